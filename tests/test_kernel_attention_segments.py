"""Segment-masked attention (packed conversations): every kernel against the plain-JAX reference.

Rows hold 1-3 segments (and padding with its own id), at odd lengths; forward and backward are
compared on fresh random inputs. The reference itself is checked against running each segment
alone, so masking by ids is checked against its meaning, not only against another mask.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err
from pallas_kernels.attention import attention_pallas, attention_reference, attention_splash, segment_tile_counts
from test_kernel_attention import make_inputs, out_and_grads


def random_segments(seed, b, t, contiguous=True):
    """[B, T] int32 ids: per row 1-3 segments of random lengths, maybe padding (id 0) at the end;
    contiguous=False: ids in any order (the kernels must not assume runs)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        n = int(rng.integers(1, 4))
        cuts = np.sort(rng.choice(np.arange(1, t), size=n, replace=False))
        ids = np.zeros(t, np.int32)
        for s, (lo, hi) in enumerate(zip([0, *cuts[:-1]], cuts), start=1):
            ids[lo:hi] = s
        ids[cuts[-1]:] = 0 if rng.random() < 0.5 else n      # padding, or the last segment runs on
        if not contiguous:
            ids = rng.integers(0, 3, t).astype(np.int32)
        rows.append(ids)
    return jnp.asarray(np.stack(rows))


def seg_fn(fn, segments):
    return functools.partial(fn, segment_ids=segments)


def check(fn, case, seed, contiguous=True, fwd_tol=1e-5, bwd_tol=1e-4):
    b, hq, hkv, t, d, window = case
    args = make_inputs(seed, b, hq, hkv, t, d, jnp.float32)
    segments = random_segments(seed, b, t, contiguous)
    out, grads = out_and_grads.__wrapped__(lambda q, k, v, s: fn(q, k, v, s, segment_ids=segments))(*args)
    ref = functools.partial(attention_reference, sliding_window=window, scale=d ** -0.5)
    ref_out, ref_grads = out_and_grads.__wrapped__(lambda q, k, v, s: ref(q, k, v, s, segment_ids=segments))(*args)
    assert rel_err(out, ref_out) <= fwd_tol, rel_err(out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert rel_err(g, r) <= bwd_tol, (name, rel_err(g, r))


# (B, Hq, Hkv, T, D, sliding_window), block_q, block_kv
CASES = [((2, 4, 2, 37, 32, 0), 16, 16), ((2, 2, 1, 70, 32, 24), 16, 32), ((1, 2, 2, 45, 32, 0), 16, 8)]


@pytest.mark.parametrize("case,bq,bkv", CASES, ids=["T37-full", "T70-window", "T45-bkv8"])
def test_tpu_kernel_with_segments(case, bq, bkv):
    fn = functools.partial(attention_pallas, sliding_window=case[5], scale=case[4] ** -0.5, block_q=bq,
                           block_kv=bkv, platform="cpu")
    check(fn, case, seed=sum(case) + bq, contiguous=case[3] != 45)


def test_gpu_kernel_interpreted_with_segments():
    case = (2, 4, 2, 37, 32, 16)
    fn = functools.partial(attention_pallas, sliding_window=16, scale=32 ** -0.5, block_q=16, block_kv=16,
                           platform="gpu", interpret="generic")
    check(fn, case, seed=3)


def test_splash_with_segments():
    case = (1, 2, 1, 130, 32, 0)
    check(functools.partial(attention_splash, sliding_window=0, scale=32 ** -0.5, platform="cpu"), case, seed=5)


def test_reference_equals_segments_run_alone():
    """Masking by ids means: each segment attends as if it were alone (queries, keys and values
    of the others invisible). Checked on the JAX and eager-torch references."""
    import torch
    from torch_model.ops import attention_reference as torch_reference

    b, hq, hkv, t, d, window = 1, 4, 2, 29, 16, 5
    q, k, v, sinks, _ = make_inputs(11, b, hq, hkv, t, d, jnp.float32)
    lengths = [7, 13, 9]
    ids = jnp.asarray(np.repeat(np.arange(1, 4), lengths)[None].astype(np.int32))
    ref = jax.jit(functools.partial(attention_reference, sliding_window=window, scale=0.3))
    packed = ref(q, k, v, sinks, segment_ids=ids)
    to_t = lambda x: torch.tensor(np.asarray(x))
    packed_torch = torch_reference(to_t(q), to_t(k), to_t(v), to_t(sinks), window, 0.3, to_t(ids))
    assert rel_err(packed, packed_torch.numpy()) <= 1e-5
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = ref(q[:, :, part], k[:, :, part], v[:, :, part], sinks)
        assert rel_err(packed[:, :, part], alone) <= 1e-6
        start += n
    unmasked = ref(q, k, v, sinks)
    assert rel_err(packed, unmasked) > 1e-2          # the ids did mask something


def test_segments_skip_tiles():
    """Per-row block bounds: tiles whose queries and keys share no id are skipped, exactly the
    ones a brute-force count finds; ids need not be contiguous."""
    ids = np.repeat([1, 2, 3, 0], [40, 50, 30, 8])[None].astype(np.int32)        # T = 128, blocks 16
    counts = segment_tile_counts(jnp.asarray(ids), sliding_window=0, block_q=16, block_kv=16)
    q_blocks = 8
    causal = q_blocks * (q_blocks + 1) // 2
    meet = sum(1 for i in range(q_blocks) for j in range(i + 1)
               if set(ids[0, i * 16:(i + 1) * 16]) & set(ids[0, j * 16:(j + 1) * 16]))
    assert counts["visited"] == meet < causal and counts["skipped"] == causal - meet
    scattered = np.tile([1, 2], 64)[None].astype(np.int32)          # every tile meets: none skipped
    assert segment_tile_counts(jnp.asarray(scattered), sliding_window=0, block_q=16, block_kv=16)["skipped"] == 0


def test_rejects_bad_segment_ids():
    q, k, v, sinks, _ = make_inputs(0, 1, 2, 1, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match="segment_ids must be integer"):
        attention_pallas(q, k, v, sinks, sliding_window=0, scale=1.0, platform="cpu",
                         segment_ids=jnp.zeros((1, 15), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be integer"):
        attention_reference(q, k, v, sinks, sliding_window=0, scale=1.0, segment_ids=jnp.zeros((1, 16)))


def test_coverage_lines_name_segment_tiles():
    from parity.coverage import segment_lines

    ids = np.repeat([1, 2, 3, 0], [100, 200, 150, 62])[None].repeat(2, 0)      # T = 512
    pallas = segment_lines("pallas", [0, 128], ids, 64, {"block_q": 128, "block_kv": 128})
    assert len(pallas) == 2 and "full causal" in pallas[0] and "window 128" in pallas[1]
    assert "skipped" in pallas[0] and "NOT exercised" not in pallas[0]
    splash = segment_lines("splash", [0], ids, 64, {})
    assert "skipped by segments: none" in splash[0]


def test_registry_refuses_attention_without_segment_ids_by_name():
    from jax_bridge import registry

    def plain(q, k, v, sinks, *, sliding_window, scale):
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)

    registry.register_implementation("attention", "no_segments", plain, contract_version=1)
    try:
        registry.check_segments({"attention": "pallas"})          # the built-ins take them
        registry.check_segments({"attention": "splash"})
        registry.check_segments({"attention": "xla"})
        with pytest.raises(registry.ContractError, match="attention=no_segments cannot run segment-masked"):
            registry.check_segments({"attention": "no_segments"})
        with pytest.raises(registry.KernelError, match="segment_ids"):
            registry.implementations("attention")["pallas"].check_options({"segment_ids": 1})
    finally:
        registry.unregister_implementation("attention", "no_segments")


def test_segmented_triton_kernels_lower_for_cuda():
    from jax import export

    q = jax.ShapeDtypeStruct((2, 4, 130, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 2, 130, 64), jnp.bfloat16)
    s, ids = jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((2, 130), jnp.int32)
    loss = lambda q, k, v, s, ids: attention_pallas(q, k, v, s, sliding_window=32, scale=0.125, platform="gpu",
                                                    segment_ids=ids).astype(jnp.float32).sum()
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), platforms=["cuda"],
                         disabled_checks=checks)(q, k, k, s, ids).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 3        # forward, dq, dkv
