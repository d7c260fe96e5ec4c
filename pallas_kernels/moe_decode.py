"""The MoE expert MLPs for the few rows of a decode step (plain JAX, the `decode` implementations
of `moe` and of `moe_mxfp4`, whose experts are decoded one at a time as they are used).

Same signature and result as `moe.moe_experts_reference` (rows sorted by expert, group_sizes
[E]). At decode shapes the cost is reading the experts' weights, not arithmetic, so this path
reads only the experts in use:
  - up to `rows_alone` (ROWS_ALONE) rows: each row goes through its own expert, chosen by
    `lax.switch` among static slices `gate_up[e]` (in a loop over the rows). When the decoder
    passes every expert's weights as a separate array stacked in the program
    (jax_bridge/decoding.py, `split_experts`), XLA resolves those slices to the experts' own
    buffers: matrix-vector products on the weights in place, nothing copied. On an ordinary
    [E, ...] array the slices are copies of every expert, held while the loop runs (1.5 GB for
    two layers of gpt-oss-20b on tensor=2): the decoder then passes rows_alone=0.
  - more rows: a loop over work items, each one expert and up to `chunk` of its (contiguous,
    sorted) rows, the expert's weights taken once by a dynamic slice.
The tiled `xla` implementation instead gathers a weight copy for every (row tile, expert) pair,
whether the expert has rows or not. Measured on the 2-core CPU (tiny: 8 experts of 256x512,
four layers' weights in turn so they do not stay cached; a busy machine, so ratios only), per
layer: 2 rows 22 us (switch) vs 691 us (xla); 16 rows 315 us (switch) vs 562 (work items) vs
775 (xla). `bench generate` times whole decode steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe import clamped_swiglu, expert_of_rows
from pallas_kernels.moe_mxfp4 import check_mxfp4_experts, decoded_experts
from pallas_kernels.platform import dot_precision

ROWS_ALONE = 32


def expert_mlp(x, w_up, b_up, w_down, b_down, alpha, limit, up_shift):
    """One expert on x [..., H] (clamped SwiGLU between the two projections)."""
    precision = dot_precision(x.dtype)
    h = jnp.dot(x, w_up, precision=precision, preferred_element_type=jnp.float32)
    h = clamped_swiglu(h + b_up.astype(jnp.float32), alpha=alpha, limit=limit, up_shift=up_shift).astype(x.dtype)
    y = jnp.dot(h, w_down, precision=precision, preferred_element_type=jnp.float32)
    return (y + b_down.astype(jnp.float32)).astype(x.dtype)


def _rows_alone(x, expert, gate_up, gate_up_bias, down, down_bias, alpha, limit, up_shift):
    """Row r through expert[r]: a loop over rows around a switch whose branch e uses static
    slices of expert e (a loop, not an unrolled list, keeps the program small to compile)."""
    experts = gate_up.shape[0]
    weights = [t for e in range(experts) for t in (gate_up[e], gate_up_bias[e], down[e], down_bias[e])]
    branches = [lambda row, *w, e=e: expert_mlp(row, *w[4 * e:4 * e + 4], alpha, limit, up_shift)
                for e in range(experts)]

    def one_row(r, out):
        row = jax.lax.dynamic_index_in_dim(x, r, 0, keepdims=False)
        return out.at[r].set(jax.lax.switch(expert[r], branches, row, *weights))

    return jax.lax.fori_loop(0, x.shape[0], one_row, jnp.zeros_like(x))


def over_work_items(inputs: tuple, sizes, chunk: int, per_item):
    """[M, H] in the layout of inputs[0]: items of (expert e, up to `chunk` of its contiguous,
    sorted rows) in a loop, each writing `per_item(e, *chunks)` (the item's rows of every array
    of `inputs`, [chunk, ...]) to its rows; rows past the group are dropped."""
    rows, experts = inputs[0].shape[0], sizes.shape[0]
    starts = jnp.cumsum(sizes) - sizes
    chunks = (sizes + chunk - 1) // chunk                         # work items per expert
    first_item = jnp.cumsum(chunks) - chunks
    padded = [jnp.pad(a, ((0, chunk), (0, 0))) for a in inputs]   # a chunk may run past the end
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def work_item(item, out):
        # The expert of item `item`: the last one with items that starts at or before it.
        owns = (first_item <= item) & (chunks > 0)
        e = jnp.max(jnp.where(owns, jnp.arange(experts, dtype=jnp.int32), 0))
        rank = (item - first_item[e]) * chunk                     # first row of this chunk in the group
        y = per_item(e, *(jax.lax.dynamic_slice_in_dim(a, starts[e] + rank, chunk, 0) for a in padded))
        target = jnp.where(rank + offsets < sizes[e], starts[e] + rank + offsets, rows)   # rows = dropped
        return out.at[target].set(y.astype(out.dtype), mode="drop")

    return jax.lax.fori_loop(0, jnp.sum(chunks), work_item, jnp.zeros_like(inputs[0]))


def _work_items(x, sizes, expert_weights, alpha, limit, up_shift, chunk: int):
    """Items of (expert, up to `chunk` of its rows) in a loop; the expert's weights taken once per
    item (`expert_weights(e)`: gate_up [H, 2I], its bias, down [I, H], its bias)."""
    return over_work_items((x,), sizes, chunk,
                           lambda e, rows: expert_mlp(rows, *expert_weights(e), alpha, limit, up_shift))


def moe_experts_decode(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                       limit: float = 7.0, up_shift: float = 1.0, chunk: int | None = None,
                       rows_alone: int = ROWS_ALONE, platform: str = "cpu"):
    """x: [M, H] sorted by expert; group_sizes: [E]; weights as the reference. `chunk`: rows per
    work item when M > rows_alone (default: twice the mean rows per expert, at least 2).
    `platform` is accepted for the registry's uniform signature (plain JAX needs none)."""
    del platform
    rows, experts = x.shape[0], group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    if rows == 0:
        return x
    if rows <= rows_alone:
        return _rows_alone(x, expert_of_rows(sizes, rows), gate_up, gate_up_bias, down, down_bias, alpha, limit,
                           up_shift)
    def expert_weights(e):
        return [jax.lax.dynamic_index_in_dim(t, e, 0, keepdims=False) for t in (gate_up, gate_up_bias, down, down_bias)]

    return _work_items(x, sizes, expert_weights, alpha, limit, up_shift, default_chunk(rows, experts, chunk))


def default_chunk(rows: int, experts: int, chunk: int | None) -> int:
    """Rows per work item: twice the mean rows per expert, at least 2."""
    return chunk or max(2, -(-2 * rows // experts))


def moe_mxfp4_decode(x, group_sizes, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                     down_bias, *, alpha: float = 1.702, limit: float = 7.0, up_shift: float = 1.0,
                     chunk: int | None = None, platform: str = "cpu"):
    """The same for an MXFP4 expert base (arguments as moe_mxfp4.moe_mxfp4_reference): work items
    over the experts in use, each expert's bytes sliced and decoded alone, where the `xla`
    implementation decodes every stack whole on every call (a layer's 32 experts of gpt-oss-20b
    are 3.2 GB in float32)."""
    del platform
    experts, _, _ = check_mxfp4_experts(x, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                                        down_bias)
    rows = x.shape[0]
    if rows == 0:
        return x
    stacks = (gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias)
    return _work_items(x, group_sizes.astype(jnp.int32), lambda e: mxfp4_expert(stacks, e, x.dtype), alpha, limit,
                       up_shift, default_chunk(rows, experts, chunk))


def mxfp4_expert(stacks, e, dtype):
    """Expert e of MXFP4 stacks (gate_up blocks, scales, bias, down blocks, scales, bias; e may
    be traced), its bytes alone decoded: gate_up [H, 2I], its bias, down [I, H], its bias."""
    gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias = (
        jax.lax.dynamic_slice_in_dim(t, e, 1, 0) for t in stacks)          # each keeps the expert axis
    gate_up, down = decoded_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales, dtype)
    return gate_up[0], gate_up_bias[0], down[0], down_bias[0]
