"""Attention of new queries over a KV cache (generation): GQA with sinks, causal or sliding by
token position, each batch row with its own positions.

Layout: q [B, Hq, Tq, D]; k, v [B, Hkv, S, D] (cache slots, any order); q_positions [B, Tq] and
k_positions [B, S] int32, -1 for an empty or padding slot. Key j is visible to query i when
0 <= k_pos[j] <= q_pos[i] and, with a window W > 0, k_pos[j] > q_pos[i] - W.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.attention import attention_over_positions
from pallas_kernels.platform import dot_precision


def cached_attention_reference(q, k, v, sinks, q_positions, k_positions, *, sliding_window: int, scale: float,
                               platform: str = "cpu"):
    """Plain JAX, the `xla` implementation: [Tq, S] scores per head, softmax with the sink
    column. `platform` is accepted for the registry's uniform signature; plain JAX needs none."""
    del platform
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    precision = dot_precision(q.dtype)
    out = attention_over_positions(q.reshape(b, hkv, hq // hkv, tq, d).astype(jnp.float32), k.astype(jnp.float32),
                                   v.astype(jnp.float32), sinks, q_positions, k_positions,
                                   sliding_window=sliding_window, scale=scale, score_precision=precision,
                                   value_precision=precision)
    return out.reshape(b, hq, tq, d).astype(q.dtype)
