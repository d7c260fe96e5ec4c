"""Attention of new queries over a KV cache (generation): GQA with sinks, causal or sliding by
token position, each batch row with its own positions.

Layout: q [B, Hq, Tq, D]; k, v [B, Hkv, S, D] (cache slots, any order); q_positions [B, Tq] and
k_positions [B, S] int32, -1 for an empty or padding slot. Key j is visible to query i when
0 <= k_pos[j] <= q_pos[i] and, with a window W > 0, k_pos[j] > q_pos[i] - W.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.platform import dot_precision


def cached_attention_reference(q, k, v, sinks, q_positions, k_positions, *, sliding_window: int, scale: float,
                               platform: str = "cpu"):
    """Plain JAX, the `xla` implementation: [Tq, S] scores per head, softmax with the sink
    column. `platform` is accepted for the registry's uniform signature; plain JAX needs none."""
    del platform
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg = q.reshape(b, hkv, group, tq, d).astype(jnp.float32)
    precision = dot_precision(q.dtype)
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k.astype(jnp.float32), precision=precision) * scale
    qpos = q_positions[:, None, None, :, None]
    kpos = k_positions[:, None, None, None, :]
    visible = (kpos >= 0) & (kpos <= qpos)
    if sliding_window > 0:
        visible = visible & (kpos > qpos - sliding_window)
    scores = jnp.where(visible, scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, group, 1, 1), (b, hkv, group, tq, 1))
    combined = jnp.concatenate([scores, sink], axis=-1)
    probs = jax.nn.softmax(combined, axis=-1)[..., :-1]
    out = jnp.einsum("bhgqk,bhkd->bhgqd", probs, v.astype(jnp.float32), precision=precision)
    return out.reshape(b, hq, tq, d).astype(q.dtype)
