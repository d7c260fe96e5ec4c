"""Grouped expert MLP (GPT-OSS): up projection + clamped SwiGLU, then down projection.

x [M, H] rows sorted by expert; group_sizes [E] int32 (sum == M, empty groups allowed);
gate_up [E, H, 2I] with gate/up interleaved (gate = [..., ::2], up = [..., 1::2]);
gate_up_bias [E, 2I]; down [E, I, H]; down_bias [E, H]. Each row goes through its own expert only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def clamped_swiglu(gate_up, *, alpha: float, limit: float):
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(alpha * gate))


def expert_of_rows(group_sizes, num_rows: int):
    """Expert index of each sorted row, [M] int32."""
    return jnp.repeat(jnp.arange(group_sizes.shape[0], dtype=jnp.int32), group_sizes, total_repeat_length=num_rows)


def moe_experts_reference(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                          limit: float = 7.0):
    """Plain JAX/XLA: two `jax.lax.ragged_dot` grouped GEMMs around the activation; the `xla`
    implementation. (Tests also check it against a per-row loop and the eager torch op.)"""
    group_sizes = group_sizes.astype(jnp.int32)
    rows = x.shape[0]
    expert = expert_of_rows(group_sizes, rows)
    h = jax.lax.ragged_dot(x, gate_up, group_sizes, precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    h = clamped_swiglu(h + gate_up_bias[expert].astype(jnp.float32), alpha=alpha, limit=limit).astype(x.dtype)
    y = jax.lax.ragged_dot(h, down, group_sizes, precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    return (y + down_bias[expert].astype(jnp.float32)).astype(x.dtype)
