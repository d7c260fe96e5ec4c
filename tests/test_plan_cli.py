"""`torchlyra plan`: the real train step compiled for a TPU slice without weights (jax_bridge/plan.py)."""
import json

import pytest

from train.cli import main


def test_plan_reports_a_step_that_does_not_fit_the_chip(tmp_path, capsys):
    """The all-xla kernel set's train step (2-layer tiny at sequence 8192, 64 rows per v5e chip,
    no remat) holds 20.6 GiB of activations: the TPU compiler refuses it for a 16 GiB chip, and
    the plan says so with the compiler's figure instead of failing. One chip, replicated state: it
    holds every parameter, and with `--optimizer adamw` two moments of each."""
    out = tmp_path / "plan.json"
    rc = main(["plan", "--preset", "tiny", "--layers", "2", "--topology", "v5e:2x2", "--mesh", "none",
               "--seq-len", "8192", "--batch-size", "256", "--kernels", "xla", "--optimizer", "adamw",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "DOES NOT FIT" in printed and "4 x TPU v5 lite" in printed and "64 rows per chip" in printed
    plan = json.loads(out.read_text())
    assert plan["fits"] is False and plan["kernels"] == {"attention": "xla", "cross_entropy": "xla", "moe": "xla"}
    assert plan["mesh"] == "none" and plan["param_bytes"] == plan["grad_bytes"] == 4 * plan["params"]
    assert plan["optimizer"] == "adamw" and "AdamW for every parameter" in printed
    assert 2 * plan["param_bytes"] <= plan["optimizer_bytes"] < 2 * plan["param_bytes"] + 4096   # + step counts
    assert plan["temp_bytes"] > plan["hbm_bytes"] > 15 << 30
    assert "exceeds available HBM" in plan["error"]


def tiny_shards_on_fsdp2_tensor2(cfg) -> int:
    """Per-chip float32 parameter bytes of `cfg` on a fsdp=2 x tensor=2 mesh, derived by hand from
    the rules (sharding.PARAM_AXES / LOGICAL_RULES): matrices split over both axes (4 ways), head
    vectors and the router over one (2), norms and output biases whole; `expert` has size 1, so
    the expert stacks split their experts over `fsdp` (and gate_up's width over `tensor`): the
    gate_up biases 4 ways, the down biases 2."""
    d, hd, heads, kv, experts, width = (cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads,
                                        cfg.n_experts, cfg.expert_dim)
    per_layer = (heads * hd * d / 4 + heads * hd / 2                 # q
                 + 2 * (kv * hd * d / 4 + kv * hd / 2)                # k, v
                 + heads * hd * d / 4 + d + heads / 2                 # o, its bias, sinks
                 + 2 * d                                              # norms
                 + experts * d / 2 + experts                          # router
                 + experts * d * 2 * width / 4 + experts * 2 * width / 4   # gate_up
                 + experts * width * d / 4 + experts * d / 2)         # down
    return int(4 * (2 * cfg.vocab_size * d / 4 + d + cfg.n_layers * per_layer))


def test_plan_on_a_mesh_holds_each_chips_shards(tmp_path, capsys):
    """The sharded step (the Pallas kernels under shard_map) compiled for a v5e 2x2 slice on a
    fsdp=2 x tensor=2 mesh: each chip holds the shards the rules predict (about a quarter of the
    one-chip plan's 4 x params bytes), and the compiler's own argument bytes agree (state shards +
    this chip's token rows, give or take the TPU's padding of tiny vectors)."""
    from torch_model.config import get_preset

    out = tmp_path / "plan.json"
    rc = main(["plan", "--preset", "tiny", "--layers", "2", "--topology", "v5e:2x2", "--mesh", "fsdp=2,tensor=2",
               "--seq-len", "64", "--batch-size", "4", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "mesh fsdp=2,tensor=2" in printed and "layers scanned" in printed and ": fits" in printed
    plan = json.loads(out.read_text())
    assert plan["kernels"] == {"attention": "pallas", "cross_entropy": "pallas", "moe": "pallas"}
    assert plan["rows_per_chip"] == 2               # the batch is split over fsdp only
    predicted = tiny_shards_on_fsdp2_tensor2(get_preset("tiny").replace(n_layers=2))
    assert plan["param_bytes"] == plan["grad_bytes"] == predicted
    assert 4 * plan["params"] / 4 < predicted < 4 * plan["params"] / 3
    # the bf16 copy the step carries: every master but the float32 router's, at 2 bytes
    assert 0.45 * plan["param_bytes"] < plan["compute_copy_bytes"] < 0.5 * plan["param_bytes"]
    state = plan["param_bytes"] + plan["optimizer_bytes"] + plan["compute_copy_bytes"]
    held = state + 2 * 65 * 4
    assert held <= plan["argument_bytes"] <= 1.01 * held
    assert plan["alias_bytes"] >= state                 # the state and its copy are donated
    assert plan["total_bytes"] < plan["hbm_bytes"] and plan["fits"] is True


def test_plan_bad_input_is_one_line(capsys):
    assert main(["plan", "--preset", "tiny", "--topology", "v9z:2x2"]) == 2
    assert "unknown TPU topology 'v9z:2x2'" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--topology", "v5e:2x2", "--mesh", "none", "--batch-size", "6"]) == 2
    assert "multiple of the 4 chips" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--topology", "v5e:2x2", "--batch-size", "6"]) == 2
    assert "multiple of the 4 batch shards of mesh fsdp=4" in capsys.readouterr().err
    assert main(["plan", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_plan_bad_mesh_for_the_topology_is_one_line(capsys):
    assert main(["plan", "--preset", "tiny", "--topology", "v5e:2x2", "--mesh", "data=3"]) == 2
    err = capsys.readouterr().err
    assert "--mesh: data=3 uses 3 devices, but 4 are available" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", "--preset", "tiny", "--topology", "v5e:2x2", "--mesh", "tensor=4"]) == 2
    assert "mesh tensor=4 must divide the attention heads (4 query, 2 key/value heads)" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--topology", "v5e:2x2", "--mesh", "pipeline=4"]) == 2
    assert "--mesh: unknown axis 'pipeline'" in capsys.readouterr().err


def test_find_slice_stops_at_the_first_slice_that_fits(monkeypatch):
    """The search itself (each plan stubbed: compiling gpt-oss-20b takes minutes): slices in
    increasing size from one chip (v6e-1), one sequence per chip, every chip on fsdp, stopping at
    the first fit."""
    from jax_bridge import plan as plan_module

    asked = []

    def fake_plan(preset, topology, **kw):
        asked.append((topology, kw["batch_size"], kw["mesh"]))
        chips = kw["batch_size"]
        return plan_module.Plan(preset=preset, topology=topology, device_kind="TPU v6 lite", generation="v6e",
                                chips=chips, mesh=f"fsdp={chips}", n_layers=24, params=1, seq_len=4096,
                                batch_size=chips, rows_per_chip=1, micro_batches=1, scan_layers=True, remat="full",
                                kernels={}, compute_dtype="bfloat16", matmul_precision="default", hbm_bytes=1,
                                fits=chips >= 16)

    monkeypatch.setattr(plan_module, "plan", fake_plan)
    plans = plan_module.smallest_slice("gpt-oss-20b", "v6e", seq_len=4096)
    assert asked == [("v6e:1x1", 1, ""), ("v6e:2x2", 4, ""), ("v6e:2x4", 8, ""), ("v6e:4x4", 16, "")]
    assert [p.fits for p in plans] == [False, False, False, True]
    with pytest.raises(ValueError, match="--find-slice: expected one of v5e, v6e, v5p, v4, found 'v9'"):
        plan_module.smallest_slice("tiny", "v9")


def test_plan_of_a_transformers_model_config(tmp_path, capsys):
    """`plan --model-config --rl`: a transformers model's LoRA GRPO step and its rollout's prefill
    and decode programs compiled for four v5e chips, its parameters counted from the model built
    on `meta`; without --seq-len it is refused."""
    from tests.transformers_configs import CONFIGS
    from torch_model import transformers_lm

    config = tmp_path / "llama.json"
    config.write_text(CONFIGS["llama"]().to_json_string())
    out = tmp_path / "plan.json"
    assert main(["plan", "--model-config", str(config), "--seq-len", "64", "--topology", "v5e:2x2",
                 "--batch-size", "4", "--lora", "r=4,alpha=8,targets=all-linear", "--rl", "--rollout-completions", "8",
                 "--rollout-group-size", "2", "--rollout-prompt-tokens", "40", "--rollout-new-tokens", "16",
                 "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["fits"] and plan["preset"] == "llama" and plan["mesh"] == "fsdp=4" and plan["n_layers"] == 2
    assert plan["rl"].startswith("loss=dapo") and plan["rollout"]["fits"] and plan["rollout"]["cache_bytes"] > 0
    assert plan["params"] == sum(p.numel() for p in transformers_lm.build(CONFIGS["llama"]()).parameters())
    assert 0 < plan["trainable_params"] < plan["params"] and plan["frozen_bytes"] > 0
    assert main(["plan", "--model-config", str(config), "--topology", "v5e:2x2"]) == 2
    assert "--seq-len" in capsys.readouterr().err
