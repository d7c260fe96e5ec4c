"""Tokenized documents on disk: ArrayRecord shards (one record per document, token ids as
little-endian uint16 or int32 bytes, without BOS) described by a manifest.json.

Every file is written atomically (temporary name, fsync, os.replace) and the manifest last, so a
directory with a manifest never points at partial shards. `open_dataset` checks the manifest and
gives random access to the documents of one split.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np
from array_record.python import array_record_module as arm

from train.atomic import fsync_path
from train.errors import UserError
from train.jsonfile import read_json

FORMAT = "torchlyra-token-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# One record per chunk: reading a document decodes only that document (random access).
WRITER_OPTIONS = "group_size:1"
DTYPES = {"uint16": "<u2", "int32": "<i4"}


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _publish(tmp: Path, final: Path) -> None:
    """fsync a finished temporary file, then rename it over its final name."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    _publish(tmp, path)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.array_record"


def write_shard(path: Path, docs: list[np.ndarray], dtype: str) -> dict:
    """Write one shard atomically; return its manifest entry."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = arm.ArrayRecordWriter(str(tmp), WRITER_OPTIONS)
    for ids in docs:
        writer.write(np.asarray(ids).astype(DTYPES[dtype], copy=False).tobytes())
    writer.close()
    _publish(tmp, path)
    return {"file": path.name, "docs": len(docs), "tokens": int(sum(len(d) for d in docs)),
            "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_split(out_dir: Path, split: str, docs: Iterable[np.ndarray], dtype: str,
                docs_per_shard: int) -> dict:
    """Write a split's documents as shards of docs_per_shard documents (the last may hold fewer)."""
    shards, batch = [], []
    for ids in docs:
        batch.append(ids)
        if len(batch) == docs_per_shard:
            shards.append(write_shard(out_dir / shard_name(split, len(shards)), batch, dtype))
            batch = []
    if batch:
        shards.append(write_shard(out_dir / shard_name(split, len(shards)), batch, dtype))
    return {"docs": sum(s["docs"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
            "shards": shards}


def write_manifest(out_dir: Path, manifest: dict) -> None:
    write_atomic(Path(out_dir) / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(data_dir: str | os.PathLike) -> dict:
    """Load and check the top level of data_dir/manifest.json."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"data directory {data_dir}: no such directory (run `torchlyra prepare`)")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise UserError(f"{data_dir}: expected {MANIFEST}, found none: not a prepared dataset "
                        f"(run `torchlyra prepare --out {data_dir}`)")
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UserError(f"{path}: field 'format' expected {FORMAT!r}, found {found!r}: "
                        "not a torchlyra dataset manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: field 'format_version' expected {FORMAT_VERSION}, found "
                        f"{manifest.get('format_version')!r} (re-run `torchlyra prepare --force`)")
    for field in ("vocab_size", "bos_id", "dtype", "splits"):
        if field not in manifest:
            raise UserError(f"{path}: field {field!r} missing")
    if manifest["dtype"] not in DTYPES:
        raise UserError(f"{path}: field 'dtype' expected one of {sorted(DTYPES)}, found {manifest['dtype']!r}")
    return manifest


def check_shards(data_dir: Path, manifest: dict, split: str, verify_hash: bool = False) -> None:
    """Every shard of the split exists with its recorded size (and, if asked, sha256)."""
    for shard in manifest["splits"][split]["shards"]:
        path = Path(data_dir) / shard["file"]
        if not path.is_file():
            raise UserError(f"{path}: shard listed in {MANIFEST} (split {split!r}) is missing")
        size = path.stat().st_size
        if size != shard["bytes"]:
            raise UserError(f"{path}: size expected {shard['bytes']} bytes (from {MANIFEST}), found {size}")
        if verify_hash and (found := sha256_file(path)) != shard["sha256"]:
            raise UserError(f"{path}: sha256 expected {shard['sha256']} (from {MANIFEST}), found {found}")


class Dataset:
    """Random access to the documents of one split. Document i is a 1-D int32 array (no BOS)."""

    def __init__(self, data_dir: Path, split: str, manifest: dict):
        self.data_dir, self.split, self.manifest = Path(data_dir), split, manifest
        entry = manifest["splits"][split]
        self.shards = entry["shards"]
        self.num_docs, self.num_tokens = int(entry["docs"]), int(entry["tokens"])
        self.vocab_size, self.bos_id = int(manifest["vocab_size"]), int(manifest["bos_id"])
        self.np_dtype = np.dtype(DTYPES[manifest["dtype"]])
        self._starts = np.cumsum([0] + [s["docs"] for s in self.shards])
        self._readers: dict[int, object] = {}

    def __len__(self) -> int:
        return self.num_docs

    def _reader(self, shard: int):
        if shard not in self._readers:
            path = self.data_dir / self.shards[shard]["file"]
            self._readers[shard] = arm.ArrayRecordReader(str(path), "readahead_buffer_size:0")
        return self._readers[shard]

    def doc(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range [0, {self.num_docs})")
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        raw = self._reader(shard).read([int(i - self._starts[shard])])[0]
        return np.frombuffer(raw, dtype=self.np_dtype).astype(np.int32)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_dataset(data_dir: str | os.PathLike, split: str, *, vocab_size: int | None = None,
                 verify_hash: bool = False) -> Dataset:
    """Open one split of a prepared dataset after checking its manifest and shards.
    vocab_size, if given, is the model's: the data's token ids must fit in it."""
    manifest = read_manifest(data_dir)
    path = Path(data_dir) / MANIFEST
    splits = manifest["splits"]
    if split not in splits:
        raise UserError(f"{path}: field 'splits' has no split {split!r}; found {sorted(splits)}")
    if vocab_size is not None and manifest["vocab_size"] > vocab_size:
        raise UserError(f"{path}: field 'vocab_size' is {manifest['vocab_size']}, larger than the "
                        f"model's vocab_size {vocab_size}: tokens would fall outside the embedding")
    check_shards(Path(data_dir), manifest, split, verify_hash)
    return Dataset(Path(data_dir), split, manifest)
