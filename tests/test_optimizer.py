"""Muon + AdamW: parameter groups, and the math cross-checked against optax."""
import copy
import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from optax.contrib import MuonDimensionNumbers

from helpers import rel_err
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from torch_model.optim import (ADAMW, MUON, MuonAdamW, OptimizerConfig, ParamPlan, init_state, muon_adamw_update,
                               plan_parameters)


def test_every_parameter_lands_in_exactly_one_group():
    for preset in ("tiny", "dense"):
        model = GptOssForCausalLM(get_preset(preset).replace(n_layers=2))
        opt = MuonAdamW(model)
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        assert len(ids) == len(set(ids)) == len(list(model.parameters()))
        plan = opt.plan
        assert plan["model.layers.0.self_attn.q_proj.weight"].kind == MUON
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.0.self_attn.sinks", "model.layers.0.self_attn.q_proj.bias"):
            assert plan[name].kind == ADAMW, name
    moe_plan = plan_parameters(GptOssForCausalLM(get_preset("tiny").replace(n_layers=1)))
    assert moe_plan["model.layers.0.mlp.experts.gate_up_proj"].kind == MUON
    assert moe_plan["model.layers.0.mlp.router.weight"].kind == ADAMW


LINEAR, X_AT_W = ParamPlan(MUON, in_axis=-1, out_axis=-2), ParamPlan(MUON, in_axis=-2, out_axis=-1)


def test_a_parameter_no_rule_places_is_refused_by_name():
    """A matrix of a module that neither is nn.Linear nor declares its layout, or a 3-D tensor
    outside an experts module: one line naming it (a ConfigError: exit 2 on the command line)."""
    from torch_model.config import ConfigError

    class Mystery(torch.nn.Module):
        def __init__(self, *shape):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(*shape))

    for shape, why in (((3, 3), "neither nn.Linear nor declares its layout"), ((2, 3, 3), "3-D tensor outside")):
        model = torch.nn.Module()
        model.mystery = Mystery(*shape)
        with pytest.raises(ConfigError, match=f"no rule places parameter mystery.weight .*{why}"):
            plan_parameters(model)


FAMILIES = {   # parameters the name rules of the past did not place, by their family's config
    "phi3": ({}, {"self_attn.qkv_proj.weight": ParamPlan(MUON, parts=(64, 32, 32)),
                  "mlp.gate_up_proj.weight": ParamPlan(MUON, parts=(96, 96))}),
    "starcoder2": ({}, {"mlp.c_fc.weight": LINEAR, "mlp.c_proj.weight": LINEAR, "mlp.c_fc.bias": ParamPlan(ADAMW)}),
    "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48),
                  {"mlp.shared_expert.up_proj.weight": LINEAR, "mlp.shared_expert_gate.weight": ParamPlan(ADAMW),
                   "mlp.gate.weight": ParamPlan(ADAMW), "mlp.experts.down_proj": LINEAR}),
    "granitemoe": (dict(num_local_experts=4, num_experts_per_tok=2),
                   {"block_sparse_moe.experts.gate_up_proj": LINEAR, "block_sparse_moe.router.weight": ParamPlan(ADAMW)}),
    "apertus": ({}, {"mlp.act_fn.alpha_p": ParamPlan(ADAMW), "mlp.up_proj.weight": LINEAR}),
}


def test_every_familys_parameters_are_placed_by_role_and_shape():
    """Fused projections (split into their parts), shared experts and their gate, expert stacks
    and routers under other names, scalar parameters."""
    from transformers import AutoConfig

    from torch_model import transformers_lm

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    for family, (extra, expected) in FAMILIES.items():
        model = transformers_lm.build(AutoConfig.for_model(family, **shape, **extra))
        plan = plan_parameters(model)
        assert set(plan) == {n for n, _ in model.named_parameters()}, family
        for rest, rule in expected.items():
            assert plan["model.layers.0." + rest] == rule, (family, rest)
        assert plan["model.embed_tokens.weight"] == ParamPlan(ADAMW), family


def test_a_fused_projection_takes_the_update_of_its_unfused_parts():
    """Phi-3 (q|k|v and gate|up fused) with a Llama's weights computes that Llama; one eager
    Muon + AdamW step moves each part of its fused weights exactly as the Llama's own matrices."""
    from transformers import LlamaConfig, Phi3Config

    from torch_model import transformers_lm

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0,
                 tie_word_embeddings=False)
    torch.manual_seed(0)
    llama = transformers_lm.build(LlamaConfig(**shape))
    phi3 = transformers_lm.build(Phi3Config(**shape))
    theirs = llama.state_dict()

    def fused(state):
        out = {}
        for name, value in state.items():
            for parts, whole in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
                if f".{parts[0]}." in name:
                    out[name.replace(parts[0], whole)] = torch.cat([state[name.replace(parts[0], p)] for p in parts])
            if not any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                out[name] = value
        return out

    phi3.load_state_dict(fused(theirs))
    whole = copy.deepcopy(phi3)         # the same fused model, its fused matrices orthogonalized whole
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(phi3(ids), llama(ids), atol=1e-6)
    for model in (llama, phi3, whole):
        optimizer = MuonAdamW(model, OptimizerConfig(lr=0.05, adam_lr=0.01))
        if model is whole:
            optimizer.plan = {n: dataclasses.replace(r, parts=()) for n, r in optimizer.plan.items()}
        model(ids, ids)["loss"].backward()
        optimizer.step()
    expected, got = fused(llama.state_dict()), phi3.state_dict()
    assert set(got) == set(expected)
    for name in got:
        assert (got[name] - expected[name]).abs().max() <= 1e-6, name
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
        assert (whole.state_dict()[name] - got[name]).abs().max() > 1e-3, name


def _run_ours(params, grads_seq, cfg):
    plan = {n: (X_AT_W if ".experts." in n else LINEAR) if p.dim() > 1 and "embed" not in n else ParamPlan(ADAMW)
            for n, p in params.items()}
    state = init_state(params, plan)
    for grads in grads_seq:
        params, state, _ = muon_adamw_update(params, grads, state, plan, cfg)
    return params


def _run_optax(tx, params, grads_seq):
    jp = {n: jnp.asarray(p.numpy()) for n, p in params.items()}
    state = tx.init(jp)
    for grads in grads_seq:
        updates, state = tx.update({n: jnp.asarray(g.numpy()) for n, g in grads.items()}, state, jp)
        jp = optax.apply_updates(jp, updates)
    return jp


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_optax_contrib_muon(nesterov):
    """Linear weights [out, in], and a batch of expert matrices [E, in, out] each orthogonalized
    on its own, over three steps with weight decay."""
    rng = np.random.default_rng(0)
    shapes = {"l.self_attn.q_proj.weight": (24, 16), "l.self_attn.o_proj.weight": (16, 40),
              "l.mlp.experts.gate_up_proj": (3, 16, 12), "l.mlp.experts.down_proj": (3, 12, 40)}   # last: Gram form
    params = {n: torch.tensor(rng.normal(size=s), dtype=torch.float32) for n, s in shapes.items()}
    grads_seq = [{n: torch.tensor(rng.normal(size=s), dtype=torch.float32) for n, s in shapes.items()}
                 for _ in range(3)]
    cfg = OptimizerConfig(lr=0.05, weight_decay=0.1, nesterov=nesterov, max_grad_norm=0.0)
    ours = _run_ours(dict(params), grads_seq, cfg)

    dims = {"l.self_attn.q_proj.weight": MuonDimensionNumbers(reduction_axis=1, output_axis=0),
            "l.self_attn.o_proj.weight": MuonDimensionNumbers(reduction_axis=1, output_axis=0),
            "l.mlp.experts.gate_up_proj": MuonDimensionNumbers(reduction_axis=1, output_axis=2),
            "l.mlp.experts.down_proj": MuonDimensionNumbers(reduction_axis=1, output_axis=2)}
    tx = optax.contrib.muon(learning_rate=cfg.lr, ns_coeffs=cfg.ns_coeffs, ns_steps=cfg.ns_steps, beta=cfg.momentum,
                            eps=cfg.eps, weight_decay=cfg.weight_decay, nesterov=nesterov,
                            muon_weight_dimension_numbers=dims)
    jp = _run_optax(tx, params, grads_seq)
    for n in shapes:
        assert rel_err(ours[n], jp[n]) < 1e-5, n


def test_adamw_matches_optax_adamw():
    rng = np.random.default_rng(1)
    shapes = {"model.embed_tokens.weight": (10, 4), "x.bias": (7,)}
    params = {n: torch.tensor(rng.normal(size=s), dtype=torch.float32) for n, s in shapes.items()}
    grads_seq = [{n: torch.tensor(rng.normal(size=s), dtype=torch.float32) for n, s in shapes.items()}
                 for _ in range(3)]
    cfg = OptimizerConfig(adam_lr=0.01, adam_weight_decay=0.05, max_grad_norm=0.0)
    ours = _run_ours(dict(params), grads_seq, cfg)
    tx = optax.adamw(cfg.adam_lr, b1=cfg.adam_betas[0], b2=cfg.adam_betas[1], eps=cfg.eps,
                     weight_decay=cfg.adam_weight_decay)
    jp = _run_optax(tx, params, grads_seq)
    for n in shapes:
        assert rel_err(ours[n], jp[n]) < 1e-6, n


def test_gradient_clipping_scales_by_global_norm():
    params = {"b.bias": torch.zeros(4)}
    grads = {"b.bias": torch.full((4,), 10.0)}
    plan = {"b.bias": ParamPlan(ADAMW)}
    _, _, stats = muon_adamw_update(params, grads, init_state(params, plan), plan, OptimizerConfig(max_grad_norm=1.0))
    assert abs(stats["grad_norm"].item() - 20.0) < 1e-5


def test_bf16_newton_schulz_is_a_setting():
    from torch_model.optim import newton_schulz

    g = torch.randn(3, 16, 32)
    x32 = newton_schulz(g, 5, OptimizerConfig().ns_coeffs, 1e-8, torch.float32)
    x16 = newton_schulz(g, 5, OptimizerConfig().ns_coeffs, 1e-8, torch.bfloat16)
    assert 1e-4 < rel_err(x16, x32) < 5e-2
    singular = torch.linalg.svdvals(x32)
    assert singular.min() > 0.5 and singular.max() < 1.3     # roughly orthogonal
    with pytest.raises(ValueError, match="ns_dtype"):
        OptimizerConfig(ns_dtype="float16")


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (3, 32, 96), (2, 40, 80), (2, 40, 40)])
def test_newton_schulz_gram_form_matches_the_plain_iteration(shape):
    """Wide matrices (n / m >= 2.7, either orientation, batched) take the cheaper Gram-matrix form;
    others the plain form. Both against the plain quintic run in float64."""
    from torch_model.optim import gram_form_is_cheaper, newton_schulz

    a, b, c = OptimizerConfig().ns_coeffs
    g = torch.randn(*shape, dtype=torch.float64)
    x = g.mT if shape[-2] > shape[-1] else g
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-8)
    for _ in range(5):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    want = x.mT if shape[-2] > shape[-1] else x
    m, n = sorted(shape[-2:])
    assert gram_form_is_cheaper(m, n, 5) == (n / m >= 2.7)
    got = newton_schulz(g.float(), 5, (a, b, c), 1e-8, torch.float32)
    assert rel_err(got.double(), want) < 1e-5


@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (3, 32, 48)])   # not square: A = x x^T has another shape
def test_newton_schulz_updates_the_iterate_by_products_only(shape):
    """Each iteration's a x + B x is one product (a I + B) x: a separate elementwise pass over the
    [m, n] iterate is memory traffic that XLA does not fuse into the matmul on TPU (BENCHMARKS.md,
    the roofline, 2026-12-05: 11.8 ms of Lyra Small's v6e step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch_model.optim import newton_schulz

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append((str(func), tuple(out.shape) if isinstance(out, torch.Tensor) else None))
            return out

    g = torch.randn(*shape)
    iterate = tuple(sorted(shape[-2:])) if len(shape) == 2 else shape      # the wide orientation
    with Recorder() as rec:
        newton_schulz(g, 5, OptimizerConfig().ns_coeffs, 1e-8, torch.float32)
    elementwise = [f for f, s in rec.ops if s == iterate and f.split(".")[1] in ("add", "mul", "sub")]
    products = [f for f, s in rec.ops if s == iterate and f.split(".")[1] in ("mm", "bmm")]
    assert not elementwise, f"elementwise passes over the iterate: {elementwise}"
    assert len(products) == 5
