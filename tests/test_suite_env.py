"""The suite's speed settings (tests/conftest.py) reach every process it starts: pytest's workers,
the clean environments of tests/worker_env.py, and subprocesses that inherit os.environ. The
suite's measured time (BENCHMARKS.md, "The test suite") depends on them."""
import gc
import os
import subprocess
import sys

from tests.worker_env import worker_env

PROBE = ("import gc, os; print(gc.get_threshold()[0], os.environ.get('OMP_NUM_THREADS'), "
         "'xla_cpu_use_fusion_emitters=false' in os.environ.get('XLA_FLAGS', ''), "
         "os.environ.get('JAX_TRACEBACK_IN_LOCATIONS_LIMIT'))")


def test_every_process_of_the_suite_gets_its_compile_speed_settings():
    assert gc.get_threshold()[0] == 50_000 and os.environ["OMP_NUM_THREADS"] == "1"
    for env in (None, worker_env(), worker_env(devices=2)):
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == ["50000", "1", "True", "0"], (out.stdout, out.stderr[-2000:])
