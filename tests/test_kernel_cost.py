"""The shared byte counter of the kernels' cost estimates (pallas_kernels/cost.py) against counts
by hand: a block is copied in when its index changes from the previous grid step (a clamped,
repeated index costs nothing), an output is written back once per run of equal indices, a block
partly outside its array moves its in-bounds part, SMEM specs move their whole array once."""
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.cost import Operand, operand_bytes, pipeline_bytes


def test_a_matmul_plan_streams_the_inner_operand_once_per_outer_step():
    n, h, v, bn, bv = 100, 8, 50, 32, 16           # 4 x 4 grid, both last tiles ragged
    a = Operand(pl.BlockSpec((bn, h), lambda i, j: (i, 0)), (n, h), jnp.float32)
    w = Operand(pl.BlockSpec((bv, h), lambda i, j: (j, 0)), (v, h), jnp.bfloat16)
    out = Operand(pl.BlockSpec((bn, h), lambda i, j: (i, 0)), (n, h), jnp.float32)
    assert operand_bytes(a, (4, 4)) == n * h * 4                     # once per i: the whole array
    assert operand_bytes(w, (4, 4)) == 4 * v * h * 2                 # every step: 4 passes over W
    assert operand_bytes(w, (4, 1)) == bv * h * 2                    # one j: the same block, copied once
    assert operand_bytes(out, (4, 4), output=True) == n * h * 4      # written back once per i
    assert pipeline_bytes((4, 4), [a, w], [out]) == n * h * 8 + 4 * v * h * 2


def test_a_clamped_index_reuses_the_block_and_alternating_outputs_are_written_each_time():
    # kv block of step j in q row i: min(i + j, 2) over a 3 x 2 grid: 0 1 | 1 2 | 2 2 -> 3 copies (0, 1, 2)
    kv = Operand(pl.BlockSpec((4, 2), lambda i, j: (jnp.minimum(i + j, 2), 0)), (12, 2), jnp.float32)
    assert operand_bytes(kv, (3, 2)) == 3 * 4 * 2 * 4
    flip = Operand(pl.BlockSpec((4,), lambda i: (i % 2,)), (8,), jnp.float32)     # 0 1 0 1 -> 4 write-backs
    assert operand_bytes(flip, (4,), output=True) == 4 * 4 * 4
    smem = Operand(pl.BlockSpec(memory_space=pltpu.SMEM), (7, 3), jnp.int32)
    assert operand_bytes(smem, (5, 5)) == 7 * 3 * 4


def test_a_squeezed_dimension_counts_one_element_and_a_bad_rank_is_refused():
    rows = Operand(pl.BlockSpec((None, 128), lambda b, i: (b, i)), (3, 200), jnp.float32)
    assert operand_bytes(rows, (3, 2)) == 3 * 200 * 4                 # 128 + 72 per row
    with pytest.raises(ValueError, match="block shape"):
        operand_bytes(Operand(pl.BlockSpec((4,), lambda i: (i,)), (4, 4), jnp.float32), (1,))
