"""`torchlyra plan --lora`: the LoRA step (adapters trained, the base frozen in bf16 and passed
undonated) compiled for a TPU slice without weights; per-chip bytes as the shapes predict."""
import contextlib
import io
import json

import pytest
import torch

from torch_model.config import get_preset
from torch_model.kv_cache import cache_slots
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
    assert plan["compute_copy_bytes"] == 2 * adapters                          # the adapters' bf16 copy
    held = plan["param_bytes"] + plan["optimizer_bytes"] + plan["frozen_bytes"] + plan["compute_copy_bytes"]
    assert held <= plan["argument_bytes"] <= 1.01 * held + 4 * 65 * 4
    assert plan["alias_bytes"] < held                                           # the base is not donated
    assert plan["fits"] is True


def test_plan_rl_compiles_the_update_step_and_the_rollout_decoder_for_tpu(tmp_path, capsys):
    """`plan --rl`: what `rl` compiles, for four v5e chips on fsdp, without weights: the GRPO update
    step (LoRA, beta > 0 and mu = 2: advantages, logp_old and the reference's log-probabilities
    per token) and the rollout's prefill and decode loop beside it, sharing the frozen base."""
    out = tmp_path / "plan.json"
    plan_args = [a if a != "none" else "fsdp=4" for a in PLAN]
    rc = main([*plan_args, "--rl", "--rl-beta", "0.04", "--rl-iterations", "2", "--rollout-completions", "8",
               "--rollout-group-size", "2", "--rollout-prompt-tokens", "40", "--rollout-new-tokens", "16",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "packed rollouts (GRPO update: loss=dapo" in printed and "layers looped" in printed
    assert "update and rollout fit" in printed
    plan = json.loads(out.read_text())
    assert plan["rl"].startswith("loss=dapo,ratio=token,beta=0.04,iterations=2") and plan["packed"]
    assert plan["fits"] and not plan["scan_layers"]
    r = plan["rollout"]
    # 4 prompts x G 2 on the 4 batch shards: 4 prompt rows prefilled, 8 rows decoded; prompts 40 ->
    # a 64 bucket, 64 + 16 -> 128 cache positions
    assert (r["completions"], r["prompt_rows"], r["batch"], r["prompt_len"], r["length"]) == (8, 4, 8, 64, 128)
    # The decoder takes the policy in bf16: the frozen base is the train step's own buffers (the
    # same shards), the adapters its own bf16 copies of the float32 masters; no KL copy with LoRA.
    assert r["param_bytes"] - r["own_bytes"] == plan["frozen_bytes"]
    assert r["own_bytes"] == plan["param_bytes"] // 2 and r["reference_bytes"] == 0
    cfg = get_preset("tiny").replace(n_layers=2)
    slots = sum(cache_slots(cfg, layer, 128) for layer in range(2))
    assert r["cache_bytes"] == 2 * 8 * cfg.n_kv_heads * cfg.head_dim * slots * 2 // 4
    for program in ("prefill", "decode"):
        assert r[program]["error"] is None and r[program]["argument_bytes"] >= r["param_bytes"]
    assert r["decode"]["alias_bytes"] >= r["cache_bytes"]          # the loop's state is donated
    # Under fsdp every token's forward gathers the sharded weights, counted once per collective,
    # and nothing is hoisted out of the loop here; but with 8 rows the expert stacks and the head
    # stay where they lie and the rows come to them (sharding.fsdp_gathers_rows): under half the
    # whole bf16 model (4 chips' shards) is gathered per token (most of it, before).
    whole = 4 * r["param_bytes"]
    assert 0 < r["gathered_per_token"] < 0.5 * whole and r["gathered_per_call"] == 0
    assert r["rollout_peak_bytes"] > plan["param_bytes"] + plan["optimizer_bytes"] + plan["frozen_bytes"]
    assert r["update_peak_bytes"] == plan["total_bytes"] + r["own_bytes"] and r["fits"]
