"""The production loop: exact resume (after a data error, SIGTERM, SIGKILL mid-run and mid-save),
damaged and mismatched checkpoints, skipped non-finite steps, async saves vs donated buffers,
metrics, evaluation and plots.

One micro model (1 layer, d_model 32, sequences of 32), ONE uninterrupted reference run and one
Trainer for the step-level tests are shared; so is the XLA compilation cache (runs compile from it).
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import one_line_error, prepare_play_corpus
from formats import checkpoint
from formats.checkpoint_integrity import FAULT_ENV, MANIFEST_FILE
from train.cli import main
from train.run.config import TrainConfig
from formats.errors import UserError
from train.run.loop import run_training
from train.run.trainer import Trainer, TrainingStopped

REPO = Path(__file__).resolve().parents[1]
STEPS = 60
MICRO = {"model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "n_experts": 4,
                   "expert_dim": 32, "sliding_window": 8, "vocab_size": 320},
         "batch_size": 4, "seq_len": 32, "steps": STEPS, "warmup_steps": 5, "log_every": 1, "eval_every": 30,
         "eval_batches": 1, "checkpoint_every": 10, "keep_checkpoints": 3, "samples": 0}
CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A prepared micro corpus, the run config file and a shared XLA compilation cache."""
    import jax
    from jax._src import compilation_cache

    root = tmp_path_factory.mktemp("loop")
    prepare_play_corpus(root)
    (root / "micro.json").write_text(json.dumps({**MICRO, "data": str(root / "data")}))
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(root / "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    yield root
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    compilation_cache.reset_cache()


def config(root, out, **changes) -> TrainConfig:
    return TrainConfig(**{**MICRO, "data": str(root / "data"), "out": str(out), **changes})


def train_losses(run_dir) -> dict[int, float]:
    """step -> logged loss; fails if a step was logged twice (metrics must not duplicate)."""
    records = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), f"steps logged twice: {sorted(s for s in steps if steps.count(s) > 1)}"
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def reference(root):
    """The uninterrupted run every resumed run must reproduce, bit for bit."""
    out = root / "reference"
    summary = run_training(config(root, out, tensorboard=True, profile_steps="20:22"), show_progress=False)
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1)) and summary["steps"] == STEPS
    return out, losses


def assert_continues_reference(run_dir, reference, first_step):
    losses, expected = train_losses(run_dir), reference[1]
    assert sorted(losses) == list(range(1, STEPS + 1))
    mismatched = [s for s in range(first_step, STEPS + 1) if losses[s] != expected[s]]
    assert not mismatched, f"losses differ from the uninterrupted run at steps {mismatched[:5]}: " \
                           f"{[(losses[s], expected[s]) for s in mismatched[:3]]}"


def subprocess_env(root, **extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(root / "xla_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **extra}
    return env


def start_training(root, out, **env):
    return subprocess.Popen([sys.executable, "-m", "train.cli", "train", "--config", str(root / "micro.json"),
                             "--out", str(out)], cwd=REPO, env=subprocess_env(root, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(proc, run_dir, step, timeout=300):
    """Poll metrics.jsonl until a train record of `step` or later appears."""
    metrics, deadline = Path(run_dir) / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"training ended early (rc {proc.returncode}):\n{proc.stdout.read()[-3000:]}"
        if metrics.exists() and any(f'"kind": "train", "step": {s},' in metrics.read_text() for s in range(step, STEPS)):
            return
        time.sleep(0.005)
    raise AssertionError(f"no step {step} logged within {timeout} s")


# ---- exact resume ---------------------------------------------------------------------------
def test_reference_run_writes_checkpoints_metrics_plots_and_tensorboard(reference):
    out, _ = reference
    assert [s for s, _ in checkpoint.step_dirs(out / "checkpoints")] == [40, 50, 60]      # keep_checkpoints=3
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    last = train[-1]
    for key in ("loss", "ce", "router_balance", "router_z", "lr_muon", "lr_adamw", "grad_norm", "grad_norm_clipped",
                "step_time_s", "tokens_per_s", "mfu", "skipped", "skipped_total"):
        assert last.get(key) is not None, key
    assert last["lr_muon"] / last["lr_adamw"] == pytest.approx(0.02 / 3e-3)
    assert last["grad_norm_clipped"] <= min(last["grad_norm"], 1.0) + 1e-6
    assert train[0]["tokens_per_s"] is not None and 0 < last["mfu"] < 1
    # the first step's rate is of that step's run (timed from its dispatch, not after it ran)
    assert train[0]["tokens_per_s"] < 5 * float(np.median([r["tokens_per_s"] for r in train[1:]]))
    assert len(last["expert_load"]["cv"]) == 1 and len(last["expert_fraction"][0]) == 4
    assert sum(last["expert_fraction"][0]) == pytest.approx(1.0)
    assert last["router_z_per_layer"] == [pytest.approx(last["router_z"], rel=1e-5)]      # one MoE layer
    assert last["router_balance_per_layer"] == [pytest.approx(last["router_balance"], rel=1e-5)]
    # records in step order, each evaluation after its step's train record (written late: queue_log)
    assert [(r["kind"], r["step"]) for r in records if r["kind"] in ("train", "eval")] == \
        [("eval", 0)] + [(kind, s) for s in range(1, STEPS + 1) for kind in ("train", "eval")[:1 + (s % 30 == 0)]]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 30, 60] and 0 < evals[-1]["val_bpb"] < evals[0]["val_bpb"]
    saves = [r for r in records if r["kind"] == "checkpoint"]
    assert [r["step"] for r in saves] == [10, 20, 30, 40, 50, 60] and all(r["bytes"] > 0 for r in saves)
    assert {p.name for p in (out / "plots").iterdir()} >= {"loss.png", "lr.png", "grad_norm.png", "throughput.png",
                                                           "expert_load.png"}
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    # --profile-steps 20:22: one jax.profiler trace (the resumed runs below reproduce this run's
    # losses without it: tracing changes nothing)
    [traced] = [r for r in records if r["kind"] == "profile"]
    assert traced["step"] == 22 and traced["steps"] == [20, 22] and traced["files"]
    assert all((out / "profile" / f).stat().st_size > 0 for f in traced["files"])
    # ... beside it the step's HLO, the very executable the steps ran (no second compile), and
    # the summary (train/run/profile_summary.py): every traced op found in that HLO, the
    # categories adding up to the measured op time; on the CPU no roofline.
    program = json.loads((out / "profile" / "step.json").read_text())
    assert program["module"] == "jit__step" and "no second compile" in program["compiled"]
    assert traced["summary"] == str(out / "profile" / "summary.json")
    profiled = json.loads((out / "profile" / "summary.json").read_text())
    assert (profiled["platform"], profiled["runs"], profiled["steps"]) == ("cpu", 3, [20, 22])
    assert profiled["unmatched"]["instructions"] == 0 and profiled["per_step_ms"]["ops"] > 0
    assert sum(r["measured_ms"] for r in profiled["rows"]) == pytest.approx(profiled["per_step_ms"]["ops"])
    assert {"matmul (XLA)", "optimizer: Newton-Schulz", "optimizer: other"} <= {r["row"] for r in profiled["rows"]}
    assert "none" in profiled["prediction"] and all(r["predicted_ms"] is None for r in profiled["rows"])
    assert main(["profile", str(out)]) == 0        # `torchlyra profile RUN` reads it again


def test_the_trace_starts_once_the_steps_before_it_are_done(tmp_path, monkeypatch):
    """With metrics fetched a step late, step A-1 may still run when step A is about to be traced:
    its tail in the trace made a third, partial run of steps 10-11 on a v5e chip (2026-12-06)."""
    import jax

    from train.run.profiling import StepProfiler

    calls = []
    monkeypatch.setattr(jax, "block_until_ready", lambda tree: calls.append(("wait", tree)))
    monkeypatch.setattr(jax.profiler, "start_trace", lambda directory: calls.append(("trace", directory)))
    profiler = StepProfiler("3:4", tmp_path, 10)
    profiler.before(2, "state after 1")
    profiler.before(3, "state after 2")
    profiler.before(4, "state after 3")                    # inside the trace: no wait
    assert calls == [("wait", "state after 2"), ("trace", str(tmp_path))]
    profiler.active = False                                # (nothing was traced: no stop_trace)


@pytest.mark.parametrize("spec", ["3", "5:2", "0:4", "50:70"])
def test_profile_steps_out_of_range_are_one_line_errors(root, spec):
    with pytest.raises(UserError, match="profile_steps"):
        config(root, root / "never", profile_steps=spec)


def test_resume_after_a_data_error_is_bit_exact(root, reference, monkeypatch):
    from train.data.loader import TokenLoader

    out, real_next = root / "data_error", TokenLoader.next_batch
    calls = {"n": 0}

    def failing(self):
        calls["n"] += 1
        if calls["n"] == 25:
            raise UserError("train-00000.array_record: damaged record (test)")
        return real_next(self)

    monkeypatch.setattr(TokenLoader, "next_batch", failing)
    with pytest.raises(TrainingStopped, match=r"damaged record \(test\); checkpoint of step 24 in .*--resume"):
        run_training(config(root, out), show_progress=False)
    monkeypatch.undo()
    assert checkpoint.step_dirs(out / "checkpoints")[-1][0] == 24
    # The end of a run without samples generates nothing.
    monkeypatch.setattr(Trainer, "_samples", lambda self: pytest.fail("samples generated with --samples 0"))
    run_training(config(root, out, resume=True), explicit={"resume": True}, show_progress=False)
    assert_continues_reference(out, reference, first_step=1)


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(root, reference):
    out = root / "sigterm"
    proc = start_training(root, out)
    wait_for_step(proc, out, 12)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout[-3000:]
    assert f"continue with: torchlyra train --out {out} --resume" in stdout
    stopped = checkpoint.step_dirs(out / "checkpoints")[-1][0]
    assert 12 <= stopped < STEPS and f"SIGTERM: stopped after step {stopped}" in stdout
    checkpoint.verify_manifest(out / "checkpoints" / str(stopped))
    run_training(config(root, out, resume=True), explicit={"resume": True}, show_progress=False)
    assert_continues_reference(out, reference, first_step=stopped + 1)


def test_sigkill_mid_run_resumes_from_the_newest_checkpoint_exactly(root, reference):
    out = root / "sigkill"
    proc = start_training(root, out)
    wait_for_step(proc, out, 33)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    newest = checkpoint.find_checkpoint(out / "checkpoints")     # 30 unless its write was still running
    assert int(newest.name) in (20, 30)
    run_training(config(root, out, resume=True), explicit={"resume": True}, show_progress=False)
    assert_continues_reference(out, reference, first_step=int(newest.name) + 1)


def test_killed_during_a_save_resumes_from_the_previous_checkpoint(root, reference):
    out = root / "killed_saving"
    # The first checkpoint (step 10) completes; the process dies inside the second save (step 20)
    # once its first file is on disk, which is before Orbax renames it into place.
    proc = start_training(root, out, **{FAULT_ENV: "1@2"})
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stdout[-3000:]
    leftovers = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert leftovers == ["10", "20.orbax-checkpoint-tmp"], leftovers
    run_training(config(root, out, resume=True), explicit={"resume": True}, show_progress=False)
    assert_continues_reference(out, reference, first_step=11)


# ---- resume rules ---------------------------------------------------------------------------
def test_resume_of_a_finished_run_says_so_and_a_larger_steps_extends_it(root, reference, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert "already reached step 60" in capsys.readouterr().out
    assert "batch_size is 3 here but 4" in one_line_error(capsys, ["train", "--out", str(run), "--resume", "--batch-size", "3"])
    assert "already holds a run" in one_line_error(capsys, ["train", "--config", str(root / "micro.json"), "--out", str(run)])
    run_training(config(root, run, resume=True, steps=64), explicit={"resume": True, "steps": 64}, show_progress=False)
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 65)) and all(losses[s] == reference[1][s] for s in range(1, 61))
    # A step written before the optimizer state had an item of its own (inside state/) resumes alike.
    legacy = tmp_path / "legacy"
    shutil.copytree(reference[0], legacy)
    _one_state_item(legacy / "checkpoints" / "60")
    run_training(config(root, legacy, resume=True, steps=64), explicit={"resume": True, "steps": 64},
                 show_progress=False)
    assert train_losses(legacy) == losses


def _one_state_item(step_dir: Path) -> None:
    """Rewrite a step as steps were written before: weights and optimizer state in one state/ item."""
    import orbax.checkpoint as ocp

    from formats.checkpoint_integrity import write_manifest

    checkpointer = ocp.PyTreeCheckpointer()
    whole = {**checkpointer.restore(step_dir / "state"), **checkpointer.restore(step_dir / "optimizer")}
    shutil.rmtree(step_dir / "state")
    shutil.rmtree(step_dir / "optimizer")
    checkpointer.save(step_dir / "state", whole)
    write_manifest(step_dir)


# ---- damaged and mismatched checkpoints -------------------------------------------------------
def _biggest_file(step_dir: Path, item: str = "state") -> Path:
    return max((p for p in (step_dir / item).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_damaged_newest_checkpoint_is_reported_moved_aside_and_skipped(reference, tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(reference[0] / "checkpoints", ckpts)
    data = bytearray(_biggest_file(ckpts / "60").read_bytes())
    data[len(data) // 2] ^= 0xFF                                  # one flipped byte
    _biggest_file(ckpts / "60").write_bytes(bytes(data))
    lines = []
    # A reader (generate, export, eval) reports and falls back without touching the run.
    assert checkpoint.find_checkpoint(tmp_path / "run", report=lines.append) == ckpts / "50"
    assert (ckpts / "60").is_dir() and len(lines) == 1 and "60 is damaged: file state/" in lines[0]
    # The run's owner (--resume) moves it aside, so step 60 can be saved again.
    assert checkpoint.find_checkpoint(ckpts, move_damaged=True, report=lines.append) == ckpts / "50"
    assert not (ckpts / "60").exists() and "moved to" in lines[-1]
    assert [p.name.startswith("step-60-") for p in (ckpts / "damaged").iterdir()] == [True]
    # A truncated file and a missing manifest (killed after Orbax's rename) are caught too.
    big = _biggest_file(ckpts / "50")
    big.write_bytes(big.read_bytes()[:-7])
    (ckpts / "40" / MANIFEST_FILE).unlink()
    with pytest.raises(UserError, match=r"no complete checkpoint \(checkpoint .*50 is damaged: file state/.* has "
                                        r"\d+ bytes, expected \d+; 1 older ones too\)\. Restore .* or start a new run"):
        checkpoint.find_checkpoint(ckpts, report=lines.append)
    assert "40 is incomplete (no torchlyra_manifest.json" in lines[-1]


def test_a_reader_hashes_the_weights_alone_and_a_resume_the_optimizer_state_too(reference, tmp_path):
    """A reader of the weights (generate, eval, export, --init-from) neither reads nor hashes the
    optimizer state's files (their presence and sizes are checked), and hashes the weights' once
    however often it opens the step; --resume, which reads them, finds one damaged there and takes
    the previous step."""
    from formats.checkpoint_integrity import HASHING

    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(reference[0] / "checkpoints", ckpts)
    step = ckpts / "60"
    damaged = _biggest_file(step, "optimizer")
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    weights = sum(p.stat().st_size for p in step.rglob("*") if p.is_file() and p.name != MANIFEST_FILE
                  and p.relative_to(step).parts[0] != "optimizer")
    before = HASHING["bytes"]
    state, _, _ = checkpoint.load_checkpoint(tmp_path / "run")
    checkpoint.find_checkpoint(tmp_path / "run")        # opened again by the same command: hashed once
    assert HASHING["bytes"] - before == weights and state
    lines = []
    assert checkpoint.find_checkpoint(ckpts, resume=True, report=lines.append) == ckpts / "50"
    assert len(lines) == 1 and "60 is damaged: file optimizer/" in lines[0], lines


def test_a_checkpoint_of_another_model_shape_is_refused_naming_the_tensors(root, reference, capsys):
    import jax
    from jax.sharding import SingleDeviceSharding

    step_dir = reference[0] / "checkpoints" / "60"
    cpu = SingleDeviceSharding(jax.devices()[0])
    target = {}
    for path, (shape, dtype) in checkpoint.stored_shapes(step_dir).items():
        if path[-1] == "lm_head.weight":
            shape = (shape[0], 48)                                       # another d_model
        node = target
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jax.ShapeDtypeStruct(shape, dtype, sharding=cpu)
    layout = checkpoint.read_meta(step_dir)[0]["layout"]
    with pytest.raises(UserError) as refused:
        checkpoint.restore_train_state(step_dir, target, layout=layout)
    for name in ("params/lm_head.weight", "opt_state/exp_avg/lm_head.weight", "opt_state/exp_avg_sq/lm_head.weight"):
        assert f"{name} has shape [320, 32], expected [320, 48]" in str(refused.value)
    wider = json.loads((root / "micro.json").read_text())
    wider["model"]["d_model"] = 48
    (root / "wider.json").write_text(json.dumps(wider))
    err = one_line_error(capsys, ["train", "--config", str(root / "wider.json"), "--out", str(root / "other"),
                          "--init-from", str(step_dir)])
    assert "tensor model.embed_tokens.weight has shape [320, 32], expected [320, 48]" in err


# ---- stability and async saves (on one shared Trainer) ------------------------------------------
@pytest.fixture(scope="module")
def trainer(root):
    from train.run.trainer import Trainer

    trainer = Trainer(config(root, root / "unit"), show_progress=False)
    yield trainer
    trainer.close()


def _poison(trainer):
    """Put a NaN into the final norm's weight (every loss becomes NaN); returns the good value."""
    good = trainer.state.params["model.norm.weight"]
    trainer.state = trainer.state._replace(params={**trainer.state.params,
                                                   "model.norm.weight": good.at[0].set(np.nan)})
    return np.asarray(good)


def _heal(trainer, good):
    trainer.state = trainer.state._replace(params={**trainer.state.params, "model.norm.weight": good})


def test_nonfinite_step_is_skipped_inside_the_step_and_counted(trainer):
    """The compiled step leaves parameters and the whole optimizer state (its step count too) as
    they were and reports the skip; with the parameter healed, the next step updates again."""
    import jax

    trainer.train_step(trainer.next_batch())
    trainer.log(trainer.train_step(trainer.next_batch()))
    counters, steps_done = dict(trainer.counters), float(trainer.state.opt_state["step"])
    good = _poison(trainer)
    before = jax.tree.map(np.array, trainer.state)
    metrics = trainer.train_step(trainer.next_batch())
    after = jax.tree.map(np.array, trainer.state)
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    unchanged = jax.tree.map(lambda a, b: np.array_equal(a, b, equal_nan=True), before, after)
    assert all(jax.tree.leaves(unchanged)) and float(after.opt_state["step"]) == steps_done
    _heal(trainer, good)
    metrics = trainer.train_step(trainer.next_batch())
    assert int(metrics["skipped"]) == 0 and float(trainer.state.opt_state["step"]) == steps_done + 1
    trainer.log(metrics)
    assert trainer.counters == {"skipped_total": counters["skipped_total"] + 1, "consecutive_skips": 0,
                                "last_good_step": trainer.done}


def test_consecutive_nonfinite_steps_stop_the_run_with_a_checkpoint(trainer):
    last_good, cfg = trainer.done, trainer.cfg
    trainer.cfg = cfg.replace(max_consecutive_skips=3)
    good = _poison(trainer)
    try:
        with pytest.raises(TrainingStopped, match=rf"3 consecutive steps up to step {last_good + 3} had a non-finite "
                                                  rf"loss or gradient norm .*checkpoint of step {last_good + 3} in .* "
                                                  rf"holds the parameters of step {last_good}, the last good update"):
            for _ in range(5):
                trainer.log(trainer.train_step(trainer.next_batch()))
        meta, _ = checkpoint.read_meta(trainer.checkpoints.root / str(last_good + 3))
        assert meta["counters"]["consecutive_skips"] == 3
    finally:
        trainer.cfg = cfg
        _heal(trainer, good)
        trainer.counters["consecutive_skips"] = 0


def test_async_save_is_not_mutated_by_the_next_steps_donated_buffers(trainer):
    import jax

    trainer.train_step(trainer.next_batch())
    expected = jax.tree.map(np.array, trainer.state._asdict())       # host copies
    trainer.save()                                                    # returns before the write ends
    for _ in range(3):                                                # each step donates the state buffers
        trainer.train_step(trainer.next_batch())
    trainer.checkpoints.wait()
    restored = checkpoint.restore_train_state(trainer.checkpoints.root / str(trainer.done - 3),
                                              trainer.state._asdict(), layout=trainer.step.layout)
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), restored, expected)
    assert all(jax.tree.leaves(same))
    moved = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), trainer.state.params, expected["params"])
    assert not all(jax.tree.leaves(moved))                            # the live state did move on


def test_a_log_steps_metrics_are_fetched_once_the_next_step_is_queued_behind_it(trainer, monkeypatch):
    """The loop's queue_log / write_pending_log: fetching a log step's metrics at once would idle
    the device for the host's turn every log step (6.7 ms of a 260 ms step on the chip)."""
    import jax

    fetched, device_get = [], jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda tree: fetched.append(trainer.done) or device_get(tree))
    trainer.queue_log(trainer.train_step(trainer.next_batch()))
    logged = trainer.done
    assert fetched == []                                  # nothing waited for the step
    trainer.train_step(trainer.next_batch())
    trainer.write_pending_log()
    assert fetched == [logged + 1]                        # fetched with the next step dispatched
    last = [r for r in map(json.loads, (trainer.out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"][-1]
    assert (last["kind"], last["step"]) == ("train", logged) and last["step_time_s"] > 0
    trainer.queue_log(trainer.train_step(trainer.next_batch()))
    trainer.save(wait=True)                               # a checkpoint writes the kept record first
    assert fetched[-1] == trainer.done and trainer._pending_log is None


# ---- evaluation and plots -----------------------------------------------------------------------
def test_eval_command_reproduces_the_runs_validation_and_writes_json(reference, tmp_path, capsys):
    out, _ = reference
    assert main(["eval", "--checkpoint", str(out), "--json", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    last = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"kind": "eval"' in l][-1]
    assert result["step"] == 60 and result["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert result["val_bpb"] == pytest.approx(last["val_bpb"], rel=1e-6)
    assert "bits per byte" in capsys.readouterr().out
    assert main(["plot", str(out)]) == 0 and (out / "plots" / "expert_load.png").stat().st_size > 1000


def test_bits_per_byte_count_the_bytes_of_the_text():
    from train.evaluation.validation import token_byte_lengths
    from formats.tokenizer import train_bpe

    enc = train_bpe(["héllo wörld, hello there\n"] * 20, 300)
    lengths = token_byte_lengths(enc, 320)
    text = "héllo wörld"
    ids = enc.encode_ordinary(text)
    assert lengths[ids].sum() == len(text.encode()) and lengths[enc.encode_single_token("<|bos|>")] == 0
    assert lengths[enc.n_vocab:].sum() == 0


# ---- FLOPs -------------------------------------------------------------------------------------
def test_flops_per_token_of_tiny_matches_a_hand_count():
    from torch_model.config import get_preset
    from train.run import flops

    # tiny: V 4096, d 256, 4 layers (sliding 64, full, sliding, full), 4 heads / 2 kv of 64, 8 experts
    # top-2 of width 256; sequence 256.
    q_o = 2 * 256 * 256                     # q and o projections
    k_v = 2 * 256 * 128                     # k and v (2 kv heads x 64)
    router = 256 * 8
    experts = 2 * (256 * 512 + 256 * 256)   # 2 active experts: gate_up [256, 512], down [256, 256]
    matmul = 4 * (q_o + k_v + router + experts) + 4096 * 256     # + LM head
    assert matmul == 3_416_064
    full = (256 + 1) / 2                                          # causal: 128.5 keys on average
    sliding = (64 * 65 / 2 + (256 - 64) * 64) / 256               # 56.125
    attention = 12 * 4 * 64 * (2 * full + 2 * sliding)
    assert flops.flops_per_token(get_preset("tiny"), 256) == 6 * matmul + attention == 21_630_720
    assert flops.mean_attended(10, 0) == 5.5 and flops.mean_attended(10, 20) == 5.5
    assert flops.mfu(1000.0, get_preset("tiny"), 256, 21_630_720 * 1000) == 1.0
    assert flops.published_peak("TPU v6 lite", "bfloat16") == (918e12, "published bfloat16 peak of TPU v6 lite")
    assert flops.published_peak("NVIDIA H100 80GB HBM3", "float32")[0] == 67e12
    assert flops.published_peak("Some CPU", "float32") is None


# ---- Muon's Newton-Schulz dtype: a run setting ------------------------------------------------
def test_ns_dtype_is_a_run_setting_from_flag_or_file_kept_in_the_checkpoint_and_checked_on_resume(
        root, reference, tmp_path, capsys):
    from formats.checkpoint import find_checkpoint, read_meta
    from train.run.config import TrainConfig
    from train.run.loop import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert TrainConfig().ns_dtype == "float32"
    cfg, explicit = config_from_args(parser.parse_args(["--ns-dtype", "bfloat16"]))
    assert cfg.ns_dtype == "bfloat16" and explicit["ns_dtype"] == "bfloat16"
    (tmp_path / "run.json").write_text(json.dumps({"ns_dtype": "bfloat16"}))
    assert config_from_args(parser.parse_args(["--config", str(tmp_path / "run.json")]))[0].ns_dtype == "bfloat16"
    with pytest.raises(UserError, match="ns_dtype must be float32 or bfloat16, found 'float16'"):
        TrainConfig(ns_dtype="float16")
    from train.run.trainer import Trainer

    trainer = Trainer(config(root, tmp_path / "bf16", ns_dtype="bfloat16"), None, None, show_progress=False)
    try:
        assert trainer.step.opt_cfg.ns_dtype == "bfloat16"     # what the compiled update runs in
    finally:
        trainer.close()
    # the reference run trained with the default: its checkpoint says so, and a resume may not change it
    meta, _ = read_meta(find_checkpoint(reference[0]))
    assert meta["train_config"]["ns_dtype"] == "float32"
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    assert "ns_dtype is 'bfloat16' here but 'float32'" in one_line_error(
        capsys, ["train", "--out", str(run), "--resume", "--steps", "61", "--ns-dtype", "bfloat16"])
