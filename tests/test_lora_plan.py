"""`torchlyra plan --lora`: the LoRA step (adapters trained, the base frozen in bf16 and passed
undonated) compiled for a TPU slice without weights; per-chip bytes as the shapes predict."""
import json

import torch

from torch_model.config import get_preset
from torch_model.lora import apply_lora, parse_lora_spec
from torch_model.model import GptOssForCausalLM
from train.cli import main

SPEC = "r=4,alpha=8,targets=all-linear+experts"


def test_plan_lora_on_one_v5e_chip_holds_the_adapters_state_and_the_bf16_base(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--preset", "tiny", "--layers", "2", "--topology", "v5e:2x2", "--mesh", "none", "--seq-len", "64",
               "--batch-size", "4", "--kernels", "xla", "--lora", SPEC, "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"LoRA {SPEC}" in printed and ": fits" in printed
    plan = json.loads(out.read_text())
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
