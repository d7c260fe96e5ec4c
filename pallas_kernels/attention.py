"""Causal GQA attention with learned sinks and optional sliding window.

Layout: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (Tk >= Tq, queries are the last Tq positions),
sinks [Hq]. sliding_window W > 0: query i sees keys i-W+1..i; W == 0: all keys <= i.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q, k, v, sinks, *, sliding_window: int, scale: float):
    """Plain JAX: materializes the [Tq, Tk] scores; the oracle and the `xla` implementation."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    qg = q.reshape(b, hkv, group, tq, d).astype(jnp.float32)
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    qpos = jnp.arange(tk - tq, tk)[:, None]
    kpos = jnp.arange(tk)[None, :]
    visible = kpos <= qpos
    if sliding_window > 0:
        visible = visible & (kpos > qpos - sliding_window)
    scores = jnp.where(visible, scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, group, 1, 1), (b, hkv, group, tq, 1))
    combined = jnp.concatenate([scores, sink], axis=-1)
    probs = jax.nn.softmax(combined, axis=-1)[..., :-1]
    out = jnp.einsum("bhgqk,bhkd->bhgqd", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, hq, tq, d).astype(q.dtype)
