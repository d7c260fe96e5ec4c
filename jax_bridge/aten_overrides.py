"""ATen ops whose torchax lowering the product replaces, each for a stated reason.

`aten.embedding` with a `padding_idx` (Gemma, Phi-3, Apertus, ... build their embeddings with the
config's pad id): torchax zeroes the padding row's gradient with a scatter, `a_dot.at[padding_idx]
.set(0)`, on the whole table. Under a mesh that splits the table along the vocabulary (`tensor`)
and the hidden dimension (`fsdp`) at once, XLA's SPMD partitioner mis-places that scatter: the
summed gradient of every padding token lands in the first row of the second vocabulary shard
(Gemma's tiny config on fsdp=2,tensor=2, first step, a session script comparing the lowered
gradients with one device's: that row's gradient 5.3 where one device gives 0.11; every other
gradient equal; tests/test_scale_out.py trains it). Here the padding tokens' looked-up rows are
cut from the gradient instead (`stop_gradient` where the id is the padding index), which is
torch's arithmetic (the padding row's value in the forward, no gradient into it) with no scatter
at a fixed row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch


def embedding(weight, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False, sparse: bool = False):
    """aten.embedding(weight [V, H], indices [...], padding_idx, scale_grad_by_freq, sparse) in JAX."""
    if scale_grad_by_freq or sparse:
        raise NotImplementedError(f"aten.embedding: scale_grad_by_freq={scale_grad_by_freq}, sparse={sparse}: "
                                  "no lowering honours them (train with nn.Embedding's defaults)")
    rows = jnp.take(weight, indices, axis=0)
    if padding_idx is None or padding_idx < 0:
        return rows
    padding = (indices == padding_idx)[..., None]
    return jnp.where(padding, jax.lax.stop_gradient(rows), rows)


def install(env) -> None:
    """Replace torchax's lowerings in `env` by the ones above (`jax_bridge.env.get_env`, once)."""
    import torchax.interop as interop

    env.override_op_definition(torch.ops.aten.embedding.default, interop.torch_view(embedding))
