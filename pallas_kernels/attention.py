"""Causal GQA attention with learned sinks and optional sliding window.

Layout: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (Tk >= Tq, queries are the last Tq positions),
sinks [Hq]. sliding_window W > 0: query i sees keys i-W+1..i; W == 0: all keys <= i.
segment_ids [B, T] (optional, Tq == Tk): query i sees key j only when their ids are equal, so
conversations packed into one row never attend to each other (None: one segment per row).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q, k, v, sinks, *, sliding_window: int, scale: float, segment_ids=None):
    """Plain JAX: materializes the [Tq, Tk] scores; the oracle and the `xla` implementation."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if segment_ids is not None:
        _check_segment_ids(segment_ids, b, tq, tk)
    out = _at_reference_precision(q.reshape(b, hkv, hq // hkv, tq, d), k.astype(q.dtype), v.astype(jnp.float32),
                                  sinks, jnp.arange(tk - tq, tk)[None], segment_ids, segment_ids,
                                  sliding_window=sliding_window, scale=scale)
    return out.reshape(b, hq, tq, d).astype(q.dtype)


def _at_reference_precision(qg, keys, values, sinks, q_positions, q_segments, k_segments, *, sliding_window: int,
                            scale: float):
    """`attention_over_positions` over all Tk keys as the reference computes it: scores in float32
    from the queries' own dtype at its dot precision (bf16 products are exact; `keys` in that
    dtype), the probabilities times float32 `values` at HIGHEST."""
    return attention_over_positions(qg, keys, values, sinks, q_positions, jnp.arange(keys.shape[2])[None],
                                    sliding_window=sliding_window, scale=scale,
                                    score_precision=dot_precision(qg.dtype),
                                    value_precision=jax.lax.Precision.HIGHEST, q_segments=q_segments,
                                    k_segments=k_segments)


def attention_over_positions(qg, k, v, sinks, q_positions, k_positions, *, sliding_window: int, scale: float,
                             score_precision, value_precision, q_segments=None, k_segments=None):
    """The one body of every plain-JAX attention (training's reference above, generation's cached
    attention): qg [B, Hkv, G, Tq, D], k and v [B, Hkv, S, D], positions [B or 1, Tq] and
    [B or 1, S] (-1: an empty slot). Key j is visible to query i when 0 <= k_pos[j] <= q_pos[i]
    and, with a window W > 0, k_pos[j] > q_pos[i] - W, and (segments given: [B, Tq], [B, S])
    q_seg[i] == k_seg[j]. Softmax over the scores and each head's sink logit, the sink's
    probability dropped. Returns float32 [B, Hkv, G, Tq, D]."""
    b, hkv, group, tq, _ = qg.shape
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k, precision=score_precision,
                        preferred_element_type=jnp.float32) * scale
    qpos = q_positions[:, None, None, :, None]
    kpos = k_positions[:, None, None, None, :]
    visible = (kpos >= 0) & (kpos <= qpos)
    if sliding_window > 0:
        visible = visible & (kpos > qpos - sliding_window)
    if q_segments is not None:
        visible = visible & (q_segments[:, None, None, :, None] == k_segments[:, None, None, None, :])
    scores = jnp.where(visible, scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, group, 1, 1), (b, hkv, group, tq, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhgqk,bhkd->bhgqd", probs, v, precision=value_precision)


# The float32 scores one query chunk of the `xla` implementation may form (256 MiB: small-o200k's
# 16 rows x 8 heads x 2048 keys at 256 queries; every shape of the CPU suite is one chunk).
XLA_CHUNK_BYTES = 1 << 28


def attention_xla(q, k, v, sinks, *, sliding_window: int, scale: float, segment_ids=None,
                  chunk_bytes: int = XLA_CHUNK_BYTES):
    """The `xla` implementation: the reference over chunks of queries whose float32 scores
    [B, Hq, rows, Tk] stay within `chunk_bytes`, each chunk formed again in the backward
    (jax.checkpoint), so neither pass holds every layer's [T, T] scores and probabilities
    (`small-o200k` at 16 x 2048: 2 GiB of float32 scores per layer and tensor). Per query the
    same arithmetic as the reference (a query's softmax spans all its keys); one chunk is the
    reference itself."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    rows = max(8, chunk_bytes // (4 * b * hq * tk) // 8 * 8)
    if tq <= rows:
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale,
                                   segment_ids=segment_ids)
    if segment_ids is not None:
        _check_segment_ids(segment_ids, b, tq, tk)
    chunks = -(-tq // rows)
    pad = chunks * rows - tq

    def by_chunk(x, axis):
        """[..., tq (axis), ...] -> [chunks, ..., rows, ...]; padded queries repeat the last one
        (its position and segment: it sees its own key, so no score row is empty and no NaN
        reaches the backward); their outputs are dropped, so they add no gradient."""
        x = jnp.pad(x, [(0, pad) if i == axis else (0, 0) for i in range(x.ndim)], mode="edge")
        x = x.reshape(*x.shape[:axis], chunks, rows, *x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    qg = by_chunk(q.reshape(b, hkv, hq // hkv, tq, d), 3)
    q_positions = by_chunk(jnp.arange(tk - tq, tk)[None], 1)
    q_segments = None if segment_ids is None else by_chunk(segment_ids, 1)
    keys, values = k.astype(q.dtype), v.astype(jnp.float32)

    @jax.checkpoint
    def chunk(qc, positions, segments):
        return _at_reference_precision(qc, keys, values, sinks, positions, segments, segment_ids,
                                       sliding_window=sliding_window, scale=scale)

    out = jax.lax.map(lambda args: chunk(*args), (qg, q_positions, q_segments))   # [chunks, B, Hkv, G, rows, D]
    out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, hq // hkv, chunks * rows, d)[:, :, :, :tq]
    return out.reshape(b, hq, tq, d).astype(q.dtype)


# ==================================================================================================
# Pallas flash attention (forward + backward), sinks, GQA, causal / sliding window.
#
# Layout inside the kernels is the op's own [B, H, T, D]; K/V heads are shared through index_maps
# (q head h reads kv head h // group), so repeated K/V is never materialized. The sequence is padded
# to a multiple of the blocks. Padding needs no extra mask: causality already hides padded keys
# (index >= T) from every real query, padded queries are sliced off, and their zero cotangent gives
# them zero weight in dK/dV.
# ==================================================================================================
import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import index_math as ix
from pallas_kernels.cost import cost_estimate
from pallas_kernels.lanes import LANES, across_lanes, lanes_to_row
from pallas_kernels.platform import (KernelMode, check_platform, dot_precision, kernel_mode, precision_name,
                                     with_matmul_precision)

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp(mask - m) == 0, never NaN


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_block_sizes(seq_len: int, head_dim: int, platform: str) -> tuple[int, int]:
    """(block_q, block_kv) for a sequence length.

    TPU (and CPU, which interprets the TPU kernel): big tiles, because each grid step costs
    ~0.35 us of fixed overhead and 128-wide tiles left Splash at half the MFU. 512 for long
    sequences, shrinking to 256/128 only when that saves more than 1/8 of padding; sequences
    under 128 use one block of the (8-rounded) sequence, which TPU lowering allows as a full dim.
    GPU (Triton): power-of-two tiles, 64x64 (the FA2 backward's register budget at D=128);
    short sequences use one power-of-two block of at least 16 (tl.dot's minimum).
    """
    if check_platform(platform, "attention_pallas") == "gpu":
        b = 64 if seq_len >= 64 else max(16, _next_pow2(seq_len))
        return b, b
    if seq_len <= 128:
        b = _round_up(seq_len, 8)
        return b, b
    for b in (512, 256):
        if seq_len >= 2 * b and _round_up(seq_len, b) - seq_len <= seq_len // 8:
            return b, b
    return 128, 128


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one attention call (hashable: custom_vjp nondiff argument)."""
    window: int      # 0 = full causal (also used when the window covers the whole sequence)
    scale: float
    block_q: int
    block_kv: int
    seq_len: int     # real T
    padded_len: int  # Tp, a multiple of both blocks
    mode: KernelMode
    vmem_limit: int | None = None   # TPU scoped VMEM limit; None: the compiler's default
    segmented: bool = False         # segment ids given: per-row block bounds and a segment mask

    @property
    def gpu(self) -> bool:
        return self.mode.family == "gpu"

    @property
    def nq(self) -> int:
        return self.padded_len // self.block_q

    @property
    def nk(self) -> int:
        return self.padded_len // self.block_kv


# ---- block ranges: which kv blocks a q block needs, and which q blocks a kv block feeds ---------
# One implementation for Python ints (grid sizing), NumPy arrays (cost estimates) and traced int32
# scalars (index_maps, kernels): pallas_kernels/index_math.py.

def _kv_range(i, cfg: _Cfg):
    """First and last kv block seen by q block i (keys q_first-W+1 .. q_last)."""
    q_first = i * cfg.block_q
    hi = ix.div(q_first + cfg.block_q - 1, cfg.block_kv)
    if cfg.window == 0:
        return 0 * hi, hi
    return ix.div(ix.maximum(q_first - cfg.window + 1, 0), cfg.block_kv), hi


def _q_range(j, cfg: _Cfg):
    """First and last q block that sees kv block j (queries k_first .. k_last+W-1)."""
    k_first = j * cfg.block_kv
    lo = ix.div(k_first, cfg.block_q)
    if cfg.window == 0:
        return lo, 0 * lo + (cfg.nq - 1)
    return lo, ix.div(ix.minimum(k_first + cfg.block_kv + cfg.window - 2, cfg.padded_len - 1), cfg.block_q)


def _kv_steps(cfg: _Cfg) -> int:
    """Kv grid extent of the forward/dq kernels: the widest kv range over q blocks (static)."""
    return max(hi - lo + 1 for lo, hi in (_kv_range(i, cfg) for i in range(cfg.nq)))


def _q_steps(cfg: _Cfg) -> int:
    """Q grid extent (per query head of a group) of the dkv kernel."""
    return max(hi - lo + 1 for lo, hi in (_q_range(j, cfg) for j in range(cfg.nk)))


def _live_tiles(cfg: _Cfg) -> int:
    """(q block, kv block) tiles the kernels compute, per batch row and query head: the tiles
    holding at least one visible (query, key) pair. Static: tiles skipped only at run time are
    none (every tile in a block range holds a visible pair), padded rows count."""
    return sum(hi - lo + 1 for lo, hi in (_kv_range(i, cfg) for i in range(cfg.nq)))


class _Work(NamedTuple):
    flops: int
    transcendentals: int


def _work(cfg: _Cfg, batch: int, q_heads: int, head_dim: int) -> dict:
    """FLOPs and exps of the TPU forward, dq and dkv kernels (keys "fwd", "dq", "dkv"), from the
    shapes, the block plan and the statically skipped tiles (their bytes are counted from the
    block specs: pallas_kernels/cost.py). Per live tile of bq x bkv: forward 2 matmuls (QK^T, PV),
    dq 3 (QK^T, dO V^T, dS K), dkv 4 (K Q^T, P^T dO, V dO^T, dS^T Q), each 2 bq bkv d FLOPs; one
    exp per score (+ the forward's per-row rescale and final log). With segment ids
    (cfg.segmented) the tiles skipped at run time by the per-row bounds count as computed (worst
    case: the estimate is static)."""
    bq, bkv, tp = cfg.block_q, cfg.block_kv, cfg.padded_len
    heads = batch * q_heads
    tiles = heads * _live_tiles(cfg)
    per_tile = 2 * bq * bkv * head_dim
    return {"fwd": _Work(2 * per_tile * tiles, tiles * (bq * bkv + bq) + heads * tp),
            "dq": _Work(3 * per_tile * tiles, tiles * bq * bkv),
            "dkv": _Work(4 * per_tile * tiles, tiles * bq * bkv)}


def attention_grid(seq_len: int, *, sliding_window: int, block_q: int, block_kv: int) -> dict:
    """The forward kernel's grid plan (for tests and cost reasoning).

    Returns q_blocks, kv_steps (kv grid extent per q block), grid_steps (q_blocks * kv_steps, per
    batch and kv head: a GQA group's query heads share each step) and computed_blocks (steps that
    do work; the rest are skipped and re-use the previous block, so they cost no DMA).
    """
    mode = kernel_mode("tpu", who="attention_grid")
    block_q, block_kv, tp = _plan_blocks(seq_len, block_q, block_kv, mode)
    window = 0 if sliding_window >= seq_len else sliding_window
    cfg = _Cfg(window, 1.0, block_q, block_kv, seq_len, tp, mode)
    steps = _kv_steps(cfg)
    return dict(q_blocks=cfg.nq, kv_steps=steps, grid_steps=cfg.nq * steps, computed_blocks=_live_tiles(cfg))


def segment_tile_counts(segment_ids, *, sliding_window: int, block_q: int, block_kv: int) -> dict:
    """The forward kernel's tiles with segment ids [B, T], summed over rows (per head): `band`
    (inside the static causal/window band), `visited` (inside the per-row segment bounds: computed,
    masked) and `skipped` (band tiles no query/key pair of which shares an id: no DMA, no compute).
    Blocks as attention_pallas plans them on TPU."""
    seq_len = segment_ids.shape[1]
    mode = kernel_mode("tpu", who="segment_tile_counts")
    block_q, block_kv, tp = _plan_blocks(seq_len, block_q, block_kv, mode)
    window = 0 if sliding_window >= seq_len else sliding_window
    cfg = _Cfg(window, 1.0, block_q, block_kv, seq_len, tp, mode, segmented=True)
    kv_lo = np.asarray(_segment_block_bounds(_pad_segments(jnp.asarray(segment_ids), tp), cfg)[0])
    bounds = [_kv_range(i, cfg) for i in range(cfg.nq)]
    band = len(kv_lo) * sum(hi - lo + 1 for lo, hi in bounds)
    visited = int(sum(hi + 1 for _, hi in bounds) * len(kv_lo) - kv_lo.sum())
    return dict(band=band, visited=visited, skipped=band - visited, block_q=block_q, block_kv=block_kv)


def _visible(q_first, k_first, shape, window: int, transposed: bool = False):
    """Causal (+ window) mask of one (q block, kv block) tile; rows are keys when transposed."""
    rows = lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, shape, 1)
    qpos, kpos = (q_first + cols, k_first + rows) if transposed else (q_first + rows, k_first + cols)
    vis = kpos <= qpos
    if window:
        vis = jnp.logical_and(vis, kpos > qpos - window)
    return vis


def _fully_visible(q_first, k_first, cfg: _Cfg):
    """True when no entry of the tile is masked, so the mask can be skipped."""
    ok = k_first + cfg.block_kv - 1 <= q_first
    if cfg.window:
        ok = jnp.logical_and(ok, k_first >= q_first + cfg.block_q - cfg.window)
    return ok


def _tile_mask(q_first, k_first, shape, window: int, seg, transposed: bool = False):
    """The tile's mask: causal (+ window), and with segments equal ids (col: the tile's rows'
    ids [rows, 1], row: its columns' ids [1, cols])."""
    vis = _visible(q_first, k_first, shape, window, transposed)
    if seg is None:
        return vis
    return jnp.logical_and(vis, seg.col[...] == seg.row[...])


def _step_mask(i, kb, cfg: _Cfg, seg):
    """The mask of the (q block i, kv block kb) tile, shared by a GQA group's query heads."""
    return _tile_mask(i * cfg.block_q, kb * cfg.block_kv, (cfg.block_q, cfg.block_kv), cfg.window, seg)


def _scaled(x, cfg: _Cfg):
    """x times the softmax scale; nothing when the scale was folded into q (TPU kernels: 1.0)."""
    return x if cfg.scale == 1.0 else x * cfg.scale


def _head_scores(q, k, mask, cfg: _Cfg, precision):
    """One query head's scaled scores against a K block, masked where the tile needs it."""
    s = _scaled(_dot(q, k, (1, 1), precision), cfg)
    return s if mask is None else jnp.where(mask, s, _MASK_VALUE)


def _run_live_step(step, live, full, seg):
    """step(masked) on live tiles; the mask is skipped on fully visible tiles, which segments
    (ids not known statically) never are."""
    if seg is not None:
        pl.when(live)(lambda: step(True))
        return
    pl.when(jnp.logical_and(live, full))(lambda: step(False))
    pl.when(jnp.logical_and(live, jnp.logical_not(full)))(lambda: step(True))


def _dot(a, b, contract, precision):
    """2-D matmul with float32 accumulation; contract = (lhs dim, rhs dim)."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


# ---- segments: per-row block bounds (scalar prefetch) and the in-tile mask -----------------------
# With segment ids the static causal/window band is narrowed per row: q block i needs kv blocks from
# the first occurrence of any of its queries' segment ids, kv block j feeds q blocks up to the last
# occurrence of any of its keys' ids. Tiles outside are skipped (no DMA, no compute); tiles inside
# are always masked (causal/window AND equal ids). Ids need not be contiguous or sorted.

@dataclasses.dataclass(frozen=True)
class _Segments:
    """The refs a segmented kernel reads: kv_lo [B, nq] and q_hi [B, nk] (SMEM), and the ids
    of this tile's queries and keys as a column and a row (broadcast to the tile)."""
    kv_lo: object
    q_hi: object
    col: object      # [rows, 1]: queries (keys in the transposed dkv tile)
    row: object      # [1, cols]: keys (queries in the transposed dkv tile)


def _first_and_last_occurrence(seg):
    """For seg [B, T]: first[b, t] / last[b, t] = the smallest / largest index of seg[b, t]'s id
    in row b (a stable sort groups equal ids; a group's first element has the smallest index)."""
    b, t = seg.shape
    order = jnp.argsort(seg, axis=1, stable=True)
    ordered = jnp.take_along_axis(seg, order, 1)
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    change = ordered[:, 1:] != ordered[:, :-1]
    starts = jnp.concatenate([jnp.ones((b, 1), bool), change], 1)
    ends = jnp.concatenate([change, jnp.ones((b, 1), bool)], 1)
    group_start = lax.cummax(jnp.where(starts, idx, 0), axis=1)
    group_end = lax.cummin(jnp.where(ends, idx, t - 1), axis=1, reverse=True)
    back = jnp.argsort(order, axis=1)        # inverse permutation
    first = jnp.take_along_axis(jnp.take_along_axis(order, group_start, 1), back, 1)
    last = jnp.take_along_axis(jnp.take_along_axis(order, group_end, 1), back, 1)
    return first.astype(jnp.int32), last.astype(jnp.int32)


def _segment_block_bounds(seg, cfg: "_Cfg"):
    """(kv_lo [B, nq], q_hi [B, nk], first, last): the static band narrowed by segments. seg is
    padded to Tp (padding continues the last id: hidden from real queries by causality)."""
    b = seg.shape[0]
    first, last = _first_and_last_occurrence(seg)
    seg_lo = first.reshape(b, cfg.nq, cfg.block_q).min(-1) // cfg.block_kv
    seg_hi = last.reshape(b, cfg.nk, cfg.block_kv).max(-1) // cfg.block_q
    static_lo = jnp.array([_kv_range(i, cfg)[0] for i in range(cfg.nq)], jnp.int32)
    static_hi = jnp.array([_q_range(j, cfg)[1] for j in range(cfg.nk)], jnp.int32)
    return jnp.maximum(seg_lo, static_lo), jnp.minimum(seg_hi, static_hi), first, last


def _pad_segments(segment_ids, tp):
    seg = segment_ids.astype(jnp.int32)
    t = seg.shape[1]
    return seg if t == tp else jnp.pad(seg, ((0, 0), (0, tp - t)), mode="edge")


# ---- TPU (Mosaic) kernels: grid over (batch, kv head, block, inner block), VMEM accumulators ----

def _tpu_fwd_kernel(sinks_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, *,
                    cfg: _Cfg, precision, seg: _Segments | None = None):
    # One grid step holds a GQA group's query heads (leading axis of the q, o, lse blocks and the
    # scratch) against one K/V block: the block is read from HBM once per group, not per head.
    bi, h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    group = q_ref.shape[0]
    lo, hi = _kv_range(i, cfg)
    if seg is not None:
        lo = seg.kv_lo[bi, i]
    kb = lo + j

    @pl.when(j == 0)
    def _init():
        # The sink is the running max's starting point with weight exp(0) = 1: l starts at 1.
        for g in range(group):
            m_scr[g] = jnp.full(m_scr.shape[1:], sinks_ref[h * group + g], jnp.float32)
        l_scr[...] = jnp.ones(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def step(masked: bool):
        k, v = k_ref[...], v_ref[...]
        mask = _step_mask(i, kb, cfg, seg) if masked else None

        def head(g, carry):
            s = _head_scores(q_ref[g], k, mask, cfg, precision)
            m_prev = m_scr[g]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - across_lanes(m_next, s.shape[1]))
            l_scr[g] = alpha * l_scr[g] + jnp.sum(p, axis=1, keepdims=True)
            acc_scr[g] = acc_scr[g] * across_lanes(alpha, acc_scr.shape[-1]) + _dot(p.astype(v.dtype), v, (1, 0),
                                                                                     precision)
            m_scr[g] = m_next
            return carry

        lax.fori_loop(0, group, head, 0)

    # Steps past the last needed kv block are skipped (their index_map re-used the block: no DMA).
    _run_live_step(step, kb <= hi, _fully_visible(i * cfg.block_q, kb * cfg.block_kv, cfg), seg)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        for g in range(group):
            l = l_scr[g]
            o_ref[g] = (acc_scr[g] / across_lanes(l, acc_scr.shape[-1])).astype(o_ref.dtype)
            lse_ref[g] = lanes_to_row(m_scr[g] + jnp.log(l))


def _tpu_dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_scr, *,
                   cfg: _Cfg, precision, seg: _Segments | None = None):
    # As the forward: a GQA group's query heads per grid step, each K/V block read once per group.
    bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, hi = _kv_range(i, cfg)
    if seg is not None:
        lo = seg.kv_lo[bi, i]
    kb = lo + j

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def step(masked: bool):
        k, v = k_ref[...], v_ref[...]
        mask = _step_mask(i, kb, cfg, seg) if masked else None

        def head(g, carry):
            s = _head_scores(q_ref[g], k, mask, cfg, precision)
            p = jnp.exp(s - jnp.expand_dims(lse_ref[g][0], -1))          # lse includes the sink
            dp = _dot(do_ref[g], v, (1, 1), precision)
            ds = p * (dp - jnp.expand_dims(delta_ref[g][0], -1))
            dq_scr[g] += _dot(ds.astype(k.dtype), k, (1, 0), precision)
            return carry

        lax.fori_loop(0, q_ref.shape[0], head, 0)

    _run_live_step(step, kb <= hi, _fully_visible(i * cfg.block_q, kb * cfg.block_kv, cfg), seg)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = _scaled(dq_scr[...], cfg).astype(dq_ref.dtype)


def _tpu_dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr, dv_scr, *,
                    cfg: _Cfg, q_steps: int, precision, seg: _Segments | None = None):
    # Inner axis t walks (query head of the group, q block): the group's sum happens in VMEM.
    bi, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, hi = _q_range(j, cfg)
    if seg is not None:
        hi = seg.q_hi[bi, j]
    qb = lo + lax.rem(t, q_steps)

    @pl.when(t == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def step(masked: bool):
        # Transposed tile (keys x queries) so lse/delta arrive as lane rows and no transpose is needed.
        q, do = q_ref[...], do_ref[...]
        st = _scaled(_dot(k_ref[...], q, (1, 1), precision), cfg)
        if masked:
            st = jnp.where(_tile_mask(qb * cfg.block_q, j * cfg.block_kv, st.shape, cfg.window, seg,
                                      transposed=True), st, _MASK_VALUE)
        pt = jnp.exp(st - lse_ref[...])
        dv_scr[...] += _dot(pt.astype(do.dtype), do, (1, 0), precision)
        dpt = _dot(v_ref[...], do, (1, 1), precision)
        dst = pt * (dpt - delta_ref[...])
        dk_scr[...] += _dot(dst.astype(q.dtype), q, (1, 0), precision)

    _run_live_step(step, qb <= hi, _fully_visible(qb * cfg.block_q, j * cfg.block_kv, cfg), seg)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = _scaled(dk_scr[...], cfg).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _tpu_call_kwargs(cfg: _Cfg):
    # On CPU the generic interpreter runs this kernel (SMEM, VMEM scratch) ~500x faster than
    # pltpu.InterpretParams() once compiled, with identical results.
    return dict(interpret=cfg.mode.pallas_interpret(), compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"), vmem_limit_bytes=cfg.vmem_limit))


def _costs(cfg: _Cfg, q) -> dict:
    b, hq, _, d = q.shape
    return _work(cfg, b, hq, d)


def _tpu_call(kernel, cfg: _Cfg, segs, seg_specs, *, grid, in_specs, out_specs, out_shape, scratch_shapes, name,
              inputs, cost):
    """pallas_call of a TPU attention kernel. With segments (segs = kv_lo, q_hi, ids as a column
    [B, Tp, 1] and as a row [B, 1, Tp]) the block bounds are scalar-prefetch arguments, which
    every index_map receives after the grid indices, and the tile's ids two more inputs.
    `inputs`: the arrays the call takes (their shapes), `cost`: the kernel's FLOP estimate, whose
    bytes are counted from the block plan (pallas_kernels/cost.py; with segments, the static
    block ranges: the worst case, as the FLOPs)."""
    seg_inputs = () if segs is None else segs[2:]
    estimate = cost_estimate(grid, [*in_specs, *(seg_specs if segs is not None else ())], [*inputs, *seg_inputs],
                             out_specs, out_shape, flops=cost.flops, transcendentals=cost.transcendentals)
    common = dict(out_shape=out_shape, name=name, cost_estimate=estimate, **_tpu_call_kwargs(cfg))
    if segs is None:
        return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                              scratch_shapes=scratch_shapes, **common)
    n_in = len(in_specs)

    def segmented(kv_lo, q_hi, *refs):
        col, row = refs[n_in], refs[n_in + 1]
        return kernel(*refs[:n_in], *refs[n_in + 2:], seg=_Segments(kv_lo, q_hi, col, row))

    spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=grid, in_specs=[*in_specs, *seg_specs],
                                        out_specs=out_specs, scratch_shapes=scratch_shapes)
    call = pl.pallas_call(segmented, grid_spec=spec, **common)
    kv_lo, q_hi, col_ids, row_ids = segs
    return lambda *args: call(kv_lo, q_hi, *args, col_ids, row_ids)


def _kv_block(cfg: _Cfg, bi, i, j, bounds):
    """The kv block of forward/dq step j of q block i, clamped: skipped steps re-use the block."""
    lo, hi = _kv_range(i, cfg)
    if bounds:
        lo = bounds[0][bi, i]
    return ix.minimum(lo + j, hi)


def _kv_stream_specs(cfg: _Cfg, d: int):
    """(K/V block spec, segment-id specs) of the kernels that stream a q block's kv range (the
    forward and dq); grid (batch, kv head, q block, kv step): the kv head's group of query heads
    shares each step."""
    def kv_map(bi, h, i, j, *bounds):
        return bi, h, _kv_block(cfg, bi, i, j, bounds), 0

    seg_specs = [pl.BlockSpec((None, cfg.block_q, 1), lambda bi, h, i, j, *_: (bi, i, 0)),
                 pl.BlockSpec((None, 1, cfg.block_kv),
                              lambda bi, h, i, j, *bounds: (bi, 0, _kv_block(cfg, bi, i, j, bounds)))]
    return pl.BlockSpec((None, None, cfg.block_kv, d), kv_map), seg_specs


def _tpu_forward(cfg: _Cfg, q, k, v, sinks, segs=None):
    b, hq, tp, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bq, steps = cfg.block_q, _kv_steps(cfg)
    kv_spec, seg_specs = _kv_stream_specs(cfg, d)
    out, lse = _tpu_call(
        functools.partial(_tpu_fwd_kernel, cfg=cfg, precision=dot_precision(q.dtype)), cfg, segs, seg_specs,
        grid=(b, hkv, cfg.nq, steps),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((None, group, bq, d), lambda bi, h, i, j, *_: (bi, h, i, 0)),
                  kv_spec, kv_spec],
        out_specs=[pl.BlockSpec((None, group, bq, d), lambda bi, h, i, j, *_: (bi, h, i, 0)),
                   pl.BlockSpec((None, group, 1, bq), lambda bi, h, i, j, *_: (bi, h, 0, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, 1, tp), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((group, bq, LANES), jnp.float32), pltpu.VMEM((group, bq, LANES), jnp.float32),
                        pltpu.VMEM((group, bq, d), jnp.float32)],
        name="attention_fwd", inputs=(sinks, q, k, v), cost=_costs(cfg, q)["fwd"],
    )(sinks.astype(jnp.float32), q, k, v)
    return out, lse   # lse: [B, H, 1, Tp], the row layout the backward kernels read


def _tpu_backward(cfg: _Cfg, q, k, v, do, lse4, delta, segs=None):
    b, hq, tp, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bq, bkv = cfg.block_q, cfg.block_kv
    prec = dot_precision(q.dtype)
    # Row statistics as [B, H, 1, T]: a (1, block) tile is a lane row (legal for block % 128 == 0).
    delta4 = delta[:, :, None, :]

    kv_steps = _kv_steps(cfg)
    kv_spec, dq_seg_specs = _kv_stream_specs(cfg, d)
    q_map = lambda bi, h, i, j, *_: (bi, h, i, 0)
    row_map = lambda bi, h, i, j, *_: (bi, h, 0, i)
    dq = _tpu_call(
        functools.partial(_tpu_dq_kernel, cfg=cfg, precision=prec), cfg, segs, dq_seg_specs,
        grid=(b, hkv, cfg.nq, kv_steps),
        in_specs=[pl.BlockSpec((None, group, bq, d), q_map),
                  kv_spec, kv_spec,
                  pl.BlockSpec((None, group, bq, d), q_map),
                  pl.BlockSpec((None, group, 1, bq), row_map),
                  pl.BlockSpec((None, group, 1, bq), row_map)],
        out_specs=pl.BlockSpec((None, group, bq, d), q_map),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((group, bq, d), jnp.float32)],
        name="attention_dq", inputs=(q, k, v, do, lse4, delta4), cost=_costs(cfg, q)["dq"],
    )(q, k, v, do, lse4, delta4)

    q_steps = _q_steps(cfg)

    def qb_of(bi, j, t, bounds):
        lo, hi = _q_range(j, cfg)
        if bounds:
            hi = bounds[1][bi, j]
        return ix.minimum(lo + ix.rem(t, q_steps), hi)

    def gq_map(bi, h, j, t, *bounds):   # query head h * group + t // q_steps of kv head h
        return bi, h * group + ix.div(t, q_steps), qb_of(bi, j, t, bounds), 0

    def grow_map(bi, h, j, t, *bounds):
        return bi, h * group + ix.div(t, q_steps), 0, qb_of(bi, j, t, bounds)

    k_map = lambda bi, h, j, t, *_: (bi, h, j, 0)
    # The transposed tile's rows are keys, its columns queries.
    dkv_seg_specs = [pl.BlockSpec((None, bkv, 1), lambda bi, h, j, t, *_: (bi, j, 0)),
                     pl.BlockSpec((None, 1, bq), lambda bi, h, j, t, *bounds: (bi, 0, qb_of(bi, j, t, bounds)))]
    dk, dv = _tpu_call(
        functools.partial(_tpu_dkv_kernel, cfg=cfg, q_steps=q_steps, precision=prec), cfg, segs, dkv_seg_specs,
        grid=(b, hkv, cfg.nk, group * q_steps),
        in_specs=[pl.BlockSpec((None, None, bq, d), gq_map),
                  pl.BlockSpec((None, None, bkv, d), k_map),
                  pl.BlockSpec((None, None, bkv, d), k_map),
                  pl.BlockSpec((None, None, bq, d), gq_map),
                  pl.BlockSpec((None, None, 1, bq), grow_map),
                  pl.BlockSpec((None, None, 1, bq), grow_map)],
        out_specs=[pl.BlockSpec((None, None, bkv, d), k_map), pl.BlockSpec((None, None, bkv, d), k_map)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)],
        name="attention_dkv", inputs=(q, k, v, do, lse4, delta4), cost=_costs(cfg, q)["dkv"],
    )(q, k, v, do, lse4, delta4)
    return dq, dk, dv


# ---- GPU (Triton) kernels: one program per (batch, head, block), fori_loop over the other axis ---
# Simpler than the TPU grid: K/V (or Q/dO) of the head stay in HBM as whole-sequence refs and
# the loop bounds are the exact block range, so nothing outside the window/diagonal is visited.

def _gpu_segmented(kernel, n_in: int):
    """A Triton kernel called with three more inputs after its own: per token the first (or last)
    occurrence of its id (this program's block), this program's ids and the whole row's ids. The
    loop bound narrows to the blocks those occurrences reach; tiles are masked by equal ids."""
    def segmented(*refs):
        bound, mine, whole = refs[n_in:n_in + 3]
        return kernel(*refs[:n_in], *refs[n_in + 3:], seg=_Segments(bound, bound, mine, whole))
    return segmented


def _gpu_tile_mask(q_first, k_first, shape, window, seg, sl, transposed=False):
    vis = _visible(q_first, k_first, shape, window, transposed)
    if seg is None:
        return vis
    return jnp.logical_and(vis, seg.col[...][:, None] == seg.row[sl][None, :])


def _gpu_fwd_kernel(q_ref, k_ref, v_ref, sink_ref, o_ref, lse_ref, *, cfg: _Cfg, precision, seg=None):
    i = pl.program_id(2)
    bq, bkv = cfg.block_q, cfg.block_kv
    q = q_ref[...]
    lo, hi = _kv_range(i, cfg)
    if seg is not None:
        lo = jnp.maximum(lo, lax.div(jnp.min(seg.kv_lo[...]), bkv))

    def body(kb, carry):
        acc, m, l = carry
        sl = pl.ds(pl.multiple_of(kb * bkv, bkv), bkv)
        s = _dot(q, k_ref[sl, :], (1, 1), precision) * cfg.scale
        s = jnp.where(_gpu_tile_mask(i * bq, kb * bkv, s.shape, cfg.window, seg, sl), s, _MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_next)
        p = jnp.exp(s - m_next[:, None])
        v = v_ref[sl, :]
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, (1, 0), precision)
        return acc, m_next, alpha * l + jnp.sum(p, axis=1)

    init = (jnp.zeros(q.shape, jnp.float32), sink_ref[...], jnp.ones((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(lo, hi + 1, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _gpu_dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Cfg, precision, seg=None):
    i = pl.program_id(2)
    bq, bkv = cfg.block_q, cfg.block_kv
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    lo, hi = _kv_range(i, cfg)
    if seg is not None:
        lo = jnp.maximum(lo, lax.div(jnp.min(seg.kv_lo[...]), bkv))

    def body(kb, dq):
        sl = pl.ds(pl.multiple_of(kb * bkv, bkv), bkv)
        k, v = k_ref[sl, :], v_ref[sl, :]
        s = _dot(q, k, (1, 1), precision) * cfg.scale
        s = jnp.where(_gpu_tile_mask(i * bq, kb * bkv, s.shape, cfg.window, seg, sl), s, _MASK_VALUE)
        p = jnp.exp(s - lse)
        ds = p * (_dot(do, v, (1, 1), precision) - delta)
        return dq + _dot(ds.astype(k.dtype), k, (1, 0), precision)

    dq = lax.fori_loop(lo, hi + 1, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _gpu_dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, cfg: _Cfg,
                    group: int, precision, seg=None):
    j = pl.program_id(2)
    bq, bkv = cfg.block_q, cfg.block_kv
    k, v = k_ref[...], v_ref[...]
    lo, hi = _q_range(j, cfg)
    if seg is not None:
        hi = jnp.minimum(hi, lax.div(jnp.max(seg.q_hi[...]), bq))

    def head_body(g, carry):
        def body(qb, carry):
            dk, dv = carry
            sl = pl.ds(pl.multiple_of(qb * bq, bq), bq)
            q, do = q_ref[g, sl, :], do_ref[g, sl, :]
            st = _dot(k, q, (1, 1), precision) * cfg.scale   # keys x queries
            st = jnp.where(_gpu_tile_mask(qb * bq, j * bkv, st.shape, cfg.window, seg, sl, transposed=True),
                           st, _MASK_VALUE)
            pt = jnp.exp(st - lse_ref[g, sl][None, :])
            dv = dv + _dot(pt.astype(do.dtype), do, (1, 0), precision)
            dst = pt * (_dot(v, do, (1, 1), precision) - delta_ref[g, sl][None, :])
            return dk + _dot(dst.astype(q.dtype), q, (1, 0), precision), dv
        return lax.fori_loop(lo, hi + 1, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _gpu_call_kwargs(cfg: _Cfg, d: int):
    from jax.experimental.pallas import triton as pltriton   # selects Triton over Mosaic GPU
    return dict(interpret=cfg.mode.pallas_interpret(),
                compiler_params=pltriton.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2))


def _gpu_segment_inputs(segs, block: int, index):
    """(specs, arrays) of the three segmented inputs: bounds and ids of this program's block
    (`index(bi, h, i)` -> block index), ids of the whole row."""
    if segs is None:
        return [], []
    bound, ids = segs
    tp = ids.shape[1]
    blk = pl.BlockSpec((None, block), lambda bi, h, i: (bi, index(bi, h, i)))
    return [blk, blk, pl.BlockSpec((None, tp), lambda bi, h, i: (bi, 0))], [bound, ids, ids]


def _gpu_forward(cfg: _Cfg, q, k, v, sinks, segs=None):
    b, hq, tp, d = q.shape
    group = hq // k.shape[1]
    bq = cfg.block_q
    sink_rows = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], (hq, bq))  # a (bq,) tile per head
    seg_specs, seg_args = _gpu_segment_inputs(segs and (segs[0], segs[2]), bq, lambda bi, h, i: i)
    kernel = functools.partial(_gpu_fwd_kernel, cfg=cfg, precision=dot_precision(q.dtype))
    return pl.pallas_call(
        _gpu_segmented(kernel, 4) if segs else kernel,
        grid=(b, hq, cfg.nq),
        in_specs=[pl.BlockSpec((None, None, bq, d), lambda bi, h, i: (bi, h, i, 0)),
                  pl.BlockSpec((None, None, tp, d), lambda bi, h, i: (bi, ix.div(h, group), 0, 0)),
                  pl.BlockSpec((None, None, tp, d), lambda bi, h, i: (bi, ix.div(h, group), 0, 0)),
                  pl.BlockSpec((None, bq), lambda bi, h, i: (h, 0)), *seg_specs],
        out_specs=[pl.BlockSpec((None, None, bq, d), lambda bi, h, i: (bi, h, i, 0)),
                   pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, tp), jnp.float32)],
        name="attention_fwd_triton", **_gpu_call_kwargs(cfg, d),
    )(q, k, v, sink_rows, *seg_args)


def _gpu_backward(cfg: _Cfg, q, k, v, do, lse, delta, segs=None):
    b, hq, tp, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bq, bkv = cfg.block_q, cfg.block_kv
    prec = dot_precision(q.dtype)
    blk = lambda bi, h, i: (bi, h, i, 0)
    kv_full = lambda bi, h, i: (bi, ix.div(h, group), 0, 0)
    dq_kernel = functools.partial(_gpu_dq_kernel, cfg=cfg, precision=prec)
    dq_seg_specs, dq_seg_args = _gpu_segment_inputs(segs and (segs[0], segs[2]), bq, lambda bi, h, i: i)
    dq = pl.pallas_call(
        _gpu_segmented(dq_kernel, 6) if segs else dq_kernel,
        grid=(b, hq, cfg.nq),
        in_specs=[pl.BlockSpec((None, None, bq, d), blk),
                  pl.BlockSpec((None, None, tp, d), kv_full),
                  pl.BlockSpec((None, None, tp, d), kv_full),
                  pl.BlockSpec((None, None, bq, d), blk),
                  pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i)),
                  pl.BlockSpec((None, None, bq), lambda bi, h, i: (bi, h, i)), *dq_seg_specs],
        out_specs=pl.BlockSpec((None, None, bq, d), blk),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="attention_dq_triton", **_gpu_call_kwargs(cfg, d),
    )(q, k, v, do, lse, delta, *dq_seg_args)
    # dK/dV: one program per kv block of a kv head; it loops over the group's query heads.
    group_map = lambda bi, h, j: (bi, h, 0, 0)        # block of `group` heads = kv head h's queries
    dkv_kernel = functools.partial(_gpu_dkv_kernel, cfg=cfg, group=group, precision=prec)
    dkv_seg_specs, dkv_seg_args = _gpu_segment_inputs(segs and (segs[1], segs[2]), bkv, lambda bi, h, j: j)
    dk, dv = pl.pallas_call(
        _gpu_segmented(dkv_kernel, 6) if segs else dkv_kernel,
        grid=(b, hkv, cfg.nk),
        in_specs=[pl.BlockSpec((None, group, tp, d), group_map),
                  pl.BlockSpec((None, None, bkv, d), blk),
                  pl.BlockSpec((None, None, bkv, d), blk),
                  pl.BlockSpec((None, group, tp, d), group_map),
                  pl.BlockSpec((None, group, tp), lambda bi, h, j: (bi, h, 0)),
                  pl.BlockSpec((None, group, tp), lambda bi, h, j: (bi, h, 0)), *dkv_seg_specs],
        out_specs=[pl.BlockSpec((None, None, bkv, d), blk), pl.BlockSpec((None, None, bkv, d), blk)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="attention_dkv_triton", **_gpu_call_kwargs(cfg, d),
    )(q, k, v, do, lse, delta, *dkv_seg_args)
    return dq, dk, dv


# ---- custom_vjp glue ------------------------------------------------------------------------------

def _pad_seq(x, tp):
    t = x.shape[2]
    return x if t == tp else jnp.pad(x, ((0, 0), (0, 0), (0, tp - t), (0, 0)))


def _segment_inputs(cfg: _Cfg, segment_ids):
    """What the kernels read for segments: TPU (kv_lo, q_hi, ids [B, Tp, 1], ids [B, 1, Tp]);
    GPU (first occurrences, last occurrences, ids [B, Tp]). None without segments."""
    if segment_ids is None:
        return None
    seg = _pad_segments(segment_ids, cfg.padded_len)
    kv_lo, q_hi, first, last = _segment_block_bounds(seg, cfg)
    return (first, last, seg) if cfg.gpu else (kv_lo, q_hi, seg[:, :, None], seg[:, None, :])


def _forward(cfg: _Cfg, q, k, v, sinks, segment_ids):
    qp, kp, vp = (_pad_seq(x, cfg.padded_len) for x in (q, k, v))
    fwd = _gpu_forward if cfg.gpu else _tpu_forward
    out, lse = fwd(cfg, qp, kp, vp, sinks, _segment_inputs(cfg, segment_ids))
    return out[:, :, :cfg.seq_len], lse   # lse stays padded: [B, H, Tp] (GPU), [B, H, 1, Tp] (TPU)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Cfg, q, k, v, sinks, segment_ids):
    return _forward(cfg, q, k, v, sinks, segment_ids)[0]


def _attention_fwd(cfg: _Cfg, q, k, v, sinks, segment_ids):
    out, lse = _forward(cfg, q, k, v, sinks, segment_ids)
    return out, (q, k, v, sinks, segment_ids, out, lse)


def _attention_bwd(cfg: _Cfg, res, do):
    q, k, v, sinks, segment_ids, out, lse = res
    t = cfg.seq_len
    # delta = rowsum(dO * O): the softmax-Jacobian term, shared by dQ, dK and the sink.
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    # The sink is one more softmax column with value 0: d(sink) = -sum p_sink * delta.
    lse_t = lse[:, :, :t] if cfg.gpu else lse[:, :, 0, :t]
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse_t)
    dsinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    tp = cfg.padded_len
    pad_rows = lambda x: x if x.shape[2] == tp else jnp.pad(x, ((0, 0), (0, 0), (0, tp - x.shape[2])))
    qp, kp, vp, dop = (_pad_seq(x, tp) for x in (q, k, v, do.astype(q.dtype)))
    bwd = _gpu_backward if cfg.gpu else _tpu_backward
    segs = _segment_inputs(cfg, segment_ids)
    dq, dk, dv = bwd(cfg, qp, kp, vp, dop, lse, pad_rows(delta), segs)   # padded rows: dO = 0
    return dq[:, :, :t], dk[:, :, :t], dv[:, :, :t], dsinks, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_inputs(q, k, v, sinks, sliding_window, segment_ids=None):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,Hq,T,D], k/v [B,Hkv,T,D]; got {q.shape}, {k.shape}, {v.shape}")
    b, hq, tq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if k.shape[2] != tq:
        raise ValueError(f"this kernel needs Tq == Tk (training/prefill); got Tq={tq}, Tk={k.shape[2]}. "
                         "Use attention_reference for decoding (Tk > Tq).")
    if hq % k.shape[1]:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {k.shape[1]}")
    if sinks.shape != (hq,):
        raise ValueError(f"sinks must be [Hq]={hq,}; got {sinks.shape}")
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0; got {sliding_window}")
    if segment_ids is not None:
        _check_segment_ids(segment_ids, b, tq, k.shape[2])


def _check_segment_ids(segment_ids, b: int, tq: int, tk: int):
    if tq != tk or tuple(segment_ids.shape) != (b, tq) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integer [B, T] = [{b}, {tq}] with Tq == Tk; got "
                         f"{segment_ids.dtype} {tuple(segment_ids.shape)} (Tk={tk})")


def _plan_blocks(t: int, block_q: int, block_kv: int, mode: KernelMode):
    """Validated (block_q, block_kv, padded_len): blocks shrink to the sequence, one divides the other."""
    gpu = mode.family == "gpu"
    if gpu and (block_q & (block_q - 1) or block_kv & (block_kv - 1) or min(block_q, block_kv) < 16):
        raise ValueError(f"Triton blocks must be powers of two >= 16; got {block_q}, {block_kv}")
    if not gpu and (block_q % 8 or block_kv % 8):
        raise ValueError(f"TPU blocks must be multiples of 8; got {block_q}, {block_kv}")
    small, large = sorted((block_q, block_kv))
    small = min(small, max(16, _next_pow2(t)) if gpu else _round_up(t, 8))
    cover = _round_up(t, small)           # the larger block never exceeds the padded sequence
    large = min(large, _next_pow2(cover) if gpu else cover)
    if large % small:
        raise ValueError(f"block_q and block_kv must divide one another; got {block_q}, {block_kv}")
    block_q, block_kv = (small, large) if block_q <= block_kv else (large, small)
    return block_q, block_kv, _round_up(t, large)


def attention_pallas(q, k, v, sinks, *, sliding_window: int, scale: float, platform: str,
                     block_q: int | None = None, block_kv: int | None = None, vmem_limit_bytes: int | None = None,
                     interpret: str | None = None, segment_ids=None):
    """Flash attention with sinks, GQA, causal / sliding window; differentiable (custom_vjp).

    platform (pallas_kernels.platform): 'tpu' -> Mosaic kernels; 'gpu' -> Triton kernels; 'cpu' ->
    the TPU kernels in the generic interpreter. interpret: None, 'generic' or 'tpu' (an override:
    platform='gpu', interpret='generic' runs the Triton kernels on CPU). Blocks default to
    default_block_sizes(T, D, platform); one must divide the other; they shrink to fit the
    sequence, which is padded to a multiple of both. scale and sliding_window are static (Python
    numbers). Requires Tq == Tk (no decoding). TPU lowering needs blocks that are multiples of
    128 or cover the whole (padded) sequence; Triton needs power-of-two blocks >= 16 and a
    power-of-two head_dim. vmem_limit_bytes: the TPU kernels' scoped VMEM limit (default: the
    compiler's). segment_ids [B, T] (integers, optional): a query sees only keys of its own id;
    tiles whose queries and keys share no id are skipped (per-row block bounds: scalar-prefetch
    arguments on TPU, loop bounds on GPU) and every visited tile is masked.
    """
    _check_inputs(q, k, v, sinks, sliding_window, segment_ids)
    mode = kernel_mode(platform, interpret, who="attention_pallas")
    t, d = q.shape[2], q.shape[3]
    if mode.family == "gpu" and d & (d - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim; got {d}")
    default_q, default_kv = default_block_sizes(t, d, platform)
    block_q, block_kv, tp = _plan_blocks(t, block_q or default_q, block_kv or default_kv, mode)
    window = 0 if sliding_window >= t else int(sliding_window)   # a window covering T is plain causal
    if mode.family != "gpu":
        # The TPU kernels take q already scaled (as splash does): one multiply of q per call, which
        # XLA fuses into q's producer, instead of one per score in every tile of the forward, dq
        # and dkv kernels (their VPU work, as the v5e compiler's LLO counts it). dq = dq' * scale
        # comes from autodiff of this product. In bf16 q*scale is rounded once more.
        q, scale = (q.astype(jnp.float32) * scale).astype(q.dtype), 1.0
    cfg = _Cfg(window, float(scale), block_q, block_kv, t, tp, mode, vmem_limit_bytes, segment_ids is not None)
    return _attention(cfg, q, k, v, sinks, segment_ids)


# ---- Splash (jax-shipped TPU kernel) wrapper: a baseline and fall-back --------------------------
SPLASH_BLOCKS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                 "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")


@functools.lru_cache(maxsize=64)
def _splash_kernel(num_q_heads: int, padded_len: int, window: int, blocks: tuple, interpret: bool):
    """Splash's kernel object for one static mask. Its mask arrays are made concrete
    (`ensure_compile_time_eval`): made by `jnp.array` inside a trace they would be that trace's
    tracers, and a kernel built in one trace and called in another (the scan body of scanned
    layers, then the scan's backward) leaks them (UnexpectedTracerError). Concrete, the object is
    the same in every trace, so it is built once per mask and tile choice."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    shape = (padded_len, padded_len)
    # LocalMask's window_size=(left, right): keys q-left .. q+right, so left = W - 1.
    mask = sm.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window else sm.CausalMask(shape)
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha_single_device(sm.MultiHeadMask([mask] * num_q_heads),
                                                block_sizes=sk.BlockSizes(**dict(blocks)), interpret=interpret)


def splash_block_sizes(seq_len: int, head_dim: int, **blocks) -> dict:
    """Splash's eight tile sizes: each given one is kept, the rest default to one base tile
    (attention_pallas's TPU default, at least 128: splash's lane constraint). All must be
    multiples of 128."""
    base = blocks.get("block_q") or max(128, default_block_sizes(seq_len, head_dim, "tpu")[0])
    sizes = {name: blocks.get(name) or base for name in SPLASH_BLOCKS}
    bad = {n: b for n, b in sizes.items() if b % 128}
    if bad:
        raise ValueError(f"splash tiles must be multiples of 128; got {bad}")
    return sizes


def attention_splash(q, k, v, sinks, *, sliding_window: int, scale: float, platform: str,
                     interpret: str | None = None, segment_ids=None, **blocks):
    """The same op through jax's shipped Splash attention (TPU only; interpreted on CPU).

    Splash's MHA kernel takes GQA natively (q head h reads kv head h // (Hq // Hkv)) and has no
    batch axis, so the batch is vmapped. Splash does not scale q: q is pre-scaled here (in q's
    dtype, so bf16 inputs see one extra rounding). Gradients: splash's custom_vjp returns dq, dk,
    dv AND d(sinks) (computed in plain jnp from o, dO and lse), so all four inputs are
    differentiable. Its dots take the ambient matmul precision, so it runs, forward and backward,
    under the precision pallas_kernels.platform chooses for the input dtype (HIGHEST for float32,
    DEFAULT for bf16, which Mosaic needs). Tiles: `blocks` are splash's BlockSizes fields
    (SPLASH_BLOCKS); see splash_block_sizes. The sequence is padded to a multiple of the largest
    tile; causality hides the padding from real queries. segment_ids [B, T]: splash's own
    SegmentIds, which mask inside its tiles but skip none (its block sparsity is the static mask's).
    """
    _check_inputs(q, k, v, sinks, sliding_window, segment_ids)
    unknown = set(blocks) - set(SPLASH_BLOCKS)
    if unknown:
        raise TypeError(f"attention_splash: unknown tile option(s) {sorted(unknown)}; tiles are {SPLASH_BLOCKS}")
    mode = kernel_mode(platform, interpret, who="attention_splash", families=("tpu",),
                       hint="on GPU use attention_pallas (its Triton kernels)")
    t = q.shape[2]
    sizes = splash_block_sizes(t, q.shape[3], **blocks)
    tp = _round_up(t, math.lcm(*sizes.values()))
    window = 0 if sliding_window >= t else int(sliding_window)
    kernel = _splash_kernel(q.shape[1], tp, window, tuple(sorted(sizes.items())), mode.shipped_interpret())
    qs = _pad_seq((q.astype(jnp.float32) * scale).astype(q.dtype), tp)
    kp, vp = _pad_seq(k, tp), _pad_seq(v, tp)
    if segment_ids is None:
        call = with_matmul_precision(lambda q1, k1, v1, s: kernel(q1, k1, v1, sinks=s), precision_name(q.dtype))
        out = jax.vmap(call, in_axes=(0, 0, 0, None))(qs, kp, vp, sinks)
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds
        seg = _pad_segments(segment_ids, tp)
        call = with_matmul_precision(lambda q1, k1, v1, s, ids: kernel(q1, k1, v1, segment_ids=SegmentIds(ids, ids),
                                                                       sinks=s), precision_name(q.dtype))
        out = jax.vmap(call, in_axes=(0, 0, 0, None, 0))(qs, kp, vp, sinks, seg)
    return out[:, :, :t].astype(q.dtype)
