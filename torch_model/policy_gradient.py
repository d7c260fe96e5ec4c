"""Group relative policy optimization as TRL's GRPOTrainer computes it, in plain torch: the typed
`rl` objective settings, the advantage formulas, and the eager reference of the loss, the oracle
the lowered step is tested against (jax_bridge/policy_gradient.py computes the same on packed
rows from the fused cross-entropy's per-token values).

Each prompt gets G completions with rewards r. Advantages: A = r - mean_group(r), divided by
(std + 1e-4) where std is the group's (scale_rewards=group), the batch's (batch) or not at all
(none); std is torch's unbiased one, as TRL. Per completion token t, with the policy's
log-probability logp, the rollout policy's logp_old (= logp, stopped, when iterations == 1) and
the reference's ref:
  log_w  = logp - logp_old                          (ratio=token)
           sum_t (logp - logp_old) / |o|            (ratio=sequence: GSPO, one weight per sequence)
  w      = exp(log_w),  w_clip = clip(w, 1 - epsilon, 1 + epsilon_high)
  loss_t = -min(w A, w_clip A) + beta (exp(ref - logp) - (ref - logp) - 1)     (k3 KL)
aggregated over the completion tokens as
  dapo:    sum_t loss_t / (completion tokens of the batch)
  grpo:    mean over completions of (sum_t loss_t / |o|)
  dr_grpo: sum_t loss_t / (completions x max_new_tokens)
With mask_truncated, a completion that hit max_new_tokens without a stop has no trained token
(it still counts as a completion for grpo's and dr_grpo's means, as in TRL).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_model.config import ConfigError

LOSSES = ("dapo", "grpo", "dr_grpo")
RATIOS = ("token", "sequence")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4


@dataclass(frozen=True)
class PolicyGradientConfig:
    """The objective's settings (TRL's GRPOConfig names and defaults where they apply)."""
    loss: str = "dapo"
    ratio: str = "token"             # TRL's importance_sampling_level
    epsilon: float = 0.2
    epsilon_high: float | None = None     # None: = epsilon (TRL)
    beta: float = 0.0
    iterations: int = 1              # TRL's num_iterations (mu)
    scale_rewards: str = "group"
    mask_truncated: bool = False     # TRL's mask_truncated_completions
    max_new_tokens: int = 256        # TRL's max_completion_length (dr_grpo's normaliser)
    temperature: float = 1.0         # the policy's log-probabilities are under softmax(z / T), as TRL's

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ConfigError(f"rl --loss must be one of {', '.join(LOSSES)}, found {self.loss!r}")
        if self.ratio not in RATIOS:
            raise ConfigError(f"rl --ratio must be one of {', '.join(RATIOS)}, found {self.ratio!r}")
        if self.scale_rewards not in SCALES:
            raise ConfigError(f"rl --scale-rewards must be one of {', '.join(SCALES)}, found {self.scale_rewards!r}")
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"rl --epsilon must be in (0, 1), found {self.epsilon:g}")
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)
        if not self.epsilon_high > 0:
            raise ConfigError(f"rl --epsilon-high must be > 0, found {self.epsilon_high:g}")
        if self.beta < 0:
            raise ConfigError(f"rl --beta must be >= 0, found {self.beta:g}")
        if self.iterations < 1:
            raise ConfigError(f"rl --iterations must be >= 1, found {self.iterations}")
        if not self.temperature > 0:
            raise ConfigError(f"rl --temperature must be > 0, found {self.temperature:g}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"rl --max-new-tokens must be >= 1, found {self.max_new_tokens}")

    @property
    def needs_logp_old(self) -> bool:
        """mu > 1: later updates weigh by the rollout policy's log-probabilities, kept from the first."""
        return self.iterations > 1


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group"):
    """(advantages [N], zero_std [N] bool) of rewards [N] in groups of `group_size` consecutive
    completions (TRL's _generate_and_score_completions). zero_std marks completions whose group
    (or, with scale=batch, whose batch) has equal rewards: no policy-gradient signal."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards: expected [groups x {group_size}], found shape {tuple(rewards.shape)}")
    if scale not in SCALES:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALES)}, found {scale!r}")
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(1).repeat_interleave(group_size)
    if scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        std = grouped.std(1).repeat_interleave(group_size)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    return advantages, zero_std


def sequence_logps_eager(model, prompt: torch.Tensor, completion: torch.Tensor, temperature: float = 1.0):
    """Log-probabilities [len(completion)] under softmax(z / temperature) of one completion after
    its prompt, run alone (no packing) through the model's full logits and log_softmax (not the
    fused cross-entropy)."""
    ids = torch.cat([prompt, completion]).long()[None]
    hidden, _ = model.model(ids[:, :-1])
    logp = torch.log_softmax(model.lm_head(hidden).float() / temperature, -1)[0]
    return logp[len(prompt) - 1:].gather(-1, completion.long()[:, None])[:, 0]


def pad_completions(values, length: int) -> torch.Tensor:
    """A list of 1-D tensors -> [N, length], zero-padded on the right."""
    out = torch.zeros(len(values), length, dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, :len(v)] = v
    return out


def grpo_loss_eager(model, cfg: PolicyGradientConfig, prompts, completions, advantages, truncated,
                    logp_old=None, ref_logps=None):
    """(loss, metrics) as TRL's GRPOTrainer._compute_loss, on completions laid out [N, max length]
    with a completion mask. prompts / completions: lists of 1-D token tensors; advantages [N];
    truncated [N] bool; logp_old / ref_logps: lists of per-token tensors (None: logp detached /
    no reference). Dense or with zero router loss coefficients (each sequence runs alone here)."""
    n = len(completions)
    longest = max(len(c) for c in completions)
    logps = [sequence_logps_eager(model, p, c, cfg.temperature) for p, c in zip(prompts, completions)]
    mask = pad_completions([torch.ones(len(c)) for c in completions], longest)
    if cfg.mask_truncated:
        mask = mask * (~torch.as_tensor(truncated, dtype=torch.bool)).float()[:, None]
    logp = torch.zeros(n, longest).index_put((torch.arange(n).repeat_interleave(torch.tensor([len(c) for c in completions])),
                                              torch.cat([torch.arange(len(c)) for c in completions])), torch.cat(logps))
    old = logp.detach() if logp_old is None else pad_completions(logp_old, longest)
    log_ratio = logp - old
    if cfg.ratio == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_weights)
    coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
    adv = torch.as_tensor(advantages, dtype=torch.float32)[:, None]
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    metrics = {}
    if cfg.beta:
        ref = pad_completions(ref_logps, longest)
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + cfg.beta * per_token_kl
        metrics["kl"] = (per_token_kl * mask).sum() / mask.sum().clamp(min=1.0)
    if cfg.loss == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif cfg.loss == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (n * cfg.max_new_tokens)
    else:
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    tokens = mask.sum().clamp(min=1.0)
    coef = coef_1.expand_as(mask)
    metrics["clip_ratio/low"] = (((coef < 1 - cfg.epsilon) & (adv < 0)).float() * mask).sum() / tokens
    metrics["clip_ratio/high"] = (((coef > 1 + cfg.epsilon_high) & (adv > 0)).float() * mask).sum() / tokens
    return loss, {k: v.detach() for k, v in metrics.items()}
