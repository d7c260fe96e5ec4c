"""`torchlyra import`: a transformers GptOss directory -> a torchlyra checkpoint to train further.

Reads config.json and unquantized safetensors weights (one file or shards with an index), maps
them through parity/hf_mapping.py, and writes our checkpoint format (float32; bfloat16 and
float16 widen exactly, so exporting back in the source dtype reproduces every bit).
A tokenizer exported by torchlyra (tiktoken/ beside the weights) comes along.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from parity import hf_mapping
from train import checkpoint
from train.errors import UserError
from train.jsonfile import read_json

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def weight_files(hf_dir: Path) -> dict[str, list[str]]:
    """safetensors file -> tensor names it should hold (from the index when sharded)."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index}: expected {{'weight_map': {{tensor: file}}}} ({type(e).__name__}: {e})") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (hf_dir / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}
    other = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
    hint = f" (found {', '.join(other)}: only safetensors weights are supported)" if other else ""
    raise UserError(f"{hf_dir}: expected {SINGLE_FILE} or {INDEX_FILE}, found neither{hint}")


def read_hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file, names in weight_files(hf_dir).items():
        path = hf_dir / file
        if not path.is_file():
            raise UserError(f"{hf_dir / INDEX_FILE}: names shard {file}, which is missing")
        try:
            with safe_open(str(path), "pt") as f:
                keys = list(f.keys())
                for name in names:
                    if name not in keys:
                        raise UserError(f"{path}: tensor {name} (listed in {INDEX_FILE}) is not in this shard")
                tensors.update((k, f.get_tensor(k)) for k in keys)
        except UserError:
            raise
        except Exception as e:   # safetensors' own error types for garbled files
            raise UserError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    quantized = [k for k in tensors if k.endswith(("_blocks", "_scales"))]
    if quantized:
        raise UserError(f"{hf_dir}: tensor {quantized[0]} is MXFP4-quantized; only unquantized float32/bfloat16 "
                        f"GptOss weights can be imported (dequantize first)")
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise UserError(f"{hf_dir}: tensor {name} has dtype {t.dtype}, expected float32, bfloat16 or float16")
    return tensors


def import_hf(hf_dir, out_dir, *, dense: bool = False, overwrite: bool = False) -> dict:
    """Write `out_dir` as a torchlyra checkpoint (step 0) of the GptOss model in `hf_dir`."""
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    cfg = hf_mapping.model_config_from_hf(hf, dense=dense, where=str(hf_dir / "config.json"))
    out = Path(out_dir)
    # Fail before reading gigabytes if the output cannot be written.
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")
    hf_state = read_hf_tensors(hf_dir)
    checkpoint.check_tensors({k: tuple(v.shape) for k, v in hf_state.items()}, hf_mapping.hf_shapes(cfg), str(hf_dir))
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in hf_state.values()})
    state = hf_mapping.from_hf_state(hf_state, cfg, where=str(hf_dir))
    extra = {"imported_from": {"dir": str(hf_dir.resolve()), "dtypes": dtypes}}
    enc = _our_tokenizer(hf_dir)
    checkpoint.save_checkpoint(out, state, cfg, step=0, extra=extra, tokenizer=enc, overwrite=overwrite)
    return {"out": str(out), "config": cfg, "dtypes": dtypes, "n_tensors": len(state),
            "tokenizer": "tiktoken (from the export's tiktoken/)" if enc else "none"}


def _our_tokenizer(hf_dir: Path):
    """The tiktoken BPE a torchlyra export carries in tiktoken/, else None (other tokenizers,
    e.g. gpt-oss's o200k_harmony tokenizer.json, have no tiktoken form here)."""
    if not (hf_dir / "tiktoken" / "tokenizer.tiktoken").is_file():
        return None
    from train.data.tokenizer import load_tokenizer
    return load_tokenizer(hf_dir / "tiktoken")


def add_arguments(parser) -> None:
    parser.add_argument("--hf", required=True, help="Hugging Face GptOss directory (unquantized safetensors)")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--dense", action="store_true",
                        help="read a one-expert model with an all-zero router as the dense MLP preset")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")


def run(args) -> int:
    summary = import_hf(args.hf, args.out, dense=args.dense, overwrite=args.overwrite)
    cfg = summary["config"]
    kind = f"{cfg.n_experts} experts top-{cfg.experts_per_token}" if cfg.is_moe else "dense MLP"
    print(f"imported {summary['n_tensors']} tensors ({', '.join(summary['dtypes'])} -> float32; {cfg.n_layers} layers, "
          f"d_model {cfg.d_model}, {kind}) into {summary['out']}; tokenizer: {summary['tokenizer']}")
    return 0
