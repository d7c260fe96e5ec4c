"""`torchlyra import`: a transformers GptOss directory -> a torchlyra checkpoint to train further
(another family's directory: `import_transformers`, through formats/transformers_import.py).

Reads config.json and the safetensors weights (unquantized, or gpt-oss's released MXFP4 layout)
tensor by tensor through formats/hf_weights.py, maps them through formats/hf_mapping.py and streams
them into a parameters-only checkpoint in the source precision (float32, or bfloat16 for bf16
and MXFP4 sources), so host memory holds one tensor. The tokenizer comes along when recognised.
"""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from formats import hf_mapping
from formats.hf_model import open_hf, stored_dtypes
from formats.hf_tokenizer import recognize
from formats.hf_weights import SOURCE_DTYPES, HFWeights, numpy_to_torch, torch_to_numpy
from formats import checkpoint
from formats.errors import UserError

STORED = {"F32": np.float32, "F16": np.float32, "BF16": ml_dtypes.bfloat16, "MXFP4": ml_dtypes.bfloat16}
EXPERT_CHUNK_BYTES = 64 * 2**20     # dequantize MXFP4 experts this many float32 bytes at a time


def read_stored(weights: HFWeights, name: str, scratch: Path | None = None) -> np.ndarray:
    """One whole tensor in the dtype a parameters-only checkpoint keeps (float32 sources stay
    float32, float16 widens exactly to float32, bfloat16 and MXFP4 become bfloat16: every MXFP4
    value is exact in bfloat16). MXFP4 experts are dequantized a few experts at a time. With a
    `scratch` file the result lives in that file's pages and float32/bfloat16 sources are mapped
    from their shard, so the caller's anonymous memory holds no whole tensor."""
    entry = weights.entries[name]
    dtype = STORED[entry.dtype]
    if not entry.quantized:
        if scratch is not None and np.dtype(SOURCE_DTYPES[entry.dtype]) == np.dtype(dtype):
            return weights.map_whole(name)
        return weights.read(name).astype(dtype, copy=False)
    out = np.empty(entry.shape, dtype) if scratch is None else np.memmap(scratch, dtype, mode="w+", shape=entry.shape)
    per_expert = 4 * math.prod(entry.shape[1:])
    step = max(1, EXPERT_CHUNK_BYTES // per_expert)
    for e in range(0, entry.shape[0], step):
        out[e:e + step] = weights.read(name, (slice(e, e + step),))
    return out


def import_hf(hf_dir, out_dir, *, dense: bool = False, overwrite: bool = False, progress: bool = False) -> dict:
    """Write `out_dir` as a torchlyra parameters-only checkpoint (step 0) of the GptOss model in
    `hf_dir`, streamed: one tensor in host memory at a time."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    cfg, weights = open_hf(hf_dir, dense=dense)
    # Fail before reading gigabytes if the output cannot be written.
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")
    enc, tokenizer = recognize(hf_dir)
    dtypes = stored_dtypes(weights)
    extra = {"imported_from": {"dir": str(hf_dir.resolve()), "dtypes": dtypes}}
    total = sum(e.nbytes for e in weights.entries.values())
    start = time.perf_counter()
    with checkpoint.params_writer(out, cfg, step=0, extra=extra, tokenizer=enc, overwrite=overwrite) as add, \
            tempfile.TemporaryDirectory(prefix=f".{out.name}.tmp-scratch-", dir=out.absolute().parent) as scratch, \
            tqdm(total=total, unit="B", unit_scale=True, desc="import", disable=not progress) as bar:
        for i, (name, entry) in enumerate(weights.entries.items()):
            # Orbax's writer keeps an anonymous buffer the size of the tensor it writes; ours stays
            # file-backed (mapped from the shard, or dequantized into a scratch file) beside it.
            scratch_file = Path(scratch) / f"{i}.bin"
            value = read_stored(weights, name, scratch_file)
            # hf_mapping works on torch tensors; a one-tensor dict maps like the whole state.
            for ours, t in hf_mapping.from_hf_state({name: numpy_to_torch(value)}, cfg, where=str(hf_dir)).items():
                add(ours, torch_to_numpy(t))
            scratch_file.unlink(missing_ok=True)
            bar.update(entry.nbytes)
    seconds = time.perf_counter() - start
    return {"out": str(out), "config": cfg, "dtypes": dtypes, "n_tensors": len(weights.entries),
            "tokenizer": tokenizer, "input_bytes": total, "seconds": seconds}


def import_transformers(hf_dir, out_dir, *, overwrite: bool = False, progress: bool = False) -> dict:
    """Write `out_dir` as a parameters-only checkpoint (step 0) of another family's directory, its
    tokenizer.json converted when it can be. A directory that reads slice by slice
    (formats/transformers_import.py: `open_streamed`) is copied one tensor at a time in its
    stored precision (float16 widened to float32), so host memory holds one tensor; any other is
    loaded whole by transformers' `from_pretrained`, in float32."""
    from formats.transformers_import import load_transformers_dir, open_streamed

    hf_dir, out = Path(hf_dir), Path(out_dir)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")
    start = time.perf_counter()
    opened = open_streamed(hf_dir)
    if opened is None:
        state, spec, meta = load_transformers_dir(hf_dir)
        imported_from, tensors = meta["imported_from"], ((name, value.numpy()) for name, value in state.items())
        names = list(state)
    else:
        spec, weights = opened
        imported_from = {"dir": str(hf_dir.resolve()), "dtypes": stored_dtypes(weights)}
        names = list(weights.entries)
        tensors = ((name, _stored(weights.read(name))) for name in names)
    enc, tokenizer = recognize(hf_dir)
    total = 0
    with checkpoint.params_writer(out, spec, step=0, extra={"imported_from": imported_from}, tokenizer=enc,
                                  overwrite=overwrite) as add:
        for name, value in tqdm(tensors, total=len(names), desc="import", disable=not progress):
            add(name, value)
            total += value.nbytes
    return {"out": str(out), "config": spec, "dtypes": imported_from["dtypes"], "n_tensors": len(names),
            "tokenizer": tokenizer, "input_bytes": total, "seconds": time.perf_counter() - start,
            "streamed": opened is not None}


def _stored(array: np.ndarray) -> np.ndarray:
    """A tensor as a checkpoint keeps it: float32 and bfloat16 as stored, float16 widened."""
    return array if str(array.dtype) in checkpoint.STORED_DTYPES else array.astype(np.float32)


def add_arguments(parser) -> None:
    parser.add_argument("--hf", required=True, help="Hugging Face directory: gpt-oss (safetensors: float32/bfloat16, "
                        "or its MXFP4 release), or another transformers family (bf16/fp32 safetensors)")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--dense", action="store_true",
                        help="read a one-expert model with an all-zero router as the dense MLP preset")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")


def run(args) -> int:
    from formats.transformers_import import is_transformers_dir

    if is_transformers_dir(args.hf):
        if args.dense:
            raise UserError(f"--dense reads a gpt-oss directory as our dense preset; {args.hf} is another family")
        summary = import_transformers(args.hf, args.out, overwrite=args.overwrite, progress=True)
    else:
        summary = import_hf(args.hf, args.out, dense=args.dense, overwrite=args.overwrite, progress=True)
    cfg = summary["config"]
    kind = f"{cfg.n_experts} experts top-{cfg.experts_per_token}" if cfg.is_moe else "dense MLP"
    rate = summary["input_bytes"] / 1e9 / max(summary["seconds"], 1e-9)
    print(f"imported {summary['n_tensors']} tensors ({', '.join(summary['dtypes'])}; {cfg.n_layers} layers, "
          f"d_model {cfg.d_model}, {kind}) into {summary['out']}: {summary['input_bytes'] / 1e9:.2f} GB of input in "
          f"{summary['seconds']:.1f} s ({rate:.2f} GB/s)"
          + {True: "; read one tensor at a time", False: "; loaded whole (float32)"}.get(summary.get("streamed"), ""))
    print(f"tokenizer: {summary['tokenizer']}")
    return 0
