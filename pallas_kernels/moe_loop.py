"""Grouped expert MLP as a loop of plain 2-D GEMMs, expert by expert: the CPU training path.

Same signature and contract as `moe.moe_experts_reference` (rows sorted by expert, `group_sizes`
[E] summing to M, gate/up interleaved). Where `moe_experts_xla` gathers a copy of the expert's
weights for every (row tile, expert) work item and runs one batched matmul, this walks the
experts (an outer `fori_loop`) and, inside each, its group's rows from the group's first row:
whole tiles of `block_m` rows first, then the remainder in tiles of `block_m_tail` rows (inner
loops with dynamic trip counts). Every matmul is a dense [t, H] x [H, 2I] or [t, I] x [I, H]
product against one expert's weights, read in place. Only the last tail tile can run past the
group's end (into the next group or the padding); that visit keeps its own rows only (a select),
so the extra work is under `block_m_tail` rows per expert.

The backward pass is written out (custom_vjp): autodiff of the loops would keep every
iteration's tiles; here the forward keeps the pre-activation of every row ([M, 2I], no GEMM
recomputed) and the backward accumulates each expert's weight gradients in float32 in the
loop's carry, so dW is never materialized per tile and summed afterwards.

Measured against the batched `xla` schedule in BENCHMARKS.md (the train step): faster on CPU, where
XLA runs small batched matmuls well below its 2-D GEMM rate; on accelerators the batched or
Pallas paths are the ones to use.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.moe import round_up, clamped_swiglu, clamped_swiglu_grad, default_block_m
from pallas_kernels.platform import dot_precision

_F32 = jnp.float32


def default_tiles(m: int, num_groups: int) -> tuple[int, int]:
    """(block_m, block_m_tail): whole tiles as `moe_experts_xla`'s (`default_block_m`), tails of
    a quarter of that (at least 8): 128 / 32 at 4,096 rows and 8 experts, faster than 64 / 16,
    256 / 32, 256 / 64 and 512 / 32 at `small` or `tiny` (BENCHMARKS.md, the train step)."""
    tm = default_block_m(m, num_groups)
    return tm, max(8, round_up(tm // 4, 8))


def moe_experts_loop(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                     limit: float = 7.0, up_shift: float = 1.0, block_m: int | None = None,
                     block_m_tail: int | None = None):
    """y [M, H]: each sorted row through its own expert's clamped-SwiGLU MLP. `block_m`: rows per
    whole tile, `block_m_tail`: rows per tile of a group's remainder (defaults: `default_tiles`)."""
    m = x.shape[0]
    if m == 0:
        return jnp.zeros_like(x)
    tm, ts = default_tiles(m, gate_up.shape[0])
    tm = min(block_m or tm, round_up(m, 8))
    ts = min(block_m_tail or ts, tm)
    return _looped(x, group_sizes.astype(jnp.int32), gate_up, gate_up_bias, down, down_bias,
                   float(alpha), float(limit), float(up_shift), int(tm), int(ts))


class _Schedule:
    """Group e owns sorted rows starts[e]:ends[e]: `full[e]` whole tiles of tm rows from
    starts[e], then `tail[e]` tiles of ts rows (the last may run past ends[e])."""

    def __init__(self, group_sizes, tm: int, ts: int):
        self.ends = jnp.cumsum(group_sizes)
        self.starts = self.ends - group_sizes
        self.full = group_sizes // tm
        self.tail = (group_sizes - self.full * tm + ts - 1) // ts
        self.tm, self.ts = tm, ts

    def full_row0(self, e, j):
        return self.starts[e] + j * self.tm

    def tail_row0(self, e, j):
        return self.starts[e] + self.full[e] * self.tm + j * self.ts

    def mine(self, e, row0, rows: int):
        """[rows, 1] bool: the rows of the tile at row0 that are expert e's."""
        return row0 + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < self.ends[e]

    def walk(self, e, visit, carry):
        """visit(row0, rows, mine or None, carry) over expert e's whole tiles, then its tail tiles."""
        carry = lax.fori_loop(0, self.full[e], lambda j, c: visit(self.full_row0(e, j), self.tm, None, c), carry)

        def tail(j, c):
            row0 = self.tail_row0(e, j)
            return visit(row0, self.ts, self.mine(e, row0, self.ts), c)

        return lax.fori_loop(0, self.tail[e], tail, carry)


def _tile(a, row0, rows):
    return lax.dynamic_slice_in_dim(a, row0, rows, axis=0)


def _put(a, value, row0, mine=None):
    """Write value's rows at row0; with `mine`, only those rows (the others keep a's)."""
    if mine is not None:
        value = jnp.where(mine, value, _tile(a, row0, value.shape[0]))
    return lax.dynamic_update_slice_in_dim(a, value.astype(a.dtype), row0, axis=0)


def _masked(value, mine):
    return value if mine is None else jnp.where(mine, value, 0)


def _pad_rows(a, rows):
    """`rows` rows of zeros after the last: a tile starting at any row < M stays in bounds."""
    return jnp.pad(a, ((0, rows), (0, 0)))


def _forward(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, up_shift, tm, ts):
    m = x.shape[0]
    two_i = gate_up.shape[2]
    sched = _Schedule(group_sizes, tm, ts)
    prec = dot_precision(x.dtype)
    xp = _pad_rows(x, tm)

    def expert(e, carry):
        w1, b1 = gate_up[e], gate_up_bias[e].astype(_F32)
        w2, b2 = down[e], down_bias[e].astype(_F32)

        def visit(row0, rows, mine, carry):
            y, pre = carry
            gu = jnp.dot(_tile(xp, row0, rows), w1, precision=prec, preferred_element_type=_F32) + b1
            h = clamped_swiglu(gu, alpha=alpha, limit=limit, up_shift=up_shift).astype(x.dtype)
            out = jnp.dot(h, w2, precision=prec, preferred_element_type=_F32) + b2
            return _put(y, out, row0, mine), _put(pre, gu, row0, mine)

        return sched.walk(e, visit, carry)

    init = (jnp.zeros_like(xp), jnp.zeros((xp.shape[0], two_i), _F32))
    y, pre = lax.fori_loop(0, gate_up.shape[0], expert, init)
    return y[:m], pre


def _backward(x, group_sizes, gate_up, gate_up_bias, down, down_bias, pre, dy, alpha, limit, up_shift, tm, ts):
    m, hdim = x.shape
    two_i = gate_up.shape[2]
    sched = _Schedule(group_sizes, tm, ts)
    prec = dot_precision(x.dtype)
    xp, dyp = _pad_rows(x, tm), _pad_rows(dy.astype(x.dtype), tm)
    a_bt = (((1,), (1,)), ((), ()))                  # a @ b^T
    at_b = (((0,), (0,)), ((), ()))                  # a^T @ b, over the tile's rows

    def expert(e, carry):
        dx, dw1, db1, dw2, db2 = carry
        w1, w2 = gate_up[e], down[e]

        def visit(row0, rows, mine, acc):
            dx, g1, gb1, g2, gb2 = acc
            dyt = _masked(_tile(dyp, row0, rows), mine)
            gu = _tile(pre, row0, rows)
            h = _masked(clamped_swiglu(gu, alpha=alpha, limit=limit, up_shift=up_shift), mine).astype(x.dtype)
            dh = lax.dot_general(dyt, w2, a_bt, precision=prec, preferred_element_type=_F32)
            dgu = _masked(clamped_swiglu_grad(gu, dh, alpha=alpha, limit=limit, up_shift=up_shift),
                          mine).astype(x.dtype)
            dxt = lax.dot_general(dgu, w1, a_bt, precision=prec, preferred_element_type=_F32)
            g1 += lax.dot_general(_tile(xp, row0, rows), dgu, at_b, precision=prec, preferred_element_type=_F32)
            g2 += lax.dot_general(h, dyt, at_b, precision=prec, preferred_element_type=_F32)
            return _put(dx, dxt, row0, mine), g1, gb1 + dgu.astype(_F32).sum(0), g2, gb2 + dyt.astype(_F32).sum(0)

        zeros = (jnp.zeros(w1.shape, _F32), jnp.zeros((two_i,), _F32), jnp.zeros(w2.shape, _F32),
                 jnp.zeros((hdim,), _F32))
        dx, g1, gb1, g2, gb2 = sched.walk(e, visit, (dx, *zeros))
        put = lambda total, part: lax.dynamic_update_index_in_dim(total, part, e, axis=0)
        return dx, put(dw1, g1), put(db1, gb1), put(dw2, g2), put(db2, gb2)

    init = (jnp.zeros(xp.shape, _F32), jnp.zeros(gate_up.shape, _F32), jnp.zeros(gate_up_bias.shape, _F32),
            jnp.zeros(down.shape, _F32), jnp.zeros(down_bias.shape, _F32))
    dx, dw1, db1, dw2, db2 = lax.fori_loop(0, gate_up.shape[0], expert, init)
    return (dx[:m].astype(x.dtype), None, dw1.astype(gate_up.dtype), db1.astype(gate_up_bias.dtype),
            dw2.astype(down.dtype), db2.astype(down_bias.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _looped(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, up_shift, tm, ts):
    return _forward(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, up_shift, tm, ts)[0]


def _looped_fwd(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, up_shift, tm, ts):
    y, pre = _forward(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha, limit, up_shift, tm, ts)
    return y, (x, group_sizes, gate_up, gate_up_bias, down, down_bias, pre)


def _looped_bwd(alpha, limit, up_shift, tm, ts, residuals, dy):
    return _backward(*residuals, dy, alpha, limit, up_shift, tm, ts)


_looped.defvjp(_looped_fwd, _looped_bwd)
