"""Pallas linear cross-entropy against the plain-JAX reference and the eager PyTorch op.

Everything runs on CPU: the TPU kernels in the Pallas interpreters (platform 'cpu': the generic
interpreter, fast; interpret='tpu': the TPU-simulating one), the Triton kernels in the generic
interpreter (platform 'gpu', interpret 'generic'), and lowering for real TPU / CUDA through
`jax.export`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from helpers import pallas_calls, rel_err as rel
from pallas_kernels.cross_entropy import (default_block_sizes, linear_cross_entropy_pallas,
                                          linear_cross_entropy_reference)

IGNORE = -100
S = jax.ShapeDtypeStruct
LYRA_SMALL = (16384, 2048, 201088)  # tokens per step, hidden, vocabulary (1571 * 128)


def make_inputs(n, h, v, dtype, seed, ignore_first_tile=0):
    k = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(k[0], (n, h), jnp.float32).astype(dtype)
    weight = (jax.random.normal(k[1], (v, h), jnp.float32) * 0.5).astype(dtype)
    labels = jax.random.randint(k[2], (n,), 0, v, jnp.int32)
    labels = labels.at[::5].set(IGNORE)              # scattered ignored tokens
    labels = labels.at[:ignore_first_tile].set(IGNORE)  # optionally a whole token tile
    a = jax.random.normal(k[3], (n,), jnp.float32)
    b = jax.random.normal(k[4], (n,), jnp.float32)
    return hidden, weight, labels, a, b


def loss_and_grads(fn):
    """One jitted program: outputs, and value and gradients of a loss that uses both outputs
    (so both cotangents, g_nll = a and g_lse = 2 b lse, are random and nonzero)."""
    def loss(hidden, weight, labels, a, b):
        nll, lse = fn(hidden, weight, labels)
        return jnp.sum(nll * a) + jnp.sum(lse ** 2 * b), (nll, lse)

    def run(hidden, weight, labels, a, b):
        (value, (nll, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            hidden, weight, labels, a, b)
        return nll, lse, value, grads
    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def pallas_run(platform, block_n, block_v, interpret=None, block_compute=None):
    """Cached so that tests sharing a configuration compile once."""
    return loss_and_grads(functools.partial(
        linear_cross_entropy_pallas, ignore_index=IGNORE, block_n=block_n, block_v=block_v,
        platform=platform, interpret=interpret, block_compute=block_compute))


reference_run = loss_and_grads(functools.partial(linear_cross_entropy_reference,
                                                 ignore_index=IGNORE))


CASES = [
    # n, h, v, dtype, platform, interpret, block_n, block_v, ignore_first_tile
    (37, 32, 1000, jnp.float32, "cpu", None, 16, 128, 16),     # N, V not multiples of the tiles
    (64, 64, 384, jnp.float32, "cpu", None, None, None, 0),    # default tiles
    (37, 64, 257, jnp.bfloat16, "cpu", None, 16, 128, 0),      # bf16, one valid column in last tile
    (37, 32, 257, jnp.float32, "cpu", "tpu", 16, 128, 0),      # the TPU interpreter (VMEM, DMAs)
    (37, 48, 1000, jnp.float32, "gpu", "generic", 16, 128, 16),  # Triton kernels; H % 64 != 0
    (64, 64, 384, jnp.bfloat16, "gpu", "generic", 32, 128, 0),
    # compute chunks (block_compute 16): 2 token chunks per tile of the forward that accumulates E,
    # 8 vocab chunks per forward / dW tile, partial last tiles on both axes (the masked code
    # paths), in the TPU interpreter
    (70, 32, 300, jnp.float32, "cpu", "tpu", 32, 128, 0, 16),
    # one token tile of 200 rows (not a multiple of 128: the per-token rows leave in two parts)
    (200, 32, 300, jnp.float32, "cpu", None, 200, 128, 0),
    # H a multiple of the 128 lanes: the per-token statistics reach E's [rows, H] as lane copies
    (70, 128, 300, jnp.float32, "cpu", None, 32, 128, 8),
]


@pytest.mark.parametrize("n,h,v,dtype,platform,interpret,block_n,block_v,ignore_first_tile,block_compute",
                         [c + (None,) * (10 - len(c)) for c in CASES])
def test_matches_reference(n, h, v, dtype, platform, interpret, block_n, block_v, ignore_first_tile, block_compute):
    hidden, weight, labels, a, b = make_inputs(n, h, v, dtype, seed=n * v + h,
                                               ignore_first_tile=ignore_first_tile)
    run = pallas_run(platform, block_n, block_v, interpret, block_compute)
    nll, lse, loss, (dh, dw) = run(hidden, weight, labels, a, b)
    nll_r, lse_r, loss_r, (dh_r, dw_r) = reference_run(hidden, weight, labels, a, b)

    assert nll.shape == lse.shape == (n,) and nll.dtype == lse.dtype == jnp.float32
    assert dh.shape == hidden.shape and dh.dtype == hidden.dtype
    assert dw.shape == weight.shape and dw.dtype == weight.dtype
    tol_f, tol_b = (1e-5, 1e-4) if dtype == jnp.float32 else (1e-2, 1e-2)
    assert rel(nll, nll_r) <= tol_f and rel(lse, lse_r) <= tol_f
    assert rel(loss, loss_r) <= tol_f
    assert rel(dh, dh_r) <= tol_b and rel(dw, dw_r) <= tol_b
    assert np.isfinite(np.asarray(dh, np.float32)).all()
    assert np.isfinite(np.asarray(dw, np.float32)).all()

    ignored = np.asarray(labels) == IGNORE
    assert np.all(np.asarray(nll)[ignored] == 0) and np.all(np.asarray(lse)[ignored] == 0)
    assert np.all(np.asarray(dh, np.float32)[ignored] == 0)
    assert np.all(np.asarray(nll)[~ignored] > 0)


def test_confident_tokens_keep_their_bf16_gradient():
    """Tokens whose label takes nearly all the probability (nll 1e-3 to 1e-2, as a trained model's
    often do): dh = ca E - cb W_y is then a small difference, so E (the forward's softmax-weighted
    weight rows) must keep float32; each token's dh is as close to float32's as the reference's
    bf16 run (rounded to bf16, E would leave ~2.5% on the worst token here)."""
    n, h, v = 64, 64, 384
    hidden, weight, labels, a, b = make_inputs(n, h, v, jnp.bfloat16, seed=3)
    weight = weight / jnp.linalg.norm(weight.astype(jnp.float32), axis=1, keepdims=True).astype(jnp.bfloat16)
    hidden = (12.0 * jnp.take(weight, jnp.maximum(labels, 0), axis=0)).astype(jnp.bfloat16)
    nll, _, _, (dh, _) = pallas_run("cpu", None, None)(hidden, weight, labels, a, b)
    _, _, _, (dh_r, _) = reference_run(hidden, weight, labels, a, b)
    _, _, _, (dh_32, _) = reference_run(hidden.astype(jnp.float32), weight.astype(jnp.float32), labels, a, b)
    valid = np.asarray(labels) != IGNORE
    assert float(jnp.max(nll)) < 2e-2

    def worst_token(x):
        x, r = np.asarray(x, np.float32)[valid], np.asarray(dh_32, np.float32)[valid]
        return float(np.max(np.linalg.norm(x - r, axis=1) / np.linalg.norm(r, axis=1)))
    assert worst_token(dh) <= max(1e-2, 1.5 * worst_token(dh_r)), (worst_token(dh), worst_token(dh_r))


def test_all_tokens_ignored_give_zero_loss_and_gradient():
    hidden, weight, labels, a, b = make_inputs(37, 32, 1000, jnp.float32, seed=1)
    labels = jnp.full_like(labels, IGNORE)
    run = pallas_run("cpu", 16, 128)  # shares the first case's compilation
    nll, lse, loss, (dh, dw) = run(hidden, weight, labels, a, b)
    assert not np.any(np.asarray(nll)) and not np.any(np.asarray(lse)) and float(loss) == 0.0
    assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


def test_matches_eager_torch_op():
    torch = pytest.importorskip("torch")
    from torch_model.ops import linear_cross_entropy_reference as torch_reference

    hidden, weight, labels, a, b = make_inputs(37, 32, 1000, jnp.float32, seed=7,
                                               ignore_first_tile=16)
    nll, lse, _, (dh, dw) = pallas_run("cpu", 16, 128)(hidden, weight, labels, a, b)

    th = torch.tensor(np.asarray(hidden), requires_grad=True)
    tw = torch.tensor(np.asarray(weight), requires_grad=True)
    tl = torch.tensor(np.asarray(labels), dtype=torch.long)
    t_nll, t_lse = torch_reference(th, tw, tl, IGNORE)
    (torch.sum(t_nll * torch.tensor(np.asarray(a)))
     + torch.sum(t_lse ** 2 * torch.tensor(np.asarray(b)))).backward()
    assert rel(nll, t_nll.detach().numpy()) <= 1e-5
    assert rel(lse, t_lse.detach().numpy()) <= 1e-5
    assert rel(dh, th.grad.numpy()) <= 1e-4
    assert rel(dw, tw.grad.numpy()) <= 1e-4


# ---- block sizes and argument checks -----------------------------------------------------------
def test_default_block_sizes():
    n, h, v = LYRA_SMALL
    assert default_block_sizes(n, h, v, "tpu") == (1024, 512)
    bn, bv = default_block_sizes(n, h, v, "cpu")  # interpreters: tiles that divide N and V
    assert n % bn == 0 and v % bv == 0 and bv % 128 == 0
    assert default_block_sizes(n, h, v, "gpu") == (64, 128)
    assert default_block_sizes(37, 64, 1000, "tpu") == (37, 512)  # a tile may be the whole dim
    bn, bv = default_block_sizes(4096, 16384, v, "tpu")           # wide hidden: smaller tiles
    assert bn % 128 == 0 and bv % 128 == 0 and bn * bv < 1024 * 512


def test_rejects_bad_arguments():
    hidden, weight, labels, _, _ = make_inputs(256, 32, 1000, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="block_n"):
        linear_cross_entropy_pallas(hidden, weight, labels, block_n=100, platform="tpu")
    with pytest.raises(ValueError, match="block_v"):
        linear_cross_entropy_pallas(hidden, weight, labels, block_v=200, platform="tpu")
    with pytest.raises(ValueError, match="power of two"):
        linear_cross_entropy_pallas(hidden, weight, labels, block_v=96, platform="gpu")
    with pytest.raises(ValueError, match="unknown platform"):
        linear_cross_entropy_pallas(hidden, weight, labels, platform="metal")
    with pytest.raises(ValueError, match="unknown interpret mode"):
        linear_cross_entropy_pallas(hidden, weight, labels, platform="cpu", interpret="gpu-interpret")
    with pytest.raises(ValueError, match="shapes"):
        linear_cross_entropy_pallas(hidden, weight[:, :16], labels, platform="cpu")


# ---- lowering for real hardware ----------------------------------------------------------------
def _value_and_grad(platform):
    def loss(hidden, weight, labels):
        nll, lse = linear_cross_entropy_pallas(hidden, weight, labels, platform=platform)
        return jnp.sum(nll) + 1e-4 * jnp.sum(lse ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))


def _specs(n, h, v, dtype=jnp.bfloat16):
    return S((n, h), dtype), S((v, h), dtype), S((n,), jnp.int32)


@pytest.mark.parametrize("shape", [(2048, 256, 4096), LYRA_SMALL], ids=["tiny", "lyra_small"])
def test_exports_for_tpu(shape):
    n, h, v = shape
    fwd = functools.partial(linear_cross_entropy_pallas, platform="tpu")
    exp = export.export(jax.jit(fwd), platforms=["tpu"])(*_specs(n, h, v))
    text = exp.mlir_module()
    assert text.count("tpu_custom_call") == 1 and "stablehlo.pad" not in text
    assert [o.shape for o in exp.out_avals] == [(n,), (n,)]

    exp = export.export(jax.jit(_value_and_grad("tpu")), platforms=["tpu"])(*_specs(n, h, v))
    text = exp.mlir_module()
    # the forward that also accumulates E (dh comes from it) + the dW kernel, and no padded copy
    # of the weight anywhere
    assert text.count("tpu_custom_call") == 2 and "stablehlo.pad" not in text
    assert [o.shape for o in exp.out_avals] == [(), (n, h), (v, h)]


def test_exports_for_cuda():
    n, h, v = 2048, 256, 4096
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    fwd = functools.partial(linear_cross_entropy_pallas, platform="gpu")
    exp = export.export(jax.jit(fwd), platforms=["cuda"], disabled_checks=checks)(*_specs(n, h, v))
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1
    for dtype in (jnp.bfloat16, jnp.float32):
        exp = export.export(jax.jit(_value_and_grad("gpu")), platforms=["cuda"],
                            disabled_checks=checks)(*_specs(n, h, v, dtype))
        assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 2  # forward, backward
        assert [o.shape for o in exp.out_avals] == [(), (n, h), (v, h)]


# ---- memory: nothing of size N x V, forward or backward ----------------------------------------
def test_compiled_temporary_memory_at_lyra_small():
    """Compile-only memory analysis on CPU, the kernels in the TPU interpreter (interpret='tpu'),
    against the reference that materializes the logits: >= 99.9% of its temporaries saved, beside
    (differentiated) the forward's float32 E [N, H], which is what saves the dh kernel's pass, and
    on CPU the target rows W_y [N, H] the forward gathers for the target logits (XLA:CPU keeps
    them; the TPU compiler fuses the gather into its product: the next test)."""
    specs = _specs(*LYRA_SMALL)
    n, h, _ = LYRA_SMALL

    def temp(fn):
        return jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes

    def vg(fn):
        def loss(hidden, weight, labels):
            nll, lse = fn(hidden, weight, labels)
            return jnp.sum(nll) + 1e-4 * jnp.sum(lse ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))

    pallas = functools.partial(linear_cross_entropy_pallas, platform="cpu", interpret="tpu")
    ref = linear_cross_entropy_reference
    assert temp(pallas) <= 1e-3 * temp(ref)
    assert n * h * 4 <= temp(vg(pallas)) <= 3 * n * h * 4 + 1e-3 * temp(vg(ref))


def test_the_tpu_step_keeps_nothing_of_size_n_x_h_beside_e():
    """By the TPU compiler (v5e, deviceless): the differentiated loss's peak memory over its
    arguments and outputs is less than one float32 [N, H] (E, which the compiler places in part
    with the outputs): the target rows the forward gathers for the target logits fuse into their
    product, as the backward's into dh."""
    pytest.importorskip("libtpu")
    from jax_bridge import tpu_compile

    n, h, _ = LYRA_SMALL

    def loss(hidden, weight, labels):
        nll, lse = linear_cross_entropy_pallas(hidden, weight, labels, platform="tpu")
        return jnp.sum(nll) + 1e-4 * jnp.sum(lse ** 2)

    _, stats = tpu_compile.compile_for(jax.value_and_grad(loss, argnums=(0, 1)), _specs(*LYRA_SMALL),
                                       tpu_compile.device_of("v5e:1x1"))
    assert stats.peak_bytes - stats.argument_bytes - stats.output_bytes < n * h * 4, stats


def _ce_hand_count(n, h, v, bn, bv, itemsize=2):
    """The TPU kernels' bytes counted by hand from their block plans: token vectors are
    int32/float32 rows, a block index unchanged from the previous grid step is not copied again
    (the weight once when it is one vocab tile; the token tiles once in dW when they are one)."""
    nq, nv = -(-n // bn), -(-v // bv)
    tokens, weight = n * h * itemsize, v * h * itemsize
    streamed_w = weight if nv == 1 else nq * weight
    return {"cross_entropy_fwd": 4 * n + tokens + streamed_w + 8 * n,          # labels, h, W; nll, lse
            "cross_entropy_fwd_e": tokens + streamed_w + 4 * n + 4 * n * h,   # h, W; lse, E (float32)
            "cross_entropy_dw": (16 * n + tokens) * (1 if nq == 1 else nv) + weight + weight}   # 4 vectors, h, W; dW


@pytest.mark.parametrize("shape", [(1000, 64, 700, 256, 256), (384, 64, 256, 128, 256), (128, 64, 512, 128, 128)],
                         ids=["ragged-tiles", "one-vocab-tile", "one-token-tile"])
def test_tpu_kernel_cost_estimates_count_what_the_block_plan_moves(shape):
    """Differentiated, the loss runs the forward that accumulates E and the dW kernel (8 NVH of
    FLOPs: the logits formed twice); not differentiated, the plain forward (2 NVH)."""
    n, h, v, bn, bv = shape
    loss = lambda hid, w, lab: jnp.sum(linear_cross_entropy_pallas(hid, w, lab, block_n=bn, block_v=bv,  # noqa: E731
                                                                   platform="tpu")[0])
    costs = {p["name"]: p["cost_estimate"] for fn in (loss, jax.grad(loss, argnums=(0, 1)))
             for p in pallas_calls(fn, *_specs(n, h, v))}
    assert {k: c.bytes_accessed for k, c in costs.items()} == _ce_hand_count(n, h, v, bn, bv)
    assert costs["cross_entropy_fwd"].flops == 2 * n * v * h
    assert costs["cross_entropy_fwd_e"].flops == costs["cross_entropy_dw"].flops == 4 * n * v * h



def test_the_xla_implementation_in_token_chunks_equals_the_reference_forward_and_backward():
    """`xla` bounds its float32 logits per chunk of tokens (each formed again in the backward): at a
    chunk of 16 tokens, 37 ragged tokens (3 chunks, the last padded) give the reference's outputs
    and gradients."""
    from pallas_kernels.cross_entropy import linear_cross_entropy_xla

    hidden, weight, labels, a, b = make_inputs(37, 32, 64, jnp.float32, seed=5)
    chunked = loss_and_grads(functools.partial(linear_cross_entropy_xla, ignore_index=IGNORE, chunk_bytes=16 * 64 * 4))
    nll, lse, loss, (dh, dw) = chunked(hidden, weight, labels, a, b)
    nll_r, lse_r, loss_r, (dh_r, dw_r) = reference_run(hidden, weight, labels, a, b)
    assert nll.shape == (37,) and rel(nll, nll_r) <= 1e-6 and rel(lse, lse_r) <= 1e-6 and rel(loss, loss_r) <= 1e-6
    assert rel(dh, dh_r) <= 1e-6 and rel(dw, dw_r) <= 1e-6
