"""The tensors a model record implies (names and shapes, from the model built on `meta`), the check
that a set of tensors matches them, a record read from JSON and the model built from it: shared by
the checkpoint loader and the Hugging Face mapping, kept apart so neither imports the other. A
record is our ModelConfig or a transformers model's TransformersSpec (torch_model/transformers_lm.py)."""
from __future__ import annotations

import contextlib

import torch

from torch_model.config import ConfigError, ModelConfig
from torch_model.transformers_lm import TransformersSpec
from formats.errors import UserError


def build_model(cfg, *, meta: bool = False):
    """The torch model a record names, with fresh weights: our decoder for a ModelConfig, the
    transformers model for a TransformersSpec. `meta`: its parameters on the `meta` device, for a
    loader to fill (formats/mesh_loader.py); buffers, which checkpoints do not hold, computed."""
    if isinstance(cfg, TransformersSpec):
        return cfg.build(meta=meta)
    from torch_model.model import GptOssForCausalLM

    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GptOssForCausalLM(cfg)
    if meta and any(True for _ in model.buffers()):
        raise ValueError("build_model(meta=True): GptOssForCausalLM gained buffers; compute them here")
    return model


def load_weights(model, state: dict) -> None:
    """Load `state` (the model's named_parameters names, as checkpoints store them: a tied weight
    once) into `model`, strictly: a tied head's other name is filled with the weight it shares."""
    owner = {id(p): n for n, p in model.named_parameters()}
    full = dict(state)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in full and owner.get(id(tensor)) in state:
            full[name] = state[owner[id(tensor)]]
    model.load_state_dict(full)


def model_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the model's state_dict, taken from the model itself
    (built on the meta device: no memory, so it works for any preset)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {name: tuple(t.shape) for name, t in model.named_parameters()}      # a tied head once


def check_tensors(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """UserError naming the missing, extra or wrongly shaped tensors (expected vs found)."""
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{where}: tensor {missing[0]} is missing (expected shape {list(expected[missing[0]])}){more}")
    extra = [n for n in found if n not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise UserError(f"{where}: unexpected tensor {extra[0]} of shape {list(found[extra[0]])}{more}; "
                        f"the model config has no such parameter")
    wrong = [n for n, shape in expected.items() if tuple(found[n]) != tuple(shape)]
    if wrong:
        listed = "; ".join(f"{n} has shape {list(found[n])}, expected {list(expected[n])}" for n in wrong[:3])
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise UserError(f"{where}: tensor {listed}{more}")


def config_from_dict(d, where: str):
    """ModelConfig from a JSON object, with errors as UserError naming the field; a
    transformers model's record ({"transformers": config}) gives its TransformersSpec."""
    if TransformersSpec.is_spec_dict(d):
        return TransformersSpec.from_dict(d, where)
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected an object of ModelConfig fields, found {type(d).__name__}")
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as e:
        raise UserError(f"{where}: {e}") from None
    except TypeError as e:   # e.g. a value of the wrong type reaching arithmetic in __post_init__
        raise UserError(f"{where}: {e}") from None
