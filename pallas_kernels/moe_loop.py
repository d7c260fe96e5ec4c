"""Grouped expert MLP as a loop of plain 2-D GEMMs, expert by expert: the CPU training path.

Same signature and contract as `moe.moe_experts_reference` (rows sorted by expert, `group_sizes`
[E] summing to M, gate/up interleaved). Where `moe_experts_xla` gathers a copy of the expert's
weights for every (row tile, expert) work item and runs one batched matmul, this walks the
experts (an outer `fori_loop`) and, inside each, its group's rows in tiles of tm starting at the
group's first row (an inner loop with a dynamic trip count), so every matmul is a dense
[tm, H] x [H, 2I] or [tm, I] x [I, H] product against one expert's weights, read in place. The
last tile of a group runs past its end; the visit keeps only its own rows (a select), so the
extra work is under one tile per expert (about tm / 2 rows) rather than a straddled tile at both
ends of every group.

The backward pass is written out (custom_vjp): autodiff of the loops would keep every
iteration's tiles; here the forward keeps each visit's pre-activation [W, tm, 2I] (no GEMM
recomputed) and the backward accumulates each expert's weight gradients in float32 in the loop's
carry, so dW is never materialized per work item and summed afterwards.

Measured against the batched `xla` schedule in BENCHMARKS.md ("Log of attempts", issue 12): it
is faster on CPU, where XLA runs small batched matmuls well below its 2-D GEMM rate; on
accelerators the batched or Pallas paths are the ones to use.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.moe import _round_up, clamped_swiglu, clamped_swiglu_grad
from pallas_kernels.platform import dot_precision

_F32 = jnp.float32


def moe_experts_loop(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                     limit: float = 7.0, block_m: int | None = None):
    """y [M, H]: each sorted row through its own expert's clamped-SwiGLU MLP. `block_m`: rows per
    tile (default: about a quarter of an average group, 8..512, like `moe_experts_xla`)."""
    m = x.shape[0]
    num_groups = gate_up.shape[0]
    if m == 0:
        return jnp.zeros_like(x)
    tm = block_m or max(8, min(512, _round_up(max(m // (4 * num_groups), 1), 8)))
    tm = min(tm, _round_up(m, 8))
    return _looped(x, group_sizes.astype(jnp.int32), gate_up, gate_up_bias, down, down_bias,
                   float(alpha), float(limit), int(tm))


class _Schedule:
    """Which rows each expert visits: group e owns sorted rows starts[e]:ends[e], walked in
    count[e] tiles of tm rows from starts[e] (the last one may run into the next group or the
    padding); its visits are work items item0[e], item0[e] + 1, ..."""

    def __init__(self, group_sizes, tm: int):
        self.ends = jnp.cumsum(group_sizes)
        self.starts = self.ends - group_sizes
        self.count = (group_sizes + tm - 1) // tm
        self.item0 = jnp.cumsum(self.count) - self.count
        self.tm = tm

    def row0(self, e, j):
        return self.starts[e] + j * self.tm

    def rows_mine(self, e, j):
        """[tm, 1] bool: the rows of expert e's tile j that are its own."""
        return self.row0(e, j) + lax.broadcasted_iota(jnp.int32, (self.tm, 1), 0) < self.ends[e]


def num_items(m: int, num_groups: int, tm: int) -> int:
    """Tiles visited, at most: sum_e ceil(size_e / tm) <= (M + E (tm - 1)) / tm."""
    return (m + num_groups * (tm - 1)) // tm


def _tile(a, row0, tm):
    return lax.dynamic_slice_in_dim(a, row0, tm, axis=0)


def _put_tile(a, value, row0):
    return lax.dynamic_update_slice_in_dim(a, value.astype(a.dtype), row0, axis=0)


def _pad_rows(a, tm):
    """tm rows of zeros after the last: a tile starting at any row < M stays in bounds."""
    return jnp.pad(a, ((0, tm), (0, 0)))


def _forward(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, tm):
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    sched = _Schedule(group_sizes, tm)
    prec = dot_precision(x.dtype)
    xp = _pad_rows(x, tm)

    def expert(e, carry):
        w1, b1 = gate_up[e], gate_up_bias[e].astype(_F32)
        w2, b2 = down[e], down_bias[e].astype(_F32)

        def tile(j, carry):
            y, pre = carry
            row0 = sched.row0(e, j)
            gu = jnp.dot(_tile(xp, row0, tm), w1, precision=prec, preferred_element_type=_F32) + b1
            h = clamped_swiglu(gu, alpha=alpha, limit=limit).astype(x.dtype)
            out = jnp.dot(h, w2, precision=prec, preferred_element_type=_F32) + b2
            keep = jnp.where(sched.rows_mine(e, j), out, _tile(y, row0, tm).astype(_F32))
            pre = lax.dynamic_update_index_in_dim(pre, gu, sched.item0[e] + j, axis=0)
            return _put_tile(y, keep, row0), pre

        return lax.fori_loop(0, sched.count[e], tile, carry)

    init = (jnp.zeros_like(xp), jnp.zeros((num_items(m, num_groups, tm), tm, two_i), _F32))
    y, pre = lax.fori_loop(0, num_groups, expert, init)
    return y[:m], pre


def _backward(x, group_sizes, gate_up, gate_up_bias, down, down_bias, pre, dy, alpha, limit, tm):
    m, hdim = x.shape
    num_groups, _, two_i = gate_up.shape
    sched = _Schedule(group_sizes, tm)
    prec = dot_precision(x.dtype)
    xp, dyp = _pad_rows(x, tm), _pad_rows(dy.astype(x.dtype), tm)
    contract_rows = (((0,), (0,)), ((), ()))        # a^T b over the tile's rows

    def expert(e, carry):
        dx, dw1, db1, dw2, db2 = carry
        w1, w2 = gate_up[e], down[e]

        def tile(j, acc):
            dx, g1, gb1, g2, gb2 = acc
            mine, row0 = sched.rows_mine(e, j), sched.row0(e, j)
            rows = _tile(xp, row0, tm)
            dyt = jnp.where(mine, _tile(dyp, row0, tm), 0)
            gu = pre[sched.item0[e] + j]
            h = jnp.where(mine, clamped_swiglu(gu, alpha=alpha, limit=limit), 0).astype(x.dtype)
            dh = lax.dot_general(dyt, w2, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=_F32)
            dgu = jnp.where(mine, clamped_swiglu_grad(gu, dh, alpha=alpha, limit=limit), 0).astype(x.dtype)
            dxt = lax.dot_general(dgu, w1, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=_F32)
            dx = _put_tile(dx, jnp.where(mine, dxt, _tile(dx, row0, tm)), row0)
            g1 += lax.dot_general(rows, dgu, contract_rows, precision=prec, preferred_element_type=_F32)
            g2 += lax.dot_general(h, dyt, contract_rows, precision=prec, preferred_element_type=_F32)
            return dx, g1, gb1 + dgu.astype(_F32).sum(0), g2, gb2 + dyt.astype(_F32).sum(0)

        zeros = (jnp.zeros(w1.shape, _F32), jnp.zeros((two_i,), _F32), jnp.zeros(w2.shape, _F32),
                 jnp.zeros((hdim,), _F32))
        dx, g1, gb1, g2, gb2 = lax.fori_loop(0, sched.count[e], tile, (dx, *zeros))
        put = lambda total, part: lax.dynamic_update_index_in_dim(total, part, e, axis=0)
        return dx, put(dw1, g1), put(db1, gb1), put(dw2, g2), put(db2, gb2)

    init = (jnp.zeros(xp.shape, _F32), jnp.zeros(gate_up.shape, _F32), jnp.zeros(gate_up_bias.shape, _F32),
            jnp.zeros(down.shape, _F32), jnp.zeros(down_bias.shape, _F32))
    dx, dw1, db1, dw2, db2 = lax.fori_loop(0, num_groups, expert, init)
    return (dx[:m].astype(x.dtype), None, dw1.astype(gate_up.dtype), db1.astype(gate_up_bias.dtype),
            dw2.astype(down.dtype), db2.astype(down_bias.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _looped(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, tm):
    return _forward(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, tm)[0]


def _looped_fwd(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, tm):
    y, pre = _forward(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, tm)
    return y, (x, group_sizes, gate_up, gate_up_bias, down, down_bias, pre)


def _looped_bwd(alpha, limit, tm, residuals, dy):
    return _backward(*residuals, dy, alpha, limit, tm)


_looped.defvjp(_looped_fwd, _looped_bwd)
