"""The real TPU compiler accepts every Pallas kernel and the whole train step.

`jax.export` only lowers a kernel; Mosaic's compiler (block layouts, VMEM, matmul operand types)
runs only inside libtpu. libtpu compiles here for deviceless topologies (compile-only TPU devices,
jax_bridge/tpu_compile.py): nothing runs, so this checks what a TPU run would compile. Kernels:
forward and forward+backward in one program per (generation, implementation, shape set), bf16,
at the tiny, Lyra Small and gpt-oss-20b shapes of `torchlyra bench kernels` (their figures:
`torchlyra bench kernels --platform tpu`, BENCHMARKS.md). Train step: `jax_bridge.plan` on a
small config, once per kernel set.
"""
import contextlib
import functools
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import registry, tpu_compile
from pallas_kernels.memory import vjp_program
from pallas_kernels.moe import fused_tiles
from train.bench.kernel_cases import float_positions, kernel_cases

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
# Our kernels choose no tile by generation; what differs is Mosaic's lowering per generation and
# the compiler's default scoped VMEM limit (attention keeps it), v5e's the smaller (16 MiB against
# 32). So the real shapes compile on v5e (Lyra Small and gpt-oss-20b: the VMEM verdict that binds)
# and v6e compiles tiny and Lyra Small;
# v6e at gpt-oss-20b's shapes is in BENCHMARKS.md (`torchlyra bench kernels --platform tpu`). The
# jax-shipped kernels (splash, megablox: our code only wraps them) compile at Lyra Small's shapes
# on v5e, where their wrappers' block choices are exercised.
SHIPPED = {"splash", "megablox"}
CASES = [(t, s, op, impl) for t in GENERATIONS for s in SHAPES for op, impl in PALLAS
         if (t, s) not in {("v5e:2x2", "tiny"), ("v6e:2x2", "gpt-oss-20b")}
         and (impl not in SHIPPED or (t, s) == ("v5e:2x2", "lyra-small"))]
# The MXFP4 expert kernel (a frozen base's experts) at tiny shapes on both generations; its
# gpt-oss-20b figures on both are in BENCHMARKS.md (`bench kernels --ops moe_mxfp4`).
CASES += [(t, "tiny", "moe_mxfp4", "pallas") for t in GENERATIONS]


@pytest.mark.parametrize("topology,shape,op,impl", CASES, ids=[f"{t}-{s}-{o}-{i}" for t, s, o, i in CASES])
def test_kernel_compiles_for_tpu_forward_and_backward(topology, shape, op, impl):
    """Compiled under the strictest ambient matmul precision ("highest", what float32 parity
    runs set): a kernel dot that inherited it would fail on bf16 operands ("Bad lhs type")."""
    case = kernel_cases(op, shape, windows=False, dtype="bfloat16")[0]
    fn = registry.implementations(op)[impl].load()
    program, specs = forward_and_backward(fn, case, platform="tpu")
    with jax.default_matmul_precision("highest"):
        _, stats = tpu_compile.compile_for(program, specs, tpu_compile.device_of(topology))
    # fwd + bwd kernels (the MXFP4 base gets no weight gradient: forward and dx only)
    assert len(stats.kernels) >= {"moe_mxfp4": 2, "moe": 3 if impl == "pallas" else 4}.get(op, 3), stats.kernels
    if impl == "pallas" and shape != "tiny":
        # Our kernels keep nothing of size [T, T], [N, V] or [M, I] in HBM (the references need GiBs
        # here): a regression such as a lane-replicated [B, H, T, 128] residual would show.
        assert stats.temp_bytes < 32 * MiB, f"{stats.temp_bytes / MiB:.1f} MiB of HBM temporaries"


def test_tokamax_peers_compile_with_its_mosaic_kernels_for_v5e():
    """`bench kernels`' tokamax rows on a TPU (train/bench/kernel_peers.py): each wrapper takes
    tokamax's Mosaic kernels, forward and backward, at the tiny shapes; its attention refuses a
    sliding window (that row records the refusal). tokamax checks the default device, so the
    compile-only v5e is made the default while tracing."""
    from train.bench import kernel_peers
    from train.bench.kernel_cases import concrete_inputs

    device = tpu_compile.device_of("v5e:2x2")
    for op in ("attention", "moe", "cross_entropy"):
        peer = kernel_peers.peer_of(op)
        for case in kernel_cases(op, "tiny", dtype="bfloat16"):
            fn = peer.build(case, kernel_peers.implementation(op, "tpu"))
            inputs = jax.eval_shape(lambda: peer.prepare(case, concrete_inputs(case)))
            op_fn = functools.partial(fn, **case.kwargs)
            with jax.default_device(device):
                if op == "attention" and case.dims["window"]:
                    with pytest.raises(NotImplementedError, match="k_start"):
                        jax.eval_shape(op_fn, *inputs)
                    continue
                outs = jax.tree.leaves(jax.eval_shape(op_fn, *inputs))
                vjp = vjp_program(op_fn, peer.floats(case), n_inputs=len(inputs))
                specs = list(inputs) + [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
                _, stats = tpu_compile.compile_for(vjp, specs, device)
            assert len(stats.kernels) >= 2, (op, case.label, stats.kernels)


def test_bf16_attention_compiles_under_the_steps_highest_precision():
    """A past bug: the step ran its forward under jax.default_matmul_precision("highest"); the
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


def parity_kernel_programs(dtype: str):
    """The Pallas kernels `torchlyra parity --preset tiny` runs on a TPU, at its shapes there and
    with its tiles there (parity.inputs.parity_shape("tpu")), each forward and backward: (name,
    program, input and cotangent specs). Attention (ours and splash) on packed rows (segment ids)
    in a sliding layer, cross-entropy, the fused MoE on the routed rows. Left out for time (~2x
    the compile): the full-causal layer (the same blocks: Mosaic's rules are about block shapes;
    its kernels compile in test_segment_masked_attention_compiles_for_tpu) and megablox (jax's gmm,
    whose row tile 128 is its own default tiling; it compiles in the `shipped` step below)."""
    from parity.inputs import PARITY_BATCH, PARITY_WINDOW, parity_config, parity_shape
    from torch_model.config import get_preset

    shape, cfg = parity_shape("tpu"), parity_config(get_preset("tiny"))
    options = registry.parse_kernel_options(shape.kernel_options)
    b, t = PARITY_BATCH, shape.seq_len
    e, h, i, n = cfg.n_experts, cfg.d_model, cfg.expert_dim, b * t
    spec = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))  # noqa: E731

    def kernel(op, impl):
        return registry.implementations(op)[impl].bind("tpu", options.get(op, {}).get(impl, {}), "v5e")

    problems = []
    for impl in ("pallas", "splash"):
        def attention(q, k, v, sinks, ids, fn=kernel("attention", impl)):
            return fn(q, k, v, sinks, sliding_window=PARITY_WINDOW, scale=cfg.head_dim ** -0.5, segment_ids=ids)
        q, kv = spec((b, cfg.n_heads, t, cfg.head_dim)), spec((b, cfg.n_kv_heads, t, cfg.head_dim))
        problems.append((f"attention={impl}", attention,
                         [q, kv, kv, spec((cfg.n_heads,), "float32"), spec((b, t), "int32")], (0, 1, 2, 3)))
    ce = kernel("cross_entropy", "pallas")
    problems.append(("cross_entropy=pallas", lambda x, w, labels: ce(x, w, labels, ignore_index=-100),
                     [spec((n, h)), spec((cfg.vocab_size, h)), spec((n,), "int32")], (0, 1)))
    moe = kernel("moe", "pallas")

    def experts(x, groups, gate_up, gate_up_bias, down, down_bias):
        return moe(x, groups, gate_up, gate_up_bias, down, down_bias, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
                   up_shift=1.0)
    problems.append(("moe=pallas", experts, [spec((n * cfg.experts_per_token, h)), spec((e,), "int32"),
                                             spec((e, h, 2 * i)), spec((e, 2 * i)), spec((e, i, h)), spec((e, h))],
                     (0, 2, 3, 4, 5)))
    out = []
    for name, op, specs, diff in problems:
        outs = jax.tree.leaves(jax.eval_shape(op, *specs))
        out.append((name, vjp_program(op, diff, n_inputs=len(specs)),
                    specs + [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tiles_parity_picks_for_tpu_pass_mosaic_at_the_parity_shapes(dtype):
    """A past bug: the CPU's parity tiles (blocks of 16 and 32) broke Mosaic's block rules on the
    chip, so `torchlyra parity` errored before checking a kernel. The tiles it picks for TPU, at
    its TPU sequence, compile for a v5e chip (v5e:1x1): its Pallas kernels (parity_kernel_programs),
    forward and backward, in both compute dtypes, under the probes' ambient precision ("highest").
    One program per dtype (a refusal names its pallas_call)."""
    programs = parity_kernel_programs(dtype)
    specs = [s for _, _, program_specs in programs for s in program_specs]
    starts = np.cumsum([0] + [len(program_specs) for _, _, program_specs in programs])

    def every_kernel(*args):
        return [program(*args[a:z]) for (_, program, _), a, z in zip(programs, starts[:-1], starts[1:])]

    with jax.default_matmul_precision("highest"):
        _, stats = tpu_compile.compile_for(every_kernel, specs, tpu_compile.device_of("v5e:1x1"))
    # forward and backward kernels: attention 3 per implementation, cross-entropy 2, fused MoE 3
    assert len(stats.kernels) >= 2 * 3 + 2 + 3, stats.kernels


# The xla set is compiled by the `torchlyra plan` test below (tests/test_plan_cli.py).
KERNEL_SETS = {"pallas": "pallas", "shipped": "attention=splash,cross_entropy=pallas,moe=megablox"}


@pytest.fixture(scope="module")
def tiny_step_plan(tmp_path_factory):
    """`torchlyra plan --roofline --json` of the whole one-jit train step (model, backward, Muon +
    AdamW update) for one v5e chip (the single-chip topology v5e:1x1, a v5litepod-1), bf16
    compute, per kernel set, on a 2-layer `tiny` (one sliding and one full layer) at sequence 256,
    2 rows per chip, planned without weights: one ~30 s compile per kernel set, shared by the
    tests below. The kernels' default tiles (`tiles=off`: a committed v5e table is tested in
    test_kernel_tiles.py). Returns (plan JSON, printed report)."""
    from train.cli import main

    cache = {}

    def get(kernels):
        if kernels not in cache:
            out = tmp_path_factory.mktemp("plan") / "plan.json"
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                rc = main(["plan", "--preset", "tiny", "--layers", "2", "--topology", "v5e:1x1", "--mesh", "none",
                           "--no-scan-layers", "--seq-len", "256", "--batch-size", "2",
                           "--kernels", KERNEL_SETS[kernels], "--kernel-options", "tiles=off", "--roofline",
                           "--json", str(out)]
                          + (["--packed"] if kernels == "pallas" else []))
            assert rc == 0
            cache[kernels] = json.loads(out.read_text()), printed.getvalue()
        return cache[kernels]
    return get


@pytest.mark.parametrize("kernels", list(KERNEL_SETS))
def test_train_step_compiles_for_v5e(kernels, tiny_step_plan):
    result, printed = tiny_step_plan(kernels)
    assert result["error"] is None and result["fits"] and result["packed"] == (kernels == "pallas")
    assert result["chips"] == 1 and result["topology"] == "v5e:1x1" and "1 x TPU v5 lite" in printed
    assert result["compute_dtype"] == "bfloat16" and result["matmul_precision"] == "default"
    assert set(result["kernels"].values()) <= {"xla", "pallas", "splash", "megablox"}
    params_f32 = result["params"] * 4
    assert result["argument_bytes"] >= 2 * params_f32          # parameters + Muon (1) / Adam (2) state, float32
    assert result["alias_bytes"] >= 2 * params_f32             # the state is donated
    assert result["total_bytes"] == (result["argument_bytes"] + result["output_bytes"] - result["alias_bytes"]
                                     + result["temp_bytes"]) < result["hbm_bytes"]


def test_plan_roofline_of_the_tiny_step(tiny_step_plan):
    """`plan --roofline`: the step's ops, split one by one out of the compiled program, sum to
    the program's totals within 1% (FLOPs and transcendentals: libtpu's, which hold our kernels'
    cost estimates; bytes: the generic analysis of the whole program); every kernel of ours is
    counted and named; the model FLOPs of train/run/flops.py and the MFU ceilings are reported."""
    from torch_model.config import get_preset
    from train.run.flops import flops_per_token

    plan, printed = tiny_step_plan("pallas")
    r = plan["roofline"]
    for name, ours, program in (("flops", r["once_flops"], r["compiler_flops"]),
                                ("transcendentals", r["once_transcendentals"], r["compiler_transcendentals"]),
                                ("bytes", r["once_bytes"], r["generic_bytes"])):
        assert abs(ours - program) <= 0.01 * program, (name, ours, program)
    rows = {row["category"]: row for row in r["rows"]}
    kernels = {"attention_fwd", "attention_dq", "attention_dkv", "cross_entropy_fwd_e",
               "cross_entropy_dw", "moe_fused_fwd", "moe_fused_dx", "moe_fused_dw"}
    assert {c.removeprefix("kernel: ") for c in rows if c.startswith("kernel: ")} == kernels
    assert all(rows[f"kernel: {k}"]["flops"] > 0 and not rows[f"kernel: {k}"]["note"] for k in kernels)
    assert {"matmul (XLA)", "optimizer: Newton-Schulz", "optimizer: other"} <= set(rows)
    assert r["kernels_without_estimate"] == r["unknown_trip_counts"] == r["unpriced_ops"] == []
    assert sum(row["seconds"] for row in r["rows"]) == pytest.approx(r["seconds"])
    assert 0 < r["memory_bound_share"] < 1 and len(r["top_memory_bound"]) == 5
    cfg = get_preset("tiny").replace(n_layers=2)
    assert r["model_flops"] == pytest.approx(flops_per_token(cfg, 256) * 2 * 256)     # 2 rows per chip
    # Roofline FLOPs hold the model's matmuls, the optimizer's and nothing skipped: at least the model's.
    assert r["flops"] >= r["model_flops"]
    assert r["mfu_ceiling"] == pytest.approx(r["model_flops"] / (r["seconds"] * 197e12))
    assert r["mfu_ceiling"] < r["model_mfu_ceiling"] <= 1
    assert r["tiles"]["attention.pallas"] == {"block_q": 128, "block_kv": 128}
    # the fused MoE's tiles as the kernel resolves them for this chip's rows (2 x 256 tokens x top-k)
    assert r["tiles"]["moe.pallas"] == fused_tiles(2 * 256 * cfg.experts_per_token, cfg.d_model, cfg.expert_dim,
                                                   jnp.bfloat16, num_experts=cfg.n_experts)
    assert "MFU ceiling" in printed and "Muon Newton-Schulz:" in printed and "agree within 1%" in printed


def test_plan_roofline_says_splash_has_no_cost_estimate(tiny_step_plan):
    """Splash's shipped kernels carry no cost estimate: the roofline counts them as zero and says so."""
    plan, printed = tiny_step_plan("shipped")
    r = plan["roofline"]
    assert r["kernels_without_estimate"] and all("splash" in k or "mha" in k or "gmm" in k
                                                 for k in r["kernels_without_estimate"])
    assert "no cost estimate" in printed and "splash" in printed


def test_topology_errors_are_one_line():
    with pytest.raises(tpu_compile.TopologyError, match="unknown TPU topology 'v9z:2x2'.*examples"):
        tpu_compile.topology_devices("v9z:2x2")


def test_single_chip_topologies_are_one_host_of_one_chip():
    """libtpu's default hosts hold 2x2x1 chips and refused v5e:1x1: a slice they do not
    divide is given hosts of its own size; the others keep libtpu's default layout."""
    assert tpu_compile.host_bounds("v5e:1x1") == tpu_compile.host_bounds("v6e:1x1") == {
        "chips_per_host_bounds": (1, 1, 1)}
    assert tpu_compile.host_bounds("v5e:2x2") == tpu_compile.host_bounds("v4:2x2x4") == {}
    assert tpu_compile.host_bounds("v9z") == {}                 # libtpu names what is wrong
    for name, kind in (("v5e:1x1", "v5e"), ("v6e:1x1", "v6e")):
        devices = tpu_compile.topology_devices(name)
        assert len(devices) == 1 and tpu_compile.generation(devices[0]) == kind


def test_ordinary_runs_stay_on_cpu_and_hbm_is_the_compilers():
    assert jax.default_backend() == "cpu"
    device = tpu_compile.device_of("v5e:2x2")
    assert tpu_compile.generation(device) == "v5e"
    assert 15 << 30 < tpu_compile.hbm_bytes(device) <= 16 << 30    # v5e: 16 GiB per chip


def test_segment_masked_attention_compiles_for_tpu():
    """Packed rows: the segment-masked kernels, forward and backward, through Mosaic
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
