"""LoRA and --freeze runs through the trainer: checkpoints hold the adapters, their optimizer state
and a verified reference to the base (never the base), resume is exact, `load_lora_model` rebuilds
the adapted model, and bad flags are one line with exit 2. One micro model, as test_training_loop."""
import json
import shutil

import numpy as np
import pytest
import torch

from helpers import prepare_play_corpus
from formats import checkpoint
from train.cli import main
from train.run.config import TrainConfig
from formats.errors import UserError
from formats.lora_checkpoint import load_lora_model
from train.run.loop import run_training

MICRO = {"model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "n_experts": 4,
                   "expert_dim": 32, "sliding_window": 8, "vocab_size": 320},
         "batch_size": 4, "seq_len": 32, "steps": 6, "warmup_steps": 2, "log_every": 1, "eval_every": 6,
         "eval_batches": 1, "checkpoint_every": 3, "keep_checkpoints": 3, "samples": 0}
LORA = "r=2,alpha=4,dropout=0,targets=all-linear+experts,modules_to_save=lm_head"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A prepared micro corpus and a base checkpoint (random weights) to adapt."""
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    root = tmp_path_factory.mktemp("lora")
    prepare_play_corpus(root)
    torch.manual_seed(3)
    cfg = get_preset("tiny").replace(**MICRO["model"])
    checkpoint.save_checkpoint(root / "base", GptOssForCausalLM(cfg).state_dict(), cfg)
    (root / "micro.json").write_text(json.dumps({**MICRO, "data": str(root / "data")}))
    return root


def config(root, out, **changes) -> TrainConfig:
    return TrainConfig(**{**MICRO, "data": str(root / "data"), "out": str(out), "init_from": str(root / "base"),
                          **changes})


def losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_lora_run_saves_adapters_and_a_base_reference_and_resumes_exactly(root):
    full = root / "lora"
    summary = run_training(config(root, full, lora=LORA, adapter_optimizer="adamw"), show_progress=False)
    # The base's weights are placed committed to the device: so is the state (one program; it
    # compiled twice while the optimizer state started uncommitted).
    assert summary["trace_count"] == summary["compile_count"] == 1
    step_dir = checkpoint.find_checkpoint(full)
    stored = checkpoint.stored_shapes(step_dir)
    params = sorted(k[1] for k in stored if k[0] == "params")
    trained = lambda name: ".lora_" in name or name == "lm_head.modules_to_save.default.weight"
    assert params and all(trained(n) for n in params)                         # never the frozen base
    assert all(trained(k[-1]) for k in stored if k[-1] != "step")
    assert {k[1] for k in stored if k[0] == "opt_state"} == {"exp_avg", "exp_avg_sq", "step"}   # adapter_optimizer
    meta, _ = checkpoint.read_meta(step_dir)
    base = meta["lora"]["base"]
    assert meta["lora"]["spec"] == LORA and base["kind"] == "checkpoint" and len(base["sha256"]) == 64
    assert base["path"] == str(checkpoint.find_checkpoint(root / "base").resolve())

    resumed = root / "resumed"                                               # the same run, stopped after step 3
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    run_training(config(root, resumed, resume=True), explicit={"resume": True}, show_progress=False)
    expected = losses(full)
    assert sorted(expected) == list(range(1, 7)) and losses(resumed) == expected
    assert len(set(expected.values())) > 1

    model, cfg, loaded_meta = load_lora_model(full)
    trained = checkpoint.restore_params_to_host(step_dir, {k: v for k, v in stored.items() if k[0] == "params"})
    from jax_bridge.layer_stack import LayerLayout
    trained = LayerLayout.from_tag(meta["layout"], cfg).unstack(trained)
    inner = dict(model.get_base_model().named_parameters())
    assert all(np.array_equal(inner[n].detach().numpy(), v) for n, v in trained.items())
    assert loaded_meta["step"] == 6
    with pytest.raises(UserError, match="holds LoRA adapters of the base"):
        checkpoint.load_checkpoint(full)

    manifest = next((root / "base").rglob("torchlyra_manifest.json"))
    original = manifest.read_bytes()
    manifest.write_bytes(original + b" ")
    with pytest.raises(UserError, match="changed since the adapters were trained"):
        load_lora_model(full)
    manifest.write_bytes(original)
    shutil.move(root / "base", root / "base_moved")
    try:
        with pytest.raises(UserError, match="base model .* is missing"):
            load_lora_model(full)
    finally:
        shutil.move(root / "base_moved", root / "base")


def test_freeze_without_lora_keeps_the_frozen_parameters_exactly(root, capsys):
    out = root / "frozen"
    assert main(["train", "--config", str(root / "micro.json"), "--out", str(out), "--steps", "2",
                 "--init-from", str(root / "base"), "--freeze", "*.mlp.router.*", "--freeze", "lm_head.weight"]) == 0
    assert "--freeze *.mlp.router.* lm_head.weight: training" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["compile_count"] == 1
    stored = checkpoint.stored_shapes(checkpoint.find_checkpoint(out))
    frozen = sorted(k[1] for k in stored if k[0] == "frozen")
    assert frozen and all(".mlp.router." in n or n == "lm_head.weight" for n in frozen)
    assert not any(k[0] == "params" and k[1] in frozen for k in stored)
    assert not any(k[0] == "opt_state" and k[-1] in frozen for k in stored)
    base, _, _ = checkpoint.load_checkpoint(root / "base")
    after, _, _ = checkpoint.load_checkpoint(out)                             # trained + frozen, per layer
    assert sorted(after) == sorted(base)
    for name in base:
        same = torch.equal(after[name], base[name])
        assert same == (".mlp.router." in name or name == "lm_head.weight"), name


@pytest.mark.parametrize("flags, message", [
    (["--lora", "r=0"], "r must be an integer"),
    (["--lora", "targets=lm_head"], "no gradient"),
    (["--lora", "r=4,dropout=0.1,targets=experts"], "cannot apply dropout"),
    (["--lora", "r=4", "--init-from", ""], "lora needs init_from"),
    (["--freeze", "*.mlp.routr.*"], "matches no parameter"),
    (["--adapter-optimizer", "sgd"], "adapter_optimizer must be muon or adamw"),
])
def test_bad_lora_and_freeze_flags_exit_2_with_one_line(root, capsys, flags, message):
    argv = ["train", "--config", str(root / "micro.json"), "--out", str(root / "bad"), "--init-from",
            str(root / "base"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
