"""Rotary position embedding with YaRN scaling, exactly as transformers computes it for GptOss
(`_compute_yarn_parameters` with truncate=False; halves rotated, not interleaved)."""
from __future__ import annotations

import math

import torch

from torch_model.config import ModelConfig


def yarn_inv_freq(cfg: ModelConfig) -> tuple[list[float], float]:
    """Inverse frequencies [head_dim/2] and the attention scaling applied to cos/sin."""
    dim, base, factor = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor
    exponents = [2 * i / dim for i in range(dim // 2)]
    # torch float32 arithmetic, like transformers, so parity holds to the last bit we can.
    pos_freqs = base ** torch.tensor(exponents, dtype=torch.float32)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations):
        return dim * math.log(cfg.rope_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(correction_dim(cfg.rope_beta_fast), 0)
    high = min(correction_dim(cfg.rope_beta_slow), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    attention_scaling = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq.tolist(), attention_scaling


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [T, head_dim/2] for integer positions [T]."""
    inv_freq, scaling = yarn_inv_freq(cfg)
    freqs = positions.float()[:, None] * torch.tensor(inv_freq, dtype=torch.float32, device=positions.device)[None, :]
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; rotates the first half against the second half."""
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
