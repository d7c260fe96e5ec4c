"""Training with frozen parameters: the LoRA train step (peft through torchax) against eager peft,
state and gradients only for the trainable parameters, the frozen ones untouched, the sharding and
optimizer rules for every peft name, and `--freeze` without LoRA."""
import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import rel_err, to_numpy
from jax_bridge import sharding
from jax_bridge.step import StepConfig, TrainStep
from torch_model.config import ConfigError, get_preset
from torch_model.freeze import freeze_parameters
from torch_model.lora import apply_lora, base_parameter_of, parse_lora_spec
from torch_model.model import GptOssForCausalLM
from torch_model.optim import ADAMW, MUON, MuonAdamW, OptimizerConfig, plan_parameters

VOCAB, BATCH, SEQ = 300, 2, 16


def tiny_model(seed=0, n_layers=2):
    torch.manual_seed(seed)
    model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=n_layers, vocab_size=VOCAB, max_seq_len=SEQ))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model


def lora_model(seed=0):
    """A tiny peft model with every adapter non-zero (B starts at zero in peft) and lm_head trained
    whole (peft's modules_to_save)."""
    wrapped = apply_lora(tiny_model(seed), parse_lora_spec("r=4,alpha=8,targets=all-linear+experts,modules_to_save=lm_head"))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name:
                torch.nn.init.normal_(p, std=0.05)
    return wrapped


def tokens(seed=1):
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def eager_step(model, ids, opt_cfg):
    """Eager peft: gradients by name (trainable only), then the eager optimizer's step."""
    inner = model.get_base_model()
    optimizer = MuonAdamW(inner, opt_cfg)
    inner.zero_grad()
    inner(ids[:, :-1], ids[:, 1:])["loss"].backward()
    grads = {n: p.grad.clone() for n, p in inner.named_parameters() if p.requires_grad}
    optimizer.step()
    return grads, {n: to_numpy(p) for n, p in inner.named_parameters()}


@pytest.fixture(scope="module")
def lora_setup():
    model = lora_model()
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype="float32"))
    return model, step


def test_lora_step_gradients_and_update_match_eager_peft(lora_setup):
    model, step = lora_setup
    ids = tokens()
    before = {n: to_numpy(p) for n, p in model.get_base_model().named_parameters()}
    grads, expected = eager_step(copy.deepcopy(model), ids, step.opt_cfg)
    adapters = sorted(n for n in before if ".lora_" in n or ".modules_to_save." in n)
    assert sorted(grads) == adapters and len(adapters) == 2 * (4 + 2) * 2 + 1   # A, B of 4 projections + 2 expert
    assert "lm_head.modules_to_save.default.weight" in adapters                # tensors; lm_head's trained copy
    registered = lambda: ([(n, id(p)) for n, p in model.named_parameters()], [n for n, _ in model.named_buffers()])
    before_trace = registered()
    state = step.init_state()
    assert sorted(state.params) == adapters                                     # only trainable parameters
    (_, _), lowered = step.grads(state.params, ids.numpy())
    assert sorted(lowered) == adapters
    for name in adapters:
        assert rel_err(lowered[name], to_numpy(grads[name])) < 1e-4, name
    state, _ = step(state, ids.numpy()[None])
    assert registered() == before_trace       # peft's parametrization under functional_call left no trace
    for name in adapters:
        assert rel_err(state.params[name], expected[name]) < 1e-5, name
    assert np.abs(np.asarray(state.params[adapters[0]]) - before[adapters[0]]).max() > 0
    frozen = jax.device_get(step.frozen)
    assert sorted(frozen) == sorted(set(before) - set(adapters))
    for name, value in frozen.items():                                          # bit-identical after steps
        assert np.array_equal(value, before[name]), name


def test_optimizer_state_only_for_trainable_parameters_by_name(lora_setup):
    _, step = lora_setup
    opt = step.init_state().opt_state
    experts = {n for n in step.layer_plan if ".mlp.experts." in n}
    linear = set(step.layer_plan) - experts - {"lm_head.modules_to_save.default.weight"}
    assert set(opt["momentum"]) == linear                          # Muon: the q/k/v/o adapters
    assert set(opt["exp_avg"]) == set(opt["exp_avg_sq"]) == experts | {"lm_head.modules_to_save.default.weight"}
    assert not any(n in step.layer_plan for n in step.frozen_names)
    adam = plan_parameters(step.model, adapters=ADAMW)
    assert {r.kind for r in adam.values()} == {ADAMW}


def test_bf16_compute_holds_the_frozen_base_in_bf16_and_routers_in_float32():
    model = apply_lora(tiny_model(), parse_lora_spec("r=2,targets=q_proj"))
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype="bfloat16"))
    frozen = step.host_frozen()
    assert {str(v.dtype) for n, v in frozen.items() if ".mlp.router." not in n} == {"bfloat16"}
    assert {str(v.dtype) for n, v in frozen.items() if ".mlp.router." in n} == {"float32"}
    assert {str(v.dtype) for v in step.host_state().params.values()} == {"float32"}   # master weights


def test_rules_map_every_peft_name_to_its_base_weight():
    wrapped = lora_model()
    mesh = sharding.make_mesh({"fsdp": 1})
    for prefix_names in (wrapped.named_parameters(), wrapped.get_base_model().named_parameters()):
        for name, p in prefix_names:
            assert len(sharding.param_axes(name, p.dim())) == p.dim(), name
            sharding.param_spec(name, tuple(p.shape), mesh)
    layer = "model.layers.1."
    expected = {"self_attn.q_proj.lora_A.default.weight": (None, "embed"),
                "self_attn.q_proj.lora_B.default.weight": ("heads", None),
                "self_attn.k_proj.lora_B.default.weight": ("kv_heads", None),
                "self_attn.o_proj.lora_A.default.weight": (None, "heads"),
                "mlp.experts.base_layer.lora_A.default.weight": (None, "embed_moe"),    # gate_up [E, in, 2I]
                "mlp.experts.base_layer.lora_B.default.weight": ("mlp", None),
                "mlp.experts.lora_A.default.weight": (None, "mlp"),                     # down [E, I, H]
                "mlp.experts.lora_B.default.weight": ("embed_moe", None),
                "mlp.experts.base_layer.base_layer.gate_up_proj": ("exp", "embed_moe", "mlp"),
                "self_attn.q_proj.base_layer.weight": ("heads", "embed")}
    for rest, axes in expected.items():
        assert sharding.param_axes("base_model.model." + layer + rest, len(axes)) == axes, rest
    for name in ("lm_head.modules_to_save.default.weight", "base_model.model.lm_head.original_module.weight"):
        assert sharding.param_axes(name, 2) == ("vocab", "embed"), name
    spec = parse_lora_spec("r=2,targets=experts,modules_to_save=embed_tokens+lm_head")
    assert parse_lora_spec(str(spec)) == spec and spec.modules_to_save == ("embed_tokens", "lm_head")
    assert sharding.param_axes("model.layers.stack0.self_attn.v_proj.lora_A.default.weight", 3) == ("layers", None, "embed")
    assert base_parameter_of(layer + "mlp.experts.lora_A.default.weight") == (layer + "mlp.experts.down_proj", "A")
    # a matrix no rule names is placed by shape (split along its input over fsdp), its adapters with it
    assert sharding.param_axes("model.layers.0.mlp.w_proj.lora_A.default.weight", 2) == (None, "embed")
    assert sharding.param_axes("model.layers.0.mlp.w_proj.lora_B.default.weight", 2) == (None, None)
    with pytest.raises(ValueError, match="no rule for parameter 'model.layers.0.mlp.w_proj'"):
        sharding.param_axes("model.layers.0.mlp.w_proj", 3)
    plan = plan_parameters(wrapped)
    assert set(plan) == {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert plan["base_model.model." + layer + "self_attn.q_proj.lora_B.default.weight"].kind == MUON


def test_freeze_without_lora_leaves_the_frozen_out_of_the_state():
    """The step's execution with frozen parameters runs in test_lora_cli (bit-identical there)."""
    model = tiny_model(n_layers=2)
    with pytest.raises(ConfigError, match="matches no parameter"):
        freeze_parameters(model, ["*.mlp.routr.*"])
    frozen = freeze_parameters(model, ["*.mlp.router.*", "model.embed_tokens.weight"])
    assert len(frozen) == 2 * 2 + 1
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype="float32", scan_layers=True))
    host = step.host_state()
    state_names = set(host.params) | {n for group in host.opt_state.values() if isinstance(group, dict) for n in group}
    assert set(step.host_frozen()) == {"model.embed_tokens.weight", "model.layers.stack0.mlp.router.weight",
                                       "model.layers.stack0.mlp.router.bias", "model.layers.stack1.mlp.router.weight",
                                       "model.layers.stack1.mlp.router.bias"}
    assert not state_names & set(step.host_frozen()) and "model.norm.weight" in state_names
    partial = tiny_model(n_layers=2)
    freeze_parameters(partial, ["model.layers.0.mlp.router.*"])
    with pytest.raises(ValueError, match="frozen in some layers only"):
        TrainStep(partial, OptimizerConfig(), StepConfig(kernels="xla", scan_layers=True))
