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


def test_index_math_on_numpy_gives_what_lax_gives_the_kernels():
    """The cost estimates run index maps on NumPy grid indices; the kernels run them on traced
    int32 scalars. Both must name the same blocks, negative operands included (lax.div and
    lax.rem truncate toward zero)."""
    import numpy as np
    from jax import lax

    from pallas_kernels import index_math as ix

    a = np.arange(-9, 10, dtype=np.int32)
    for b in (1, 3, 4):
        np.testing.assert_array_equal(ix.div(a, b), lax.div(jnp.asarray(a), b))
        np.testing.assert_array_equal(ix.rem(a, b), lax.rem(jnp.asarray(a), b))
    np.testing.assert_array_equal(ix.minimum(a, 2), jnp.minimum(jnp.asarray(a), 2))
    np.testing.assert_array_equal(ix.maximum(a, -2), jnp.maximum(jnp.asarray(a), -2))
    np.testing.assert_array_equal(ix.clip(a, -1, 3), jnp.clip(jnp.asarray(a), -1, 3))
    np.testing.assert_array_equal(ix.where(a > 0, a, 7), jnp.where(jnp.asarray(a) > 0, jnp.asarray(a), 7))
    assert ix.div(-7, 2) == -4 and ix.minimum(3, 5) == 3        # Python ints (grid sizes): Python's own
    for name in ("div", "rem", "minimum", "maximum", "clip", "where"):   # the host path never returns JAX
        args = (a > 0, a, 1) if name == "where" else (a, 1, 2) if name == "clip" else (a, 2)
        assert isinstance(getattr(ix, name)(*args), np.ndarray), name


def test_tracing_a_pallas_train_step_compiles_nothing():
    """Every kernel's cost estimate is evaluated while a step is traced. Done with JAX ops, each op
    compiled a small program of its own (74 of them, 1.4 s, in a 2-layer step's trace when this
    broke); in NumPy none is compiled."""
    import jax
    import numpy as np
    import torch

    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, expert_dim=32,
                                     sliding_window=16, max_seq_len=64)
    step = TrainStep(GptOssForCausalLM(cfg), step_cfg=StepConfig(kernels="pallas"))
    state = step.init_state()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 2, 65)).astype(np.int32)
    # Placing the batch and the learning-rate scale each compile a small program once, outside tracing.
    step.place_batch(tokens, 1)
    jax.numpy.asarray(1.0, jax.numpy.float32)
    compiled = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        step.lower(state, tokens)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiled == [], f"tracing the step compiled {len(compiled)} programs ({sum(compiled):.2f} s)"
