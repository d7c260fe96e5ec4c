"""Multi-host training through the CLI: two real processes on 127.0.0.1 form a JAX cluster
(jax.distributed, gloo collectives, 2 simulated CPU devices each) and train the same 5 steps,
with the same losses, as one process on one device. Each process loads only its rows of the
global batch; only process 0 writes metrics."""
import json
import os
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
    texts = root / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"play{i}.txt").write_text("\n\n".join(LINES[(i + j) % 4] for j in range(60)) + "\n")
    assert main(["prepare", "--input", str(texts), "--out", str(root / "data"), "--vocab-size", "320",
                 "--val-fraction", "0.2"]) == 0
    config = {"model": MODEL, "eval_batches": 1, "log_every": 1, "samples": 0, "warmup_steps": 2}
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


def test_two_processes_train_the_same_losses_as_one_device(setup):
    root = setup
    assert main(train_args(root, "one")) == 0
    port = free_port()
    env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen([sys.executable, "-m", "train.cli", *train_args(root, "two", "--mesh", "data=2,fsdp=2"),
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    assert "process 0 of 2" in outputs[0] and "mesh: data=2,fsdp=2" in outputs[0], outputs[0][-2000:]
    assert "trained" not in outputs[1], "only process 0 prints the summary"
    one, two = losses(root / "one"), losses(root / "two")
    assert len(one) == len(two) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(two, one))
    assert worst < 1e-5, f"two processes {two} vs one device {one}"
