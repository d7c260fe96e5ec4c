"""`torchlyra plan`: will a preset fit a TPU slice? Compiles the real (sharded) train step for the
slice's chips with the TPU compiler, without weights, and prints per-chip memory against the
chip's HBM and the compile time (the work is `jax_bridge.plan.plan`)."""
from __future__ import annotations

import argparse
import json
import os

from train.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="lyra-small", help="model preset (default: lyra-small)")
    parser.add_argument("--topology", default="v5e:2x2",
                        help="TPU slice, e.g. v5e:2x2, v6e:2x2, v4:2x2x1, v5p:2x2x1, v5e:4x4 (default: v5e:2x2)")
    parser.add_argument("--mesh", default="",
                        help="mesh over the slice's chips, as for train, e.g. data=2,fsdp=4 (default: every chip "
                             "on fsdp); 'none': one chip holding the whole state (replicated)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the preset's)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="global batch: rows per micro-step over the whole slice (default: 8)")
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps (default: 1)")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="decoder layers as one lax.scan over stacked parameters (default), or a loop")
    parser.add_argument("--remat", default="none", choices=["none", "full", "save-matmuls"],
                        help="per-layer rematerialization, as for train (default: none)")
    parser.add_argument("--kernels", default="auto", help="kernel choice, as for train (default: auto)")
    parser.add_argument("--kernel-options", default=None, help="per-implementation options, as for train")
    parser.add_argument("--compute-dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="compute dtype (default: auto = bfloat16 on TPU)")
    parser.add_argument("--layers", type=int, default=None,
                        help="plan with this many layers instead of the preset's (compile time grows with depth)")
    parser.add_argument("--packed", action="store_true",
                        help="the SFT step: packed conversations (segment ids, positions, loss weights)")
    parser.add_argument("--json", metavar="OUT", help="also write the plan as JSON to OUT")


def run(args) -> int:
    from jax_bridge import registry, tpu_compile
    from jax_bridge.plan import ONE_CHIP, format_plan, plan
    from torch_model.config import ConfigError, get_preset

    try:
        get_preset(args.preset)
    except ConfigError as e:
        raise UserError(str(e)) from None
    for name in ("seq_len", "batch_size", "micro_batches", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, found {value}")
    overrides = {"n_layers": args.layers} if args.layers else {}
    try:
        result = plan(args.preset, args.topology, mesh=None if args.mesh.strip() == ONE_CHIP else args.mesh,
                      seq_len=args.seq_len, batch_size=args.batch_size, micro_batches=args.micro_batches,
                      scan_layers=args.scan_layers, remat=args.remat, kernels=args.kernels, kernel_options=args.kernel_options,
                      compute_dtype=args.compute_dtype, model_overrides=overrides, packed=args.packed)
    except tpu_compile.TopologyError as e:
        raise UserError(f"--topology: {e}") from None
    except (ValueError, ConfigError) as e:
        if isinstance(e, registry.KernelError):
            raise
        raise UserError(str(e).splitlines()[0]) from None
    print(format_plan(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result.to_dict(), fh, indent=1)
        print(f"wrote {args.json}")
    return 0
