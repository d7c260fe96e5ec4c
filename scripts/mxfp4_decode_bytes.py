"""HBM bytes per generated token of gpt-oss-20b's decode step, by the TPU compiler, with the experts
in bf16 against kept MXFP4 (`--base-dtype mxfp4`): the decode program `generate` compiles
(jax_bridge/decoding.py; its while loop runs once per token), priced op by op by the roofline
(jax_bridge/roofline.py: the compiler's optimized HLO, our kernels by their cost estimates, the
loop body counted once, i.e. per token).

    python scripts/mxfp4_decode_bytes.py [TOPOLOGY] [LAYERS] [BATCH]    (defaults: v6e:2x2 2 1)

One chip of TOPOLOGY decodes BATCH rows with the whole model (gpt-oss-20b's shapes with LAYERS
layers, so that the bf16 model fits one chip; the expert rows scale with the layer count). The
MoE kernels' estimates assume an evenly routed batch: BATCH x 4 rows over 32 experts (1 row: 4
experts read per layer).
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode_roofline(topology: str, layers: int, batch: int, mxfp4: bool):
    import jax
    import jax.numpy as jnp
    import torch

    from jax_bridge import decoding, roofline, sharding, tpu_compile
    from jax_bridge.lowering import abstract_params
    from jax_bridge.sampling import SamplingMode
    from torch_model.causal_lm import keeps_float32
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM, mxfp4_expert_modules

    prompt, new = 128, 128
    cfg = get_preset("gpt-oss-20b").replace(n_layers=layers, max_seq_len=prompt + new,
                                            layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
        if mxfp4:
            mxfp4_expert_modules(model)
    device = tpu_compile.device_of(topology)
    mesh = sharding.make_mesh(None, [device])
    flat = abstract_params(model)
    placed = sharding.state_shardings(flat, mesh)
    kept = lambda n, a: keeps_float32(n) or not jnp.issubdtype(a.dtype, jnp.floating)   # noqa: E731
    params = {n: jax.ShapeDtypeStruct(a.shape, a.dtype if kept(n, a) else jnp.bfloat16, sharding=placed[n])
              for n, a in flat.items()}
    decoder = decoding.Decoder(model, kernels=decoding.generation_kernels("auto", "tpu"), platform="tpu",
                               compute_dtype="bfloat16", mesh=mesh, params=params)
    rows, prompt_len, length = decoding.buckets(batch, prompt, new, 1, 1)
    mode = SamplingMode(greedy=True, top_k=False, top_p=False, penalty=False, logprobs=False)
    n_stop = decoding.stop_slots(1)
    prefill = decoder.prefill_program(rows, prompt_len, length, mode, n_stop)
    decode = decoder.decode_program(rows, length, mode, n_stop, prefill.out_info)
    return roofline.roofline(decode, tpu_compile.generation(device)), dict(decoder.decode_kernels), rows


def main(topology: str = "v6e:2x2", layers: int = 2, batch: int = 1) -> dict:
    out = {}
    for name, mxfp4 in (("bf16 experts", False), ("MXFP4 experts", True)):
        r, kernels, rows = decode_roofline(topology, layers, batch, mxfp4)
        if not r.unknown_trip_counts:
            raise RuntimeError("the decode loop's trip count was read: the figure would not be per token")
        moe = sum(row.hbm_bytes for row in r.rows if row.category.startswith("kernel: moe"))
        out[name] = {"bytes_per_token_step": r.hbm_bytes, "moe_kernel_bytes": moe, "kernels": kernels,
                     "seconds": r.seconds}
        print(f"{name}: decode ({rows} rows, {layers} layers) {r.hbm_bytes / 2**20:.1f} MiB of HBM per token "
              f"(the loop body once, with the program's prologue), of which the MoE kernels {moe / 2**20:.1f} MiB; "
              f"roofline {r.seconds * 1e3:.3f} ms; kernels {kernels}", flush=True)
    a, b = out["bf16 experts"], out["MXFP4 experts"]
    print(f"bf16 / MXFP4: the step {a['bytes_per_token_step'] / b['bytes_per_token_step']:.2f}x, "
          f"the MoE kernels {a['moe_kernel_bytes'] / max(b['moe_kernel_bytes'], 1):.2f}x")
    return out


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["v6e:2x2"]), *(int(a) for a in sys.argv[2:4]))
