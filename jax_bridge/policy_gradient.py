"""The GRPO objective (with its DAPO, Dr. GRPO and GSPO variants) inside the one-jit train step:
TRL's formulas (torch_model/policy_gradient.py has them and the eager oracle) on packed rows,
from per-token log-probabilities that the model's `token_logps` takes out of the fused
cross-entropy (no [tokens x vocabulary] logits: per token the step holds the hidden state, the
label, its log-probability and the fields below).

A packed rollout row holds whole sequences: segment k (numbered 1, 2, ... in the row, 0 =
padding) is one prompt followed by one of its completions; the loss weights are 1 on the
completion's tokens (0 on a truncated one under mask_truncated). Per-token float32 fields, aligned
with `tokens` (the value at index i belongs to token i, as a label):
  advantages  the completion's advantage on each of its tokens
  logp_old    the rollout policy's log-probabilities (iterations > 1 only; else logp, stopped)
  ref_logps   the reference's (beta > 0 only), computed at rollout time by this step's own
              forward: with LoRA on the same parameters with the adapters off
              (jax_bridge/preference.reference_params, as DPO), otherwise on a frozen copy of the
              starting parameters in the compute dtype.

Micro-batches: each micro-batch's loss is its part of the step's sum divided by the step's
denominator (dapo: the step's completion tokens; grpo: its completions; dr_grpo: completions x
max_new_tokens), so the micro-batch gradients add up to the whole batch's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from torch_model.policy_gradient import PolicyGradientConfig

ADVANTAGES, LOGP_OLD, REF_LOGPS = "advantages", "logp_old", "ref_logps"
# Summed over micro-batches (each is a share of the step's denominators).
SUMMED = ("loss", "pg_loss", "kl", "clip_ratio/low", "clip_ratio/high", "completion_tokens", "completions")


def per_token_fields(cfg: PolicyGradientConfig) -> tuple[str, ...]:
    """The float32 per-token fields a rollout batch carries for this objective."""
    return (ADVANTAGES, *((LOGP_OLD,) if cfg.needs_logp_old else ()), *((REF_LOGPS,) if cfg.beta else ()))


def completions(tokens: dict):
    """Completions (segments) of a packed batch of any leading shape: the rows' largest segment ids."""
    return tokens["segment_ids"].max(-1).sum().astype(jnp.float32)


def segment_sum(values, seg):
    """[B, T] values summed per segment id -> [B, T + 1] (index: segment id)."""
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros((values.shape[0], values.shape[1] + 1), jnp.float32).at[rows, seg].add(values)


def per_segment_gather(per_segment, seg):
    """[B, T + 1] per-segment values -> [B, T], each token's segment's value."""
    return jnp.take_along_axis(per_segment, seg, axis=1)


class PolicyGradientObjective:
    """loss(params, tokens, denominator, router_loss_scale) -> (loss, metrics) for the step;
    `token_forward(params, *args)` is the model's `token_logps` as a JAX function (the step's
    layered forward of that method)."""

    summed = SUMMED

    def __init__(self, cfg: PolicyGradientConfig, token_forward):
        self.cfg, self.token_forward = cfg, token_forward
        self.fields = per_token_fields(cfg)

    @property
    def batch_fields(self) -> tuple[str, ...]:
        """The float32 fields a packed batch carries besides the token fields (per token)."""
        return self.fields

    def evaluate(self, params, tokens: dict) -> dict:
        """This batch's metrics, with its own normalisers."""
        return self.loss(params, tokens)[1]

    def token_logps(self, params, tokens: dict, router_loss_scale: float = 1.0):
        """(per-token log-probabilities [B, S] of the labels tokens[:, 1:] (0 off the completions),
        router losses)."""
        out = self.token_forward(params, tokens["tokens"][:, :-1], tokens["tokens"][:, 1:],
                                 tokens["positions"][:, :-1], tokens["segment_ids"][:, :-1],
                                 tokens["weights"][:, 1:], router_loss_scale, self.cfg.temperature)
        return out["logps"], out["aux"]

    def step_denominator(self, tokens: dict) -> dict:
        """The step's normalisers from all its micro-batches (arrays [micro, B, S + 1])."""
        trained = jnp.maximum(tokens["weights"][..., 1:].sum(), 1.0)
        n = jnp.maximum(completions(tokens), 1.0)
        loss = {"dapo": trained, "grpo": n, "dr_grpo": n * self.cfg.max_new_tokens}[self.cfg.loss]
        return {"loss": loss, "tokens": trained}

    def loss(self, params, tokens: dict, denominator: dict | None = None, router_loss_scale: float = 1.0):
        cfg = self.cfg
        if denominator is None:
            denominator = self.step_denominator(jax.tree.map(lambda x: x[None], tokens))
        logp, aux = self.token_logps(params, tokens, router_loss_scale)
        w = tokens["weights"][:, 1:].astype(jnp.float32)
        on = w > 0
        seg = tokens["segment_ids"][:, 1:]
        adv = tokens[ADVANTAGES][:, 1:].astype(jnp.float32)
        sg = jax.lax.stop_gradient
        old = tokens[LOGP_OLD][:, 1:] if cfg.needs_logp_old else sg(logp)
        log_ratio = jnp.where(on, logp - old, 0.0)
        if cfg.ratio == "sequence":     # GSPO: the mean log-ratio of each sequence, for all its tokens
            counts = segment_sum(w, seg)
            log_weights = per_segment_gather(segment_sum(log_ratio * w, seg) / jnp.maximum(counts, 1.0), seg)
        else:
            log_weights = log_ratio
        coef_1 = jnp.exp(log_weights)
        coef_2 = jnp.clip(coef_1, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        per_token = -jnp.minimum(coef_1 * adv, coef_2 * adv)
        share_tokens = lambda x: (x * w).sum() / denominator["tokens"]       # noqa: E731
        metrics = {}
        if cfg.beta:
            delta = jnp.where(on, tokens[REF_LOGPS][:, 1:] - logp, 0.0)
            kl = jnp.exp(delta) - delta - 1
            per_token = per_token + cfg.beta * kl
            metrics["kl"] = share_tokens(sg(kl))
        if cfg.loss == "grpo":          # each completion's mean over its tokens, then the mean
            per_seq = segment_sum(per_token * w, seg) / jnp.maximum(segment_sum(w, seg), 1.0)
            pg = per_seq[:, 1:].sum() / denominator["loss"]
        else:
            pg = (per_token * w).sum() / denominator["loss"]
        low = (coef_1 < 1 - cfg.epsilon) & (adv < 0)
        high = (coef_1 > 1 + cfg.epsilon_high) & (adv > 0)
        metrics.update({"pg_loss": pg, "clip_ratio/low": share_tokens(low.astype(jnp.float32)),
                        "clip_ratio/high": share_tokens(high.astype(jnp.float32)),
                        "completion_tokens": w.sum(), "completions": completions(tokens)})
        loss = pg + aux
        metrics["loss"] = loss
        return loss, metrics
