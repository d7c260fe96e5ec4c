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


# =============================================================================================
# Shared: tile metadata for grouped GEMMs (megablox-style)
# =============================================================================================
# Rows are cut into tiles of `tm`. A "work item" is one (row tile, expert) pair that overlaps; a
# tile straddling a group boundary is visited once per group in it. In the row-sorted layout
# there are at most num_tiles + E - 1 such pairs, so every grid/batch has that STATIC length;
# items past the real count (`num_active`) repeat the last real item and do nothing.
import functools
import math
from typing import NamedTuple

import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


class GroupMetadata(NamedTuple):
    offsets: jax.Array     # [E+1] int32: group e owns rows offsets[e]:offsets[e+1]
    group_ids: jax.Array   # [W] int32: expert of work item w
    tile_ids: jax.Array    # [W] int32: row tile of work item w (non-decreasing)
    num_active: jax.Array  # [1] int32: work items that do real work


def group_metadata(group_sizes, num_tiles: int, tm: int, *, visit_empty: bool = False) -> GroupMetadata:
    """Work items in (expert, tile) order. `visit_empty` gives each empty group one item (the
    transposed GEMM must still write that expert's zero gradient)."""
    gs = group_sizes.astype(jnp.int32)
    num_groups = gs.shape[0]
    num_items = num_tiles + num_groups - 1
    ends = jnp.cumsum(gs)
    starts = ends - gs
    first = jnp.minimum(starts // tm, num_tiles - 1)   # an empty group at row M may point past the end
    last = (ends - 1) // tm
    counts = jnp.where(gs > 0, last - first + 1, 1 if visit_empty else 0)
    cum = jnp.cumsum(counts)
    num_active = cum[-1]
    w = jnp.clip(jnp.arange(num_items, dtype=jnp.int32), 0, jnp.maximum(num_active - 1, 0))
    gid = jnp.sum(w[:, None] >= cum[None, :], axis=1).astype(jnp.int32)
    tile = first[gid] + (w - (cum - counts)[gid])
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    return GroupMetadata(offsets, gid, tile.astype(jnp.int32), num_active[None].astype(jnp.int32))


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _fit(dim: int, want: int, align: int) -> int:
    """Largest tile <= want dividing dim that is a multiple of `align`; else the whole dim (a
    block equal to the array dim is always legal on TPU)."""
    if dim <= want:
        return dim
    for t in range(want - want % align, 0, -align):
        if dim % t == 0:
            return t
    return dim


def _precision(dtype):
    # float32 matmuls must be real float32 (TPU's default would use bf16 passes); bf16 x bf16
    # products are exact in the float32 accumulator at default precision.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _swiglu_fwd_split(gu, ti: int, *, alpha: float, limit: float):
    """clamped_swiglu on a [rows, 2*ti] block laid out as [gate ti | up ti] (see _split_layout)."""
    gate = jnp.minimum(gu[:, :ti], limit)
    up = jnp.clip(gu[:, ti:], -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(alpha * gate))


def _swiglu_bwd_split(gu, dh, ti: int, *, alpha: float, limit: float):
    """d(clamped_swiglu)/d(gate_up) times dh, same [gate | up] block layout; float32."""
    g_raw, u_raw = gu[:, :ti], gu[:, ti:]
    gate = jnp.minimum(g_raw, limit)
    up = jnp.clip(u_raw, -limit, limit)
    sig = jax.nn.sigmoid(alpha * gate)
    glu = gate * sig
    dglu = sig + alpha * gate * sig * (1.0 - sig)
    dgate = jnp.where(g_raw < limit, dh * (up + 1.0) * dglu, 0.0)
    dup = jnp.where((u_raw > -limit) & (u_raw < limit), dh * glu, 0.0)
    return jnp.concatenate([dgate, dup], axis=-1)


def _split_layout(w, ti: int):
    """[..., 2I] interleaved (gate, up, gate, up, ...) -> blocks of [gate ti | up ti] per I tile,
    so each kernel block holds matching gate and up columns as two lane-aligned halves (a
    stride-2 lane slice inside a TPU kernel is not an option). A pure permutation: autodiff of
    the wrapper maps gradients back to the interleaved layout."""
    *lead, two_i = w.shape
    i = two_i // 2
    w = w.reshape(*lead, i // ti, ti, 2)
    return jnp.swapaxes(w, -1, -2).reshape(*lead, two_i)


# =============================================================================================
# Plain-JAX grouped GEMM (CPU training path; no Pallas)
# =============================================================================================
def moe_experts_xla(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                    limit: float = 7.0, tile_rows: int | None = None):
    """Megablox's schedule as batched XLA ops: gather each work item's row tile and expert
    weights, one batched matmul per projection, mask rows outside the item's expert, and add the
    (at most E - 1 extra) partial tiles back with a sorted segment_sum. Costs ~(1 + E*t/M) x the
    dense FLOPs instead of ragged_dot's E x on CPU. Gradients by autodiff."""
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    if m == 0:
        return jnp.zeros_like(x)
    # Small tiles waste less on partial tiles but gather the weights more often.
    tm = tile_rows or max(8, min(256, _round_up(max(m // (4 * num_groups), 1), 8)))
    tm = min(tm, _round_up(m, 8))
    num_tiles = -(-m // tm)
    mp = num_tiles * tm
    gs = group_sizes.astype(jnp.int32)
    meta = group_metadata(gs, num_tiles, tm)
    num_items = meta.group_ids.shape[0]
    acc = jnp.float32
    prec = _precision(x.dtype)

    xt = jnp.pad(x, ((0, mp - m), (0, 0))).reshape(num_tiles, tm, hdim)[meta.tile_ids]       # [W, t, H]
    rows = meta.tile_ids[:, None] * tm + jnp.arange(tm, dtype=jnp.int32)[None, :]          # [W, t]
    lo, hi = meta.offsets[meta.group_ids], meta.offsets[meta.group_ids + 1]
    live = (rows >= lo[:, None]) & (rows < hi[:, None])
    live &= (jnp.arange(num_items) < meta.num_active[0])[:, None]

    gu = jnp.einsum("wth,whn->wtn", xt, gate_up[meta.group_ids], precision=prec, preferred_element_type=acc)
    gu = gu + gate_up_bias[meta.group_ids][:, None, :].astype(acc)
    h = clamped_swiglu(gu, alpha=alpha, limit=limit).astype(x.dtype)
    y = jnp.einsum("wti,wih->wth", h, down[meta.group_ids], precision=prec, preferred_element_type=acc)
    y = y + down_bias[meta.group_ids][:, None, :].astype(acc)
    y = jnp.where(live[..., None], y, 0.0)   # select, not multiply: no 0 * inf leaking through
    y = jax.ops.segment_sum(y, meta.tile_ids, num_segments=num_tiles, indices_are_sorted=True)
    return y.reshape(mp, hdim)[:m].astype(x.dtype)
