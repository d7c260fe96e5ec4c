"""Grouped expert MLP whose frozen weights stay MXFP4 in HBM (gpt-oss as released): the weights
arrive as the released `*_blocks` / `*_scales` tensors and are decoded to the compute dtype in
VMEM, tile by tile; nothing of them is dequantized in HBM.

The op's contract (the `moe_mxfp4` op of the registry):
  x [M, H] rows sorted by expert; group_sizes [E] int32 (sum == M)
  gate_up_blocks [E, 2I, H/2] uint8, gate_up_scales [E, 2I, H/32] uint8, gate_up_bias [E, 2I]
  down_blocks [E, H, I/2] uint8, down_scales [E, H, I/32] uint8, down_bias [E, H]
i.e. transformers' gate_up_proj [E, H, 2I] (gate/up interleaved) and down_proj [E, I, H] stored
transposed, each output row's input dimension cut into 32-value blocks (pallas_kernels/mxfp4.py
decodes them). The blocks are the released `*_blocks` bytes in their order, viewed as [E, rows,
K/2] rather than [E, rows, K/32, 16]: on TPU an array whose last dimension is 16 bytes is padded
to 128 lanes in HBM (8x), so a 4-D view would cost a relayout copy of every stack per call.
The result is moe_experts(x, ...) of pallas_kernels/moe.py on the decoded weights.
The base is frozen: gradients flow to x only (weights and biases get none; a caller that trains
them must not use this op).

Implementations (same signature, plus keyword options):
  moe_mxfp4_reference  decode every stack, then moe_experts_reference (ragged_dot): the oracle
  moe_mxfp4_xla        decode every stack, then moe_experts_xla: CPU runs (decoded per call)
  moe_mxfp4_pallas     the fused kernels below: 4.25 bits per weight read from HBM
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import index_math as ix
from pallas_kernels.cost import cost_estimate
from pallas_kernels.moe import (GPU_HINT, GroupMetadata, active_item_flops, active_items, cost_metadata, fit_tile,
                                group_metadata, moe_experts_reference, moe_experts_xla, round_up, store_rows)
from pallas_kernels.mxfp4 import (BLOCK, NORMAL_SCALES, dequantize_mxfp4, e2m1_bf16_bits, e2m1_bf16_bits_normal,
                                  normal_base)
from pallas_kernels.platform import KernelMode, dot_precision, kernel_mode

_F32 = jnp.float32
_HALF_BLOCK = BLOCK // 2        # bytes per block: two E2M1 codes each


def check_mxfp4_experts(x, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias):
    """(E, H, I) of a released-layout expert stack, or a ValueError naming the tensor that does
    not fit x [M, H]."""
    m, hdim = x.shape
    if gate_up_blocks.ndim != 3:
        raise ValueError(f"moe_mxfp4: gate_up_blocks must be [E, 2I, H/2], found {list(gate_up_blocks.shape)}")
    num_experts, two_i, _ = gate_up_blocks.shape
    idim = two_i // 2
    want = {"gate_up_blocks": ((num_experts, two_i, hdim // 2), jnp.uint8),
            "gate_up_scales": ((num_experts, two_i, hdim // BLOCK), jnp.uint8),
            "gate_up_bias": ((num_experts, two_i), None),
            "down_blocks": ((num_experts, hdim, idim // 2), jnp.uint8),
            "down_scales": ((num_experts, hdim, idim // BLOCK), jnp.uint8),
            "down_bias": ((num_experts, hdim), None)}
    found = {"gate_up_blocks": gate_up_blocks, "gate_up_scales": gate_up_scales, "gate_up_bias": gate_up_bias,
             "down_blocks": down_blocks, "down_scales": down_scales, "down_bias": down_bias}
    if hdim % BLOCK or two_i % (2 * BLOCK):
        raise ValueError(f"moe_mxfp4: the hidden size ({hdim}) and the expert width ({idim}) must be multiples of "
                         f"{BLOCK} (MXFP4 blocks)")
    for name, (shape, dtype) in want.items():
        if tuple(found[name].shape) != shape or (dtype is not None and found[name].dtype != dtype):
            raise ValueError(f"moe_mxfp4: {name} must be {list(shape)}{' uint8' if dtype else ''} for x "
                             f"{list(x.shape)} and {num_experts} experts of width {idim}; found "
                             f"{list(found[name].shape)} {found[name].dtype}")
    return num_experts, hdim, idim


def decoded_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales, dtype):
    """The stacks in moe_experts' layout: gate_up [E, H, 2I] and down [E, I, H], in `dtype`
    (the decode is exact in bfloat16, so in float32 too)."""
    blocks = lambda b: b.reshape(*b.shape[:-1], b.shape[-1] // _HALF_BLOCK, _HALF_BLOCK)
    gate_up = dequantize_mxfp4(blocks(gate_up_blocks), gate_up_scales).astype(dtype)    # [E, 2I, H]
    down = dequantize_mxfp4(blocks(down_blocks), down_scales).astype(dtype)             # [E, H, I]
    return jnp.swapaxes(gate_up, 1, 2), jnp.swapaxes(down, 1, 2)


def _frozen(*arrays):
    return tuple(jax.lax.stop_gradient(a) for a in arrays)


def moe_mxfp4_reference(x, group_sizes, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                        down_bias, *, alpha: float = 1.702, limit: float = 7.0, up_shift: float = 1.0):
    """The oracle: decode the stacks whole, then the bf16/f32 expert computation of
    moe_experts_reference (two ragged_dot grouped GEMMs)."""
    check_mxfp4_experts(x, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias)
    gate_up, down = decoded_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales, x.dtype)
    gate_up_bias, down_bias = _frozen(gate_up_bias, down_bias)
    return moe_experts_reference(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha=alpha, limit=limit,
                                 up_shift=up_shift)


def moe_mxfp4_xla(x, group_sizes, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                  down_bias, *, alpha: float = 1.702, limit: float = 7.0, up_shift: float = 1.0,
                  block_m: int | None = None):
    """Decode the stacks whole (in the program, per call), then moe_experts_xla: the CPU path.
    HBM holds the MXFP4 bytes between calls; a call's decoded copy is a temporary."""
    check_mxfp4_experts(x, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias)
    gate_up, down = decoded_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales, x.dtype)
    gate_up_bias, down_bias = _frozen(gate_up_bias, down_bias)
    return moe_experts_xla(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha=alpha, limit=limit,
                           up_shift=up_shift, block_m=block_m)


# =============================================================================================
# The fused kernels: weights decoded in VMEM, computed "transposed" (rows of x on lanes)
# =============================================================================================
# Why transposed. A released block tile is [rows, K/2] bytes, row r holding K values of one output
# row, low nibble first: decoding gives the even-k and odd-k values as two [rows, K/2] tiles
# (lo, hi), and x's columns are split the same way once per call (x_even, x_odd: [2, M, H/2]), so
# x @ W^T = x_even @ lo^T + x_odd @ hi^T with no lane shuffle. A block's scale byte covers 16
# lanes of lo and hi: broadcast [rows, G, 16] -> [rows, K/2], a layout the TPU compiler takes.
# Computing pre^T [2ti, tm] = lo @ x_even^T + hi @ x_odd^T puts gate/up, which alternate along 2I,
# on sublanes, where strided reads separate them (Mosaic has no lane-strided access); h^T lands in
# a VMEM stack [2, I/2, tm] (even / odd units of I, as the down projection's lo / hi need them),
# and the down projection y^T [H, tm] = lo2 @ h_even^T + hi2 @ h_odd^T runs over tiles of H rows
# of the released down stack, whose lanes (I/2 bytes) stay whole: gpt-oss's 2880 has no divisor
# that is a multiple of 128, so no lane dimension is ever cut. y^T [H, M] is transposed back
# outside (activation-sized).
#
# One work item = one (row tile, expert) pair, as in pallas_kernels/moe.py; per item the grid
# runs nj steps over I tiles (up projection + SwiGLU) then nh steps over H tiles (down
# projection): each weight tile is read once per item, the decoded tiles never leave VMEM.
# The dx kernel runs the down stack first (dh^T [2, I/2, tm] = lo2^T dy^T), then the I tiles:
# pre recomputed, dpre from the SwiGLU's derivative, dx_even/odd += dpre^T lo / hi.


class _MxConfig(NamedTuple):
    tm: int          # rows per tile (lanes of the transposed blocks)
    ti: int          # units of I per up-projection step (2ti rows of gate_up)
    th: int          # rows of H per down-projection step
    alpha: float
    limit: float
    up_shift: float
    mode: KernelMode
    vmem_limit: int | None


_NT = (((1,), (1,)), ((), ()))   # a @ b^T
_TN = (((0,), (0,)), ((), ()))   # a^T @ b


def _decode_tile(packed_ref, scales_ref, lo_ref, hi_ref):
    """Decode a released block tile [rows, K/2] uint8 with its scale bytes [rows, K/32] into
    lo_ref / hi_ref ([rows, K/2]: the even-k and odd-k values, in their dtype), exactly. Tiles
    whose scale bytes all lie in NORMAL_SCALES (every real checkpoint's) take the few-operation
    decode; a tile with an extreme byte (subnormal or overflowing values) the general one."""
    packed = packed_ref[...].astype(jnp.int32)
    rows, half = packed.shape
    scales = scales_ref[...].astype(jnp.int32)
    low, high = NORMAL_SCALES
    extreme = jnp.max(jnp.where((scales < low) | (scales > high), 1, 0)) > 0
    per_value = lambda a: jnp.broadcast_to(a[:, :, None], (rows, half // _HALF_BLOCK, _HALF_BLOCK)).reshape(rows, half)

    def decode(bits_of, per_block):
        lo_ref[...] = jax.lax.bitcast_convert_type(bits_of(packed & 0x0F, per_block), jnp.bfloat16).astype(lo_ref.dtype)
        hi_ref[...] = jax.lax.bitcast_convert_type(bits_of(packed >> 4, per_block), jnp.bfloat16).astype(hi_ref.dtype)

    pl.when(extreme)(lambda: decode(e2m1_bf16_bits, per_value(scales)))
    pl.when(jnp.logical_not(extreme))(lambda: decode(e2m1_bf16_bits_normal, per_value(normal_base(scales))))
    return lo_ref[...], hi_ref[...]


# Mosaic's strided loads and stores (the gate / up rows of an interleaved tile) take a VMEM
# buffer whose last dimension is exactly 128 lanes: tiles of tm rows (lanes) are kept as
# [tm / 128, rows, 128] chunks (on CPU, where tm may be smaller, one chunk of tm lanes).
def _chunks(tm: int) -> tuple[int, int]:
    width = min(tm, 128)
    if tm % width:
        raise ValueError(f"moe_mxfp4: a row tile of {tm} is not whole 128-lane chunks")
    return tm // width, width


def _put_chunked(ref, value):
    """value [rows, tm] into a chunked buffer [tm / w, rows, w]."""
    count, width = ref.shape[0], ref.shape[2]
    for c in range(count):
        ref[c] = value[:, c * width:(c + 1) * width]


def _get_chunked(ref, rows=None):
    """ref [tm / w, R, w] (rows: a pl.ds of R, strided or not) -> [rows, tm]."""
    rows = slice(None) if rows is None else rows
    parts = [ref.at[c][rows, :] for c in range(ref.shape[0])]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _set_chunked(ref, rows, value):
    """ref[:, rows, :] = value [rows, tm] (rows: a pl.ds, strided or not)."""
    width = ref.shape[2]
    for c in range(ref.shape[0]):
        ref.at[c][rows, :] = value[:, c * width:(c + 1) * width]


def _gate_up_rows(pre_ref, n: int):
    """The four row classes of an interleaved pre-activation tile (chunked [., 4n, w]): gate and
    up of the even units of I, then of the odd units (rows 4c, 4c+1, 4c+2, 4c+3), each [n, tm]."""
    return tuple(_get_chunked(pre_ref, pl.ds(k, n, stride=4)) for k in range(4))


def _swiglu(g_raw, u_raw, cfg: _MxConfig):
    gate = jnp.minimum(g_raw, cfg.limit)
    up = jnp.clip(u_raw, -cfg.limit, cfg.limit)
    return (up + cfg.up_shift) * (gate * jax.nn.sigmoid(cfg.alpha * gate))


def _swiglu_grads(g_raw, u_raw, dh, cfg: _MxConfig):
    """(d/dgate, d/dup) times dh, with the clamps' gradient 0 at the limit itself (as
    clamped_swiglu_grad and the bf16 fused kernels)."""
    gate = jnp.minimum(g_raw, cfg.limit)
    up = jnp.clip(u_raw, -cfg.limit, cfg.limit)
    sig = jax.nn.sigmoid(cfg.alpha * gate)
    glu = gate * sig
    dgate = jnp.where(g_raw < cfg.limit, dh * (up + cfg.up_shift) * (sig + cfg.alpha * gate * sig * (1.0 - sig)), 0.0)
    dup = jnp.where((u_raw > -cfg.limit) & (u_raw < cfg.limit), dh * glu, 0.0)
    return dgate, dup


def _step(w, s, num_active, first: int, count: int):
    """The tile a phase's index map gives work item w at grid step s: the phase [first,
    first + count) walks its tiles; outside it the map holds the nearest end, so nothing is
    fetched again. Spare items past the last active one hold the last tile (nothing streamed)."""
    live = ix.clip(s - first, 0, count - 1)
    return ix.where(w < num_active[0], live, count - 1)


def _specs(cfg: _MxConfig, hdim: int, idim: int, *, up_first: int, down_first: int):
    """BlockSpecs of the weights: the up stack's tiles during steps [up_first, up_first + nj),
    the down stack's during [down_first, down_first + nh)."""
    ti, th = cfg.ti, cfg.th
    nj, nh = idim // ti, hdim // th
    up = lambda w, s, a: _step(w, s, a, up_first, nj)
    down = lambda w, s, a: _step(w, s, a, down_first, nh)
    return [pl.BlockSpec((None, 2 * ti, hdim // 2), lambda w, s, o, g, t, a: (g[w], up(w, s, a), 0)),
            pl.BlockSpec((None, 2 * ti, hdim // BLOCK), lambda w, s, o, g, t, a: (g[w], up(w, s, a), 0)),
            pl.BlockSpec((None, 2 * ti, 1), lambda w, s, o, g, t, a: (g[w], up(w, s, a), 0)),
            pl.BlockSpec((None, th, idim // 2), lambda w, s, o, g, t, a: (g[w], down(w, s, a), 0)),
            pl.BlockSpec((None, th, idim // BLOCK), lambda w, s, o, g, t, a: (g[w], down(w, s, a), 0))]


def _chunk_buffer(tm: int, rows: int):
    """A float32 VMEM buffer for a [rows, tm] tile, chunked as [tm / w, rows, w] (see _chunks)."""
    count, width = _chunks(tm)
    return pltpu.VMEM((count, rows, width), _F32)


def _decoded_scratch(cfg: _MxConfig, hdim: int, idim: int, dtype):
    """VMEM for the decoded tiles: the up stack's lo / hi [2ti, H/2], the down stack's [th, I/2]."""
    return [pltpu.VMEM((2 * cfg.ti, hdim // 2), dtype), pltpu.VMEM((2 * cfg.ti, hdim // 2), dtype),
            pltpu.VMEM((cfg.th, idim // 2), dtype), pltpu.VMEM((cfg.th, idim // 2), dtype)]


def _params(cfg: _MxConfig):
    return pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=cfg.vmem_limit)


class _Dims(NamedTuple):
    m: int
    hdim: int
    idim: int
    nj: int               # up-projection steps (tiles of I)
    nh: int               # down-projection steps (tiles of H rows)
    num_items: int
    assumed: GroupMetadata    # the metadata the cost estimates assume (moe.cost_metadata)


def _dims(meta: GroupMetadata, x_halves, w1b, cfg: _MxConfig) -> _Dims:
    _, m, half_h = x_halves.shape
    hdim, idim = 2 * half_h, w1b.shape[1] // 2
    return _Dims(m, hdim, idim, idim // cfg.ti, hdim // cfg.th, meta.group_ids.shape[0],
                 cost_metadata(m, w1b.shape[0], cfg.tm))


def _up_projection(x_ref, w1b_ref, w1s_ref, b1_ref, lo_s, hi_s, pre_s, n: int, prec):
    """This I tile's pre-activation^T (decoded weights x both halves of x, plus the bias) kept in
    pre_s, returned as its four row classes (gate / up of the even units, then of the odd), and
    the decoded (lo, hi) tile."""
    lo, hi = _decode_tile(w1b_ref, w1s_ref, lo_s, hi_s)
    pre = jax.lax.dot_general(lo, x_ref[0], _NT, precision=prec, preferred_element_type=_F32)
    pre += jax.lax.dot_general(hi, x_ref[1], _NT, precision=prec, preferred_element_type=_F32)
    _put_chunked(pre_s, pre + b1_ref[...].astype(_F32))
    return _gate_up_rows(pre_s, n), (lo, hi)


def _mx_forward(meta: GroupMetadata, x_halves, w1b, w1s, b1, w2b, w2s, b2, cfg: _MxConfig):
    """y^T [H, M]. x_halves [2, M, H/2] (x's even and odd columns); w1b [E, 2I, H/2] bytes,
    w1s [E, 2I, H/32]; b1 [E, 2I, 1]; w2b [E, H, I/2], w2s [E, H, I/32]; b2 [E, H, 1]."""
    m, hdim, idim, nj, nh, num_items, assumed = _dims(meta, x_halves, w1b, cfg)
    tm, ti, th = cfg.tm, cfg.ti, cfg.th
    dtype, prec = x_halves.dtype, dot_precision(x_halves.dtype)
    half_h, steps = hdim // 2, nj + nh

    def kernel(offsets, gids, tiles, nact, x_ref, w1b_ref, w1s_ref, b1_ref, w2b_ref, w2s_ref, b2_ref,
               y_ref, lo1_s, hi1_s, lo2_s, hi2_s, pre_s, h_s, y_s):
        w, s = pl.program_id(0), pl.program_id(1)
        active = w < nact[0]

        @pl.when(active & (s < nj))
        def _up():
            (g_e, u_e, g_o, u_o), _ = _up_projection(x_ref, w1b_ref, w1s_ref, b1_ref, lo1_s, hi1_s, pre_s, ti // 2,
                                                     prec)
            rows = pl.ds(pl.multiple_of(s * (ti // 2), 8), ti // 2)
            h_s[0, rows, :] = _swiglu(g_e, u_e, cfg).astype(dtype)
            h_s[1, rows, :] = _swiglu(g_o, u_o, cfg).astype(dtype)

        @pl.when(active & (s >= nj))
        def _down():
            lo, hi = _decode_tile(w2b_ref, w2s_ref, lo2_s, hi2_s)
            y = jnp.dot(lo, h_s[0], precision=prec, preferred_element_type=_F32)
            y += jnp.dot(hi, h_s[1], precision=prec, preferred_element_type=_F32)
            y_s[pl.ds(pl.multiple_of((s - nj) * th, 8), th), :] = y

        @pl.when(active & (s == steps - 1))
        def _store():
            store_rows(y_ref, y_s[...] + b2_ref[...].astype(_F32), offsets, gids, tiles, w, tm, axis=1)

    w1_b, w1_s, b1_spec, w2_b, w2_s = _specs(cfg, hdim, idim, up_first=0, down_first=nj)
    in_specs = [pl.BlockSpec((2, tm, half_h), lambda w, s, o, g, t, a: (0, t[w], 0)),
                w1_b, w1_s, b1_spec, w2_b, w2_s, pl.BlockSpec((None, hdim, 1), lambda w, s, o, g, t, a: (g[w], 0, 0))]
    out_spec = pl.BlockSpec((hdim, tm), lambda w, s, o, g, t, a: (0, t[w]))
    out_shape = jax.ShapeDtypeStruct((hdim, m), dtype)
    grid = (num_items, steps)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=grid, in_specs=in_specs, out_specs=out_spec,
            scratch_shapes=[*_decoded_scratch(cfg, hdim, idim, dtype), _chunk_buffer(tm, 2 * ti),
                            pltpu.VMEM((2, idim // 2, tm), dtype), pltpu.VMEM((hdim, tm), _F32)]),
        compiler_params=_params(cfg),
        name="moe_mxfp4_fwd",
        cost_estimate=cost_estimate(grid, in_specs, (x_halves, w1b, w1s, b1, w2b, w2s, b2), out_spec, out_shape,
                                    # the decode's integer operations (VPU) are not FLOPs: not counted
                                    flops=active_item_flops(assumed, tm, hdim, idim, 3),
                                    transcendentals=active_items(assumed) * tm * idim, prefetch=assumed),
        interpret=cfg.mode.pallas_interpret(),
    )(*meta, x_halves, w1b, w1s, b1, w2b, w2s, b2)


def _mx_dx(meta: GroupMetadata, x_halves, dy_t, w1b, w1s, b1, w2b, w2s, cfg: _MxConfig):
    """dx as [2, M, H/2] (even and odd columns). dy_t [H, M]."""
    m, hdim, idim, nj, nh, num_items, assumed = _dims(meta, x_halves, w1b, cfg)
    tm, ti, th = cfg.tm, cfg.ti, cfg.th
    dtype, prec = x_halves.dtype, dot_precision(x_halves.dtype)
    half_h, steps = hdim // 2, nh + nj

    def kernel(offsets, gids, tiles, nact, x_ref, dy_ref, w1b_ref, w1s_ref, b1_ref, w2b_ref, w2s_ref,
               dx_ref, lo1_s, hi1_s, lo2_s, hi2_s, dh_s, pre_s, dpre_s, acc_s):
        w, s = pl.program_id(0), pl.program_id(1)
        active = w < nact[0]

        @pl.when(s == 0)
        def _zero():
            dh_s[...] = jnp.zeros_like(dh_s)
            acc_s[...] = jnp.zeros_like(acc_s)

        @pl.when(active & (s < nh))
        def _down():      # dh^T [I/2, tm] (even, odd units) += W2^T dy^T over this tile of H
            lo, hi = _decode_tile(w2b_ref, w2s_ref, lo2_s, hi2_s)
            dy = dy_ref[...]
            dh_s[0] += jax.lax.dot_general(lo, dy, _TN, precision=prec, preferred_element_type=_F32)
            dh_s[1] += jax.lax.dot_general(hi, dy, _TN, precision=prec, preferred_element_type=_F32)

        @pl.when(active & (s >= nh))
        def _up():
            (g_e, u_e, g_o, u_o), (lo, hi) = _up_projection(x_ref, w1b_ref, w1s_ref, b1_ref, lo1_s, hi1_s, pre_s,
                                                            ti // 2, prec)
            rows = pl.ds(pl.multiple_of((s - nh) * (ti // 2), 8), ti // 2)
            n = ti // 2
            for k, grads in ((0, _swiglu_grads(g_e, u_e, dh_s[0, rows, :], cfg)),
                             (2, _swiglu_grads(g_o, u_o, dh_s[1, rows, :], cfg))):
                _set_chunked(dpre_s, pl.ds(k, n, stride=4), grads[0])
                _set_chunked(dpre_s, pl.ds(k + 1, n, stride=4), grads[1])
            dpre = _get_chunked(dpre_s).astype(dtype)                            # [2ti, tm]
            acc_s[0] += jax.lax.dot_general(dpre, lo, _TN, precision=prec, preferred_element_type=_F32)
            acc_s[1] += jax.lax.dot_general(dpre, hi, _TN, precision=prec, preferred_element_type=_F32)

        @pl.when(active & (s == steps - 1))
        def _store():
            store_rows(dx_ref, acc_s[...], offsets, gids, tiles, w, tm, axis=1)

    w1_b, w1_s, b1_spec, w2_b, w2_s = _specs(cfg, hdim, idim, up_first=nh, down_first=0)
    halves = pl.BlockSpec((2, tm, half_h), lambda w, s, o, g, t, a: (0, t[w], 0))
    dy_spec = pl.BlockSpec((th, tm), lambda w, s, o, g, t, a: (_step(w, s, a, 0, nh), t[w]))
    in_specs = [halves, dy_spec, w1_b, w1_s, b1_spec, w2_b, w2_s]
    out_shape = jax.ShapeDtypeStruct((2, m, half_h), dtype)
    grid = (num_items, steps)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=grid, in_specs=in_specs, out_specs=halves,
            scratch_shapes=[*_decoded_scratch(cfg, hdim, idim, dtype), pltpu.VMEM((2, idim // 2, tm), _F32),
                            _chunk_buffer(tm, 2 * ti), _chunk_buffer(tm, 2 * ti),
                            pltpu.VMEM((2, tm, half_h), _F32)]),
        compiler_params=_params(cfg),
        name="moe_mxfp4_dx",
        cost_estimate=cost_estimate(grid, in_specs, (x_halves, dy_t, w1b, w1s, b1, w2b, w2s), halves, out_shape,
                                    flops=active_item_flops(assumed, tm, hdim, idim, 5),
                                    transcendentals=active_items(assumed) * tm * idim, prefetch=assumed),
        interpret=cfg.mode.pallas_interpret(),
    )(*meta, x_halves, dy_t, w1b, w1s, b1, w2b, w2s)


def _split_columns(x):
    """[M, H] -> [2, M, H/2]: the even columns, then the odd ones."""
    m, hdim = x.shape
    return jnp.moveaxis(x.reshape(m, hdim // 2, 2), 2, 0)


def _join_columns(halves):
    """[2, M, H/2] -> [M, H], inverse of _split_columns."""
    _, m, half = halves.shape
    return jnp.moveaxis(halves, 0, 2).reshape(m, 2 * half)


def bias_operand(bias):
    """An expert bias [E, N] as the kernels take it: [E, N, 1], a column per expert, added along
    the transposed tiles' rows. (A decode loop makes it once before the loop: jax_bridge/decoding.py.)"""
    return bias.reshape(bias.shape[0], bias.shape[-1], 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _mx_core(x, group_sizes, w1b, w1s, b1, w2b, w2s, b2, cfg: _MxConfig):
    meta = group_metadata(group_sizes, x.shape[0], cfg.tm)
    return _mx_forward(meta, _split_columns(x), w1b, w1s, b1, w2b, w2s, b2, cfg).T


def _mx_core_fwd(x, group_sizes, w1b, w1s, b1, w2b, w2s, b2, cfg):
    return _mx_core(x, group_sizes, w1b, w1s, b1, w2b, w2s, b2, cfg), (x, group_sizes, w1b, w1s, b1, w2b, w2s, b2)


def _mx_core_bwd(cfg, res, dy):
    x, group_sizes, w1b, w1s, b1, w2b, w2s, b2 = res
    meta = group_metadata(group_sizes, x.shape[0], cfg.tm)
    dx = _mx_dx(meta, _split_columns(x), dy.astype(x.dtype).T, w1b, w1s, b1, w2b, w2s, cfg)
    # The base is frozen: weights and biases take no cotangent (the wrapper stops their gradients).
    return _join_columns(dx), None, None, None, None, None, None, None


_mx_core.defvjp(_mx_core_fwd, _mx_core_bwd)


DEFAULT_MXFP4_TILES = {
    # (block_m, block_i, block_h): rows per tile, units of I per up-projection step, rows of H per
    # down-projection step. Each step decodes a [2 block_i, H/2] or [block_h, I/2] byte tile into
    # int32 temporaries in VMEM, which bound the tiles: at gpt-oss-20b's shapes (H = I = 2880: 96 and
    # 192) the forward needs 29.6 MiB of scoped VMEM and dx 30.3 (the TPU compiler's verdict). Untuned.
    "tpu": (256, 128, 256),
    "cpu": (128, 128, 256),
}
_MXFP4_VMEM_LIMIT = 48 * 2**20      # above the 30 MiB measured, below v7x's 64 MiB per core


def mxfp4_tiles(m: int, hdim: int, idim: int, platform: str = "tpu", block_m: int | None = None,
                block_i: int | None = None, block_h: int | None = None) -> dict:
    """The tiles moe_mxfp4_pallas runs with. TPU rules: rows sit on lanes of the transposed tiles
    and Mosaic's strided loads take exactly 128 lanes, so block_m is a multiple of 128 (a tile may
    reach past M: those rows belong to no expert); block_i divides I and is a multiple of 16
    (2 block_i byte rows: uint8 sublane tiles of 32); block_h divides H and is a multiple of 32;
    else the whole dimension (always legal). On CPU the row tile is at most 128 or whole chunks."""
    default_m, default_i, default_h = DEFAULT_MXFP4_TILES["tpu" if platform == "tpu" else "cpu"]
    want_m = block_m or default_m
    if platform == "tpu":
        tm = round_up(min(want_m, m), 128)
    else:
        tm = min(round_up(want_m, 8), round_up(m, 8))
        tm = tm if tm <= 128 else round_up(tm, 128)       # whole 128-lane chunks (_chunks)
    ti = fit_tile(idim, block_i or default_i, 16)
    th = fit_tile(hdim, block_h or default_h, 32)
    return {"block_m": tm, "block_i": ti, "block_h": th}


def moe_mxfp4_pallas(x, group_sizes, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                     down_bias, *, alpha: float = 1.702, limit: float = 7.0, up_shift: float = 1.0, platform: str,
                     block_m: int | None = None, block_i: int | None = None, block_h: int | None = None,
                     vmem_limit_bytes: int | None = None, interpret: str | None = None):
    """Fused Pallas expert MLP reading MXFP4 weights (the released orientation, see the module
    docstring): per (row tile, expert), the up projection, clamped SwiGLU and down projection in
    one kernel, each weight tile decoded to x's dtype in VMEM; backward (custom_vjp) gives dx
    only, from one more kernel. Float32 x runs its matmuls at HIGHEST precision on the exact
    decoded values; all matmuls accumulate in float32. platform / interpret as
    moe_experts_pallas; tiles: mxfp4_tiles."""
    mode = kernel_mode(platform, interpret, who="moe_mxfp4_pallas", families=("tpu",), hint=GPU_HINT)
    num_experts, hdim, idim = check_mxfp4_experts(x, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks,
                                                  down_scales, down_bias)
    m = x.shape[0]
    if m == 0:
        return jnp.zeros_like(x)
    tiles = mxfp4_tiles(m, hdim, idim, platform, block_m, block_i, block_h)
    vmem = vmem_limit_bytes
    if platform == "tpu" and vmem is None:
        vmem = _MXFP4_VMEM_LIMIT
    cfg = _MxConfig(tiles["block_m"], tiles["block_i"], tiles["block_h"], float(alpha), float(limit), float(up_shift),
                    mode, vmem)
    b1, b2 = (bias_operand(jax.lax.stop_gradient(b)) for b in (gate_up_bias, down_bias))
    return _mx_core(x, group_sizes.astype(jnp.int32), gate_up_blocks, gate_up_scales, b1, down_blocks, down_scales,
                    b2, cfg)
