"""`torchlyra export`: a checkpoint -> a directory transformers loads as GptOssForCausalLM.

Writes config.json (GptOssConfig), model.safetensors (or shards + model.safetensors.index.json
above the size threshold), generation_config.json, the tokenizer (transformers' tokenizer.json +
tokenizer_config.json converted from our tiktoken BPE, the harmony chat template for harmony
tokenizers, the original files under tiktoken/) and a README.md. Tensors stream from the
checkpoint one at a time into shards; `--dtype mxfp4` writes gpt-oss's released layout (MXFP4
experts, bf16 rest). Everything is written into a hidden directory beside the target and renamed
at the end, so a failure leaves no partial output.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from tqdm import tqdm

from formats import hf_mapping, mxfp4, tokenizer_json
from formats import checkpoint
from formats.atomic import staged_dir
from formats.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "mxfp4": None}
DEFAULT_SHARD_BYTES = 2 * 1000**3
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
# As gpt-oss is released: only the expert weights are MXFP4.
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
# gpt-oss's harmony chat format, as train/generation/chat.py renders it: <|start|>{role}[<|channel|>{channel}]
# <|message|>{content}<|end|> per message, then <|start|>assistant for the reply.
HARMONY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|start|>{{ message['role'] }}"
    "{%- if message.get('channel') %}<|channel|>{{ message['channel'] }}{% endif -%}"
    "<|message|>{{ message['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
# Text the exported tokenizer must encode exactly as tiktoken does before it is written.
TOKENIZER_PROBES = [*tokenizer_json.PROBES, "<|bos|>once upon a time"]   # a special token in text too


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


class ShardWriter:
    """Consecutive safetensors shards of at most shard_bytes each (a larger tensor gets a shard of
    its own), written as tensors arrive: host memory holds at most one shard. Shards are named
    model-K-of-N once N is known (close), or model.safetensors when there is only one."""

    def __init__(self, out: Path, shard_bytes: int):
        self.out, self.shard_bytes = out, shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.size, self.files, self.weight_map, self.total = 0, [], {}, 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.current and self.size + n > self.shard_bytes:
            self.flush()
        self.current[name], self.size, self.total = t.contiguous(), self.size + n, self.total + n

    def flush(self) -> None:
        part = self.out / f".shard-{len(self.files)}.tmp"
        safetensors.torch.save_file(self.current, str(part), metadata={"format": "pt"})
        self.files.append((part, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> list[str]:
        """Name the shards and write the index; returns the file names."""
        if self.current or not self.files:
            self.flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.out / SINGLE_FILE)
            return [SINGLE_FILE]
        names = [f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors" for i in range(len(self.files))]
        for name, (part, tensors) in zip(names, self.files):
            part.rename(self.out / name)
            self.weight_map.update(dict.fromkeys(tensors, name))
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return names + [INDEX_FILE]


def is_expert_weight(hf_name: str) -> bool:
    return hf_name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))


def released_tensors(hf_name: str, t: torch.Tensor, errors: dict) -> dict[str, torch.Tensor]:
    """One HF tensor as gpt-oss releases it: expert weights [E, in, out] as MXFP4 blocks
    [E, out, in/32, 16] + scales [E, out, in/32] (the relative error is recorded in `errors`),
    everything else bfloat16. Quantized one expert at a time (bounded temporaries)."""
    if not is_expert_weight(hf_name):
        return {hf_name: t.to(torch.bfloat16)}
    experts, inputs, outputs = t.shape
    blocks = np.empty((experts, outputs, inputs // mxfp4.BLOCK, mxfp4.BLOCK // 2), np.uint8)
    scales = np.empty((experts, outputs, inputs // mxfp4.BLOCK), np.uint8)
    err2 = ref2 = 0.0
    for e in range(experts):
        w = t[e].float().numpy().T                               # [out, in]: blocks run along `in`
        blocks[e], scales[e] = mxfp4.quantize(w, hf_name)
        back = mxfp4.dequantize(blocks[e], scales[e], hf_name)
        err2 += float(np.sum((back.astype(np.float64) - w) ** 2))
        ref2 += float(np.sum(w.astype(np.float64) ** 2))
    errors[hf_name] = (err2 / ref2) ** 0.5 if ref2 else 0.0
    return {hf_name + "_blocks": torch.from_numpy(blocks), hf_name + "_scales": torch.from_numpy(scales)}


def write_tokenizer(enc, out: Path, cfg) -> str:
    """Our tiktoken BPE as transformers files (checked against tiktoken on probe text before they
    are kept) and, always, the original tiktoken files under out/tiktoken. Returns a status line."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from formats.tokenizer import save_tokenizer, special_tokens_by_id

    if enc.n_vocab > cfg.vocab_size:
        raise UserError(f"tokenizer: {enc.n_vocab} ids do not fit ModelConfig.vocab_size {cfg.vocab_size}")
    save_tokenizer(enc, out / "tiktoken")
    specials = special_tokens_by_id(enc)  # the converter numbers them consecutively after the ranks
    converter = TikTokenConverter(vocab_file=None, pattern=enc._pat_str, extra_special_tokens=specials)
    # Hand the ranks over in memory: no temp .tiktoken file, no tiktoken path cache involved.
    converter.load_tiktoken_bpe = lambda _: enc._mergeable_ranks
    tok = converter.converted()
    if getattr(enc, "normalization", None):     # a converted Hugging Face tokenizer's (formats/tokenizer_json.py)
        from tokenizers import normalizers
        tok.normalizer = getattr(normalizers, enc.normalization)()
    specials_ok = all(tok.token_to_id(s) == enc._special_tokens[s] for s in specials if s in enc._special_tokens)
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
    if getattr(enc, "chat_template", None):      # a Hugging Face tokenizer's own template, passed on
        (out / "chat_template.jinja").write_text(enc.chat_template)
        return ("transformers: tokenizer.json + tokenizer_config.json (AutoTokenizer) + its chat_template.jinja, "
                "tiktoken files in tiktoken/")
    if {"<|start|>", "<|message|>", "<|end|>"} <= set(enc._special_tokens):
        (out / "chat_template.jinja").write_text(HARMONY_CHAT_TEMPLATE)
        return ("transformers: tokenizer.json + tokenizer_config.json (AutoTokenizer) + harmony chat_template.jinja, "
                "tiktoken files in tiktoken/")
    return "transformers: tokenizer.json + tokenizer_config.json (AutoTokenizer), tiktoken files in tiktoken/"


# How every exported directory's README.md says to load it (here and formats/transformers_export.py).
LOADING = """```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")   # if tokenizer.json is present
```"""

README = """# {name}

A torchlyra checkpoint (step {step}) exported as a Hugging Face transformers `GptOssForCausalLM`
({dtype}, {n_params:,} parameters{moe}).

{loading}

- Weights: {weights}.
- Tokenizer: {tokenizer}.
  The original tiktoken BPE (when the checkpoint named one) is in `tiktoken/`: rebuild it with
  `formats.tokenizer.load_tokenizer("tiktoken")`, or with `tiktoken.Encoding` from the ranks file,
  pattern and special tokens listed in `tiktoken/tokenizer.json`.
- Exactness: transformers' eager attention in float32 matches torchlyra's eager model (test suite:
  relative error of the logits <= 1e-5).{dense_note}
"""


def export_checkpoint(checkpoint_dir, out_dir, *, dtype: str = "float32", shard_size_bytes: int = DEFAULT_SHARD_BYTES,
                      overwrite: bool = False, progress: bool = False) -> dict:
    """Write `out_dir` as a transformers GptOss model directory, streamed one tensor at a time
    from the checkpoint; dtype "mxfp4" writes gpt-oss's released layout. Returns a summary
    (with "quantization_error": relative error per MXFP4 tensor)."""
    check_export_options(dtype, shard_size_bytes)
    cfg, meta, params = checkpoint.iter_params(checkpoint_dir)
    if not isinstance(cfg, checkpoint.ModelConfig):
        kind = "module" if hasattr(cfg, "facts") else "transformers"
        raise UserError(f"checkpoint {checkpoint_dir} holds a {kind} model ({cfg.model_type}), not our GPT-OSS: "
                        f"formats.{kind}_export writes it (`torchlyra export`)")
    return write_hf_dir(cfg, params, out_dir, step=meta.get("step", 0), enc=checkpoint_encoding(checkpoint_dir, meta),
                        dtype=dtype, shard_size_bytes=shard_size_bytes, overwrite=overwrite, progress=progress)


def weights_line(files: list[str]) -> str:
    """The README's description of the weight files ShardWriter.close named."""
    if len(files) == 1:
        return f"`{files[0]}`"
    return f"{len(files) - 1} shards `model-*-of-*.safetensors`, listed in `{INDEX_FILE}`"


def checkpoint_encoding(checkpoint_dir, meta):
    """The tiktoken Encoding the checkpoint's metadata names, or None."""
    tok_dir = checkpoint.tokenizer_dir(checkpoint_dir, meta)
    if tok_dir is None:
        return None
    from formats.tokenizer import load_tokenizer
    return load_tokenizer(tok_dir)


def check_export_options(dtype: str, shard_size_bytes: int) -> None:
    if dtype not in DTYPES:
        raise UserError(f"--dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
    if shard_size_bytes <= 0:
        raise UserError(f"--shard-size: expected a positive size, found {shard_size_bytes}")


def write_hf_dir(cfg, params, out_dir, *, step: int = 0, enc=None, dtype: str = "float32",
                 shard_size_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, progress: bool = False,
                 note: str = "") -> dict:
    """Write `out_dir` from `params`, an iterable of (our per-layer name, float32 numpy array)
    covering the model (a checkpoint streamed, or a model in memory such as a merged LoRA);
    `note` is appended to the README. Returns the summary export_checkpoint returns."""
    check_export_options(dtype, shard_size_bytes)
    quantized = dtype == "mxfp4"
    if quantized:
        width = cfg.expert_dim if cfg.is_moe else cfg.dense_dim
        for field, size in (("d_model", cfg.d_model), ("expert_dim" if cfg.is_moe else "dense_dim", width)):
            if size % mxfp4.BLOCK:
                raise UserError(f"--dtype mxfp4: ModelConfig.{field} must be a multiple of {mxfp4.BLOCK}, found {size}")
    extra = {"quantization_config": MXFP4_CONFIG} if quantized else {}
    hf_cfg = hf_mapping.build_hf_config(cfg, dtype="bfloat16" if quantized else dtype, **extra)

    from transformers import GenerationConfig
    errors: dict[str, float] = {}
    n_params = 0
    with staged_dir(out_dir, replace="always" if overwrite else "never") as tmp:
        hf_cfg.save_pretrained(tmp)
        GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id).save_pretrained(tmp)
        writer = ShardWriter(tmp, shard_size_bytes)
        for name, value in tqdm(params, total=len(hf_mapping.hf_shapes(cfg)), desc="export", disable=not progress):
            for hf_name, t in hf_mapping.to_hf_state({name: torch.from_numpy(value)}, cfg).items():
                n_params += t.numel()
                written = released_tensors(hf_name, t, errors) if quantized else {hf_name: t.to(DTYPES[dtype])}
                for stored_name, stored in written.items():
                    writer.add(stored_name, stored)
            del value
        files = writer.close()
        tokenizer = write_tokenizer(enc, tmp, cfg) if enc else "none: the checkpoint's config.json names no tokenizer"
        if quantized:
            (tmp / "mxfp4_error.json").write_text(json.dumps(
                {"rule": "OCP MX: scale 2**(floor(log2(block amax)) - 2), round to nearest even, saturating",
                 "relative_error": errors}, indent=1) + "\n")
        (tmp / "README.md").write_text(README.format(
            name=Path(out_dir).name, step=step, dtype=dtype, n_params=n_params,
            moe=f", {cfg.n_experts} experts top-{cfg.experts_per_token}" if cfg.is_moe else ", dense MLP",
            loading=LOADING.format(name=Path(out_dir).name), weights=weights_line(files), tokenizer=tokenizer,
            dense_note=" The dense MLP is stored as a one-expert MoE with a zero router (exactly equal)."
            if not cfg.is_moe else "") + (MXFP4_NOTE if quantized else "") + note)
    return {"out": str(out_dir), "step": step, "dtype": dtype, "files": files,
            "n_tensors": len(writer.weight_map) or len(hf_mapping.hf_shapes(cfg)), "n_params": n_params,
            "tokenizer": tokenizer, "quantization_error": errors}


MXFP4_NOTE = """
MXFP4 (as gpt-oss is released): expert weights are `*_blocks` + `*_scales` (OCP Microscaling
FP4: blocks of 32, shared power-of-two scale, round to nearest even), everything else bfloat16.
On a CPU, load with `quantization_config=Mxfp4Config(dequantize=True)`. The relative error of
each quantized tensor is in `mxfp4_error.json`.
"""


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory written by `torchlyra train`")
    parser.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="dtype of the written weights; mxfp4: gpt-oss's released layout (MXFP4 experts, bf16 rest)")
    parser.add_argument("--shard-size", default="2GB", help="largest safetensors file before sharding (e.g. 2GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")


def run(args, export=None) -> int:
    """Export and print what was written; `export` (default: export_checkpoint) is the writer of
    the checkpoint's kind (formats/export_cli.py chooses it)."""
    summary = (export or export_checkpoint)(args.checkpoint, args.out, dtype=args.dtype,
                                            shard_size_bytes=parse_size(args.shard_size),
                                            overwrite=args.overwrite, progress=True)
    files = summary["files"]
    weights = files[0] if len(files) == 1 else f"{len(files) - 1} shards + {INDEX_FILE}"
    print(f"exported step {summary['step']} ({summary['n_params']:,} parameters, {summary['dtype']}) to "
          f"{summary['out']}: {weights}")
    print(f"tokenizer: {summary['tokenizer']}")
    errors = summary["quantization_error"]
    if errors:
        worst = max(errors, key=errors.get)
        print(f"MXFP4 relative error per tensor (mxfp4_error.json): mean {sum(errors.values()) / len(errors):.4f}, "
              f"worst {errors[worst]:.4f} ({worst})")
    return 0
