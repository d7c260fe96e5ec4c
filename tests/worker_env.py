"""The environment of a test's worker process started clean (no variables of the test process
but these): the suite's XLA options, persistent compilation cache and threads (tests/conftest.py), CPU
only, and `devices` simulated CPU devices when given."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Its sitecustomize sets the suite's garbage-collector thresholds in every process (tests/conftest.py).
STARTUP = ROOT / "tests" / "startup"
PYTHONPATH = f"{ROOT}{os.pathsep}{STARTUP}"
SHARED = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
          "JAX_COMPILATION_CACHE_MAX_SIZE", "JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "OMP_NUM_THREADS")


def worker_env(devices: int | None = None) -> dict[str, str]:
    env = {"PYTHONPATH": PYTHONPATH, "JAX_PLATFORMS": "cpu", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           **{k: os.environ[k] for k in SHARED if k in os.environ}}
    if devices is not None:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return env
