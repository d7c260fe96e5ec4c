"""Does the scoring program of a preset fit a TPU slice? Compile `CompiledScorer`'s program for
the compile-only devices of a topology (the real TPU compiler, no weights, nothing run; as
`jax_bridge/plan.py` does for the train step) and read one chip's memory figures.

    python -m train.evaluation.scoring_plan --preset gpt-oss-20b --topology v6e:2x4 --rows 8 --positions 4096
"""
from __future__ import annotations

import argparse
import json
import time

from jax_bridge import tpu_compile


def plan_scoring(preset: str, topology: str, *, mesh: str = "", rows: int = 8, positions: int = 4096,
                 scored: int | None = None, kernels: str | None = "auto", model_overrides: dict | None = None) -> dict:
    """One chip's memory for scoring `rows` requests of `positions` tokens, `scored` of them
    scored (default all: a rolling log-likelihood window): the model sharded over every chip of
    `topology` by `mesh` ("" = all on fsdp; folded into tensor as the commands fold it:
    `sharding.inference_mesh`), the train step's TPU defaults (bf16 compute,
    `kernels`). An out-of-memory refusal is a result (fits False), not an error."""
    import torch

    from jax_bridge import sharding
    from jax_bridge.model_on_mesh import ModelOnMesh
    from jax_bridge.step import DEFAULT_COMPUTE_DTYPE
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    from train.evaluation.scorer import CompiledScorer

    devices = tpu_compile.topology_devices(topology)
    cfg = get_preset(preset).replace(max_seq_len=positions, **(model_overrides or {}))
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    # The split `eval` and `lm-eval` run over (their scorer reads its own weights).
    device_mesh = ModelOnMesh(model, sharding.make_mesh(mesh or None, devices)).for_inference(
        DEFAULT_COMPUTE_DTYPE["tpu"]).mesh
    scorer = CompiledScorer(model, kernels=kernels, mesh=device_mesh, batch_size=rows, max_length=positions,
                            platform="tpu", progress=False)
    params = scorer.abstract_params(model)
    out = {"preset": preset, "topology": topology, "chips": len(devices), "device_kind": devices[0].device_kind,
           "mesh": sharding.describe(device_mesh), "n_layers": cfg.n_layers, "params": cfg.param_counts()["total"],
           "rows": rows, "positions": positions, "scored": scored or positions, "kernels": dict(scorer.kernels),
           "compute_dtype": scorer.step_cfg.compute_dtype, "matmul_precision": scorer.step_cfg.matmul_precision,
           "param_bytes_per_chip": sharding.shard_bytes(params), "hbm_bytes": tpu_compile.hbm_bytes(devices[0])}
    started = time.perf_counter()
    lowered = scorer.lower(rows, positions, scored, params=params)
    out["lower_s"] = round(time.perf_counter() - started, 1)
    started, cpu = time.perf_counter(), time.process_time()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the answer
        if "exceeds available HBM" not in str(e):
            raise
        out.update(fits=False, error=str(e).strip().splitlines()[0][:400])
        return out
    out.update(compile_s=round(time.perf_counter() - started, 1), compile_cpu_s=round(time.process_time() - cpu, 1))
    mem = compiled.memory_analysis()
    out.update(argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
               temp_bytes=int(mem.temp_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
               mosaic_kernels=len(tpu_compile.mosaic_kernels(compiled.as_text())))
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    out["fits"] = out["total_bytes"] <= out["hbm_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--topology", default="v6e:2x4")
    parser.add_argument("--mesh", default="", help="as `eval --mesh` (default: every chip on fsdp, folded into tensor "
                                                   "as far as the heads divide)")
    parser.add_argument("--rows", type=int, default=8, help="requests per scoring call (global)")
    parser.add_argument("--positions", type=int, default=4096, help="tokens per request (the window)")
    parser.add_argument("--scored", type=int, default=None, help="scored positions per request (default all)")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--layers", type=int, default=None, help="cut the preset to this many layers")
    args = parser.parse_args(argv)
    overrides = {"n_layers": args.layers} if args.layers else {}
    result = plan_scoring(args.preset, args.topology, mesh=args.mesh, rows=args.rows, positions=args.positions,
                          scored=args.scored, kernels=args.kernels, model_overrides=overrides)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
