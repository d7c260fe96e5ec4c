"""HBM bytes a Pallas TPU kernel's pipeline moves, counted from its grid and BlockSpecs: the one
place the kernels' cost estimates take their byte counts from, so an estimate (and a roofline
ceiling built on it) cannot claim less traffic than the block plan moves.

The pipeline's rules, as Pallas TPU runs a grid (row-major order, the last grid axis fastest):
- an input's block is copied HBM -> VMEM at the first step and at every step whose block index
  differs from the previous step's (an unchanged index re-uses the buffer: no DMA), so a clamped
  index map that repeats a block (a skipped tile) costs nothing;
- an output's block is written back VMEM -> HBM whenever the next step's block index differs,
  and after the last step: once per run of equal consecutive indices;
- a block partly outside its array moves only its in-bounds part; a squeezed (None) dimension is
  one element; a spec without a block shape (SMEM, ANY) moves its whole array once.

Index maps are evaluated on every grid step at once (numpy arrays of grid indices through the
map's jnp / lax arithmetic); maps that read scalar-prefetch arguments take `prefetch` values
(e.g. a static worst case) after the grid indices.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


class Operand(NamedTuple):
    """A pallas_call operand: its BlockSpec and the array's shape and dtype."""
    spec: object            # pl.BlockSpec
    shape: tuple
    dtype: object


def operands(specs, arrays) -> list[Operand]:
    """Operands from parallel lists of BlockSpecs and arrays (or ShapeDtypeStructs)."""
    if len(specs) != len(arrays):
        raise ValueError(f"cost: {len(specs)} BlockSpecs for {len(arrays)} arrays")
    return [Operand(s, tuple(a.shape), a.dtype) for s, a in zip(specs, arrays)]


def _block_indices(spec, grid: tuple, prefetch: tuple) -> np.ndarray:
    """[steps, rank] block index of `spec` at every grid step, in the pipeline's order."""
    import jax

    steps = math.prod(grid)
    # NumPy grid indices: an index map of plain arithmetic then runs in NumPy, with no JAX dispatch
    # (each dispatched op is a small compile, and kernels are traced in every step); one that calls
    # lax / jnp gets JAX values, concrete even while a kernel is being traced.
    with jax.ensure_compile_time_eval():
        grid_ix = list(np.indices(grid, dtype=np.int32).reshape(len(grid), steps))
        index = spec.index_map(*grid_ix, *prefetch)
        index = index if isinstance(index, tuple) else (index,)
        return np.stack([np.broadcast_to(np.asarray(c, np.int64), (steps,)) for c in index], axis=1)


def _in_bounds_elements(block_shape: tuple, shape: tuple, index: np.ndarray) -> np.ndarray:
    """[steps] elements of each step's block that lie inside the array."""
    count = np.ones(index.shape[0], np.int64)
    for dim, (block, size) in enumerate(zip(block_shape, shape)):
        block = 1 if block is None else block
        start = index[:, dim] * block
        count *= np.clip(np.minimum(start + block, size) - start, 0, None)
    return count


def operand_bytes(operand: Operand, grid: tuple, *, output: bool = False, prefetch: tuple = ()) -> int:
    """Bytes one operand moves over the grid (an input's copies in, an output's write-backs)."""
    itemsize = np.dtype(operand.dtype).itemsize
    if operand.spec.block_shape is None:          # SMEM / ANY: the whole array, once
        return math.prod(operand.shape) * itemsize
    if len(operand.spec.block_shape) != len(operand.shape):
        raise ValueError(f"cost: block shape {operand.spec.block_shape} for an array of shape {operand.shape}")
    index = _block_indices(operand.spec, tuple(grid), prefetch)
    changed = np.ones(index.shape[0], bool)
    if output:      # written back when the next step leaves the block, and after the last step
        changed[:-1] = np.any(index[1:] != index[:-1], axis=1)
    else:           # copied in at the first step and whenever the block changes
        changed[1:] = np.any(index[1:] != index[:-1], axis=1)
    elements = _in_bounds_elements(operand.spec.block_shape, operand.shape, index)
    return int(elements[changed].sum()) * itemsize


def pipeline_bytes(grid, inputs: list[Operand], outputs: list[Operand], *, prefetch: tuple = ()) -> int:
    """HBM bytes of one pallas_call: every input's copies in plus every output's write-backs."""
    return (sum(operand_bytes(o, grid, prefetch=prefetch) for o in inputs)
            + sum(operand_bytes(o, grid, output=True, prefetch=prefetch) for o in outputs))


def cost_estimate(grid, in_specs, inputs, out_specs, outputs, *, flops: int, transcendentals: int = 0,
                  prefetch: tuple = ()):
    """pl.CostEstimate of a pallas_call: the FLOPs given, the bytes its block plan moves (with
    `prefetch`, the scalar-prefetch values its index maps read, e.g. an assumed routing)."""
    from jax.experimental import pallas as pl

    out_specs = out_specs if isinstance(out_specs, (list, tuple)) else [out_specs]
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    nbytes = pipeline_bytes(tuple(grid), operands(in_specs, inputs), operands(out_specs, outputs), prefetch=prefetch)
    nbytes += sum(int(np.asarray(p).nbytes) for p in prefetch)     # scalar-prefetch arrays: into SMEM once
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(nbytes))
