"""The MoE expert MLPs for the few rows of a decode step (plain JAX, the `decode` implementation).

Same signature and result as `moe.moe_experts_reference` (rows sorted by expert, group_sizes
[E]). At decode shapes the cost is reading the experts' weights, not arithmetic, so this path
reads each expert in use once and no other:
  - up to ROWS_ALONE rows: one matrix-vector product per row with its own expert's weights;
  - more rows: a loop over work items, each one expert and up to `chunk` of its (contiguous,
    sorted) rows: the expert's weights are sliced once and multiplied by its rows together.
The tiled `xla` implementation instead gathers a weight copy for every (row tile, expert) pair,
whether the expert has rows or not. Measured on the 2-core CPU (tiny: 8 experts of 256x512,
four layers' weights in turn so they do not stay cached; a busy machine, so ratios only):
2 rows 101 vs 1117 us per layer, 16 rows 734 vs 1259 us. `bench generate` times whole steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe import clamped_swiglu, expert_of_rows

ROWS_ALONE = 4


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _expert_mlp(x, expert, gate_up, gate_up_bias, down, down_bias, alpha, limit):
    """x [..., H] through expert `expert` (a traced index) with weights sliced, not gathered."""
    precision = _precision(x.dtype)
    w_up = jax.lax.dynamic_index_in_dim(gate_up, expert, 0, keepdims=False)
    w_down = jax.lax.dynamic_index_in_dim(down, expert, 0, keepdims=False)
    h = jnp.dot(x, w_up, precision=precision, preferred_element_type=jnp.float32)
    h = clamped_swiglu(h + gate_up_bias[expert].astype(jnp.float32), alpha=alpha, limit=limit).astype(x.dtype)
    y = jnp.dot(h, w_down, precision=precision, preferred_element_type=jnp.float32)
    return (y + down_bias[expert].astype(jnp.float32)).astype(x.dtype)


def moe_experts_decode(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                       limit: float = 7.0, chunk: int | None = None, platform: str = "cpu"):
    """x: [M, H] sorted by expert; group_sizes: [E]; weights as the reference. `chunk`: rows per
    work item (default: twice the mean rows per expert, at least 2). `platform` is accepted for
    the registry's uniform signature (plain JAX needs none)."""
    del platform
    rows, experts = x.shape[0], group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    weights = (gate_up, gate_up_bias, down, down_bias, alpha, limit)
    if rows == 0:
        return x
    if rows <= ROWS_ALONE:
        expert = expert_of_rows(sizes, rows)
        return jnp.stack([_expert_mlp(x[r], expert[r], *weights) for r in range(rows)])

    chunk = chunk or max(2, -(-2 * rows // experts))
    starts = jnp.cumsum(sizes) - sizes
    chunks = (sizes + chunk - 1) // chunk                         # work items per expert
    first_item = jnp.cumsum(chunks) - chunks
    padded = jnp.pad(x, ((0, chunk), (0, 0)))                     # a chunk may run past the end
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def work_item(item, out):
        # The expert of item `item`: the last one with items that starts at or before it.
        owns = (first_item <= item) & (chunks > 0)
        e = jnp.max(jnp.where(owns, jnp.arange(experts, dtype=jnp.int32), 0))
        rank = (item - first_item[e]) * chunk                     # first row of this chunk in the group
        y = _expert_mlp(jax.lax.dynamic_slice_in_dim(padded, starts[e] + rank, chunk, 0), e, *weights)
        target = jnp.where(rank + offsets < sizes[e], starts[e] + rank + offsets, rows)   # rows = dropped
        return out.at[target].set(y, mode="drop")

    return jax.lax.fori_loop(0, jnp.sum(chunks), work_item, jnp.zeros_like(x))
