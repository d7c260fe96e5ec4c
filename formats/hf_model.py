"""A transformers GptOss directory (gpt-oss as released, MXFP4 experts, or unquantized) opened as
a model: its config and tensor headers checked against each other (`open_hf`), and, for the
commands that hold the whole model on the host (generate, eval, parity), its per-layer float32
state_dict read tensor by tensor through formats/hf_weights.py (MXFP4 dequantized on the host).
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from formats import hf_mapping
from formats.hf_weights import HFWeights, check_quantization, numpy_to_torch
from torch_model.config import ModelConfig
from formats.errors import UserError
from formats.jsonfile import read_json
from formats.model_checks import check_tensors


def is_hf_dir(path) -> bool:
    """A directory holding a transformers config.json (not a torchlyra checkpoint)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    found = read_json(config)
    return isinstance(found, dict) and "model_type" in found


def read_hf_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir}: Hugging Face model directory not found")
    if not path.is_file():
        raise UserError(f"{path}: expected a transformers config.json, found no file")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(hf).__name__}")
    return hf


def open_hf(hf_dir, *, dense: bool = False) -> tuple[ModelConfig, HFWeights]:
    """(ModelConfig, HFWeights) of a GptOss directory, config and shard headers validated against
    each other (names and dequantized shapes); no tensor data read yet."""
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    where = str(hf_dir / "config.json")
    cfg = hf_mapping.model_config_from_hf(hf, dense=dense, where=where)
    weights = HFWeights(hf_dir, quantized=check_quantization(hf, where) is not None)
    check_tensors({k: e.shape for k, e in weights.entries.items()}, hf_mapping.hf_shapes(cfg), str(hf_dir))
    return cfg, weights


def stored_dtypes(weights: HFWeights) -> list[str]:
    """The source precisions of a directory's tensors, e.g. ['bfloat16', 'mxfp4']."""
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    return sorted({"mxfp4" if e.quantized else names[e.dtype] for e in weights.entries.values()})


def hf_meta(hf_dir, weights=None, **extra) -> dict:
    """What the checkpoint loader gives as a Hugging Face directory's meta: step 0, "step_dir" and
    "hf_dir" (where it was read from), "imported_from" (with the stored precisions of `weights`,
    HFWeights or a view of them; none when not opened)."""
    hf_dir = str(Path(hf_dir).resolve())
    return {"step": 0, "step_dir": hf_dir, "hf_dir": hf_dir,
            "imported_from": {"dir": hf_dir, "dtypes": stored_dtypes(weights) if weights is not None else []}, **extra}


def load_hf(hf_dir) -> tuple[dict[str, torch.Tensor], ModelConfig, dict]:
    """(per-layer float32 state_dict, ModelConfig, meta) of a GptOss directory, as the checkpoint
    loader returns for ours: read one tensor at a time (host memory: the model plus one tensor).
    meta: step 0, "step_dir" and "hf_dir" (where it was read from), "imported_from"."""
    hf_dir = Path(hf_dir).resolve()
    cfg, weights = open_hf(hf_dir)
    state: dict[str, torch.Tensor] = {}
    total = sum(e.nbytes for e in weights.entries.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"load {hf_dir.name}", disable=None) as bar:
        for name, entry in weights.entries.items():
            value = numpy_to_torch(weights.read(name)).to(torch.float32)
            # hf_mapping works on torch tensors; a one-tensor dict maps like the whole state.
            state.update(hf_mapping.from_hf_state({name: value}, cfg, where=str(hf_dir)))
            bar.update(entry.nbytes)
    return state, cfg, hf_meta(hf_dir, weights)
