"""Grouped expert MLP (GPT-OSS): up projection + clamped SwiGLU, then down projection.

x [M, H] rows sorted by expert; group_sizes [E] int32 (sum == M, empty groups allowed);
gate_up [E, H, 2I] with gate/up interleaved (gate = [..., ::2], up = [..., 1::2]);
gate_up_bias [E, 2I]; down [E, I, H]; down_bias [E, H]. Each row goes through its own expert only.

Implementations (same signature, plus keyword options):
  moe_experts_reference  two jax.lax.ragged_dot (on CPU it computes every expert: ~10x dense)
  moe_experts_xla        megablox's (row tile, expert) schedule as batched XLA ops; CPU training
  moe_experts_pallas     fused Pallas expert MLP: up projection, clamped SwiGLU and down projection in
                         one kernel per (row tile, expert); [M, I] never in HBM, forward or backward
                         (custom_vjp with recomputing backward kernels); TPU, interpreted on CPU
  moe_experts_megablox   jax-shipped megablox gmm around plain-JAX activation; a baseline

HBM temp memory of each (compile-only, forward and forward+backward): pallas_kernels/memory.py.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import index_math as ix
from pallas_kernels.cost import cost_estimate
from pallas_kernels.platform import KernelMode, dot_precision, kernel_mode, precision_name, with_matmul_precision


def clamped_swiglu(gate_up, *, alpha: float, limit: float, up_shift: float = 1.0):
    """The experts' activation of the interleaved [..., 2I] pre-activation -> [..., I]:
    (clip(up, +-limit) + up_shift) * g * sigmoid(alpha * g), g = min(gate, limit). GPT-OSS:
    alpha 1.702, limit 7, up_shift 1; SwiGLU (silu(gate) * up): alpha 1, limit inf, up_shift 0."""
    return _clamped_swiglu(gate_up, float(alpha), float(limit), float(up_shift))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _clamped_swiglu(gate_up, alpha: float, limit: float, up_shift: float):
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + up_shift) * (gate * jax.nn.sigmoid(alpha * gate))


def _clamped_swiglu_fwd(gate_up, alpha, limit, up_shift):
    return _clamped_swiglu(gate_up, alpha, limit, up_shift), gate_up


def _clamped_swiglu_bwd(alpha, limit, up_shift, gate_up, dh):
    return (clamped_swiglu_grad(gate_up, dh, alpha=alpha, limit=limit, up_shift=up_shift),)


def clamped_swiglu_grad(gate_up, dh, *, alpha: float, limit: float, up_shift: float = 1.0):
    """d(clamped_swiglu)/d(gate_up) times dh: [..., 2I] interleaved, in gate_up's dtype."""
    # Written out because autodiff's transpose of the stride-2 slices (a padded scatter into the
    # interleaved layout) took the TPU compiler ~140 s for one [4096, 512] MoE layer; the two
    # gradients interleaved by stack + reshape compile in seconds and run as fast on CPU. The
    # clamps' gradients follow the fused kernel's convention (0 at the limit itself).
    g_raw, u_raw = gate_up[..., ::2], gate_up[..., 1::2]
    gate = jnp.minimum(g_raw, limit)
    up = jnp.clip(u_raw, -limit, limit)
    sig = jax.nn.sigmoid(alpha * gate)
    dh = dh.astype(sig.dtype)
    dgate = jnp.where(g_raw < limit, dh * (up + up_shift) * (sig + alpha * gate * sig * (1.0 - sig)), 0.0)
    dup = jnp.where((u_raw > -limit) & (u_raw < limit), dh * gate * sig, 0.0)
    return jnp.stack([dgate, dup], axis=-1).reshape(gate_up.shape).astype(gate_up.dtype)


_clamped_swiglu.defvjp(_clamped_swiglu_fwd, _clamped_swiglu_bwd)


def expert_of_rows(group_sizes, num_rows: int):
    """Expert index of each sorted row, [M] int32."""
    return jnp.repeat(jnp.arange(group_sizes.shape[0], dtype=jnp.int32), group_sizes, total_repeat_length=num_rows)


def moe_experts_reference(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                          limit: float = 7.0, up_shift: float = 1.0):
    """Plain JAX/XLA: two `jax.lax.ragged_dot` grouped GEMMs around the activation; the `xla`
    implementation. (Tests also check it against a per-row loop and the eager torch op.)"""
    return experts_around_grouped_matmuls(jax.lax.ragged_dot, x, group_sizes, gate_up, gate_up_bias, down, down_bias,
                                          alpha=alpha, limit=limit, up_shift=up_shift)


def experts_around_grouped_matmuls(ragged_dot, x, group_sizes, gate_up, gate_up_bias, down, down_bias, *,
                                   alpha: float, limit: float, up_shift: float = 1.0):
    """The expert MLP as two grouped GEMMs `ragged_dot(lhs, rhs, group_sizes, precision=,
    preferred_element_type=)` (jax.lax.ragged_dot's signature) around the biases and the activation
    in plain JAX: the reference's body, and `bench kernels`' tokamax peer with tokamax's GEMM."""
    group_sizes = group_sizes.astype(jnp.int32)
    rows = x.shape[0]
    expert = expert_of_rows(group_sizes, rows)
    prec = dot_precision(x.dtype)   # explicit: on TPU ragged_dot is a Mosaic kernel (no HIGHEST for bf16)
    h = ragged_dot(x, gate_up, group_sizes, precision=prec, preferred_element_type=jnp.float32)
    h = clamped_swiglu(h + gate_up_bias[expert].astype(jnp.float32), alpha=alpha, limit=limit,
                       up_shift=up_shift).astype(x.dtype)
    y = ragged_dot(h, down, group_sizes, precision=prec, preferred_element_type=jnp.float32)
    return (y + down_bias[expert].astype(jnp.float32)).astype(x.dtype)


# =============================================================================================
# Shared: tile metadata for grouped GEMMs (megablox-style)
# =============================================================================================
# Rows are cut into tiles of `tm`. A "work item" is one (row tile, expert) pair that overlaps; a
# tile straddling a group boundary is visited once per group in it. In the row-sorted layout
# there are at most num_tiles + G - 1 such pairs, G the groups that hold rows: at most E, and at
# most the M rows themselves (a decode step's 2 rows reach 2 of E experts). Every grid/batch has
# that STATIC length; items past the real count (`num_active`) repeat the last real item and do
# nothing, but each still costs its grid steps (~0.35 us each on a TPU).


class GroupMetadata(NamedTuple):
    offsets: jax.Array     # [E+1] int32: group e owns rows offsets[e]:offsets[e+1]
    group_ids: jax.Array   # [W] int32: expert of work item w
    tile_ids: jax.Array    # [W] int32: row tile of work item w (non-decreasing)
    num_active: jax.Array  # [1] int32: work items that do real work


def group_metadata(group_sizes, rows: int, tm: int, *, visit_empty: bool = False, xp=jnp) -> GroupMetadata:
    """Work items in (expert, tile) order over `rows` rows (static) cut into tiles of `tm`.
    `visit_empty` gives each empty group one item (the transposed GEMM must still write that
    expert's zero gradient); otherwise no more groups than rows can hold any. `xp` is jax.numpy
    inside a program, or NumPy for sizes known on the host (no tiny programs compiled per op)."""
    gs = group_sizes.astype(xp.int32)
    num_groups = gs.shape[0]
    num_tiles = -(-rows // tm)
    holding = num_groups if visit_empty else max(1, min(num_groups, rows))
    num_items = num_tiles + holding - 1
    ends = xp.cumsum(gs)
    if num_tiles == 1:      # all rows in one tile (a decode step's): each group's item is tile 0
        counts = xp.where(gs > 0, 1, 1 if visit_empty else 0)
    else:
        starts = ends - gs
        first = xp.minimum(starts // tm, num_tiles - 1)   # an empty group at row M may point past the end
        last = (ends - 1) // tm
        counts = xp.where(gs > 0, last - first + 1, 1 if visit_empty else 0)
    cum = xp.cumsum(counts)
    num_active = cum[-1]
    w = xp.clip(xp.arange(num_items, dtype=xp.int32), 0, xp.maximum(num_active - 1, 0))
    gid = xp.sum(w[:, None] >= cum[None, :], axis=1)
    if num_tiles == 1:      # (the arithmetic below gives 0 there, in four ops a layer of every decode step)
        tile = xp.zeros_like(w)
    else:
        # first[gid] + (w - (cum - counts)[gid]) as a one-hot select over experts: the TPU compiler
        # turns a gather from an [E] vector into E scalar slices, each in its own 16 KiB slot of HBM
        # (0.6 MiB of temporaries at E = 16, more than the whole rest of the fused MoE keeps).
        mine = gid[:, None] == xp.arange(num_groups, dtype=xp.int32)[None, :]
        tile = xp.sum(xp.where(mine, first[None, :] - (cum - counts)[None, :], 0), axis=1) + w
    offsets = xp.concatenate([xp.zeros((1,), xp.int32), ends])
    return GroupMetadata(*(a.astype(xp.int32) for a in (offsets, gid, tile, num_active[None])))


# The routing the fused kernels' static cost estimates assume (routing is data; nothing else
# changes): "even", m // E rows per expert (the remainder to the first ones), so groups fill whole
# row tiles where the tile divides them; "random", row counts drawn multinomially with equal
# probabilities (seeded), so groups start mid-tile and a straddling tile is computed, and its
# weights fetched, for each of its experts, as under a real router.
COST_ROUTINGS = ("even", "random")
_cost_routing = contextvars.ContextVar("moe_cost_routing", default="even")


@contextlib.contextmanager
def cost_routing(routing: str):
    """Within this block (while tracing), the fused MoE kernels' cost estimates assume `routing`."""
    if routing not in COST_ROUTINGS:
        raise ValueError(f"MoE cost routing must be one of {', '.join(COST_ROUTINGS)}, found {routing!r}")
    token = _cost_routing.set(routing)
    try:
        yield
    finally:
        _cost_routing.reset(token)


def cost_metadata(m: int, num_groups: int, tm: int, *, visit_empty: bool = False) -> GroupMetadata:
    """The metadata of the batch the cost estimates assume (`cost_routing`: evenly routed unless
    told otherwise)."""
    if _cost_routing.get() == "random":
        sizes = np.random.default_rng(0).multinomial(m, np.full(num_groups, 1 / num_groups)).astype(np.int32)
    else:
        sizes = np.full(num_groups, m // num_groups, np.int32)
        sizes[:m % num_groups] += 1
    return group_metadata(sizes, m, tm, visit_empty=visit_empty, xp=np)


def active_items(assumed: GroupMetadata) -> int:
    """Work items that compute in the assumed batch's metadata (cost_metadata): the spare items
    past them skip their compute (`pl.when(active)`), so cost estimates count these only."""
    return int(assumed.num_active[0])


def active_item_flops(assumed: GroupMetadata, tm: int, hdim: int, idim: int, passes: int) -> int:
    """Matmul FLOPs of `passes` [tm, H] x [H, I]-sized products per active work item of the
    assumed batch (the up projection is 2 passes)."""
    return active_items(assumed) * tm * hdim * idim * 2 * passes


def pair_matmul_flops(assumed: GroupMetadata, tm: int, ti: int, idim: int, products: int) -> int:
    """The interleaved layout's 0/1 pair matmuls per active work item: `products` of
    [tm, 2ti] x [2ti, ti] (or its transpose) per I tile (the forward's compact: 1; dx's spread:
    2 in 16-bit, hi and lo, else 1; dW's spread and compact: 3, or 2)."""
    return active_items(assumed) * tm * ti * idim * 4 * products


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def default_block_m(m: int, num_groups: int) -> int:
    """Row tile of the plain-JAX grouped GEMMs (`xla`, `loop`): about a quarter of an average
    group, 8..512 rows, a multiple of 8."""
    return max(8, min(512, round_up(max(m // (4 * num_groups), 1), 8)))


def fit_tile(dim: int, want: int, align: int) -> int:
    """Largest tile <= want dividing dim that is a multiple of `align`; else the whole dim (a
    block equal to the array dim is always legal on TPU)."""
    if dim <= want:
        return dim
    for t in range(want - want % align, 0, -align):
        if dim % t == 0:
            return t
    return dim


# =============================================================================================
# Plain-JAX grouped GEMM (CPU training path; no Pallas)
# =============================================================================================
def moe_experts_xla(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                    limit: float = 7.0, up_shift: float = 1.0, block_m: int | None = None):
    """Megablox's schedule as batched XLA ops: gather each work item's row tile and expert
    weights, one batched matmul per projection, mask rows outside the item's expert, and add the
    (at most E - 1 extra) partial tiles back with a sorted segment_sum. Costs ~(1 + E*t/M) x the
    dense FLOPs instead of ragged_dot's E x on CPU. Gradients by autodiff, with the gathered tiles
    and weights formed again in the backward (jax.checkpoint): held for it, they were ~1.9 GiB per
    layer of `small-o200k` at 16 x 2048 (its `--kernels xla` step needed 16.97 GiB of a v5e's
    15.75)."""
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    if m == 0:
        return jnp.zeros_like(x)
    # Small tiles waste less on partial tiles but gather the weights more often.
    tm = block_m or default_block_m(m, num_groups)
    tm = min(tm, round_up(m, 8))
    num_tiles = -(-m // tm)
    mp = num_tiles * tm
    gs = group_sizes.astype(jnp.int32)
    meta = group_metadata(gs, m, tm)
    num_items = meta.group_ids.shape[0]
    acc = jnp.float32
    prec = dot_precision(x.dtype)

    rows = meta.tile_ids[:, None] * tm + jnp.arange(tm, dtype=jnp.int32)[None, :]          # [W, t]
    lo, hi = meta.offsets[meta.group_ids], meta.offsets[meta.group_ids + 1]
    live = (rows >= lo[:, None]) & (rows < hi[:, None])
    live &= (jnp.arange(num_items) < meta.num_active[0])[:, None]

    @jax.checkpoint
    def tiles(x, gate_up, gate_up_bias, down, down_bias):
        xt = jnp.pad(x, ((0, mp - m), (0, 0))).reshape(num_tiles, tm, hdim)[meta.tile_ids]       # [W, t, H]
        gu = jnp.einsum("wth,whn->wtn", xt, gate_up[meta.group_ids], precision=prec, preferred_element_type=acc)
        gu = gu + gate_up_bias.astype(acc)[meta.group_ids][:, None, :]   # cast first: bias grads sum in f32
        h = clamped_swiglu(gu, alpha=alpha, limit=limit, up_shift=up_shift).astype(x.dtype)
        y = jnp.einsum("wti,wih->wth", h, down[meta.group_ids], precision=prec, preferred_element_type=acc)
        y = y + down_bias.astype(acc)[meta.group_ids][:, None, :]
        y = jnp.where(live[..., None], y, 0.0)   # select, not multiply: no 0 * inf leaking through
        return jax.ops.segment_sum(y, meta.tile_ids, num_segments=num_tiles, indices_are_sorted=True)

    return tiles(x, gate_up, gate_up_bias, down, down_bias).reshape(mp, hdim)[:m].astype(x.dtype)


# =============================================================================================
# Pallas grouped-GEMM kernels (Mosaic TPU; interpreted on CPU)
# =============================================================================================
# Every kernel takes the GroupMetadata as four scalar-prefetch operands (SMEM on TPU), so the
# BlockSpec index maps can pick each work item's row tile and expert weight block.
# Rows of a tile that belong to another expert are masked with a select (never a multiply, so
# garbage in padding rows cannot leak in as NaN).
_F32 = jnp.float32


def rows_mine(offsets, gids, tiles, w, tm: int, shape, axis: int = 0):
    """Bool mask of `shape`: the rows of work item w's tile (along `axis`) that belong to its
    expert."""
    g = gids[w]
    rows = tiles[w] * tm + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return (rows >= offsets[g]) & (rows < offsets[g + 1])


def store_rows(out_ref, val, offsets, gids, tiles, w, tm: int, axis: int = 0):
    """Write this expert's rows of the tile (along `axis`); on the tile's first visit zero the
    other rows (a later visit by the next expert fills its own), so every output row is defined."""
    mine = rows_mine(offsets, gids, tiles, w, tm, val.shape, axis)
    first_visit = (w == 0) | (tiles[jnp.maximum(w - 1, 0)] != tiles[w])

    # Two branches rather than a select on a scalar predicate (a vector-of-i1 broadcast).
    @pl.when(first_visit)
    def _first():
        out_ref[...] = jnp.where(mine, val, 0.0).astype(out_ref.dtype)

    @pl.when(jnp.logical_not(first_visit))
    def _again():
        out_ref[...] = jnp.where(mine, val, out_ref[...].astype(_F32)).astype(out_ref.dtype)


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
# Blocked layout (gate_up_layout="blocked", the default where the three kernels share one I tile
# that is a multiple of the 128 lanes and the rows amortize the copy: _gate_up_layout): gate_up
# is permuted once per call to [gate tile j | up tile j] per I tile (`_blocked`, a transpose of
# the weights: its gradient is the inverse), so a [H, 2ti] block holds the tile's gate and up as
# two lane-aligned halves. The SwiGLU then runs on [tm, ti] (not at every lane of [tm, 2ti]) and
# no pair matmul remains. At small H those matmuls are a large share: 17% / 23% more MXU work at
# small-o200k (H = 512, ti = 128), against a permuted copy of 17 MB per layer and call, which a
# decode step's few rows do not amortize.
#
# HBM traffic: x/dy row tiles are read once per I tile; weight blocks are re-fetched for every
# work item when there are several I tiles (once per expert when ti = I), less the one block
# consecutive items of an expert share at the turn of the forward's and dx's snake order. Rows are not padded:
# the last row tile may overhang M (rows past M belong to no expert and are masked).
# Megacore: forward and dx grids are sequential ('arbitrary'); the dW grid's I axis is parallel.


def _pair_partner(v):
    """v[..., lane ^ 1] for a 2-D block (the other half of each interleaved (gate, up) pair)."""
    n = v.shape[1]
    lane = jax.lax.broadcasted_iota(jnp.int32, v.shape, 1)
    a, b = pltpu.roll(v, 1, 1), pltpu.roll(v, n - 1, 1)
    from_a = pltpu.roll(lane, 1, 1) == jnp.bitwise_xor(lane, 1)
    return jnp.where(from_a, a, b)


def _swiglu_parts(g_raw, u_raw, cfg: "_FusedConfig", dh=None):
    """Clamped SwiGLU (cfg's alpha, limit, up_shift) of float32 gate and up pre-activations of one
    shape: h and, with dh (d loss / d h), (d/dgate, d/dup); the clamps' gradients are 0 at the
    limit itself (the convention of clamped_swiglu_grad)."""
    alpha, limit, up_shift = cfg.alpha, cfg.limit, cfg.up_shift
    gate = jnp.minimum(g_raw, limit)
    up = jnp.clip(u_raw, -limit, limit)
    sig = jax.nn.sigmoid(alpha * gate)
    glu = gate * sig
    h = (up + up_shift) * glu
    if dh is None:
        return h, None
    dglu = sig + alpha * gate * sig * (1.0 - sig)
    dgate = jnp.where(g_raw < limit, dh * (up + up_shift) * dglu, 0.0)
    dup = jnp.where((u_raw > -limit) & (u_raw < limit), dh * glu, 0.0)
    return h, (dgate, dup)


def _swiglu_pairs(pre, cfg: _FusedConfig, dh2=None):
    """Clamped SwiGLU on an interleaved [rows, 2n] float32 block, evaluated at every lane (both
    lanes of a pair hold the pair's h). With dh2 (d loss / d h, at both lanes of each pair) also
    returns d loss / d pre, interleaved: d/dgate at even lanes, d/dup at odd lanes."""
    partner = _pair_partner(pre)
    even = jnp.bitwise_and(jax.lax.broadcasted_iota(jnp.int32, pre.shape, 1), 1) == 0
    h2, grads = _swiglu_parts(jnp.where(even, pre, partner), jnp.where(even, partner, pre), cfg, dh2)
    return h2, None if grads is None else jnp.where(even, *grads)


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
    out = jnp.dot(v, _pair_matrix(n, dtype, spread=False), precision=dot_precision(dtype), preferred_element_type=_F32)
    return out.astype(dtype)


def _spread_passes(dtype) -> int:
    """The matmuls _spread_pairs takes: one for float32, two (hi and lo) for 16-bit dtypes."""
    return 1 if jnp.dtype(dtype) == jnp.float32 else 2


def _spread_pairs(v, dtype):
    """float32 [rows, n] -> float32 [rows, 2n] with v[:, c] at lanes 2c and 2c+1. Exact for
    float32 (HIGHEST); for 16-bit dtypes a hi + lo split in that dtype (~16 mantissa bits), far
    below the rounding of dpre to that dtype that follows."""
    n = v.shape[1]
    mat = _pair_matrix(n, dtype, spread=True)
    hi = v.astype(dtype)
    out = jnp.dot(hi, mat, precision=dot_precision(dtype), preferred_element_type=_F32)
    if _spread_passes(dtype) == 2:
        lo = (v - hi.astype(_F32)).astype(dtype)
        out = out + jnp.dot(lo, mat, precision=dot_precision(dtype), preferred_element_type=_F32)
    return out


def _swiglu_halves(pre, cfg: "_FusedConfig", dh=None):
    """The blocked layout's clamped SwiGLU: pre [rows, 2n] float32 is [gate | up]; returns h
    [rows, n] and, with dh (d loss / d h, [rows, n]), d loss / d pre as [dgate | dup]."""
    n = pre.shape[1] // 2
    h, grads = _swiglu_parts(pre[:, :n], pre[:, n:], cfg, dh)
    return h, None if grads is None else jnp.concatenate(grads, axis=1)


def _activation(pre, cfg: "_FusedConfig", dtype):
    """h [rows, ti] in `dtype` (the down projection's input) from the tile's pre-activation."""
    if cfg.blocked:
        return _swiglu_halves(pre, cfg)[0].astype(dtype)
    return _compact_pairs(_swiglu_pairs(pre, cfg)[0], dtype)


def _activation_grad(pre, dh, cfg: "_FusedConfig", dtype):
    """(h [rows, ti] in `dtype`, d loss / d pre [rows, 2ti] float32 in the tile's layout) from
    the pre-activation and dh = dy @ down^T [rows, ti] float32."""
    if cfg.blocked:
        h, dpre = _swiglu_halves(pre, cfg, dh)
        return h.astype(dtype), dpre
    h2, dpre = _swiglu_pairs(pre, cfg, dh2=_spread_pairs(dh, dtype))
    return _compact_pairs(h2, dtype), dpre


def _blocked(w, ti: int):
    """[..., 2I] interleaved (gate, up pairs) -> per I tile of ti: [gate tile | up tile]."""
    *lead, two_i = w.shape
    tiles = two_i // (2 * ti)
    return jnp.swapaxes(w.reshape(*lead, tiles, ti, 2), -1, -2).reshape(*lead, two_i)


_NT = (((1,), (1,)), ((), ()))   # a @ b^T


class _FusedConfig(NamedTuple):
    tm: int          # row tile of the row kernels (forward, dx)
    ti: int          # I tile of the row kernels
    tm_w: int        # row tile of the dW kernel
    ti_w: int        # I tile of the dW kernel (its VMEM holds weight-sized accumulators)
    alpha: float
    limit: float
    up_shift: float
    mode: KernelMode
    vmem_limit: int | None
    blocked: bool = False    # gate_up in the blocked layout ([gate | up] per I tile), else interleaved


def _fused_params(cfg: _FusedConfig, semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=cfg.vmem_limit)


def _live_tile(w, j, num_active, nj: int):
    """The I tile an index map gives work item w at step j, in snake order: even items walk the
    tiles up, odd items down, so an item starts on the tile the previous one ended on, and when
    both are the same expert's (an expert's rows span several row tiles) that weight block is not
    fetched again. The spare items past the last active one (they compute nothing) stay on the
    tile the last active item ended on: no expert weights are streamed for them."""
    last_end = ix.where(ix.rem(num_active[0] - 1, 2) == 0, nj - 1, 0)
    return ix.where(w < num_active[0], ix.where(ix.rem(w, 2) == 0, j, nj - 1 - j), last_end)


def _fused_forward(meta: GroupMetadata, xp, w1, b1, w2, b2, cfg: _FusedConfig):
    """y [M, H]; w1 [E, H, 2I] interleaved, b1 [E, 1, 2I], w2 [E, I, H], b2 [E, 1, H]."""
    m, hdim = xp.shape
    tm, ti = cfg.tm, cfg.ti
    nj, num_items = w2.shape[1] // ti, meta.group_ids.shape[0]
    assumed = cost_metadata(m, w1.shape[0], tm)
    dtype, prec = xp.dtype, dot_precision(xp.dtype)

    def kernel(offsets, gids, tiles, nact, x_ref, w1_ref, b1_ref, w2_ref, b2_ref, y_ref, acc_ref):
        w, j = pl.program_id(0), pl.program_id(1)
        active = w < nact[0]

        @pl.when(j == 0)
        def _zero():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(active)
        def _accumulate():
            pre = jnp.dot(x_ref[...], w1_ref[...], precision=prec, preferred_element_type=_F32)
            h = _activation(pre + b1_ref[...].astype(_F32), cfg, dtype)
            acc_ref[...] += jnp.dot(h, w2_ref[...], precision=prec, preferred_element_type=_F32)

        @pl.when(active & (j == nj - 1))
        def _store():
            store_rows(y_ref, acc_ref[...] + b2_ref[...].astype(_F32), offsets, gids, tiles, w, tm)

    grid = (num_items, nj)
    in_specs = [pl.BlockSpec((tm, hdim), lambda w, j, o, g, t, a: (t[w], 0)),
                pl.BlockSpec((None, hdim, 2 * ti), lambda w, j, o, g, t, a: (g[w], 0, _live_tile(w, j, a, nj))),
                pl.BlockSpec((None, 1, 2 * ti), lambda w, j, o, g, t, a: (g[w], 0, _live_tile(w, j, a, nj))),
                pl.BlockSpec((None, ti, hdim), lambda w, j, o, g, t, a: (g[w], _live_tile(w, j, a, nj), 0)),
                pl.BlockSpec((None, 1, hdim), lambda w, j, o, g, t, a: (g[w], 0, 0))]
    out_spec, out_shape = pl.BlockSpec((tm, hdim), lambda w, j, o, g, t, a: (t[w], 0)), \
        jax.ShapeDtypeStruct((m, hdim), dtype)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=4, grid=grid, in_specs=in_specs,
                                               out_specs=out_spec, scratch_shapes=[pltpu.VMEM((tm, hdim), _F32)]),
        compiler_params=_fused_params(cfg, ("arbitrary", "arbitrary")),
        name="moe_fused_fwd",
        cost_estimate=cost_estimate(grid, in_specs, (xp, w1, b1, w2, b2), out_spec, out_shape,
                                    flops=active_item_flops(assumed, tm, hdim, w2.shape[1], 3)
                                    + (0 if cfg.blocked else pair_matmul_flops(assumed, tm, ti, w2.shape[1], 1)),
                                    transcendentals=active_items(assumed) * tm * w2.shape[1] * 2,
                                    prefetch=assumed),
        interpret=cfg.mode.pallas_interpret(),
    )(*meta, xp, w1, b1, w2, b2)


def _fused_dx(meta: GroupMetadata, xp, dy, w1, b1, w2, cfg: _FusedConfig):
    """dx [M, H]: per item, over I tiles: dpre = swiglu'(pre) * (dy @ w2[e]^T) spread to pairs,
    dx += dpre @ w1[e]^T."""
    m, hdim = xp.shape
    tm, ti = cfg.tm, cfg.ti
    nj, num_items = w2.shape[1] // ti, meta.group_ids.shape[0]
    assumed = cost_metadata(m, w1.shape[0], tm)
    dtype, prec = xp.dtype, dot_precision(xp.dtype)

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
            _, dpre = _activation_grad(pre + b1_ref[...].astype(_F32), dh, cfg, dtype)
            acc_ref[...] += jax.lax.dot_general(dpre.astype(dtype), w1_blk, _NT, precision=prec,
                                                preferred_element_type=_F32)

        @pl.when(active & (j == nj - 1))
        def _store():
            store_rows(dx_ref, acc_ref[...], offsets, gids, tiles, w, tm)

    row = pl.BlockSpec((tm, hdim), lambda w, j, o, g, t, a: (t[w], 0))
    grid = (num_items, nj)
    in_specs = [row, row,
                pl.BlockSpec((None, hdim, 2 * ti), lambda w, j, o, g, t, a: (g[w], 0, _live_tile(w, j, a, nj))),
                pl.BlockSpec((None, 1, 2 * ti), lambda w, j, o, g, t, a: (g[w], 0, _live_tile(w, j, a, nj))),
                pl.BlockSpec((None, ti, hdim), lambda w, j, o, g, t, a: (g[w], _live_tile(w, j, a, nj), 0))]
    out_shape = jax.ShapeDtypeStruct((m, hdim), dtype)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=4, grid=grid, in_specs=in_specs, out_specs=row,
                                               scratch_shapes=[pltpu.VMEM((tm, hdim), _F32)]),
        compiler_params=_fused_params(cfg, ("arbitrary", "arbitrary")),
        name="moe_fused_dx",
        cost_estimate=cost_estimate(grid, in_specs, (xp, dy, w1, b1, w2), row, out_shape,
                                    flops=active_item_flops(assumed, tm, hdim, w2.shape[1], 5)
                                    + (0 if cfg.blocked else pair_matmul_flops(assumed, tm, ti, w2.shape[1],
                                                                               _spread_passes(dtype))),
                                    transcendentals=active_items(assumed) * tm * w2.shape[1] * 2,
                                    prefetch=assumed),
        interpret=cfg.mode.pallas_interpret(),
    )(*meta, xp, dy, w1, b1, w2)


def _fused_dw(meta_all: GroupMetadata, xp, dy, w1, b1, w2, cfg: _FusedConfig, *, bias1_dtype, bias2_dtype):
    """dw1 [E, H, 2I] (interleaved), db1 [E, 1, 2I], dw2 [E, I, H], db2 [E, 1, H]. Grid (I tiles,
    items): one expert's items are consecutive, so its blocks accumulate in VMEM and are written
    once. `meta_all` visits empty groups (one all-masked item writes their zero gradient). db2 is
    written once per I tile into its own copy (no block revisited out of order); copy 0 is used."""
    m, hdim = xp.shape
    num_groups = w1.shape[0]
    tm, ti = cfg.tm_w, cfg.ti_w
    assumed = cost_metadata(m, num_groups, tm, visit_empty=True)
    nj, num_items = w2.shape[1] // ti, meta_all.group_ids.shape[0]
    dtype, prec = xp.dtype, dot_precision(xp.dtype)

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
            mine = rows_mine(offsets, gids, tiles, w, tm, (tm, hdim))
            xm = jnp.where(mine, x_ref[...].astype(_F32), 0.0)
            dym = jnp.where(mine, dy_ref[...].astype(_F32), 0.0)
            x_d, dy_d = xm.astype(dtype), dym.astype(dtype)
            pre = jnp.dot(x_d, w1_ref[...], precision=prec, preferred_element_type=_F32)
            dh = jax.lax.dot_general(dy_d, w2_ref[...], _NT, precision=prec, preferred_element_type=_F32)
            h, dpre = _activation_grad(pre + b1_ref[...].astype(_F32), dh, cfg, dtype)
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
    grid, in_specs = (nj, num_items), [row, row, w1_spec, b1_spec, w2_spec]
    out_specs = [w1_spec, b1_spec, w2_spec, pl.BlockSpec((None, None, 1, hdim), lambda j, w, o, g, t, a: (j, g[w], 0, 0))]
    out_shape = (jax.ShapeDtypeStruct(w1.shape, w1.dtype), jax.ShapeDtypeStruct(b1.shape, bias1_dtype),
                 jax.ShapeDtypeStruct(w2.shape, w2.dtype), jax.ShapeDtypeStruct((nj, num_groups, 1, hdim), bias2_dtype))
    dw1, db1, dw2, db2 = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((hdim, 2 * ti), _F32), pltpu.VMEM((1, 2 * ti), _F32),
                            pltpu.VMEM((ti, hdim), _F32), pltpu.VMEM((1, hdim), _F32)]),
        compiler_params=_fused_params(cfg, ("parallel", "arbitrary")),
        name="moe_fused_dw",
        cost_estimate=cost_estimate(grid, in_specs, (xp, dy, w1, b1, w2), out_specs, out_shape,
                                    flops=active_item_flops(assumed, tm, hdim, w2.shape[1], 6)
                                    + (0 if cfg.blocked else pair_matmul_flops(assumed, tm, ti, w2.shape[1],
                                                                               _spread_passes(dtype) + 1)),
                                    transcendentals=active_items(assumed) * tm * w2.shape[1] * 2,
                                    prefetch=assumed),
        interpret=cfg.mode.pallas_interpret(),
    )(*meta_all, xp, dy, w1, b1, w2)
    return dw1, db1, dw2, db2[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_fused_core(xp, group_sizes, w1, b1, w2, b2, cfg: _FusedConfig):
    meta = group_metadata(group_sizes, xp.shape[0], cfg.tm)
    return _fused_forward(meta, xp, w1, b1, w2, b2, cfg)


def _moe_fused_core_fwd(xp, group_sizes, w1, b1, w2, b2, cfg):
    # Residuals are the inputs only: nothing of size [M, I] or [M, 2I] is kept.
    return _moe_fused_core(xp, group_sizes, w1, b1, w2, b2, cfg), (xp, group_sizes, w1, b1, w2, b2)


def _moe_fused_core_bwd(cfg, res, dy):
    xp, group_sizes, w1, b1, w2, b2 = res
    meta = group_metadata(group_sizes, xp.shape[0], cfg.tm)
    meta_all = group_metadata(group_sizes, xp.shape[0], cfg.tm_w, visit_empty=True)
    dy = dy.astype(xp.dtype)
    dx = _fused_dx(meta, xp, dy, w1, b1, w2, cfg)
    dw1, db1, dw2, db2 = _fused_dw(meta_all, xp, dy, w1, b1, w2, cfg, bias1_dtype=b1.dtype, bias2_dtype=b2.dtype)
    return dx, None, dw1, db1, dw2, db2


_moe_fused_core.defvjp(_moe_fused_core_fwd, _moe_fused_core_bwd)


GPU_HINT = "on GPU use the 'xla' (moe_experts_xla) or 'ragged_dot' (moe_experts_reference) implementation"
DEFAULT_FUSED_TILES = {
    # (block_m, block_i): rows per tile and I (intermediate) tile. The kernels take H whole (the
    # SwiGLU needs the full H reduction before the down projection). block_i = I when it fits the
    # VMEM budget below, so each expert's weight blocks are fetched once per expert rather than
    # once per row tile: the row kernels (forward, dx) and the dW kernel each shrink their own
    # I tile to their own VMEM need. Untuned: `bench kernels --tune` on hardware.
    "tpu": (256, 512),
    "cpu": (128, 512),
}
# The row kernels' row tile when I does not fit VMEM whole (TPU): they then stream an expert's
# weights once per row tile, so fewer, taller tiles read them fewer times. gpt-oss-20b on v6e
# (~512 rows per expert per chip): forward 93.7 -> 52.2 ms, dx 48.2 -> 35.5 ms (BENCHMARKS.md,
# the roofline, 2026-12-05). The dW kernel keeps DEFAULT_FUSED_TILES' rows: its row tiles are
# re-read once per I tile, and taller ones leave its weight-sized accumulators less VMEM.
_TILED_I_ROWS_TPU = 512
# Tiles are shrunk until the estimate fits the budget (TPU only). The dW kernel re-reads x and dy
# once per I tile, so its tile is worth the VMEM: it starts from all of I and takes the largest
# tile that fits. At 56 MiB gpt-oss-20b's dW takes I in 9 tiles, not 15 (71.6 instead of 88.2 ms
# per v6e step), Lyra Small's in one (BENCHMARKS.md, the roofline, 2026-12-05). Told the target's VMEM
# (`vmem_capacity_bytes`, which the registry fills from the TPU generation compiled for), the
# budget is 7/8 of it: 112 MiB on v5e and v6e (gpt-oss-20b's dW in 5 tiles), 14 MiB on v4.
_FUSED_VMEM_BUDGET = 56 * 2**20
_FUSED_VMEM_CAP = 64 * 2**20      # vmem_limit_bytes never above this (v7x has 64 MiB per core)


def _fused_vmem_limits(vmem_capacity: int | None) -> tuple[int, int]:
    """(the tiles' VMEM budget, the cap on vmem_limit_bytes) for a target of `vmem_capacity` bytes
    of VMEM per core (None: unknown, budgets that fit any TPU from v5p on)."""
    if vmem_capacity is None:
        return _FUSED_VMEM_BUDGET, _FUSED_VMEM_CAP
    return vmem_capacity * 7 // 8, vmem_capacity


def _fused_temps_bytes(tm: int, hdim: int, ti: int) -> int:
    """Float32 temporaries of a fused kernel's [tm, H] and [tm, 2ti] intermediates."""
    return 4 * (3 * tm * hdim + 12 * tm * 2 * ti)


def _fused_vmem_bytes(tm: int, hdim: int, ti: int, itemsize: int) -> int:
    """Rough VMEM use of the dW kernel: double-buffered blocks, float32 weight-sized accumulators,
    and the temporaries."""
    blocks = 2 * itemsize * (2 * tm * hdim + 2 * (3 * hdim * ti))   # x, dy; w1/w2 in and dw1/dw2 out
    scratch = 4 * 3 * hdim * ti
    return blocks + scratch + _fused_temps_bytes(tm, hdim, ti)


def _fused_rows_vmem_bytes(tm: int, hdim: int, ti: int, itemsize: int) -> int:
    """Rough VMEM use of the larger row kernel (dx): double-buffered x, dy and dx row blocks and
    w1/w2 blocks, the [tm, H] float32 accumulator, and the temporaries."""
    blocks = 2 * itemsize * (3 * tm * hdim + 3 * hdim * ti)
    return blocks + 4 * tm * hdim + _fused_temps_bytes(tm, hdim, ti)


def _resolve_fused_tiling(block_m, block_i, platform: str, m: int, hdim: int, idim: int, dtype,
                          block_i_dw: int | None = None, block_m_dw: int | None = None,
                          vmem_capacity: int | None = None) -> tuple[int, int, int, int, int]:
    """(tm, ti of the row kernels, tm_w, ti_w of the dW kernel, padded I). TPU block rules: the
    x/y/dx blocks take H whole (always legal); a w1 block is [H, 2ti] and a w2 block [ti, H], so ti
    must be I itself or a multiple of 64 (2ti a multiple of 128 lanes, ti of 16 sublanes). An I
    with no such divisor <= the wanted tile is zero-padded to a multiple of 128 (a weight copy:
    only in that case). Tiles given explicitly are kept (rounded to the rules): block_m and block_i
    for all three kernels unless block_m_dw / block_i_dw set the dW kernel's. Defaults shrink to
    the VMEM budget (_fused_vmem_limits): the dW kernel's I tile (weight-sized accumulators, from
    all of I down) first, then its row tile.
    The row kernels keep all of I where it fits (an expert's weights fetched once per expert);
    where it does not, they take _TILED_I_ROWS_TPU rows and the I tile that fits beside them."""
    default_m, default_i = DEFAULT_FUSED_TILES["tpu" if platform == "tpu" else "cpu"]
    want_i = block_i or default_i
    on_tpu = platform == "tpu"
    itemsize = jnp.dtype(dtype).itemsize
    sub = (16 if itemsize < 4 else 8) if on_tpu else 8

    def rows(want: int) -> int:
        return max(sub, min(round_up(want, sub), round_up(m, sub)))

    tm, tm_w = rows(block_m or default_m), rows(block_m_dw or block_m or default_m)
    if not on_tpu:
        return tm, fit_tile(idim, want_i, 8), tm_w, fit_tile(idim, block_i_dw or want_i, 8), idim
    ip = idim
    start = fit_tile(idim, want_i, 64)
    if start == idim and idim > want_i:
        ip = round_up(idim, 128)
        start = fit_tile(ip, want_i, 128)
    # The dW kernel: shrink its defaults to the budget, first ti_w (to multiples of 64 dividing ip), then tm_w.
    budget, _ = _fused_vmem_limits(vmem_capacity)
    fixed_i, fixed_m = block_i is not None or block_i_dw is not None, block_m is not None or block_m_dw is not None
    ti_w = fit_tile(ip, block_i_dw, 64) if block_i_dw is not None else start if block_i is not None else ip
    while _fused_vmem_bytes(tm_w, hdim, ti_w, itemsize) > budget:
        smaller = fit_tile(ip, ti_w - 64, 64) if ti_w > 64 and not fixed_i else ti_w
        if smaller < ti_w:
            ti_w = smaller
        elif tm_w > sub and not fixed_m:
            tm_w = max(sub, round_up(tm_w // 2, sub))
        else:
            break

    def fits(tm: int, ti: int) -> bool:
        return _fused_rows_vmem_bytes(tm, hdim, ti, itemsize) <= budget

    def row_i_tile(tm: int) -> int:
        """The row kernels' I tile beside `tm` rows: the wanted one, shrunk (a default) to fit."""
        ti = start
        while ti > 64 and block_i is None and not fits(tm, ti):
            ti = fit_tile(ip, ti - 64, 64)
        return ti

    ti = row_i_tile(tm)
    if ti < ip and block_m is None:      # I tiled: weights streamed per row tile, so taller row tiles
        tm = rows(_TILED_I_ROWS_TPU)
        ti = row_i_tile(tm)
        while tm > sub and not fits(tm, ti):
            tm = max(sub, round_up(tm // 2, sub))
    return tm, ti, tm_w, ti_w, ip


GATE_UP_LAYOUTS = ("interleaved", "blocked")


# Rows from which the blocked layout's per-call copy of gate_up (E x H x 2I, written and read
# again, forward and dW) costs less than the pair matmuls it saves (forward, dx and dW: ~3 x 4 ti I
# FLOPs a row): m ti >= _BLOCKED_ROWS_FACTOR x E H itemsize, at ~250 FLOP per HBM byte (v5e's
# peaks), rounded down. Training steps are far above it (small-o200k: 65,536 rows, 8,192 needed);
# decoding (a few rows a step) is far below.
_BLOCKED_ROWS_FACTOR = 128


def _gate_up_layout(requested: str | None, ti: int, ti_w: int, platform: str, rows: int, experts: int,
                    hdim: int, itemsize: int) -> str:
    """The layout the kernels take gate_up in (section comment above): blocked where the row
    kernels and the dW kernel share one I tile (one permuted copy serves all three), on TPU a
    multiple of the 128 lanes (its gate and up halves lane-aligned), and the rows amortize the
    copy (_BLOCKED_ROWS_FACTOR); else interleaved. Asked for blocked where the tiles do not allow
    it: refused, naming why."""
    if requested not in (None, *GATE_UP_LAYOUTS):
        raise ValueError(f"moe_experts_pallas: gate_up_layout must be one of {', '.join(GATE_UP_LAYOUTS)}, "
                         f"found {requested!r}")
    why = (f"the row kernels' I tile ({ti}) differs from the dW kernel's ({ti_w})" if ti != ti_w else
           f"the I tile ({ti}) is not a multiple of the TPU's 128 lanes" if platform == "tpu" and ti % 128 else None)
    if requested == "blocked" and why:
        raise ValueError(f"moe_experts_pallas: gate_up_layout='blocked' needs one I tile for all three kernels, "
                         f"a multiple of 128 on TPU: {why}; set block_i (and block_i_dw) accordingly, or use "
                         f"'interleaved'")
    amortized = rows * ti >= _BLOCKED_ROWS_FACTOR * experts * hdim * itemsize
    return requested or ("blocked" if not why and amortized else "interleaved")


def bias_operand(bias):
    """An expert bias [E, N] as the fused kernels take it: [E, 1, N], a row per expert. (A decode
    loop makes it once before the loop: jax_bridge/decoding.py.)"""
    return bias.reshape(bias.shape[0], 1, bias.shape[-1])


def fused_tiles(m: int, hdim: int, idim: int, dtype, platform: str = "tpu", block_m: int | None = None,
                block_i: int | None = None, block_i_dw: int | None = None, block_m_dw: int | None = None,
                vmem_capacity_bytes: int | None = None, gate_up_layout: str | None = None,
                num_experts: int = 1) -> dict:
    """The tiles `moe_experts_pallas` runs with for x [m, hdim] and num_experts experts of width idim (the
    defaults after their VMEM-budget shrink, or the options given): block_m, block_i (forward and
    dx), block_m_dw, block_i_dw (dW), the gate_up layout and the padded I when it had to be padded."""
    tm, ti, tm_w, ti_w, ip = _resolve_fused_tiling(block_m, block_i, platform, m, hdim, idim, dtype, block_i_dw,
                                                   block_m_dw, vmem_capacity_bytes)
    return {"block_m": tm, "block_i": ti, "block_m_dw": tm_w, "block_i_dw": ti_w,
            "gate_up_layout": _gate_up_layout(gate_up_layout, ti, ti_w, platform, m, num_experts, hdim,
                                              jnp.dtype(dtype).itemsize),
            **({"padded_i": ip} if ip != idim else {})}


def moe_experts_pallas(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                       limit: float = 7.0, up_shift: float = 1.0, platform: str, block_m: int | None = None,
                       block_i: int | None = None, block_i_dw: int | None = None, block_m_dw: int | None = None,
                       vmem_limit_bytes: int | None = None, vmem_capacity_bytes: int | None = None,
                       gate_up_layout: str | None = None, interpret: str | None = None):
    """Fused Pallas expert MLP: per (row tile, expert) work item, up projection, clamped SwiGLU
    and down projection in one kernel; h [M, I] and the pre-activation [M, 2I] (or its gradient)
    exist only as VMEM tiles, in forward and backward. Backward (custom_vjp) recomputes them in
    a dx kernel and an expert-major dW/db kernel. gate_up_layout: 'blocked' (gate_up permuted
    once per call to [gate | up] per I tile) or 'interleaved' (no copy; the kernels de-interleave
    with lane rolls and pair matmuls); None: blocked where the tiles allow it and the rows amortize
    the copy (_gate_up_layout; the section comment says what each costs).

    platform (pallas_kernels.platform): 'tpu' -> Mosaic; 'cpu' -> the same kernels in the
    generic interpreter; there is no GPU kernel. interpret: None, 'generic' or 'tpu' (the
    TPU-simulating interpreter: NaN-filled buffers, race detection; with platform 'tpu' it keeps
    the TPU tiling rules). block_m (rows per tile) and block_i (I tile): None -> per-platform
    DEFAULT_FUSED_TILES, clipped to the problem and (TPU) to a VMEM budget, the row kernels
    taller where I is tiled (_resolve_fused_tiling); block_m_dw / block_i_dw: the dW kernel's own
    tiles (default: block_m / block_i, or its own VMEM budget's). vmem_limit_bytes:
    the TPU kernels' scoped VMEM limit (default: from the tiles' estimate). vmem_capacity_bytes:
    the target's VMEM per core, which sets the budget (the registry gives the generation's).
    Float32 inputs use HIGHEST precision, all matmuls accumulate in float32; outputs and
    gradients come back in the input dtypes.
    """
    mode = kernel_mode(platform, interpret, who="moe_experts_pallas", families=("tpu",), hint=GPU_HINT)
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    idim = two_i // 2
    if m == 0:
        return jnp.zeros_like(x)
    tm, ti, tm_w, ti_w, ip = _resolve_fused_tiling(block_m, block_i, platform, m, hdim, idim, x.dtype, block_i_dw,
                                                   block_m_dw, vmem_capacity_bytes)
    vmem = vmem_limit_bytes
    if platform == "tpu" and vmem is None:
        itemsize = jnp.dtype(x.dtype).itemsize
        est = max(_fused_vmem_bytes(tm_w, hdim, ti_w, itemsize), _fused_rows_vmem_bytes(tm, hdim, ti, itemsize))
        cap = _fused_vmem_limits(vmem_capacity_bytes)[1]
        vmem = int(min(cap, max(32 * 2**20, round_up(est * 5 // 4, 2**20))))
    blocked = _gate_up_layout(gate_up_layout, ti, ti_w, platform, m, num_groups, hdim,
                              jnp.dtype(x.dtype).itemsize) == "blocked"
    cfg = _FusedConfig(tm, ti, tm_w, ti_w, float(alpha), float(limit), float(up_shift), mode, vmem, blocked)
    dtype = x.dtype
    w1, b1 = gate_up.astype(dtype), bias_operand(gate_up_bias)
    w2, b2 = down.astype(dtype), bias_operand(down_bias)
    if ip != idim:   # zero gate/up columns and down rows give h = 0 there: results unchanged
        w1 = jnp.pad(w1.reshape(num_groups, hdim, idim, 2),
                     ((0, 0), (0, 0), (0, ip - idim), (0, 0))).reshape(num_groups, hdim, 2 * ip)
        b1 = jnp.pad(b1.reshape(num_groups, 1, idim, 2),
                     ((0, 0), (0, 0), (0, ip - idim), (0, 0))).reshape(num_groups, 1, 2 * ip)
        w2 = jnp.pad(w2, ((0, 0), (0, ip - idim), (0, 0)))
    if blocked:      # autodiff's transpose of the permutation puts the gradients back in order
        w1, b1 = _blocked(w1, ti), _blocked(b1, ti)
    # No row padding: when tm does not divide M the last row tile overhangs the arrays. Its rows
    # past M belong to no expert (offsets[E] == M), so they are masked by select on store and
    # zeroed in the dW kernel; their out-of-bounds block writes are dropped.
    return _moe_fused_core(x, group_sizes.astype(jnp.int32), w1, b1, w2, b2, cfg)


# =============================================================================================
# Baseline: jax-shipped megablox gmm (TPU kernel; interpreted on CPU)
# =============================================================================================
DEFAULT_MEGABLOX_TILES = {"tpu": (256, 512), "cpu": (128, 512)}   # (block_m, block_k)


def moe_experts_megablox(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                         limit: float = 7.0, up_shift: float = 1.0, platform: str, block_m: int | None = None,
                         block_k: int | None = None, interpret: str | None = None):
    """Two `jax.experimental.pallas.ops.tpu.megablox.gmm` calls (custom_vjp: gmm + tgmm
    backward) with bias gathers and clamped_swiglu in plain JAX between them. A baseline and
    fall-back: it stores the float32 [M, 2I] pre-activation. Its in-kernel dots take the ambient
    matmul precision, so each gmm runs (forward and backward) under the precision
    pallas_kernels.platform chooses for the input dtype. block_m: rows per tile; block_k: the
    megablox k and n tile, one size dividing both matmul dims (its backward swaps them).
    platform 'tpu' (Mosaic) or 'cpu' (interpreted); no GPU kernel."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

    mode = kernel_mode(platform, interpret, who="moe_experts_megablox", families=("tpu",), hint=GPU_HINT)
    interpret_flag = mode.shipped_interpret()
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    if m == 0:
        return jnp.zeros_like(x)
    default_m, default_k = DEFAULT_MEGABLOX_TILES["tpu" if platform == "tpu" else "cpu"]
    want_m, want_k = block_m or default_m, block_k or default_k
    lane = 128 if platform == "tpu" else 8
    tm = max(8, min(round_up(want_m, 8), round_up(m, 8)))
    mp = round_up(m, tm)
    gs = group_sizes.astype(jnp.int32)
    expert = expert_of_rows(gs, mp)
    valid = (jnp.arange(mp) < m)[:, None]
    # megablox's k / n tiles must divide both matmul dims and be multiples of 128 on TPU; H or I
    # without such a divisor (gpt-oss: 2880) are zero-padded to a multiple of 128: zero weights
    # and biases give zero outputs there, sliced off (a weight copy per call, only then).
    idim = two_i // 2
    hp, ip = (round_up(hdim, lane), round_up(idim, lane)) if platform == "tpu" else (hdim, idim)
    gate_up, gate_up_bias = gate_up.astype(x.dtype), gate_up_bias
    down, down_bias = down.astype(x.dtype), down_bias
    if (hp, ip) != (hdim, idim):
        gate_up = jnp.pad(gate_up.reshape(num_groups, hdim, idim, 2),
                          ((0, 0), (0, hp - hdim), (0, ip - idim), (0, 0))).reshape(num_groups, hp, 2 * ip)
        gate_up_bias = jnp.pad(gate_up_bias.reshape(num_groups, idim, 2),
                               ((0, 0), (0, ip - idim), (0, 0))).reshape(num_groups, 2 * ip)
        down = jnp.pad(down, ((0, 0), (0, ip - idim), (0, hp - hdim)))
        down_bias = jnp.pad(down_bias, ((0, 0), (0, hp - hdim)))

    def gmm(lhs, rhs):
        t = fit_tile(math.gcd(rhs.shape[1], rhs.shape[2]), want_k, lane)
        call = with_matmul_precision(
            lambda a, b, g: megablox_gmm(a, b, g, _F32, (tm, t, t), None, None, False, interpret_flag),
            precision_name(lhs.dtype))
        return call(lhs, rhs, gs)

    xp = jnp.pad(x, ((0, mp - m), (0, hp - hdim)))
    # Rows past M are never written by megablox: select them to 0 so no garbage reaches the
    # activation or (through the bias gather's transpose) the bias gradients. Biases are cast
    # before the gather so their gradients are summed in float32.
    # Sorted gathers: their transposes (the bias gradients) are sorted segment sums.
    per_row = lambda b: jnp.take(b.astype(_F32), expert, axis=0, indices_are_sorted=True)
    gu = jnp.where(valid, gmm(xp, gate_up) + per_row(gate_up_bias), 0.0)
    h = clamped_swiglu(gu, alpha=alpha, limit=limit, up_shift=up_shift).astype(x.dtype)
    y = gmm(h, down) + per_row(down_bias)
    return y[:m, :hdim].astype(x.dtype)
