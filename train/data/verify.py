"""`torchlyra prepare --verify DIR`: check a whole dataset against its manifest.

Every shard: present, of its recorded size and sha256; every record readable (ArrayRecord
checks its own block hashes) and as long as the shard's index says; the index agreeing with the
manifest's document and token counts; every token id below the vocabulary size, every loss weight
0 or 1 (chat data). Also the tokenizer file's sha256. All damaged shards are named, then the command fails (exit 2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from formats.atomic import sha256_file
from train.data import shards
from formats import tokenizer
from train.data.shards import DataIntegrityError


def _check_shard(data_dir: Path, manifest: dict, split: str, entry: dict) -> int:
    """Raise DataIntegrityError describing the first problem of one shard; return its tokens."""
    path = data_dir / entry["file"]
    if not path.is_file():
        raise DataIntegrityError(f"{entry['file']}: missing")
    if (size := path.stat().st_size) != entry["bytes"]:
        raise DataIntegrityError(f"{entry['file']}: size {size}, manifest says {entry['bytes']}")
    whole, blocks = shards.hash_blocks(path)
    if whole != entry["sha256"]:
        bad = [i for i in range(len(blocks) // shards.BLOCK_DIGEST_HEX)
               if blocks[i * shards.BLOCK_DIGEST_HEX:(i + 1) * shards.BLOCK_DIGEST_HEX]
               != entry["blocks"][i * shards.BLOCK_DIGEST_HEX:(i + 1) * shards.BLOCK_DIGEST_HEX]]
        where = ", ".join(f"bytes {i * shards.BLOCK_BYTES}-{min((i + 1) * shards.BLOCK_BYTES, size)}" for i in bad[:3])
        raise DataIntegrityError(f"{entry['file']}: sha256 differs from the manifest ({where or 'somewhere'})")
    one = {**manifest, "splits": {split: {"docs": entry["docs"], "tokens": entry["tokens"], "shards": [entry]}}}
    with shards.Dataset(data_dir, split, one) as ds:  # reads the index record
        vocab = int(manifest["vocab_size"])
        # Which stream each record holds: per document, each stream's records in turn.
        kinds = np.concatenate([np.repeat(np.arange(len(ds.streams)), n) for n in ds.stream_records.tolist()] or
                               [np.zeros(0, np.int64)])
        for start in range(0, entry["records"] - 1, 256):
            records = list(range(start, min(start + 256, entry["records"] - 1)))
            for r, raw in zip(records, ds.read_records(0, records)):
                if r < len(kinds) and ds.streams[kinds[r]] == "weights":
                    w = np.frombuffer(raw, shards.STREAMS["weights"])
                    if len(w) and int(w.max()) > 1:
                        raise DataIntegrityError(f"{entry['file']}: loss weight {int(w.max())}, expected 0 or 1")
                    continue
                ids = np.frombuffer(raw, ds.np_dtype)
                if len(ids) and int(ids.max()) >= vocab:
                    raise DataIntegrityError(f"{entry['file']}: token id {int(ids.max())} >= vocab_size {vocab}")
        expected = -(-ds.lengths // ds.record_tokens) * len(ds.streams)
        if int(expected.sum()) + 1 != entry["records"]:
            raise DataIntegrityError(f"{entry['file']}: {entry['records']} records, the index implies "
                                     f"{int(expected.sum()) + 1}")
        return int(ds.lengths.sum())


def verify_dataset(data_dir) -> str:
    """Check everything; return a one-line summary, or raise DataIntegrityError naming every
    damaged shard."""
    data_dir = Path(data_dir)
    manifest = shards.read_manifest(data_dir)
    problems, checked, tokens, size = [], 0, 0, 0
    tok = manifest["tokenizer"]
    tok_path = data_dir / tok.get("tiktoken_file", tokenizer.RANKS_FILE)
    if not tok_path.is_file() or sha256_file(tok_path) != tok["tiktoken_sha256"]:
        problems.append(f"{tok_path.name}: missing or sha256 differs from the manifest")
    for split, entry in manifest["splits"].items():
        for shard in entry["shards"]:
            try:
                tokens += _check_shard(data_dir, manifest, split, shard)
                checked += 1
                size += shard["bytes"]
            except DataIntegrityError as e:
                problems.append(str(e).split(": run `torchlyra")[0])
    if problems:
        raise DataIntegrityError(f"{data_dir}: {len(problems)} problem(s): " + "; ".join(problems))
    return (f"{data_dir}: OK: {checked} shard(s), {size:,} bytes, {tokens:,} tokens: sizes, sha256, every "
            f"record and token id checked against {shards.MANIFEST}")
