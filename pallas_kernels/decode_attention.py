"""Attention of new queries over a KV cache (generation): GQA with sinks, causal or sliding by
token position, each batch row with its own positions.

Layout: q [B, Hq, Tq, D]; k, v [B, Hkv, S, D] (cache slots, any order); q_positions [B, Tq] and
k_positions [B, S] int32, -1 for an empty or padding slot. Key j is visible to query i when
0 <= k_pos[j] <= q_pos[i] and, with a window W > 0, k_pos[j] > q_pos[i] - W.

Two implementations of the registry's `cached_attention` op: `cached_attention_reference` (plain
JAX, `xla`: the whole cache widened to float32 and every slot scored) and `cached_attention_pallas`
(`pallas`: the cache read block by block in its own dtype, only the blocks holding visible slots).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import index_math as ix
from pallas_kernels.attention import attention_over_positions
from pallas_kernels.cost import cost_estimate
from pallas_kernels.lanes import LANES
from pallas_kernels.platform import dot_precision, kernel_mode


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


# ==================================================================================================
# Pallas decode attention (forward only: generation).
#
# The query heads of one KV head are one block of rows, (group head, query) pairs, each with its own
# position: q [B, Hq, Tq, D] is viewed as [B, Hkv, G*Tq, D] (a free reshape), so a decode step's
# G heads share every K/V block read (their product runs on the MXU as [G*Tq, D] x [D, block]).
# The grid is (block of batch rows, row block, KV block); a grid step holds several batch rows and
# all their KV heads (a TPU grid step costs ~0.35 us: one per row and head would cost 2 ms a token
# at 64 rows x 8 heads x 12 layers) and loops over those (row, head) pairs. The cache stays where it
# is (in HBM, read block by block into VMEM in its own dtype: never widened, never copied), and the
# KV blocks outside the range of the row block's visible slots are skipped without a DMA: a block
# index past the last live block repeats it (no copy), and its compute is skipped. The range comes
# from the key positions (scalar-prefetch arguments), so a decode step reads the cache up to its
# current length, not the whole bucket. Online softmax with the sink as the running max's starting
# point (weight 1), as the training kernel: a query that sees no key returns 0.
# ==================================================================================================
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp(mask - m) == 0, never NaN
MAX_BLOCK_KV = 512      # keys per grid step (at most)
MAX_BLOCK_ROWS = 256    # (query head, query) rows per grid step (prefill's long prompts)
BLOCK_BYTES = 2 << 20   # batch rows per grid step: as many as keep a step's K (or V) and Q blocks under this
_ROW_MULTIPLE = 16      # row blocks smaller than all the rows are whole bf16 sublane tiles


def cached_block_kv(slots: int, block_kv: int | None = None) -> int:
    """Keys per grid step for a cache of `slots` slots: `block_kv` when given (at most the slots),
    else all the slots in one block up to MAX_BLOCK_KV, and beyond that whole 128-lane tiles (512,
    256 or 128, the least padding): the TPU wants a key-position block of whole 128 lanes or the
    whole row. The cache is never padded (that would copy it): a last block past its end is read
    in part, and its missing slots are masked."""
    if block_kv is not None:
        if block_kv <= 0:
            raise ValueError(f"cached_attention_pallas: block_kv must be positive, found {block_kv}")
        return min(block_kv, slots)
    if slots <= MAX_BLOCK_KV:
        return slots
    return min((512, 256, 128), key=lambda b: (-(-slots // b) * b - slots, -b))


def batch_block(batch: int, per_row_bytes: int, block_batch: int | None = None) -> int:
    """Batch rows per grid step: `block_batch` when given (it must divide the batch), else the most
    rows, dividing the batch, whose blocks stay under BLOCK_BYTES (at least one)."""
    if block_batch is not None:
        if block_batch <= 0 or batch % block_batch:
            raise ValueError(f"cached_attention_pallas: block_batch={block_batch} must divide the batch of {batch}")
        return block_batch
    fit = max(1, BLOCK_BYTES // max(per_row_bytes, 1))
    return max(n for n in range(1, min(batch, fit) + 1) if batch % n == 0)


def live_block_range(q_positions, k_positions, *, sliding_window: int, block_kv: int, block_batch: int = 1):
    """(first, last) KV block [B / block_batch] int32 of the slots some query of a block of rows
    may see (0, -1: none): the blocks its grid steps visit."""
    b, s = k_positions.shape
    qmax = jnp.max(q_positions, axis=1, keepdims=True)
    qmin = jnp.min(jnp.where(q_positions >= 0, q_positions, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
    seen = (k_positions >= 0) & (k_positions <= qmax)
    if sliding_window > 0:
        seen = seen & (k_positions > qmin - sliding_window)
    slot = jnp.arange(s, dtype=jnp.int32)[None]
    last = jnp.max(jnp.where(seen, slot, -1).reshape(b // block_batch, -1), axis=1)
    first = jnp.min(jnp.where(seen, slot, s).reshape(b // block_batch, -1), axis=1)
    none = last < 0          # no block to visit: first 0, last -1 (block 0 is fetched once, never used)
    return (jnp.where(none, 0, first // block_kv).astype(jnp.int32),
            jnp.where(none, -1, last // block_kv).astype(jnp.int32))


def _decode_kernel(first_ref, last_ref, sink_ref, qpos_ref, q_ref, kpos_ref, k_ref, v_ref, o_ref,
                   m_scr, l_scr, acc_scr, *, window: int, scale: float, precision, slots: int):
    # Blocks: sink [Hkv, rows, 1], qpos [bb, rows, 1], q and o [bb, Hkv, rows, D], kpos [bb, 1, block],
    # k and v [bb, Hkv, block, D]; scratch m, l [bb, Hkv, rows, 128], acc [bb, Hkv, rows, D].
    bi, j = pl.program_id(0), pl.program_id(2)
    bb, heads = k_ref.shape[0], k_ref.shape[1]
    kb = first_ref[bi] + j

    @pl.when(j == 0)
    def _init():
        for h in range(heads):
            m_scr[:, h] = jnp.broadcast_to(sink_ref[h][None], m_scr.shape[:1] + m_scr.shape[2:])
        l_scr[...] = jnp.ones(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(kb <= last_ref[bi])
    def _step():
        def pair(n, carry):
            r, h = lax.div(n, heads), lax.rem(n, heads)     # not // and %: floor division lowers to sign
            k, v = k_ref[r, h], v_ref[r, h]
            block = v.shape[0]
            if slots % block:       # the last block runs past the cache: its missing slots' values -> 0
                slot = kb * block + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
                v = jnp.where(slot < slots, v, jnp.zeros_like(v))
            s = lax.dot_general(q_ref[r, h], k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * scale
            kpos, qpos = kpos_ref[r], qpos_ref[r]          # [1, block], [rows, 1]
            visible = (kpos >= 0) & (kpos <= qpos)
            if window > 0:
                visible = visible & (kpos > qpos - window)
            s = jnp.where(visible, s, _MASK_VALUE)
            m_prev = m_scr[r, h]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, :1])
            l_scr[r, h] = alpha * l_scr[r, h] + jnp.sum(p, axis=1, keepdims=True)
            acc_scr[r, h] = acc_scr[r, h] * alpha[:, :1] + lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                preferred_element_type=jnp.float32)
            m_scr[r, h] = m_next
            return carry

        lax.fori_loop(0, bb * heads, pair, 0)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = (acc_scr[...] / l_scr[..., :1]).astype(o_ref.dtype)


def cached_attention_pallas(q, k, v, sinks, q_positions, k_positions, *, sliding_window: int, scale: float,
                            platform: str, block_kv: int | None = None, block_rows: int | None = None,
                            block_batch: int | None = None, interpret: str | None = None,
                            vmem_limit_bytes: int | None = None):
    """The `pallas` implementation of `cached_attention` (forward only; Mosaic TPU, interpreted on
    CPU): same contract as `cached_attention_reference`. Scores and the softmax in float32 from
    the operands' dtype (bf16 products exact), probabilities cast to V's dtype for the value
    product (as the training kernel). block_kv: keys per grid step (default `cached_block_kv`; on
    TPU a multiple of 128 or all the slots); block_rows: (query head, query) rows per step
    (default: all of a KV head's G*Tq rows, up to MAX_BLOCK_ROWS; more are padded to a multiple of
    the block); block_batch: batch rows per step (default `batch_block`). Cost estimate: every
    block read (the worst case: the bucket's whole cache)."""
    mode = kernel_mode(platform, interpret, who="cached_attention_pallas", families=("tpu",),
                       hint="cached_attention=xla runs everywhere")
    b, hq, tq, d = q.shape
    hkv, slots = k.shape[1], k.shape[2]
    if hq % hkv or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"cached_attention_pallas: q {q.shape}, k {k.shape}, v {v.shape} are not GQA shapes")
    group = hq // hkv
    bkv = cached_block_kv(slots, block_kv)
    rows = group * tq
    # One block of all a KV head's rows when they fit (a block equal to the whole dimension needs no
    # padding: a decode step's few rows stay as they are); else blocks of whole bf16 tiles.
    br = block_rows or (rows if rows <= MAX_BLOCK_ROWS else MAX_BLOCK_ROWS)
    if br != rows and br % _ROW_MULTIPLE:
        raise ValueError(f"cached_attention_pallas: block_rows={br} must be a multiple of {_ROW_MULTIPLE} "
                         f"(or all {rows} rows)")
    padded = -(-rows // br) * br
    bb = batch_block(b, hkv * (bkv + br) * d * jnp.dtype(k.dtype).itemsize, block_batch)
    qr = q.reshape(b, hkv, rows, d)
    qpos = jnp.broadcast_to(q_positions.astype(jnp.int32)[:, None, :], (b, group, tq)).reshape(b, rows)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(hkv, group, 1), (hkv, group, tq)).reshape(hkv, rows)
    if padded != rows:      # padding rows see nothing (position -1) and are dropped
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, padded - rows)), constant_values=-1)
        sink = jnp.pad(sink, ((0, 0), (0, padded - rows)))
    steps = -(-slots // bkv)
    # Key positions as one row per batch row, padded (empty: -1) to whole blocks: small, unlike the cache.
    kpos = jnp.pad(k_positions.astype(jnp.int32), ((0, 0), (0, steps * bkv - slots)), constant_values=-1)[:, None]
    first, last = live_block_range(q_positions.astype(jnp.int32), k_positions.astype(jnp.int32),
                                   sliding_window=int(sliding_window), block_kv=bkv, block_batch=bb)
    grid = (b // bb, padded // br, steps)

    def block(bi, j, first_ref, last_ref):        # past the last live block: repeat it (no DMA)
        return ix.minimum(first_ref[bi] + j, ix.maximum(last_ref[bi], first_ref[bi]))

    kv_spec = pl.BlockSpec((bb, hkv, bkv, d), lambda bi, i, j, f, l: (bi, 0, block(bi, j, f, l), 0))
    q_spec = pl.BlockSpec((bb, hkv, br, d), lambda bi, i, j, f, l: (bi, 0, i, 0))
    in_specs = [pl.BlockSpec((hkv, br, 1), lambda bi, i, j, f, l: (0, i, 0)),
                pl.BlockSpec((bb, br, 1), lambda bi, i, j, f, l: (bi, i, 0)),
                q_spec,
                pl.BlockSpec((bb, 1, bkv), lambda bi, i, j, f, l: (bi, 0, block(bi, j, f, l))),
                kv_spec, kv_spec]
    inputs = (sink[..., None], qpos[..., None], qr, kpos, k, v)
    out_shape = jax.ShapeDtypeStruct(qr.shape, q.dtype)
    worst = (np.zeros(b // bb, np.int32), np.full(b // bb, steps - 1, np.int32))
    estimate = cost_estimate(grid, in_specs, inputs, [q_spec], [out_shape], prefetch=worst,
                             flops=4 * b * hkv * padded * slots * d, transcendentals=b * hkv * padded * slots)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((bb, hkv, br, LANES), jnp.float32), pltpu.VMEM((bb, hkv, br, LANES), jnp.float32),
                        pltpu.VMEM((bb, hkv, br, d), jnp.float32)])
    kernel = functools.partial(_decode_kernel, window=int(sliding_window), scale=float(scale),
                               precision=dot_precision(q.dtype), slots=slots)
    out = pl.pallas_call(
        kernel, grid_spec=spec, out_shape=out_shape, name="cached_attention", cost_estimate=estimate,
        interpret=mode.pallas_interpret(),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
    )(first, last, *inputs)
    return out[:, :, :rows].reshape(b, hq, tq, d)
