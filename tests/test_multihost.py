"""Multi-host training through the CLI: two real processes on 127.0.0.1 form a JAX cluster
(jax.distributed, gloo collectives, 2 simulated CPU devices each) and train the same 5 steps,
with the same losses, as one process on one device. Each process loads only its rows of the
global batch; only process 0 writes metrics. Their checkpoint of step 3 (Orbax, sharded over
the two processes) resumes in two processes past a damaged newest checkpoint; there process 1 is
SIGKILLed while saving (a host lost mid-run): process 0 stops within the stated bound with one
line and exit 75 and leaves no partial checkpoint, and the run resumes in one process on 2 devices
(another mesh) with the same losses as the uninterrupted run."""
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from formats.checkpoint import find_checkpoint
from formats.checkpoint_integrity import SAVE_FAULT_ENV
from train.cli import main
from train.cluster.host_fault import EXIT_HOST_LOST
from train.cluster.host_supervisor import STOP_GRACE_S, newest_complete_checkpoint

from tests.worker_env import worker_env

ROOT = Path(__file__).resolve().parents[1]
LINES = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
    "HAMLET: To be, or not to be, that is the question.",
    "MACBETH: Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace.",
]
MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "n_experts": 4,
         "expert_dim": 32, "sliding_window": 8, "vocab_size": 320}
STEPS = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    texts, val = root / "texts", root / "val"
    texts.mkdir()
    val.mkdir()
    for i in range(4):       # the last play is the validation split (chosen by file: never by a path hash)
        (val if i == 3 else texts).joinpath(f"play{i}.txt").write_text(
            "\n\n".join(LINES[(i + j) % 4] for j in range(60)) + "\n")
    assert main(["prepare", "--input", str(texts), "--val-input", str(val), "--out", str(root / "data"),
                 "--tokenizer", "bpe:320"]) == 0
    config = {"model": MODEL, "eval_batches": 1, "log_every": 1, "samples": 0, "warmup_steps": 2,
              "checkpoint_every": 3}
    (root / "run.json").write_text(json.dumps(config))
    return root


def train_args(root: Path, out: str, *extra: str) -> list[str]:
    return ["train", "--config", str(root / "run.json"), "--data", str(root / "data"), "--out", str(root / out),
            "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", *extra]


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outputs_of(procs, timeout: float = 600) -> list[str]:
    """Each process's output, once all have exited 0 (any still running at the end is killed)."""
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    return outputs


def cluster_args(port: int, process: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process)]


@pytest.fixture(scope="module")
def runs(setup):
    """One process on one device, and two processes with 2 devices each (mesh data=2 x fsdp=2)."""
    root = setup
    assert main(train_args(root, "one")) == 0
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "train.cli", *train_args(root, "two", "--mesh", "data=2,fsdp=2"),
                               *cluster_args(port, i)],
                              cwd=ROOT, env=worker_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for i in range(2)]
    outputs = outputs_of(procs)
    return root, outputs


def test_two_processes_train_the_same_losses_as_one_device(runs):
    root, outputs = runs
    assert "process 0 of 2" in outputs[0] and "mesh: data=2,fsdp=2" in outputs[0], outputs[0][-2000:]
    assert "trained" not in outputs[1], "only process 0 prints the summary"
    one, two = losses(root / "one"), losses(root / "two")
    assert len(one) == len(two) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(two, one))
    assert worst < 1e-5, f"two processes {two} vs one device {one}"


HOST_TIMEOUT_S = 6      # the fault test's host_timeout_s: a survivor stops within it + STOP_GRACE_S


@pytest.fixture(scope="module")
def host_lost(runs):
    """The two-process run, its newest checkpoint (step 5) damaged, resumed by two processes that
    checkpoint every 2 steps; process 1 is SIGKILLed as its save of step 4 starts.
    Returns (run directory, [(exit code, output, exit time)] per process)."""
    root, _ = runs
    out = root / "host_lost"
    shutil.copytree(root / "two", out)
    shard = max((p for p in (out / "checkpoints" / str(STEPS)).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-8])             # truncated: fails its manifest
    port = free_port()
    logs = [(root / f"host_lost.{i}.log").open("w+") for i in range(2)]     # files: no pipe fills up and blocks
    procs = [subprocess.Popen([sys.executable, "-m", "train.cli", "train", "--out", str(out), "--resume",
                               "--checkpoint-every", "2", "--host-timeout-s", str(HOST_TIMEOUT_S), *cluster_args(port, i)],
                              cwd=ROOT, env={**worker_env(2), **({SAVE_FAULT_ENV: "4"} if i == 1 else {})},
                              stdout=logs[i], stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    ended = [None, None]
    try:
        deadline = time.monotonic() + 600
        while None in ended and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    return out, [(p.returncode, (root / f"host_lost.{i}.log").read_text(), t) for i, (p, t) in enumerate(zip(procs, ended))]


def test_a_lost_host_stops_the_survivor_within_the_bound_with_one_line(host_lost):
    out, [(code0, out0, end0), (code1, out1, end1)] = host_lost
    assert code1 == 128 + 9, f"process 1 should have been SIGKILLed in its save of step 4:\n{out1[-3000:]}"
    assert code0 == EXIT_HOST_LOST, f"process 0 exit code {code0}:\n{out0[-4000:]}"
    lines = [l for l in out0.splitlines() if "lost process" in l]
    assert len(lines) == 1, out0[-4000:]
    line = lines[0]
    assert f"lost process 1 (host {socket.gethostname()}) of 2" in line, line
    assert f"newest complete checkpoint {out / 'checkpoints' / '3'} (step 3)" in line, line
    assert f"torchlyra train --out {out} --resume" in line, line
    for raw in ("Traceback", "Check failure", "Terminating process", "coordination_service", "Aborted"):
        assert raw not in out0, f"the survivor's output shows {raw!r}:\n{out0[-4000:]}"
    assert end0 - end1 <= HOST_TIMEOUT_S + STOP_GRACE_S, f"survivor stopped {end0 - end1:.1f} s after process 1 died"


def test_no_partial_checkpoint_of_the_save_the_host_died_in_counts_as_complete(host_lost):
    out, _ = host_lost
    root = out / "checkpoints"
    assert newest_complete_checkpoint(str(out)) == root / "3"
    assert find_checkpoint(root, report=lambda line: None) == root / "3"


def test_two_processes_resume_past_a_damaged_newest_checkpoint_from_the_previous_one(runs, host_lost):
    root, _ = runs
    out, [(_, out0, _), (_, out1, _)] = host_lost
    assert f"resuming from {out / 'checkpoints' / '3'} (step 3)" in out0, out0[-3000:]
    assert "damaged" in out0 and "damaged" not in out1, "process 0 alone reports and moves the damaged step"
    moved = list((out / "checkpoints" / "damaged").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(f"step-{STEPS}-"), moved
    # Step 4 trained by both processes from step 3 (before process 1 was lost) is the uninterrupted run's.
    step4 = losses(out)[3]
    assert abs(step4 - losses(root / "one")[3]) / abs(losses(root / "one")[3]) < 1e-5


def test_after_losing_a_host_the_run_resumes_on_one_process_of_two_devices_with_the_uninterrupted_losses(runs, host_lost):
    root, _ = runs
    out, _ = host_lost
    resumed = root / "resumed_after_loss"
    shutil.copytree(out, resumed)
    proc = subprocess.run([sys.executable, "-m", "train.cli", "train", "--out", str(resumed), "--resume",
                           "--mesh", "tensor=2"], cwd=ROOT, env=worker_env(2), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh: tensor=2" in proc.stdout and f"resuming from {resumed / 'checkpoints' / '3'}" in proc.stdout
    one, again = losses(root / "one"), losses(resumed)
    assert len(again) == STEPS, "metrics continue across the resume"
    worst = max(abs(a - b) / abs(b) for a, b in zip(again[3:], one[3:]))
    assert worst < 1e-5, f"steps 4-5 on one process after the loss: {again[3:]} vs uninterrupted {one[3:]}"
