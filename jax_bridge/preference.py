"""The DPO objective inside the one-jit train step: TRL's losses (torch_model/preference.py has
the eager oracle) from per-answer log-probabilities that the model's `answer_logps` sums per
segment out of the fused cross-entropy's per-token values.

A packed preference row holds whole pairs: pair k is segments 2k + 1 (the chosen answer after
its prompt) and 2k + 2 (the rejected one after the same prompt); the loss weights are 1 on
answer tokens. The reference log-probabilities come either from the batch (field "reference"
[B, S // 2, 2], computed once before training by this same forward: full fine-tuning) or, with
LoRA, from the same forward with the adapters switched off: every `lora_B` zero (B A x = 0) and
`modules_to_save` copies replaced by peft's original modules, under stop_gradient. No second
model is built either way.

Micro-batches: each micro-batch's loss is its sum over valid pairs (both answers trained)
divided by the valid pairs of the whole step, so the micro-batch gradients add up to the big
batch's mean over pairs; metrics are such shares too and are summed over micro-batches.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from torch_model.lora import base_parameter_of, is_adapter_parameter, is_trained_copy, original_of
from torch_model.preference import METRICS, PreferenceConfig, pair_view

REFERENCE_FIELD = "reference"


def segment_counts(tokens: dict):
    """Trained label tokens per segment [B, S + 1] of one packed batch [B, S + 1]."""
    w, seg = tokens["weights"][:, 1:], tokens["segment_ids"][:, 1:]
    rows = jnp.arange(w.shape[0])[:, None]
    return jnp.zeros((w.shape[0], w.shape[1] + 1), jnp.float32).at[rows, seg].add(w)


def valid_pairs(tokens: dict):
    """[B, S // 2] bool: the pair slot holds a pair whose two answers both have trained tokens."""
    nc, nr = pair_view(segment_counts(tokens))
    return (nc > 0) & (nr > 0)


def step_pairs(tokens: dict):
    """Valid pairs of a whole step (tokens: [micro, B, S + 1] arrays), at least 1."""
    return jnp.maximum(jax.vmap(lambda t: valid_pairs(t).sum())(tokens).sum(), 1).astype(jnp.float32)


def reference_params(params: dict) -> dict:
    """The LoRA model's parameters with the adapters switched off: each lora_B zero, each
    modules_to_save copy replaced by peft's original module (the base's weights)."""
    out = {}
    for name, value in params.items():
        if is_adapter_parameter(name) and base_parameter_of(name)[1] == "B":
            value = jnp.zeros_like(value)
        elif is_trained_copy(name):
            value = params[original_of(name)]
        out[name] = value
    return out


class PreferenceObjective:
    """loss(params, tokens, denominator, router_loss_scale) -> (loss, metrics) for the step.
    `answer_forward(params, *args)` is the model's `answer_logps` as a JAX function (the step's
    layered forward of that method); `reference` is "adapters" (LoRA: the same parameters, the
    adapters off) or "batch" (precomputed, in tokens["reference"])."""

    def __init__(self, cfg: PreferenceConfig, answer_forward, reference: str):
        # The step's interface to an objective (GRPO's has the same): what its micro-batch metrics
        # sum, and the whole step's denominator.
        if reference not in ("adapters", "batch"):
            raise ValueError(f"preference reference must be 'adapters' or 'batch', found {reference!r}")
        self.cfg, self.answer_forward, self.reference = cfg, answer_forward, reference
        self.summed, self.step_denominator = SUMMED, step_pairs

    @property
    def batch_fields(self) -> tuple[str, ...]:
        """The float32 fields a packed batch carries besides the token fields: the stored reference."""
        return (REFERENCE_FIELD,) if self.reference == "batch" else ()

    def evaluate(self, params, tokens: dict) -> dict:
        """Metrics summed over the batch's pairs (denominator 1): the caller averages over batches."""
        return self.loss(params, tokens, jnp.float32(1.0))[1]

    def answer_sums(self, params, tokens: dict, router_loss_scale: float = 1.0):
        """(per-pair log-probability sums [B, S // 2, 2] (chosen, rejected), router losses)."""
        out = self.answer_forward(params, tokens["tokens"][:, :-1], tokens["tokens"][:, 1:],
                                  tokens["positions"][:, :-1], tokens["segment_ids"][:, :-1],
                                  tokens["weights"][:, 1:], tokens["segment_ids"][:, 1:], router_loss_scale)
        return jnp.stack(pair_view(out["sums"]), -1), out["aux"]

    def loss(self, params, tokens: dict, denominator=None, router_loss_scale: float = 1.0):
        policy, aux = self.answer_sums(params, tokens, router_loss_scale)
        if self.reference == "batch":
            ref = tokens[REFERENCE_FIELD].astype(jnp.float32)
        else:
            ref, _ = self.answer_sums(reference_params(params), tokens, router_loss_scale)
        ref = jax.lax.stop_gradient(ref)
        counts = jnp.stack(pair_view(segment_counts(tokens)), -1)             # [B, P, 2]
        valid = (counts[..., 0] > 0) & (counts[..., 1] > 0)
        if self.cfg.loss == "ipo":      # TRL: IPO on length-averaged log-probabilities
            n = jnp.where(counts > 0, counts, 1.0)
            policy, ref = policy / n, ref / n
        pc, pr, rc, rr = policy[..., 0], policy[..., 1], ref[..., 0], ref[..., 1]
        losses, chosen, rejected = dpo_losses(self.cfg, pc, pr, rc, rr)
        v = valid.astype(jnp.float32)
        denom = jnp.maximum(v.sum(), 1.0) if denominator is None else denominator
        share = lambda x: (x * v).sum() / denom       # noqa: E731
        dpo = share(losses)
        metrics = {"dpo_loss": dpo, "pairs": v.sum(), "rewards/chosen": share(chosen),
                   "rewards/rejected": share(rejected), "rewards/margins": share(chosen - rejected),
                   "rewards/accuracies": share((chosen > rejected).astype(jnp.float32)),
                   "logps/chosen": share(jax.lax.stop_gradient(pc)), "logps/rejected": share(jax.lax.stop_gradient(pr))}
        loss = dpo + aux
        metrics["loss"] = loss
        return loss, metrics


def dpo_losses(cfg: PreferenceConfig, chosen, rejected, ref_chosen, ref_rejected):
    """Per-pair losses and (stopped) rewards, as torch_model.preference.dpo_losses."""
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if cfg.loss == "sigmoid":
        losses = (-jax.nn.log_sigmoid(cfg.beta * logits) * (1 - cfg.label_smoothing)
                  - jax.nn.log_sigmoid(-cfg.beta * logits) * cfg.label_smoothing)
    else:
        losses = (logits - 1 / (2 * cfg.beta)) ** 2
    sg = jax.lax.stop_gradient
    return losses, cfg.beta * sg(chosen - ref_chosen), cfg.beta * sg(rejected - ref_rejected)


# Summed over micro-batches (each is a share of the step's mean over pairs).
SUMMED = ("loss", "dpo_loss", "pairs", *METRICS)
