"""HBM bytes per generated token of gpt-oss-20b's decode step, by the TPU compiler, with the experts
in bf16 against kept MXFP4 (`--base-dtype mxfp4`): the decode program `generate` compiles
(jax_bridge/decoding.py; its while loop runs once per token), priced op by op as the roofline
prices a step (jax_bridge/roofline.py: the compiler's optimized HLO, our kernels by their cost
estimates). Per token: the ops of the loop (its body and what it calls); the program's prologue
(once per call: e.g. the arguments' relayouts the compile-only layouts ask for) is shown apart.

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
    import torch

    from jax_bridge import decoding, sharding, tpu_compile
    from jax_bridge.sampling import SamplingMode
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM, mxfp4_expert_modules

    prompt, new = 128, 128
    # the layer types re-derived: sliding and full alternating, as gpt-oss-20b's (any count, odd too)
    cfg = get_preset("gpt-oss-20b").replace(n_layers=layers, max_seq_len=prompt + new)
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
        if mxfp4:
            mxfp4_expert_modules(model)
    device = tpu_compile.device_of(topology)
    mesh = sharding.make_mesh(None, [device])
    params = decoding.decoder_params(model, "bfloat16", mesh)
    decoder = decoding.Decoder(model, kernels=decoding.generation_kernels("auto", "tpu"), platform="tpu",
                               compute_dtype="bfloat16", mesh=mesh, params=params)
    rows, prompt_len, length = decoding.buckets(batch, prompt, new, 1, 1)
    mode = SamplingMode(greedy=True, top_k=False, top_p=False, penalty=False, logprobs=False)
    n_stop = decoding.stop_slots(1)
    prefill = decoder.prefill_program(rows, prompt_len, length, mode, n_stop)
    decode = decoder.decode_program(rows, length, mode, n_stop, prefill.out_info[0])
    return decode, dict(decoder.decode_kernels), rows


def per_token_bytes(compiled) -> dict:
    """HBM bytes of the decode program's ops: those of its while loop (per token) and of the
    prologue (once per call), and the MoE kernels' share of the loop's."""
    from jax_bridge import roofline

    text = roofline.module_text(compiled)
    ops, unknown, _ = roofline.collect_ops(text, roofline.xla_cost_fn())
    if not unknown:
        raise RuntimeError("the decode loop's trip count was read: its body would not be counted once per token")
    loop = roofline.loop_ops(ops, text)
    return {"per_token": sum(op.hbm_bytes for op in loop),
            "prologue": sum(op.hbm_bytes for op in ops) - sum(op.hbm_bytes for op in loop),
            "moe_per_token": sum(op.hbm_bytes for op in loop if op.kernel.startswith(("moe_fused", "moe_mxfp4")))}


def main(topology: str = "v6e:2x2", layers: int = 2, batch: int = 1) -> dict:
    out = {}
    for name, mxfp4 in (("bf16 experts", False), ("MXFP4 experts", True)):
        compiled, kernels, rows = decode_roofline(topology, layers, batch, mxfp4)
        out[name] = found = {**per_token_bytes(compiled), "kernels": kernels}
        print(f"{name}: decode of {rows} row(s), {layers} layers: {found['per_token'] / 2**20:.1f} MiB of HBM per "
              f"token, of which the MoE kernels {found['moe_per_token'] / 2**20:.1f} MiB (prologue, once per call: "
              f"{found['prologue'] / 2**20:.1f} MiB); kernels {kernels}", flush=True)
    a, b = out["bf16 experts"], out["MXFP4 experts"]
    print(f"bf16 / MXFP4 per token: the step {a['per_token'] / b['per_token']:.2f}x, "
          f"the MoE kernels {a['moe_per_token'] / max(b['moe_per_token'], 1):.2f}x")
    return out


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["v6e:2x2"]), *(int(a) for a in sys.argv[2:4]))
