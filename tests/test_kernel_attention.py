"""Pallas flash attention (and the Splash wrapper) against the plain-JAX and eager-torch references.

Kernels run in interpret mode on CPU; TPU (Mosaic) and CUDA (Triton) lowering is checked by
jax.export, which traces and lowers without running. Shapes are small: every (shape, config) pair
costs one ~3 s interpret-mode compile, so each case compiles forward and backward together once.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from helpers import pallas_calls, rel_err
from pallas_kernels.attention import (attention_grid, attention_pallas, attention_reference,
                                      attention_splash, attention_xla, default_block_sizes)


def make_inputs(seed, b, hq, hkv, t, d, dtype):
    kq, kk, kv, ks, kd = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(kq, (b, hq, t, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, hkv, t, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, hkv, t, d), jnp.float32).astype(dtype)
    sinks = jax.random.normal(ks, (hq,), jnp.float32)
    dout = jax.random.normal(kd, (b, hq, t, d), jnp.float32).astype(dtype)
    return q, k, v, sinks, dout


@functools.lru_cache(maxsize=None)
def out_and_grads(fn):
    """jit(inputs, dO) -> (out, (dq, dk, dv, dsinks)): one compile for forward and backward."""
    def run(q, k, v, sinks, dout):
        out, vjp = jax.vjp(fn, q, k, v, sinks)
        return out, vjp(dout)
    # The interpreted kernels are tiny programs with big graphs: XLA's backend optimizations
    # cost more compile time (~40%) than they save at run time.
    return jax.jit(run, compiler_options={"xla_backend_optimization_level": 0})


@functools.lru_cache(maxsize=None)
def pallas_fn(window, scale, block_q, block_kv, platform, interpret=None):
    return functools.partial(attention_pallas, sliding_window=window, scale=scale,
                             block_q=block_q, block_kv=block_kv, platform=platform, interpret=interpret)


@functools.lru_cache(maxsize=None)
def reference_fn(window, scale):
    return functools.partial(attention_reference, sliding_window=window, scale=scale)


def check_against_reference(case, dtype, platform, fwd_tol, bwd_tol, seed, interpret=None):
    b, hq, hkv, t, d, window, bq, bkv = case
    scale = d ** -0.5
    args = make_inputs(seed, b, hq, hkv, t, d, dtype)
    out, grads = out_and_grads(pallas_fn(window, scale, bq, bkv, platform, interpret))(*args)
    ref_out, ref_grads = out_and_grads(reference_fn(window, scale))(*args)
    assert out.dtype == dtype and out.shape == (b, hq, t, d)
    assert rel_err(out, ref_out) <= fwd_tol, rel_err(out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert rel_err(g, r) <= bwd_tol, (name, rel_err(g, r))


# (B, Hq, Hkv, T, D, sliding_window, block_q, block_kv)
F32_CASES = [
    (2, 4, 2, 37, 32, 0, 16, 16),     # GQA 2, T not a multiple of the block, full causal
    (1, 4, 1, 64, 64, 16, 16, 32),    # MQA, window, block_kv > block_q
    (1, 2, 2, 130, 32, 1, 32, 32),    # group 1, window 1 (only the diagonal and the sink)
    (1, 4, 2, 37, 32, 100, 16, 32),   # window larger than T (plain causal)
    (1, 4, 2, 130, 32, 40, 32, 16),   # window spanning several kv blocks, block_q > block_kv
    (2, 8, 1, 50, 32, 20, 16, 16),    # group 8 (gpt-oss-20b's ratio), ragged T, window
    (1, 4, 2, 200, 128, 64, 128, 128),  # the TPU's 128-lane tiles (statistics tiled across lanes), ragged T
]


@pytest.mark.parametrize("case", F32_CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-T{}-D{}-W{}-bq{}-bkv{}".format(*c))
def test_tpu_kernel_matches_reference_f32(case):
    check_against_reference(case, jnp.float32, "cpu", 1e-5, 1e-4, seed=sum(case))


@pytest.mark.parametrize("case", [(2, 4, 2, 64, 64, 24, 16, 16), (1, 4, 4, 130, 32, 0, 32, 32)],
                         ids=["GQA-window", "MHA-full-T130"])
def test_tpu_kernel_matches_reference_bf16(case):
    check_against_reference(case, jnp.bfloat16, "cpu", 1e-2, 1e-2, seed=sum(case))


@pytest.mark.parametrize("case", [(2, 4, 2, 37, 32, 0, 16, 16), (1, 4, 1, 130, 32, 40, 32, 16)],
                         ids=["GQA-full-T37", "MQA-window-T130"])
def test_gpu_kernel_interpreted_matches_reference_f32(case):
    # The Triton-structured kernel (fori_loop over blocks) run by the generic Pallas interpreter.
    check_against_reference(case, jnp.float32, "gpu", 1e-5, 1e-4, seed=sum(case), interpret="generic")


def test_matches_eager_torch():
    import torch
    from torch_model.ops import attention_reference as torch_reference

    b, hq, hkv, t, d, window, bq, bkv = F32_CASES[0]   # re-uses that case's compiled kernel
    for window in (0,):
        args = make_inputs(sum(F32_CASES[0]), b, hq, hkv, t, d, jnp.float32)
        out, grads = out_and_grads(pallas_fn(window, d ** -0.5, bq, bkv, "cpu", None))(*args)
        tq, tk, tv, ts = (torch.tensor(np.asarray(x), requires_grad=True) for x in args[:4])
        t_out = torch_reference(tq, tk, tv, ts, window, d ** -0.5)
        t_out.backward(torch.tensor(np.asarray(args[4])))
        assert rel_err(out, t_out.detach().numpy()) <= 1e-5
        for g, tg in zip(grads, (tq.grad, tk.grad, tv.grad, ts.grad)):
            assert rel_err(g, tg.numpy()) <= 1e-4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_xla_implementation_in_query_chunks_equals_the_reference_forward_and_backward(dtype):
    """`xla` bounds its float32 scores per chunk of queries (each formed again in the backward):
    at chunks of 16 queries, 37 ragged tokens (3 chunks, the last padded) in three packed segments,
    GQA, sinks and a window give the reference's outputs and gradients (float32: to summation
    order; bf16: the same products, to the last rounding)."""
    b, hq, hkv, t, d, window = 2, 4, 2, 37, 16, 9
    q, k, v, sinks, dout = make_inputs(11, b, hq, hkv, t, d, dtype)
    segments = jnp.asarray([[0] * 12 + [1] * 20 + [2] * 5, [3] * 31 + [4] * 6], jnp.int32)
    chunk_bytes = 4 * b * hq * t * 16                      # 16 query rows per chunk
    for window_ in (0, window):
        for seg in (None, segments):
            chunked = functools.partial(attention_xla, sliding_window=window_, scale=d ** -0.5, segment_ids=seg,
                                        chunk_bytes=chunk_bytes)
            whole = functools.partial(attention_reference, sliding_window=window_, scale=d ** -0.5, segment_ids=seg)
            out, grads = out_and_grads(chunked)(q, k, v, sinks, dout)
            ref_out, ref_grads = out_and_grads(whole)(q, k, v, sinks, dout)
            tol = 1e-6 if dtype == jnp.float32 else 1e-2
            assert out.dtype == dtype and out.shape == (b, hq, t, d) and rel_err(out, ref_out) <= tol
            for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
                assert rel_err(g, r) <= tol, (name, window_, seg is not None, rel_err(g, r))


def test_the_xla_implementation_saves_no_score_matrix_for_its_backward():
    """Chunked (`chunk_bytes` below one [B, Hq, T, T] float32 matrix), `xla`'s vjp holds its inputs
    and no scores or probabilities; the reference (one chunk) holds [T, T]-sized arrays."""
    b, hq, hkv, t, d = 1, 2, 1, 64, 8
    q, k, v, sinks, _ = make_inputs(2, b, hq, hkv, t, d, jnp.float32)
    full = b * hq * t * t

    def largest_saved(fn):
        _, vjp = jax.vjp(functools.partial(fn, sliding_window=0, scale=0.3), q, k, v, sinks)
        return max(leaf.size for leaf in jax.tree_util.tree_leaves(vjp))

    assert largest_saved(functools.partial(attention_xla, chunk_bytes=4 * b * hq * t * 16)) <= q.size < full / 4
    assert largest_saved(attention_reference) >= full


def test_splash_matches_reference():
    # Splash differentiates all four inputs, sinks included.
    b, hq, hkv, t, d, window = 2, 4, 2, 130, 32, 20
    args = make_inputs(7, b, hq, hkv, t, d, jnp.float32)
    fn = functools.partial(attention_splash, sliding_window=window, scale=d ** -0.5, platform="cpu")
    out, grads = out_and_grads(fn)(*args)
    ref_out, ref_grads = out_and_grads(reference_fn(window, d ** -0.5))(*args)
    assert rel_err(out, ref_out) <= 1e-5
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert rel_err(g, r) <= 1e-4, (name, rel_err(g, r))
    with pytest.raises(NotImplementedError, match="no gpu kernel.*attention_pallas"):
        attention_splash(*args[:4], sliding_window=window, scale=1.0, platform="gpu")


def _pallas_grids(fn, *args):
    """Grids of every pallas_call in fn's backward+forward jaxpr, in trace order."""
    return [tuple(params["grid_mapping"].grid) for params in pallas_calls(fn, *args)]


def test_sliding_window_grid_is_linear_in_window():
    t, w, blk = 4096, 128, 512
    local = attention_grid(t, sliding_window=w, block_q=blk, block_kv=blk)
    full = attention_grid(t, sliding_window=0, block_q=blk, block_kv=blk)
    nq = t // blk
    assert local["kv_steps"] <= -(-(w + blk) // blk) + 1 == 3
    assert local["grid_steps"] == nq * local["kv_steps"] == 16 and full["grid_steps"] == nq * nq == 64
    assert full["computed_blocks"] == nq * (nq + 1) // 2       # above-diagonal blocks skipped
    small = attention_grid(t, sliding_window=w, block_q=128, block_kv=128)
    assert small["kv_steps"] == 2 and small["computed_blocks"] <= 2 * (t // 128)   # O(T*W)

    # The kernels' actual grids (forward, dq, dkv), read from the traced program.
    q = jax.ShapeDtypeStruct((1, 4, t, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, t, 64), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((4,), jnp.float32)

    def loss(window):
        return jax.grad(lambda *a: attention_pallas(*a, sliding_window=window, scale=0.125, block_q=blk,
                                                    block_kv=blk, platform="tpu").astype(jnp.float32).sum(),
                        argnums=(0, 1, 2, 3))
    local_grids, full_grids = _pallas_grids(loss(w), q, k, k, s), _pallas_grids(loss(0), q, k, k, s)
    # forward and dq: one row per kv head (its 2 query heads in each step)
    assert local_grids.count((1, 2, nq, 2)) == 2 and full_grids.count((1, 2, nq, nq)) == 2
    assert (1, 2, nq, 2 * 2) in local_grids and (1, 2, nq, 2 * nq) in full_grids  # dkv: group x q steps


def _pallas_costs(fn, *args):
    """{kernel name: (flops, transcendentals, bytes_accessed)} of every pallas_call in fn's jaxpr."""
    costs = {}
    for params in pallas_calls(fn, *args):
        est = params["cost_estimate"]
        costs[params["name"]] = None if est is None else (est.flops, est.transcendentals, est.bytes_accessed)
    return costs


def _fetches(blocks) -> int:
    """DMAs of a block stream in grid order: the first block, then every change (the pipeline
    re-uses an unchanged block)."""
    return sum(1 for n, blk in enumerate(blocks) if n == 0 or blk != blocks[n - 1])


def hand_count(b, hq, hkv, t, d, window, bq, bkv, itemsize):
    """The three TPU kernels' costs counted from scratch: the padded sequence's visibility mask
    decides which (q block, kv block) tiles hold any visible pair; each such tile costs 2 matmuls
    forward (QK^T, PV), 3 for dq (QK^T, dO V^T, dS K), 4 for dkv (K Q^T, P^T dO, V dO^T, dS^T Q).
    Bytes: the streamed K/V (or Q/dO) blocks are walked in grid order (forward and dq: once per kv
    head, whose group's query heads share each step), each step's block the next
    live one of its row, held at the row's last (a skipped step); a block equal to the previous
    step's is not copied again, also across rows (a window's first kv block of q block i + 1 can
    be q block i's last)."""
    tp = -(-t // max(bq, bkv)) * max(bq, bkv)
    nq, nk, group = tp // bq, tp // bkv, hq // hkv
    qpos, kpos = np.arange(tp)[:, None], np.arange(tp)[None, :]
    visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    live = [[visible[i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv].any() for j in range(nk)] for i in range(nq)]
    tiles = b * hq * sum(map(sum, live))
    kv_of = [[j for j in range(nk) if live[i][j]] for i in range(nq)]
    q_of = [[i for i in range(nq) if live[i][j]] for j in range(nk)]
    kv_steps, q_steps = max(map(len, kv_of)), max(map(len, q_of))
    # forward, dq: one grid row per kv head (its group's query heads in one step)
    kv_fetches = _fetches([(bi, h, min(kv_of[i][0] + j, kv_of[i][-1]))
                           for bi in range(b) for h in range(hkv) for i in range(nq) for j in range(kv_steps)])
    q_fetches = _fetches([(bi, h * group + s // q_steps, min(q_of[j][0] + s % q_steps, q_of[j][-1]))  # dkv
                          for bi in range(b) for h in range(hkv) for j in range(nk) for s in range(group * q_steps)])
    mm = 2 * bq * bkv * d
    head_rows, kv_rows = b * hq * tp, b * hkv * tp
    return {
        # forward: q read, o written, K and V blocks as streamed, lse written (f32), sinks
        "attention_fwd": (2 * mm * tiles, tiles * bq * bkv + tiles * bq + head_rows,
                          2 * head_rows * d * itemsize + kv_fetches * 2 * bkv * d * itemsize + 4 * head_rows + 4 * hq),
        # dq: q and dO read, dq written, K and V blocks as streamed, lse and delta read
        "attention_dq": (3 * mm * tiles, tiles * bq * bkv,
                         3 * head_rows * d * itemsize + kv_fetches * 2 * bkv * d * itemsize + 8 * head_rows),
        # dkv: k, v read and dk, dv written once; Q and dO blocks with their lse and delta rows as streamed
        "attention_dkv": (4 * mm * tiles, tiles * bq * bkv,
                          4 * kv_rows * d * itemsize + q_fetches * 2 * bq * (d * itemsize + 4)),
    }


@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 64, 100, 128, 128), (1, 8, 2, 1024, 128, 0, 256, 512),
                                   (1, 4, 1, 2048, 128, 128, 512, 256)],
                         ids=["odd-window100", "full-256x512", "window128-512x256"])
def test_tpu_kernel_cost_estimates_match_hand_counts(shape):
    """The forward, dq and dkv kernels carry pl.CostEstimate (what XLA's scheduler and cost
    analysis see of them); each equals a count by hand, and skipped tiles are not counted: a
    sliding window costs less than causal attention over the same blocks."""
    b, hq, hkv, t, d, window, bq, bkv = shape
    q = jax.ShapeDtypeStruct((b, hq, t, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, hkv, t, d), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((hq,), jnp.float32)
    grad = jax.grad(lambda *a: attention_pallas(*a, sliding_window=window, scale=d ** -0.5, block_q=bq,
                                                block_kv=bkv, platform="tpu").astype(jnp.float32).sum(),
                    argnums=(0, 1, 2, 3))
    costs = _pallas_costs(grad, q, k, k, s)
    assert costs == hand_count(b, hq, hkv, t, d, window, bq, bkv, 2)
    if window:
        causal = hand_count(b, hq, hkv, t, d, 0, bq, bkv, 2)["attention_fwd"][0]
        assert costs["attention_fwd"][0] < causal


def _lower(export_platform, b, hq, hkv, t, d, window, platform):
    q = jax.ShapeDtypeStruct((b, hq, t, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, hkv, t, d), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((hq,), jnp.float32)
    fwd = functools.partial(attention_pallas, sliding_window=window, scale=d ** -0.5, platform=platform)
    vag = jax.value_and_grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if export_platform == "cuda" else []
    texts = [export.export(jax.jit(f), platforms=[export_platform], disabled_checks=checks)(q, k, k, s).mlir_module()
             for f in (fwd, vag)]
    return texts


@pytest.mark.parametrize("shape", [(2, 4, 2, 256, 64, 64), (4, 16, 4, 4096, 128, 128), (4, 16, 4, 4096, 128, 0)],
                         ids=["tiny", "lyra-small-window128", "lyra-small-full"])
def test_tpu_lowering(shape):
    fwd_text, vag_text = _lower("tpu", *shape, platform="tpu")
    assert fwd_text.count("tpu_custom_call") == 1      # forward kernel
    assert vag_text.count("tpu_custom_call") == 3      # forward, dq, dkv


def test_cuda_lowering():
    fwd_text, vag_text = _lower("cuda", 2, 4, 2, 130, 64, 32, platform="gpu")
    assert "triton" in fwd_text and vag_text.count("__gpu$xla.gpu.triton") >= 3


def test_default_block_sizes():
    assert default_block_sizes(4096, 128, "tpu") == (512, 512)
    assert default_block_sizes(2048, 128, "tpu") == (512, 512)
    assert default_block_sizes(1024, 128, "tpu") == (512, 512)
    assert default_block_sizes(512, 128, "tpu") == (256, 256)
    assert default_block_sizes(300, 64, "tpu") == (128, 128)
    assert default_block_sizes(37, 64, "tpu") == (40, 40)
    assert default_block_sizes(4096, 128, "gpu") == (64, 64)
    assert default_block_sizes(37, 64, "gpu") == (64, 64)
    assert default_block_sizes(20, 64, "gpu") == (32, 32)
    # Explicit blocks shrink to the sequence without breaking divisibility (or Triton's powers of 2).
    from pallas_kernels.attention import _plan_blocks
    from pallas_kernels.platform import kernel_mode
    tpu, gpu = kernel_mode("tpu", who="test"), kernel_mode("gpu", who="test")
    assert _plan_blocks(200, 512, 128, tpu) == (256, 128, 256)
    assert _plan_blocks(200, 512, 512, tpu) == (200, 200, 200)
    assert _plan_blocks(130, 256, 64, gpu) == (256, 64, 256)
    with pytest.raises(ValueError, match="divide"):
        _plan_blocks(256, 48, 32, tpu)


def test_rejects_bad_inputs():
    q, k, v = np.zeros((1, 4, 16, 32), np.float32), np.zeros((1, 2, 16, 32), np.float32), np.zeros((1, 2, 16, 32), np.float32)
    sinks = np.zeros((4,), np.float32)
    with pytest.raises(ValueError, match="Tq == Tk"):
        attention_pallas(q[:, :, :8], k, v, sinks, sliding_window=0, scale=1.0, platform="cpu")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention_pallas(q[:, :3], k, v, sinks[:3], sliding_window=0, scale=1.0, platform="cpu")
    with pytest.raises(ValueError, match="powers of two"):
        attention_pallas(q, k, v, sinks, sliding_window=0, scale=1.0, block_q=24, platform="gpu")
    with pytest.raises(ValueError, match="unknown platform 'cuda'"):
        attention_pallas(q, k, v, sinks, sliding_window=0, scale=1.0, platform="cuda")


def test_splash_wrapper_can_be_traced_twice():
    """Regression: a cached splash kernel built inside one trace leaked its values into the next."""
    q = jnp.ones((1, 2, 64, 32))
    k = jnp.ones((1, 1, 64, 32))
    sinks = jnp.zeros(2)
    for _ in range(2):
        f = jax.jit(jax.grad(lambda q: attention_splash(q, k, k, sinks, sliding_window=8, scale=0.1,
                                                        platform="cpu").sum()))
        assert f(q).shape == q.shape
