"""The MXFP4 expert MLP (pallas_kernels/moe_mxfp4.py): the fused kernel against its reference
(decode, then the bf16 expert computation), forward and backward, on fresh random MXFP4 weights;
the reference against the host codec and the row-by-row definition; the kernel's tile decode at
every scale byte; the cost estimate's 4.25 bits per weight. On CPU the kernels run in interpret
mode; the TPU compiler's verdict is in tests/test_tpu_compile.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from formats import mxfp4 as host_mxfp4
from helpers import pallas_calls, rel_err
from pallas_kernels.moe_mxfp4 import (
    _decode_tile,
    mxfp4_tiles,
    moe_mxfp4_pallas,
    moe_mxfp4_reference,
    moe_mxfp4_xla,
)
from test_kernel_moe import ALPHA, LIMIT, TOL, clear_of_the_clamps, make_group_sizes, naive_moe


def random_stack(rng, e: int, rows: int, k: int, scale_byte: int):
    """Random MXFP4 weights [E, rows, K] as (blocks [E, rows, K/2], scales [E, rows, K/32]):
    every code, scale bytes within 2 of `scale_byte` (values up to 6 * 2**(byte - 125))."""
    blocks = rng.integers(0, 256, (e, rows, k // 2), dtype=np.uint8)
    scales = rng.integers(scale_byte - 2, scale_byte + 3, (e, rows, k // 32), dtype=np.uint8)
    return jnp.asarray(blocks), jnp.asarray(scales)


def make_inputs(seed: int, m: int, h: int, i: int, e: int, dtype=jnp.float32, kind: str = "random"):
    """x, group sizes, the released-layout stacks and biases, and a cotangent dy. Scales are set
    so the pre-activations (std ~8) hit both clamps as well as the linear region."""
    rng = np.random.default_rng(seed)
    byte = lambda fan_in: 127 - 2 - int(np.round(np.log2(np.sqrt(fan_in))))   # values ~ 1/sqrt(fan_in)
    w1b, w1s = random_stack(rng, e, 2 * i, h, byte(h) + 1)
    w2b, w2s = random_stack(rng, e, h, i, byte(i))
    cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
    x = cast(2.0 * rng.standard_normal((m, h)))
    b1, b2 = rng.standard_normal((e, 2 * i)), cast(rng.standard_normal((e, h)))
    dy = cast(rng.standard_normal((m, h)))
    gs = jnp.asarray(make_group_sizes(rng, m, e, kind))
    b1 = clear_of_the_clamps(x, np.swapaxes(host_decoded(w1b, w1s), 1, 2), b1, gs, cast)
    return (x, gs, w1b, w1s, b1, w2b, w2s, b2), dy


def host_decoded(blocks, scales):
    """The host codec's float32 values [E, rows, K] of a [E, rows, K/2] stack."""
    b = np.asarray(blocks)
    return host_mxfp4.dequantize(b.reshape(*b.shape[:-1], -1, 16), np.asarray(scales))


def value_and_dx(fn, args, dy):
    x, *rest = args

    def loss(x):
        y = fn(x, *rest)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), dx = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    return y, dx


def test_reference_decodes_as_the_host_codec_and_matches_the_definition():
    """The oracle itself: the released orientation ([E, out, in] blocked along `in`) decoded by
    the host codec and run row by row in float64 gives the reference's output."""
    (x, gs, w1b, w1s, b1, w2b, w2s, b2), _ = make_inputs(0, 45, 64, 32, 3)
    gate_up = np.swapaxes(host_decoded(w1b, w1s), 1, 2)       # [E, H, 2I]
    down = np.swapaxes(host_decoded(w2b, w2s), 1, 2)          # [E, I, H]
    want = naive_moe(x, gs, gate_up, b1, down, b2)
    got = moe_mxfp4_reference(x, gs, w1b, w1s, b1, w2b, w2s, b2, alpha=ALPHA, limit=LIMIT)
    assert rel_err(got, want) < 1e-6


def test_inputs_hit_both_clamps():
    (x, gs, w1b, w1s, b1, _, _, _), _ = make_inputs(1, 64, 64, 32, 2)
    pre = np.einsum("mh,eih->mei", np.asarray(x), host_decoded(w1b, w1s)) + np.asarray(b1)[None]
    gate, up = pre[..., ::2], pre[..., 1::2]
    assert (gate > LIMIT).mean() > 0.05 and (np.abs(up) > LIMIT).mean() > 0.05 and (np.abs(up) < LIMIT).mean() > 0.3


# (m, h, i, e, tiles): ragged groups with empty ones; several I and H tiles; a row tile that
# overhangs M; hidden sizes (160: 80 lanes of bytes, 5 blocks) that no lane tile divides; a
# decode step's few rows.
CASES = [
    ("one-tile", 37, 64, 32, 3, {}),
    ("many-tiles", 200, 96, 64, 5, dict(block_m=64, block_i=16, block_h=32)),
    ("overhang", 130, 160, 96, 4, dict(block_i=32, block_h=64)),
    ("one-expert", 50, 64, 64, 4, dict(block_m=16, block_i=32, block_h=32)),
    ("decode", 3, 64, 32, 8, {}),           # fewer rows than experts: 3 work items, not 8
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name,m,h,i,e,tiles", CASES, ids=[c[0] for c in CASES])
def test_pallas_matches_the_reference_forward_and_backward(name, m, h, i, e, tiles, dtype):
    args, dy = make_inputs(hash(name) % 1000, m, h, i, e, dtype, kind="one" if name == "one-expert" else "random")
    y_ref, dx_ref = value_and_dx(lambda *a: moe_mxfp4_reference(*a, alpha=ALPHA, limit=LIMIT), args, dy)
    y, dx = value_and_dx(lambda *a: moe_mxfp4_pallas(*a, alpha=ALPHA, limit=LIMIT, platform="cpu", **tiles), args, dy)
    fwd_tol, bwd_tol = TOL[dtype]
    assert y.dtype == dtype and dx.dtype == dtype
    assert rel_err(y, y_ref) < fwd_tol and rel_err(dx, dx_ref) < bwd_tol


def test_xla_matches_the_reference_forward_and_backward():
    args, dy = make_inputs(3, 90, 64, 32, 4)
    y_ref, dx_ref = value_and_dx(lambda *a: moe_mxfp4_reference(*a, alpha=ALPHA, limit=LIMIT), args, dy)
    y, dx = value_and_dx(lambda *a: moe_mxfp4_xla(*a, alpha=ALPHA, limit=LIMIT), args, dy)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(dx, dx_ref) < 1e-4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("m, h, i, e, kind, chunk", [(1, 64, 32, 4, "random", None), (37, 64, 32, 3, "random", None),
                                                  (130, 160, 96, 4, "random", None), (50, 64, 64, 4, "one", 7)])
def test_loop_matches_the_reference_forward_and_backward(m, h, i, e, kind, chunk, dtype):
    """The CPU training path (`loop`: work items of one expert each, decoded as they run, and its
    written-out backward decoding them again): a row, ragged and empty groups, a hidden size no
    tile divides, every row in one expert with chunks that do not divide it; float32 and bf16."""
    from pallas_kernels.moe_mxfp4_loop import moe_mxfp4_loop

    args, dy = make_inputs(m + e, m, h, i, e, dtype, kind=kind)
    y_ref, dx_ref = value_and_dx(lambda *a: moe_mxfp4_reference(*a, alpha=ALPHA, limit=LIMIT), args, dy)
    y, dx = value_and_dx(lambda *a: moe_mxfp4_loop(*a, alpha=ALPHA, limit=LIMIT, chunk=chunk), args, dy)
    fwd_tol, bwd_tol = TOL[dtype]
    assert y.dtype == dtype and dx.dtype == dtype
    assert rel_err(y, y_ref) < fwd_tol and rel_err(dx, dx_ref) < bwd_tol


@pytest.mark.parametrize("m, e, kind, chunk", [(1, 4, "random", None), (7, 4, "random", None), (40, 8, "random", None),
                                            (90, 4, "one", 4), (33, 4, "random", 3)])
def test_decode_matches_the_reference_forward(m, e, kind, chunk):
    """Generation's `decode` implementation (each expert's bytes sliced and decoded alone as its
    rows come, in work items of `chunk` rows) equals the reference: a row, a decode step's few,
    ragged and empty groups, every row in one expert, chunks that do not divide the groups."""
    from pallas_kernels.moe_decode import moe_mxfp4_decode

    args, _ = make_inputs(m + e, m, 64, 32, e, kind=kind)
    y_ref = jax.jit(lambda *a: moe_mxfp4_reference(*a, alpha=ALPHA, limit=LIMIT))(*args)
    y = jax.jit(lambda *a: moe_mxfp4_decode(*a, alpha=ALPHA, limit=LIMIT, chunk=chunk))(*args)
    assert y.shape == y_ref.shape and rel_err(y, y_ref) < 1e-5


def test_the_frozen_base_gets_no_gradient():
    """Weights and biases are the frozen base: their gradients are zero in every implementation,
    so a caller cannot train them by accident through this op."""
    (x, gs, w1b, w1s, b1, w2b, w2s, b2), dy = make_inputs(4, 40, 64, 32, 2)
    from pallas_kernels.moe_mxfp4_loop import moe_mxfp4_loop

    for fn in (moe_mxfp4_reference, moe_mxfp4_xla, moe_mxfp4_loop, lambda *a: moe_mxfp4_pallas(*a, platform="cpu")):
        grads = jax.grad(lambda b1, b2: jnp.sum(fn(x, gs, w1b, w1s, b1, w2b, w2s, b2) * dy), argnums=(0, 1))(b1, b2)
        assert all(float(jnp.abs(g).max()) == 0.0 for g in grads)


def test_the_tile_decode_equals_the_host_codec_at_every_scale_byte():
    """The kernel's in-VMEM decode, both branches (scale bytes 2-252: the few-operation decode; a
    tile holding 0, 1 or 253: the general one), bit for bit against the host codec's float32
    values, for every code and every scale byte the codec accepts."""
    codes = np.arange(256, dtype=np.uint8)                          # every (low, high) nibble pair
    tiles = {"normal": np.arange(2, 253), "extreme": np.arange(0, 254)}
    for name, scale_bytes in tiles.items():
        rows = len(scale_bytes) if name == "normal" else 256
        scale_bytes = np.resize(scale_bytes, rows).astype(np.uint8)
        blocks = np.broadcast_to(codes[None, :], (rows, 256)).copy()         # [rows, K/2], K = 512
        scales = np.broadcast_to(scale_bytes[:, None], (rows, 16)).copy()    # [rows, K/32]
        if name == "extreme":     # the host refuses 253 with magnitudes 4 and 6: keep those codes off it
            big = np.isin(codes & 7, (6, 7)) | np.isin(codes >> 4 & 7, (6, 7))
            blocks[np.ix_(scale_bytes == 253, big)] = 0x11
        want = host_decoded(blocks[None], scales[None])[0]           # [rows, 512] float32

        def kernel(b_ref, s_ref, lo_ref, hi_ref):
            _decode_tile(b_ref, s_ref, lo_ref, hi_ref)

        lo, hi = pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16)] * 2,
                                interpret=True)(jnp.asarray(blocks), jnp.asarray(scales))
        got = np.stack([np.asarray(lo, np.float32), np.asarray(hi, np.float32)], axis=-1).reshape(rows, 512)
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (name, np.argwhere(~same)[:3])
        assert (np.signbit(got) == np.signbit(want)).all()          # -0.0 stays -0.0


def test_tiles_follow_the_tpu_rules():
    """Rows sit on lanes: a row tile is whole 128-lane chunks (Mosaic's strided loads take exactly
    128 lanes), even past a smaller M; I and H tiles divide their dimension (multiples of 16 and
    32: uint8 byte rows in 32-row tiles), else the whole one."""
    assert mxfp4_tiles(16384, 2880, 2880, "tpu") == {"block_m": 256, "block_i": 96, "block_h": 192}
    assert mxfp4_tiles(40, 2880, 2880, "tpu")["block_m"] == 128
    assert mxfp4_tiles(16384, 2880, 2880, "tpu", block_m=200)["block_m"] == 256
    assert mxfp4_tiles(100, 96, 48, "cpu", block_i=40, block_h=40) == {"block_m": 104, "block_i": 16, "block_h": 32}


def test_cost_estimate_counts_four_and_a_quarter_bits_per_weight():
    """Bytes of each kernel by hand for an evenly routed batch with one row tile per expert (the
    estimates' assumption): each expert's stacks stream once, as MXFP4 (half a byte per value
    plus a scale byte per 32 values: 4.25 bits per weight), never as bf16."""
    m, h, i, e, tm = 512, 128, 64, 4, 128
    specs = (jax.ShapeDtypeStruct((m, h), jnp.bfloat16), jax.ShapeDtypeStruct((e,), jnp.int32),
             jax.ShapeDtypeStruct((e, 2 * i, h // 2), jnp.uint8), jax.ShapeDtypeStruct((e, 2 * i, h // 32), jnp.uint8),
             jax.ShapeDtypeStruct((e, 2 * i), jnp.bfloat16), jax.ShapeDtypeStruct((e, h, i // 2), jnp.uint8),
             jax.ShapeDtypeStruct((e, h, i // 32), jnp.uint8), jax.ShapeDtypeStruct((e, h), jnp.bfloat16))
    fn = lambda x, *rest: moe_mxfp4_pallas(x, *rest, platform="tpu", block_m=tm, block_i=32,  # noqa: E731
                                           block_h=64).astype(jnp.float32).sum()
    calls = {p["name"]: p["cost_estimate"] for p in pallas_calls(jax.grad(fn), *specs)}
    weights = e * (2 * i * h + h * i)                                # values in both stacks
    mxfp4_bytes = weights // 2 + weights // 32                       # 4.25 bits each
    assert mxfp4_bytes * 8 == weights * 4.25
    rows = m * h * 2                                                 # x, y, dy, dx in bf16
    biases = e * 2 * i * 2 + e * h * 2
    items = m // tm + e - 1
    prefetch = 4 * ((e + 1) + 2 * items + 1)
    assert calls["moe_mxfp4_fwd"].bytes_accessed == rows + mxfp4_bytes + biases + rows + prefetch
    assert calls["moe_mxfp4_dx"].bytes_accessed == 2 * rows + mxfp4_bytes + e * 2 * i * 2 + rows + prefetch
    assert calls["moe_mxfp4_fwd"].flops == 6 * m * h * i and calls["moe_mxfp4_dx"].flops == 10 * m * h * i


@pytest.mark.parametrize("m", [40, 300], ids=["tile-past-M", "overhang"])
def test_pallas_in_the_tpu_interpreter_with_tpu_tiles(m):
    """platform 'tpu' tiles (128-row tiles: one larger than M, or one overhanging it) in the
    TPU-simulating interpreter (NaN-filled buffers, out-of-bounds blocks as on the chip)."""
    args, dy = make_inputs(5, m, 64, 32, 3, jnp.bfloat16)
    y_ref, dx_ref = value_and_dx(lambda *a: moe_mxfp4_reference(*a, alpha=ALPHA, limit=LIMIT), args, dy)
    y, dx = value_and_dx(lambda *a: moe_mxfp4_pallas(*a, alpha=ALPHA, limit=LIMIT, platform="tpu", interpret="tpu",
                                                     block_m=128), args, dy)
    assert rel_err(y, y_ref) < TOL[jnp.bfloat16][0] and rel_err(dx, dx_ref) < TOL[jnp.bfloat16][1]


def test_the_torch_decode_equals_the_host_codec_at_every_scale_byte():
    """torch_model/ops.py's eager decode (the model's ground truth) against the host codec."""
    import torch

    from torch_model.ops import mxfp4_decode

    scale_bytes = np.arange(0, 254, dtype=np.uint8)
    blocks = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :], (254, 256)).copy()
    blocks[253] = 0x11                                      # 253 overflows with magnitudes 4, 6
    scales = np.broadcast_to(scale_bytes[:, None], (254, 16)).copy()
    want = host_decoded(blocks[None], scales[None])[0]
    got = mxfp4_decode(torch.from_numpy(blocks), torch.from_numpy(scales)).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", ["xla", "ragged_dot", "loop", "pallas"])
def test_the_torch_op_is_routed_to_each_registered_implementation(name):
    """torch.ops.torchlyra.routed_experts_mxfp4 (the op a model with an MXFP4 expert base
    calls): eager, its torch reference; under the bridge, the registry's `moe_mxfp4` choice,
    `auto` picking `loop` on CPU and `pallas` on TPU. Forward and the gradients of x and of the
    routing weights (the only ones the op gives) agree."""
    import torch

    from jax_bridge import registry
    from jax_bridge.env import get_env

    env = get_env()                                  # torchax through the torch 2.13 shim, first
    import torchax.interop as interop

    (x, _, w1b, w1s, b1, w2b, w2s, b2), _ = make_inputs(6, 24, 64, 32, 4)
    rng = np.random.default_rng(6)
    experts = jnp.asarray(np.stack([rng.choice(4, 2, replace=False) for _ in range(24)]), jnp.int32)
    weights = jnp.asarray(rng.random((24, 2)), jnp.float32)
    stacks = (w1b, w1s, b1, w2b, w2s, b2)
    to_torch = lambda a: torch.from_numpy(np.asarray(a).copy())                       # noqa: E731
    xt, wt = to_torch(x).requires_grad_(), to_torch(weights).requires_grad_()
    eager = torch.ops.torchlyra.routed_experts_mxfp4(xt, to_torch(experts).long(), wt, *map(to_torch, stacks),
                                                     ALPHA, LIMIT, 1.0)
    eager.sum().backward()

    assert registry.resolve("auto", "cpu", ops=registry.QUANTIZED_OPS) == {"moe_mxfp4": "loop"}
    assert registry.resolve("auto", "tpu", ops=registry.QUANTIZED_OPS) == {"moe_mxfp4": "pallas"}
    kernels = {**registry.resolve("xla", "cpu"), "moe_mxfp4": name}

    def loss(x, weights):
        op = interop.torch_view(lambda *a: torch.ops.torchlyra.routed_experts_mxfp4(*a, ALPHA, LIMIT, 1.0))
        y = interop.jax_view(op)(x, experts, weights, *stacks)
        return jnp.sum(y), y

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    with registry.routed(env, kernels, platform="cpu"):
        (_, y), (dx, dw) = jax.jit(grad)(x, weights)
        program = str(jax.make_jaxpr(grad)(x, weights))
    # The chosen implementation is what ran (not the torch reference traced through torchax).
    assert ("moe_mxfp4_fwd" in program) == (name == "pallas") and ("ragged_dot" in program) == (name == "ragged_dot")
    assert rel_err(y, eager.detach().numpy()) < 1e-5
    assert rel_err(dx, xt.grad.numpy()) < 1e-4 and rel_err(dw, wt.grad.numpy()) < 1e-5
