#!/usr/bin/env python3
"""A preset's decode loop as the real TPU compiler builds it for one v5e chip (deviceless: nothing
runs, the weights are never made): per generated token, the HBM bytes and roofline time of the
loop body (jax_bridge/roofline.py) and how many ops the body runs, per kernel choice. At one row a
small model's decode is bound by the fixed cost of its ops as much as by its bytes
(BENCHMARKS.md, "Decoding on one TPU v5e chip").

    python3 scripts/decode_loop_ops.py [--preset small-o200k | --model-config CONFIG.json] [--rows 1] \
        [--kernels moe=pallas;moe=decode]
"""
import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def loop_body(preset: str, rows: int, kernels: str, length: int = 256, model_config: str | None = None):
    """(the decode loop body's costed ops, the program's ops outside the loop (run once per call),
    the decode kernels chosen) for one program: the preset's model, or a transformers config's."""
    import torch

    from jax_bridge import decoding, roofline, sharding, tpu_compile
    from jax_bridge.sampling import SamplingMode
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    if model_config:
        from formats.model_checks import build_model
        from torch_model.transformers_lm import TransformersSpec

        model = build_model(TransformersSpec.from_file(model_config), meta=True)
    else:
        with torch.device("meta"):
            model = GptOssForCausalLM(get_preset(preset))
    mesh = sharding.make_mesh(None, [tpu_compile.device_of("v5e:1x1")])
    params = decoding.decoder_params(model, "bfloat16", mesh)
    decoder = decoding.Decoder(model, kernels=decoding.generation_kernels(kernels, "tpu", model), platform="tpu",
                               compute_dtype="bfloat16", mesh=mesh, params=params, tpu_generation="v5e")
    mode = SamplingMode(greedy=True, top_k=0, top_p=False, penalty=False)
    n_stop = decoding.stop_slots(1)
    prefill = decoder.prefill_program(rows, 32, length, mode, n_stop)
    text = roofline.module_text(decoder.decode_program(rows, length, mode, n_stop, prefill.out_info[0]))
    ops, _, _ = roofline.collect_ops(text, roofline.xla_cost_fn())
    loop = roofline.loop_ops(ops, text)
    inside = {id(op) for op in loop}
    return loop, [op for op in ops if id(op) not in inside], dict(decoder.decode_kernels)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small-o200k", help="our model's preset (default: small-o200k)")
    parser.add_argument("--model-config", default=None, metavar="CONFIG.json",
                        help="a transformers config.json's model instead of the preset")
    parser.add_argument("--rows", type=int, default=1, help="rows decoded at once (default: 1)")
    parser.add_argument("--kernels", default="moe=pallas;moe=decode", help="';'-separated kernel specs to compare")
    args = parser.parse_args(argv)
    from jax_bridge import roofline

    peak, bandwidth = roofline.device_peaks("v5e")
    fixed = roofline.op_cost("v5e")
    print(f"{args.model_config or args.preset}, {args.rows} row(s), one v5e chip (deviceless), per generated token:")
    print("| kernels | HBM bytes | roofline | ops in the loop body | of them fusions | most bytes "
          "| outside the loop, once per call |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.kernels.split(";"):
        loop, outside, chosen = loop_body(args.preset, args.rows, spec, model_config=args.model_config)
        hbm = sum(op.hbm_bytes * op.trips for op in loop)
        seconds = sum(roofline.op_seconds(op, peak, bandwidth, fixed)[0] * op.trips for op in loop)
        opcodes = collections.Counter(op.opcode for op in loop)
        top = max(loop, key=lambda op: op.hbm_bytes)
        print(f"| {spec} | {hbm / 1e6:.1f} MB | {seconds * 1e3:.3f} ms | {sum(op.trips for op in loop)} | "
              f"{opcodes['fusion']} | {top.name} {top.hbm_bytes / 1e6:.1f} MB | {len(outside)} ops, "
              f"{sum(op.hbm_bytes for op in outside) / 1e6:.2f} MB, "
              f"{sum(roofline.op_seconds(op, peak, bandwidth, fixed)[0] for op in outside) * 1e6:.1f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
