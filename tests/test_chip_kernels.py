"""The hardware tier's kernels (`make test-tpu`): every Pallas kernel compiled by Mosaic and run on
the TPU, forward and backward, against its plain-JAX reference on the same chip, in float32 and
bfloat16, at shapes that make each kernel tile and skip: ragged lengths, GQA groups, segments,
sinks, sliding windows, empty expert groups, MXFP4 experts against the host codec. Tiles follow
the TPU's block rules (multiples of 128 rows), so several tiles per kernel still run.

The references' dots are explicit (float32: HIGHEST), so a float32 reference is float32 on the
chip too; the bounds are the CPU suite's where the kernels' arithmetic is the same.
Skipped without a TPU (tests/conftest.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err
from pallas_kernels.attention import attention_pallas, attention_reference, attention_splash
from pallas_kernels.cross_entropy import linear_cross_entropy_pallas, linear_cross_entropy_reference
from pallas_kernels.moe import moe_experts_megablox, moe_experts_pallas, moe_experts_reference
from pallas_kernels.moe_mxfp4 import moe_mxfp4_pallas, moe_mxfp4_reference
from test_kernel_attention import make_inputs as attention_inputs
from test_kernel_cross_entropy import IGNORE, make_inputs as ce_inputs
from test_kernel_moe import ALPHA, LIMIT, TOL, make_inputs as moe_inputs, naive_moe, value_and_grads
from test_kernel_moe_mxfp4 import host_decoded, make_inputs as mxfp4_inputs, value_and_dx

pytestmark = [pytest.mark.tpu, pytest.mark.usefixtures("tpu_device")]
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
# (forward, backward) relative bounds: the CPU suite's (tests/test_kernel_*.py).
BOUNDS = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (1e-2, 1e-2)}


def out_and_grads(fn, *args, dout):
    """(out, grads of every float input) of fn, one compiled program on the chip."""
    def run(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(dout)
    return jax.jit(run)(*args)


# (B, Hq, Hkv, T, D, window, block_q, block_kv)
ATTENTION = [
    (2, 4, 2, 300, 64, 0, 128, 128),      # GQA 2, T not a tile multiple, full causal
    (1, 8, 1, 256, 128, 64, 128, 128),    # MQA (group 8), window inside a tile
    (1, 4, 4, 384, 128, 1, 128, 256),     # group 1, window 1: the diagonal and the sink
    (2, 8, 2, 640, 64, 200, 256, 128),    # window spanning tiles, block_q > block_kv
]


@DTYPES
@pytest.mark.parametrize("case", ATTENTION, ids=lambda c: "B{}-Hq{}-Hkv{}-T{}-D{}-W{}-bq{}-bkv{}".format(*c))
def test_flash_attention_on_the_chip_matches_the_reference(case, dtype):
    b, hq, hkv, t, d, window, bq, bkv = case
    q, k, v, sinks, dout = attention_inputs(sum(case), b, hq, hkv, t, d, dtype)
    kw = dict(sliding_window=window, scale=d ** -0.5)
    out, grads = out_and_grads(functools.partial(attention_pallas, platform="tpu", block_q=bq, block_kv=bkv, **kw),
                               q, k, v, sinks, dout=dout)
    ref, ref_grads = out_and_grads(functools.partial(attention_reference, **kw), q, k, v, sinks, dout=dout)
    fwd, bwd = BOUNDS[dtype]
    assert out.dtype == dtype and rel_err(out, ref) <= fwd, rel_err(out, ref)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert g.shape == r.shape and rel_err(g, r) <= bwd, (name, rel_err(g, r))


@DTYPES
def test_flash_attention_with_segments_on_the_chip_matches_the_reference(dtype):
    """Packed rows: three segments and a padded tail, cut off tile bounds, with a window."""
    b, hq, hkv, t, d = 2, 4, 2, 384, 64
    q, k, v, sinks, dout = attention_inputs(7, b, hq, hkv, t, d, dtype)
    cuts = [(0, 50, 300, 384), (0, 200, 330, 384)]
    segments = jnp.asarray(np.stack([np.repeat(np.arange(3), np.diff(c)) for c in cuts]), jnp.int32)
    for window in (0, 96):
        kw = dict(sliding_window=window, scale=d ** -0.5, segment_ids=segments)
        out, grads = out_and_grads(functools.partial(attention_pallas, platform="tpu", block_q=128, block_kv=128, **kw),
                                   q, k, v, sinks, dout=dout)
        ref, ref_grads = out_and_grads(functools.partial(attention_reference, **kw), q, k, v, sinks, dout=dout)
        fwd, bwd = BOUNDS[dtype]
        assert rel_err(out, ref) <= fwd, (window, rel_err(out, ref))
        for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
            assert rel_err(g, r) <= bwd, (window, name, rel_err(g, r))


def test_splash_attention_on_the_chip_matches_the_reference():
    """jax's shipped splash kernel behind our op (bf16, its TPU home), window and full."""
    b, hq, hkv, t, d = 1, 8, 2, 512, 128
    q, k, v, sinks, dout = attention_inputs(11, b, hq, hkv, t, d, jnp.bfloat16)
    for window in (0, 128):
        kw = dict(sliding_window=window, scale=d ** -0.5)
        out, grads = out_and_grads(functools.partial(attention_splash, platform="tpu", **kw), q, k, v, sinks, dout=dout)
        ref, ref_grads = out_and_grads(functools.partial(attention_reference, **kw), q, k, v, sinks, dout=dout)
        fwd, bwd = BOUNDS[jnp.bfloat16]
        assert rel_err(out, ref) <= fwd, (window, rel_err(out, ref))
        for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
            assert rel_err(g, r) <= bwd, (window, name, rel_err(g, r))


# (N, H, V, block_n, block_v): ragged tokens and vocabularies, whole ignored tiles.
CROSS_ENTROPY = [(1000, 256, 4100, 256, 512), (384, 128, 1152, 128, 256), (2048, 512, 8192, None, None)]


@DTYPES
@pytest.mark.parametrize("case", CROSS_ENTROPY, ids=lambda c: "N{}-H{}-V{}-bn{}-bv{}".format(*c))
def test_linear_cross_entropy_on_the_chip_matches_the_reference(case, dtype):
    n, h, v, bn, bv = case
    hidden, weight, labels, a, b = ce_inputs(n, h, v, dtype, seed=n + v, ignore_first_tile=bn or 0)

    def loss(fn):
        def f(hidden, weight):
            nll, lse = fn(hidden, weight, labels, ignore_index=IGNORE)
            return jnp.sum(nll * a) + jnp.sum(lse ** 2 * b), (nll, lse)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hidden, weight)

    (value, (nll, lse)), (dh, dw) = loss(functools.partial(linear_cross_entropy_pallas, platform="tpu",
                                                           block_n=bn, block_v=bv))
    (value_r, (nll_r, lse_r)), (dh_r, dw_r) = loss(linear_cross_entropy_reference)
    fwd, bwd = BOUNDS[dtype]
    assert rel_err(nll, nll_r) <= fwd and rel_err(lse, lse_r) <= fwd and rel_err(value, value_r) <= fwd
    assert rel_err(dh, dh_r) <= bwd and rel_err(dw, dw_r) <= bwd
    ignored = np.asarray(labels) == IGNORE
    assert np.all(np.asarray(nll)[ignored] == 0) and np.all(np.asarray(dh, np.float32)[ignored] == 0)


# (M, H, I, E, group kind, tiles): ragged groups with empty ones, a row tile overhanging M.
MOE = [(300, 256, 256, 8, "random", dict(block_m=128, block_i=128)),
       (1024, 512, 384, 4, "one", {}),
       (520, 256, 512, 16, "random", dict(block_m=256, block_i=256))]


@DTYPES
@pytest.mark.parametrize("impl", ["pallas", "pallas-interleaved", "megablox"])
@pytest.mark.parametrize("case", MOE, ids=lambda c: "M{}-H{}-I{}-E{}-{}".format(*c[:5]))
def test_moe_kernels_on_the_chip_match_the_reference(case, impl, dtype):
    """`pallas` takes gate_up in the blocked layout at these tiles (one I tile, a multiple of 128);
    `pallas-interleaved` de-interleaves in the kernels (lane rolls and pair matmuls)."""
    m, h, i, e, kind, tiles = case
    args, dy = moe_inputs(m + e, m, h, i, e, kind, dtype)
    up = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
    y_ref, g_ref = value_and_grads(moe_experts_reference, up, dy.astype(jnp.float32))
    if impl.startswith("pallas"):
        layout = "interleaved" if impl == "pallas-interleaved" else "blocked"
        fn = functools.partial(moe_experts_pallas, platform="tpu", gate_up_layout=layout, **tiles)
    else:
        fn = functools.partial(moe_experts_megablox, platform="tpu", block_m=tiles.get("block_m"))
    y, grads = value_and_grads(fn, args, dy)
    fwd, bwd = TOL[dtype]
    assert y.dtype == dtype and rel_err(y, y_ref) <= fwd, rel_err(y, y_ref)
    for name, g, r in zip(("x", "gate_up", "gate_up_bias", "down", "down_bias"), grads, g_ref):
        assert rel_err(g, r) <= bwd, (name, rel_err(g, r))


@DTYPES
@pytest.mark.parametrize("m,tiles", [(300, dict(block_m=128)), (1000, {})], ids=["overhang", "defaults"])
def test_mxfp4_experts_on_the_chip_match_the_host_codec(m, tiles, dtype):
    """The MXFP4 kernel decodes its tiles in VMEM on the chip; the oracle decodes the same bytes with
    the host codec (formats/mxfp4.py) and runs the experts row by row in float64."""
    args, dy = mxfp4_inputs(m, m, 256, 128, 4, dtype)
    x, gs, w1b, w1s, b1, w2b, w2s, b2 = args
    want = naive_moe(np.asarray(x, np.float32), gs, np.swapaxes(host_decoded(w1b, w1s), 1, 2), np.asarray(b1, np.float32),
                     np.swapaxes(host_decoded(w2b, w2s), 1, 2), np.asarray(b2, np.float32))
    y, dx = value_and_dx(lambda *a: moe_mxfp4_pallas(*a, alpha=ALPHA, limit=LIMIT, platform="tpu", **tiles), args, dy)
    _, dx_ref = value_and_dx(lambda *a: moe_mxfp4_reference(*a, alpha=ALPHA, limit=LIMIT), args, dy)
    fwd, bwd = TOL[dtype]
    assert rel_err(y, want) <= fwd, rel_err(y, want)
    assert dx.dtype == dtype and rel_err(dx, dx_ref) <= bwd, rel_err(dx, dx_ref)


@DTYPES
@pytest.mark.parametrize("window", [0, 100])
def test_cached_attention_on_the_chip_matches_the_reference(window, dtype):
    """Generation's Pallas attention over a KV cache (opt in until this passes on a chip): a GQA
    decode step over left-padded rows of ragged lengths (one all padding), default tiles."""
    from pallas_kernels.decode_attention import cached_attention_pallas, cached_attention_reference

    r = np.random.default_rng(window)
    b, hq, hkv, slots, d = 4, 16, 8, 512, 128
    q, k, v = (jnp.asarray(r.standard_normal(shape), dtype) for shape in
               ((b, hq, 1, d), (b, hkv, slots, d), (b, hkv, slots, d)))
    sinks = jnp.asarray(r.standard_normal(hq), jnp.float32)
    slot, lengths = np.arange(slots), (300, 41, 0, 512)
    kpos = jnp.asarray(np.stack([np.where(slot >= slots - n, slot - (slots - n), -1) for n in lengths]), jnp.int32)
    qpos = jnp.asarray([[n - 1] for n in lengths], jnp.int32)
    kw = dict(sliding_window=window, scale=d ** -0.5)
    got = jax.jit(functools.partial(cached_attention_pallas, platform="tpu", **kw))(q, k, v, sinks, qpos, kpos)
    want = jax.jit(functools.partial(cached_attention_reference, **kw))(q, k, v, sinks, qpos, kpos)
    assert got.dtype == dtype and rel_err(got, want) <= BOUNDS[dtype][0], rel_err(got, want)
