"""Grouped expert MLP (GPT-OSS): up projection + clamped SwiGLU, then down projection.

x [M, H] rows sorted by expert; group_sizes [E] int32 (sum == M, empty groups allowed);
gate_up [E, H, 2I] with gate/up interleaved (gate = [..., ::2], up = [..., 1::2]);
gate_up_bias [E, 2I]; down [E, I, H]; down_bias [E, H]. Each row goes through its own expert only.

Implementations (same signature, plus keyword options):
  moe_experts_reference  two jax.lax.ragged_dot (on CPU it computes every expert: ~10x dense)
  moe_experts_xla        megablox's (row tile, expert) schedule as batched XLA ops; CPU training
  moe_experts_pallas     fused Pallas expert MLP: up projection, clamped SwiGLU and down projection in
                         one kernel per (row tile, expert); [M, I] never in HBM, forward or backward
                         (custom_vjp with recomputing backward kernels); TPU, interpret on CPU
  moe_experts_pallas_unfused  the earlier two grouped-GEMM Pallas kernels (h [M, I] in HBM)
  moe_experts_megablox   jax-shipped megablox gmm around plain-JAX activation; a baseline

HBM temp memory of each (compile-only, forward and forward+backward): pallas_kernels/memory.py.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


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
    tm = tile_rows or max(8, min(512, _round_up(max(m // (4 * num_groups), 1), 8)))
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
    gu = gu + gate_up_bias.astype(acc)[meta.group_ids][:, None, :]   # cast first: bias grads sum in f32
    h = clamped_swiglu(gu, alpha=alpha, limit=limit).astype(x.dtype)
    y = jnp.einsum("wti,wih->wth", h, down[meta.group_ids], precision=prec, preferred_element_type=acc)
    y = y + down_bias.astype(acc)[meta.group_ids][:, None, :]
    y = jnp.where(live[..., None], y, 0.0)   # select, not multiply: no 0 * inf leaking through
    y = jax.ops.segment_sum(y, meta.tile_ids, num_segments=num_tiles, indices_are_sorted=True)
    return y.reshape(mp, hdim)[:m].astype(x.dtype)


# =============================================================================================
# Pallas grouped-GEMM kernels (Mosaic TPU; interpret mode on CPU)
# =============================================================================================
# Every kernel takes the GroupMetadata as four scalar-prefetch operands (SMEM on TPU), so the
# BlockSpec index maps can pick each work item's row tile and expert weight block.
# Rows of a tile that belong to another expert are masked with a select (never a multiply, so
# garbage in padding rows cannot leak in as NaN).
_F32 = jnp.float32


class MoETiling(NamedTuple):
    tm: int   # rows per tile (the ragged dimension)
    th: int   # hidden (H) tile: reduction tile of the up projection, output tile of the down one
    ti: int   # intermediate (I) tile: gate_up blocks hold 2*ti columns, h blocks ti


DEFAULT_TILING = {   # the unfused kernels' tiles (the fused path: DEFAULT_FUSED_TILING)
    # TPU: MXU-sized blocks (v6e MXU is 256x256), all well inside the default scoped VMEM
    # (largest kernel ~5 MiB at tm=256, th=512, ti=384 in bf16). Untuned: tune on hardware.
    "tpu": MoETiling(tm=256, th=512, ti=512),
    # CPU interpret mode: each grid step costs fixed overhead, so use few, large blocks.
    "cpu": MoETiling(tm=128, th=512, ti=512),
}


def _rows_mine(offsets, gids, tiles, w, tm: int, shape):
    """[tm, n] bool: rows of work item w's tile that belong to its expert."""
    g = gids[w]
    rows = tiles[w] * tm + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= offsets[g]) & (rows < offsets[g + 1])


def _store_rows(out_ref, val, offsets, gids, tiles, w, tm: int):
    """Write this expert's rows of the tile; on the tile's first visit zero the other rows
    (a later visit by the next expert fills its own), so every output row is defined."""
    mine = _rows_mine(offsets, gids, tiles, w, tm, val.shape)
    first_visit = (w == 0) | (tiles[jnp.maximum(w - 1, 0)] != tiles[w])

    # Two branches rather than a select on a scalar predicate (a vector-of-i1 broadcast).
    @pl.when(first_visit)
    def _first():
        out_ref[...] = jnp.where(mine, val, 0.0).astype(out_ref.dtype)

    @pl.when(jnp.logical_not(first_visit))
    def _again():
        out_ref[...] = jnp.where(mine, val, out_ref[...].astype(_F32)).astype(out_ref.dtype)


def _gmm(meta: GroupMetadata, lhs, rhs, bias, *, tm: int, tk: int, tn: int, out_dtype, interpret,
         transpose_rhs: bool = False, swiglu: tuple[float, float] | None = None):
    """out[rows of e] = epilogue(lhs[rows of e] @ rhs[e] (+ bias[e])).

    lhs [Mp, K]; rhs [E, K, N] ([E, N, K] if transpose_rhs); bias [E, 1, N] or None.
    swiglu=(alpha, limit): rhs columns are in _split_layout with tn = 2 * ti, and the clamped
    SwiGLU runs on the float32 accumulator before the store, giving [Mp, N / 2].
    Grid (N tiles, work items, K tiles); K is the innermost reduction into a VMEM accumulator.
    """
    mp, kdim = lhs.shape
    ndim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tn_out = tn // 2 if swiglu else tn
    n_out = ndim // 2 if swiglu else ndim
    nk, nn, num_items = kdim // tk, ndim // tn, meta.group_ids.shape[0]
    prec = _precision(lhs.dtype)
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def kernel(offsets, gids, tiles, nact, lhs_ref, rhs_ref, *rest):
        bias_ref = rest[0] if bias is not None else None
        out_ref, acc_ref = rest[-2:]
        w, k = pl.program_id(1), pl.program_id(2)
        active = w < nact[0]

        @pl.when(k == 0)
        def _zero():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(active)
        def _accumulate():
            acc_ref[...] += jax.lax.dot_general(lhs_ref[...], rhs_ref[...], dims, precision=prec,
                                                preferred_element_type=_F32)

        @pl.when(active & (k == nk - 1))
        def _epilogue():
            val = acc_ref[...]
            if bias_ref is not None:
                val = val + bias_ref[...].astype(_F32)
            if swiglu:
                val = _swiglu_fwd_split(val, tn_out, alpha=swiglu[0], limit=swiglu[1])
            _store_rows(out_ref, val, offsets, gids, tiles, w, tm)

    in_specs = [pl.BlockSpec((tm, tk), lambda n, w, k, o, g, t, a: (t[w], k))]
    if transpose_rhs:
        in_specs.append(pl.BlockSpec((None, tn, tk), lambda n, w, k, o, g, t, a: (g[w], n, k)))
    else:
        in_specs.append(pl.BlockSpec((None, tk, tn), lambda n, w, k, o, g, t, a: (g[w], k, n)))
    operands = [lhs, rhs]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, 1, tn), lambda n, w, k, o, g, t, a: (g[w], 0, n)))
        operands.append(bias)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, n_out), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(nn, num_items, nk),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn_out), lambda n, w, k, o, g, t, a: (t[w], n)),
            scratch_shapes=[pltpu.VMEM((tm, tn), _F32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=2 * mp * kdim * ndim, transcendentals=mp * n_out if swiglu else 0,
                                      bytes_accessed=lhs.nbytes * nn + rhs.nbytes
                                      + mp * n_out * jnp.dtype(out_dtype).itemsize),
        interpret=interpret,
    )(*meta, *operands)


def _swiglu_grad(meta: GroupMetadata, x, dy, w1, b1, w2, *, tm: int, th: int, ti: int, alpha: float, limit: float,
                 interpret):
    """d(loss)/d(gate_up pre-activation), [Mp, 2I] in _split_layout, without storing it in forward:
    recomputes gu = x @ w1[e] + b1[e] and dh = dy @ w2[e]^T together (both reduce over H), then
    applies the SwiGLU derivative in the epilogue. Grid (I tiles, work items, H tiles)."""
    mp, hdim = x.shape
    two_i = w1.shape[2]
    nk, nj, num_items = hdim // th, two_i // (2 * ti), meta.group_ids.shape[0]
    prec = _precision(x.dtype)
    nt = (((1,), (1,)), ((), ()))

    def kernel(offsets, gids, tiles, nact, x_ref, dy_ref, w1_ref, b1_ref, w2_ref, out_ref, gu_acc, dh_acc):
        w, k = pl.program_id(1), pl.program_id(2)
        active = w < nact[0]

        @pl.when(k == 0)
        def _zero():
            gu_acc[...] = jnp.zeros_like(gu_acc)
            dh_acc[...] = jnp.zeros_like(dh_acc)

        @pl.when(active)
        def _accumulate():
            gu_acc[...] += jnp.dot(x_ref[...], w1_ref[...], precision=prec, preferred_element_type=_F32)
            dh_acc[...] += jax.lax.dot_general(dy_ref[...], w2_ref[...], nt, precision=prec,
                                               preferred_element_type=_F32)

        @pl.when(active & (k == nk - 1))
        def _epilogue():
            gu = gu_acc[...] + b1_ref[...].astype(_F32)
            dgu = _swiglu_bwd_split(gu, dh_acc[...], ti, alpha=alpha, limit=limit)
            _store_rows(out_ref, dgu, offsets, gids, tiles, w, tm)

    row_block = pl.BlockSpec((tm, th), lambda j, w, k, o, g, t, a: (t[w], k))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, two_i), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(nj, num_items, nk),
            in_specs=[row_block, row_block,
                      pl.BlockSpec((None, th, 2 * ti), lambda j, w, k, o, g, t, a: (g[w], k, j)),
                      pl.BlockSpec((None, 1, 2 * ti), lambda j, w, k, o, g, t, a: (g[w], 0, j)),
                      pl.BlockSpec((None, ti, th), lambda j, w, k, o, g, t, a: (g[w], j, k))],
            out_specs=pl.BlockSpec((tm, 2 * ti), lambda j, w, k, o, g, t, a: (t[w], j)),
            scratch_shapes=[pltpu.VMEM((tm, 2 * ti), _F32), pltpu.VMEM((tm, ti), _F32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=2 * mp * hdim * two_i * 3 // 2, transcendentals=mp * two_i // 2,
                                      bytes_accessed=2 * x.nbytes * nj + w1.nbytes + w2.nbytes
                                      + mp * two_i * x.dtype.itemsize),
        interpret=interpret,
    )(*meta, x, dy, w1, b1, w2)


def _tgmm(meta: GroupMetadata, lhs, rhs, *, tm: int, tk: int, tn: int, num_groups: int, out_dtype, bias_dtype,
          interpret):
    """Transposed grouped GEMM (megablox tgmm) with the bias gradient fused in:
    dw[e] = lhs[rows of e]^T @ rhs[rows of e]  -> [E, K, N]
    db[e] = sum over rows of e of rhs          -> [E, 1, N]
    Grid (K tiles, N tiles, work items): the work items of one expert are consecutive, so each
    dw block accumulates in VMEM and is written once. `meta` must visit empty groups (they get
    one all-masked item, which writes their zero gradient). db is produced once per K tile (a
    separate output row each, so no block is revisited out of order); copy 0 is returned."""
    mp, kdim = lhs.shape
    ndim = rhs.shape[1]
    nk, nn, num_items = kdim // tk, ndim // tn, meta.group_ids.shape[0]
    dot_dtype = lhs.dtype
    prec = _precision(dot_dtype)

    def kernel(offsets, gids, tiles, nact, lhs_ref, rhs_ref, dw_ref, db_ref, acc, bacc):
        w = pl.program_id(2)
        g = gids[w]
        active = w < nact[0]
        first = (w == 0) | (gids[jnp.maximum(w - 1, 0)] != g)
        last = active & ((w == nact[0] - 1) | (gids[jnp.minimum(w + 1, num_items - 1)] != g))

        @pl.when(first)
        def _zero():
            acc[...] = jnp.zeros_like(acc)
            bacc[...] = jnp.zeros_like(bacc)

        @pl.when(active)
        def _accumulate():
            lhs_blk = lhs_ref[...].astype(_F32)
            rhs_blk = rhs_ref[...].astype(_F32)
            lhs_blk = jnp.where(_rows_mine(offsets, gids, tiles, w, tm, lhs_blk.shape), lhs_blk, 0.0)
            rhs_blk = jnp.where(_rows_mine(offsets, gids, tiles, w, tm, rhs_blk.shape), rhs_blk, 0.0)
            # Transpose in float32 then cast back, as megablox does (32-bit transposes lower on
            # every TPU generation).
            acc[...] += jnp.dot(lhs_blk.T.astype(dot_dtype), rhs_blk.astype(dot_dtype), precision=prec,
                                preferred_element_type=_F32)
            bacc[...] += jnp.sum(rhs_blk, axis=0, keepdims=True)

        @pl.when(last)
        def _store():
            dw_ref[...] = acc[...].astype(dw_ref.dtype)
            db_ref[...] = bacc[...].astype(db_ref.dtype)

    dw, db = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_groups, kdim, ndim), out_dtype),
                   jax.ShapeDtypeStruct((nk, num_groups, 1, ndim), bias_dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(nk, nn, num_items),
            in_specs=[pl.BlockSpec((tm, tk), lambda kk, n, w, o, g, t, a: (t[w], kk)),
                      pl.BlockSpec((tm, tn), lambda kk, n, w, o, g, t, a: (t[w], n))],
            out_specs=[pl.BlockSpec((None, tk, tn), lambda kk, n, w, o, g, t, a: (g[w], kk, n)),
                       pl.BlockSpec((None, None, 1, tn), lambda kk, n, w, o, g, t, a: (kk, g[w], 0, n))],
            scratch_shapes=[pltpu.VMEM((tk, tn), _F32), pltpu.VMEM((1, tn), _F32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=2 * mp * kdim * ndim, transcendentals=0,
                                      bytes_accessed=lhs.nbytes * nn + rhs.nbytes * nk
                                      + num_groups * kdim * ndim * jnp.dtype(out_dtype).itemsize),
        interpret=interpret,
    )(*meta, lhs, rhs)
    return dw, db[0]


# =============================================================================================
# custom_vjp glue for the Pallas path
# =============================================================================================
class _PallasConfig(NamedTuple):
    tm: int
    th: int
    ti: int
    alpha: float
    limit: float
    interpret: bool


def _pallas_forward(xp, group_sizes, w1, b1, w2, b2, cfg: _PallasConfig):
    meta = group_metadata(group_sizes, xp.shape[0] // cfg.tm, cfg.tm)
    h = _gmm(meta, xp, w1, b1, tm=cfg.tm, tk=cfg.th, tn=2 * cfg.ti, out_dtype=xp.dtype, interpret=cfg.interpret,
             swiglu=(cfg.alpha, cfg.limit))
    y = _gmm(meta, h, w2, b2, tm=cfg.tm, tk=cfg.ti, tn=cfg.th, out_dtype=xp.dtype, interpret=cfg.interpret)
    return y, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_pallas_core(xp, group_sizes, w1, b1, w2, b2, cfg: _PallasConfig):
    return _pallas_forward(xp, group_sizes, w1, b1, w2, b2, cfg)[0]


def _moe_pallas_core_fwd(xp, group_sizes, w1, b1, w2, b2, cfg):
    y, h = _pallas_forward(xp, group_sizes, w1, b1, w2, b2, cfg)
    # Residuals: inputs plus h [Mp, I] (needed for dW2); the [Mp, 2I] pre-activation is
    # recomputed in backward rather than stored.
    return y, (xp, group_sizes, w1, b1, w2, b2, h)


def _moe_pallas_core_bwd(cfg, res, dy):
    xp, group_sizes, w1, b1, w2, b2, h = res
    num_tiles, num_groups = xp.shape[0] // cfg.tm, w1.shape[0]
    meta = group_metadata(group_sizes, num_tiles, cfg.tm)
    meta_all = group_metadata(group_sizes, num_tiles, cfg.tm, visit_empty=True)
    common = dict(tm=cfg.tm, num_groups=num_groups, interpret=cfg.interpret)
    dw2, db2 = _tgmm(meta_all, h, dy, tk=cfg.ti, tn=cfg.th, out_dtype=w2.dtype, bias_dtype=b2.dtype, **common)
    dgu = _swiglu_grad(meta, xp, dy, w1, b1, w2, tm=cfg.tm, th=cfg.th, ti=cfg.ti, alpha=cfg.alpha, limit=cfg.limit,
                       interpret=cfg.interpret)
    dx = _gmm(meta, dgu, w1, None, tm=cfg.tm, tk=2 * cfg.ti, tn=cfg.th, out_dtype=xp.dtype, interpret=cfg.interpret,
              transpose_rhs=True)
    dw1, db1 = _tgmm(meta_all, xp, dgu, tk=cfg.th, tn=2 * cfg.ti, out_dtype=w1.dtype, bias_dtype=b1.dtype, **common)
    return dx, None, dw1, db1, dw2, db2


_moe_pallas_core.defvjp(_moe_pallas_core_fwd, _moe_pallas_core_bwd)


def _resolve_tiling(tiling, backend: str, m: int, hdim: int, idim: int, dtype) -> tuple[MoETiling, int, int]:
    """Tiles clipped to the problem; returns (tiling, padded H, padded I). On TPU every lane
    block must be a multiple of 128 or the whole dimension, so an H with no such divisor near
    the wanted tile is zero-padded to a multiple of 128 rather than taken whole into VMEM; I is
    always padded to a multiple of 128 because kernels slice [gate ti | up ti] blocks at lane
    offset ti. Zero weights and biases give h = 0 in padded columns, so results are unchanged."""
    want = MoETiling(*(tiling if tiling is not None else DEFAULT_TILING[backend]))
    on_tpu = backend == "tpu"
    lane = 128 if on_tpu else 8
    sub = (16 if jnp.dtype(dtype).itemsize < 4 else 8) if on_tpu else 8
    hp, ip = hdim, idim
    if on_tpu:
        if hdim > want.th and _fit(hdim, want.th, lane) == hdim:
            hp = _round_up(hdim, lane)
        ip = _round_up(idim, lane)
    tm = max(sub, min(_round_up(want.tm, sub), _round_up(m, sub)))
    return MoETiling(tm, _fit(hp, want.th, lane), _fit(ip, want.ti, lane)), hp, ip


def moe_experts_pallas_unfused(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                               limit: float = 7.0, tiling=None, backend: str | None = None):
    """The earlier two-stage Pallas path (moe_experts_pallas is now the fused one; this stays as a
    comparison and fall-back). It writes h [M, I] between its kernels, stores h as a residual,
    writes the [M, 2I] pre-activation gradient in backward, and copies gate_up into a permuted
    layout on every call. Kernel 1 = x @ gate_up[e] + bias with the clamped SwiGLU in its
    epilogue (writes h [M, I] only); kernel 2 = h @ down[e] + bias. Backward (custom_vjp):
    one kernel recomputes the pre-activation and applies the SwiGLU derivative, dx is a grouped
    GEMM against transposed gate_up, weight and bias grads are transposed grouped GEMMs.

    tiling: MoETiling(tm, th, ti) or a 3-tuple (rows, H tile, I tile); None -> per-backend
    DEFAULT_TILING, clipped to the problem. backend: None -> jax.default_backend(); 'tpu' ->
    Mosaic; 'cpu' -> the same kernels in interpret mode. Float32 inputs use HIGHEST precision,
    all matmuls accumulate in float32; outputs and gradients come back in the input dtypes.
    """
    backend = (backend or jax.default_backend()).lower()
    if backend in ("gpu", "cuda", "rocm"):
        raise NotImplementedError("moe_experts_pallas_unfused has no GPU kernel (its kernels are Mosaic TPU); on GPU "
                                  "use the 'xla' implementation (moe_experts_xla) or 'ragged_dot' (moe_experts_reference)")
    if backend not in ("tpu", "cpu"):
        raise ValueError(f"moe_experts_pallas_unfused: unknown backend {backend!r} (expected 'tpu' or 'cpu')")
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    idim = two_i // 2
    if m == 0:
        return jnp.zeros_like(x)
    cfg_t, hp, ip = _resolve_tiling(tiling, backend, m, hdim, idim, x.dtype)
    cfg = _PallasConfig(cfg_t.tm, cfg_t.th, cfg_t.ti, float(alpha), float(limit), backend == "cpu")
    mp = _round_up(m, cfg.tm)

    dtype = x.dtype
    w1 = gate_up.astype(dtype).reshape(num_groups, hdim, idim, 2)
    b1 = gate_up_bias.reshape(num_groups, 1, idim, 2)
    w2, b2 = down.astype(dtype), down_bias.reshape(num_groups, 1, hdim)
    xp = jnp.pad(x, ((0, mp - m), (0, hp - hdim)))
    if (hp, ip) != (hdim, idim):
        w1 = jnp.pad(w1, ((0, 0), (0, hp - hdim), (0, ip - idim), (0, 0)))
        b1 = jnp.pad(b1, ((0, 0), (0, 0), (0, ip - idim), (0, 0)))
        w2 = jnp.pad(w2, ((0, 0), (0, ip - idim), (0, hp - hdim)))
        b2 = jnp.pad(b2, ((0, 0), (0, 0), (0, hp - hdim)))
    w1 = _split_layout(w1.reshape(num_groups, hp, 2 * ip), cfg.ti)
    b1 = _split_layout(b1.reshape(num_groups, 1, 2 * ip), cfg.ti)
    y = _moe_pallas_core(xp, group_sizes.astype(jnp.int32), w1, b1, w2, b2, cfg)
    return y[:m, :hdim]


# =============================================================================================
# Fused expert MLP (the default Pallas path): [M, I] and [M, 2I] never reach HBM
# =============================================================================================
# One work item = one (row tile, expert) pair, as above. For each item and each I tile j:
#   pre = x_tile @ gate_up[e][:, j] + b1      [tm, 2ti] float32, gate/up still INTERLEAVED
#   h   = clamped_swiglu(pre)                 [tm, ti], in VMEM only
#   y_tile += h @ down[e][j, :]               accumulated over j in VMEM, + b2, rows of e stored
# Backward recomputes pre and h in VMEM (residuals are the inputs only):
#   dx kernel, grid (items, I tiles): dh = dy @ down[e][j]^T, dpre = swiglu'(pre) * dh,
#     dx_tile += dpre @ gate_up[e][:, j]^T
#   dW kernel, grid (I tiles, items), expert-major: per expert, accumulate in VMEM
#     dgate_up[e][:, j] += x^T dpre, dbias1 += sum dpre, ddown[e][j] += h^T dy, dbias2 += sum dy
#
# Gate/up de-interleaving without a permuted copy of gate_up: Mosaic has no lane-strided loads
# (its strided load rule rejects "Stride on last dim is not 1"), so the kernels work on the
# interleaved [tm, 2ti] block directly. Two lane rotations (pltpu.roll, the XLU) give every lane
# its pair partner (lane ^ 1), so the SwiGLU and its derivative are computed at every lane: in
# backward dpre comes out already interleaved, which is exactly the layout dx and dgate_up need.
# Only two small matmuls against constant 0/1 matrices remain (exact, the MXU's way to shuffle
# lanes): `_compact_pairs` [tm, 2ti] -> [tm, ti] (h, before the down projection) and
# `_spread_pairs` [tm, ti] -> [tm, 2ti] (dh, to both lanes of its pair). They add about
# 2*ti/(3*H) to the forward's matmul FLOPs and 10*ti/(11*H) to the backward's (bf16, where the
# spread takes two passes, hi and lo): ~6% / ~9% at Lyra Small (H = 2048, ti = 192 after the
# VMEM budget). The rotation direction is read from a rotated iota, so the code does not depend
# on which way the hardware rotates.
#
# HBM traffic: x/dy row tiles are read once per I tile; weight blocks are re-fetched for every
# work item when there are several I tiles (once per expert when ti = I). Rows are not padded:
# the last row tile may overhang M (rows past M belong to no expert and are masked).
# Megacore: forward and dx grids are sequential ('arbitrary'); the dW grid's I axis is parallel.


def _pair_partner(v):
    """v[..., lane ^ 1] for a 2-D block (the other half of each interleaved (gate, up) pair)."""
    n = v.shape[1]
    lane = jax.lax.broadcasted_iota(jnp.int32, v.shape, 1)
    a, b = pltpu.roll(v, 1, 1), pltpu.roll(v, n - 1, 1)
    from_a = pltpu.roll(lane, 1, 1) == jnp.bitwise_xor(lane, 1)
    return jnp.where(from_a, a, b)


def _swiglu_pairs(pre, *, alpha: float, limit: float, dh2=None):
    """Clamped SwiGLU on an interleaved [rows, 2n] float32 block, evaluated at every lane (both
    lanes of a pair hold the pair's h). With dh2 (d loss / d h, at both lanes of each pair) also
    returns d loss / d pre, interleaved: d/dgate at even lanes, d/dup at odd lanes."""
    partner = _pair_partner(pre)
    even = jnp.bitwise_and(jax.lax.broadcasted_iota(jnp.int32, pre.shape, 1), 1) == 0
    g_raw = jnp.where(even, pre, partner)
    u_raw = jnp.where(even, partner, pre)
    gate = jnp.minimum(g_raw, limit)
    up = jnp.clip(u_raw, -limit, limit)
    sig = jax.nn.sigmoid(alpha * gate)
    glu = gate * sig
    h2 = (up + 1.0) * glu
    if dh2 is None:
        return h2, None
    dglu = sig + alpha * gate * sig * (1.0 - sig)
    dgate = jnp.where(g_raw < limit, dh2 * (up + 1.0) * dglu, 0.0)
    dup = jnp.where((u_raw > -limit) & (u_raw < limit), dh2 * glu, 0.0)
    return h2, jnp.where(even, dgate, dup)


def _pair_matrix(n: int, dtype, *, spread: bool):
    """0/1 matrix: spread [n, 2n] has M[c, l] = (l // 2 == c); compact [2n, n] has
    M[l, c] = (l == 2c)."""
    shape = (n, 2 * n) if spread else (2 * n, n)
    r = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    c = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    hit = (jax.lax.shift_right_logical(c, 1) == r) if spread else (r == 2 * c)
    return jnp.where(hit, 1.0, 0.0).astype(dtype)


def _compact_pairs(h2, dtype):
    """[rows, 2n] (pairs hold equal values) -> [rows, n] in `dtype`: one matmul against a 0/1
    matrix, exact (one non-zero term per output; float32 at HIGHEST precision)."""
    n = h2.shape[1] // 2
    v = h2.astype(dtype)
    out = jnp.dot(v, _pair_matrix(n, dtype, spread=False), precision=_precision(dtype), preferred_element_type=_F32)
    return out.astype(dtype)


def _spread_pairs(v, dtype):
    """float32 [rows, n] -> float32 [rows, 2n] with v[:, c] at lanes 2c and 2c+1. Exact for
    float32 (HIGHEST); for 16-bit dtypes a hi + lo split in that dtype (~16 mantissa bits), far
    below the rounding of dpre to that dtype that follows."""
    n = v.shape[1]
    mat = _pair_matrix(n, dtype, spread=True)
    hi = v.astype(dtype)
    out = jnp.dot(hi, mat, precision=_precision(dtype), preferred_element_type=_F32)
    if jnp.dtype(dtype) != jnp.float32:
        lo = (v - hi.astype(_F32)).astype(dtype)
        out = out + jnp.dot(lo, mat, preferred_element_type=_F32)
    return out


_NT = (((1,), (1,)), ((), ()))   # a @ b^T


class _FusedConfig(NamedTuple):
    tm: int
    ti: int
    alpha: float
    limit: float
    interpret: Any           # False (Mosaic), True, or a pltpu.InterpretParams (hashable)
    vmem_limit: int | None


def _fused_params(cfg: _FusedConfig, semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=cfg.vmem_limit)


def _fused_forward(meta: GroupMetadata, xp, w1, b1, w2, b2, cfg: _FusedConfig):
    """y [M, H]; w1 [E, H, 2I] interleaved, b1 [E, 1, 2I], w2 [E, I, H], b2 [E, 1, H]."""
    m, hdim = xp.shape
    tm, ti = cfg.tm, cfg.ti
    nj, num_items = w2.shape[1] // ti, meta.group_ids.shape[0]
    dtype, prec = xp.dtype, _precision(xp.dtype)

    def kernel(offsets, gids, tiles, nact, x_ref, w1_ref, b1_ref, w2_ref, b2_ref, y_ref, acc_ref):
        w, j = pl.program_id(0), pl.program_id(1)
        active = w < nact[0]

        @pl.when(j == 0)
        def _zero():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(active)
        def _accumulate():
            pre = jnp.dot(x_ref[...], w1_ref[...], precision=prec, preferred_element_type=_F32)
            h2, _ = _swiglu_pairs(pre + b1_ref[...].astype(_F32), alpha=cfg.alpha, limit=cfg.limit)
            acc_ref[...] += jnp.dot(_compact_pairs(h2, dtype), w2_ref[...], precision=prec,
                                    preferred_element_type=_F32)

        @pl.when(active & (j == nj - 1))
        def _store():
            _store_rows(y_ref, acc_ref[...] + b2_ref[...].astype(_F32), offsets, gids, tiles, w, tm)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, hdim), dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_items, nj),
            in_specs=[pl.BlockSpec((tm, hdim), lambda w, j, o, g, t, a: (t[w], 0)),
                      pl.BlockSpec((None, hdim, 2 * ti), lambda w, j, o, g, t, a: (g[w], 0, j)),
                      pl.BlockSpec((None, 1, 2 * ti), lambda w, j, o, g, t, a: (g[w], 0, j)),
                      pl.BlockSpec((None, ti, hdim), lambda w, j, o, g, t, a: (g[w], j, 0)),
                      pl.BlockSpec((None, 1, hdim), lambda w, j, o, g, t, a: (g[w], 0, 0))],
            out_specs=pl.BlockSpec((tm, hdim), lambda w, j, o, g, t, a: (t[w], 0)),
            scratch_shapes=[pltpu.VMEM((tm, hdim), _F32)]),
        compiler_params=_fused_params(cfg, ("arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=num_items * tm * hdim * w2.shape[1] * 6,
                                      transcendentals=num_items * tm * w2.shape[1] * 2,
                                      bytes_accessed=2 * xp.nbytes + w1.nbytes + w2.nbytes),
        interpret=cfg.interpret,
    )(*meta, xp, w1, b1, w2, b2)


def _fused_dx(meta: GroupMetadata, xp, dy, w1, b1, w2, cfg: _FusedConfig):
    """dx [M, H]: per item, over I tiles: dpre = swiglu'(pre) * (dy @ w2[e]^T) spread to pairs,
    dx += dpre @ w1[e]^T."""
    m, hdim = xp.shape
    tm, ti = cfg.tm, cfg.ti
    nj, num_items = w2.shape[1] // ti, meta.group_ids.shape[0]
    dtype, prec = xp.dtype, _precision(xp.dtype)

    def kernel(offsets, gids, tiles, nact, x_ref, dy_ref, w1_ref, b1_ref, w2_ref, dx_ref, acc_ref):
        w, j = pl.program_id(0), pl.program_id(1)
        active = w < nact[0]

        @pl.when(j == 0)
        def _zero():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(active)
        def _accumulate():
            w1_blk = w1_ref[...]
            pre = jnp.dot(x_ref[...], w1_blk, precision=prec, preferred_element_type=_F32)
            dh = jax.lax.dot_general(dy_ref[...], w2_ref[...], _NT, precision=prec, preferred_element_type=_F32)
            _, dpre = _swiglu_pairs(pre + b1_ref[...].astype(_F32), alpha=cfg.alpha, limit=cfg.limit,
                                    dh2=_spread_pairs(dh, dtype))
            acc_ref[...] += jax.lax.dot_general(dpre.astype(dtype), w1_blk, _NT, precision=prec,
                                                preferred_element_type=_F32)

        @pl.when(active & (j == nj - 1))
        def _store():
            _store_rows(dx_ref, acc_ref[...], offsets, gids, tiles, w, tm)

    row = pl.BlockSpec((tm, hdim), lambda w, j, o, g, t, a: (t[w], 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, hdim), dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_items, nj),
            in_specs=[row, row,
                      pl.BlockSpec((None, hdim, 2 * ti), lambda w, j, o, g, t, a: (g[w], 0, j)),
                      pl.BlockSpec((None, 1, 2 * ti), lambda w, j, o, g, t, a: (g[w], 0, j)),
                      pl.BlockSpec((None, ti, hdim), lambda w, j, o, g, t, a: (g[w], j, 0))],
            out_specs=row,
            scratch_shapes=[pltpu.VMEM((tm, hdim), _F32)]),
        compiler_params=_fused_params(cfg, ("arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=num_items * tm * hdim * w2.shape[1] * 10,
                                      transcendentals=num_items * tm * w2.shape[1] * 2,
                                      bytes_accessed=3 * xp.nbytes + w1.nbytes + w2.nbytes),
        interpret=cfg.interpret,
    )(*meta, xp, dy, w1, b1, w2)


def _fused_dw(meta_all: GroupMetadata, xp, dy, w1, b1, w2, cfg: _FusedConfig, *, bias1_dtype, bias2_dtype):
    """dw1 [E, H, 2I] (interleaved), db1 [E, 1, 2I], dw2 [E, I, H], db2 [E, 1, H]. Grid (I tiles,
    items): one expert's items are consecutive, so its blocks accumulate in VMEM and are written
    once. `meta_all` visits empty groups (one all-masked item writes their zero gradient). db2 is
    written once per I tile into its own copy (no block revisited out of order); copy 0 is used."""
    m, hdim = xp.shape
    num_groups = w1.shape[0]
    tm, ti = cfg.tm, cfg.ti
    nj, num_items = w2.shape[1] // ti, meta_all.group_ids.shape[0]
    dtype, prec = xp.dtype, _precision(xp.dtype)

    def kernel(offsets, gids, tiles, nact, x_ref, dy_ref, w1_ref, b1_ref, w2_ref,
               dw1_ref, db1_ref, dw2_ref, db2_ref, acc1, accb1, acc2, accb2):
        w = pl.program_id(1)
        g = gids[w]
        active = w < nact[0]
        first = (w == 0) | (gids[jnp.maximum(w - 1, 0)] != g)
        last = active & ((w == nact[0] - 1) | (gids[jnp.minimum(w + 1, num_items - 1)] != g))

        @pl.when(first)
        def _zero():
            acc1[...] = jnp.zeros_like(acc1)
            accb1[...] = jnp.zeros_like(accb1)
            acc2[...] = jnp.zeros_like(acc2)
            accb2[...] = jnp.zeros_like(accb2)

        @pl.when(active)
        def _accumulate():
            # Rows of other experts: x and dy select to 0 (select, not multiply: no NaN leaks),
            # which makes their dpre and dy contributions exactly 0.
            mine = _rows_mine(offsets, gids, tiles, w, tm, (tm, hdim))
            xm = jnp.where(mine, x_ref[...].astype(_F32), 0.0)
            dym = jnp.where(mine, dy_ref[...].astype(_F32), 0.0)
            x_d, dy_d = xm.astype(dtype), dym.astype(dtype)
            pre = jnp.dot(x_d, w1_ref[...], precision=prec, preferred_element_type=_F32)
            dh = jax.lax.dot_general(dy_d, w2_ref[...], _NT, precision=prec, preferred_element_type=_F32)
            h2, dpre = _swiglu_pairs(pre + b1_ref[...].astype(_F32), alpha=cfg.alpha, limit=cfg.limit,
                                     dh2=_spread_pairs(dh, dtype))
            h = _compact_pairs(h2, dtype)
            # Transposes in float32 then cast back, as megablox does (32-bit transposes lower on
            # every TPU generation; Mosaic matmuls take no transposed LHS).
            acc1[...] += jnp.dot(xm.T.astype(dtype), dpre.astype(dtype), precision=prec,
                                 preferred_element_type=_F32)
            accb1[...] += jnp.sum(dpre, axis=0, keepdims=True)
            acc2[...] += jnp.dot(h.astype(_F32).T.astype(dtype), dy_d, precision=prec, preferred_element_type=_F32)
            accb2[...] += jnp.sum(dym, axis=0, keepdims=True)

        @pl.when(last)
        def _store():
            dw1_ref[...] = acc1[...].astype(dw1_ref.dtype)
            db1_ref[...] = accb1[...].astype(db1_ref.dtype)
            dw2_ref[...] = acc2[...].astype(dw2_ref.dtype)
            db2_ref[...] = accb2[...].astype(db2_ref.dtype)

    row = pl.BlockSpec((tm, hdim), lambda j, w, o, g, t, a: (t[w], 0))
    w1_spec = pl.BlockSpec((None, hdim, 2 * ti), lambda j, w, o, g, t, a: (g[w], 0, j))
    b1_spec = pl.BlockSpec((None, 1, 2 * ti), lambda j, w, o, g, t, a: (g[w], 0, j))
    w2_spec = pl.BlockSpec((None, ti, hdim), lambda j, w, o, g, t, a: (g[w], j, 0))
    dw1, db1, dw2, db2 = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(w1.shape, w1.dtype),
                   jax.ShapeDtypeStruct(b1.shape, bias1_dtype),
                   jax.ShapeDtypeStruct(w2.shape, w2.dtype),
                   jax.ShapeDtypeStruct((nj, num_groups, 1, hdim), bias2_dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(nj, num_items),
            in_specs=[row, row, w1_spec, b1_spec, w2_spec],
            out_specs=[w1_spec, b1_spec, w2_spec,
                       pl.BlockSpec((None, None, 1, hdim), lambda j, w, o, g, t, a: (j, g[w], 0, 0))],
            scratch_shapes=[pltpu.VMEM((hdim, 2 * ti), _F32), pltpu.VMEM((1, 2 * ti), _F32),
                            pltpu.VMEM((ti, hdim), _F32), pltpu.VMEM((1, hdim), _F32)]),
        compiler_params=_fused_params(cfg, ("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=num_items * tm * hdim * w2.shape[1] * 12,
                                      transcendentals=num_items * tm * w2.shape[1] * 2,
                                      bytes_accessed=2 * nj * xp.nbytes + 2 * (w1.nbytes + w2.nbytes)),
        interpret=cfg.interpret,
    )(*meta_all, xp, dy, w1, b1, w2)
    return dw1, db1, dw2, db2[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_fused_core(xp, group_sizes, w1, b1, w2, b2, cfg: _FusedConfig):
    meta = group_metadata(group_sizes, -(-xp.shape[0] // cfg.tm), cfg.tm)
    return _fused_forward(meta, xp, w1, b1, w2, b2, cfg)


def _moe_fused_core_fwd(xp, group_sizes, w1, b1, w2, b2, cfg):
    # Residuals are the inputs only: nothing of size [M, I] or [M, 2I] is kept.
    return _moe_fused_core(xp, group_sizes, w1, b1, w2, b2, cfg), (xp, group_sizes, w1, b1, w2, b2)


def _moe_fused_core_bwd(cfg, res, dy):
    xp, group_sizes, w1, b1, w2, b2 = res
    num_tiles = -(-xp.shape[0] // cfg.tm)
    meta = group_metadata(group_sizes, num_tiles, cfg.tm)
    meta_all = group_metadata(group_sizes, num_tiles, cfg.tm, visit_empty=True)
    dy = dy.astype(xp.dtype)
    dx = _fused_dx(meta, xp, dy, w1, b1, w2, cfg)
    dw1, db1, dw2, db2 = _fused_dw(meta_all, xp, dy, w1, b1, w2, cfg, bias1_dtype=b1.dtype, bias2_dtype=b2.dtype)
    return dx, None, dw1, db1, dw2, db2


_moe_fused_core.defvjp(_moe_fused_core_fwd, _moe_fused_core_bwd)


DEFAULT_FUSED_TILING = {
    # th is unused by the fused kernels (they take H whole: the SwiGLU needs the full H
    # reduction before the down projection). ti = I when it fits the VMEM budget below, so
    # each expert's weight blocks are fetched once per expert rather than once per row tile.
    # Untuned: tune on hardware.
    "tpu": MoETiling(tm=256, th=0, ti=512),
    "cpu": MoETiling(tm=128, th=0, ti=512),
}
_FUSED_VMEM_BUDGET = 40 * 2**20   # tiles are shrunk until the estimate fits (TPU only)
_FUSED_VMEM_CAP = 64 * 2**20      # vmem_limit_bytes never above this (v7x has 64 MiB per core)


def _fused_vmem_bytes(tm: int, hdim: int, ti: int, itemsize: int) -> int:
    """Rough VMEM use of the largest fused kernel (the dW one): double-buffered blocks, float32
    accumulators, and float32 temporaries of the [tm, H] and [tm, 2ti] intermediates."""
    blocks = 2 * itemsize * (2 * tm * hdim + 2 * (3 * hdim * ti))   # x, dy; w1/w2 in and dw1/dw2 out
    scratch = 4 * 3 * hdim * ti
    temps = 4 * (3 * tm * hdim + 12 * tm * 2 * ti)
    return blocks + scratch + temps


def _resolve_fused_tiling(tiling, backend: str, m: int, hdim: int, idim: int, dtype) -> tuple[int, int, int]:
    """(tm, ti, padded I). TPU block rules: the x/y/dx blocks take H whole (always legal); a
    w1 block is [H, 2ti] and a w2 block [ti, H], so ti must be I itself or a multiple of 64
    (2ti a multiple of 128 lanes, ti of 16 sublanes). An I with no such divisor <= the wanted
    tile is zero-padded to a multiple of 128 (a weight copy: only in that case)."""
    want = MoETiling(*(tiling if tiling is not None else DEFAULT_FUSED_TILING[backend]))
    on_tpu = backend == "tpu"
    itemsize = jnp.dtype(dtype).itemsize
    sub = (16 if itemsize < 4 else 8) if on_tpu else 8
    tm = max(sub, min(_round_up(want.tm, sub), _round_up(m, sub)))
    if not on_tpu:
        return tm, _fit(idim, want.ti, 8), idim
    ip = idim
    ti = _fit(idim, want.ti, 64)
    if ti == idim and idim > want.ti:
        ip = _round_up(idim, 128)
        ti = _fit(ip, want.ti, 128)
    # Shrink to the VMEM budget: first ti (to multiples of 64 dividing ip), then tm.
    while _fused_vmem_bytes(tm, hdim, ti, itemsize) > _FUSED_VMEM_BUDGET:
        smaller = _fit(ip, ti - 64, 64) if ti > 64 else ti
        if smaller < ti:
            ti = smaller
        elif tm > sub:
            tm = max(sub, _round_up(tm // 2, sub))
        else:
            break
    return tm, ti, ip


def moe_experts_pallas(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                       limit: float = 7.0, tiling=None, backend: str | None = None, interpret=None):
    """Fused Pallas expert MLP: per (row tile, expert) work item, up projection, clamped SwiGLU
    and down projection in one kernel; h [M, I] and the pre-activation [M, 2I] (or its gradient)
    exist only as VMEM tiles, in forward and backward. Backward (custom_vjp) recomputes them in
    a dx kernel and an expert-major dW/db kernel. gate_up is used in its interleaved layout (no
    per-call permuted copy); see the section comment for how the kernels de-interleave.

    tiling: MoETiling(tm, th, ti) or a 3-tuple (rows, unused, I tile); None -> per-backend
    DEFAULT_FUSED_TILING, clipped to the problem and (TPU) to a VMEM budget. backend: None ->
    jax.default_backend(); 'tpu' -> Mosaic; 'cpu' -> the same kernels in interpret mode.
    interpret: None -> plain interpret mode exactly when backend is 'cpu'; a
    pltpu.InterpretParams runs the TPU-simulating interpreter instead (NaN-filled buffers, race
    detection, several cores; slower), with the TPU tiling rules unless backend='cpu'.
    Float32 inputs use HIGHEST precision, all matmuls accumulate in float32; outputs and
    gradients come back in the input dtypes.
    """
    backend = (backend or jax.default_backend()).lower()
    if backend in ("gpu", "cuda", "rocm"):
        raise NotImplementedError("moe_experts_pallas has no GPU kernel (its kernels are Mosaic TPU); on GPU use "
                                  "the 'xla' implementation (moe_experts_xla) or 'ragged_dot' (moe_experts_reference)")
    if backend not in ("tpu", "cpu"):
        raise ValueError(f"moe_experts_pallas: unknown backend {backend!r} (expected 'tpu' or 'cpu')")
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    idim = two_i // 2
    if m == 0:
        return jnp.zeros_like(x)
    tm, ti, ip = _resolve_fused_tiling(tiling, backend, m, hdim, idim, x.dtype)
    vmem = None
    if backend == "tpu":
        est = _fused_vmem_bytes(tm, hdim, ti, jnp.dtype(x.dtype).itemsize)
        vmem = int(min(_FUSED_VMEM_CAP, max(32 * 2**20, _round_up(est * 5 // 4, 2**20))))
    cfg = _FusedConfig(tm, ti, float(alpha), float(limit), backend == "cpu" if interpret is None else interpret, vmem)
    dtype = x.dtype
    w1, b1 = gate_up.astype(dtype), gate_up_bias.reshape(num_groups, 1, two_i)
    w2, b2 = down.astype(dtype), down_bias.reshape(num_groups, 1, hdim)
    if ip != idim:   # zero gate/up columns and down rows give h = 0 there: results unchanged
        w1 = jnp.pad(w1.reshape(num_groups, hdim, idim, 2),
                     ((0, 0), (0, 0), (0, ip - idim), (0, 0))).reshape(num_groups, hdim, 2 * ip)
        b1 = jnp.pad(b1.reshape(num_groups, 1, idim, 2),
                     ((0, 0), (0, 0), (0, ip - idim), (0, 0))).reshape(num_groups, 1, 2 * ip)
        w2 = jnp.pad(w2, ((0, 0), (0, ip - idim), (0, 0)))
    # No row padding: when tm does not divide M the last row tile overhangs the arrays. Its rows
    # past M belong to no expert (offsets[E] == M), so they are masked by select on store and
    # zeroed in the dW kernel; their out-of-bounds block writes are dropped.
    return _moe_fused_core(x, group_sizes.astype(jnp.int32), w1, b1, w2, b2, cfg)


# =============================================================================================
# Baseline: jax-shipped megablox gmm (TPU kernel; interpret mode on CPU)
# =============================================================================================
def moe_experts_megablox(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                         limit: float = 7.0, tiling=None, backend: str | None = None):
    """Two `jax.experimental.pallas.ops.tpu.megablox.gmm` calls (custom_vjp: gmm + tgmm
    backward) with bias gathers and clamped_swiglu in plain JAX between them. A baseline and
    fall-back: it stores the float32 [M, 2I] pre-activation, and its in-kernel dots use
    default precision (bf16 passes for float32 on TPU). tiling: (tm, tk) or None; the
    megablox k and n tiles are one size dividing both matmul dims (its backward swaps them)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

    backend = (backend or jax.default_backend()).lower()
    if backend in ("gpu", "cuda", "rocm"):
        raise NotImplementedError("megablox is a TPU kernel; on GPU use moe_experts_xla or moe_experts_reference "
                                  "(ragged_dot)")
    if backend not in ("tpu", "cpu"):
        raise ValueError(f"moe_experts_megablox: unknown backend {backend!r} (expected 'tpu' or 'cpu')")
    interpret = backend == "cpu"
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    if m == 0:
        return jnp.zeros_like(x)
    want_m, want_k = tiling if tiling is not None else (DEFAULT_TILING[backend].tm, DEFAULT_TILING[backend].th)
    lane = 128 if backend == "tpu" else 8
    tm = max(8, min(_round_up(want_m, 8), _round_up(m, 8)))
    mp = _round_up(m, tm)
    gs = group_sizes.astype(jnp.int32)
    expert = expert_of_rows(gs, mp)
    valid = (jnp.arange(mp) < m)[:, None]

    def gmm(lhs, rhs):
        t = _fit(math.gcd(rhs.shape[1], rhs.shape[2]), want_k, lane)
        return megablox_gmm(lhs, rhs, gs, _F32, (tm, t, t), None, None, False, interpret)

    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    # Rows past M are never written by megablox: select them to 0 so no garbage reaches the
    # activation or (through the bias gather's transpose) the bias gradients. Biases are cast
    # before the gather so their gradients are summed in float32.
    gu = jnp.where(valid, gmm(xp, gate_up.astype(x.dtype)) + gate_up_bias.astype(_F32)[expert], 0.0)
    h = clamped_swiglu(gu, alpha=alpha, limit=limit).astype(x.dtype)
    y = gmm(h, down.astype(x.dtype)) + down_bias.astype(_F32)[expert]
    return y[:m].astype(x.dtype)
