"""Token dispatch around the grouped-GEMM expert kernels: what runs the model's `routed_experts` op.

The op hands over token rows with their top-k expert choices. Here the k copies of each row are
grouped by expert (a stable sort), the registry's chosen grouped-GEMM implementation runs each
expert on its own rows only, and the results return to token order, mixed by the routing weights.

Under a mesh the dispatch runs per device inside `shard_map` (GSPMD cannot partition a sort), on
that device's tokens. Expert parallelism (an `expert` axis): the tokens of the devices along
`expert` are all-gathered, each device runs only its local experts on the rows that chose them
(dropless: any number of rows, up to all of them, so the row buffer is static at its maximum and
rows for other experts sort last, past the groups) and the mixed rows are reduce-scattered back.
Tensor parallelism splits every expert's hidden width over `tensor`: each device adds a partial
down projection and the partial outputs are summed over `tensor` (the down bias is added once).

Expert stacks held as MXFP4 (`moe_mxfp4`: blocks and scales in the released orientation) are
split over their experts only: their other dimensions are blocked along the input (H for
gate_up, I for down), and a split there could cut a 32-value block. Under `tensor` their
experts are split over it instead of their width: the rows, alike on the devices of a `tensor`
group, go through each device's experts and the outputs are summed over `tensor`.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_bridge.sharded_ops import CHECK_VMA


def mix_experts(grouped: Callable, x, experts, weights, *stacks, first_expert=None, alpha: float, limit: float,
                up_shift: float):
    """out[n] = sum_j weights[n, j] * expert_{experts[n, j]}(x[n]); x [R, H], experts and weights [R, k].
    `stacks`: the expert tensors `grouped` takes after the group sizes, each [E_local, ...].

    first_expert None: every expert is held here. Otherwise the weights hold experts
    first_expert .. first_expert + E_local - 1 only, and choices of other experts contribute 0.
    """
    rows, k = experts.shape
    e_local = stacks[0].shape[0]
    key = experts.reshape(-1)
    if first_expert is not None:                  # other experts' rows sort last, past the groups
        key = key - first_expert
        key = jnp.where((key >= 0) & (key < e_local), key, e_local)
    order, weights_sorted, copies = stable_order(key, jax.lax.stop_gradient(weights).reshape(-1))
    group_sizes = (key[:, None] == jnp.arange(e_local, dtype=key.dtype)).sum(0, dtype=jnp.int32)
    copies = copies.reshape(rows, k)
    sorted_rows = sort_rows(x, order, copies)
    live = None
    if first_expert is not None:
        # Rows past the groups are never computed by the kernels: mask both ways so nothing they
        # leave there (forward output, or input gradient in the backward pass) leaks in.
        live = (jnp.arange(order.shape[0]) < group_sizes.sum())[:, None]
        sorted_rows = jnp.where(live, sorted_rows, 0)
    out = grouped(sorted_rows, group_sizes, *stacks, alpha=alpha, limit=limit, up_shift=up_shift)
    if live is not None:
        out = jnp.where(live, out, 0)
    return combine_rows(out, weights, order, copies, weights_sorted)


# Up to this many (row, choice) copies the grouping is found by comparing every pair (an [n, n]
# pass) rather than by two sorts: a decode step's few rows, where each sort is an op of its own in
# every step of the loop (small-o200k at 1 prompt: 345 -> 337 ops per token). Past it the pass
# grows as n^2 (the v5e roofline already prices 128 copies' above the sorts').
COMPARED_COPIES = 64


def stable_order(key, weights):
    """(order, weights in sorted order, copies) of the copies' expert keys [n] sorted stably:
    order[p] is the copy at sorted position p, copies[i] the position of copy i (the inverse
    permutation). Past COMPARED_COPIES one sort orders the copies and carries their routing
    weights along (the backward's weights in sorted order) and a second inverts the permutation;
    up to it, comparisons of every pair give all three. Never a scatter or a gather of single
    values, which a TPU runs element by element: as `bincount`, `.at[order].set` and
    `weights[order]` they took about 8 ms of `small-o200k`'s 266 ms step on a v5e (profiled
    2026-12-06); sorts and comparisons run vectorised."""
    n = key.shape[0]
    flat = jnp.arange(n, dtype=jnp.int32)
    if n > COMPARED_COPIES:
        _, order, weights_sorted = jax.lax.sort((key, flat, weights), num_keys=1, is_stable=True)
        return order, weights_sorted, unsort(order, flat)
    # copy i's position: the copies of smaller keys, and of its key earlier (stable)
    earlier = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (flat[None, :] < flat[:, None]))
    copies = earlier.sum(1, dtype=jnp.int32)
    lands = copies[None, :] == flat[:, None]                       # [p, i]: copy i sits at position p
    order = jnp.where(lands, flat[None, :], 0).sum(1, dtype=jnp.int32)
    weights_sorted = jnp.where(lands, weights[None, :], jnp.zeros((), weights.dtype)).sum(1).astype(weights.dtype)
    return order, weights_sorted, copies


def unsort(order, values):
    """values in sorted order -> the same values in the original order: out[order[i]] = values[i],
    by a sort keyed on `order` (a permutation) rather than a scatter."""
    return jax.lax.sort((order, values), num_keys=1)[1]


# The two permutations around the kernels, with their transposes written out. Autodiff would
# transpose a gather into a scatter-add, and a [R, k, H] array is a layout copy on TPU (its k rows
# pad a tile). So rows move by gathers of [R, H] or [R k, H] only, one per copy, and the sums over
# the k copies and the weighting are elementwise passes XLA fuses.
# order [R k]: the flat (row, choice) index of each sorted row; copies [R, k]: where each row's
# k copies sit in sorted order (the inverse permutation).

def _rows_at(rows, positions):
    """rows[positions] for positions made here (in range, never negative): a plain gather, without
    the wrap of negative indices that `rows[positions]` adds (an add, a compare and a select per
    gather, unfused: 24 of a 4-layer decode step's ops)."""
    return rows.at[positions].get(mode="promise_in_bounds", wrap_negative_indices=False)


def _sum_of_copies(rows, copies, scale=None):
    """sum_j scale[:, j] * rows[copies[:, j]] over the k copies, one [R, H] gather each."""
    total = None
    for j in range(copies.shape[1]):
        part = _rows_at(rows, copies[:, j])
        if scale is not None:
            part = part * scale[:, j, None].astype(rows.dtype)
        total = part if total is None else total + part
    return total


@jax.custom_vjp
def sort_rows(x, order, copies):
    """x [R, H] -> its k copies in sorted order [R k, H]: sorted[i] = x[order[i] // k]."""
    return _rows_at(x, jax.lax.div(order, copies.shape[1]))


def _sort_rows_fwd(x, order, copies):
    return sort_rows(x, order, copies), (order, copies)


def _sort_rows_bwd(residuals, d_sorted):
    order, copies = residuals
    return _sum_of_copies(d_sorted, copies), None, None


sort_rows.defvjp(_sort_rows_fwd, _sort_rows_bwd)


@jax.custom_vjp
def combine_rows(out, weights, order, copies, weights_sorted):
    """Sorted expert outputs [R k, H] back to token order, mixed: y[n] = sum_j weights[n, j] *
    out[copies[n, j]] (in out's dtype). weights_sorted: the same weights in sorted order [R k],
    for the backward (its gradient is the one `weights` receives)."""
    return _sum_of_copies(out, copies, weights)


def _combine_rows_fwd(out, weights, order, copies, weights_sorted):
    return combine_rows(out, weights, order, copies, weights_sorted), (out, weights_sorted, order, copies)


def _combine_rows_bwd(residuals, dy):
    out, weights_sorted, order, copies = residuals          # weights_sorted: weights' values and dtype
    rows, k = copies.shape
    dy_sorted = _rows_at(dy, jax.lax.div(order, k))               # each sorted row's token's cotangent
    d_out = dy_sorted * weights_sorted[:, None].astype(dy.dtype)
    d_weights_sorted = (out * dy_sorted).sum(-1)                   # in sorted order, then back per copy
    d_weights = unsort(order, d_weights_sorted).reshape(rows, k).astype(weights_sorted.dtype)
    return d_out, d_weights, None, None, None


combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


def routed_experts(grouped: Callable, *, mesh=None, mxfp4: bool = False):
    """The `routed_experts` op as a JAX function over `grouped` (a registry `moe` implementation
    with the grouped-GEMM signature; with mxfp4, a `moe_mxfp4` one): one dispatch over all
    tokens, or per device under a mesh."""
    if mesh is None:
        return functools.partial(mix_experts, grouped)
    return functools.partial(_per_device, grouped, mesh, mxfp4=mxfp4)


def _stack_specs(mesh, stacks, mxfp4: bool, over_fsdp: bool):
    """(the expert stacks' specs as the dispatch uses them, the `tensor` axis splitting their
    width or None): experts split over `expert` (or as stored, over `fsdp` too, with over_fsdp),
    everything else the rules split over `fsdp` (the experts, the hidden dimension or MXFP4's
    output rows) gathered (FSDP). bf16 stacks: gate_up, its bias, down, its bias; MXFP4 ones:
    blocks, scales and bias of gate_up, then of down."""
    from jax_bridge import sharding

    if mxfp4:
        first = sharding.logical_spec(mesh, ("exp_q" if over_fsdp else "exp_parallel_q",), stacks[0].shape[:1])
        return [P(*first, *(None,) * (s.ndim - 1)) for s in stacks], None
    exp = "exp" if over_fsdp else "exp_parallel"
    gate_up, gate_up_bias, down, down_bias = stacks
    w1 = sharding.logical_spec(mesh, (exp, None, "mlp"), gate_up.shape)
    specs = [w1, sharding.logical_spec(mesh, (exp, "mlp"), gate_up_bias.shape),
             sharding.logical_spec(mesh, (exp, "mlp", None), down.shape),
             sharding.logical_spec(mesh, (exp, None), down_bias.shape)]
    return specs, (w1[2] if len(w1) > 2 else None)


def _experts_over_fsdp(mesh, x, experts, stacks, mxfp4: bool) -> bool:
    """Whether the stacks, split over their experts on `fsdp` as stored, stay there and the rows
    of the devices along `fsdp` come to them (expert parallelism over `fsdp`), rather than each
    device gathering the stacks: `sharding.fsdp_gathers_rows` weighs the dropless row buffers
    (every gathered row once per choice: its input, its [2I] pre-activation and its output)
    against the stacks."""
    from jax_bridge import sharding

    if mesh.shape.get("fsdp", 1) == 1 or mesh.shape.get("expert", 1) > 1:
        return False
    stored = sharding.logical_spec(mesh, ("exp_q" if mxfp4 else "exp",), stacks[0].shape[:1])
    if tuple(stored) != ("fsdp",):
        return False
    rows = sharding.rows_along_fsdp(mesh, x.shape[0]) * experts.shape[1]
    width = x.shape[1] * 2 + stacks[0].shape[1 if mxfp4 else 2]      # [E, 2I, ...] as released, else [E, H, 2I]
    weight = sum(s.size * s.dtype.itemsize for s in stacks)
    return sharding.fsdp_gathers_rows(mesh, rows * width * x.dtype.itemsize, weight)


def _per_device(grouped, mesh, x, experts, weights, *stacks, mxfp4: bool, alpha, limit, up_shift):
    from jax_bridge import sharding

    over_fsdp = _experts_over_fsdp(mesh, x, experts, stacks, mxfp4)
    specs, tensor = _stack_specs(mesh, stacks, mxfp4, over_fsdp)
    split = specs[0][0] if len(specs[0]) else None
    split = () if split is None else (split,) if isinstance(split, str) else tuple(split)   # the experts' axes
    parallel = "expert" if "expert" in split else "fsdp" if over_fsdp else None    # whose rows come together
    tensor_experts = "tensor" if "tensor" in split else None     # MXFP4: experts over tensor, rows alike
    if mesh.shape.get("expert", 1) > 1 and "expert" not in split:
        raise ValueError(f"expert parallelism: {stacks[0].shape[0]} experts cannot be split over "
                         f"expert={mesh.shape['expert']} devices (the count must divide)")
    rows = P(sharding.batch_axes(mesh), None)

    def local(x, experts, weights, *stacks):
        first = None
        if parallel:
            x, experts, weights = (jax.lax.all_gather(a, parallel, axis=0, tiled=True) for a in (x, experts, weights))
        if split:
            first = jax.lax.axis_index(split) * stacks[0].shape[0]
        if tensor:          # every tensor shard adds a partial down projection; the bias (last) once
            down_bias = stacks[-1]
            stacks = (*stacks[:-1], jnp.where(jax.lax.axis_index(tensor) == 0, down_bias, jnp.zeros_like(down_bias)))
        y = mix_experts(grouped, x, experts, weights, *stacks, first_expert=first, alpha=alpha, limit=limit,
                        up_shift=up_shift)
        if tensor or tensor_experts:
            y = jax.lax.psum(y, tensor or tensor_experts)
        if parallel:
            y = jax.lax.psum_scatter(y, parallel, scatter_dimension=0, tiled=True)
        return y

    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, *specs), out_specs=rows,
                         check_vma=CHECK_VMA)(x, experts, weights, *stacks)
