"""The lowered JAX step agrees with eager CPU PyTorch on `tiny` in float32.

`tiny` cut to 2 layers (one sliding, one full attention layer: every layer kind) at its own
widths: tracing and compiling dominate the time, and take half as long as at 4 layers."""
import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import dot_precisions, rel_err, to_numpy
from jax_bridge.lowering import params_to_jax
from jax_bridge.step import StepConfig, TrainStep
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from torch_model.optim import MuonAdamW, OptimizerConfig

BATCH, SEQ = 2, 64


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(n_layers=2, sliding_window=16, max_seq_len=SEQ)
    model = GptOssForCausalLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla"))
    return cfg, model, tokens, step


def eager_grads(model, tokens):
    model.zero_grad()
    out = model(tokens[:, :-1], tokens[:, 1:])
    out["loss"].backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_forward_logits_match_eager(setup):
    cfg, model, tokens, step = setup
    with torch.no_grad():
        expected = model(tokens[:, :-1]).numpy()
    params = params_to_jax(model)

    def logits(p, ids):
        with step.routing():
            return step.forward(p, ids)

    got = jax.jit(logits)(params, jnp.asarray(tokens[:, :-1].numpy()))
    assert rel_err(got, expected) < 1e-5


def test_loss_and_every_gradient_match_eager(setup):
    cfg, model, tokens, step = setup
    out, expected = eager_grads(model, tokens)
    (loss, _), grads = step.grads(params_to_jax(model), tokens.numpy())
    assert rel_err(loss, out["loss"].item()) < 1e-5
    assert set(grads) == set(expected)
    errors = {n: rel_err(grads[n], to_numpy(expected[n])) for n in expected}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"gradient of {worst} differs: rel err {errors[worst]:.2e}"


def test_lowered_optimizer_update_matches_eager_optimizer(setup):
    """Same gradients in, the torch optimizer's update traced through torchax must give the
    eager optimizer's parameters."""
    cfg, model, tokens, step = setup
    eager = copy.deepcopy(model)
    optimizer = MuonAdamW(eager, step.opt_cfg)
    _, grads = eager_grads(eager, tokens)
    state = step.init_state()
    optimizer.step()
    jax_grads = {n: jnp.asarray(g.numpy()) for n, g in grads.items()}
    params, _, stats = jax.jit(step.update)(state.params, jax_grads, state.opt_state, jnp.float32(1.0))
    errors = {n: rel_err(params[n], to_numpy(p)) for n, p in eager.named_parameters()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"parameter {worst} after one step differs: rel err {errors[worst]:.2e}"
    assert rel_err(stats["grad_norm"], optimizer.last_stats["grad_norm"].item()) < 1e-5


def test_lowered_update_matches_eager_with_wide_expert_matrices():
    """Expert up-projections [64, 256] take Newton-Schulz's Gram-matrix form: traced through
    torchax it must still give the eager optimizer's parameters."""
    from torch_model.optim import gram_form_is_cheaper

    cfg = get_preset("tiny").replace(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, expert_dim=128,
                                     n_layers=2, vocab_size=256, sliding_window=16, max_seq_len=SEQ)
    assert gram_form_is_cheaper(64, 2 * cfg.expert_dim, OptimizerConfig().ns_steps)
    model = GptOssForCausalLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2))
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla"))
    eager = copy.deepcopy(model)
    optimizer = MuonAdamW(eager, step.opt_cfg)
    _, grads = eager_grads(eager, tokens)
    state = step.init_state()
    optimizer.step()
    params, _, _ = jax.jit(step.update)(state.params, {n: jnp.asarray(g.numpy()) for n, g in grads.items()},
                                        state.opt_state, jnp.float32(1.0))
    for n, p in eager.named_parameters():
        assert rel_err(params[n], to_numpy(p)) < 1e-5, n


def test_every_dot_of_a_lowered_update_carries_the_steps_precision(setup):
    """A past bug: the parity suite jitted the optimizer with no precision scope, so on TPU its
    float32 Newton-Schulz products ran as one bf16 pass (post-step parameters off by 2e-3). The lowered
    update carries the precision it is given (optimizer_function), whoever traces it: the parity
    suite's shared update, jitted bare, and the whole float32 step (model, backward and update)
    have every dot at 'highest'. (Tracing the optimizer costs ~2 s a program: two programs.)"""
    from parity.runs import SharedLowered

    cfg, model, tokens, step = setup
    assert step.cfg.matmul_precision == "highest"
    state = step.abstract_state()
    shared = SharedLowered(model, step.opt_cfg)
    programs = {"parity's shared update": shared.program().lower(state.params, state.params, state.opt_state,
                                                                 jnp.float32(1.0)),
                "whole float32 step": step.lower(state, tokens.numpy()[None])}
    for name, lowered in programs.items():
        precisions = dot_precisions(lowered)
        assert precisions and set(precisions) == {"HIGHEST, HIGHEST"}, (name, sorted(set(precisions)))


def assert_same_parameters(got, want, *, vector: float, tensor: float = 1e-4):
    """Parameters after one step against another computation of it: the whole parameter vector
    within `vector`, each tensor within `tensor`. Adam's first step is sign-like (g / (|g| + eps)):
    a zero-initialised bias whose gradient entries sit near eps shows their last-bit differences
    in full (~1e-5 relative between two compiled programs of the step)."""
    names = sorted(want)
    flat = lambda d: np.concatenate([np.asarray(d[n], np.float64).ravel() for n in names])
    assert sorted(got) == names
    assert rel_err(flat(got), flat(want)) < vector
    errors = {n: rel_err(got[n], want[n]) for n in names}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tensor, f"{worst} differs: rel err {errors[worst]:.2e}"


def test_one_full_step_matches_eager(setup):
    """Gradients and update both lowered; against eager the whole parameter vector is held to 1e-5
    and every tensor to 1e-3 (Adam's sign-like first step: assert_same_parameters)."""
    cfg, model, tokens, step = setup
    eager = copy.deepcopy(model)
    optimizer = MuonAdamW(eager, step.opt_cfg)
    eager_grads(eager, tokens)
    optimizer.step()
    state, metrics = step(step.init_state(), tokens.numpy()[None])
    assert_same_parameters(state.params, {n: to_numpy(p) for n, p in eager.named_parameters()}, vector=1e-5,
                           tensor=1e-3)
    assert rel_err(metrics["grad_norm"], optimizer.last_stats["grad_norm"].item()) < 1e-4


def test_gradients_then_the_update_alone_equal_the_full_step(setup):
    """What the step benchmark times apart (grads(), apply_update()) composes to the step."""
    cfg, model, tokens, step = setup
    full, _ = step(step.init_state(), tokens.numpy()[None])
    state = step.init_state()
    _, grads = step.grads(state.params, tokens.numpy())
    params, opt_state, stats = step.apply_update(state.params, grads, state.opt_state)
    assert_same_parameters(params, full.params, vector=1e-6)
    for name in full.opt_state["momentum"]:
        assert rel_err(opt_state["momentum"][name], full.opt_state["momentum"][name]) < 1e-6, name
    assert float(opt_state["step"]) == float(full.opt_state["step"]) == 1.0


def test_accumulating_four_micro_batches_equals_one_big_batch():
    torch.manual_seed(0)
    # The load-balancing loss is a product of per-batch statistics, not a sum over tokens: a
    # micro-batch's differs from the whole batch's, so it is off for this comparison.
    cfg = get_preset("tiny").replace(n_layers=2, sliding_window=8, router_aux_loss_coef=0.0)
    model = GptOssForCausalLM(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 33)).astype(np.int32)
    opt_cfg = OptimizerConfig()
    accumulated = TrainStep(model, opt_cfg, StepConfig(kernels="xla", micro_batches=4))
    whole = TrainStep(model, opt_cfg, StepConfig(kernels="xla", micro_batches=1))
    s_acc, m_acc = accumulated(accumulated.init_state(), tokens.reshape(4, 2, 33))
    s_one, m_one = whole(whole.init_state(), tokens[None])
    assert rel_err(m_acc["ce"], m_one["ce"]) < 1e-5
    assert rel_err(m_acc["grad_norm"], m_one["grad_norm"]) < 1e-4
    assert_same_parameters(s_acc.params, s_one.params, vector=1e-5)


def test_micro_batches_are_not_aliased():
    """Different data in each micro-batch must give a different result than repeating one."""
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(n_layers=1, sliding_window=8)
    model = GptOssForCausalLM(cfg)
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla", micro_batches=2))
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, cfg.vocab_size, (1, 2, 17)).astype(np.int32) for _ in range(2))
    _, m_ab = step(step.init_state(), np.concatenate([a, b]))
    _, m_bb = step(step.init_state(), np.concatenate([b, b]))
    assert abs(float(m_ab["ce"]) - float(m_bb["ce"])) > 1e-4


def test_no_recompilation_across_steps(setup):
    cfg, model, tokens, _ = setup
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla"))
    state = step.init_state()
    for i in range(3):
        state, _ = step(state, tokens.numpy()[None], lr_scale=1.0 / (i + 1))
    assert step.trace_count == 1
    assert step._jitted._cache_size() == 1


def test_bf16_steps_keep_float32_masters_and_read_the_compute_copy_their_update_wrote(setup):
    """A bf16 step keeps float32 master weights and casts them once (the first step); each later
    step reads the copy the previous update wrote, with the very losses and parameters of casting
    afresh every step, and gradients taken through the copy equal those taken through the cast."""
    cfg, model, tokens, _ = setup
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype="bfloat16"))
    casts, cast = [], step._jitted_copy
    step._jitted_copy = lambda params: casts.append(1) or cast(params)
    batch = tokens.numpy()[None]

    def run(carry: bool):
        state, losses = step.init_state(), []
        for _ in range(3):
            if not carry:
                step._carried = None
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return state, losses

    carried, carried_losses = run(carry=True)
    assert all(p.dtype == jnp.float32 for p in carried.params.values())
    eager_loss = eager_grads(model, tokens)[0]["loss"].item()
    assert abs(carried_losses[0] - eager_loss) / eager_loss < 2e-2
    assert len(casts) == 1
    copy = step._carried[1]
    assert set(copy) == {n for n in carried.params if "router" not in n}       # the router stays float32
    for name, p in copy.items():
        assert p.dtype == jnp.bfloat16 and np.array_equal(np.asarray(p), np.asarray(carried.params[name].astype(p.dtype)))
    grads_of = jax.jit(step._grads)
    through_cast = grads_of(carried.params, batch[0])[1]
    through_copy = grads_of({**carried.params, **copy}, batch[0])[1]
    for name, g in through_cast.items():
        assert through_copy[name].dtype == jnp.float32 and np.array_equal(np.asarray(g), np.asarray(through_copy[name]))
    fresh, fresh_losses = run(carry=False)
    assert len(casts) == 4 and fresh_losses == carried_losses
    assert all(np.array_equal(np.asarray(fresh.params[n]), np.asarray(carried.params[n])) for n in fresh.params)


def test_wrong_token_shape_is_a_clear_error(setup):
    cfg, model, tokens, step = setup
    with pytest.raises(ValueError, match="micro_batches"):
        step(step.init_state(), tokens.numpy())
