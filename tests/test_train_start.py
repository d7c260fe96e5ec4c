"""A training run's start: where it goes (one line, and a "startup" record in metrics.jsonl), and
the persistent compilation cache `--compile-cache` keeps for train as for generate: a second process
of the same run loads its programs (compiles none), a changed kernel option compiles its programs
again, and a cache that cannot be made, or entries that cannot be read, are said in one line while
the run goes on."""
import json
import subprocess
import sys

import pytest

from helpers import prepare_play_corpus
from tests.worker_env import ROOT, worker_env

# One MoE layer of `tiny`, narrow: a step of its own programs, compiled in a few seconds.
MODEL = {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "n_experts": 4,
         "experts_per_token": 2, "expert_dim": 32, "vocab_size": 320}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_start")
    data = prepare_play_corpus(root)
    config = root / "run.json"
    config.write_text(json.dumps({"model": MODEL, "data": data, "steps": 2, "batch_size": 2, "seq_len": 32,
                                  "samples": 0, "eval_every": 2, "eval_batches": 1, "kernels": "moe=xla"}))
    return root, config


def train(setup, out: str, *extra, cache: str = "cache") -> tuple[dict, str]:
    """A run in a process of its own (the suite's own cache left out of it): its startup record and
    what it printed."""
    root, config = setup
    env = {k: v for k, v in worker_env().items() if not k.startswith("JAX_COMPILATION_CACHE")}
    proc = subprocess.run([sys.executable, "-m", "train.cli", "train", "--config", str(config), "--out", str(root / out),
                           "--compile-cache", str(root / cache), *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (root / out / "metrics.jsonl").read_text().splitlines()]
    (start,) = [r for r in records if r["kind"] == "startup"]
    return start, proc.stderr + proc.stdout


def test_a_second_process_loads_the_steps_programs_and_says_where_the_start_went(setup):
    first, _ = train(setup, "first")
    assert first["programs_compiled"] > 0 and first["programs_loaded"] == 0
    for phase in ("imports_s", "starting_the_devices_s", "model_s", "parameters_s", "first_evaluation_s",
                  "first_step_s", "compile_s", "trace_s", "hashing_s"):
        assert first[phase] >= 0, phase
    assert first["total_s"] >= first["first_step_s"] + first["imports_s"]
    second, output = train(setup, "second")
    assert second["programs_compiled"] == 0 and second["programs_loaded"] == first["programs_compiled"]
    assert second["compile_s"] < first["compile_s"]
    (start_line,) = [line for line in output.splitlines() if "imports" in line and "first step" in line]
    assert f"{second['programs_loaded']} programs loaded, 0 compiled" in start_line


def test_a_changed_kernel_option_or_a_damaged_entry_compiles_again(setup):
    """Run after the cache holds the first test's programs (or its own first run's)."""
    cache = setup[0] / "cache"
    if not cache.is_dir() or not any(cache.iterdir()):
        train(setup, "warm")
    changed, _ = train(setup, "changed", "--kernel-options", "moe.xla.block_m=16")
    assert changed["programs_compiled"] > 0
    for entry in cache.iterdir():
        entry.write_bytes(b"damaged")
    damaged, output = train(setup, "damaged")
    assert damaged["programs_loaded"] == 0 and damaged["programs_compiled"] > 0
    assert sum("could not be read" in line for line in output.splitlines()) == 1, output[-2000:]
    assert "Traceback" not in output and "UserWarning" not in output


def test_a_cache_that_cannot_be_made_is_said_in_one_line_and_the_command_runs_uncached(tmp_path, capsys, monkeypatch):
    """What `train --compile-cache` calls first (this process already has the suite's cache: a
    process without one is what `enable` sees here)."""
    import jax

    from jax_bridge import compile_cache

    monkeypatch.setattr(compile_cache, "_said", set())
    (tmp_path / "not_a_dir").write_text("a file where the cache would be")
    suites = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert compile_cache.enable(tmp_path / "not_a_dir" / "cache") is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", suites)
    err = capsys.readouterr()
    lines = (err.out + err.err).strip().splitlines()
    assert len(lines) == 1 and "cannot be made" in lines[0], lines


def test_modules_compiled_from_source_in_every_start_are_counted_and_named(monkeypatch, tmp_path):
    """A Python that writes no bytecode (PYTHONDONTWRITEBYTECODE) over modules with none cached
    compiles them again in every process: the start line says so, with the remedy; elsewhere the
    count is 0 and the line says nothing."""
    import importlib.machinery
    import types

    from train import startup

    module = types.ModuleType("never_cached")
    module.__spec__ = importlib.machinery.ModuleSpec("never_cached", None, origin=str(tmp_path / "never_cached.py"))
    module.__spec__.cached = str(tmp_path / "__pycache__" / "never_cached.cpython-311.pyc")
    monkeypatch.setitem(sys.modules, "never_cached", module)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert startup.modules_without_bytecode() == 0 and "compiled from source" not in startup.Startup().line()
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    count = startup.modules_without_bytecode()
    assert count >= 1
    assert f"; {count} modules compiled from source, as in every start: this Python writes no bytecode" in \
        startup.Startup().line()
