"""Direct preference optimization as TRL's DPOTrainer computes it, in plain torch: the typed
`--dpo` settings and the eager reference of the losses, the oracle the lowered step is tested
against (jax_bridge/preference.py computes the same from the fused cross-entropy).

A pair is a prompt with a chosen and a rejected answer. Each answer's log-probability is the sum
over its answer tokens (IPO: their mean); with the reference model's log-probabilities,
logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected) and
  sigmoid: -logsigmoid(beta * logits) * (1 - label_smoothing) - logsigmoid(-beta * logits) * label_smoothing
  ipo:     (logits - 1 / (2 * beta)) ** 2
rewards/chosen = beta * (policy_chosen - ref_chosen), rewards/rejected likewise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torch_model.config import ConfigError

LOSSES = ("sigmoid", "ipo")
# Logged per step and per evaluation: TRL's names.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class PreferenceConfig:
    """`beta=0.1,loss=sigmoid,label_smoothing=0` as a value (TRL's DPOConfig defaults)."""
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        if not self.beta > 0:
            raise ConfigError(f"--dpo: beta must be > 0, found {self.beta:g}")
        if self.loss not in LOSSES:
            raise ConfigError(f"--dpo: loss must be one of {', '.join(LOSSES)}, found {self.loss!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--dpo: label_smoothing must be in [0, 0.5), found {self.label_smoothing:g}")
        if self.label_smoothing and self.loss != "sigmoid":
            raise ConfigError(f"--dpo: label_smoothing applies to loss=sigmoid (found loss={self.loss})")

    def __str__(self) -> str:
        return f"beta={self.beta:g},loss={self.loss},label_smoothing={self.label_smoothing:g}"


def parse_preference_spec(text: str) -> PreferenceConfig:
    """Parse `key=value,...` (keys beta, loss, label_smoothing)."""
    fields: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("beta", "loss", "label_smoothing"):
            raise ConfigError(f"--dpo: expected key=value with keys beta, loss, label_smoothing; found {part!r}")
        if key == "loss":
            fields[key] = value
            continue
        try:
            fields[key] = float(value)
        except ValueError:
            raise ConfigError(f"--dpo: {key} must be a number, found {value!r}") from None
    return PreferenceConfig(**fields)


def dpo_losses(cfg: PreferenceConfig, chosen, rejected, ref_chosen, ref_rejected):
    """Per-pair losses and rewards from per-pair log-probabilities (already length-averaged for
    IPO), as TRL's DPOTrainer.dpo_loss."""
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if cfg.loss == "sigmoid":
        losses = (-F.logsigmoid(cfg.beta * logits) * (1 - cfg.label_smoothing)
                  - F.logsigmoid(-cfg.beta * logits) * cfg.label_smoothing)
    else:
        losses = (logits - 1 / (2 * cfg.beta)) ** 2
    return losses, cfg.beta * (chosen - ref_chosen).detach(), cfg.beta * (rejected - ref_rejected).detach()


def answer_logps_eager(model, tokens, segment_ids, positions, weights):
    """Eager oracle: per-answer log-probability sums and token counts [B, S + 1] (index: segment
    id, 0 = padding) of one packed batch [B, S + 1], from the model's full logits and
    log_softmax (not the fused cross-entropy), plus the model's router stats."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    hidden, stats = model.model(inputs, positions=positions[:, :-1], segment_ids=segment_ids[:, :-1])
    logp = torch.log_softmax(model.lm_head(hidden).float(), -1).gather(-1, labels[..., None].long())[..., 0]
    w = weights[:, 1:].float()
    seg = segment_ids[:, 1:].long()
    b, s = labels.shape
    sums = torch.zeros(b, s + 1, dtype=logp.dtype).scatter_add(1, seg, logp * w)
    counts = torch.zeros(b, s + 1, dtype=w.dtype).scatter_add(1, seg, w)
    return sums, counts, stats


def pair_view(per_segment):
    """[..., S + 1] per-segment values -> (chosen, rejected) [..., S // 2]: pair k of a row is
    segments 2k + 1 (chosen) and 2k + 2 (rejected), as the loader numbers them. Plain slicing:
    torch tensors and JAX arrays alike (jax_bridge/preference.py uses it too)."""
    s = per_segment.shape[-1] - 1
    return per_segment[..., 1:1 + 2 * (s // 2):2], per_segment[..., 2:2 + 2 * (s // 2):2]


def dpo_loss_eager(model, cfg: PreferenceConfig, batch: dict, reference=None, denominator=None):
    """(loss, metrics) of one packed preference batch (tokens, weights, segment_ids, positions
    [B, S + 1]; the model in its training mode). reference: [B, S // 2, 2] per-pair reference
    log-probability sums (chosen, rejected); None: the model itself under no_grad (policy =
    reference). The loss is the mean over valid pairs (both answers trained), or their sum over
    `denominator`, plus the router losses as in the model's training loss."""
    sums, counts, stats = answer_logps_eager(model, batch["tokens"], batch["segment_ids"], batch["positions"],
                                             batch["weights"])
    (pc, pr), (nc, nr) = pair_view(sums), pair_view(counts)
    if reference is None:
        with torch.no_grad():
            ref_sums, _, _ = answer_logps_eager(model, batch["tokens"], batch["segment_ids"], batch["positions"],
                                                batch["weights"])
        rc, rr = pair_view(ref_sums)
    else:
        rc, rr = reference[..., 0], reference[..., 1]
    valid = (nc > 0) & (nr > 0)
    if cfg.loss == "ipo":
        pc, pr, rc, rr = (v / torch.where(valid, n, torch.ones_like(n)) for v, n in ((pc, nc), (pr, nr), (rc, nc), (rr, nr)))
    losses, chosen_rewards, rejected_rewards = dpo_losses(cfg, pc, pr, rc, rr)
    v = valid.float()
    denom = v.sum().clamp(min=1) if denominator is None else denominator
    loss = (losses * v).sum() / denom
    cfg_m = model.cfg
    if cfg_m.is_moe:
        loss = loss + cfg_m.router_aux_loss_coef * torch.stack([s["balance"] for s in stats]).mean() \
            + cfg_m.router_z_loss_coef * torch.stack([s["z"] for s in stats]).mean()
    metrics = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
               "rewards/margins": chosen_rewards - rejected_rewards,
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
               "logps/chosen": pc.detach(), "logps/rejected": pr.detach()}
    return loss, {k: (m * v).sum() / denom for k, m in metrics.items()}
