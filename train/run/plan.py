"""`torchlyra plan`: will a preset fit a TPU slice? Compiles the real (sharded) train step for the
slice's chips with the TPU compiler, without weights, and prints per-chip memory against the
chip's HBM and the compile time (the work is `jax_bridge.plan.plan`); with --roofline, also how
fast one chip could run the step at its published peaks (`jax_bridge.roofline`) and the MFU
ceiling that gives against the model FLOPs of train/run/flops.py."""
from __future__ import annotations

import argparse
import json

from formats.atomic import write_atomic
from formats.errors import UserError


def add_arguments(parser) -> None:
    from formats.mxfp4 import BASE_DTYPES
    from formats.model_checks import add_module_arguments
    from torch_model.optim import NS_DTYPES, OPTIMIZERS
    from train.run.config import COMPUTE_DTYPES, REMATS

    parser.add_argument("--preset", default="lyra-small", help="model preset (default: lyra-small)")
    parser.add_argument("--model-config", metavar="CONFIG.json", default=None,
                        help="plan this transformers model (a config.json) instead of a preset; needs --seq-len")
    add_module_arguments(parser, "plan your own nn.Module instead (as train --module: path/to/file.py:NAME or "
                                 "package.module:NAME), built on the meta device; needs --seq-len", args_default="none")
    parser.add_argument("--topology", default="v5e:2x2",
                        help="TPU slice, e.g. v5e:1x1 (one chip), v6e:1x1, v5e:2x2, v6e:2x2, v4:2x2x1, v5p:2x2x1, v5e:4x4 "
                             "(default: v5e:2x2)")
    parser.add_argument("--mesh", default="",
                        help="mesh over the slice's chips, as for train, e.g. data=2,fsdp=4 (default: every chip "
                             "on fsdp); 'none': one chip holding the whole state (replicated)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the preset's)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="global batch: rows per micro-step over the whole slice (default: 8)")
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps (default: 1)")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="decoder layers as one lax.scan over stacked parameters (default), or a loop")
    parser.add_argument("--remat", default="none", choices=REMATS,
                        help="per-layer rematerialization, as for train (default: none)")
    parser.add_argument("--kernels", default="auto", help="kernel choice, as for train (default: auto)")
    parser.add_argument("--kernel-options", default=None, help="per-implementation options, as for train")
    parser.add_argument("--compute-dtype", default=None, choices=COMPUTE_DTYPES,
                        help="compute dtype (default: auto = bfloat16 on TPU)")
    parser.add_argument("--layers", type=int, default=None,
                        help="plan with this many layers instead of the preset's (compile time grows with depth)")
    parser.add_argument("--find-slice", metavar="GENERATION", default=None,
                        help="plan on this generation's slices (v5e, v6e, v5p, v4), smallest first (v5e and v6e from "
                             "one chip), with every chip "
                             "on fsdp and one sequence per chip, until one fits: the smallest slice that trains the "
                             "preset (full fine-tune, Muon + AdamW)")
    parser.add_argument("--optimizer", default="muon", choices=OPTIMIZERS,
                        help="muon: Muon for the hidden weight matrices, AdamW for the rest (default); adamw: AdamW "
                             "for every parameter, as train's --optimizer")
    parser.add_argument("--ns-dtype", default="float32", choices=NS_DTYPES,
                        help="dtype of Muon's Newton-Schulz iteration (default: float32, the optimizer's default)")
    parser.add_argument("--roofline", action="store_true",
                        help="also break the compiled step down by op category: FLOPs, HBM bytes and roofline "
                             "time at the chip's published peaks, MFU ceiling, most expensive memory-bound ops")
    parser.add_argument("--moe-routing", default="even", choices=("even", "random"),     # moe.COST_ROUTINGS
                        help="--roofline: the routing the fused MoE kernels are priced at: even (every expert the "
                             "same rows: whole row tiles; default) or random (rows drawn multinomially, seeded: "
                             "groups start mid-tile, as under a real router)")
    parser.add_argument("--packed", action="store_true",
                        help="the SFT step: packed conversations (segment ids, positions, loss weights)")
    parser.add_argument("--lora", metavar="SPEC", default=None,
                        help="plan the LoRA step (as train --lora, e.g. r=16,alpha=32,targets=all-linear+experts): "
                             "adapters trained, the base frozen in the compute dtype")
    parser.add_argument("--base-dtype", default="compute", choices=BASE_DTYPES,
                        help="with --lora: the frozen experts in the compute dtype (default) or as gpt-oss releases "
                             "them, MXFP4 (4.25 bits per weight), read by the moe_mxfp4 kernels")
    parser.add_argument("--rl", action="store_true",
                        help="what `torchlyra rl` compiles: its GRPO update step (packed rollouts, per-token "
                             "advantages; with --rl-beta / --rl-iterations its reference and logp_old fields; layers "
                             "looped, as rl runs them) and the rollout's prefill and decode-loop programs, with "
                             "whether both fit beside the train state")
    parser.add_argument("--rollout-completions", type=int, default=None,
                        help="--rl: completions decoded together, prompts per step x group size (default: --batch-size)")
    parser.add_argument("--rollout-group-size", type=int, default=8,
                        help="--rl: completions per prompt, G (default 8, rl's --group-size); each prompt is "
                             "prefilled once")
    parser.add_argument("--rollout-prompt-tokens", type=int, default=512,
                        help="--rl: the longest prompt (default 512, rl's --max-prompt-tokens)")
    parser.add_argument("--rollout-new-tokens", type=int, default=256,
                        help="--rl: new tokens per completion (default 256, rl's --max-new-tokens)")
    parser.add_argument("--rl-beta", type=float, default=0.0, help="--rl: the KL coefficient (default 0)")
    parser.add_argument("--rl-iterations", type=int, default=1, help="--rl: updates per rollout batch (default 1)")
    parser.add_argument("--rl-loss", default="dapo", help="--rl: dapo | grpo | dr_grpo (default dapo)")
    parser.add_argument("--json", metavar="OUT", help="also write the plan as JSON to OUT")


def run(args) -> int:
    from jax_bridge import registry, tpu_compile
    from jax_bridge.plan import ONE_CHIP, format_plan, plan
    from torch_model.config import ConfigError, get_preset

    model = _model_record(args)
    if model is not None:
        args.preset = model.model_type            # how the report names it
    for name in ("seq_len", "batch_size", "micro_batches", "layers", "rollout_completions", "rollout_group_size",
                 "rollout_prompt_tokens", "rollout_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, found {value}")
    overrides = {"n_layers": args.layers} if args.layers else {}
    rl = rollout = None
    scan_layers = args.scan_layers
    if args.rl:
        from jax_bridge.plan import RolloutShape
        from torch_model.policy_gradient import PolicyGradientConfig

        try:
            rl = PolicyGradientConfig(loss=args.rl_loss, beta=args.rl_beta, iterations=args.rl_iterations)
        except ConfigError as e:
            raise UserError(str(e)) from None
        rollout = RolloutShape(args.rollout_completions or args.batch_size, args.rollout_prompt_tokens,
                               args.rollout_new_tokens, args.rollout_group_size)
        scan_layers = False         # rl's update step loops over the layers
    if args.find_slice:
        if rl is not None:
            raise UserError("--find-slice plans the train step; give --topology with --rl")
        return find_slice(args, overrides, model)
    try:
        result = plan(args.preset, args.topology, mesh=None if args.mesh.strip() == ONE_CHIP else args.mesh,
                      seq_len=args.seq_len, batch_size=args.batch_size, micro_batches=args.micro_batches,
                      scan_layers=scan_layers, remat=args.remat, kernels=args.kernels, kernel_options=args.kernel_options,
                      compute_dtype=args.compute_dtype, model_overrides=overrides, roofline=args.roofline,
                      optimizer=optimizer_of(args), packed=args.packed, lora=args.lora, rl=rl,
                      rollout=rollout, model_record=model, base_dtype=args.base_dtype,
                      moe_routing=args.moe_routing)
    except tpu_compile.TopologyError as e:
        raise UserError(f"--topology: {e}") from None
    except (ValueError, ConfigError) as e:
        if isinstance(e, registry.KernelError):
            raise
        raise UserError(str(e).splitlines()[0]) from None
    print(format_plan(result))
    if result.roofline is not None:
        print(roofline_report(result, model.replace(max_seq_len=args.seq_len) if model is not None
                              else get_preset(args.preset).replace(**overrides)))
    if args.json:
        write_atomic(args.json, (json.dumps(result.to_dict(), indent=1) + "\n").encode())
        print(f"wrote {args.json}")
    return 0


def optimizer_of(args):
    """The optimizer the planned step updates with (--optimizer, --ns-dtype), as train's."""
    from torch_model.optim import OptimizerConfig

    return OptimizerConfig(ns_dtype=args.ns_dtype, optimizer=args.optimizer)


def _model_record(args):
    """The transformers model of --model-config or the module of --module (None: the --preset,
    checked here)."""
    from torch_model.config import ConfigError, get_preset
    from torch_model.transformers_lm import TransformersSpec

    if args.module_args and not args.module:
        raise UserError("--module-args: the keyword arguments of --module; give --module")
    if args.module is not None:
        if args.model_config is not None:
            raise UserError("--module and --model-config name two models: give one")
        if not args.seq_len:
            raise UserError("--module: give --seq-len (a module records no training length)")
        if args.layers:
            raise UserError("--module: --layers is not built for modules (set the depth in --module-args)")
        from formats.model_checks import module_record

        return module_record(args.module, args.module_args or {}, args.seq_len)
    if args.model_config is None:
        try:
            get_preset(args.preset)
        except ConfigError as e:
            raise UserError(str(e)) from None
        return None
    if not args.seq_len:
        raise UserError("--model-config: give --seq-len (a transformers config has no training length)")
    if args.layers:
        raise UserError("--model-config: --layers is not built for transformers models (set num_hidden_layers in "
                        "the config)")
    return TransformersSpec.from_file(args.model_config)     # refusals: ConfigErrors, one line


def find_slice(args, overrides: dict, model=None) -> int:
    """--find-slice: the smallest slice of a generation whose chips hold the whole train step."""
    from jax_bridge import tpu_compile
    from jax_bridge.plan import format_plan, smallest_slice
    from torch_model.config import ConfigError

    try:
        plans = smallest_slice(args.preset, args.find_slice, seq_len=args.seq_len, micro_batches=args.micro_batches,
                               scan_layers=args.scan_layers, remat=args.remat, kernels=args.kernels,
                               kernel_options=args.kernel_options, compute_dtype=args.compute_dtype,
                               model_overrides=overrides, optimizer=optimizer_of(args),
                               packed=args.packed, lora=args.lora, model_record=model, base_dtype=args.base_dtype,
                               **({"mesh": args.mesh} if args.mesh.strip() else {}),
                               report=lambda p: print(format_plan(p) if p.device_kind else
                                                      f"plan: {p.topology}: {p.error}", flush=True))
    except tpu_compile.TopologyError as e:
        raise UserError(f"--find-slice: {e}") from None
    except ConfigError as e:
        raise UserError(str(e)) from None
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    last = plans[-1]
    if last.fits:
        what = f"LoRA ({args.lora})" if args.lora else "a full fine-tune"
        print(f"smallest {args.find_slice} slice for {what} of {args.preset}: {last.topology} "
              f"({last.chips} chips, mesh {last.mesh})")
    else:
        print(f"no {args.find_slice} slice up to {last.topology} fits {args.preset}")
    if args.json:
        write_atomic(args.json, (json.dumps([p.to_dict() for p in plans], indent=1) + "\n").encode())
        print(f"wrote {args.json}")
    return 0


def roofline_report(result, cfg) -> str:
    """Sets the model FLOPs of one chip's share of the step on the plan's roofline and formats
    it, with Muon's Newton-Schulz per token."""
    from jax_bridge.roofline import format_roofline
    from train.run.flops import flops_per_token

    tokens = result.batch_size * result.seq_len * result.micro_batches // result.chips
    r = result.roofline
    r.set_model_flops(flops_per_token(cfg, result.seq_len) * tokens)
    lines = [format_roofline(r)]
    ns = next((row for row in r.rows if row.category == "optimizer: Newton-Schulz"), None)
    if ns is not None and r.seconds:
        lines.append(f"  Muon Newton-Schulz: {ns.flops / 1e12:.2f} TFLOP ({ns.flops / r.model_flops:.0%} of the model "
                     f"FLOPs), {ns.seconds * 1e3:.2f} ms = {ns.seconds / r.seconds:.1%} of the roofline step, "
                     f"{ns.seconds / tokens * 1e9:.1f} ns per token at {tokens} tokens per chip")
    return "\n".join(lines)
