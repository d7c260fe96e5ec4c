"""`torchlyra plan --lora`: the LoRA step (adapters trained, the base frozen in bf16 and passed
undonated) compiled for a TPU slice without weights; per-chip bytes as the shapes predict."""
import contextlib
import io
import json

import pytest
import torch

from torch_model.config import get_preset
from torch_model.lora import apply_lora, parse_lora_spec
from torch_model.model import GptOssForCausalLM
from train.cli import main

SPEC = "r=4,alpha=8,targets=all-linear+experts"


PLAN = ["plan", "--preset", "tiny", "--layers", "2", "--topology", "v5e:2x2", "--mesh", "none", "--seq-len", "64",
        "--batch-size", "4", "--kernels", "xla", "--lora", SPEC]


@pytest.fixture(scope="module")
def lora_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*PLAN, "--json", str(out)]) == 0
    return printed.getvalue(), json.loads(out.read_text())


def test_plan_lora_on_one_v5e_chip_holds_the_adapters_state_and_the_bf16_base(lora_plan):
    printed, plan = lora_plan
    assert f"LoRA {SPEC}" in printed and ": fits" in printed
    with torch.device("meta"):
        model = apply_lora(GptOssForCausalLM(get_preset("tiny").replace(n_layers=2)), parse_lora_spec(SPEC))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad}
    experts = sum(v for n, v in frozen.items() if ".mlp.experts." in n and n.endswith(("gate_up_proj", "down_proj")))
    assert plan["lora"] == SPEC and plan["trainable_params"] == adapters
    assert plan["param_bytes"] == plan["grad_bytes"] == 4 * adapters            # float32, adapters only
    routers = sum(v for n, v in frozen.items() if ".router." in n)
    assert plan["frozen_bytes"] == 2 * (sum(frozen.values()) - routers) + 4 * routers   # bf16, routers float32
    assert plan["expert_delta_bytes"] == 2 * experts // 2 > 0                   # one layer of two, bf16
    held = plan["param_bytes"] + plan["optimizer_bytes"] + plan["frozen_bytes"]
    assert held <= plan["argument_bytes"] <= 1.01 * held + 4 * 65 * 4
    assert plan["alias_bytes"] < held                                           # the base is not donated
    assert plan["fits"] is True


def test_plan_rl_compiles_the_grpo_update_step_for_tpu(lora_plan, tmp_path, capsys):
    """`plan --rl`: the GRPO update step (LoRA, beta > 0 and mu = 2: advantages, logp_old and the
    reference's log-probabilities per token) compiled for a v5e chip without weights."""
    out = tmp_path / "plan.json"
    rc = main([*PLAN, "--rl", "--rl-beta", "0.04", "--rl-iterations", "2", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "packed rollouts (GRPO update: loss=dapo" in printed and ": fits" in printed
    plan = json.loads(out.read_text())
    assert plan["rl"].startswith("loss=dapo,ratio=token,beta=0.04,iterations=2") and plan["packed"]
    # The same state as the LoRA train step's; a bigger batch argument (the train step takes one
    # token array, the GRPO step 4 packed fields and 3 float32 per-token fields: advantages,
    # logp_old, ref_logps; the compiler's argument bytes are not their plain sum, so only the order).
    _, train = lora_plan
    assert plan["param_bytes"] == train["param_bytes"] and plan["optimizer_bytes"] == train["optimizer_bytes"]
    assert plan["frozen_bytes"] == train["frozen_bytes"] and plan["argument_bytes"] > train["argument_bytes"]
