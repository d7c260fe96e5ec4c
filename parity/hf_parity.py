"""Logits of our eager torch model vs transformers' GptOssForCausalLM on the same tokens.

transformers runs with eager attention and eager experts in float32: its reference paths, the
ones our layout was checked against. Used by `torchlyra parity --hf` and the tests.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from formats import hf_mapping
from torch_model.config import ModelConfig


def quantized_load(hf_dir) -> dict:
    """from_pretrained arguments for an MXFP4 directory on a CPU: dequantize while loading (a
    plain load needs a GPU kernel and `accelerate`); none for an unquantized one."""
    from transformers import Mxfp4Config

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    return {"quantization_config": Mxfp4Config(dequantize=True)} if config.get("quantization_config") else {}


def _hf_model(cfg: ModelConfig, state: dict[str, torch.Tensor], hf_dir=None):
    from transformers import GptOssForCausalLM

    impl = dict(attn_implementation="eager", experts_implementation="eager")
    if hf_dir is not None:      # what was written to disk, read the way users will read it
        return GptOssForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **impl, **quantized_load(hf_dir)).eval()
    model = GptOssForCausalLM(hf_mapping.build_hf_config(cfg, **impl)).eval()
    hf_state = {k: v.float() for k, v in hf_mapping.to_hf_state(state, cfg).items()}
    model.load_state_dict(hf_state, strict=True)
    return model


@torch.no_grad()
def compare_with_transformers(model_cfg: ModelConfig, state_dict: dict[str, torch.Tensor], tokens, *,
                              hf_dir=None) -> dict:
    """Run both models on `tokens` ([B, T] or [T] ids) and report
    max_abs_err, rel_err = ||ours - hf|| / ||hf|| (float64), top1_agreement (fraction of
    positions whose argmax agrees). With hf_dir, transformers loads that exported directory;
    otherwise it is built in memory from the same mapping the exporter uses."""
    from torch_model.model import GptOssForCausalLM

    ids = torch.as_tensor(tokens, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    ours = GptOssForCausalLM(model_cfg).eval()
    ours.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    a = ours(ids).double()
    hf = _hf_model(model_cfg, state_dict, hf_dir)
    b = hf(input_ids=ids, use_cache=False).logits.double()
    diff = a - b
    return {
        "max_abs_err": float(diff.abs().max()),
        "rel_err": float(diff.norm() / b.norm().clamp(min=1e-300)),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
        "n_tokens": int(ids.numel()), "shape": list(ids.shape),
        "attn_implementation": "eager", "experts_implementation": "eager", "dtype": "float32",
    }
