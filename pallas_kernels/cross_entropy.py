"""Linear cross-entropy: loss of `hidden @ weight.T` against labels without handing back logits.

hidden [N, H], weight [V, H], labels [N] (ignore_index marks tokens without a target).
Returns (nll [N], lse [N]) in float32, both 0 at ignored tokens; the z-loss is coef * lse**2.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def linear_cross_entropy_reference(hidden, weight, labels, *, ignore_index: int = -100):
    """Plain JAX: materializes [N, V] logits; the oracle and the `xla` implementation."""
    logits = jnp.einsum("nh,vh->nv", hidden.astype(jnp.float32), weight.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    lse = jax.nn.logsumexp(logits, axis=-1)
    valid = labels != ignore_index
    safe = jnp.where(valid, labels, 0)
    target = jnp.take_along_axis(logits, safe[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return jnp.where(valid, lse - target, 0.0), jnp.where(valid, lse, 0.0)
