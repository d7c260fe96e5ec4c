"""A transformers directory of a family other than gpt-oss (Llama, Qwen3, Qwen3-MoE, ... as released
in bf16/fp32 safetensors, or as `torchlyra export` writes them) read as a model record and weights,
the counterpart of formats/transformers_export.py.

The record is the directory's own config.json (a `TransformersSpec`, less what only describes the
files); the weights are loaded by transformers' own `from_pretrained`, so every renaming a family's
released layout needs (Qwen3-MoE's per-expert tensors fused into one stack, ...) is transformers'
own and nothing here names a family. The load is strict: a tensor missing, unexpected or of
another shape is an error that names it. The whole model is held on the host in float32, as every
command that loads one of our checkpoints whole does; `--init-from` and `import` of a directory
whose tensors are stored under the model's own names and shapes (Llama, Qwen3), or whose layout
transformers converts by moving tensors only (Qwen3-MoE), stream it instead (`open_streamed`):
each device's slice read onto the mesh, as gpt-oss directories are read (formats/init_from_hf.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from formats.errors import UserError
from formats.jsonfile import read_json
from torch_model.transformers_lm import ATTENTION, TransformersSpec, register_interfaces

GPT_OSS = "gpt_oss"     # released gpt-oss directories have their own reader (formats/hf_model.py)
# config.json fields that describe the files or the hub, not the model.
FILE_FIELDS = ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache")


def is_transformers_dir(path) -> bool:
    """A directory whose config.json names a model_type other than gpt-oss."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    found = read_json(config)
    return isinstance(found, dict) and isinstance(found.get("model_type"), str) and found["model_type"] != GPT_OSS


def read_spec(hf_dir) -> TransformersSpec:
    """The directory's model record, built (on the meta device) and checked as `--model-config`
    checks one; quantized weights and custom modeling code are refused by field."""
    path = Path(hf_dir) / "config.json"
    config = read_json(path)
    for field, why in (("quantization_config", "quantized weights (this path reads bf16, fp16 or fp32 safetensors)"),
                       ("auto_map", "custom modeling code (transformers' own families only)")):
        if config.get(field):
            raise UserError(f"{path}: field '{field}': {why}")
    spec = TransformersSpec({k: v for k, v in config.items() if k not in FILE_FIELDS}, str(path))
    spec.structure()
    return spec


def open_streamed(hf_dir):
    """(TransformersSpec, weights) of a directory whose tensors can be read slice by slice as the
    model's own (`read(name, index)`, `entries`): stored under the model's names and shapes
    (Llama, Qwen3), or in a layout transformers converts by moving tensors only (Qwen3-MoE's
    per-expert tensors fused into stacks: formats/transformers_conversion.py). `--init-from` then
    reads each device's slice onto the mesh and `import` one tensor at a time. None when the
    conversion is not one of those: the directory then loads whole (`load_transformers_dir`)."""
    from formats.hf_weights import HFWeights
    from formats.model_checks import model_shapes
    from formats.transformers_conversion import ConvertedWeights, conversion_rules, converted_names

    spec = read_spec(hf_dir)
    weights = HFWeights(hf_dir, quantized=False)
    expected = model_shapes(spec)
    if {name: tuple(entry.shape) for name, entry in weights.entries.items()} == expected:
        return spec, weights
    rules = conversion_rules(spec.config["model_type"])
    if not rules:
        return None
    view = ConvertedWeights(weights, converted_names(list(weights.entries), rules))
    return (spec, view) if {name: tuple(e.shape) for name, e in view.entries.items()} == expected else None


def load_transformers_dir(hf_dir) -> tuple[dict[str, torch.Tensor], TransformersSpec, dict]:
    """(float32 state_dict under the transformers model's own parameter names, a tied head's weight
    once; its TransformersSpec; meta as the checkpoint loader gives it: step 0, "step_dir",
    "hf_dir", "imported_from")."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from formats.hf_model import hf_meta
    from formats.hf_weights import HFWeights

    hf_dir = Path(hf_dir).resolve()
    spec = read_spec(hf_dir)
    meta = hf_meta(hf_dir, HFWeights(hf_dir, quantized=False))      # the shard headers, checked
    register_interfaces()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()        # its load report: what it lists is refused below, by name
    try:
        model, info = AutoModelForCausalLM.from_pretrained(hf_dir, config=spec.hf_config(), dtype=torch.float32,
                                                           attn_implementation=ATTENTION,
                                                           experts_implementation=ATTENTION, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{hf_dir}: transformers cannot load these weights: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    problems = [(kind, sorted(map(str, info.get(kind) or []))) for kind in ("missing_keys", "unexpected_keys",
                                                                             "mismatched_keys")]
    problems = [(kind, names) for kind, names in problems if names]
    if problems:
        kind, names = problems[0]
        raise UserError(f"{hf_dir}: {kind.replace('_', ' ')} against its config.json: {', '.join(names[:3])}"
                        + (f" (and {len(names) - 3} more)" if len(names) > 3 else ""))
    state = {name: p.detach() for name, p in model.named_parameters()}
    return state, spec, meta
