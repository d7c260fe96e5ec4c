"""Grouped expert MLP (pallas_kernels/moe.py): every implementation against the reference.

All on CPU: the Pallas and megablox kernels run in interpret mode (the fused kernels also once in
the TPU-simulating interpreter), and HBM temp memory by compile-only memory analysis. The real
TPU compiler's verdict (Mosaic, VMEM): tests/test_tpu_compile.py. Inputs are scaled so the
pre-activations hit both clamps (gate > limit, |up| > limit) as well as the linear region.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import pallas_calls, rel_err
from pallas_kernels.memory import opaque_pallas_calls, temp_bytes, vjp_program
from pallas_kernels.moe import (
    COST_ROUTINGS,
    cost_routing,
    expert_of_rows,
    fused_tiles,
    group_metadata,
    moe_experts_megablox,
    moe_experts_pallas,
    moe_experts_reference,
    moe_experts_xla,
)
from pallas_kernels.moe_loop import moe_experts_loop

ALPHA, LIMIT = 1.702, 7.0
TOL = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (1e-2, 1e-2)}   # (forward, backward), relative


def make_group_sizes(rng, m: int, e: int, kind: str) -> np.ndarray:
    """'random': ragged sizes with at least one empty group when E > 1; 'one': every row in one
    group (a middle one, so empty groups sit on both sides)."""
    gs = np.zeros(e, np.int32)
    if kind == "one" or e == 1:
        gs[e // 2] = m
        return gs
    live = rng.choice(e, size=max(1, (e + 1) // 2), replace=False)   # the rest stay empty
    cuts = np.sort(rng.integers(0, m + 1, size=len(live) - 1))
    gs[np.sort(live)] = np.diff(np.concatenate([[0], cuts, [m]]))
    return gs


def clear_of_the_clamps(x, gate_up, bias, group_sizes, cast, margin: float = 1e-3):
    """The gate_up bias [E, 2I], cast, moved until no pre-activation lies within `margin` of the
    clamp's kinks (gate at +LIMIT, up at +-LIMIT). There the derivative jumps, and two correct
    float32 computations of the same pre-activation can round to opposite sides: on a TPU a
    value 3e-7 from the clamp (half a float32 ulp at 7) made the MXFP4 kernel's dx differ from
    its reference by rel 1.6e-3 in one row. x [M, H] and gate_up [E, H, 2I] are the values the
    kernels see (cast), pre-activations are taken in float64."""
    expert = np.repeat(np.arange(len(group_sizes)), np.asarray(group_sizes))
    x64, w64 = np.asarray(x, np.float64)[:len(expert)], np.asarray(gate_up, np.float64)
    product = np.zeros((len(expert), w64.shape[-1]))
    for e in np.unique(expert):
        product[expert == e] = x64[expert == e] @ w64[e]
    bias = np.asarray(bias, np.float64)
    for _ in range(8):
        pre = product + np.asarray(cast(bias), np.float64)[expert]
        near = np.zeros(pre.shape, bool)
        near[:, ::2] = np.abs(pre[:, ::2] - LIMIT) < margin
        near[:, 1::2] = np.abs(np.abs(pre[:, 1::2]) - LIMIT) < margin
        if not near.any():
            return cast(bias)
        rows, cols = np.nonzero(near)
        bias = bias.copy()
        bias[expert[rows], cols] += 0.03          # a step that survives a cast to bf16 (ulp 2**-7 at 1)
    raise AssertionError("test inputs: pre-activations stay at the clamp")


def make_inputs(seed: int, m: int, h: int, i: int, e: int, kind: str, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    # Pre-activation std ~8 (x std 2, weights 4/sqrt(H)): a good share beyond +-7 on both halves.
    x = 2.0 * rng.standard_normal((m, h))
    gate_up = 4.0 / np.sqrt(h) * rng.standard_normal((e, h, 2 * i))
    gate_up_bias = rng.standard_normal((e, 2 * i))
    down = rng.standard_normal((e, i, h)) / np.sqrt(i)
    down_bias = rng.standard_normal((e, h))
    dy = rng.standard_normal((m, h))    # cotangent for the backward checks
    cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
    gs = jnp.asarray(make_group_sizes(rng, m, e, kind))
    x, gate_up = cast(x), cast(gate_up)
    gate_up_bias = clear_of_the_clamps(x, gate_up, gate_up_bias, gs, cast)
    return (x, gs, gate_up, gate_up_bias, cast(down), cast(down_bias)), cast(dy)


def value_and_grads(fn, args, dy):
    """One jitted program: output and the gradients of <y, dy> for x, gate_up, gate_up_bias,
    down, down_bias."""
    x, gs, gate_up, gate_up_bias, down, down_bias = args

    def loss(x, gate_up, gate_up_bias, down, down_bias):
        y = fn(x, gs, gate_up, gate_up_bias, down, down_bias)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    grads, y = jax.jit(grad)(x, gate_up, gate_up_bias, down, down_bias)
    return y, grads


def naive_moe(x, group_sizes, gate_up, gate_up_bias, down, down_bias, swiglu: bool = False):
    """Row by row in float64 numpy: the definition (swiglu: silu(gate) * up, transformers' MoE
    families, instead of GPT-OSS's clamped activation)."""
    x, gate_up, gate_up_bias, down, down_bias = (np.asarray(a, np.float64) for a in
                                                 (x, gate_up, gate_up_bias, down, down_bias))
    expert = np.repeat(np.arange(len(group_sizes)), np.asarray(group_sizes))
    out = np.zeros_like(x)
    for r, e in enumerate(expert):
        gu = x[r] @ gate_up[e] + gate_up_bias[e]
        if swiglu:
            h = gu[1::2] * gu[::2] / (1.0 + np.exp(-gu[::2]))
        else:
            gate, up = np.minimum(gu[::2], LIMIT), np.clip(gu[1::2], -LIMIT, LIMIT)
            h = (up + 1.0) * gate / (1.0 + np.exp(-ALPHA * gate))
        out[r] = h @ down[e] + down_bias[e]
    return out


# ---------------------------------------------------------------------------------------------
# The reference and its oracles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,m,h,i,e,kind", [(0, 37, 32, 16, 3, "random"), (1, 200, 64, 48, 8, "random"),
                                               (2, 64, 32, 16, 3, "one")])
def test_reference_matches_naive_loop(seed, m, h, i, e, kind):
    args, _ = make_inputs(seed, m, h, i, e, kind)
    y = jax.jit(moe_experts_reference)(*args)
    assert rel_err(y, naive_moe(*args)) <= 1e-5


def test_inputs_hit_both_clamps():
    args, _ = make_inputs(1, 200, 64, 48, 8, "random")
    x, gs, gate_up, gate_up_bias, _, _ = args
    expert = np.asarray(expert_of_rows(gs, x.shape[0]))
    gu = np.einsum("mh,mhn->mn", np.asarray(x), np.asarray(gate_up)[expert]) + np.asarray(gate_up_bias)[expert]
    gate, up = gu[:, ::2], gu[:, 1::2]
    assert (gate > LIMIT).mean() > 0.05 and (up > LIMIT).mean() > 0.05 and (up < -LIMIT).mean() > 0.05
    assert (np.abs(up) < LIMIT).mean() > 0.3 and (gate < LIMIT).mean() > 0.3


def test_reference_matches_torch_op():
    torch = pytest.importorskip("torch")
    from torch_model import ops

    args, dy = make_inputs(3, 50, 32, 16, 4, "random")
    t_args = [torch.tensor(np.asarray(a)) for a in args]
    leaves = [t_args[0]] + t_args[2:]
    for t in leaves:
        t.requires_grad_(True)
    t_y = ops.moe_experts_reference(t_args[0], t_args[1], *t_args[2:], ALPHA, LIMIT)
    t_grads = torch.autograd.grad(t_y, leaves, torch.tensor(np.asarray(dy)))
    y, grads = value_and_grads(moe_experts_reference, args, dy)
    assert rel_err(y, t_y.detach().numpy()) <= 1e-5
    for g, tg in zip(grads, t_grads):
        assert rel_err(g, tg.numpy()) <= 1e-4


def test_group_metadata_enumerates_tile_expert_pairs():
    """Every (expert, row tile) pair with rows, in order, then the last one repeated; as many items
    as the rows allow: at most num_tiles + G - 1, G the groups that can hold rows (all E where
    empty groups are visited; else at most M: a decode step's 2 rows, 2 items of 8 experts). Rows
    in one tile (a decode step's) take a shorter path: every item is tile 0."""
    rng = np.random.default_rng(4)
    meta_fn = jax.jit(group_metadata, static_argnums=(1, 2), static_argnames="visit_empty")
    for tm, e, m, kind in [(1, 3, 7, "random"), (3, 5, 20, "random"), (8, 6, 37, "random"), (8, 4, 32, "random"),
                           (8, 6, 37, "one"), (8, 4, 32, "one"), (4, 1, 9, "one"), (16, 8, 2, "random"),
                           (16, 8, 3, "one"), (8, 6, 4, "random"), (2, 8, 5, "random"),
                           (8, 4, 8, "random"), (4, 5, 1, "one")] * 3:        # the last 5: all rows one tile
        gs = make_group_sizes(rng, m, e, kind)
        num_tiles = -(-m // tm)
        for visit_empty in (False, True):
            meta = jax.tree.map(np.asarray, meta_fn(jnp.asarray(gs), m, tm, visit_empty=visit_empty))
            # The host's NumPy version (the cost estimates' layout) gives the same items.
            on_host = group_metadata(np.asarray(gs), m, tm, visit_empty=visit_empty, xp=np)
            for field, a, b in zip(meta._fields, meta, on_host):
                assert b.dtype == np.int32 and np.array_equal(a, b), f"{field}: NumPy {b} vs JAX {a}"
            starts = np.concatenate([[0], np.cumsum(gs)])
            want = []
            for g in range(e):
                if gs[g]:
                    want += [(g, t) for t in range(starts[g] // tm, (starts[g + 1] - 1) // tm + 1)]
                elif visit_empty:
                    want.append((g, min(starts[g] // tm, num_tiles - 1)))
            n = int(meta.num_active[0])
            assert meta.group_ids.shape == (num_tiles + (e if visit_empty else min(e, m)) - 1,)
            assert list(zip(meta.group_ids[:n], meta.tile_ids[:n])) == want
            # Padding items repeat the last real one (same blocks, no extra work or writes).
            assert (meta.group_ids[n:] == meta.group_ids[n - 1]).all()
            assert (meta.tile_ids[n:] == meta.tile_ids[n - 1]).all()
            np.testing.assert_array_equal(meta.offsets, starts)


# ---------------------------------------------------------------------------------------------
# Implementations against the reference: output and all five gradients
# ---------------------------------------------------------------------------------------------
# (id, seed, M, H, I, E, group kind, dtype, tiling (tm, th, ti))
CASES = [
    ("m37-e3-f32", 0, 37, 32, 16, 3, "random", jnp.float32, None),              # M not a tile multiple
    ("m200-e8-f32-small-tiles", 1, 200, 64, 48, 8, "random", jnp.float32, (16, 16, 8)),   # every dim tiled
    ("m64-e1-f32", 2, 64, 32, 48, 1, "one", jnp.float32, (8, 16, 16)),
    ("m64-e3-one-group-bf16", 3, 64, 64, 16, 3, "one", jnp.bfloat16, None),
    ("m200-e8-bf16", 4, 200, 64, 48, 8, "random", jnp.bfloat16, (16, 32, 16)),
    ("m3-e8-decode-bf16", 5, 3, 64, 48, 8, "random", jnp.bfloat16, None),       # fewer rows than experts
]

IMPLS = {
    "xla": lambda tiling: functools.partial(moe_experts_xla, block_m=tiling and tiling[0]),
    "loop": lambda tiling: functools.partial(moe_experts_loop, block_m=tiling and tiling[0],
                                             block_m_tail=tiling and tiling[2]),
    "pallas": lambda tiling: functools.partial(moe_experts_pallas, block_m=tiling and tiling[0],
                                               block_i=tiling and tiling[2], platform="cpu",
                                               gate_up_layout="blocked"),    # (too few rows for its default)
    "pallas-interleaved": lambda tiling: functools.partial(moe_experts_pallas, block_m=tiling and tiling[0],
                                                           block_i=tiling and tiling[2], platform="cpu",
                                                           gate_up_layout="interleaved"),
    "megablox": lambda tiling: functools.partial(moe_experts_megablox, block_m=tiling and tiling[0],
                                                 block_k=tiling and tiling[1], platform="cpu"),
}


@functools.lru_cache(maxsize=None)
def case_data(case_id):
    _, seed, m, h, i, e, kind, dtype, tiling = next(c for c in CASES if c[0] == case_id)
    args, dy = make_inputs(seed, m, h, i, e, kind, dtype)
    # Oracle: the reference in float32 on the same (possibly bf16-rounded) values. The bf16
    # reference itself sums bias gradients in bf16 (its gather's transpose) and is off ~1e-2.
    up = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
    y_ref, g_ref = value_and_grads(moe_experts_reference, up, dy.astype(jnp.float32))
    return args, dy, dtype, tiling, y_ref, g_ref


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_matches_reference(impl, case_id):
    args, dy, dtype, tiling, y_ref, g_ref = case_data(case_id)
    y, grads = value_and_grads(IMPLS[impl](tiling), args, dy)
    fwd_tol, bwd_tol = TOL[dtype]
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert rel_err(y, y_ref) <= fwd_tol
    names = ("x", "gate_up", "gate_up_bias", "down", "down_bias")
    for name, g, g0, a in zip(names, grads, g_ref, (args[0],) + args[2:]):
        assert g.shape == a.shape and g.dtype == a.dtype, name
        assert rel_err(g, g0) <= bwd_tol, (name, rel_err(g, g0))


# SwiGLU through the op's constants (torch_model/transformers_lm.py SWIGLU): no clamp, no shift.
SWIGLU = dict(alpha=1.0, limit=float("inf"), up_shift=0.0)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_swiglu_constants_match_the_definition_forward_and_backward(impl):
    args, dy = make_inputs(5, 37, 32, 16, 3, "random")
    assert rel_err(jax.jit(functools.partial(moe_experts_reference, **SWIGLU))(*args),
                   naive_moe(*args, swiglu=True)) <= 1e-5
    y_ref, g_ref = value_and_grads(functools.partial(moe_experts_reference, **SWIGLU), args, dy)
    y, grads = value_and_grads(functools.partial(IMPLS[impl]((8, 16, 8)), **SWIGLU), args, dy)
    assert rel_err(y, y_ref) <= 1e-5
    for name, g, g0 in zip(("x", "gate_up", "gate_up_bias", "down", "down_bias"), grads, g_ref):
        assert rel_err(g, g0) <= 1e-4, (name, rel_err(g, g0))


@pytest.mark.parametrize("fn", [moe_experts_pallas, moe_experts_megablox])
def test_tpu_only_kernels_refuse_gpu_naming_the_alternatives(fn):
    args, _ = make_inputs(0, 8, 32, 16, 2, "random")
    with pytest.raises(NotImplementedError, match="no gpu kernel.*xla.*ragged_dot"):
        fn(*args, platform="gpu")


def moe_specs(m, h, i, e, dt=jnp.bfloat16):
    return tuple(jax.ShapeDtypeStruct(s, d) for s, d in [((m, h), dt), ((e,), jnp.int32), ((e, h, 2 * i), dt),
                                                          ((e, 2 * i), dt), ((e, i, h), dt), ((e, h), dt)])


# ---------------------------------------------------------------------------------------------
# Memory (compile-only XLA temp bytes; pallas_kernels/memory.py)
# ---------------------------------------------------------------------------------------------
def test_vjp_program_gives_the_cotangents():
    args, dy = make_inputs(5, 24, 16, 8, 2, "random")
    program = vjp_program(moe_experts_reference, (0, 2, 3, 4, 5))
    _, got = jax.jit(program)(*args, dy)
    _, want = value_and_grads(moe_experts_reference, args, dy)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-6


def test_the_xla_implementation_saves_no_gathered_tile_or_weight_for_its_backward():
    """`xla` gathers every work item's row tile and expert weights ([W, t, H], [W, H, 2I] and
    [W, I, H], W = tiles + E - 1 items) and forms [W, t, 2I] pre-activations: its backward forms
    them again (jax.checkpoint), so what the vjp holds is no larger than its inputs (held, they
    took ~1.9 GiB per layer of small-o200k at 16 x 2048)."""
    args, dy = make_inputs(3, 64, 16, 24, 4, "random")
    x, gs, gate_up, gate_up_bias, down, down_bias = args
    f = lambda x, gu, gub, d, db: moe_experts_xla(x, gs, gu, gub, d, db, block_m=8)  # noqa: E731
    _, vjp = jax.vjp(f, x, gate_up, gate_up_bias, down, down_bias)
    largest_input = max(a.size for a in (x, gate_up, down))
    saved = sorted((leaf.size, leaf.shape) for leaf in jax.tree_util.tree_leaves(vjp))
    assert saved and saved[-1][0] <= largest_input, saved[-3:]
    # the same function without the checkpoint would hold a gathered [W, H, 2I] (W = 8 + 3 > E = 4)
    assert 11 * 16 * 48 > largest_input


def test_opaque_mode_restores_pallas_call():
    from jax.experimental import pallas as pl
    original = pl.pallas_call
    with opaque_pallas_calls():
        assert pl.pallas_call is not original
    assert pl.pallas_call is original


@pytest.mark.parametrize("layout", ["interleaved", "blocked"])
def test_fused_pallas_keeps_no_intermediate_in_hbm(layout):
    """Forward+backward temp bytes of the fused kernel (opaque measure: what the TPU program
    allocates around its kernels) against the ragged_dot reference and megablox (which keeps the
    [M, 2I] pre-activation), at a mid-size shape. Any [M, I] buffer (h, or a residual) would blow
    the bound of a quarter of one [M, I] buffer; so would a permuted copy of gate_up ([E, H, 2I],
    2x that here), which only the blocked layout makes, once. (The TPU compiler's own figures:
    tests/test_tpu_compile.py.)"""
    m, h, i, e = 4096, 512, 256, 8
    specs = moe_specs(m, h, i, e)
    dy = jax.ShapeDtypeStruct((m, h), jnp.bfloat16)
    vjp = lambda fn: vjp_program(fn, (0, 2, 3, 4, 5))
    fused = functools.partial(moe_experts_pallas, platform="cpu", gate_up_layout=layout)
    copy = e * h * 2 * i * 2 if layout == "blocked" else 0     # the permuted gate_up, bf16
    megablox = functools.partial(moe_experts_megablox, platform="cpu")
    m_by_i = m * i * 2   # one [M, I] bf16 buffer
    ref_fb = temp_bytes(vjp(moe_experts_reference), *specs, dy)
    with opaque_pallas_calls():
        fused_fb = temp_bytes(vjp(fused), *specs, dy)
        fused_f = temp_bytes(fused, *specs)
        megablox_fb = temp_bytes(vjp(megablox), *specs, dy)
    assert fused_fb < copy + m_by_i / 4 and fused_f < copy + m_by_i / 4, (fused_f, fused_fb)
    assert fused_fb < 1e-3 * ref_fb + copy, (fused_fb, ref_fb)
    assert megablox_fb > m_by_i   # the measure does see an [M, I]-sized buffer when there is one


@pytest.mark.parametrize("layout", ["blocked", "interleaved"])
def test_fused_pallas_in_tpu_interpreter(layout):
    """The fused kernels under the TPU-simulating interpreter with the TPU tiling rules (tm a
    multiple of 16, ti of 64, two I tiles): NaN-filled buffers catch an output block that is
    read before it is written, and the race detector runs with two cores (the dW kernel's I
    axis is 'parallel')."""
    from jax.experimental.pallas import tpu as pltpu
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    args, dy = make_inputs(6, 40, 128, 256, 3, "random")
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", num_cores_or_threads=2)
    fused = functools.partial(moe_experts_pallas, block_m=32, block_i=128, platform="tpu", interpret=params,
                              gate_up_layout=layout)
    y, grads = value_and_grads(fused, args, dy)
    y_ref, g_ref = value_and_grads(moe_experts_reference, args, dy)
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
    assert rel_err(y, y_ref) <= 1e-5
    for g, g0 in zip(grads, g_ref):
        assert rel_err(g, g0) <= 1e-4


@pytest.mark.parametrize("block_i,block_i_dw,block_m_dw", [(256, 64, 32), (64, 128, 32), (64, 128, 16)],
                         ids=["rows-whole-I", "dw-wider", "dw-shorter-rows"])
def test_fused_pallas_with_its_own_dw_tiles(block_i, block_i_dw, block_m_dw):
    """The row kernels (forward, dx) and the dW kernel on different I tiles (as the default
    tiling picks when only dW's accumulators outgrow VMEM) and row tiles (the default where I is
    tiled: taller rows for the row kernels), with the TPU tiling rules in the generic
    interpreter: the output and all five gradients are the reference's."""
    args, dy = make_inputs(8, 40, 128, 256, 3, "random")
    fused = functools.partial(moe_experts_pallas, block_m=32, block_i=block_i, block_i_dw=block_i_dw,
                              block_m_dw=block_m_dw, platform="tpu", interpret="generic")
    grids = {p["name"]: p["grid_mapping"].grid for p in pallas_calls(
        jax.grad(lambda *a: fused(*a).astype(jnp.float32).sum(), argnums=(0, 2, 3, 4, 5)), *args)}
    assert grids["moe_fused_fwd"][1] == grids["moe_fused_dx"][1] == 256 // block_i   # I tiles per item
    assert grids["moe_fused_dw"][0] == 256 // block_i_dw
    # work items: row tiles + experts - 1
    assert grids["moe_fused_fwd"][0] == -(-40 // 32) + 2 and grids["moe_fused_dw"][1] == -(-40 // block_m_dw) + 2
    y, grads = value_and_grads(fused, args, dy)
    y_ref, g_ref = value_and_grads(moe_experts_reference, args, dy)
    assert rel_err(y, y_ref) <= 1e-5
    for g, g0 in zip(grads, g_ref):
        assert rel_err(g, g0) <= 1e-4


def test_the_gate_up_layout_is_blocked_where_one_lane_aligned_i_tile_serves_all_three_kernels():
    """Blocked ([gate | up] per I tile, no pair matmuls) needs the row kernels' and the dW
    kernel's I tile equal, on TPU a multiple of 128, and rows enough to amortize its copy of
    gate_up; elsewhere interleaved; asked for where the tiles forbid it: refused, naming why."""
    tiles = lambda m=65536, **kw: fused_tiles(m, 512, 1024, jnp.bfloat16, num_experts=8, **kw)["gate_up_layout"]
    assert tiles(block_m=512, block_i=128, block_m_dw=512) == "blocked"        # small-o200k's step, v5e tiles
    assert tiles(m=64, block_i=128) == "interleaved"                            # a decode step: the copy dominates
    assert tiles(m=64, block_i=128, gate_up_layout="blocked") == "blocked"      # allowed when asked
    assert fused_tiles(65536, 512, 384, jnp.bfloat16, block_i=192)["gate_up_layout"] == "interleaved"  # 192 lanes
    assert tiles(block_i=128, block_i_dw=256) == "interleaved"                   # two I tiles
    assert fused_tiles(4096, 128, 192, jnp.float32, platform="cpu", block_i=64,
                       num_experts=3)["gate_up_layout"] == "blocked"
    with pytest.raises(ValueError, match=r"gate_up_layout='blocked'.*I tile \(128\) differs from the dW kernel's \(256\)"):
        tiles(block_i=128, block_i_dw=256, gate_up_layout="blocked")
    with pytest.raises(ValueError, match="gate_up_layout must be one of interleaved, blocked, found 'split'"):
        tiles(gate_up_layout="split")


def test_megablox_pads_dims_without_a_128_divisor_on_tpu():
    """gpt-oss's H = I = 2880 has no multiple-of-128 divisor, which megablox's TPU tiles need:
    the wrapper zero-pads H and I (here 200 and 72) and slices the result back. Run with the TPU
    tiling rules in the generic interpreter."""
    args, dy = make_inputs(7, 40, 200, 72, 3, "random")
    fn = functools.partial(moe_experts_megablox, platform="tpu", interpret="generic")
    y, grads = value_and_grads(fn, args, dy)
    y_ref, g_ref = value_and_grads(moe_experts_reference, args, dy)
    assert rel_err(y, y_ref) <= 1e-5
    for g, g0 in zip(grads, g_ref):
        assert rel_err(g, g0) <= 1e-4


def test_fused_tiling_fits_tpu_rules_and_vmem_budget():
    """Each kernel's I tile follows the block rules and its own VMEM estimate; the row kernels
    (forward, dx) keep all of I where it fits them even when the dW kernel's accumulators need
    a smaller tile (H 2048, I 512: rows 512 whole, dW 256), so they fetch an expert's
    weights once per expert, not once per row tile; where I does not fit whole, they take
    512-row tiles (fewer passes over the weights) while the dW kernel keeps 256. The budget is
    7/8 of the target's VMEM when the kernel is told it (64 MiB when not)."""
    from pallas_kernels.moe import _fused_rows_vmem_bytes, _fused_vmem_bytes, _resolve_fused_tiling

    for capacity, budget in [(None, 56 << 20), (16 << 20, 14 << 20), (64 << 20, 56 << 20), (128 << 20, 112 << 20)]:
        for m, h, i, dt in [(32768, 2048, 384, jnp.bfloat16), (32768, 2048, 384, jnp.float32),
                            (4096, 2880, 2880, jnp.bfloat16), (37, 64, 48, jnp.bfloat16),
                            (5000, 4096, 1000, jnp.bfloat16), (32768, 2048, 512, jnp.bfloat16)]:
            tm, ti, tm_w, ti_w, ip = _resolve_fused_tiling(None, None, "tpu", m, h, i, dt, vmem_capacity=capacity)
            for t in (ti, ti_w):
                assert tm % 16 == 0 and tm_w % 16 == 0 and ip % t == 0 and (t == ip or t % 64 == 0) and ip >= i
            assert (ip == i) or ip % 128 == 0
            itemsize = jnp.dtype(dt).itemsize
            assert _fused_vmem_bytes(tm_w, h, ti_w, itemsize) <= budget, (capacity, m, h, i)
            assert _fused_rows_vmem_bytes(tm, h, ti, itemsize) <= budget, (capacity, m, h, i)
            assert ti == ip or tm >= tm_w       # I tiled: the row kernels take taller row tiles
    # (tm, ti, tm_w, ti_w, padded I): Lyra Small, gpt-oss-20b (I tiled: 512-row tiles), I 512 at H 2048
    assert _resolve_fused_tiling(None, None, "tpu", 32768, 2048, 384, jnp.bfloat16) == (256, 384, 256, 384, 384)
    assert _resolve_fused_tiling(None, None, "tpu", 16384, 2880, 2880, jnp.bfloat16) == (512, 192, 256, 320, 2880)
    assert _resolve_fused_tiling(None, None, "tpu", 32768, 2048, 512, jnp.bfloat16) == (256, 512, 256, 256, 512)
    # told v6e's 128 MiB: gpt-oss-20b's dW takes I in 5 tiles, not 9 (it starts from all of I)
    assert _resolve_fused_tiling(None, None, "tpu", 16384, 2880, 2880, jnp.bfloat16,
                                 vmem_capacity=128 << 20) == (512, 320, 256, 576, 2880)
    tiles = _resolve_fused_tiling(None, 128, "tpu", 32768, 2048, 384, jnp.bfloat16)       # explicit I tile
    assert (tiles[1], tiles[3]) == (128, 128)
    tiles = _resolve_fused_tiling(384, None, "tpu", 16384, 2880, 2880, jnp.bfloat16, block_m_dw=128)
    assert (tiles[0], tiles[2]) == (384, 128)                                              # explicit row tiles


@pytest.mark.parametrize("block_i", [128, 256], ids=["two-i-tiles", "one-i-tile"])
def test_fused_cost_estimates_count_the_expert_weights_each_row_tile_streams(block_i):
    """The fused kernels' bytes, counted by hand for an evenly routed batch (the estimates'
    assumption: 256 rows, 4 experts of 64 = 2 row tiles of 32 each; 8 tiles + 3 spare work items,
    which repeat the last active one). With two I tiles every active work item streams its
    expert's gate_up and down blocks (the weights are re-read per row tile; the spare items keep
    the last block: nothing), except the block at the turn of the snake order, which an expert's
    second item starts on where its first ended; with one I tile a block is copied only when the
    expert changes."""
    m, h, i, e, tm = 256, 128, 256, 4, 32
    specs = moe_specs(m, h, i, e)
    fn = lambda x, gs, wu, bu, wd, bd: moe_experts_pallas(x, gs, wu, bu, wd, bd, platform="tpu", block_m=tm,  # noqa: E731
                                                          block_i=block_i).astype(jnp.float32).sum()
    estimates = {p["name"]: p["cost_estimate"] for p in pallas_calls(jax.grad(fn, argnums=(0, 2, 3, 4, 5)), *specs)}
    calls = {name: c.bytes_accessed for name, c in estimates.items()}
    # FLOPs: the 8 active items only (the spare ones skip their compute): 6, 10 and 12 M H I, and
    # (interleaved: 256 rows do not amortize the blocked layout's copy) the pair matmuls, 1, 2 and
    # 3 products of 4 M ti I (bf16: dx's spread takes two passes)
    assert [estimates[k].flops for k in ("moe_fused_fwd", "moe_fused_dx", "moe_fused_dw")] == \
        [6 * m * h * i + 4 * m * block_i * i, 10 * m * h * i + 8 * m * block_i * i, 12 * m * h * i + 12 * m * block_i * i]
    nj, items, tiles = i // block_i, m // tm + e - 1, m // tm
    rows = m * h * 2                                              # x, dy, y, dx: bf16
    w1, b1, w2, b2 = e * h * 2 * i * 2, e * 2 * i * 2, e * i * h * 2, e * h * 2
    blocks = tiles * nj - (tiles - e)                             # per item and I tile, less each expert's turn
    streamed = blocks * (w1 + b1 + w2) // (e * nj)
    prefetch = 4 * ((e + 1) + 2 * items + 1)                      # offsets, expert and tile ids, active
    assert tiles == 8 and calls["moe_fused_fwd"] == rows + streamed + b2 + rows + prefetch
    assert calls["moe_fused_dx"] == 2 * rows + streamed + rows + prefetch
    # dW: for each I tile the row tiles are walked again; each expert's blocks in once, out once
    assert calls["moe_fused_dw"] == nj * 2 * rows + 2 * (w1 + b1 + w2) + nj * e * h * 2 + prefetch


def test_fused_cost_estimates_can_assume_random_routing():
    """Under `cost_routing("random")` the estimates assume multinomial row counts (seeded): groups
    start mid-tile, and the tiles that straddle two experts compute for each, so each kernel counts
    the active items of those counts; evenly routed rows fill whole tiles here. The kernels' own
    program (grid, outputs) does not change, and the estimates are even again after the block."""
    m, h, i, e, tm = 256, 128, 128, 4, 64
    specs = moe_specs(m, h, i, e)
    fn = lambda x, gs, wu, bu, wd, bd: moe_experts_pallas(x, gs, wu, bu, wd, bd, platform="tpu",  # noqa: E731
                                                          block_m=tm, gate_up_layout="blocked"  # no pair matmuls
                                                          ).astype(jnp.float32).sum()

    def priced():
        calls = pallas_calls(jax.grad(fn, argnums=(0, 2, 3, 4, 5)), *specs)
        return {p["name"]: (p["cost_estimate"].flops, p["grid_mapping"].grid) for p in calls}

    sizes = np.random.default_rng(0).multinomial(m, np.full(e, 1 / e))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    straddled = len({(row // tm, g) for g in range(e) for row in range(starts[g], starts[g + 1])})  # (tile, expert)
    even = priced()
    with cost_routing("random"):
        random = priced()
    assert priced() == even
    for name, passes in (("moe_fused_fwd", 3), ("moe_fused_dx", 5), ("moe_fused_dw", 6)):
        assert even[name][0] == (m // tm) * tm * h * i * 2 * passes                  # 4 whole tiles
        assert random[name] == (straddled * tm * h * i * 2 * passes, even[name][1])  # same grid
    assert straddled > m // tm
    with pytest.raises(ValueError, match="must be one of even, random, found 'skewed'"):
        with cost_routing("skewed"):
            pass
    import argparse

    from train.run.plan import add_arguments

    plan_parser = argparse.ArgumentParser()
    add_arguments(plan_parser)                 # `plan --moe-routing` offers these
    assert [plan_parser.parse_args(["--moe-routing", r]).moe_routing for r in COST_ROUTINGS] == list(COST_ROUTINGS)



def test_a_tpu_kernel_is_told_the_vmem_of_the_generation_it_compiles_for():
    """jax's table of VMEM per core reaches a kernel with a `vmem_capacity_bytes` option through
    the registry's binding, on TPU only and under an explicit option; the fused MoE's VMEM limit
    stays within it."""
    from jax_bridge.registry import Implementation
    from jax_bridge.step import StepConfig
    from pallas_kernels.platform import vmem_capacity_bytes

    assert [vmem_capacity_bytes(g) for g in ("v4", "v5e", "v5p", "v6e", "v7x")] == [16 << 20, 128 << 20, 64 << 20,
                                                                                    128 << 20, 64 << 20]
    assert vmem_capacity_bytes(None) is None and vmem_capacity_bytes("v99") is None

    def kernel(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha=1.702, limit=7.0, up_shift=1.0,
               platform, vmem_capacity_bytes=None):        # the moe op's contract, and the target's keywords
        return platform, vmem_capacity_bytes

    impl = Implementation("moe", "probe", kernel)
    call = lambda bound: bound(*[0] * 6)
    assert call(impl.bind("tpu", {}, "v6e")) == ("tpu", 128 << 20)
    assert call(impl.bind("tpu", {"vmem_capacity_bytes": 1 << 20}, "v6e")) == ("tpu", 1 << 20)
    assert call(impl.bind("tpu", {}, None)) == ("tpu", None) and call(impl.bind("cpu", {}, "v6e")) == ("cpu", None)
    assert StepConfig(platform="tpu", tpu_generation="v5e").tpu_generation == "v5e"
    assert StepConfig(platform="cpu").tpu_generation is None
    with pytest.raises(ValueError, match="unknown TPU generation 'v99'"):
        StepConfig(platform="tpu", tpu_generation="v99")
    with pytest.raises(ValueError, match="for platform 'tpu', found 'cpu'"):
        StepConfig(platform="cpu", tpu_generation="v5e")


def test_the_decoder_traces_its_kernels_for_the_tpu_generation_it_is_given(monkeypatch):
    """The Decoder (generate, rollouts, `plan --rl`'s rollout) binds its kernels for the TPU
    generation given, as the train step does; none off TPU."""
    import contextlib

    import torch

    from jax_bridge import decoding, registry
    from jax_bridge.sampling import SamplingMode
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=2))
    seen = []

    class Traced(Exception):
        pass

    @contextlib.contextmanager
    def routed(*args, generation=None, **kwargs):
        seen.append(generation)
        raise Traced
        yield

    monkeypatch.setattr(registry, "routed", routed)
    decoder = decoding.Decoder(model, kernels="xla", platform="tpu", tpu_generation="v5e",
                               params=decoding.decoder_params(model, "bfloat16"))
    with pytest.raises(Traced):
        decoder.prefill_program(1, 8, 16, SamplingMode(greedy=True, top_k=0, top_p=False, penalty=False), decoding.stop_slots(1))
    assert seen == ["v5e"]
    with pytest.raises(ValueError, match="for platform 'tpu', found 'cpu'"):
        decoding.Decoder(model, platform="cpu", tpu_generation="v5e", params=decoding.decoder_params(model, "float32"))
