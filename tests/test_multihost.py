"""Multi-host training through the CLI: two real processes on 127.0.0.1 form a JAX cluster
(jax.distributed, gloo collectives, 2 simulated CPU devices each) and train the same 5 steps,
with the same losses, as one process on one device. Each process loads only its rows of the
global batch; only process 0 writes metrics. Their checkpoint of step 3 (Orbax, sharded over
the two processes) then resumes in one process on another mesh with the same losses after it."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from train.cli import main

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


def env_with_devices(n: int) -> dict:
    return {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}


@pytest.fixture(scope="module")
def runs(setup):
    """One process on one device, and two processes with 2 devices each (mesh data=2 x fsdp=2)."""
    root = setup
    assert main(train_args(root, "one")) == 0
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "train.cli", *train_args(root, "two", "--mesh", "data=2,fsdp=2"),
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              cwd=ROOT, env=env_with_devices(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    return root, outputs


def test_two_processes_train_the_same_losses_as_one_device(runs):
    root, outputs = runs
    assert "process 0 of 2" in outputs[0] and "mesh: data=2,fsdp=2" in outputs[0], outputs[0][-2000:]
    assert "trained" not in outputs[1], "only process 0 prints the summary"
    one, two = losses(root / "one"), losses(root / "two")
    assert len(one) == len(two) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(two, one))
    assert worst < 1e-5, f"two processes {two} vs one device {one}"


def test_a_checkpoint_of_two_processes_resumes_on_another_mesh_with_the_same_losses(runs):
    root, _ = runs
    resumed = root / "resumed"
    shutil.copytree(root / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / str(STEPS))            # keep the checkpoint of step 3
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
    proc = subprocess.run([sys.executable, "-m", "train.cli", "train", "--out", str(resumed), "--resume",
                           "--mesh", "tensor=2,expert=2"], cwd=ROOT, env=env_with_devices(4),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh: tensor=2,expert=2" in proc.stdout and "resuming from" in proc.stdout
    one, again = losses(root / "one"), losses(resumed)
    assert len(again) == STEPS, "metrics continue across the resume"
    worst = max(abs(a - b) / abs(b) for a, b in zip(again[3:], one[3:]))
    assert worst < 1e-5, f"steps 4-5 resumed on tensor=2,expert=2: {again[3:]} vs one device {one[3:]}"
