"""Runs in a subprocess with 8 simulated CPU devices (see test_generation_mesh.py): greedy
tokens of a small MoE model on one device and sharded over each mesh given, and the sharded
prefill's last-position logits beside eager PyTorch's, printed as JSON.

usage: python tests/generation_mesh_worker.py SEED MESH ...   e.g. 3 fsdp=2,tensor=2,expert=2
"""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from jax_bridge import sharding  # noqa: E402
from jax_bridge.decoding import round_up  # noqa: E402
from parity.generation import eager_greedy  # noqa: E402
from torch_model.config import get_preset  # noqa: E402
from torch_model.kv_cache import left_pad  # noqa: E402
from torch_model.model import GptOssForCausalLM  # noqa: E402
from train.generation.generator import Generator  # noqa: E402
from train.generation.sampling import SamplingConfig  # noqa: E402

NEW = 12
# 4 experts, 4/2 heads, vocabulary 320: every mesh axis (data, fsdp, tensor, expert) can split.
CONFIG = dict(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
              expert_dim=32, sliding_window=8, max_seq_len=64, bos_token_id=0, eos_token_id=0)


def greedy(model, prompts, mesh):
    generator = Generator(model, mesh=mesh)
    return generator, generator.generate(prompts, SamplingConfig(max_new_tokens=NEW, temperature=0)).tokens


def last_logits(generator, prompts):
    rows = round_up(len(prompts), generator.decoder.batch_shards)
    ids, positions = left_pad(prompts + [[]] * (rows - len(prompts)), round_up(max(map(len, prompts)), 32))
    return generator.decoder.last_logits(ids.numpy().astype(np.int32), positions.numpy().astype(np.int32))[:len(prompts)]


def main(seed: int, meshes: list[str]) -> dict:
    assert len(jax.devices()) == 8
    torch.manual_seed(seed)
    model = GptOssForCausalLM(get_preset("tiny").replace(**CONFIG)).eval()
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, CONFIG["vocab_size"], n).tolist() for n in (5, 17, 33)]    # odd lengths
    _, tokens = greedy(model, prompts, None)
    _, margins = eager_greedy(model, prompts, NEW)
    with torch.no_grad():
        eager = np.stack([model(torch.tensor([p]))[0, -1].numpy() for p in prompts])
    out = {"one_device": tokens, "margins": margins, "meshes": {}}
    for spec in meshes:
        generator, mesh_tokens = greedy(model, prompts, sharding.make_mesh(spec))
        mesh_logits = last_logits(generator, prompts)
        # One prompt x G = batch shards: too few prompt rows to split, prefilled on every device
        grouped = generator.generate(prompts[1:2], SamplingConfig(max_new_tokens=NEW, temperature=0),
                                     samples_per_prompt=generator.decoder.batch_shards)
        collectives = list(generator.decoder.decode_collectives().values())
        # The decode MoE's switch over static slices would copy every expert here (not split)
        switch = any(" conditional(" in p.as_text() for p in generator.decoder.decode_programs().values())
        out["meshes"][spec] = {"tokens": mesh_tokens, "logits_max_abs_diff": float(np.abs(mesh_logits - eager).max()),
                               "decode_collectives": collectives, "decode_switch": switch,
                               "logits_max_abs": float(np.abs(eager).max()), "grouped_tokens": grouped.tokens,
                               "grouped_bucket": list(grouped.bucket),
                               **new_params(generator, prompts, spec, seed, mesh_tokens)}
    out["inference_meshes"] = inference_meshes(model)
    return out


def inference_meshes(model) -> dict:
    """The mesh each --mesh runs inference over (sharding.inference_mesh): this model's; this
    model's with its experts as MXFP4 stacks (split over experts by tensor); and with routers so
    large that tensor, which does not split them, would hold more than fsdp does while gathering one."""
    from jax_bridge.decoding import decoder_params
    from torch_model.model import mxfp4_expert_modules

    params = decoder_params(model, "float32")
    out = {spec: sharding.describe(sharding.inference_mesh(sharding.make_mesh(spec), model.cfg, params))
           for spec in ("fsdp=8", "data=2,fsdp=4", "fsdp=2,tensor=2,expert=2", "data=4,fsdp=2")}
    with torch.device("meta"):
        quantized = GptOssForCausalLM(model.cfg)
        mxfp4_expert_modules(quantized)
    two = sharding.make_mesh("fsdp=2", jax.devices()[:2])
    out["mxfp4 fsdp=2"] = sharding.describe(sharding.inference_mesh(two, model.cfg, decoder_params(quantized, "float32")))
    routers = {**params, **{f"model.layers.{i}.mlp.router.weight": jax.ShapeDtypeStruct((1 << 14, CONFIG["d_model"]),
                                                                                        np.float32) for i in (0, 1)}}
    out["large routers fsdp=2"] = sharding.describe(sharding.inference_mesh(two, model.cfg, routers))
    return out


def new_params(generator, prompts, spec, seed, before) -> dict:
    """set_params with another model's parameters as arrays already on the mesh (as an RL update
    hands them over): taken without a host round trip (the same device buffers), and decoded as a
    decoder built from that model decodes."""
    torch.manual_seed(seed + 1)
    other = GptOssForCausalLM(get_preset("tiny").replace(**CONFIG)).eval()
    fresh, expected = greedy(other, prompts, sharding.make_mesh(spec))
    generator.decoder.set_params(fresh.decoder.params)
    buffers = lambda a: [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]  # noqa: E731
    same = all(buffers(generator.decoder.params[n]) == buffers(a) for n, a in fresh.decoder.params.items())
    tokens = generator.generate(prompts, SamplingConfig(max_new_tokens=NEW, temperature=0)).tokens
    return {"set_params_same_buffers": same, "set_params_tokens_equal": tokens == expected,
            "set_params_tokens_changed": tokens != before}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2:])))
