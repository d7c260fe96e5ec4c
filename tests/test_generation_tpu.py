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
    state = jax.eval_shape(lambda p, *a: decoder._prefill(p, *a, length=length, mode=mode), params, *inputs)
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


def test_a_v5e_moe_decode_step_takes_the_expert_biases_without_a_copy_per_token():
    """The fused MoE kernels take each expert bias as [E, 1, N]: made once before the decode loop,
    not relaid out by a copy per layer and token inside it (2 per MoE layer, about 14 us a token at
    small-o200k by the compiler's estimate). And their grids have 2 work items, as many as the 2
    rows (1 prompt, top-2) can reach experts, not one per expert: each item costs grid steps."""
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    cfg = get_preset("tiny")
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    loop, _, decoder = v5e_decode_loop(model, "auto", rows=1, length=64)
    assert decoder.decode_kernels["moe"] == "pallas"
    kernels = [op for op in loop if op.kernel.startswith("moe_fused")]
    assert kernels and all(op.operands[1] == "s32[2]" for op in kernels), [op.operands[:4] for op in kernels]
    biases = {f"bf16[{cfg.n_experts},1,{2 * cfg.expert_dim}]", f"bf16[{cfg.n_experts},1,{cfg.d_model}]"}
    assert not [op.name for op in loop if op.opcode in ("copy", "copy-start") and op.shape in biases]
