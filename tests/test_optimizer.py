"""Muon + AdamW: parameter groups, and the math cross-checked against optax."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from optax.contrib import MuonDimensionNumbers

from helpers import rel_err
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from torch_model.optim import ADAMW, MUON, MuonAdamW, OptimizerConfig, init_state, muon_adamw_update, plan_parameters


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
    moe_plan = plan_parameters(GptOssForCausalLM(get_preset("tiny").replace(n_layers=1)).named_parameters())
    assert moe_plan["model.layers.0.mlp.experts.gate_up_proj"].kind == MUON
    assert moe_plan["model.layers.0.mlp.router.weight"].kind == ADAMW


def test_unmatched_parameter_is_an_error():
    with pytest.raises(ValueError, match="mystery.weight"):
        plan_parameters([("mystery.weight", torch.zeros(3, 3))])


def _run_ours(params, grads_seq, cfg):
    plan = plan_parameters(params.items())
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
    plan = plan_parameters(params.items())
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
    issue 36, session 19: 11.8 ms of Lyra Small's v6e step)."""
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
