"""A model's expert stacks as an MXFP4 base and back: each `Experts` module (bf16/float32
stacks) replaced in place by an `Mxfp4Experts` holding the export's quantization of its weights
(formats/mxfp4.py, the layout gpt-oss is released in), or the reverse, decoding exactly. The
stacks' values after a round trip are the decoded ones: quantizing is where precision is lost."""
from __future__ import annotations

import numpy as np
import torch

from formats import mxfp4
from torch_model.model import Experts, Mxfp4Experts


def _quantized(stack: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] float -> (bytes [E, out, in/2], scale bytes [E, out, in/32]): the released
    orientation, blocked along the input."""
    values = stack.detach().float().transpose(1, 2).contiguous().numpy()
    blocks, scales = mxfp4.quantize(values, where)
    return torch.from_numpy(blocks.reshape(*blocks.shape[:-2], -1)), torch.from_numpy(scales)


def _decoded(blocks: torch.Tensor, scales: torch.Tensor, where: str) -> torch.Tensor:
    """The inverse: [E, out, in/2] bytes and [E, out, in/32] scales -> float32 [E, in, out]."""
    b = blocks.numpy()
    values = mxfp4.dequantize(b.reshape(*b.shape[:-1], -1, mxfp4.BLOCK // 2), scales.numpy(), where)
    return torch.from_numpy(np.ascontiguousarray(np.swapaxes(values, 1, 2)))


def _replace(model: torch.nn.Module, kind: type, build) -> int:
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, child_name, build(child, f"{name}.{child_name}" if name else child_name))
                count += 1
    return count


def quantize_experts(model: torch.nn.Module) -> int:
    """Every `Experts` of the model -> an `Mxfp4Experts` base (frozen); returns how many."""
    def build(experts: Experts, where: str) -> Mxfp4Experts:
        out = Mxfp4Experts(model.cfg)
        with torch.no_grad():
            for stack in ("gate_up_proj", "down_proj"):
                blocks, scales = _quantized(getattr(experts, stack), f"{where}.{stack}")
                getattr(out, f"{stack}_blocks").copy_(blocks)
                getattr(out, f"{stack}_scales").copy_(scales)
                getattr(out, f"{stack}_bias").copy_(getattr(experts, f"{stack}_bias").float())
        return out
    return _replace(model, Experts, build)


def dequantize_experts(model: torch.nn.Module, *, trainable: bool = False) -> int:
    """Every `Mxfp4Experts` -> an `Experts` holding the exact decoded values (float32), frozen
    unless `trainable`; returns how many."""
    def build(quantized: Mxfp4Experts, where: str) -> Experts:
        out = Experts(model.cfg)
        with torch.no_grad():
            for stack in ("gate_up_proj", "down_proj"):
                getattr(out, stack).copy_(_decoded(getattr(quantized, f"{stack}_blocks"),
                                                   getattr(quantized, f"{stack}_scales"), f"{where}.{stack}"))
                getattr(out, f"{stack}_bias").copy_(getattr(quantized, f"{stack}_bias"))
        out.requires_grad_(trainable)
        return out
    return _replace(model, Mxfp4Experts, build)
