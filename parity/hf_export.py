"""`torchlyra export`: a checkpoint -> a directory transformers loads as GptOssForCausalLM.

Writes config.json (GptOssConfig), model.safetensors (or shards + model.safetensors.index.json
above the size threshold), generation_config.json, the tokenizer (transformers' tokenizer.json +
tokenizer_config.json converted from our tiktoken BPE, plus the original files under tiktoken/)
and a README.md. Everything is written into a hidden directory beside the target and renamed
at the end, so a failure leaves no partial output.
"""
from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from parity import hf_mapping
from train import checkpoint
from train.atomic import staged_dir
from train.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_SHARD_BYTES = 2 * 1000**3
INDEX_FILE = "model.safetensors.index.json"
# Text the exported tokenizer must encode exactly as tiktoken does before it is written.
TOKENIZER_PROBES = ["Hello, world! It's 2024: naïve café, ünïcode ЖЖ 日本語 😀.\n\n  indented\tline\r\n",
                    "x = [1, 22, 333, 4444];  // code   with    runs of spaces\n", "<|bos|>once upon a time"]


def parse_size(text: str) -> int:
    """'2GB', '500MB', '10KB' or a byte count (decimal units, as transformers' max_shard_size)."""
    units = {"GB": 1000**3, "MB": 1000**2, "KB": 1000, "B": 1}
    s = str(text).strip().upper()
    for unit, scale in units.items():
        if s.endswith(unit) and s[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(s[:-len(unit)]) * scale)
    if s.isdigit():
        return int(s)
    raise UserError(f"--shard-size: expected a size such as 2GB, 500MB or a byte count, found {text!r}")


def write_weights(out: Path, tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[str]:
    """One model.safetensors, or consecutive shards of at most shard_bytes each (a larger tensor
    gets a shard of its own) plus the index transformers reads. Returns the file names."""
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t, size + n
    shards.append(current)
    if len(shards) == 1:
        safetensors.torch.save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        safetensors.torch.save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names + [INDEX_FILE]


def write_tokenizer(enc, out: Path, cfg) -> str:
    """Our tiktoken BPE as transformers files (checked against tiktoken on probe text before they
    are kept) and, always, the original tiktoken files under out/tiktoken. Returns a status line."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from train.tokenizer import save_tokenizer

    if enc.n_vocab > cfg.vocab_size:
        raise UserError(f"tokenizer: {enc.n_vocab} ids do not fit ModelConfig.vocab_size {cfg.vocab_size}")
    save_tokenizer(enc, out / "tiktoken")
    converter = TikTokenConverter(vocab_file=None, pattern=enc._pat_str, extra_special_tokens=enc._special_tokens)
    # Hand the ranks over in memory: no temp .tiktoken file, no tiktoken path cache involved.
    converter.load_tiktoken_bpe = lambda _: enc._mergeable_ranks
    tok = converter.converted()
    specials_ok = all(tok.token_to_id(s) == i for s, i in enc._special_tokens.items())
    same = specials_ok and all(
        tok.encode(text, add_special_tokens=False).ids == enc.encode(text, allowed_special="all")
        for text in TOKENIZER_PROBES)
    if not same:
        return "tiktoken only: the transformers conversion did not reproduce tiktoken's ids (see tiktoken/)"
    tok.save(str(out / "tokenizer.json"))
    by_id = {i: s for s, i in enc._special_tokens.items()}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
               "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    for role, token_id in (("bos_token", cfg.bos_token_id), ("eos_token", cfg.eos_token_id)):
        if token_id in by_id:
            tok_cfg[role] = by_id[token_id]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return "transformers: tokenizer.json + tokenizer_config.json (AutoTokenizer), tiktoken files in tiktoken/"


README = """# {name}

A torchlyra checkpoint (step {step}) exported as a Hugging Face transformers `GptOssForCausalLM`
({dtype}, {n_params:,} parameters{moe}).

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")   # if tokenizer.json is present
```

- Weights: {weights}.
- Tokenizer: {tokenizer}.
  The original tiktoken BPE (when the checkpoint named one) is in `tiktoken/`: rebuild it with
  `train.tokenizer.load_tokenizer("tiktoken")`, or with `tiktoken.Encoding` from the ranks file,
  pattern and special tokens listed in `tiktoken/tokenizer.json`.
- Exactness: transformers' eager attention in float32 matches torchlyra's eager model (test suite:
  relative error of the logits <= 1e-5).{dense_note}
"""


def export_checkpoint(checkpoint_dir, out_dir, *, dtype: str = "float32", shard_size_bytes: int = DEFAULT_SHARD_BYTES,
                      overwrite: bool = False) -> dict:
    """Write `out_dir` as a transformers GptOss model directory; returns a summary dict."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
    if shard_size_bytes <= 0:
        raise UserError(f"--shard-size: expected a positive size, found {shard_size_bytes}")
    state, cfg, meta = checkpoint.load_checkpoint(checkpoint_dir)
    hf_cfg = hf_mapping.build_hf_config(cfg, dtype=dtype)
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf_mapping.to_hf_state(state, cfg).items()}
    tok_dir = checkpoint.tokenizer_dir(checkpoint_dir, meta)
    enc = None
    if tok_dir is not None:
        from train.tokenizer import load_tokenizer
        enc = load_tokenizer(tok_dir)

    from transformers import GenerationConfig
    with staged_dir(out_dir, replace="always" if overwrite else "never") as tmp:
        hf_cfg.save_pretrained(tmp)
        GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id).save_pretrained(tmp)
        files = write_weights(tmp, tensors, shard_size_bytes)
        tokenizer = write_tokenizer(enc, tmp, cfg) if enc else "none: the checkpoint's config.json names no tokenizer"
        n_params = sum(t.numel() for t in tensors.values())
        (tmp / "README.md").write_text(README.format(
            name=Path(out_dir).name, step=meta.get("step", 0), dtype=dtype, n_params=n_params,
            moe=f", {cfg.n_experts} experts top-{cfg.experts_per_token}" if cfg.is_moe else ", dense MLP",
            weights=f"`{files[0]}`" if len(files) == 1 else f"{len(files) - 1} shards `model-*-of-*.safetensors`, "
                                                           f"listed in `{INDEX_FILE}`", tokenizer=tokenizer,
            dense_note=" The dense MLP is stored as a one-expert MoE with a zero router (exactly equal)."
            if not cfg.is_moe else ""))
    return {"out": str(out_dir), "step": meta.get("step", 0), "dtype": dtype, "files": files,
            "n_tensors": len(tensors), "n_params": n_params, "tokenizer": tokenizer}


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory written by `torchlyra train`")
    parser.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the written weights")
    parser.add_argument("--shard-size", default="2GB", help="largest safetensors file before sharding (e.g. 2GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")


def run(args) -> int:
    summary = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, shard_size_bytes=parse_size(args.shard_size),
                                overwrite=args.overwrite)
    files = summary["files"]
    weights = files[0] if len(files) == 1 else f"{len(files) - 1} shards + {INDEX_FILE}"
    print(f"exported step {summary['step']} ({summary['n_params']:,} parameters, {summary['dtype']}) to "
          f"{summary['out']}: {weights}")
    print(f"tokenizer: {summary['tokenizer']}")
    return 0
