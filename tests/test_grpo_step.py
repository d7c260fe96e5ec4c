"""The GRPO objective in the lowered train step against the eager torch oracle beside
the model (torch_model/policy_gradient.py: each completion run alone through the full logits and
log_softmax, TRL's formulas on a [completions x length] layout): loss within 1e-5 and every
gradient within 1e-4 (float32, CPU) on packed rows of prompts, completions and padding, for each
loss type, both ratios, beta > 0 and mu > 1, with logp_old perturbed so tokens clip low and high,
mixed-sign advantages, a None reward and a truncated completion. Plus the advantage formulas
against hand-computed values.

One tiny MoE model (two layers: sliding window and full), router loss coefficients 0 (the
router's losses are batch statistics, which running sequences alone would change).
"""
import functools
import math

import jax
import numpy as np
import pytest
import torch

from helpers import rel_err
from jax_bridge.policy_gradient import LOGP_OLD, REF_LOGPS, per_token_fields
from jax_bridge.preference import reference_params
from jax_bridge.step import StepConfig, TrainStep
from torch_model.config import ConfigError, get_preset
from torch_model.lora import apply_lora, parse_lora_spec
from torch_model.model import GptOssForCausalLM
from torch_model.policy_gradient import (PolicyGradientConfig, group_advantages, grpo_loss_eager,
                                         sequence_logps_eager)
from train.rl.batch import Rollout, pack_rollouts, unpack_tokens

SEQ = 40
ROWS = 2
G = 3
MAX_NEW = 7


def tiny_model(seed=1):
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(vocab_size=96, d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2,
                                     n_experts=4, expert_dim=16, sliding_window=6, router_aux_loss_coef=0.0,
                                     router_z_loss_coef=0.0, max_seq_len=SEQ)
    model = GptOssForCausalLM(cfg)
    model.reset_parameters(seed=seed)
    return model


def nansum_rewards(per_func):
    """Weighted rewards per completion with None left out (TRL's nansum); all None -> 0."""
    return torch.tensor([sum(v for v in row if v is not None) for row in per_func], dtype=torch.float32)


# Two prompts x G = 3 completions. Rewards from two functions; completion 2 has one None, completion
# 5 both None (reward 0). Completion 4 is truncated (MAX_NEW tokens, no stop).
PROMPT_LENGTHS = (5, 4)
COMPLETION_LENGTHS = (3, 6, 2, 5, MAX_NEW, 4)
PER_FUNC = [(1.0, 0.5), (0.0, 0.0), (None, 1.0), (1.0, 1.0), (0.0, 0.25), (None, None)]
TRUNCATED = (False, False, False, False, True, False)


def rollouts():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 96, n)) for n in PROMPT_LENGTHS]
    adv, _ = group_advantages(nansum_rewards(PER_FUNC), G)
    return [Rollout(prompts[i // G], list(rng.integers(1, 96, n)), float(adv[i]), TRUNCATED[i])
            for i, n in enumerate(COMPLETION_LENGTHS)]


@functools.lru_cache(maxsize=None)
def full_step(cfg: PolicyGradientConfig):
    model = tiny_model()
    return model, TrainStep(model, step_cfg=StepConfig(kernels="xla", compute_dtype="float32", policy_gradient=cfg))


def with_logps(model, cfg, rs, seed=3):
    """The rollouts with logp_old (the true values shifted: a per-sequence offset of +-0.6 plus
    noise, so tokens and sequences clip on both sides) and ref_logps (true values plus noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, r in enumerate(rs):
        with torch.no_grad():
            true = sequence_logps_eager(model, torch.tensor(r.prompt), torch.tensor(r.completion),
                                        cfg.temperature).numpy()
        offset = 0.6 if i % 2 else -0.6
        old = true + offset + rng.normal(0, 0.3, true.shape) if cfg.needs_logp_old else None
        ref = true + rng.normal(0, 0.5, true.shape) if cfg.beta else None
        out.append(Rollout(r.prompt, r.completion, r.advantage, r.truncated,
                           None if old is None else list(old.astype(np.float32)),
                           None if ref is None else list(ref.astype(np.float32))))
    return out


CASES = {
    "dapo-token-mu2": PolicyGradientConfig(loss="dapo", ratio="token", iterations=2, epsilon_high=0.28,
                                           max_new_tokens=MAX_NEW),
    "grpo-sequence-mu2-beta-masktrunc": PolicyGradientConfig(loss="grpo", ratio="sequence", iterations=2, beta=0.04,
                                                             mask_truncated=True, max_new_tokens=MAX_NEW),
    "dr_grpo-token-mu2-beta-T0.7": PolicyGradientConfig(loss="dr_grpo", ratio="token", iterations=2, beta=0.1,
                                                        max_new_tokens=MAX_NEW, temperature=0.7),
    "grpo-token-mu1": PolicyGradientConfig(loss="grpo", ratio="token", max_new_tokens=MAX_NEW),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lowered_grpo_step_matches_eager_torch(name):
    cfg = CASES[name]
    model, step = full_step(cfg)
    rs = with_logps(model, cfg, rollouts())
    batch = pack_rollouts(rs, ROWS, SEQ, per_token_fields(cfg), cfg.mask_truncated)
    assert (batch["segment_ids"] == 0).any() and batch["segment_ids"].max() >= 3     # padding; packed
    params = step.layer_layout.stack({n: p.detach().numpy() for n, p in model.named_parameters()})
    (loss, out), grads = step.grads(params, batch)
    model.zero_grad()
    eager_loss, eager_metrics = grpo_loss_eager(
        model, cfg, [torch.tensor(r.prompt) for r in rs], [torch.tensor(r.completion) for r in rs],
        torch.tensor([r.advantage for r in rs]), torch.tensor(TRUNCATED),
        None if not cfg.needs_logp_old else [torch.tensor(r.logp_old) for r in rs],
        None if not cfg.beta else [torch.tensor(r.ref_logps) for r in rs])
    eager_loss.backward()
    eager = float(eager_loss.detach())
    assert abs(float(loss) - eager) <= 1e-5 * max(1.0, abs(eager)), (float(loss), eager)
    assert abs(eager) > 1e-3 or not cfg.needs_logp_old
    for key, value in eager_metrics.items():
        assert abs(float(out[key]) - float(value)) <= 1e-5, (key, float(out[key]), float(value))
    if cfg.needs_logp_old:        # the perturbation clips on both sides
        assert float(out["clip_ratio/low"]) > 0 and float(out["clip_ratio/high"]) > 0, out
    lowered = step.layer_params(grads)
    assert max(float(np.abs(np.asarray(g)).max()) for g in lowered.values()) > 0
    for n, p in model.named_parameters():
        err = rel_err(np.asarray(lowered[n]), p.grad.numpy())
        assert err <= 1e-4, (n, err)


def test_token_logps_are_the_eager_log_probabilities_and_unpack_in_order():
    """`TrainStep.token_logps` (what logp_old and the reference come from) gives each completion
    token's log-probability as the oracle does, and `unpack_tokens` returns them per rollout."""
    cfg = CASES["dapo-token-mu2"]
    model, step = full_step(cfg)
    rs = rollouts()
    batch = pack_rollouts(rs, ROWS, SEQ)
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    per_token = np.asarray(step.token_logps(step.layer_layout.stack(params), batch))
    for r, got in zip(rs, unpack_tokens(per_token, rs, SEQ)):
        with torch.no_grad():
            want = sequence_logps_eager(model, torch.tensor(r.prompt), torch.tensor(r.completion)).numpy()
        assert np.abs(got - want).max() <= 1e-5


def test_lora_reference_is_the_base_with_adapters_off():
    """With LoRA the reference is reference_params (every lora_B zero): at the start (B = 0) its
    log-probabilities are the policy's, so the k3 KL is 0 while its gradient flows to lora_B."""
    model = tiny_model()
    wrapped = apply_lora(model, parse_lora_spec("r=2,alpha=4,targets=all-linear"))
    cfg = PolicyGradientConfig(beta=0.5, max_new_tokens=MAX_NEW)
    step = TrainStep(wrapped, step_cfg=StepConfig(kernels="xla", compute_dtype="float32", policy_gradient=cfg))
    state = step.init_state()
    rs = rollouts()
    full = step.full_params(state.params)
    ref = np.asarray(step.token_logps(reference_params(full), pack_rollouts(rs, ROWS, SEQ)))
    rs = [Rollout(r.prompt, r.completion, r.advantage, r.truncated, None, list(v))
          for r, v in zip(rs, unpack_tokens(ref, rs, SEQ))]
    (loss, out), grads = step.grads(state.params, pack_rollouts(rs, ROWS, SEQ, per_token_fields(cfg)))
    assert abs(float(out["kl"])) <= 1e-6
    assert any(float(np.abs(np.asarray(grads[n])).max()) > 0 for n in grads if "lora_B" in n)


def test_group_advantages_against_hand_computed_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    std1 = math.sqrt(1 / 3)                      # unbiased std of (1, 0, 0)
    adv, zero = group_advantages(r, 3, "group")
    want = [(2 / 3) / (std1 + 1e-4), (-1 / 3) / (std1 + 1e-4), (-1 / 3) / (std1 + 1e-4), 0, 0, 0]
    assert np.allclose(adv.numpy(), want, atol=1e-6) and zero.tolist() == [False] * 3 + [True] * 3
    batch_std = math.sqrt((4 * (1 / 3) ** 2 + 2 * (2 / 3) ** 2) / 5)    # unbiased, about the batch mean 2/3
    adv, zero = group_advantages(r, 3, "batch")     # group mean, batch std
    assert abs(batch_std - 0.5163978) < 1e-6
    assert np.allclose(adv.numpy(), [(2 / 3) / (batch_std + 1e-4), (-1 / 3) / (batch_std + 1e-4),
                                     (-1 / 3) / (batch_std + 1e-4), 0, 0, 0], atol=1e-6)
    assert not zero.any()
    adv, _ = group_advantages(r, 3, "none")
    assert np.allclose(adv.numpy(), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], atol=1e-7)
    # None rewards left out of the weighted sum; all None -> 0
    assert nansum_rewards([(None, 1.0), (None, None), (0.5, 0.25)]).tolist() == [1.0, 0.0, 0.75]


def test_loss_normalisers_differ_as_trl_defines_them():
    """One completion of 2 tokens and one of 4, per-token losses 1: dapo 6/6, grpo mean(1, 1),
    dr_grpo 6/(2 x max_new_tokens)."""
    from jax_bridge.policy_gradient import PolicyGradientObjective
    import jax.numpy as jnp

    def constant(params, inputs, labels, positions, segs, weights, scale, temperature):
        return {"logps": jnp.zeros(labels.shape), "aux": jnp.float32(0.0)}

    row = pack_rollouts([Rollout([1, 2], [3, 4], -1.0), Rollout([5], [6, 7, 8, 9], -1.0)], 1, 12)
    for loss, want in (("dapo", 1.0), ("grpo", 1.0), ("dr_grpo", 6 / (2 * 8))):
        obj = PolicyGradientObjective(PolicyGradientConfig(loss=loss, max_new_tokens=8), constant)
        value, out = obj.loss({}, jax.tree.map(jnp.asarray, row))
        assert abs(float(value) - want) <= 1e-6, (loss, float(value))
        assert float(out["completions"]) == 2 and float(out["completion_tokens"]) == 6


def test_settings_refuse_by_name():
    for kwargs, words in (({"loss": "bnpo"}, "--loss must be one of dapo, grpo, dr_grpo"),
                          ({"ratio": "tok"}, "--ratio must be one of token, sequence"),
                          ({"scale_rewards": "x"}, "--scale-rewards"), ({"beta": -1}, "--beta"),
                          ({"iterations": 0}, "--iterations"), ({"epsilon": 1.5}, "--epsilon")):
        with pytest.raises(ConfigError, match=words):
            PolicyGradientConfig(**kwargs)
    assert PolicyGradientConfig(epsilon=0.2).epsilon_high == 0.2
    assert per_token_fields(PolicyGradientConfig(iterations=2, beta=0.1)) == ("advantages", LOGP_OLD, REF_LOGPS)


def test_micro_batches_give_the_whole_batch_gradient():
    """The two packed rows as two micro-batches, each normalised by the whole step's denominator
    (grpo: completions; the KL and clip metrics: completion tokens): their gradients add up to the
    one-batch ones."""
    from jax_bridge.policy_gradient import PolicyGradientObjective

    for name in ("grpo-sequence-mu2-beta-masktrunc",):
        cfg = CASES[name]
        model, step = full_step(cfg)
        batch = pack_rollouts(with_logps(model, cfg, rollouts()), ROWS, SEQ, per_token_fields(cfg), cfg.mask_truncated)
        params = step.layer_layout.stack({n: p.detach().numpy() for n, p in model.named_parameters()})
        (_, _), whole = step.grads(params, batch)
        placed = step.place_batch({k: v[:, None] for k, v in batch.items()}, 1)        # [2 micro, 1 row, S + 1]
        assert isinstance(step.objective, PolicyGradientObjective)
        denominator = step.objective.step_denominator(placed)
        grads_of = jax.jit(lambda p, t, d: step._grads(p, t, d, 0.5)[1])
        parts = [grads_of(params, jax.tree.map(lambda x, i=i: x[i], placed), denominator) for i in range(2)]
        for n in whole:
            assert rel_err(np.asarray(parts[0][n] + parts[1][n]), np.asarray(whole[n])) <= 1e-5, (name, n)
