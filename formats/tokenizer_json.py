"""A Hugging Face tokenizer directory (`tokenizer.json` + `tokenizer_config.json`, Llama-3 or Qwen
style: a byte-level BPE) as a tiktoken Encoding, so every path that takes our tokenizers (data,
bits per byte, streamed decoding, evaluation) takes it too.

The conversion is exact or refused: each token's bytes get its id as tiktoken rank, which
reproduces the `tokenizers` library's BPE when merge order is id order (checked for every merge),
the split regex comes from the pre-tokenizer, a Unicode normalizer (Qwen's NFC) is applied before
encoding, and the converted encoder must give `tokenizers`' own ids on probe texts before it is
returned. Anything else (a SentencePiece/Metaspace model, byte fallback, another normalizer or
pre-tokenizer) is refused by name.

Documents are delimited as the tokenizer's config says: its `bos_token` starts each document and
its `eos_token` ends it (Llama-3); with no `bos_token` (Qwen) the `eos_token` alone separates them:
it precedes each document, and so ends the one before.
"""
from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path

import tiktoken

from formats.errors import UserError

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
NORMALIZATIONS = ("NFC", "NFD", "NFKC", "NFKD")     # what unicodedata.normalize applies as tokenizers does
# GPT-2's split regex: what a ByteLevel pre-tokenizer with use_regex=true applies.
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Text the converted encoder must tokenize exactly as `tokenizers` does before it is used.
PROBES = ["Hello, world! It's 2024: naïve café, ünïcode ЖЖ 日本語 😀.\n\n  indented\tline\r\n",
          "x = [1, 22, 333, 4444];  // code   with    runs of spaces\n",
          "HOW'S IT GOING? I'd've thought   so...\n\n\n3.14159 + 2,718 = 5.85\u00a0non-breaking",
          "Cafe\u0301 (a decomposed é), \uff21\uff22 (fullwidth), \u212b (angstrom) ﬁ ligature",
          "def f(xs):\n    return {k: v for k, v in xs.items() if v}  # ok\n\t\ttabs\n"]


class HFEncoding(tiktoken.Encoding):
    """tiktoken's Encoding of a converted tokenizer.json: applies its Unicode normalization before
    encoding and carries its document markers (special token names)."""

    def __init__(self, *, name, pat_str, mergeable_ranks, special_tokens, normalization: str | None,
                 document_start: str, document_end: str, chat_template: str | None = None):
        super().__init__(name=name, pat_str=pat_str, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens)
        if normalization not in (None, *NORMALIZATIONS):
            raise ValueError(f"normalization {normalization!r}, expected None or one of {NORMALIZATIONS}")
        for marker in (document_start, document_end):
            if marker not in special_tokens:
                raise ValueError(f"document marker {marker!r} is not a special token")
        self.normalization, self.document_start, self.document_end = normalization, document_start, document_end
        self.chat_template = chat_template      # the Jinja template SFT renders conversations with

    def normalize(self, text: str) -> str:
        return unicodedata.normalize(self.normalization, text) if self.normalization else text

    def encode_ordinary(self, text, *args, **kwargs):
        return super().encode_ordinary(self.normalize(text), *args, **kwargs)

    def encode(self, text, *args, **kwargs):
        return super().encode(self.normalize(text), *args, **kwargs)

    def encode_to_numpy(self, text, *args, **kwargs):
        return super().encode_to_numpy(self.normalize(text), *args, **kwargs)
    # encode_ordinary_batch and encode_batch go through the two methods above.

    def extras(self) -> dict:
        return {"normalization": self.normalization, "document_start": self.document_start,
                "document_end": self.document_end, "chat_template": self.chat_template}

    def __getstate__(self):
        return {**super().__getstate__(), **self.extras()}

    def __setstate__(self, value):
        self.__init__(**value)


def byte_level_alphabet() -> dict[str, int]:
    """The printable character that HF's ByteLevel stands in for each byte (GPT-2's table):
    tokenizer.json writes every token in it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _content(token) -> str | None:
    """A tokenizer_config.json token field: a string, {"content": ...} or null."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) or token is None else str(token)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"--tokenizer hf:{path.parent}: no {path.name} (expected a Hugging Face tokenizer directory)")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def fingerprint(hf_dir) -> str:
    """sha256 over the two files the conversion reads (what decides the prepared data)."""
    digest = hashlib.sha256()
    for name in (TOKENIZER_JSON, TOKENIZER_CONFIG, "chat_template.jinja"):
        path = Path(hf_dir) / name
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()


def _split_pattern(pre, where: str) -> str:
    """The split regex of a byte-level pre-tokenizer; refuses any other."""
    parts = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") if isinstance(p, dict) else None for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True) and not parts[0].get("add_prefix_space"):
        return GPT2_PAT_STR
    if kinds == ["Split", "ByteLevel"]:
        split, level = parts
        regex = (split.get("pattern") or {}).get("Regex")
        if (regex and split.get("behavior") == "Isolated" and not split.get("invert")
                and not level.get("use_regex", True) and not level.get("add_prefix_space")):
            return regex
    raise UserError(f"{where}: field 'pre_tokenizer' is {kinds}, expected a byte-level BPE's (ByteLevel with its "
                    "regex, or Split by a regex, isolated, then ByteLevel without it; no prefix space)")


def load_hf_tokenizer(hf_dir) -> HFEncoding:
    """The tokenizer of a Hugging Face directory as a tiktoken Encoding, checked against the
    `tokenizers` library on PROBES; UserError naming the field that cannot convert."""
    from tokenizers import Tokenizer

    hf_dir = Path(hf_dir)
    path = hf_dir / TOKENIZER_JSON
    data, config = _read_json(path), _read_json(hf_dir / TOKENIZER_CONFIG)
    where = str(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UserError(f"{where}: field 'model.type' is {model.get('type')!r}, expected a byte-level 'BPE'")
    for field in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(field):
            raise UserError(f"{where}: field 'model.{field}' is {model[field]!r}, which tiktoken does not express")
    if (data.get("decoder") or {}).get("type") != "ByteLevel":
        raise UserError(f"{where}: field 'decoder' is {(data.get('decoder') or {}).get('type')!r}, expected 'ByteLevel'")
    normalizer = data.get("normalizer")
    normalization = None if normalizer is None else normalizer.get("type")
    if normalization not in (None, *NORMALIZATIONS):
        raise UserError(f"{where}: field 'normalizer' is {normalization!r}, expected none or one of {NORMALIZATIONS}")
    pat_str = _split_pattern(data.get("pre_tokenizer"), where)

    decode = byte_level_alphabet()
    ranks: dict[bytes, int] = {}
    for token, i in model["vocab"].items():
        try:
            ranks[bytes(decode[c] for c in token)] = int(i)
        except KeyError:
            raise UserError(f"{where}: vocabulary token {token!r} is not byte-level") from None
    if len(set(ranks.values())) != len(ranks):
        raise UserError(f"{where}: two vocabulary tokens share an id")
    _check_merge_order(model.get("merges") or [], model["vocab"], where)
    specials = {}
    for added in data.get("added_tokens") or []:
        name, i = added.get("content"), int(added.get("id"))
        if name in model["vocab"]:
            continue             # a vocabulary token listed again
        if i in ranks.values():
            raise UserError(f"{where}: added token {name!r} has id {i}, which a vocabulary token holds")
        specials[name] = i

    bos, eos = _content(config.get("bos_token")), _content(config.get("eos_token"))
    for role, name in (("bos_token", bos), ("eos_token", eos)):
        if name is not None and name not in specials:
            raise UserError(f"{hf_dir / TOKENIZER_CONFIG}: field '{role}' is {name!r}, not one of the added tokens")
    if eos is None:
        raise UserError(f"{hf_dir / TOKENIZER_CONFIG}: field 'eos_token' is missing: nothing marks a document's end")
    enc = HFEncoding(name=f"hf:{hf_dir.name}", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials,
                     normalization=normalization, document_start=bos or eos, document_end=eos,
                     chat_template=_chat_template(hf_dir, config))
    reference = Tokenizer.from_file(str(path))
    reference.encode_special_tokens = True     # special-token text is plain text in documents, as ours
    for text in PROBES:
        want, got = reference.encode(text, add_special_tokens=False).ids, enc.encode_ordinary(text)
        if want != got:
            at = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise UserError(f"{where}: converted to tiktoken it tokenizes {text[:40]!r}... differently from the "
                            f"tokenizers library (token {at}: {got[at:at + 3]} instead of {want[at:at + 3]})")
    return enc


def _chat_template(hf_dir: Path, config: dict) -> str | None:
    """The directory's chat template: chat_template.jinja (transformers >= 4.50 writes it there)
    or tokenizer_config.json's `chat_template` (one string; named templates are not taken)."""
    if (hf_dir / "chat_template.jinja").is_file():
        return (hf_dir / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise UserError(f"{hf_dir / TOKENIZER_CONFIG}: field 'chat_template' holds several named templates; "
                        "expected one template string")
    return template


def _check_merge_order(merges: list, vocab: dict, where: str) -> None:
    """tiktoken merges the adjacent pair whose joined token has the lowest id; tokenizers' BPE, the
    pair listed first in `merges`: the same when each merge makes a token of a larger id."""
    last = -1
    for k, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        made = vocab.get(left + right)
        if made is None or made <= last:
            raise UserError(f"{where}: merge {k} ({left!r} + {right!r}) makes id {made} after a merge made id "
                            f"{last}: merge order is not id order, which tiktoken needs")
        last = made
