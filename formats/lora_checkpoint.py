"""LoRA checkpoints: a LoRA run saves its trainable state (adapters + optimizer) and a reference to
its frozen base, never the base itself. The reference (`meta["lora"]["base"]`) names the base's
directory and a hash of it, checked whenever the base is loaded again (resume, `load_lora_model`).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from formats.checkpoint import LORA_META, is_lora_meta  # noqa: F401 (the checkpoint format's; this module's API too)
from formats.errors import UserError

# meta[LORA_META] = {"spec": LoraSpec string, "base": {"path", "kind", "sha256", "hashed"}}
CHECKPOINT_BASE, HF_BASE = "checkpoint", "huggingface"
HF_HASHED_FILES = ("config.json", "model.safetensors.index.json")


def base_reference(init_from: str | os.PathLike, init_meta: dict) -> dict:
    """The reference to the base a LoRA run starts from. Our checkpoint: its step directory and
    the sha256 of its integrity manifest (which holds every file's checksum, so it hashes the whole
    step). A Hugging Face directory: the sha256 of the names and sizes of its config, index and
    safetensors files (reading tens of GB to hash them would cost minutes; a changed size or file
    set is caught, an in-place edit of equal size is not)."""
    if init_meta.get("hf_dir"):
        path = Path(init_meta["hf_dir"]).resolve()
        return {"path": str(path), "kind": HF_BASE, "sha256": _hf_fingerprint(path),
                "hashed": "names and sizes of config.json, the safetensors index and *.safetensors"}
    from formats.checkpoint_integrity import MANIFEST_FILE

    step_dir = Path(init_meta["step_dir"]).resolve()
    return {"path": str(step_dir), "kind": CHECKPOINT_BASE,
            "sha256": hashlib.sha256((step_dir / MANIFEST_FILE).read_bytes()).hexdigest(),
            "hashed": MANIFEST_FILE}


def _hf_fingerprint(hf_dir: Path) -> str:
    files = sorted(p for p in hf_dir.iterdir()
                   if p.is_file() and (p.name in HF_HASHED_FILES or p.suffix == ".safetensors"))
    listing = "".join(f"{p.name}\t{p.stat().st_size}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def check_base(reference: dict, where: str) -> Path:
    """The base directory of a LoRA checkpoint, verified against its recorded hash."""
    from formats.checkpoint_integrity import MANIFEST_FILE

    path = Path(reference["path"])
    if not path.is_dir():
        raise UserError(f"{where}: its base model {path} is missing (a LoRA checkpoint holds only the adapters; "
                        f"restore the base there)")
    if reference["kind"] == HF_BASE:
        found = _hf_fingerprint(path)
    else:
        manifest = path / MANIFEST_FILE
        found = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else "no manifest"
    if found != reference["sha256"]:
        raise UserError(f"{where}: its base model {path} changed since the adapters were trained (sha256 of "
                        f"{reference['hashed']}: expected {reference['sha256'][:16]}..., found {found[:16]}...)")
    return path


def load_base_state(meta: dict) -> dict[str, torch.Tensor]:
    """The frozen base's float32 state_dict (per-layer names) of a LoRA checkpoint, verified."""
    from formats.checkpoint import load_checkpoint

    reference = meta[LORA_META]["base"]
    path = check_base(reference, f"LoRA checkpoint {meta.get('step_dir')}")
    state, _, _ = load_checkpoint(path, transformers_ok=True)     # ours or a `train --model-config` run's
    return state


def load_lora_model(checkpoint: str | os.PathLike, *, base: bool = True, base_dtype: str = "compute"):
    """(peft_model, model_cfg, meta) of a LoRA checkpoint (run, checkpoints or step directory):
    the base loaded from its reference (verified), wrapped by peft with the saved spec, the
    trained adapters loaded; float32, eval mode. meta as `load_checkpoint` gives it.
    base=False: the adapters alone (peft's trainable tensors, modules_to_save included), the base
    left on the `meta` device, never read (its experts as `Mxfp4Experts` with base_dtype "mxfp4"):
    enough to write peft's adapter files, or for the loader to place the base from its files.
    base_dtype "mxfp4": the base's experts kept as released (its reference must be a released
    gpt-oss directory: formats/mxfp4_experts.py)."""
    from torch_model.lora import apply_lora, parse_lora_spec, unwrap
    from formats.model_checks import build_model, load_weights
    from formats.checkpoint import (LAYOUTS, check_tensors, find_checkpoint, read_meta, restore_params_to_host,
                                  stored_shapes)

    step_dir = find_checkpoint(checkpoint)
    meta, cfg = read_meta(step_dir)
    if not is_lora_meta(meta):
        raise UserError(f"checkpoint {step_dir} holds no LoRA adapters (no '{LORA_META}' in its metadata)")
    spec = parse_lora_spec(meta[LORA_META]["spec"])
    if base:
        if base_dtype == "mxfp4":
            from formats.mxfp4_experts import load_released_base

            path = check_base(meta[LORA_META]["base"], f"LoRA checkpoint {step_dir}")
            model, _ = load_released_base(path, f"LoRA checkpoint {step_dir} (its base)", cfg)
        else:
            model = build_model(cfg)
            load_weights(model, load_base_state(meta))
        wrapped = apply_lora(model, spec)
    else:
        model = build_model(cfg, meta=True)
        if base_dtype == "mxfp4":           # the base's experts as released, to be placed by slice
            from torch_model.model import mxfp4_expert_modules

            with torch.device("meta"):
                mxfp4_expert_modules(model)
            model.requires_grad_(False)
        wrapped = apply_lora(model, spec)
    stored = {k: v for k, v in stored_shapes(step_dir).items() if k[0] == "params"}
    adapters = LAYOUTS[meta["layout"]](restore_params_to_host(step_dir, stored), cfg)
    inner = unwrap(wrapped)
    params = {n: p for n, p in inner.named_parameters() if p.requires_grad}
    check_tensors({n: tuple(np.shape(v)) for n, v in adapters.items()}, {n: tuple(p.shape) for n, p in params.items()},
                  f"checkpoint {step_dir} (adapters of {meta[LORA_META]['spec']})")
    with torch.no_grad():
        for name, value in adapters.items():
            tensor = torch.from_numpy(np.asarray(value, dtype=np.float32))
            if base:
                params[name].copy_(tensor)
            else:       # a meta tensor holds no data: the module gets a new parameter
                owner, _, attr = name.rpartition(".")
                setattr(inner.get_submodule(owner), attr, torch.nn.Parameter(tensor))
    wrapped.eval()
    return wrapped, cfg, {k: v for k, v in meta.items() if k != "model"}
