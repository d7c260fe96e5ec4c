"""End to end through the CLI: prepare a small corpus, train briefly, generate, and bad input."""
import json
import re

import pytest

from helpers import one_line_error, prepare_play_corpus
from train.cli import main

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    prepare_play_corpus(root)
    config = {"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                        "n_experts": 4, "expert_dim": 64, "sliding_window": 16, "vocab_size": 320},
              "eval_every": 20, "eval_batches": 2, "log_every": 5, "samples": 1, "sample_tokens": 20}
    (root / "run.json").write_text(json.dumps(config))
    assert main(["train", "--config", str(root / "run.json"), "--data", str(root / "data"), "--out",
                 str(root / "run"), "--steps", "40", "--batch-size", "4", "--seq-len", "64", "--lr", "0.02",
                 "--adam-lr", "0.01"]) == 0
    return root


def test_short_training_run_lowers_validation_loss_and_writes_artifacts(run_dir):
    summary = json.loads((run_dir / "run" / "summary.json").read_text())
    assert summary["val_loss_end"] < summary["val_loss_start"] - 1.0
    assert summary["trace_count"] == summary["compile_count"] == 1
    assert summary["kernel_tiles"] == {"tables": [], "untuned": []}      # no tuned tiles on CPU
    records = [json.loads(l) for l in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"run", "train", "eval"} <= kinds
    assert records[0]["kernels"] == {"attention": "xla", "cross_entropy": "xla", "moe": "loop"}   # CPU auto
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(k in train[-1] for k in ("tokens_per_s", "grad_norm", "lr_scale", "expert_load_max"))
    png = run_dir / "run" / "plots" / "loss.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert summary["samples"] and summary["samples"][0]["text"].startswith("ROMEO:")


def test_generate_from_the_checkpoint(run_dir, capsys):
    from formats.checkpoint import find_checkpoint, read_meta

    ckpt = run_dir / "run"                      # a run directory names its newest complete checkpoint
    meta, _ = read_meta(find_checkpoint(ckpt))
    assert meta["kernels"]["attention"] == "xla" and meta["step"] == 40
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "JULIET:", "--max-tokens", "12",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "JULIET:" in out and len(out.split("JULIET:")[-1].strip()) > 0
    # A batch prints each result at the end; the streamed single prompt above printed the same text.
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "JULIET:", "--prompt", "HAMLET: To be",
                 "--max-tokens", "12", "--temperature", "0", "--timings"]) == 0
    batch = capsys.readouterr()
    assert batch.out.split("--- prompt: 'HAMLET: To be'")[0].strip() == out.strip()
    assert "compile:" in batch.err and "tokens/s" in batch.err
    assert re.search(r"stored bytes onto its devices in \d+\.\d s\n", batch.err)
    assert re.search(r"^load \d+\.\d s; bucket batch=2 ", batch.err, re.M)       # --timings: the load first
    assert re.search(r"^start \d+\.\d s: imports \d+\.\d s, starting the devices \d+\.\d s, opening the checkpoint ",
                     batch.err, re.M)


def test_bad_input_is_one_line_naming_the_problem(run_dir, tmp_path, capsys):
    data = str(run_dir / "data")
    assert "unknown preset 'huge'" in one_line_error(capsys, ["train", "--preset", "huge", "--data", data])
    assert "steps must be a positive integer" in one_line_error(capsys, ["train", "--steps", "0", "--data", data])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"n_heads": 3}}))
    assert "n_heads" in one_line_error(capsys, ["train", "--config", str(bad), "--data", data, "--out", str(tmp_path / "o")])
    bad.write_text(json.dumps({"stepz": 3}))
    assert "stepz" in one_line_error(capsys, ["train", "--config", str(bad), "--data", data, "--out", str(tmp_path / "o")])
    (tmp_path / "empty").mkdir()
    assert "empty" in one_line_error(capsys, ["train", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    assert "foreign" in one_line_error(capsys, ["train", "--data", str(foreign), "--out", str(tmp_path / "o")])
    assert "missing" in one_line_error(capsys, ["generate", "--checkpoint", str(tmp_path / "missing")])
    ckpt = str(run_dir / "run")
    # (bpe:N models carry harmony's chat tokens, so --chat works on them: tests/test_chat.py checks the refusal.)
    assert "need --chat" in one_line_error(capsys, ["generate", "--checkpoint", ckpt, "--system", "x", "--prompt", "hi"])
    assert "top_p" in one_line_error(capsys, ["generate", "--checkpoint", ckpt, "--top-p", "1.5"])
    assert "nowhere" in one_line_error(capsys, ["prepare", "--input", str(tmp_path / "nowhere"), "--out", str(tmp_path / "d")])
    assert "attention=nope" in one_line_error(capsys, ["train", "--kernels", "attention=nope", "--data", data,
                                               "--out", str(tmp_path / "o")])
