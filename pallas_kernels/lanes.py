"""Per-row statistics inside TPU kernels: kept lane-replicated ([rows, 128], as Splash keeps its
running max and sum) while a kernel works, and handed out as lane-dense [1, rows] rows."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

LANES = 128  # TPU lane width


def across_lanes(col, width: int):
    """[rows, 128] lane-replicated per-row values -> [rows, width], to combine with a [rows, width]
    tile: whole 128-lane copies of the vregs (splash's `jnp.tile`) where width is a multiple of
    128, instead of broadcasting a [rows, 1] column into every lane of every vreg; the column's
    broadcast otherwise (narrow tiles, CPU-sized blocks)."""
    if width % LANES == 0:
        return jnp.tile(col, (1, width // LANES))
    return col[:, :1]


def lanes_to_row(col):
    """[rows, 128] lane-replicated per-row values -> [1, rows] lane-dense row, 128 rows at a time
    (each square block's diagonal, summed down the sublanes: no transpose, exact). Statistics
    leave a kernel in the row layout the next kernel reads, so nothing of size [..., T, 128]
    ever reaches HBM."""
    rows = col.shape[0]
    parts = []
    for r in range(0, rows, LANES):
        width = min(LANES, rows - r)     # a last part of fewer rows when rows % 128 != 0
        eye = lax.broadcasted_iota(jnp.int32, (width, width), 0) == lax.broadcasted_iota(jnp.int32, (width, width), 1)
        parts.append(jnp.sum(jnp.where(eye, col[r:r + width, :width], 0.0), axis=0, keepdims=True))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
