"""The tensors a ModelConfig implies (names and shapes, from the model built on `meta`), the check
that a set of tensors matches them, and a ModelConfig read from JSON: shared by the checkpoint
loader and the Hugging Face mapping, kept apart so neither imports the other."""
from __future__ import annotations

import torch

from torch_model.config import ConfigError, ModelConfig
from formats.errors import UserError


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in our model's state_dict, taken from the model itself
    (built on the meta device: no memory, so it works for any preset)."""
    from torch_model.model import GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


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


def config_from_dict(d, where: str) -> ModelConfig:
    """ModelConfig from a JSON object, with errors as UserError naming the field."""
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected an object of ModelConfig fields, found {type(d).__name__}")
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as e:
        raise UserError(f"{where}: {e}") from None
    except TypeError as e:   # e.g. a value of the wrong type reaching arithmetic in __post_init__
        raise UserError(f"{where}: {e}") from None
