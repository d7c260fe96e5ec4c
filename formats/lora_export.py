"""LoRA adapters out to transformers + peft: peft's own adapter files (`adapter_config.json`,
`adapter_model.safetensors`) that `PeftModel.from_pretrained(transformers GptOss, dir)` loads, and
the merged model (W + scaling * B A, by peft's `merge_and_unload`) in any format of hf_export.
"""
from __future__ import annotations

import json
from pathlib import Path

from formats import hf_export
from formats.atomic import staged_dir
from formats.errors import UserError
from formats.model_checks import model_shapes
from torch_model.config import ModelConfig
from torch_model.lora import unwrap

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

ADAPTER_README = """# {name}

A torchlyra LoRA adapter ({spec}) in peft's own format, for its base model in transformers.

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained("{base}")
model = PeftModel.from_pretrained(base, "{name}")   # model.merge_and_unload() folds it in
```

Base: {base_note}
"""


def lora_settings(peft_model) -> dict:
    """The adapter's r, alpha, targets as peft records them (for READMEs and reports)."""
    config = peft_model.peft_config["default"]
    return {"r": config.r, "alpha": config.lora_alpha, "target_modules": sorted(config.target_modules or []),
            "target_parameters": sorted(config.target_parameters or [])}


def describe(settings: dict) -> str:
    """'r=16, alpha=32 on q_proj, ...': lora_settings in one line."""
    return (f"r={settings['r']}, alpha={settings['alpha']:g} on "
            + ", ".join(settings["target_modules"] + settings["target_parameters"]))


def export_adapter(peft_model, out_dir, *, base_model: str | None = None, overwrite: bool = False) -> dict:
    """Write peft's adapter files for a peft-wrapped model of ours into `out_dir`, atomically.

    peft's own `save_pretrained` writes the tensors and config (our module and parameter names
    are transformers' GptOss names, and Experts are `is_transposed` like transformers'; a
    transformers model trained here is transformers' own modules: so the files are already the
    ones peft makes on transformers' model). Fixed up for transformers:
    `auto_mapping` (it names our torch class, which a transformers user does not have) is
    dropped, `task_type` is CAUSAL_LM, and `base_model_name_or_path` is `base_model` (a hub id
    or a directory transformers loads: a released gpt-oss or our export of the base)."""
    settings = lora_settings(peft_model)
    with staged_dir(out_dir, replace="always" if overwrite else "never") as tmp:
        peft_model.save_pretrained(str(tmp), safe_serialization=True)
        missing = [f for f in ADAPTER_FILES if not (tmp / f).is_file()]
        if missing:
            raise UserError(f"{out_dir}: peft's save_pretrained wrote no {', '.join(missing)}")
        _in_module_names(peft_model, tmp / "adapter_model.safetensors")
        config_path = tmp / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config.pop("auto_mapping", None)
        # A module model's adapter loads on the module itself: plain PeftModel (no transformers task).
        task = None if hasattr(unwrap(peft_model), "own_module_path") else "CAUSAL_LM"
        config.update(task_type=task, base_model_name_or_path=base_model, inference_mode=True)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        base_note = (f"`{base_model}`." if base_model else
                     "not recorded: load the base this adapter was trained on (`torchlyra export` of its "
                     "base checkpoint, or the released gpt-oss directory).")
        (tmp / "README.md").write_text(ADAPTER_README.format(
            name=Path(out_dir).name, spec=describe(settings), base=base_model or "BASE_DIR", base_note=base_note))
    n_params = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)   # modules_to_save too
    return {"out": str(out_dir), "files": list(ADAPTER_FILES) + ["README.md"], "n_adapter_params": n_params,
            "base_model": base_model, **settings}


PEFT_PREFIX = "base_model.model."


def _in_module_names(peft_model, path: Path) -> None:
    """A module model's adapter tensors keyed by the module's own paths (`blocks.0.attention.wq`),
    as peft keys them on the user's module, instead of the boundary's (`model.layers.0...`)."""
    from safetensors.torch import load_file, save_file

    model = unwrap(peft_model)
    if not hasattr(model, "own_module_path"):
        return
    renamed = {}
    for key, tensor in load_file(str(path)).items():
        rest = key.removeprefix(PEFT_PREFIX)
        module, found, leaf = rest.rpartition(".lora_")      # peft: <module>.lora_A.weight, <module>.lora_B.weight
        renamed[f"{PEFT_PREFIX}{model.own_module_path(module)}.lora_{leaf}" if found else key] = tensor
    save_file(renamed, str(path), metadata={"format": "pt"})


def merged_params(peft_model):
    """(our per-layer name, float32 numpy array) of base + adapter merged by peft's
    `merge_and_unload`. It merges in place: the peft model is consumed (no second copy of the
    weights is made, which matters at 20B)."""
    merged = peft_model.merge_and_unload(progressbar=False)
    for name, t in merged.state_dict().items():
        yield name, t.detach().float().numpy()


def export_merged(peft_model, cfg, out_dir, *, step: int = 0, enc=None, dtype: str = "float32",
                  shard_size_bytes: int = hf_export.DEFAULT_SHARD_BYTES, overwrite: bool = False,
                  progress: bool = False, tensors=None) -> dict:
    """Base + adapter merged (consuming `peft_model`, see merged_params; or `tensors`, (name,
    float32 array) of the merged model in its order, e.g. read by formats/lora_merge.py), written
    as hf_export writes a checkpoint (float32, bfloat16 or the released MXFP4 layout; a
    transformers model as formats/transformers_export.py writes one)."""
    settings = lora_settings(peft_model)
    merged = merged_params(peft_model) if tensors is None else tensors
    note = (f"\nLoRA merged: {describe(settings)}"
            + (" (MXFP4 rounds away the part of the adapter's change below each block's grid step)"
               if dtype == "mxfp4" else "") + ".\n")
    if hasattr(cfg, "facts"):                     # a module model: its own names
        from formats.module_export import write_module_dir

        return write_module_dir(cfg, dict(merged), out_dir, step=step, enc=enc, dtype=dtype,
                                shard_size_bytes=shard_size_bytes, overwrite=overwrite)
    if not isinstance(cfg, ModelConfig):          # a transformers model: its family's own layout
        from formats.transformers_export import write_transformers_dir

        names = model_shapes(cfg)                 # a tied head once, as checkpoints hold it
        return write_transformers_dir(cfg, ((n, v) for n, v in merged if n in names), out_dir,
                                      n_tensors=len(names), step=step, enc=enc, dtype=dtype,
                                      shard_size_bytes=shard_size_bytes, overwrite=overwrite, progress=progress,
                                      note=note)
    return hf_export.write_hf_dir(cfg, merged, out_dir, step=step, enc=enc, dtype=dtype,
                                  shard_size_bytes=shard_size_bytes, overwrite=overwrite, progress=progress,
                                  note=note)
