"""`torchlyra export` of a transformers model trained here (`train --model-config`): the family's
own Hugging Face directory, which `AutoModelForCausalLM.from_pretrained` loads.

The checkpoint's parameters carry the transformers model's own names; transformers 5 keeps some
families' weights fused in memory (Qwen3-MoE's experts as one [E, 2I, H] stack) and saves them in
the layout their released checkpoints use (one tensor per expert). That renaming is transformers'
own (`revert_weight_conversion`, what `save_pretrained` calls), applied here tensor by tensor as
the checkpoint streams, so no family is named and host memory holds one stored tensor and one
shard, never the model. Written into a hidden directory and renamed at the end, as every export.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from formats import checkpoint
from formats.atomic import staged_dir
from formats.errors import UserError
from formats.hf_export import (DTYPES, LOADING, ShardWriter, check_export_options, checkpoint_encoding, weights_line,
                               write_tokenizer)

README = """# {name}

A torchlyra checkpoint (step {step}) of a transformers `{architecture}` trained with
`torchlyra train --model-config`, exported in transformers' own layout ({dtype}, {n_params:,}
parameters).

{loading}

- Weights: {weights}.
- Tokenizer: {tokenizer}.
- Exactness: transformers' eager attention and experts in float32 give torchlyra's logits
  (test suite: relative error <= 1e-5).
"""


def holds_transformers_model(checkpoint_dir) -> bool:
    """Whether the checkpoint named by `checkpoint_dir` is of a `train --model-config` run."""
    _, record = checkpoint.read_meta(checkpoint.find_checkpoint(checkpoint_dir))
    return not isinstance(record, checkpoint.ModelConfig)


def export_checkpoint(checkpoint_dir, out_dir, *, dtype: str = "float32", shard_size_bytes: int,
                      overwrite: bool = False, progress: bool = False) -> dict:
    """Write `out_dir` as the family's own Hugging Face directory, streamed one stored tensor at a
    time from the checkpoint of a `train --model-config` run."""
    spec, meta, params = checkpoint.iter_params(checkpoint_dir)
    return write_transformers_dir(spec, params, out_dir, n_tensors=len(checkpoint.model_shapes(spec)),
                                  step=meta.get("step", 0), enc=checkpoint_encoding(checkpoint_dir, meta), dtype=dtype,
                                  shard_size_bytes=shard_size_bytes, overwrite=overwrite, progress=progress)


def hf_model_on_meta(spec):
    """The family's own `*ForCausalLM` on the meta device (no weights, default kernels): what
    transformers' save-time renaming reads its conversions from."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(spec.hf_config())


def saved_tensors(hf_model, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One parameter (its in-memory transformers name) -> the tensors transformers' save_pretrained
    writes for it (renamed, split per expert, ...), or itself when the family converts nothing."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf_model, {name: value})


def write_transformers_dir(spec, params, out_dir, *, n_tensors: int, step: int = 0, enc=None,
                           dtype: str = "float32", shard_size_bytes: int, overwrite: bool = False,
                           progress: bool = False, note: str = "") -> dict:
    """Write `out_dir` from `params`, an iterable of (in-memory transformers name, float32 numpy
    array) covering the model (a tied head's weight is the embedding's and is not among them);
    `note` is appended to the README. Returns the summary `hf_export.export_checkpoint` returns."""
    from transformers import GenerationConfig

    check_export_options(dtype, shard_size_bytes)
    if dtype == "mxfp4":
        raise UserError("--dtype mxfp4: the MXFP4 layout is gpt-oss's release format; a transformers "
                        f"{spec.config['model_type']} model exports as float32 or bfloat16")
    hf_model = hf_model_on_meta(spec)
    hf_cfg = hf_model.config
    hf_cfg.dtype, hf_cfg.architectures = dtype, [type(hf_model).__name__]
    n_params = 0
    with staged_dir(out_dir, replace="always" if overwrite else "never") as tmp:
        hf_cfg.save_pretrained(tmp)
        GenerationConfig(bos_token_id=hf_cfg.bos_token_id, eos_token_id=hf_cfg.eos_token_id).save_pretrained(tmp)
        writer = ShardWriter(tmp, shard_size_bytes)
        for name, value in tqdm(params, total=n_tensors, desc="export", disable=not progress):
            tensor = torch.from_numpy(np.ascontiguousarray(value))
            n_params += tensor.numel()
            for saved_name, saved in saved_tensors(hf_model, name, tensor).items():
                writer.add(saved_name, saved.to(DTYPES[dtype]))
            del value, tensor
        files = writer.close()
        tokenizer = (write_tokenizer(enc, tmp, hf_cfg) if enc
                     else "none: the checkpoint's metadata names no tokenizer")
        (tmp / "README.md").write_text(README.format(
            name=Path(out_dir).name, step=step, architecture=hf_cfg.architectures[0], dtype=dtype, n_params=n_params,
            loading=LOADING.format(name=Path(out_dir).name), weights=weights_line(files), tokenizer=tokenizer) + note)
    return {"out": str(out_dir), "step": step, "dtype": dtype, "files": files,
            "n_tensors": len(writer.weight_map) or n_tensors, "n_params": n_params,
            "tokenizer": tokenizer, "quantization_error": {}}
