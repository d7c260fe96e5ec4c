"""The decode program as the real TPU compiler builds it for a v5e (deviceless; nothing runs),
priced by the roofline (jax_bridge/roofline.py): what one generated token reads from HBM."""
import jax
import jax.numpy as jnp
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

from jax_bridge import decoding, roofline, sharding, tpu_compile
from jax_bridge.sampling import SamplingMode
from torch_model.transformers_lm import TransformersSpec

pytest.importorskip("libtpu")

# Two Llama layers with wide KV caches: 64 rows x 8 KV heads x 128 slots x 128 = 16.8 MB per cache,
# as the 0.57 B Llama's (docs/models/llama-570m.json) at 64 prompts; small weights. (With one layer
# the compiler left the caches in HBM anyway; with two it round-tripped them: 1.93x the bytes.)
LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
         "max_position_embeddings": 256, "tie_word_embeddings": True}
ROWS, LENGTH = 64, 128


def v5e_decode_loop(model, kernels: str, rows: int, length: int):
    """(the ops of the decode loop's body, the parameters, the decoder) as the TPU compiler builds
    the program for a v5e:2x2 mesh (deviceless), greedy, from a 32-token prompt bucket."""
    mesh = sharding.make_mesh(None, [tpu_compile.device_of("v5e:2x2")])
    params = decoding.decoder_params(model, "bfloat16", mesh)
    decoder = decoding.Decoder(model, kernels=decoding.generation_kernels(kernels, "tpu", model), platform="tpu",
                               compute_dtype="bfloat16", mesh=mesh, params=params, tpu_generation="v5e")
    mode = SamplingMode(greedy=True, top_k=0, top_p=False, penalty=False)
    n_stop = decoding.stop_slots(1)
    values = decoding._values_spec(n_stop, model.cfg.vocab_size)
    key = jax.random.key_data(jax.random.key(0))
    inputs = (jax.ShapeDtypeStruct((rows, 32), jnp.int32), jax.ShapeDtypeStruct((rows, 32), jnp.int32),
              jax.ShapeDtypeStruct((rows,), jnp.bool_), values, jax.ShapeDtypeStruct(key.shape, key.dtype))
    state, _ = jax.eval_shape(lambda p, *a: decoder._prefill(p, *a, length=length, mode=mode), params, *inputs)
    whole = NamedSharding(mesh, PartitionSpec())
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole), state)
    text = roofline.module_text(decoder.decode_program(rows, length, mode, n_stop, state))
    ops, unknown, _ = roofline.collect_ops(text, roofline.xla_cost_fn())
    assert unknown, "the decode loop's trip count is a runtime value: its body counts once, per token"
    return roofline.loop_ops(ops, text), params, decoder


def test_a_v5e_decode_step_reads_the_weights_once_and_writes_its_caches_in_place():
    """Per token the loop reads about the weights and the KV cache once: no copy of a weight, and
    the caches stay in HBM, updated in place (the compiler used to bring each whole cache into VMEM
    to write one row there and copy it back, 2 x 16.8 MB per cache per token), and the cached
    attention is the Pallas kernel, which reads the cache in bf16 (the `xla` one widened it)."""
    spec = TransformersSpec(LLAMA)
    with torch.device("meta"):
        model = spec.build()
    loop, params, decoder = v5e_decode_loop(model, "cached_attention=pallas", ROWS, LENGTH)   # the rest auto
    assert decoder.decode_kernels["cached_attention"] == "pallas"
    weights = sum(a.size * a.dtype.itemsize for a in params.values())
    cache = 2 * 2 * ROWS * 8 * LENGTH * 128 * 2            # keys and values of two layers
    per_token = sum(op.hbm_bytes for op in loop)
    assert per_token <= 1.1 * (weights + cache), (per_token, weights, cache)
    cache_shape = f"bf16[{ROWS},8,{LENGTH},128]"
    assert not [op.name for op in loop if op.opcode in ("copy", "copy-start") and op.shape == cache_shape]
    assert any(op.kernel == "cached_attention" for op in loop)


# The `tiny` decode loop body's ops per token at 1 row (v5e:2x2, deviceless; libtpu as locked).
OPS_PER_TOKEN = {"bf16": 322, "mxfp4": 324}


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_a_v5e_moe_decode_step_takes_the_expert_biases_without_a_copy_per_token(experts):
    """The fused MoE kernels take each expert bias reshaped ([E, 1, N]; MXFP4's [E, N, 1]): made
    once before the decode loop, not relaid out by a copy per layer and token inside it (2 per MoE
    layer, about 14 us a token at small-o200k by the compiler's estimate). And their grids have 2
    work items, as many as the 2 rows (1 prompt, top-2) can reach experts, not one per expert:
    each item costs grid steps. At one row a step's time is mostly the fixed cost of its ops
    (~0.4 us each on the chip, BENCHMARKS.md): the loop body holds no more of them than it did
    when each was accounted for (2026-12-06: the dispatch's gathers and the KV cache's writes
    without the negative-index wrap, the ring slots as low bits, one-tile MoE metadata: bf16
    387 -> 322, MXFP4 367 -> 324)."""
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM, mxfp4_expert_modules

    cfg = get_preset("tiny")
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
        if experts == "mxfp4":
            mxfp4_expert_modules(model)
    loop, _, decoder = v5e_decode_loop(model, "auto", rows=1, length=64)
    op, kernel = ("moe", "moe_fused") if experts == "bf16" else ("moe_mxfp4", "moe_mxfp4")
    assert decoder.decode_kernels[op] == "pallas"
    kernels = [o for o in loop if o.kernel.startswith(kernel)]
    assert kernels and all(o.operands[1] == "s32[2]" for o in kernels), [o.operands[:4] for o in kernels]
    e, two_i, d = cfg.n_experts, 2 * cfg.expert_dim, cfg.d_model
    biases = ({f"bf16[{e},1,{two_i}]", f"bf16[{e},1,{d}]"} if experts == "bf16" else
              {f"bf16[{e},{two_i},1]", f"bf16[{e},{d},1]"})
    assert not [o.name for o in loop if o.opcode in ("copy", "copy-start") and o.shape in biases]
    ops = sum(o.trips for o in loop)
    assert ops <= OPS_PER_TOKEN[experts], f"the decode loop body runs {ops} ops per token, was {OPS_PER_TOKEN[experts]}"
