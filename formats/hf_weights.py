"""The tensors of a transformers GptOss directory, read lazily and by slice: unquantized
safetensors (one file or shards with an index) or gpt-oss's released layout, whose expert
weights are MXFP4 `*_blocks` + `*_scales`. Every tensor is addressed by its dequantized
transformers name and [E, in, out] layout; reading a slice touches only the bytes that cover it
(`safe_open(...).get_slice`), each file opened per read so no mapped pages stay resident.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open

from formats import mxfp4
from formats.errors import UserError

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
BLOCKS, SCALES = "_blocks", "_scales"
SOURCE_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
QUANT_METHODS = ("mxfp4",)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One logical tensor: where it is stored and how."""
    name: str
    shape: tuple[int, ...]          # logical (dequantized, [E, in, out] for experts)
    dtype: str                      # safetensors dtype of the stored values ("MXFP4" when packed)
    file: str
    scales_file: str | None = None  # MXFP4 only

    @property
    def quantized(self) -> bool:
        return self.dtype == "MXFP4"

    @property
    def nbytes(self) -> int:
        per = {"F32": 4, "BF16": 2, "F16": 2, "MXFP4": 0.5 + 1 / mxfp4.BLOCK}[self.dtype]
        return int(math.prod(self.shape) * per)


def weight_files(hf_dir: Path) -> dict[str, list[str]]:
    """safetensors file -> tensor names it should hold (from the index when sharded)."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                files.setdefault(file, []).append(name)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{index}: expected {{'weight_map': {{tensor: file}}}} ({type(e).__name__}: {e})") from None
        for file in files:
            if not (hf_dir / file).is_file():
                raise UserError(f"{index}: names shard {file} (for tensor {files[file][0]}), which is missing")
        return files
    if (hf_dir / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}
    other = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
    hint = f" (found {', '.join(other)}: only safetensors weights are supported)" if other else ""
    raise UserError(f"{hf_dir}: expected {SINGLE_FILE} or {INDEX_FILE}, found neither{hint}")


def check_quantization(hf_config: dict, where: str) -> str | None:
    """The checkpoint's quant_method (None when unquantized); any method but MXFP4 is refused."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in QUANT_METHODS:
        raise UserError(f"{where}: field 'quantization_config.quant_method' expected 'mxfp4' (gpt-oss's release), "
                        f"found {method!r}")
    return method


class HFWeights:
    """Name -> Entry for every tensor of `hf_dir`, validated from the shard headers alone."""

    def __init__(self, hf_dir: str | Path, *, quantized: bool):
        self.dir = Path(hf_dir)
        self.bytes_requested = 0            # bytes asked of get_slice (for the streaming checks)
        headers: dict[str, tuple[str, tuple[int, ...], str]] = {}   # stored name -> (file, shape, dtype)
        for file, listed in weight_files(self.dir).items():
            path = self.dir / file
            try:
                with safe_open(str(path), "pt") as f:
                    for name in f.keys():
                        part = f.get_slice(name)
                        headers[name] = (file, tuple(part.get_shape()), part.get_dtype())
            except Exception as e:   # safetensors' own errors for truncated or garbled files
                raise UserError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from None
            absent = [n for n in listed if headers.get(n, (None,))[0] != file]
            if absent:
                raise UserError(f"{path}: tensor {absent[0]} (listed in {INDEX_FILE}) is not in this shard")
        self.entries = self._entries(headers, quantized)

    def _entries(self, headers: dict, quantized: bool) -> dict[str, Entry]:
        entries = {}
        for name, (file, shape, dtype) in headers.items():
            if name.endswith(SCALES):
                if name.removesuffix(SCALES) + BLOCKS not in headers:
                    raise UserError(f"{self.dir / file}: tensor {name} has no {name.removesuffix(SCALES) + BLOCKS}")
                continue
            if name.endswith(BLOCKS):
                base = name.removesuffix(BLOCKS)
                where = f"{self.dir / file}: tensor {name}"
                if not quantized:
                    raise UserError(f"{where} is MXFP4-quantized but config.json has no quantization_config "
                                    f"(expected quant_method 'mxfp4')")
                if base + SCALES not in headers:
                    raise UserError(f"{where}: its scales {base + SCALES} are missing")
                scales_file, scales_shape, scales_dtype = headers[base + SCALES]
                mxfp4.check_packed(shape, scales_shape, f"{where} (scales {base + SCALES})")
                if dtype != "U8" or scales_dtype != "U8":
                    raise UserError(f"{where}: MXFP4 blocks and scales must be U8, found {dtype} and {scales_dtype}")
                if len(shape) != 4:
                    raise UserError(f"{where}: expected MXFP4 expert blocks [E, rows, G, 16], found {list(shape)}")
                experts, rows, groups, _ = shape
                entries[base] = Entry(base, (experts, groups * mxfp4.BLOCK, rows), "MXFP4", file, scales_file)
                continue
            if dtype not in SOURCE_DTYPES:
                raise UserError(f"{self.dir / file}: tensor {name} has dtype {dtype}, expected F32, BF16 or F16")
            entries[name] = Entry(name, shape, dtype, file)
        return entries

    # ---- reading ----------------------------------------------------------------------------
    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The values of `name` (or of the slice `index`, a tuple of slices over its logical
        shape) as numpy in the stored dtype; MXFP4 dequantizes to float32 (exact; every value
        also fits bfloat16)."""
        entry = self.entries[name]
        index = normalize_index(index, entry.shape)
        if entry.quantized:
            return self._read_mxfp4(entry, index)
        with safe_open(str(self.dir / entry.file), "pt") as f:
            part = f.get_slice(name)[index]
        self.bytes_requested += part.numel() * part.element_size()
        return torch_to_numpy(part)

    def read_packed(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """An MXFP4 tensor's stored bytes, not decoded: (blocks [E, rows, in/2] uint8 (the
        released [E, rows, in/32, 16] viewed with its last two axes merged), scale bytes
        [E, rows, in/32] uint8), rows being the output dimension."""
        entry = self.entries[name]
        if not entry.quantized:
            raise UserError(f"{self.dir / entry.file}: tensor {name} is {entry.dtype}, not MXFP4 (*{BLOCKS} + *{SCALES})")
        with safe_open(str(self.dir / entry.file), "pt") as f:
            blocks = f.get_tensor(entry.name + BLOCKS)
        with safe_open(str(self.dir / entry.scales_file), "pt") as f:
            scales = f.get_tensor(entry.name + SCALES)
        self.bytes_requested += blocks.numel() + scales.numel()
        return blocks.reshape(*blocks.shape[:-2], -1).numpy(), scales.numpy()

    def read_stored_bytes(self, name: str, index: tuple | None = None) -> np.ndarray:
        """A slice of an MXFP4 tensor's stored bytes, not decoded: `<tensor>_blocks` viewed as
        [E, rows, in/2] (as `read_packed` gives it) or `<tensor>_scales` [E, rows, in/32]. A
        blocks slice along in/2 covers whole blocks (16 bytes each)."""
        blocks = name.endswith(BLOCKS)
        entry = self.entries[name.removesuffix(BLOCKS if blocks else SCALES)]
        experts, inputs, outputs = entry.shape
        per = mxfp4.BLOCK // 2 if blocks else 1
        index = normalize_index(index, (experts, outputs, inputs // (2 if blocks else mxfp4.BLOCK)))
        e, rows, cols = index
        if cols.start % per or cols.stop % per:
            raise ValueError(f"{name}: a slice of the stored bytes must cover whole blocks of {per}, found {cols}")
        with safe_open(str(self.dir / (entry.file if blocks else entry.scales_file)), "pt") as f:
            part = f.get_slice(name)[(e, rows, slice(cols.start // per, cols.stop // per))
                                     + ((slice(None),) if blocks else ())]
        self.bytes_requested += part.numel()
        return part.reshape(*part.shape[:2], -1).numpy()

    def map_whole(self, name: str) -> np.ndarray:
        """An unquantized tensor as a memory map of its bytes in the shard: file-backed
        pages the kernel may drop at will, no anonymous copy. (The safetensors layout: an 8-byte
        little-endian header length, the JSON header, then the data at the header's offsets.)"""
        entry = self.entries[name]
        path = self.dir / entry.file
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        start, end = header[name]["data_offsets"]
        self.bytes_requested += end - start
        # Copy-on-write ("c"): never written, but writable, as torch.from_numpy wants.
        return np.memmap(path, dtype=SOURCE_DTYPES[entry.dtype], mode="c", offset=8 + header_len + start,
                         shape=entry.shape)

    def _read_mxfp4(self, entry: Entry, index: tuple[slice, ...]) -> np.ndarray:
        experts, inputs, outputs = index
        # A slice of the input dim may start or end inside a block: read the covering blocks, crop.
        first, last = inputs.start // mxfp4.BLOCK, -(-inputs.stop // mxfp4.BLOCK)
        stored = (experts, outputs, slice(first, last))
        with safe_open(str(self.dir / entry.file), "pt") as f:
            blocks = f.get_slice(entry.name + BLOCKS)[stored + (slice(None),)]
        with safe_open(str(self.dir / entry.scales_file), "pt") as f:
            scales = f.get_slice(entry.name + SCALES)[stored]
        self.bytes_requested += blocks.numel() + scales.numel()
        values = mxfp4.dequantize(blocks.numpy(), scales.numpy(), f"{self.dir / entry.file}: tensor {entry.name}{BLOCKS}")
        offset = first * mxfp4.BLOCK
        values = values[..., inputs.start - offset:inputs.stop - offset]
        return np.ascontiguousarray(values.transpose(0, 2, 1))      # [E, rows=out, in] -> [E, in, out]


def normalize_index(index, shape) -> tuple[slice, ...]:
    """A tuple of unit-step slices with explicit bounds, one per dimension."""
    index = tuple(index or ())
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, size in zip(index, shape):
        if not isinstance(s, slice):
            raise TypeError(f"expected slices, found {s!r}")
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"expected unit-step slices, found {s!r}")
        out.append(slice(start, stop))
    return tuple(out)


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy without widening (bfloat16 as ml_dtypes.bfloat16)."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    """The inverse of torch_to_numpy (shares memory)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
