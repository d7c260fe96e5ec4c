"""Linear cross-entropy: loss of `hidden @ weight.T` against labels without handing back logits.

hidden [N, H], weight [V, H], labels [N] (ignore_index marks tokens without a target).
Returns (nll [N], lse [N]) in float32, both 0 at ignored tokens; the z-loss is coef * lse**2.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.cost import cost_estimate
from pallas_kernels.lanes import LANES, across_lanes, lanes_to_row
from pallas_kernels.platform import KernelMode, check_platform, dot_precision, kernel_mode


def linear_cross_entropy_reference(hidden, weight, labels, *, ignore_index: int = -100):
    """Plain JAX: materializes [N, V] logits; the oracle and the `xla` implementation.
    Logits in float32 from the inputs' own dtype at its dot precision (bf16 products are exact in
    float32; float32 runs at HIGHEST); the target logit by a one-hot select (its transpose is a
    select too, where a gather's would be a scatter, slow to compile for TPU)."""
    cdt = jnp.promote_types(hidden.dtype, weight.dtype)
    logits = jnp.einsum("nh,vh->nv", hidden.astype(cdt), weight.astype(cdt), precision=dot_precision(cdt),
                        preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    valid = labels != ignore_index
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    target = jnp.sum(jnp.where(vocab == labels[:, None], logits, 0.0), axis=-1)
    return jnp.where(valid, lse - target, 0.0), jnp.where(valid, lse, 0.0)


# The float32 logits one chunk of the `xla` implementation may form (1 GiB: o200k's vocabulary at
# ~1,300 tokens; every shape of the CPU suite is one chunk).
XLA_CHUNK_BYTES = 1 << 30


def linear_cross_entropy_xla(hidden, weight, labels, *, ignore_index: int = -100, chunk_bytes: int = XLA_CHUNK_BYTES):
    """The `xla` implementation: the reference over chunks of tokens whose float32 logits stay
    within `chunk_bytes`, each chunk formed again in the backward (jax.checkpoint), so neither
    pass holds all [N, V] logits (validation of a 201k vocabulary at 16 x 2048 tokens needed 25.5
    GB of them on a 16 GB v5e). Per token the same arithmetic as the reference; one chunk is the
    reference itself."""
    n, v = hidden.shape[0], weight.shape[0]
    rows = max(8, chunk_bytes // (4 * v) // 8 * 8)
    if n <= rows:
        return linear_cross_entropy_reference(hidden, weight, labels, ignore_index=ignore_index)
    chunks = -(-n // rows)
    pad = chunks * rows - n
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(chunks, rows, hidden.shape[1])
    labels = jnp.pad(labels, (0, pad), constant_values=ignore_index).reshape(chunks, rows)
    chunk = jax.checkpoint(lambda h, y: linear_cross_entropy_reference(h, weight, y, ignore_index=ignore_index))
    nll, lse = jax.lax.map(lambda args: chunk(*args), (hidden, labels))
    return nll.reshape(-1)[:n], lse.reshape(-1)[:n]


# =============================================================================================
# Pallas kernels
#
# Math, per token row r with valid label y (ignored rows give 0 and get no gradient):
#   lse_r = log sum_c exp(z_rc),  nll_r = lse_r - z_ry,  z = hidden @ weight.T
#   dz_rc = (g_nll_r + g_lse_r) * softmax_rc - g_nll_r * [c == y]
# z is only ever held one (token tile x vocab tile) at a time: the forward keeps an online
# log-sum-exp per token, the backward recomputes each tile from the saved lse.
# TPU, when differentiated: dh_r = sum_c dz_rc W_c = (g_nll_r + g_lse_r) * E_r - g_nll_r * W_y,
# where E_r = sum_c softmax_rc W_c does not depend on the cotangents. The forward accumulates E
# beside the log-sum-exp (online, rescaled as flash attention's output: softmax(h W^T) W is
# attention with K = V = W), so each logits tile is formed twice in all (forward, dW) where a
# separate dh kernel formed it three times: 8 NVH of FLOPs instead of 10. E stays float32: for a
# confident token dh ~ (1 - p_y) W_y is a small difference of E and W_y. (Its bf16 products lose
# nothing there: the unnormalized exp(z - m) of the maximal logit is exactly 1.)
# =============================================================================================
_NT = (((1,), (1,)), ((), ()))  # a @ b.T: the MXU / tensor-core friendly "q @ k.T" form
_TN = (((0,), (0,)), ((), ()))  # a.T @ b (GPU only; Triton transposes in registers)
_MiB = 1 << 20
_TPU_VMEM_CAP = 64 * _MiB       # smallest per-core VMEM among current TPUs (v7x); v5e/v6e: 128
_TPU_VMEM_TARGET = 48 * _MiB    # what default tiles aim to stay under, leaving Mosaic headroom
_DEFAULT_COMPUTE = 256          # rows of a logits tile computed at once (see the TPU kernels)
def _tpu_vmem_estimate(bn: int, bv: int, h: int, itemsize: int, compute: int = 256) -> int:
    """Bytes of VMEM the largest of the TPU kernels needs (double-buffered tiles, f32
    accumulators, ~4 live f32 copies of one compute chunk of the logits tile). The forward that
    accumulates E (its [bn, H] float32 output block, double-buffered, and four [bn, 128] per-token
    columns) is the largest."""
    tiles = 2 * (bn + bv) * h * itemsize
    logits = 4 * min(compute, bn) * bv * 4
    expectation = 2 * bn * h * 4 + 4 * bn * LANES * 4
    dw = bv * h * 4 + 2 * bv * h * itemsize
    return tiles + logits + max(expectation, dw) + 64 * 1024


def default_block_sizes(n: int, h: int, v: int, platform: str, dtype=jnp.bfloat16) -> tuple[int, int]:
    """(block_n, block_v) for `platform`.

    TPU: vocab tiles of 512 (a multiple of the 256-wide v6e MXU; ~0.35 us of per-step overhead
    wants big steps) and the largest token tile in (1024, 512, 256, 128) whose kernels fit
    `_TPU_VMEM_TARGET`: every vocab tile is streamed once per token tile, so big token tiles
    keep the weight traffic below the matmul time (N=16384, H=2048, V=201088, bf16: 16 passes
    over the 0.8 GB weight, ~8 ms of HBM time against ~15 ms of MXU time on v6e).
    CPU (interpreted): the same, but preferring tiles that divide N and V (multiples of 128), since
    the interpreters pad (copy) an input whose last tile is partial; a real TPU does not.
    GPU (Triton): 64 tokens x 128 vocab (powers of two; the hidden dim is looped in 64-chunks).
    """
    if check_platform(platform, "linear_cross_entropy_pallas") == "gpu":
        return 64, 128
    itemsize = jnp.dtype(dtype).itemsize
    block_v = 512
    for block_n in (1024, 512, 256, 128):
        if _tpu_vmem_estimate(block_n, block_v, h, itemsize) <= _TPU_VMEM_TARGET:
            break
    else:
        block_v = 256  # very wide hidden dims: shrink both
    if platform != "tpu":
        block_n, block_v = _dividing_tile(n, block_n), _dividing_tile(v, block_v)
    return min(block_n, n), min(block_v, v)


def _dividing_tile(size: int, tile: int) -> int:
    """The largest multiple of 128 <= tile that divides size (or size itself if it fits)."""
    if size <= tile:
        return size
    for t in range(tile - tile % 128, 0, -128):
        if size % t == 0:
            return t
    return tile


def _check_tpu_blocks(n: int, v: int, bn: int, bv: int) -> None:
    # Token vectors travel as lane-dense [1, N] rows and tokens sit on lanes in two kernels, so
    # token tiles are multiples of 128 (or all of N); vocab tiles sit on sublanes and lanes.
    if not (bn == n or bn % 128 == 0):
        raise ValueError(f"TPU: block_n={bn} must be a multiple of 128 or equal N={n}")
    if not (bv == v or bv % 128 == 0):
        raise ValueError(f"TPU: block_v={bv} must be a multiple of 128 or equal V={v}")


# ---- TPU (Mosaic) kernels ---------------------------------------------------------------------
# Tokens live on lanes ([1, N] row vectors, logits tile transposed to [block_v, block_n]) in the
# forward and dW kernels, so per-token statistics need no relayout; the forward that accumulates
# E uses the natural [block_n, block_v] orientation (E += p @ W is an NN product) and keeps its
# per-token statistics as lane-replicated columns (as attention does). Matmuls are only the NT
# and NN forms.
# Each grid step works through its logits tile `block_compute` rows at a time (vocab rows in
# the forward and dW kernels, token rows in the E forward) in a loop: the MXU sees the same matmuls, but
# the vector code Mosaic emits (and compiles) is for a [block_compute, tile] slab, not the whole
# tile, which cut compile time ~4x at Lyra Small (splash's block_kv_compute plays this role).

def _chunks(size: int, chunk: int) -> tuple[int, int]:
    """(rows per chunk, chunks): `size` rows `chunk` at a time; one chunk if it does not divide."""
    if chunk >= size or size % chunk:
        return size, 1
    return chunk, size // chunk


def _masked_on_last(run, index, count, *, overhangs: bool) -> None:
    """run(masked) for this grid step: the masked variant on the last tile only, and only when
    the tiles overhang the array (static), so full tiles pay for no select."""
    if overhangs:
        pl.when(index == count - 1)(lambda: run(True))
        pl.when(index != count - 1)(lambda: run(False))
    else:
        run(False)


def _tpu_fwd_kernel(lab_ref, h_ref, w_ref, nll_ref, lse_ref, m_sc, l_sc, t_sc, *,
                    v, bv, cv, ignore_index, cdt, precision):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        t_sc[...] = jnp.zeros(t_sc.shape, jnp.float32)

    lab = lab_ref[...]                                                       # [1, bn]

    def chunk(c, carry):
        m_prev, l_prev, t_prev = carry
        r0 = pl.multiple_of(c * cv, cv)
        zt = lax.dot_general(w_ref[pl.ds(r0, cv), :].astype(cdt), h_ref[...].astype(cdt), _NT,
                             preferred_element_type=jnp.float32, precision=precision)  # [cv, bn]
        vid = j * bv + r0 + lax.broadcasted_iota(jnp.int32, zt.shape, 0)
        if v % bv:  # the last vocab tile runs past V: those rows must not count. A chunk that is
            zt = jnp.where(vid < v, zt, -jnp.inf)   # all padding leaves m finite (chunk 0 never is)
        t_next = t_prev + jnp.sum(jnp.where(vid == lab, zt, 0.0), axis=0, keepdims=True)
        m_next = jnp.maximum(m_prev, jnp.max(zt, axis=0, keepdims=True))
        l_next = l_prev * jnp.exp(m_prev - m_next) + jnp.sum(jnp.exp(zt - m_next), axis=0, keepdims=True)
        return m_next, l_next, t_next

    m, l, t = lax.fori_loop(0, bv // cv, chunk, (m_sc[...], l_sc[...], t_sc[...]))
    m_sc[...], l_sc[...], t_sc[...] = m, l, t

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        lse = m_sc[...] + jnp.log(l_sc[...])
        valid = lab != ignore_index
        nll_ref[...] = jnp.where(valid, lse - t_sc[...], 0.0)
        lse_ref[...] = jnp.where(valid, lse, 0.0)


def _tpu_fwd_expectation_kernel(h_ref, w_ref, lse_ref, e_ref, m_sc, l_sc, *, v, bv, cn, cdt, precision):
    """The forward's lse of every token, and E = softmax(z) @ W per token (e_ref: [bn, H] float32,
    the accumulator itself: its block stays in VMEM across the vocab axis). Natural [tokens, vocab]
    orientation, per-token running max / sum lane-replicated [bn, 128]. The target logit is not
    picked here (_lce_fwd forms it from W_y, which dh needs anyway): per logit that was a
    compare, a select and a third reduction across lanes beside the max and the sum, vector work
    in a kernel that ran 13% over its MXU roofline at small-o200k's H = 512 on a v5e."""
    j = pl.program_id(1)
    nj = pl.num_programs(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        e_ref[...] = jnp.zeros(e_ref.shape, jnp.float32)

    def run(masked: bool):
        def chunk(c, carry):
            rows = pl.ds(pl.multiple_of(c * cn, cn), cn)
            w = w_ref[...].astype(cdt)
            if masked:   # the weight tile's rows past V may be garbage (NaN): zero them
                wid = j * bv + lax.broadcasted_iota(jnp.int32, w.shape, 0)
                w = jnp.where(wid < v, w, jnp.zeros_like(w))
            z = lax.dot_general(h_ref[rows, :].astype(cdt), w, _NT,
                                preferred_element_type=jnp.float32, precision=precision)  # [cn, bv]
            if masked:   # vocabulary tile 0 always holds real columns, so m stays finite
                vid = j * bv + lax.broadcasted_iota(jnp.int32, z.shape, 1)
                z = jnp.where(vid < v, z, -jnp.inf)
            m_prev = m_sc[rows, :]
            m_next = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(z - across_lanes(m_next, z.shape[1]))
            l_sc[rows, :] = alpha * l_sc[rows, :] + jnp.sum(p, axis=1, keepdims=True)
            e_ref[rows, :] = e_ref[rows, :] * across_lanes(alpha, e_ref.shape[1]) + lax.dot_general(
                p.astype(cdt), w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)
            m_sc[rows, :] = m_next
            return carry

        lax.fori_loop(0, e_ref.shape[0] // cn, chunk, 0)

    _masked_on_last(run, j, nj, overhangs=bool(v % bv))   # only the last vocab tile overhangs V

    @pl.when(j == nj - 1)
    def _finish():
        def chunk(c, carry):
            rows = pl.ds(pl.multiple_of(c * cn, cn), cn)
            e_ref[rows, :] = e_ref[rows, :] / across_lanes(l_sc[rows, :], e_ref.shape[1])
            return carry

        lax.fori_loop(0, e_ref.shape[0] // cn, chunk, 0)
        lse_ref[...] = lanes_to_row(m_sc[...] + jnp.log(l_sc[...]))


def _tpu_dw_kernel(lab_ref, lse_ref, ca_ref, cb_ref, h_ref, w_ref, dw_ref, acc_sc, *,
                   n, bn, bv, cv, cdt, precision):
    jv, i = pl.program_id(0), pl.program_id(1)
    ni = pl.num_programs(1)

    @pl.when(i == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def run(masked: bool):
        def chunk(c, carry):
            rows = pl.ds(pl.multiple_of(c * cv, cv), cv)
            h = h_ref[...].astype(cdt)
            if masked:   # the last token tile runs past N: its padding (maybe NaN) must not reach dW
                hid = i * bn + lax.broadcasted_iota(jnp.int32, h.shape, 0)
                h = jnp.where(hid < n, h, jnp.zeros_like(h))
            zt = lax.dot_general(w_ref[rows, :].astype(cdt), h, _NT,
                                 preferred_element_type=jnp.float32, precision=precision)  # [cv, bn]
            vid = jv * bv + c * cv + lax.broadcasted_iota(jnp.int32, zt.shape, 0)
            dt = ca_ref[...] * jnp.exp(zt - lse_ref[...]) - jnp.where(vid == lab_ref[...], cb_ref[...], 0.0)
            if masked:
                tok = i * bn + lax.broadcasted_iota(jnp.int32, zt.shape, 1)
                dt = jnp.where(tok < n, dt, 0.0)
            acc_sc[rows, :] += lax.dot_general(dt.astype(cdt), h, (((1,), (0,)), ((), ())),
                                               preferred_element_type=jnp.float32, precision=precision)
            return carry

        lax.fori_loop(0, bv // cv, chunk, 0)

    _masked_on_last(run, i, ni, overhangs=bool(n % bn))   # only the last token tile overhangs N

    @pl.when(i == ni - 1)
    def _finish():
        dw_ref[...] = acc_sc[...].astype(dw_ref.dtype)


def _tpu_compiler_params(semantics, bn, bv, h, itemsize, compute, vmem_limit):
    est = _tpu_vmem_estimate(bn, bv, h, itemsize, compute)
    limit = vmem_limit or min(max(int(est * 1.25), 32 * _MiB), _TPU_VMEM_CAP)
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)


class _Tiles(NamedTuple):
    bn: int                    # tokens per tile
    bv: int                    # vocabulary rows per tile
    compute: int               # rows of a logits tile computed at once (TPU)
    vmem_limit: int | None     # TPU scoped VMEM limit; None: from _tpu_vmem_estimate


def _tpu_forward(hidden, weight, lab_row, *, ignore_index, tiles: _Tiles, mode: KernelMode,
                 expectation: bool = False):
    """(nll [1, N], lse [1, N]); with `expectation` instead (lse [1, N] of every token, ignored
    ones too, E [N, H] float32): the forward that serves dh. Token tiles in parallel, vocab tiles
    in order."""
    n, h = hidden.shape
    v = weight.shape[0]
    bn, bv = tiles.bn, tiles.bv
    cdt = jnp.promote_types(hidden.dtype, weight.dtype)
    row = pl.BlockSpec((1, bn), lambda i, j: (0, i))
    grid = (pl.cdiv(n, bn), pl.cdiv(v, bv))
    matrices = [pl.BlockSpec((bn, h), lambda i, j: (i, 0)), pl.BlockSpec((bv, h), lambda i, j: (j, 0))]
    common = dict(v=v, bv=bv, cdt=cdt, precision=dot_precision(cdt))
    if expectation:
        kernel = functools.partial(_tpu_fwd_expectation_kernel, cn=_chunks(bn, tiles.compute)[0], **common)
        inputs, in_specs = (hidden, weight), matrices
        out_specs = [row, pl.BlockSpec((bn, h), lambda i, j: (i, 0))]
        out_shape = [jax.ShapeDtypeStruct((1, n), jnp.float32), jax.ShapeDtypeStruct((n, h), jnp.float32)]
        scratch, name, flops = [pltpu.VMEM((bn, LANES), jnp.float32)] * 2, "cross_entropy_fwd_e", 4 * n * v * h
    else:
        kernel = functools.partial(_tpu_fwd_kernel, cv=_chunks(bv, tiles.compute)[0], ignore_index=ignore_index,
                                   **common)
        inputs, in_specs = (lab_row, hidden, weight), [row, *matrices]
        out_specs, out_shape = [row, row], [jax.ShapeDtypeStruct((1, n), jnp.float32)] * 2
        scratch, name, flops = [pltpu.VMEM((1, bn), jnp.float32)] * 3, "cross_entropy_fwd", 2 * n * v * h
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch,
        compiler_params=_tpu_compiler_params(("parallel", "arbitrary"), bn, bv, h, jnp.dtype(cdt).itemsize,
                                             tiles.compute, tiles.vmem_limit),
        name=name,
        cost_estimate=cost_estimate(grid, in_specs, inputs, out_specs, out_shape, flops=flops, transcendentals=n * v),
        interpret=mode.pallas_interpret(),
    )(*inputs)


def _tpu_dw(hidden, weight, lab_row, lse_row, ca_row, cb_row, *, tiles: _Tiles, mode: KernelMode):
    """dW: vocab tiles in parallel, token tiles accumulated in VMEM."""
    n, h = hidden.shape
    v = weight.shape[0]
    bn, bv = tiles.bn, tiles.bv
    cdt = jnp.promote_types(hidden.dtype, weight.dtype)
    vectors = (lab_row, lse_row, ca_row, cb_row)
    row_t = pl.BlockSpec((1, bn), lambda jv, i: (0, i))
    grid = (pl.cdiv(v, bv), pl.cdiv(n, bn))
    in_specs = [row_t] * 4 + [pl.BlockSpec((bn, h), lambda jv, i: (i, 0)), pl.BlockSpec((bv, h), lambda jv, i: (jv, 0))]
    out_spec, out_shape = pl.BlockSpec((bv, h), lambda jv, i: (jv, 0)), jax.ShapeDtypeStruct((v, h), weight.dtype)
    return pl.pallas_call(
        functools.partial(_tpu_dw_kernel, n=n, bn=bn, bv=bv, cv=_chunks(bv, tiles.compute)[0], cdt=cdt,
                          precision=dot_precision(cdt)),
        grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((bv, h), jnp.float32)],
        compiler_params=_tpu_compiler_params(("parallel", "arbitrary"), bn, bv, h, jnp.dtype(cdt).itemsize,
                                             tiles.compute, tiles.vmem_limit),
        name="cross_entropy_dw",
        cost_estimate=cost_estimate(grid, in_specs, (*vectors, hidden, weight), out_spec, out_shape,
                                    flops=4 * n * v * h, transcendentals=n * v),
        interpret=mode.pallas_interpret(),
    )(*vectors, hidden, weight)


# ---- GPU (Triton) kernels ---------------------------------------------------------------------
# Triton has no scratch memory and no sequential grid axes, and a [block_n, H] accumulator does
# not fit in registers, so: the forward loops over vocab tiles inside one program per token
# tile (hidden dim looped in chunks of block_h); the backward runs one program per
# (token tile, vocab tile), recomputes that logits tile and atomically adds its contributions
# to f32 dh / dW buffers (the Cut-Cross-Entropy scheme). All loads and stores are masked, so
# no dimension has to be a multiple of its tile.

def _gpu_logits(h_ref, w_ref, r0, c0, rmask, cmask, *, h, bn, bv, bk, cdt, precision):
    """[bn, bv] f32 logits of rows r0.., vocab c0.., looping over the hidden dim."""
    def body(kk, acc):
        k0 = kk * bk
        kmask = (k0 + jnp.arange(bk)) < h
        x = pltriton.load(h_ref.at[pl.ds(r0, bn), pl.ds(k0, bk)],
                          mask=rmask[:, None] & kmask[None, :], other=0)
        y = pltriton.load(w_ref.at[pl.ds(c0, bv), pl.ds(k0, bk)],
                          mask=cmask[:, None] & kmask[None, :], other=0)
        return acc + lax.dot_general(x.astype(cdt), y.astype(cdt), _NT,
                                     preferred_element_type=jnp.float32, precision=precision)
    return lax.fori_loop(0, pl.cdiv(h, bk), body, jnp.zeros((bn, bv), jnp.float32))


def _gpu_fwd_kernel(h_ref, w_ref, lab_ref, nll_ref, lse_ref, *,
                    n, h, v, bn, bv, bk, ignore_index, cdt, precision):
    r0 = pl.program_id(0) * bn
    rmask = (r0 + jnp.arange(bn)) < n
    lab = pltriton.load(lab_ref.at[pl.ds(r0, bn)], mask=rmask, other=ignore_index)

    def body(j, carry):
        m, l, t = carry
        c0 = j * bv
        vid = c0 + jnp.arange(bv)
        cmask = vid < v
        z = _gpu_logits(h_ref, w_ref, r0, c0, rmask, cmask,
                        h=h, bn=bn, bv=bv, bk=bk, cdt=cdt, precision=precision)
        z = jnp.where(cmask[None, :], z, -jnp.inf)
        t = t + jnp.sum(jnp.where(vid[None, :] == lab[:, None], z, 0.0), axis=1)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        return m_new, l, t

    init = (jnp.full((bn,), -jnp.inf, jnp.float32), jnp.zeros((bn,), jnp.float32),
            jnp.zeros((bn,), jnp.float32))
    m, l, t = lax.fori_loop(0, pl.cdiv(v, bv), body, init)
    lse = m + jnp.log(l)
    valid = lab != ignore_index
    pltriton.store(nll_ref.at[pl.ds(r0, bn)], jnp.where(valid, lse - t, 0.0), mask=rmask)
    pltriton.store(lse_ref.at[pl.ds(r0, bn)], jnp.where(valid, lse, 0.0), mask=rmask)


def _accumulate(ref, idx, val, mask, interpret):
    if interpret:  # the interpreter runs one program at a time and has no masked atomics
        view = ref.at[idx]
        pltriton.store(view, pltriton.load(view, mask=mask, other=0.0) + val, mask=mask)
    else:
        pltriton.atomic_add(ref, idx, val, mask=mask)


def _gpu_bwd_kernel(h_ref, w_ref, lab_ref, lse_ref, ca_ref, cb_ref, dh_in, dw_in,
                    dh_ref, dw_ref, *, n, h, v, bn, bv, bk, cdt, precision, interpret):
    del dh_in, dw_in  # aliased to dh_ref / dw_ref (zero-initialised accumulators)
    r0, c0 = pl.program_id(0) * bn, pl.program_id(1) * bv
    rmask = (r0 + jnp.arange(bn)) < n
    vid = c0 + jnp.arange(bv)
    cmask = vid < v
    rows = pl.ds(r0, bn)
    lab = pltriton.load(lab_ref.at[rows], mask=rmask, other=-1)
    lse = pltriton.load(lse_ref.at[rows], mask=rmask, other=jnp.inf)
    ca = pltriton.load(ca_ref.at[rows], mask=rmask, other=0.0)
    cb = pltriton.load(cb_ref.at[rows], mask=rmask, other=0.0)
    z = _gpu_logits(h_ref, w_ref, r0, c0, rmask, cmask,
                    h=h, bn=bn, bv=bv, bk=bk, cdt=cdt, precision=precision)
    d = ca[:, None] * jnp.exp(z - lse[:, None]) - jnp.where(vid[None, :] == lab[:, None],
                                                            cb[:, None], 0.0)
    d = jnp.where(rmask[:, None] & cmask[None, :], d, 0.0).astype(cdt)

    @pl.loop(0, pl.cdiv(h, bk))
    def _(kk):
        k0 = kk * bk
        kmask = (k0 + jnp.arange(bk)) < h
        hmask = rmask[:, None] & kmask[None, :]
        wmask = cmask[:, None] & kmask[None, :]
        x = pltriton.load(h_ref.at[rows, pl.ds(k0, bk)], mask=hmask, other=0).astype(cdt)
        y = pltriton.load(w_ref.at[pl.ds(c0, bv), pl.ds(k0, bk)], mask=wmask, other=0).astype(cdt)
        dh = lax.dot_general(d, y, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32, precision=precision)
        dw = lax.dot_general(d, x, _TN, preferred_element_type=jnp.float32, precision=precision)
        _accumulate(dh_ref, (rows, pl.ds(k0, bk)), dh, hmask, interpret)
        _accumulate(dw_ref, (pl.ds(c0, bv), pl.ds(k0, bk)), dw, wmask, interpret)


def _gpu_block_h(h: int) -> int:
    return max(16, min(64, pl.next_power_of_2(h)))


def _check_gpu_blocks(bn: int, bv: int) -> None:
    for name, b in (("block_n", bn), ("block_v", bv)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"GPU: {name}={b} must be a power of two >= 16 (Triton tiles)")


def _gpu_params(mode: KernelMode, num_warps):
    if not mode.compiled:
        return dict(interpret=mode.pallas_interpret())
    return dict(compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2))


def _gpu_forward(hidden, weight, labels, *, ignore_index, bn, bv, mode: KernelMode):
    n, h = hidden.shape
    v = weight.shape[0]
    cdt = jnp.promote_types(hidden.dtype, weight.dtype)
    kernel = functools.partial(_gpu_fwd_kernel, n=n, h=h, v=v, bn=bn, bv=bv, bk=_gpu_block_h(h),
                               ignore_index=ignore_index, cdt=cdt, precision=dot_precision(cdt))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, bn),),
        out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 2,
        **_gpu_params(mode, num_warps=4),
    )(hidden, weight, labels)


def _gpu_backward(hidden, weight, labels, lse, ca, cb, *, bn, bv, mode: KernelMode):
    n, h = hidden.shape
    v = weight.shape[0]
    cdt = jnp.promote_types(hidden.dtype, weight.dtype)
    kernel = functools.partial(_gpu_bwd_kernel, n=n, h=h, v=v, bn=bn, bv=bv, bk=_gpu_block_h(h),
                               cdt=cdt, precision=dot_precision(cdt),
                               interpret=not mode.compiled)
    dh, dw = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, bn), pl.cdiv(v, bv)),
        out_shape=[jax.ShapeDtypeStruct((n, h), jnp.float32),
                   jax.ShapeDtypeStruct((v, h), jnp.float32)],
        input_output_aliases={6: 0, 7: 1},
        **_gpu_params(mode, num_warps=8),
    )(hidden, weight, labels, lse, ca, cb,
      jnp.zeros((n, h), jnp.float32), jnp.zeros((v, h), jnp.float32))
    return dh.astype(hidden.dtype), dw.astype(weight.dtype)


# =============================================================================================
# custom_vjp glue
# =============================================================================================
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _lce(hidden, weight, labels, ignore_index, tiles: _Tiles, mode: KernelMode):
    """Not differentiated: the forward alone (2 NVH)."""
    n = hidden.shape[0]
    if mode.family == "gpu":
        return tuple(_gpu_forward(hidden, weight, labels, ignore_index=ignore_index, bn=tiles.bn, bv=tiles.bv,
                                  mode=mode))
    nll, lse = _tpu_forward(hidden, weight, labels.reshape(1, n), ignore_index=ignore_index, tiles=tiles, mode=mode)
    return nll.reshape(n), lse.reshape(n)


def _lce_fwd(hidden, weight, labels, ignore_index, tiles: _Tiles, mode: KernelMode):
    """Differentiated: on TPU the forward also accumulates E for dh (see the math above), and the
    target logits z_ry = h_r . W_y come from a gather of the target rows W_y [N, H] (as dh's) and
    one fused [N, H] product, instead of a one-hot pick in every logit. W_y is gathered again in
    the backward rather than kept: on TPU the gather fuses into its consumer either way (the v5e
    compiler's peak memory for the loss is unchanged)."""
    n = hidden.shape[0]
    if mode.family == "gpu":
        nll, lse = _lce(hidden, weight, labels, ignore_index, tiles, mode)
        return (nll, lse), (hidden, weight, labels, lse, None)
    lse, expectation = _tpu_forward(hidden, weight, labels.reshape(1, n), ignore_index=ignore_index, tiles=tiles,
                                    mode=mode, expectation=True)
    valid = labels != ignore_index
    # In float32, as the kernels form logits: bf16 products are exact there; one fused pass.
    target = jnp.sum(hidden.astype(jnp.float32) * _target_rows(weight, labels, valid), axis=-1)
    lse = lse.reshape(n)
    nll, lse = jnp.where(valid, lse - target, 0.0), jnp.where(valid, lse, 0.0)
    return (nll, lse), (hidden, weight, labels, lse, expectation)


def _target_rows(weight, labels, valid):
    """W_y [N, H] in float32, each token's target row (row 0 for ignored tokens): gathered in the
    weight's dtype, widened by its consumer."""
    return jnp.take(weight, jnp.where(valid, labels, 0), axis=0).astype(jnp.float32)


def _lce_bwd(ignore_index, tiles, mode, res, g):
    hidden, weight, labels, lse, expectation = res   # expectation: E on TPU (see the math above), None on GPU
    g_nll, g_lse = (x.astype(jnp.float32) for x in g)
    valid = labels != ignore_index
    # Per-token coefficients of dz = ca * softmax - cb * onehot. Ignored tokens: ca = cb = 0 and
    # lse = +inf, so their softmax is exactly 0 (no inf * 0 from a zeroed lse).
    ca = jnp.where(valid, g_nll + g_lse, 0.0)
    cb = jnp.where(valid, g_nll, 0.0)
    lse_b = jnp.where(valid, lse, jnp.inf)
    if mode.family == "gpu":
        dh, dw = _gpu_backward(hidden, weight, labels, lse_b, ca, cb, bn=tiles.bn, bv=tiles.bv, mode=mode)
        return dh, dw, None
    dh = (ca[:, None] * expectation - cb[:, None] * _target_rows(weight, labels, valid)).astype(hidden.dtype)
    n = hidden.shape[0]
    dw = _tpu_dw(hidden, weight, *(x.reshape(1, n) for x in (labels, lse_b, ca, cb)), tiles=tiles, mode=mode)
    return dh, dw, None


_lce.defvjp(_lce_fwd, _lce_bwd)


def linear_cross_entropy_pallas(hidden, weight, labels, *, ignore_index: int = -100, platform: str,
                                block_n: int | None = None, block_v: int | None = None,
                                block_compute: int | None = None, vmem_limit_bytes: int | None = None,
                                interpret: str | None = None):
    """Pallas linear cross-entropy; same contract as `linear_cross_entropy_reference`.

    hidden [N, H], weight [V, H] (bf16 or f32; f32 accumulation), labels [N] int.
    Returns (nll [N] f32, lse [N] f32), 0 at tokens whose label is `ignore_index`.
    Differentiable in hidden and weight (custom_vjp); [N, V] logits never exist in memory.
    platform (pallas_kernels.platform): 'tpu' (Mosaic), 'gpu' (Triton), 'cpu' (the TPU kernels
    in the generic interpreter); interpret: None, 'generic' or 'tpu' (the TPU-simulating
    interpreter). block_n / block_v: token / vocab tile sizes; defaults from `default_block_sizes`.
    Labels must lie in [0, V) or equal ignore_index.
    """
    mode = kernel_mode(platform, interpret, who="linear_cross_entropy_pallas")
    n, h = hidden.shape
    v, h_w = weight.shape
    if h_w != h or labels.shape != (n,):
        raise ValueError(f"shapes: hidden {hidden.shape}, weight {weight.shape}, labels {labels.shape}")
    dn, dv = default_block_sizes(n, h, v, platform, jnp.promote_types(hidden.dtype, weight.dtype))
    bn, bv = block_n or dn, block_v or dv
    if mode.family == "gpu":
        _check_gpu_blocks(bn, bv)
    else:
        bn, bv = min(bn, n), min(bv, v)  # a tile as large as the array is always legal
        if platform == "tpu":
            _check_tpu_blocks(n, v, bn, bv)
    compute = block_compute or _DEFAULT_COMPUTE
    if compute % 8:
        raise ValueError(f"block_compute must be a multiple of 8; got {compute}")
    tiles = _Tiles(bn, bv, compute, vmem_limit_bytes)
    return _lce(hidden, weight, labels.astype(jnp.int32), int(ignore_index), tiles, mode)
