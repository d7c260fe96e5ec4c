"""The real TPU compiler accepts every Pallas kernel and the whole train step.

`jax.export` only lowers a kernel; Mosaic's compiler (block layouts, VMEM, matmul operand types)
runs only inside libtpu. libtpu compiles here for deviceless topologies (compile-only TPU devices,
jax_bridge/tpu_compile.py): nothing runs, so this checks what a TPU run would compile. Kernels:
forward and forward+backward in one program per (generation, implementation, shape set), bf16,
at the tiny, Lyra Small and gpt-oss-20b shapes of `torchlyra bench kernels` (their figures:
`torchlyra bench kernels --platform tpu`, BENCHMARKS.md). Train step: `jax_bridge.plan` on a
small config, once per kernel set.
"""
import functools

import jax
import jax.numpy as jnp
import pytest

from jax_bridge import registry, tpu_compile
from pallas_kernels.memory import vjp_program
from train.bench.kernels import float_positions, kernel_cases

GENERATIONS = ("v5e:2x2", "v6e:2x2")
SHAPES = ("tiny", "lyra-small", "gpt-oss-20b")
PALLAS = [("attention", "pallas"), ("attention", "splash"), ("cross_entropy", "pallas"),
          ("moe", "pallas"), ("moe", "megablox")]
MiB = 1 << 20


def forward_and_backward(fn, case, **kernel_kwargs):
    """(program, specs): the op and its vjp in one program, so one compile covers the forward
    kernel(s) and the backward kernels; inputs then output cotangents."""
    specs = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d, _ in case.specs]
    op = functools.partial(fn, **case.kwargs, **kernel_kwargs)
    outs = jax.tree.leaves(jax.eval_shape(op, *specs))
    vjp = vjp_program(op, float_positions(case), n_inputs=len(specs))
    n = len(specs)
    program = lambda *args: (op(*args[:n]), vjp(*args))
    return program, specs + [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]


# v5e at tiny shapes is compiled by the train-step tests below: their programs hold the forward
# and backward of every kernel of the `pallas` and `shipped` sets at the tiny preset's dims.
CASES = [(t, s) for t in GENERATIONS for s in SHAPES if (t, s) != ("v5e:2x2", "tiny")]


@pytest.mark.parametrize("op,impl", PALLAS, ids=[f"{o}-{i}" for o, i in PALLAS])
@pytest.mark.parametrize("topology,shape", CASES, ids=[f"{t}-{s}" for t, s in CASES])
def test_kernel_compiles_for_tpu_forward_and_backward(topology, shape, op, impl):
    """Compiled under the strictest ambient matmul precision ("highest", what float32 parity
    runs set): a kernel dot that inherited it would fail on bf16 operands ("Bad lhs type")."""
    case = kernel_cases(op, shape, windows=False, dtype="bfloat16")[0]
    fn = registry.implementations(op)[impl].load()
    program, specs = forward_and_backward(fn, case, platform="tpu")
    with jax.default_matmul_precision("highest"):
        _, stats = tpu_compile.compile_for(program, specs, tpu_compile.device_of(topology))
    assert len(stats.kernels) >= (3 if op != "moe" or impl == "pallas" else 4), stats.kernels   # fwd + bwd kernels
    if impl == "pallas" and shape != "tiny":
        # Our kernels keep nothing of size [T, T], [N, V] or [M, I] in HBM (the references need GiBs
        # here): a regression such as a lane-replicated [B, H, T, 128] residual would show.
        assert stats.temp_bytes < 32 * MiB, f"{stats.temp_bytes / MiB:.1f} MiB of HBM temporaries"


def test_bf16_attention_compiles_under_the_steps_highest_precision():
    """Issue 14's bug: the step ran its forward under jax.default_matmul_precision("highest"); the
    kernels' bf16 dots inherited it and Mosaic refused them ("Bad lhs type"), so a TPU run with
    attention=pallas (what `auto` picks) could not start. Kernels now choose their dots'
    precision; jax-shipped kernels (splash) and ragged_dot (a Mosaic kernel on TPU) run at the
    precision chosen for their dtype. (Every kernel test above also compiles under "highest".)"""
    from jax_bridge.step import StepConfig
    from torch_model.config import get_preset

    cfg = get_preset("tiny")
    step_cfg = StepConfig(platform="tpu", compute_dtype="bfloat16", matmul_precision="highest")
    device = tpu_compile.device_of("v5e:2x2")
    q = jax.ShapeDtypeStruct((2, cfg.n_heads, 256, cfg.head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, cfg.n_kv_heads, 256, cfg.head_dim), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((cfg.n_heads,), jnp.float32)
    for impl in ("pallas", "splash"):
        fn = functools.partial(registry.implementations("attention")[impl].load(), platform="tpu",
                               sliding_window=cfg.sliding_window, scale=cfg.head_dim ** -0.5)
        with jax.default_matmul_precision(step_cfg.matmul_precision):
            tpu_compile.compile_for(vjp_program(fn, (0, 1, 2, 3), n_inputs=4), (q, kv, kv, sinks, q), device)
    program, specs = forward_and_backward(registry.implementations("moe")["ragged_dot"].load(),
                                          kernel_cases("moe", "tiny", dtype="bfloat16")[0])
    with jax.default_matmul_precision(step_cfg.matmul_precision):
        tpu_compile.compile_for(program, specs, device)


# The xla set is compiled by the `torchlyra plan` test below (tests/test_plan_cli.py).
KERNEL_SETS = {"pallas": "pallas", "shipped": "attention=splash,cross_entropy=pallas,moe=megablox"}


@pytest.mark.parametrize("kernels", list(KERNEL_SETS))
def test_train_step_compiles_for_v5e(kernels):
    """The whole one-jit train step (model, backward, Muon + AdamW update) for one v5e chip, bf16
    compute, per kernel set, on a 2-layer `tiny` (one sliding and one full layer) at sequence 256,
    planned without weights. The pallas set compiles the SFT step (packed rows: segment-masked
    attention with per-row block bounds, loss weights); its kernels' unpacked forms are compiled
    one by one above."""
    from jax_bridge.plan import plan

    result = plan("tiny", "v5e:2x2", seq_len=256, batch_size=8, kernels=KERNEL_SETS[kernels],
                  model_overrides={"n_layers": 2}, packed=kernels == "pallas")
    assert result.error is None and result.fits and result.packed == (kernels == "pallas")
    assert result.compute_dtype == "bfloat16" and result.matmul_precision == "default"
    assert set(result.kernels.values()) <= {"xla", "pallas", "splash", "megablox"}
    params_f32 = result.params * 4
    assert result.argument_bytes >= 2 * params_f32          # parameters + Muon (1) / Adam (2) state, float32
    assert result.alias_bytes >= 2 * params_f32             # the state is donated
    assert result.total_bytes == (result.argument_bytes + result.output_bytes - result.alias_bytes
                                  + result.temp_bytes) < result.hbm_bytes


def test_topology_errors_are_one_line():
    with pytest.raises(tpu_compile.TopologyError, match="unknown TPU topology 'v9z:2x2'.*examples"):
        tpu_compile.topology_devices("v9z:2x2")


def test_ordinary_runs_stay_on_cpu_and_hbm_is_the_compilers():
    assert jax.default_backend() == "cpu"
    device = tpu_compile.device_of("v5e:2x2")
    assert tpu_compile.generation(device) == "v5e"
    assert 15 << 30 < tpu_compile.hbm_bytes(device) <= 16 << 30    # v5e: 16 GiB per chip


def test_segment_masked_attention_compiles_for_tpu():
    """Packed rows (issue 21): the segment-masked kernels, forward and backward, through Mosaic
    for v6e (pallas: per-row block bounds as scalar-prefetch arguments; splash: its SegmentIds),
    one small case each at a length with two 128-wide tiles per side."""
    b, hq, hkv, t, d = 2, 4, 2, 256, 64
    q = jax.ShapeDtypeStruct((b, hq, t, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, hkv, t, d), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((hq,), jnp.float32)
    segments = jax.ShapeDtypeStruct((b, t), jnp.int32)
    device = tpu_compile.device_of("v6e:2x2")
    for impl, expected in (("pallas", 3), ("splash", 3)):
        fn = registry.implementations("attention")[impl].load()
        op = lambda q, k, v, s, ids: fn(q, k, v, s, sliding_window=0, scale=d ** -0.5, platform="tpu",
                                        block_q=128, block_kv=128, segment_ids=ids) if impl == "pallas" else \
            fn(q, k, v, s, sliding_window=0, scale=d ** -0.5, platform="tpu", segment_ids=ids)

        def program(q, k, v, s, ids, dout, op=op):
            out, vjp = jax.vjp(lambda *a: op(*a, ids), q, k, v, s)
            return out, vjp(dout)
        _, stats = tpu_compile.compile_for(program, (q, kv, kv, sinks, segments, q), device)
        assert len(stats.kernels) >= expected, (impl, stats.kernels)
