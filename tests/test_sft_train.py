"""`torchlyra train` on chat data end to end: packed conversations, weighted loss,
accumulation, the packing report, metrics of trained tokens, validation on held-out
conversations, `--document-masking` refusals, then `generate --chat` on the result."""
import json

import pytest

from test_chat_data import chat_data  # noqa: F401  (the module-scoped chat data fixture)
from train.cli import main

MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "n_experts": 2,
         "expert_dim": 32, "sliding_window": 8}


def test_sft_run_trains_on_weighted_tokens_and_talks(chat_data, tmp_path, capsys):  # noqa: F811
    data = chat_data[0]
    (tmp_path / "run.json").write_text(json.dumps({"model": MODEL, "eval_batches": 1, "samples": 0}))
    out = tmp_path / "sft"
    assert main(["train", "--config", str(tmp_path / "run.json"), "--data", str(data), "--out", str(out),
                 "--steps", "2", "--batch-size", "2", "--micro-batches", "2", "--seq-len", "96",
                 "--log-every", "1", "--eval-every", "2"]) == 0
    printed = capsys.readouterr().out
    assert "packing: conversations into" in printed and "efficiency" in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    packing = next(r for r in records if r["kind"] == "packing")
    assert 0 < packing["efficiency"] <= 1 and packing["rows"] > 0
    train = [r for r in records if r["kind"] == "train"]
    assert all(0 < r["trained_tokens"] <= 4 * 96 and 0 < r["trained_share"] < 1 for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[-1]["val_trained_tokens"] > 0 and evals[-1]["val_bpb"] > 0
    assert evals[-1]["val_trained_tokens"] < evals[-1]["val_tokens"]          # prompts are not scored
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(out), "--chat", "--prompt", "hello", "--max-tokens", "3",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_packed_runs_refuse_attention_without_segment_ids(chat_data, tmp_path, capsys):  # noqa: F811
    from jax_bridge import registry
    from pallas_kernels.attention import attention_reference

    def plain(q, k, v, sinks, *, sliding_window, scale):
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)

    registry.register_implementation("attention", "no_segments", plain, contract_version=1)
    try:
        (tmp_path / "run.json").write_text(json.dumps({"model": MODEL}))
        assert main(["train", "--config", str(tmp_path / "run.json"), "--data", str(chat_data[0]), "--out",
                     str(tmp_path / "x"), "--steps", "1", "--seq-len", "96", "--kernels", "attention=no_segments"]) == 2
        assert "attention=no_segments cannot run segment-masked (packed) batches" in capsys.readouterr().err
    finally:
        registry.unregister_implementation("attention", "no_segments")
