"""ATen ops whose torchax lowering the product replaces, each for a stated reason.

`aten.embedding` with a `padding_idx` (Gemma, Phi-3, Apertus, ... build their embeddings with the
config's pad id): torchax zeroes the padding row's gradient with a scatter, `a_dot.at[padding_idx]
.set(0)`, on the whole table. Under a mesh that splits the table along the vocabulary (`tensor`)
and the hidden dimension (`fsdp`) at once, XLA's SPMD partitioner mis-places that scatter: the
summed gradient of every padding token lands in the first row of the second vocabulary shard
(Gemma's tiny config on fsdp=2,tensor=2, first step, a one-off script comparing the lowered
gradients with one device's: that row's gradient 5.3 where one device gives 0.11; every other
gradient equal; tests/test_scale_out.py trains it). Here the padding tokens' looked-up rows are
cut from the gradient instead (`stop_gradient` where the id is the padding index), which is
torch's arithmetic (the padding row's value in the forward, no gradient into it) with no scatter
at a fixed row.

`aten.topk`: torchax takes `jax.lax.top_k`, whose values already come largest first, and for
`sorted=True` (torch's default, what every router calls) sorts them again and argsorts the sorted
values: two more sorts, a reverse and a gather per call, which change nothing (a stable argsort of
sorted values is the identity). On a v5e they were 12 of the 426 ops of `small-o200k`'s one-row
decode step (deviceless compile), and every train step's routers carried them and their
gradients' scatters. Here `jax.lax.top_k` alone: the same values and indices. Along a router's
dimension (at most ROUTER_TOP_K_MAX experts) its gradient compares each entry with the chosen
indices instead of scattering into the input, which a TPU does element by element (2 x 0.89 ms
of `small-o200k`'s 266 ms step on a v5e for [32768, 8], profiled 2026-12-06).

`aten.fmod`: torchax divides in float32 and truncates (a division, floor, ceil, a select, a
multiply and a subtraction, with casts), which for integers is exact only below 2^24. Here
`jnp.fmod`, which for integers is `lax.rem`, C's truncated remainder, as torch's: one op. The KV
cache's rings of other than a power-of-two size take it in every decode step
(torch_model/kv_cache.py).

`aten.index_copy`: torchax writes `x.at[..., index, ...].set(source)`, which wraps a negative
index to the end of the dimension (an add, a compare and a select per index array). torch raises
on any index outside [0, size); a traced program cannot raise, so here every such index, negative
ones included, writes nothing, as torchax already does past the end. The KV cache's writes take
it (never negative slots): 6 of `small-o200k`'s one-row decode step's ops on a v5e.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
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


ROUTER_TOP_K_MAX = 1024   # a comparison gradient costs k x n per row: routers, not vocabularies


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def router_top_k(x, k: int):
    """jax.lax.top_k over the last dimension, with a gradient that never scatters."""
    top, indices = jax.lax.top_k(x, k)
    return top, indices


@router_top_k.defjvp
def _router_top_k_jvp(k, primals, tangents):
    (x,), (t,) = primals, tangents
    top, indices = router_top_k(x, k)
    chosen = indices[..., :, None] == jnp.arange(x.shape[-1], dtype=indices.dtype)     # [..., k, n]
    t_top = jnp.where(chosen, t[..., None, :], jnp.zeros((), t.dtype)).sum(-1)          # its transpose: a where
    return (top, indices), (t_top, np.zeros(indices.shape, jax.dtypes.float0))


def topk(values, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002 - torch's name
    """aten.topk(input, k, dim, largest, sorted) in JAX: (values, indices) along `dim`, largest
    first (largest=False: smallest first); `sorted=False` allows any order, this one included."""
    del sorted
    if values.ndim == 0:
        return values, jnp.zeros((), jnp.int32)
    moved = jnp.moveaxis(values, dim, -1)
    top_k = router_top_k if moved.shape[-1] <= ROUTER_TOP_K_MAX else jax.lax.top_k
    top, indices = top_k(moved if largest else -moved, k)
    top = top if largest else -top
    return jnp.moveaxis(top, -1, dim), jnp.moveaxis(indices, -1, dim)


def fmod(x, other):
    """aten.fmod(input, other) in JAX (.Scalar and .Tensor): the remainder truncated toward zero,
    with the dividend's sign; torch's and JAX's type promotion agree for a Python scalar."""
    return jnp.fmod(x, other)


def index_copy(x, dim: int, index, source):
    """aten.index_copy(input, dim, index, source) in JAX: source's slices written at `index` along
    `dim`; an index outside [0, size) writes nothing (torch raises)."""
    if x.ndim == 0:
        return source
    dim = dim % x.ndim
    if x.ndim == 1:
        source = source.reshape(-1)
    where = tuple(index if i == dim else slice(None) for i in range(x.ndim))
    return x.at[where].set(source, mode="drop", wrap_negative_indices=False)


def install(env) -> None:
    """Replace torchax's lowerings in `env` by the ones above (`jax_bridge.env.get_env`, once)."""
    import torchax.interop as interop

    env.override_op_definition(torch.ops.aten.embedding.default, interop.torch_view(embedding))
    env.override_op_definition(torch.ops.aten.topk.default, interop.torch_view(topk))
    env.override_op_definition(torch.ops.aten.index_copy.default, interop.torch_view(index_copy))
    for overload in (torch.ops.aten.fmod.Scalar, torch.ops.aten.fmod.Tensor):
        env.override_op_definition(overload, interop.torch_view(fmod))
