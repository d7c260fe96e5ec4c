"""Tokenized documents on disk: ArrayRecord shards described by a manifest.json, their integrity
checks, and random access to any token range of any document.

A shard holds whole documents (a document never spans shards) as records of at most
RECORD_TOKENS token ids each (little-endian uint16 or int32, no BOS/EOS: the packer adds them),
then one last record: the documents' lengths (int64). So a reader touches only the records of
the tokens it wants. Chat data (format version 3, manifest field "streams": ["tokens", "weights"])
stores a second per-token stream: after each document's token records come as many records of
its loss weights (uint8, 0 or 1; preference pairs store a side code there, bit 0 the weight:
train/data/preferences.py). Version-2 data (tokens only) still reads. Shards are written
under a temporary name and renamed when complete; the manifest lists each shard's token count,
size, sha256 and the sha256 of every BLOCK_BYTES block (for a sampled check at start). Damage
found while reading raises DataIntegrityError, a UserError naming the shard, never a raw Riegeli
exception.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from pathlib import Path

import numpy as np
from array_record.python import array_record_module as arm

from formats.atomic import publish, temp_name, write_atomic
from formats.errors import UserError
from formats.jsonfile import read_json

FORMAT = "torchlyra-token-shards"
FORMAT_VERSION = 3          # 3: the "streams" field and the optional weights stream
READABLE_VERSIONS = (2, 3)  # 2: tokens only, no "streams" field
STREAMS = {"tokens": None, "weights": "<u1"}  # per-token streams; None: the manifest's token dtype
MANIFEST = "manifest.json"
# One record per chunk (group_size:1): reading a record decodes only that record. Uncompressed:
# zstd:1 would halve o200k shards (int32) but costs the preparation about 10% more CPU and the
# loader 8x in read speed (BENCHMARKS.md); Riegeli's block and chunk hashes are kept either way.
WRITER_OPTIONS = "group_size:1,uncompressed"
RECORD_TOKENS = 4096
BLOCK_BYTES = 4 << 20
BLOCK_DIGEST_HEX = 16  # a 64-bit prefix of each block's sha256
DTYPES = {"uint16": "<u2", "int32": "<i4"}
# Start-of-run check: hash whole shards up to this many bytes per split, else a random sample
# of blocks this large (sha256 runs at about 0.85 GB/s here: BENCHMARKS.md).
FULL_CHECK_BYTES = 1 << 30
SAMPLE_CHECK_BYTES = 256 << 20


class DataIntegrityError(UserError):
    """A shard differs from what its manifest recorded (damaged, truncated, replaced)."""


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.array_record"


# ---- writing ------------------------------------------------------------------------------------
def hash_blocks(path: Path) -> tuple[str, str]:
    """(sha256 of the file, concatenated 64-bit sha256 prefixes of its BLOCK_BYTES blocks)."""
    whole, blocks = hashlib.sha256(), []
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK_BYTES), b""):
            whole.update(block)
            blocks.append(hashlib.sha256(block).hexdigest()[:BLOCK_DIGEST_HEX])
    return whole.hexdigest(), "".join(blocks)


class ShardWriter:
    """Writes one shard under a temporary name; close() publishes it and returns its manifest
    entry, abort() removes it. A shard that was not closed never carries its final name."""

    def __init__(self, path: Path, dtype: str, weighted: bool = False):
        self.path, self.dtype, self.weighted = Path(path), DTYPES[dtype], weighted
        self.tmp = temp_name(self.path)
        self.writer = arm.ArrayRecordWriter(str(self.tmp), WRITER_OPTIONS)
        self.lengths: list[int] = []
        self.tokens = self.records = self.trained = 0

    def _write(self, values: np.ndarray) -> None:
        for start in range(0, len(values), RECORD_TOKENS):
            self.writer.write(values[start:start + RECORD_TOKENS].tobytes())
            self.records += 1

    def add(self, ids: np.ndarray, weights: np.ndarray | None = None) -> None:
        """One document; `weights` (one 0/1 per token) exactly when the shard is weighted."""
        if (weights is not None) != self.weighted or (weights is not None and len(weights) != len(ids)):
            raise ValueError(f"{self.path.name}: weights expected {'one per token' if self.weighted else 'none'}")
        self._write(np.asarray(ids).astype(self.dtype, copy=False))
        if weights is not None:
            weights = np.asarray(weights).astype(STREAMS["weights"], copy=False)
            self._write(weights)
            self.trained += int(np.count_nonzero(weights & 1))   # preference codes: bit 0 (preferences.py)
        self.lengths.append(len(ids))
        self.tokens += len(ids)

    def close(self) -> dict:
        self.writer.write(np.asarray(self.lengths, "<i8").tobytes())
        self.writer.close()
        publish(self.tmp, self.path)
        sha, blocks = hash_blocks(self.path)
        entry = {"file": self.path.name, "docs": len(self.lengths), "tokens": self.tokens,
                 "records": self.records + 1, "bytes": self.path.stat().st_size, "sha256": sha, "blocks": blocks}
        if self.weighted:
            entry["trained_tokens"] = self.trained
        return entry

    def abort(self) -> None:
        try:
            self.writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def write_manifest(out_dir: Path, manifest: dict) -> None:
    write_atomic(Path(out_dir) / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


# ---- manifest -----------------------------------------------------------------------------------
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
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise UserError(f"{path}: field 'format_version' expected one of {READABLE_VERSIONS}, found "
                        f"{manifest.get('format_version')!r} (re-run `torchlyra prepare --force`)")
    streams = manifest.setdefault("streams", ["tokens"])  # version 2: tokens only
    if streams not in (["tokens"], ["tokens", "weights"]):
        raise UserError(f"{path}: field 'streams' expected [\"tokens\"] or [\"tokens\", \"weights\"], "
                        f"found {streams!r}")
    for key in ("tokenizer", "vocab_size", "bos_id", "eos_id", "dtype", "record_tokens", "splits"):
        if key not in manifest:
            raise UserError(f"{path}: field {key!r} missing")
    if manifest["dtype"] not in DTYPES:
        raise UserError(f"{path}: field 'dtype' expected one of {sorted(DTYPES)}, found {manifest['dtype']!r}")
    return manifest


def _split_entry(data_dir: Path, manifest: dict, split: str) -> dict:
    splits = manifest["splits"]
    if split not in splits:
        raise UserError(f"{data_dir / MANIFEST}: field 'splits' has no split {split!r}; found {sorted(splits)}")
    return splits[split]


# ---- integrity ----------------------------------------------------------------------------------
def _block_digest(f, index: int) -> str:
    f.seek(index * BLOCK_BYTES)
    return hashlib.sha256(f.read(BLOCK_BYTES)).hexdigest()[:BLOCK_DIGEST_HEX]


def check_shards(data_dir, manifest: dict, split: str, mode: str = "auto") -> str:
    """Every shard of the split exists with its recorded size; then, by mode, "full": sha256 of
    every block, "sample": a random sample of blocks (SAMPLE_CHECK_BYTES in all), "size": nothing
    more, "auto": full up to FULL_CHECK_BYTES, else sample. Returns what was checked (one line)."""
    data_dir = Path(data_dir)
    shards = _split_entry(data_dir, manifest, split)["shards"]
    total = 0
    for shard in shards:
        path = data_dir / shard["file"]
        if not path.is_file():
            raise DataIntegrityError(f"{path}: shard listed in {MANIFEST} (split {split!r}) is missing")
        if (size := path.stat().st_size) != shard["bytes"]:
            raise DataIntegrityError(f"{path}: shard damaged: size expected {shard['bytes']} bytes "
                                     f"(from {MANIFEST}), found {size}")
        total += size
    if mode == "auto":
        mode = "full" if total <= FULL_CHECK_BYTES else "sample"
    blocks = [(shard, i) for shard in shards for i in range(len(shard["blocks"]) // BLOCK_DIGEST_HEX)]
    if mode == "sample" and len(blocks) * BLOCK_BYTES > SAMPLE_CHECK_BYTES:
        # A different sample at every start: over restarts the whole dataset gets looked at.
        blocks = random.Random(os.urandom(8)).sample(blocks, SAMPLE_CHECK_BYTES // BLOCK_BYTES)
    elif mode == "size":
        blocks = []
    for shard, i in sorted(blocks, key=lambda b: (b[0]["file"], b[1])):
        path = data_dir / shard["file"]
        with open(path, "rb") as f:
            found = _block_digest(f, i)
        if found != shard["blocks"][i * BLOCK_DIGEST_HEX:(i + 1) * BLOCK_DIGEST_HEX]:
            raise DataIntegrityError(f"{path}: shard damaged: bytes {i * BLOCK_BYTES}-"
                                     f"{min((i + 1) * BLOCK_BYTES, shard['bytes'])} differ from their sha256 "
                                     f"in {MANIFEST} (run `torchlyra prepare --verify {data_dir}`)")
    hashed = sum(min(BLOCK_BYTES, s["bytes"] - i * BLOCK_BYTES) for s, i in blocks)
    return f"{len(shards)} shard(s), {total:,} bytes: sizes checked, {hashed:,} bytes hashed ({mode})"


# ---- reading ------------------------------------------------------------------------------------
class Dataset:
    """Random access to the documents of one split. Document d (0 <= d < len(self), in stored
    order) has lengths[d] tokens; tokens(d, start, n) reads only the records covering them."""

    def __init__(self, data_dir, split: str, manifest: dict):
        self.data_dir, self.split, self.manifest = Path(data_dir), split, manifest
        entry = _split_entry(self.data_dir, manifest, split)
        self.shards = entry["shards"]
        self.num_docs, self.num_tokens = int(entry["docs"]), int(entry["tokens"])
        self.vocab_size, self.bos_id = int(manifest["vocab_size"]), int(manifest["bos_id"])
        self.eos_id = manifest["eos_id"]
        self.record_tokens = int(manifest["record_tokens"])
        self.np_dtype = np.dtype(DTYPES[manifest["dtype"]])
        self.streams = tuple(manifest.get("streams", ["tokens"]))
        self.weighted = "weights" in self.streams
        self._readers: dict[int, object] = {}
        self._lock = threading.Lock()  # the prefetch thread and an evaluation pass may read at once
        self.doc_start = np.cumsum([0] + [s["docs"] for s in self.shards])  # first document of each shard
        lengths, record_start = [], []
        for i, shard in enumerate(self.shards):
            n = self._read(i, [shard["records"] - 1])[0]
            lens = np.frombuffer(n, "<i8")
            if len(lens) != shard["docs"] or int(lens.sum()) != shard["tokens"]:
                raise DataIntegrityError(f"{self._path(i)}: shard damaged: its index lists {len(lens)} documents "
                                         f"of {int(lens.sum())} tokens, {MANIFEST} says {shard['docs']} of {shard['tokens']}")
            per_doc = -(-lens // self.record_tokens) * len(self.streams)  # each stream's records in turn
            record_start.append(np.concatenate([[0], np.cumsum(per_doc)[:-1]]).astype(np.int64))
            lengths.append(lens)
        self.lengths = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
        self.record_start = np.concatenate(record_start) if record_start else np.zeros(0, np.int64)
        self.stream_records = -(-self.lengths // self.record_tokens)  # records of one stream, per document

    def __len__(self) -> int:
        return self.num_docs

    def _path(self, shard: int) -> Path:
        return self.data_dir / self.shards[shard]["file"]

    def _read(self, shard: int, records: list[int]) -> list[bytes]:
        """Records of one shard; any failure is a DataIntegrityError naming the shard."""
        try:
            with self._lock:
                if shard not in self._readers:
                    self._readers[shard] = arm.ArrayRecordReader(str(self._path(shard)), "readahead_buffer_size:0")
                return self._readers[shard].read(records)
        except Exception as e:  # the Riegeli binding raises RuntimeError/ValueError/OSError
            detail = str(e).splitlines()[0].split(";")[0][:200] if str(e) else type(e).__name__
            raise DataIntegrityError(f"{self._path(shard)}: shard damaged or unreadable ({detail}); "
                                     f"run `torchlyra prepare --verify {self.data_dir}`") from None

    def read_records(self, shard: int, records: list[int]) -> list[bytes]:
        """Raw records of one shard (integrity checks); DataIntegrityError naming it on failure."""
        return self._read(shard, records)

    def locate(self, doc: int) -> tuple[int, int]:
        """(shard, first record) of a document."""
        shard = int(np.searchsorted(self.doc_start, doc, side="right")) - 1
        return shard, int(self.record_start[doc])

    def read_segments(self, segments, stream: str = "tokens") -> list[np.ndarray]:
        """Token ids (int32) of each (doc, start, count) segment, or with stream="weights" their
        loss weights (uint8), reading each needed record once; segments are grouped by shard so
        each shard is asked once."""
        if stream not in self.streams:
            raise UserError(f"{self.data_dir / MANIFEST}: no {stream!r} stream "
                            f"(field 'streams' is {list(self.streams)})")
        index = self.streams.index(stream)
        dtype, out_dtype = (self.np_dtype, np.int32) if stream == "tokens" else (np.dtype(STREAMS[stream]), np.uint8)
        wanted: dict[int, dict[int, None]] = {}
        spans = []
        c = self.record_tokens
        for doc, start, count in segments:
            if count == 0:
                spans.append(None)
                continue
            shard, first = self.locate(int(doc))
            first += index * int(self.stream_records[doc])
            lo, hi = first + start // c, first + (start + count - 1) // c
            wanted.setdefault(shard, {}).update(dict.fromkeys(range(lo, hi + 1)))
            spans.append((shard, lo, hi, start - (start // c) * c, count))
        got: dict[tuple[int, int], np.ndarray] = {}
        for shard, records in wanted.items():
            recs = list(records)
            for r, raw in zip(recs, self._read(shard, recs)):
                got[shard, r] = np.frombuffer(raw, dtype)
        out = []
        for span in spans:
            if span is None:
                out.append(np.zeros(0, out_dtype))
                continue
            shard, lo, hi, skip, count = span
            parts = [got[shard, r] for r in range(lo, hi + 1)]
            ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
            piece = ids[skip:skip + count]
            if len(piece) != count:
                raise DataIntegrityError(f"{self._path(shard)}: shard damaged: a record is shorter than its index says")
            out.append(piece.astype(out_dtype))  # a copy: never a view of the record's bytes
        return out

    def doc(self, d: int) -> np.ndarray:
        if not 0 <= d < self.num_docs:
            raise IndexError(f"document {d} out of range [0, {self.num_docs})")
        return self.read_segments([(d, 0, int(self.lengths[d]))])[0]

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_dataset(data_dir, split: str, *, vocab_size: int | None = None, check: str = "auto") -> Dataset:
    """Open one split of a prepared dataset after checking its manifest and shards (see
    check_shards for `check`). vocab_size, if given, is the model's: the data's ids must fit."""
    manifest = read_manifest(data_dir)
    if vocab_size is not None and manifest["vocab_size"] > vocab_size:
        raise UserError(f"{Path(data_dir) / MANIFEST}: field 'vocab_size' is {manifest['vocab_size']}, larger than "
                        f"the model's vocab_size {vocab_size}: tokens would fall outside the embedding")
    check_shards(data_dir, manifest, split, check)
    return Dataset(data_dir, split, manifest)
