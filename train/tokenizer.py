"""A small byte-level BPE trained on the corpus, used through tiktoken.

Training uses Hugging Face `tokenizers` (fast, Rust) behind the same regex pre-tokenizer that
tiktoken applies at encode time; its merges become tiktoken mergeable ranks: the 256 single bytes
first (rank = byte value), then one rank per merge in merge order. The one special token
`<|bos|>` takes the last id, vocab_size - 1.

On disk, beside the data: `tokenizer.tiktoken` (tiktoken's format: base64 token, space, rank)
and `tokenizer.json` (name, pat_str, special tokens, vocab_size, sha256 of the .tiktoken file).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Iterable

import tiktoken

from train.errors import UserError
from train.shards import sha256_file, write_atomic

BOS = "<|bos|>"
# GPT-4's split pattern (cl100k_base): contractions, words, up to 3 digits, punctuation, spaces.
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
RANKS_FILE, META_FILE = "tokenizer.tiktoken", "tokenizer.json"


def _byte_level_alphabet() -> dict[str, int]:
    """The printable character that HF's ByteLevel stands in for each byte (GPT-2's table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _make_encoding(ranks: dict[bytes, int], name: str) -> tiktoken.Encoding:
    return tiktoken.Encoding(name=name, pat_str=PAT_STR, mergeable_ranks=ranks,
                             special_tokens={BOS: len(ranks)})


def train_bpe(texts: Iterable[str], vocab_size: int = 4096) -> tiktoken.Encoding:
    """Train a byte-level BPE with vocab_size ids in all (256 bytes + merges + <|bos|>).
    A corpus too small to yield that many merges gives a smaller vocabulary (enc.n_vocab)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise UserError(f"--vocab-size: expected at least 257 (256 bytes + {BOS}), found {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]

    to_byte = _byte_level_alphabet()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in merges:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(to_byte[c] for c in left + right)
        ranks.setdefault(token, len(ranks))  # a merge that re-creates a known token adds no id
        if len(ranks) == vocab_size - 1:
            break
    return _make_encoding(ranks, f"torchlyra-bpe-{len(ranks) + 1}")


def bos_id(enc: tiktoken.Encoding) -> int:
    return enc.encode_single_token(BOS)


def save_tokenizer(enc: tiktoken.Encoding, out_dir: str | os.PathLike) -> str:
    """Write tokenizer.tiktoken and tokenizer.json atomically; return the .tiktoken sha256."""
    out_dir = Path(out_dir)
    ranks = enc._mergeable_ranks  # tiktoken keeps no public accessor for the ranks
    lines = [base64.b64encode(tok) + b" " + str(rank).encode()
             for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    write_atomic(out_dir / RANKS_FILE, b"\n".join(lines) + b"\n")
    digest = sha256_file(out_dir / RANKS_FILE)
    meta = {"name": enc.name, "pat_str": enc._pat_str, "special_tokens": enc._special_tokens,
            "vocab_size": enc.n_vocab, "tiktoken_file": RANKS_FILE, "tiktoken_sha256": digest}
    write_atomic(out_dir / META_FILE, (json.dumps(meta, indent=1) + "\n").encode())
    return digest


def _parse_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise UserError(f"{path}:{n}: expected 'base64-token rank', found {line[:60]!r}") from e
    return ranks


def load_tokenizer(data_dir: str | os.PathLike) -> tiktoken.Encoding:
    """Rebuild the Encoding saved by save_tokenizer, after checking the .tiktoken file's sha256."""
    data_dir = Path(data_dir)
    meta_path = data_dir / META_FILE
    if not meta_path.is_file():
        raise UserError(f"{data_dir}: expected {META_FILE}, found none (run `torchlyra prepare`)")
    try:
        meta = json.loads(meta_path.read_text())
        ranks_path = data_dir / meta["tiktoken_file"]
        expected, vocab_size = meta["tiktoken_sha256"], int(meta["vocab_size"])
        pat_str, specials = meta["pat_str"], dict(meta["special_tokens"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{meta_path}: not a torchlyra tokenizer description ({type(e).__name__}: {e})") from e
    if not ranks_path.is_file():
        raise UserError(f"{ranks_path}: file named by {META_FILE} field 'tiktoken_file' is missing")
    # Hash the bytes ourselves: tiktoken.load.load_tiktoken_bpe caches local files by path in a
    # shared temp dir and would answer from that cache, hiding a file changed on disk.
    data = ranks_path.read_bytes()
    found = sha256_file(ranks_path)
    if found != expected:
        raise UserError(f"{ranks_path}: sha256 expected {expected} (from {META_FILE} field "
                        f"'tiktoken_sha256'), found {found}")
    ranks = _parse_ranks(data, ranks_path)
    if len(ranks) + len(specials) != vocab_size or specials.get(BOS) != vocab_size - 1:
        raise UserError(f"{meta_path}: field 'vocab_size' is {vocab_size} with {BOS} at "
                        f"{specials.get(BOS)}, but {ranks_path.name} holds {len(ranks)} ranks")
    return tiktoken.Encoding(name=meta.get("name", "torchlyra-bpe"), pat_str=pat_str,
                             mergeable_ranks=ranks, special_tokens=specials)
