"""A model's expert stacks as an MXFP4 base: a released gpt-oss directory's model with its experts'
bytes as stored, nothing decoded (`meta_released_base` and `ReleasedBytes`, the loader's source,
read by slice; `released_base`, whole on the host), or each `Experts` module
of a model replaced in place by an `Mxfp4Experts` holding the export's quantization of its weights
(formats/mxfp4.py), and the reverse, decoding exactly (tests compare a base with its decoding).
Quantizing is where precision is lost; decoding loses nothing."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from formats import mxfp4
from formats.errors import UserError
from formats.hf_weights import HFWeights
from torch_model.model import Experts, GptOssForCausalLM, Mxfp4Experts, mxfp4_expert_modules, replace_modules

_PACKED = ("_blocks", "_scales")


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
    return replace_modules(model, Experts, build)


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
    return replace_modules(model, Mxfp4Experts, build)


@dataclasses.dataclass(frozen=True)
class PackedEntry:
    """One MXFP4 stack's stored bytes as an `Mxfp4Experts` holds them: `<stack>_blocks`
    [E, out, in/2] or `<stack>_scales` [E, out, in/32], uint8."""
    name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape)


class ReleasedBytes:
    """A released gpt-oss directory as the parameters of its MXFP4 base, a source for the one
    loader (formats/mesh_loader.py): the expert stacks as their stored bytes, read by slice and
    never decoded; every other tensor as `HFWeights` reads it."""

    def __init__(self, weights: HFWeights):
        self.weights, self.dir, self.entries = weights, weights.dir, {}
        for name, entry in weights.entries.items():
            if not entry.quantized:
                self.entries[name] = entry
                continue
            experts, inputs, outputs = entry.shape
            for suffix, width in (("_blocks", inputs // 2), ("_scales", inputs // mxfp4.BLOCK)):
                self.entries[name + suffix] = PackedEntry(name + suffix, (experts, outputs, width))

    @property
    def bytes_requested(self) -> int:
        return self.weights.bytes_requested

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        if isinstance(self.entries[name], PackedEntry):
            return self.weights.read_stored_bytes(name, index)
        return self.weights.read(name, index)


def meta_released_base(model_cfg, weights: HFWeights) -> tuple[GptOssForCausalLM, ReleasedBytes]:
    """The model of a released gpt-oss directory with its experts as an MXFP4 base, on the
    `meta` device, and the source its parameters are placed from (each device's block of the
    stored bytes: no process holds the base, nothing is decoded). Every parameter is frozen;
    LoRA adapters are added by the caller."""
    with torch.device("meta"):
        model = GptOssForCausalLM(model_cfg)
        mxfp4_expert_modules(model)
    _check_packed(model, weights)
    model.requires_grad_(False)
    return model, ReleasedBytes(weights)


def _check_packed(model, weights: HFWeights) -> None:
    """Every expert stack of `model` is stored MXFP4 in `weights`, or one line says which is not."""
    stacks = sorted({n.rsplit("_", 1)[0] for n, _ in model.named_parameters() if n.endswith(_PACKED)})
    dense = [n for n in stacks if n not in weights.entries or not weights.entries[n].quantized]
    if dense:
        raise UserError(f"--base-dtype mxfp4: {weights.dir} holds expert weight {dense[0]} "
                        f"{'unquantized' if dense[0] in weights.entries else 'nowhere'}; "
                        f"{MXFP4_BASE_REFUSAL}, or use the base as it is (--base-dtype compute)")


def released_base(model_cfg, weights: HFWeights) -> GptOssForCausalLM:
    """The model of a released gpt-oss directory (`weights`) with its experts as an MXFP4 base,
    whole on the host (where an eager model is needed: `--merge`, `eval --scorer eager`): the
    expert stacks' stored bytes copied as they are, every other tensor read in float32 (the
    step casts it to the compute dtype). Built on the meta device first, so no dense expert
    stack (random or decoded) is ever allocated on the host. Every parameter is left frozen
    except what the caller trains (LoRA adapters are added afterwards)."""
    return _on_host(*meta_released_base(model_cfg, weights))


def _on_host(model, source: ReleasedBytes) -> GptOssForCausalLM:
    """The `meta` model of `meta_released_base` filled on the host from its source, each tensor
    read once (the expert stacks' bytes as stored, the rest in float32)."""
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = source.read(name)
            if not name.endswith(_PACKED):
                value = np.asarray(value, np.float32)
            if tuple(value.shape) != tuple(p.shape):
                raise UserError(f"{source.dir}: tensor {name} has shape {list(value.shape)}, the model needs "
                                f"{list(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(value)))
            p.requires_grad_(False)
    return model


MXFP4_BASE_REFUSAL = ("an MXFP4 base is read from gpt-oss's released layout, not quantized on load (that would "
                      "change the base's values); write that layout first (`torchlyra export --dtype mxfp4`)")


def check_released(path, where: str) -> None:
    """An MXFP4 base is read only from a released gpt-oss directory: refuse anything else, naming why."""
    from formats.init_from_hf import is_gpt_oss_dir

    if not is_gpt_oss_dir(path):
        raise UserError(f"{where}: --base-dtype mxfp4: {path} is not a gpt-oss directory in the released layout; "
                        f"{MXFP4_BASE_REFUSAL}")


def open_released_base(path, where: str, model_cfg=None) -> tuple[GptOssForCausalLM, dict, ReleasedBytes]:
    """(model on `meta`, meta, source) of a released gpt-oss directory for inference with its
    experts kept MXFP4 (`--base-dtype mxfp4`; `meta_released_base`), eval mode; meta as the
    checkpoint loader gives a Hugging Face directory's. model_cfg: the record to build (a LoRA
    run's: its tokenizer's special ids and length), which must have the directory's shapes;
    default the directory's own. Any other checkpoint is refused, naming why."""
    from formats.hf_model import hf_meta, open_hf

    check_released(path, where)
    cfg, weights = open_hf(path)
    if model_cfg is not None:
        from formats.model_checks import check_tensors, model_shapes

        check_tensors(model_shapes(model_cfg), model_shapes(cfg), f"{where} against {path}")
        cfg = model_cfg
    model, source = meta_released_base(cfg, weights)
    return model.eval(), hf_meta(path, weights, base_dtype="mxfp4"), source


def load_released_base(path, where: str, model_cfg=None) -> tuple[GptOssForCausalLM, dict]:
    """(model, meta) as `open_released_base`, the model whole on the host (`released_base`)."""
    model, meta, source = open_released_base(path, where, model_cfg)
    return _on_host(model, source).eval(), meta
