"""Recognise the tokenizer of a Hugging Face directory: gpt-oss ships o200k_harmony as a
byte-level BPE tokenizer.json; when its vocabulary and special tokens equal ours, our offline
o200k_harmony (tiktoken) is attached, so data prepared with `--tokenizer o200k_harmony` fits.
Another byte-level BPE (Llama-3, Qwen) is converted as `--tokenizer hf:DIR` converts it. A
torchlyra export carries its own tiktoken files in tiktoken/.
"""
from __future__ import annotations

import json
from pathlib import Path

from formats.tokenizer_json import byte_level_alphabet


def vocabulary_difference(tokenizer_json: dict, enc) -> str | None:
    """None when a byte-level BPE tokenizer.json has exactly `enc`'s ranks and special tokens,
    else what differs first."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return f"model type {model.get('type')!r}, expected a byte-level 'BPE'"
    decode = byte_level_alphabet()
    ranks = enc._mergeable_ranks    # tiktoken keeps no public accessor for the ranks
    vocab = model["vocab"]
    if len(vocab) != len(ranks):
        return f"{len(vocab)} vocabulary entries, expected {len(ranks)}"
    for token, i in vocab.items():
        try:
            raw = bytes(decode[c] for c in token)
        except KeyError:
            return f"token {token!r} is not byte-level"
        if ranks.get(raw) != i:
            return f"token {token!r} has id {i}, expected {ranks.get(raw)}"
    ours = enc._special_tokens
    for added in tokenizer_json.get("added_tokens") or []:
        name, i = added.get("content"), added.get("id")
        if ours.get(name) != i and not (name or "").startswith("<|reserved_"):
            return f"special token {name!r} has id {i}, expected {ours.get(name)}"
    named = {a.get("content") for a in tokenizer_json.get("added_tokens") or []}
    missing = [n for n in ours if n not in named and not n.startswith("<|reserved_")]
    if missing:
        return f"special token {missing[0]!r} is missing"
    return None


def recognize(hf_dir: Path):
    """(tiktoken Encoding or None, one line saying which tokenizer was found)."""
    hf_dir = Path(hf_dir)
    if (hf_dir / "tiktoken" / "tokenizer.tiktoken").is_file():
        from formats.tokenizer import load_tokenizer
        return load_tokenizer(hf_dir / "tiktoken"), "tiktoken (from the export's tiktoken/)"
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return None, "none (no tokenizer.json)"
    from formats.tokenizer import o200k_harmony

    try:
        found = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"none: {path} is not JSON ({e})"
    difference = vocabulary_difference(found, o200k_harmony())
    if difference is None:
        return o200k_harmony(), f"o200k_harmony (recognised in {path.name}; our offline copy attached)"
    from formats.errors import UserError
    from formats.tokenizer import build_tokenizer, parse_spec

    try:        # another byte-level BPE (Llama-3, Qwen): converted exactly, as `--tokenizer hf:DIR` does
        return build_tokenizer(parse_spec(f"hf:{hf_dir}")), f"hf:{hf_dir} (its tokenizer.json, converted)"
    except UserError as e:
        return None, (f"none: {path} is not o200k_harmony ({difference}) and does not convert ({e}); "
                      f"no tokenizer attached")
