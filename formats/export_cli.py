"""`torchlyra export`: a checkpoint -> Hugging Face files. A whole-model checkpoint goes through
formats/hf_export.py (ours, as transformers' GptOss) or formats/transformers_export.py (a
`train --model-config` run, in its family's own layout) or formats/module_export.py (a `train
--module` run, in the module's own names); a LoRA checkpoint is written merged (default: base + adapters, any --dtype)
or, with --adapter, as peft's own adapter files (formats/lora_export.py)."""
from __future__ import annotations

from formats import hf_export, lora_export, module_export, transformers_export
from formats.errors import UserError


def add_arguments(parser) -> None:
    from formats.model_checks import add_module_arguments

    hf_export.add_arguments(parser)
    add_module_arguments(parser)
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA checkpoint's adapters as peft files (adapter_config.json, "
                             "adapter_model.safetensors) for PeftModel.from_pretrained on transformers' GptOss "
                             "(default for a LoRA checkpoint: the merged model)")
    parser.add_argument("--base-model", default=None, metavar="NAME_OR_DIR",
                        help="with --adapter: the base_model_name_or_path to record (default: the LoRA "
                             "checkpoint's base when it is a Hugging Face directory)")


def run(args) -> int:
    from formats.lora_inference import lora_meta
    from formats.model_checks import take_module_from_args

    take_module_from_args(args)
    meta = lora_meta(args.checkpoint)
    if meta is None:
        if args.adapter or args.base_model:
            raise UserError(f"--adapter: checkpoint {args.checkpoint} holds no LoRA adapters (a whole model: "
                            f"export it without --adapter)")
        if module_export.holds_module_model(args.checkpoint):
            return hf_export.run(args, export=module_export.export_checkpoint)
        if transformers_export.holds_transformers_model(args.checkpoint):
            return hf_export.run(args, export=transformers_export.export_checkpoint)
        return hf_export.run(args)
    if args.adapter:
        return run_adapter(args, meta)
    return run_merged(args)


def run_adapter(args, meta) -> int:
    from formats.lora_checkpoint import HF_BASE, LORA_META, load_lora_model

    base = meta[LORA_META]["base"]
    base_model = args.base_model or (base["path"] if base["kind"] == HF_BASE else None)
    wrapped, _, meta = load_lora_model(args.checkpoint, base=False)     # the adapters only: the base is not read
    summary = lora_export.export_adapter(wrapped, args.out, base_model=base_model, overwrite=args.overwrite)
    print(f"exported the LoRA adapters of step {meta.get('step', 0)} ({summary['n_adapter_params']:,} parameters, "
          f"r={summary['r']}, alpha={summary['alpha']:g}) to {summary['out']}: adapter_config.json, "
          f"adapter_model.safetensors")
    if base_model is None:
        print(f"base: not recorded (the base {base['path']} is a torchlyra checkpoint: `torchlyra export` it and "
              f"pass that directory as --base-model, or load it yourself before PeftModel.from_pretrained)")
    else:
        print(f"base: {base_model}")
    return 0


def run_merged(args) -> int:
    """Base + adapters merged one tensor at a time as the base is read (formats/lora_merge.py);
    a base whose layout is not read by slice is merged whole on the host by peft."""
    from formats.lora_checkpoint import load_lora_model
    from formats.lora_inference import lora_tokenizer, open_lora_base
    from formats.lora_merge import MergedWeights
    import numpy as np

    wrapped, cfg, meta = load_lora_model(args.checkpoint, base=False)
    base, weights = open_lora_base(cfg, meta)
    tensors = None
    if weights is None:
        wrapped, cfg, meta = load_lora_model(args.checkpoint)
    else:
        source = MergedWeights(weights, wrapped)
        # named_parameters: a tied head once, as the embedding (as checkpoints store it)
        tensors = ((name, np.asarray(source.read(name), np.float32)) for name, _ in base.named_parameters())
    enc, _ = lora_tokenizer(args.checkpoint, meta)
    summary = lora_export.export_merged(wrapped, cfg, args.out, step=meta.get("step", 0), enc=enc, dtype=args.dtype,
                                        shard_size_bytes=hf_export.parse_size(args.shard_size),
                                        overwrite=args.overwrite, progress=True, tensors=tensors)
    print(f"exported step {summary['step']} merged (base + LoRA adapters; {summary['n_params']:,} parameters, "
          f"{summary['dtype']}) to {summary['out']}: {', '.join(summary['files'])}")
    print(f"tokenizer: {summary['tokenizer']}")
    if summary["quantization_error"]:
        errors = summary["quantization_error"]
        print(f"MXFP4 relative error per tensor (mxfp4_error.json): mean {sum(errors.values()) / len(errors):.4f}; "
              f"part of the adapters' change is below the MXFP4 grid and rounds away")
    return 0
