"""Decode-time implementations against their references: cached attention (JAX vs the eager torch
op), the MoE `decode` implementation (both of its paths vs ragged_dot), and the on-device
sampling steps against transformers' logits processors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import rel_err
from jax_bridge import registry
from jax_bridge.sampling import (SamplingMode, SamplingValues, apply_repetition_penalty, first_argmax, is_stop,
                                 mark_seen, next_token, top_p_keep)
from pallas_kernels.decode_attention import cached_attention_reference
from pallas_kernels.moe import moe_experts_reference
from pallas_kernels.moe_decode import ROWS_ALONE, moe_experts_decode
from torch_model import ops


# ---- cached attention -----------------------------------------------------------------------
@pytest.mark.parametrize("b,hq,hkv,tq,slots,d,window", [(2, 4, 2, 1, 9, 16, 0), (3, 8, 1, 5, 13, 8, 4),
                                                         (1, 2, 2, 7, 7, 32, 1), (2, 6, 3, 2, 21, 64, 64)])
def test_cached_attention_jax_matches_the_torch_op(b, hq, hkv, tq, slots, d, window):
    g = torch.Generator().manual_seed(slots)
    q, k, v = torch.randn(b, hq, tq, d, generator=g), torch.randn(b, hkv, slots, d, generator=g), \
        torch.randn(b, hkv, slots, d, generator=g)
    sinks = torch.randn(hq, generator=g)
    kpos = torch.randint(-1, slots, (b, slots), generator=g, dtype=torch.int32)      # -1: empty / padding
    qpos = torch.randint(-1, slots + 2, (b, tq), generator=g, dtype=torch.int32)
    expected = ops.cached_attention_reference(q, k, v, sinks, qpos, kpos, window, d ** -0.5)
    got = cached_attention_reference(*(jnp.asarray(t.numpy()) for t in (q, k, v, sinks, qpos, kpos)),
                                     sliding_window=window, scale=d ** -0.5, platform="cpu")
    assert rel_err(np.asarray(got), expected.numpy()) < 1e-6


def _cached_inputs(b, hq, hkv, tq, slots, d, seed, dtype=jnp.float32, sinks=True):
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.standard_normal(shape), dtype) for shape in
               ((b, hq, tq, d), (b, hkv, slots, d), (b, hkv, slots, d)))
    sink = jnp.asarray(r.standard_normal(hq) if sinks else np.full(hq, -1e30), jnp.float32)     # -1e30: none
    return q, k, v, sink


def test_cached_attention_pallas_matches_the_xla_reference():
    """The Pallas decode kernel (interpreted on CPU) against the plain-JAX reference: a GQA decode
    step over a left-padded batch with ragged lengths, a row of padding only, and cache blocks
    past every row's last token that hold NaN (skipped: never read into the result); a prefill-like
    chunk (Tq 5, MHA) with a window and no sinks, slots in any order; bf16 GQA with a window; and
    the kernel under a mesh (shard_map, per device)."""
    from jax_bridge import sharded_ops, sharding
    from pallas_kernels.decode_attention import cached_attention_pallas, live_block_range

    ref = functools.partial(cached_attention_reference, platform="cpu")
    pal = functools.partial(cached_attention_pallas, platform="cpu")
    # 1. decode: 4 blocks of 16 slots; rows hold 20, 7 and 0 tokens (left-padded to slot 31), the
    #    rest of the cache is empty; NaN past slot 31 must not reach the outputs.
    q, k, v, sinks = _cached_inputs(3, 8, 2, 1, 64, 32, seed=1)
    slot = np.arange(64)
    kpos = np.stack([np.where((slot >= 32 - n) & (slot < 32), slot - (32 - n), -1) for n in (20, 7, 0)])
    qpos = np.array([[19], [6], [-1]])
    args = (jnp.asarray(qpos, jnp.int32), jnp.asarray(kpos, jnp.int32))
    first, last = live_block_range(*args, sliding_window=0, block_kv=16)
    assert first.tolist() == [0, 1, 0] and last.tolist() == [1, 1, -1]
    poisoned = v.at[:, :, 32:].set(jnp.nan)
    expected = ref(q, k, v, sinks, *args, sliding_window=0, scale=0.2)
    got = pal(q, k, poisoned, sinks, *args, sliding_window=0, scale=0.2, block_kv=16, block_batch=1)
    assert rel_err(got, expected) < 1e-6 and not np.any(np.asarray(got[2]))     # padding row: 0
    # 2. a chunk of 5 queries, MHA, window 7, no sinks, slots in any order (a ring); both batch rows
    #    in one grid step, blocks of 32 of 48 slots (the last one past the cache's end)
    q, k, v, sinks = _cached_inputs(2, 4, 4, 5, 48, 16, seed=2, sinks=False)
    r = np.random.default_rng(3)
    kpos = jnp.asarray(np.stack([r.permutation(48) - 8 for _ in range(2)]), jnp.int32)     # -8..39: some empty
    qpos = jnp.asarray([[35, 36, 37, 38, 39], [-1, 0, 1, 2, 3]], jnp.int32)
    expected = ref(q, k, v, sinks, qpos, kpos, sliding_window=7, scale=0.25)
    assert rel_err(pal(q, k, v, sinks, qpos, kpos, sliding_window=7, scale=0.25, block_kv=32), expected) < 1e-6
    # 3. bf16, GQA 4:1, window 16, contiguous positions, one block of all 40 slots
    q, k, v, sinks = _cached_inputs(2, 8, 2, 1, 40, 64, seed=4, dtype=jnp.bfloat16)
    kpos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    qpos = jnp.asarray([[39], [25]], jnp.int32)
    expected = ref(q, k, v, sinks, qpos, kpos, sliding_window=16, scale=0.125)
    got = pal(q, k, v, sinks, qpos, kpos, sliding_window=16, scale=0.125)
    assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), expected.astype(jnp.float32)) < 2e-2
    # 4. per device under a mesh: the same result
    mesh = sharding.make_mesh(None, jax.devices()[:1])
    sharded = sharded_ops.cached_attention(pal, mesh, sharded_ops.SHARD_MAP)
    assert rel_err(sharded(q, k, v, sinks, qpos, kpos, sliding_window=16, scale=0.125).astype(jnp.float32),
                   got.astype(jnp.float32)) == 0


def test_cached_attention_pallas_is_opt_in_on_tpu_until_checked_on_a_chip_and_xla_stays_on_cpu():
    impl = registry.implementations("cached_attention")["pallas"]
    assert impl.platforms == ("cpu", "tpu") and not impl.trains
    ops_ = registry.OPS + registry.GENERATION_OPS
    assert registry.resolve("auto", "tpu", ops=ops_)["cached_attention"] == "xla"
    assert registry.resolve("cached_attention=pallas", "tpu", ops=ops_)["cached_attention"] == "pallas"
    assert registry.resolve("auto", "cpu", ops=ops_)["cached_attention"] == "xla"
    with pytest.raises(registry.KernelError, match="cached_attention=pallas cannot run on platform 'gpu'"):
        registry.resolve("cached_attention=pallas", "gpu", ops=ops_)


# ---- MoE for a decode step -------------------------------------------------------------------
def moe_inputs(rows, experts, sizes, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    h, i = 32, 24
    weights = (jax.random.normal(ks[0], (experts, h, 2 * i)) * 0.3, jax.random.normal(ks[1], (experts, 2 * i)) * 0.1,
               jax.random.normal(ks[2], (experts, i, h)) * 0.3, jax.random.normal(ks[3], (experts, h)) * 0.1)
    x = jax.random.normal(ks[4], (rows, h))
    return x.astype(dtype), jnp.asarray(sizes, jnp.int32), [w.astype(dtype) for w in weights]


@pytest.mark.parametrize("sizes, chunk", [([0, 1, 0, 1], None), ([0, 5, 0, 1, 2, 2, 3, 3], None),   # row by row
                                          ([20, 0, 13, 7], None), ([0, 0, 0, 40], 6)])             # work items
@pytest.mark.parametrize("rows_alone", [ROWS_ALONE, 0])     # 0: work items however few the rows (under a mesh)
def test_moe_decode_matches_ragged_dot_reference(sizes, chunk, rows_alone):
    rows = sum(sizes)
    x, group_sizes, w = moe_inputs(rows, len(sizes), sizes, seed=rows)
    expected = jax.jit(moe_experts_reference)(x, group_sizes, *w)
    decode = jax.jit(moe_experts_decode, static_argnames=("chunk", "rows_alone"))
    assert rel_err(decode(x, group_sizes, *w, chunk=chunk, rows_alone=rows_alone), expected) < 1e-6
    program = str(jax.make_jaxpr(functools.partial(moe_experts_decode, chunk=chunk, rows_alone=rows_alone))(
        x, group_sizes, *w))
    assert ("while" in program) == (rows > rows_alone)      # the work-item loop runs a dynamic count
    assert ("cond[" in program) == (rows <= rows_alone)     # the switch over static slices


def test_moe_decode_in_bfloat16_stays_close_to_the_float32_reference():
    x, group_sizes, w = moe_inputs(8, 4, [3, 0, 4, 1], seed=4)
    expected = jax.jit(moe_experts_reference)(x, group_sizes, *w)
    xb, wb = x.astype(jnp.bfloat16), [t.astype(jnp.bfloat16) for t in w]
    got = jax.jit(moe_experts_decode)(xb, group_sizes, *wb)
    assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), expected) < 2e-2


def test_decode_moe_is_registered_for_every_platform():
    impl = registry.implementations("moe")["decode"]
    assert impl.platforms == registry.PLATFORMS and impl.load() is moe_experts_decode
    assert not impl.trains          # generation only: it has no backward
    assert not registry.implementations("moe_mxfp4")["decode"].trains


def test_generation_on_cpu_takes_the_decode_moes_left_at_auto():
    """Generation's kernels on CPU: `decode` for the MoE left at `auto`, and for an MXFP4 base's
    (which the tiled `xla` implementation decodes whole on every call); a named one is kept; on
    TPU `auto` stays (the Pallas kernels)."""
    from jax_bridge.decoding import generation_kernels
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM, mxfp4_expert_modules

    with torch.device("meta"):
        model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=1))
        plain = GptOssForCausalLM(get_preset("tiny").replace(n_layers=1))
        mxfp4_expert_modules(model)
    chosen = generation_kernels("auto", "cpu", model)
    assert (chosen["moe"], chosen["moe_mxfp4"]) == ("decode", "decode")
    assert generation_kernels("moe_mxfp4=xla", "cpu", model)["moe_mxfp4"] == "xla"
    assert generation_kernels("auto", "tpu", model)["moe_mxfp4"] == "auto"
    assert "moe_mxfp4" not in generation_kernels("auto", "cpu", plain)


def test_the_train_step_refuses_the_generation_only_moe():
    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                                         head_dim=16, n_experts=2, expert_dim=16, vocab_size=64))
    with pytest.raises(registry.KernelError, match="moe=decode is for generation only .*choose one of: xla"):
        TrainStep(model, step_cfg=StepConfig(kernels="moe=decode"))


# ---- sampling ---------------------------------------------------------------------------------
def hf_processors():
    return pytest.importorskip("transformers.generation.logits_process")


def test_repetition_penalty_matches_transformers():
    lp = hf_processors()
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    history = torch.tensor([[1, 2, 2, 7], [0, 49, 3, 3], [5, 5, 5, 5]])
    expected = lp.RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    seen = mark_seen(jnp.zeros((3, 50), bool), jnp.asarray(history.numpy()))
    got = apply_repetition_penalty(jnp.asarray(logits.numpy()), seen, 1.3)
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-6)


def test_padding_never_counts_as_seen():
    seen = mark_seen(jnp.zeros((1, 10), bool), jnp.asarray([[-1, -1, 4]]))
    assert np.flatnonzero(np.asarray(seen[0])).tolist() == [4]


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_what_transformers_keeps(top_p):
    lp = hf_processors()
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(int(top_p * 1000))) * 3
    expected = torch.isfinite(lp.TopPLogitsWarper(top_p)(None, logits.clone()))
    values, order = torch.sort(logits, descending=True)
    keep_sorted = np.asarray(top_p_keep(jnp.asarray(values.numpy()), top_p))
    kept = np.zeros_like(keep_sorted)
    np.put_along_axis(kept, order.numpy(), keep_sorted, axis=-1)
    assert (kept == expected.numpy()).all()


def sample_many(logits, mode, values, n=200):
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draw = jax.jit(jax.vmap(lambda k: next_token(logits, jnp.zeros((1, 1), bool), k, mode, values)[0]))
    return np.asarray(draw(keys))[:, 0]


def values(temperature=1.0, top_p=1.0, penalty=1.0):
    return SamplingValues(jnp.float32(temperature), jnp.float32(top_p), jnp.float32(penalty), jnp.asarray([-1]))


def test_only_allowed_ids_are_chosen_whatever_the_mode():
    """Ids a tokenizer cannot decode (here 30-39, the most likely, and every odd id) never come out:
    greedy, a plain draw, and top-k with top-p and the repetition penalty."""
    logits = jnp.asarray(np.linspace(0, 4, 40, dtype=np.float32)[None])
    allowed = (np.arange(40) < 30) & (np.arange(40) % 2 == 0)
    masked = values(top_p=0.9, penalty=1.3)._replace(allowed=jnp.asarray(allowed))
    greedy = next_token(logits, jnp.zeros((1, 1), bool), jax.random.PRNGKey(0), SamplingMode(True, 0, False, False),
                        masked)[0]
    assert greedy.tolist() == [28]
    for mode in (SamplingMode(False, 0, False, False), SamplingMode(False, 5, True, True)):
        drawn = sample_many(logits, mode, masked, n=50)
        assert allowed[drawn].all() and len(set(drawn)) > 1, (mode, drawn)


def test_top_k_and_top_p_draw_only_from_their_sets():
    logits = jnp.asarray(np.linspace(0, 4, 40, dtype=np.float32)[None])   # token 39 most likely
    top3 = sample_many(logits, SamplingMode(False, 3, False, False), values())
    assert set(top3) <= {37, 38, 39} and len(set(top3)) == 3
    probs = np.asarray(jax.nn.softmax(logits[0]))
    smallest = int(np.searchsorted(np.cumsum(probs[::-1]), 0.5) + 1)      # tokens needed to reach p = 0.5
    nucleus = sample_many(logits, SamplingMode(False, 0, True, False), values(top_p=0.5))
    assert set(nucleus) <= set(range(40 - smallest, 40)) and len(set(nucleus)) > 1


def test_low_temperature_concentrates_and_greedy_takes_the_first_maximum():
    logits = jnp.asarray([[0.0, 1.0, 0.9, 1.0]])
    assert int(first_argmax(logits)[0]) == 1
    cold = sample_many(logits, SamplingMode(False, 0, False, False), values(temperature=0.01))
    assert set(cold) <= {1, 3}
    warm = sample_many(logits, SamplingMode(False, 0, False, False), values(temperature=1.0))
    assert set(warm) == {0, 1, 2, 3}


def test_stop_ids_match_and_unused_slots_never_do():
    assert np.asarray(is_stop(jnp.asarray([3, -1, 7]), jnp.asarray([7, -1, -1, -1]))).tolist() == [False, False, True]
