"""The machine a benchmark ran on (platform, cores, CPU model, jax backend), recorded beside every
benchmark's JSON so numbers are never read apart from where they were measured."""
from __future__ import annotations

import os
import platform
import subprocess


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "nproc": os.cpu_count()}
    try:
        info["nproc"] = int(subprocess.run(["nproc"], capture_output=True, text=True, timeout=5).stdout.strip())
    except Exception:  # noqa: BLE001
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
    except Exception:  # noqa: BLE001
        pass
    try:
        import jax
        info["jax"] = jax.__version__
        info["jax_backend"] = jax.default_backend()
    except Exception:  # noqa: BLE001
        pass
    return info
