"""The model `generate`, `eval` and `export` use for a LoRA checkpoint (adapters + a reference to
the base, formats/lora_checkpoint.py): base + adapters unmerged (peft's layers inside our model, as
they trained), or merged by peft's `merge_and_unload` (`--merge`: plain weights, no LoRA path).
"""
from __future__ import annotations

import os
from pathlib import Path


def add_merge_argument(parser, *, base_dtype: bool = False) -> None:
    """`--merge`, as every inference command that takes a LoRA checkpoint offers it; with
    base_dtype, also `--base-dtype` (the commands that run a gpt-oss base with its experts MXFP4)."""
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA checkpoint: merge the adapters into the weights first (default: base + adapters "
                             "unmerged, as trained)")
    if base_dtype:
        from formats.mxfp4 import BASE_DTYPES

        parser.add_argument("--base-dtype", default="compute", choices=BASE_DTYPES,
                            help="mxfp4: a released gpt-oss directory (or a LoRA checkpoint on one) run with its "
                                 "experts kept MXFP4 on the device, read by the moe_mxfp4 kernels (default: compute, "
                                 "every weight in the compute dtype)")


def lora_meta(checkpoint: str | os.PathLike) -> dict | None:
    """The metadata of a LoRA checkpoint named by `checkpoint` (run, checkpoints or step
    directory), None for any other checkpoint or a Hugging Face directory."""
    from formats.hf_model import is_hf_dir
    from formats.checkpoint import find_checkpoint, read_meta
    from formats.lora_checkpoint import is_lora_meta

    if is_hf_dir(checkpoint):
        return None
    meta, _ = read_meta(find_checkpoint(checkpoint))
    return meta if is_lora_meta(meta) else None


def load_lora_for_inference(checkpoint, *, merge: bool = False, base_dtype: str = "compute"):
    """(model, meta): our GptOssForCausalLM holding peft's LoRA layers (unmerged), or with the
    adapters merged into its weights; float32 (experts MXFP4 with base_dtype "mxfp4"), eval
    mode. meta as load_checkpoint gives it."""
    from torch_model.lora import unwrap
    from formats.lora_checkpoint import load_lora_model

    wrapped, _, meta = load_lora_model(checkpoint, base_dtype=base_dtype)
    model = wrapped.merge_and_unload(progressbar=False) if merge else unwrap(wrapped)
    return model.eval(), meta


def lora_tokenizer(checkpoint, meta: dict):
    """(tiktoken Encoding or None, one line saying which): the LoRA checkpoint's own tokenizer,
    else its base's (a LoRA run trains on the base's tokenizer)."""
    from formats.checkpoint import checkpoint_tokenizer, find_checkpoint, read_meta
    from formats.lora_checkpoint import HF_BASE, LORA_META

    enc, found = checkpoint_tokenizer(checkpoint, meta)
    if enc is not None:
        return enc, found
    base = meta[LORA_META]["base"]
    path = Path(base["path"])
    if base["kind"] == HF_BASE:
        return checkpoint_tokenizer(path, {"hf_dir": str(path)})
    step_dir = find_checkpoint(path)
    base_meta, _ = read_meta(step_dir)
    return checkpoint_tokenizer(step_dir, {**base_meta, "step_dir": str(step_dir)})


def load_inference_model(checkpoint: str | os.PathLike, *, merge: bool = False, base_dtype: str = "compute"):
    """(float32 model in eval mode, meta) of any checkpoint the inference commands take: ours, a
    `train --model-config` run's transformers model, a Hugging Face directory (through the one
    checkpoint loader), or a LoRA checkpoint of either model (base + adapters unmerged, or merged
    with `merge`, which any other checkpoint refuses). base_dtype "mxfp4": a released gpt-oss
    directory (or a LoRA checkpoint on one) with its experts kept MXFP4 (formats/mxfp4_experts.py)."""
    import torch

    from formats.checkpoint import load_checkpoint
    from formats.errors import UserError
    from formats.model_checks import build_model, load_weights

    meta = lora_meta(checkpoint)
    if meta is not None:
        return load_lora_for_inference(checkpoint, merge=merge, base_dtype=base_dtype)
    if merge:
        raise UserError(f"--merge: checkpoint {checkpoint} holds no LoRA adapters (nothing to merge)")
    if base_dtype == "mxfp4":
        from formats.mxfp4_experts import load_released_base

        return load_released_base(checkpoint, f"checkpoint {checkpoint}")
    state, model_cfg, meta = load_checkpoint(checkpoint, transformers_ok=True)
    model = build_model(model_cfg)
    load_weights(model, {k: v.to(torch.float32) for k, v in state.items()})
    return model.eval(), meta


def open_inference_model(checkpoint: str | os.PathLike, *, merge: bool = False, base_dtype: str = "compute"):
    """(model, meta, weights) of any checkpoint `load_inference_model` takes, for the loader
    (formats/mesh_loader.py) to place on the devices: the model with its weights on `meta` (a LoRA
    checkpoint's adapters and trained head read onto the host) and `weights` the source of the
    rest, so no process holds the model (`--base-dtype mxfp4`: the experts' stored bytes, by
    slice; `--merge`: the plain model, each block merged as it is read, formats/lora_merge.py).
    Where the weights are not read by slice (a transformers layout that needs a conversion), the
    host model of `load_inference_model` and weights None."""
    from formats import mesh_loader
    from formats.lora_checkpoint import load_lora_model
    from formats.model_checks import build_model
    from torch_model.lora import unwrap

    def whole():
        return (*load_inference_model(checkpoint, merge=merge, base_dtype=base_dtype), None)

    if lora_meta(checkpoint) is not None:
        wrapped, cfg, meta = load_lora_model(checkpoint, base=False, base_dtype=base_dtype)
        base, weights = open_lora_base(cfg, meta, base_dtype)
        if weights is None:
            return whole()
        if merge:               # the plain model, each block merged as it is read
            from formats.lora_merge import MergedWeights

            return base.eval(), meta, MergedWeights(weights, wrapped)
        return unwrap(wrapped).eval(), meta, weights
    if merge:                   # refused by name: no adapters to merge
        return whole()
    if base_dtype == "mxfp4":
        from formats.mxfp4_experts import open_released_base

        return open_released_base(checkpoint, f"checkpoint {checkpoint}")
    model_cfg, meta, weights = mesh_loader.open_weights(checkpoint)
    if weights is None:
        return whole()
    return build_model(model_cfg, meta=True).eval(), meta, weights


def open_lora_base(cfg, meta: dict, base_dtype: str = "compute"):
    """(the plain model on `meta`, the source its weights are read from, or None where the base's
    layout is not read by slice) of a LoRA checkpoint's base (`meta`: the checkpoint's), verified
    against its reference; base_dtype "mxfp4": its experts as released (a gpt-oss directory)."""
    from formats import mesh_loader
    from formats.lora_checkpoint import LORA_META, check_base
    from formats.model_checks import build_model

    where = f"LoRA checkpoint {meta['step_dir']}"
    path = check_base(meta[LORA_META]["base"], where)
    if base_dtype == "mxfp4":
        from formats.mxfp4_experts import open_released_base

        base, _, weights = open_released_base(path, f"{where} (its base)", cfg)
        return base, weights
    _, _, weights = mesh_loader.open_weights(path)
    return build_model(cfg, meta=True), weights


def inference_tokenizer(checkpoint, meta: dict):
    """(tiktoken Encoding or None, one line saying which) of a checkpoint loaded by
    `load_inference_model`: a LoRA checkpoint's falls back to its base's."""
    from formats.checkpoint import checkpoint_tokenizer
    from formats.lora_checkpoint import is_lora_meta

    return (lora_tokenizer if is_lora_meta(meta) else checkpoint_tokenizer)(checkpoint, meta)
