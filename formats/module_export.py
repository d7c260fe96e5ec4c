"""`torchlyra export` of a module run (`train --module`): the module's own weights, in its own names.

`model.safetensors` holds the module's `state_dict()` (persistent buffers included) as
`safetensors.torch.save_model` writes it (a tied weight under one of its names), so

    module = NAME(**args)                                  # as torchlyra_module.json records them
    safetensors.torch.load_model(module, "OUT/model.safetensors")     # strict

restores the run's module. `torchlyra_module.json` records the SPEC, its arguments and the hash of
its source; the tokenizer's tiktoken files go under tiktoken/. A module that is a transformers
model (`PreTrainedModel`) is written by its own `save_pretrained` instead: transformers' layout,
which `from_pretrained` loads. The module is built on the host with the checkpoint's weights (host
memory holds it once); the directory is written aside and renamed at the end, as every export.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from formats import checkpoint
from formats.atomic import staged_dir
from formats.errors import UserError
from formats.hf_export import DTYPES, checkpoint_encoding, check_export_options

RECORD = "torchlyra_module.json"
README = """# {name}

A torchlyra checkpoint (step {step}) of the module `{spec}`, trained with `torchlyra train --module`,
exported in the module's own names ({dtype}, {n_params:,} parameters).

```python
import json, safetensors.torch
record = json.load(open("{name}/{record}"))
module = NAME(**record["args"])          # NAME: the class or function of record["spec"]
safetensors.torch.load_model(module, "{name}/model.safetensors")
```
"""


def holds_module_model(checkpoint_dir) -> bool:
    """Whether the checkpoint named by `checkpoint_dir` is of a `train --module` run."""
    _, record = checkpoint.read_meta(checkpoint.find_checkpoint(checkpoint_dir))
    return hasattr(record, "facts")


def export_checkpoint(checkpoint_dir, out_dir, *, dtype: str = "float32", shard_size_bytes: int,
                      overwrite: bool = False, progress: bool = False) -> dict:
    """Write `out_dir` (see the module docstring) from the newest checkpoint of a module run."""
    state, record, meta = checkpoint.load_checkpoint(checkpoint_dir, transformers_ok=True)
    return write_module_dir(record, state, out_dir, step=meta.get("step", 0),
                            enc=checkpoint_encoding(checkpoint_dir, meta), dtype=dtype,
                            shard_size_bytes=shard_size_bytes, overwrite=overwrite)


def write_module_dir(record, state: dict, out_dir, *, step: int = 0, enc=None, dtype: str = "float32",
                     shard_size_bytes: int, overwrite: bool = False) -> dict:
    """Write `out_dir` for the module `record` builds, holding `state` (the boundary's parameter
    names, any of a tied tensor's: a LoRA run's merged weights too)."""
    from safetensors.torch import save_model

    from formats.model_checks import build_model, load_weights

    check_export_options(dtype, shard_size_bytes)
    if dtype == "mxfp4":
        raise UserError("--dtype mxfp4: the MXFP4 layout is gpt-oss's release format; a module exports as "
                        "float32 or bfloat16")
    model = build_model(record)
    names = {n for n, _ in model.named_parameters()}
    load_weights(model, {n: torch.as_tensor(v) for n, v in state.items() if n in names})
    module = model.module.to(DTYPES[dtype])
    n_params = sum(p.numel() for p in module.parameters())
    with staged_dir(out_dir, replace="always" if overwrite else "never") as tmp:
        if _is_transformers_model(module):
            module.save_pretrained(tmp, max_shard_size=shard_size_bytes)
            files = sorted(p.name for p in Path(tmp).glob("*.safetensors*"))
        else:
            save_model(module, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            files = ["model.safetensors"]
        (Path(tmp) / RECORD).write_text(json.dumps({"spec": record.spec, "args": record.args,
                                                    "source": record.source, "step": step}, indent=2))
        tokenizer = "none: the checkpoint's metadata names no tokenizer"
        if enc is not None:
            from formats.tokenizer import save_tokenizer

            save_tokenizer(enc, Path(tmp) / "tiktoken")
            tokenizer = f"{enc.name} ({enc.n_vocab} ids) in tiktoken/"
        (Path(tmp) / "README.md").write_text(README.format(name=Path(out_dir).name, step=step, spec=record.spec,
                                                           dtype=dtype, n_params=n_params, record=RECORD))
    return {"out": str(out_dir), "step": step, "dtype": dtype, "files": files, "n_tensors": len(module.state_dict()),
            "n_params": n_params, "tokenizer": tokenizer, "quantization_error": {}}


def _is_transformers_model(module: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)
