"""The tensors a model record implies (names and shapes, from the model built on `meta`), the check
that a set of tensors matches them, a record read from JSON and the model built from it: shared by
the checkpoint loader and the Hugging Face mapping, kept apart so neither imports the other. A
record is our ModelConfig, a transformers model's TransformersSpec (torch_model/transformers_lm.py)
or a plain module's ModuleSpec (torch_model/module_lm.py)."""
from __future__ import annotations

import contextlib

import torch

from torch_model.config import ConfigError, ModelConfig
from torch_model.module_lm import ModuleSpec
from torch_model.transformers_lm import TransformersSpec
from formats.errors import UserError

# A module run's record names the SPEC that built it; a command given `--module` builds that
# instead (a run made from a module instance in Python records none, a run taken to another
# machine may find its file elsewhere), and `train_module` hands the module itself:
# take_module_from sets either for the process.
_module_given: tuple[str, dict | None] | torch.nn.Module | None = None


RUNS_MODULE = ("a module run's code, path/to/file.py:NAME or package.module:NAME, where it is not where the run "
               "recorded it (another machine; a run made from Python records none) (default: the run's)")


def add_module_arguments(parser, help: str = RUNS_MODULE, args_default: str = "the run's",  # noqa: A002
                         group=None) -> None:
    """--module SPEC (in `group`, e.g. a command's mutually exclusive sources, else `parser`) and
    --module-args JSON: `help` says what the module is for the command (by default, as for the
    commands that read a checkpoint: where a module run's code is)."""
    from formats.jsonfile import json_object

    (group or parser).add_argument("--module", metavar="SPEC", default=None, help=help)
    parser.add_argument("--module-args", type=json_object, default=None, metavar="JSON",
                        help=f"with --module: the keyword arguments of NAME, a JSON object (default: {args_default})")


def take_module_from_args(args) -> None:
    """What add_module_arguments parsed, taken (take_module_from)."""
    if getattr(args, "module_args", None) and not getattr(args, "module", None):
        raise UserError("--module-args: the keyword arguments of --module; give --module")
    take_module_from(getattr(args, "module", None), getattr(args, "module_args", None))


def take_module_from(spec, args: dict | None = None) -> None:
    """Build a module run's model from `spec` (and `args`, default the run's) instead of the
    SPEC its record names, or from `spec` itself when it is an nn.Module; None: the record's."""
    global _module_given
    _module_given = spec if isinstance(spec, torch.nn.Module) else (spec, args) if spec else None


def given_module() -> torch.nn.Module | None:
    """The module instance take_module_from was given (train_module's), or None."""
    return _module_given if isinstance(_module_given, torch.nn.Module) else None


def build_model(cfg, *, meta: bool = False):
    """The torch model a record names, with fresh weights: our decoder for a ModelConfig, the
    transformers model for a TransformersSpec, the module behind the boundary for a ModuleSpec.
    `meta`: its parameters on the `meta` device, for a loader to fill (formats/mesh_loader.py);
    buffers, which checkpoints do not hold, computed."""
    if isinstance(cfg, TransformersSpec):
        return cfg.build(meta=meta)
    if isinstance(cfg, ModuleSpec):
        return build_module_model(cfg, meta=meta)
    from torch_model.model import GptOssForCausalLM

    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GptOssForCausalLM(cfg)
    if meta and any(True for _ in model.buffers()):
        raise ValueError("build_model(meta=True): GptOssForCausalLM gained buffers; compute them here")
    return model


def load_weights(model, state: dict) -> None:
    """Load `state` (the model's named_parameters names, as checkpoints store them: a tied weight
    once) into `model`, strictly: a tied head's other name is filled with the weight it shares,
    and a persistent buffer (which checkpoints do not hold) keeps the value the model computed."""
    owner = {id(p): n for n, p in model.named_parameters()}
    buffers = {id(b) for b in model.buffers()}
    full = dict(state)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in full and owner.get(id(tensor)) in state:
            full[name] = state[owner[id(tensor)]]
        elif name not in full and id(tensor) in buffers:
            full[name] = tensor.detach()
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


def build_module_model(record: ModuleSpec, *, meta: bool = False, new_run: bool = False):
    """A module record's model: its SPEC (or the one `take_module_from` gave) called with its
    arguments, probed and wrapped (jax_bridge/module_probe.py). The module must still have the
    facts the record holds; `new_run`: the record is a new run's (`module_record`), whose facts the
    model's own replace (the blocks checked on its weights)."""
    from jax_bridge.distributed import say
    from jax_bridge.module_probe import build_record, wrap
    from torch_model.module_lm import source_hash

    if given_module() is not None:
        return wrap(given_module(), max_seq_len=record.max_seq_len, recorded=None if new_run else record.facts,
                    where="the module given", bos_token_id=record.bos_token_id, eos_token_id=record.eos_token_id)
    spec, args = record.spec, record.args
    if _module_given is not None:
        spec, args = _module_given[0], record.args if _module_given[1] is None else _module_given[1]
    if not spec:
        raise UserError("this run's model is a module given from Python: name its code with --module "
                        "path/to/file.py:NAME (and --module-args, if it takes arguments)")
    if not new_run and record.source and spec == record.spec and source_hash(spec) != record.source:
        say(f"--module {spec}: its source changed since the run recorded it (the recorded facts are checked)")
    return build_record(record, meta=meta, new_run=new_run, spec=spec, args=args)


def module_record(spec: str | None, args: dict, max_seq_len: int) -> ModuleSpec:
    """A new run's record of the module SPEC builds from `args` (probed on `meta`: no weights), or
    (spec None) of the module take_module_from was given, which records no SPEC."""
    from jax_bridge.module_probe import probe
    from torch_model.module_lm import instantiate, source_hash

    if spec is None:
        return ModuleSpec(None, {}, None, probe(given_module()), max_seq_len)
    facts = probe(instantiate(spec, args, meta=True))
    return ModuleSpec(spec, args, source_hash(spec), facts, max_seq_len)


def config_from_dict(d, where: str):
    """ModelConfig from a JSON object, with errors as UserError naming the field; a
    transformers model's record ({"transformers": config}) gives its TransformersSpec, a
    module's ({"module": ...}) its ModuleSpec."""
    if TransformersSpec.is_spec_dict(d):
        return TransformersSpec.from_dict(d, where)
    if ModuleSpec.is_spec_dict(d):
        return ModuleSpec.from_dict(d, where)
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected an object of ModelConfig fields, found {type(d).__name__}")
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as e:
        raise UserError(f"{where}: {e}") from None
    except TypeError as e:   # e.g. a value of the wrong type reaching arithmetic in __post_init__
        raise UserError(f"{where}: {e}") from None
