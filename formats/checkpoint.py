"""The one checkpoint format (version 2) and its one loader.

A checkpoints directory (`RUN/checkpoints`) is an Orbax `CheckpointManager` directory: one
directory per step, written asynchronously to `<step>.orbax-checkpoint-tmp` and renamed when
complete (atomic finalize), the last K kept. Each step directory holds these Orbax items:
  state/      the weights {"params": {name: array}} (and a --freeze run's "frozen"; float32, or
              bfloat16 from `torchlyra import`, written one tensor at a time by `params_writer`),
              saved and restored through shardings;
  optimizer/  a training run's {"opt_state": {...}}, apart from the weights so that a reader of
              the weights (generate, eval, export, --init-from) neither reads nor hashes it (steps
              written before keep "opt_state" inside state/, and read as they are);
  meta/       JSON: format, version, step, contents, layout, model config, train config,
              kernels, tokenizer reference, loader state, counters;
  tokenizer/  the tokenizer files (`formats.tokenizer.save_tokenizer`);
and, written after Orbax's rename, `torchlyra_manifest.json` (formats/checkpoint_integrity.py):
size and checksum of every file. A step is complete only when its manifest verifies.

`load_checkpoint(path)` serves generate / export / parity / eval: it accepts a run directory,
a checkpoints directory (newest complete step) or one step directory (or a Hugging Face GptOss
directory, read through formats/hf_model.py) and returns the per-layer torch state_dict (float32)
whatever `layout` the parameters are stored in (`LAYOUTS`); `checkpoint_tokenizer` its tokenizer;
`iter_params(path)` gives the same tensors one stored tensor at a time (export streams them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from torch_model.config import ModelConfig
from formats.atomic import staged_dir
from formats.checkpoint_integrity import (CheckpointDamaged, fault_while_saving, hooked_temporary_path, verify_manifest,
                                        write_manifest)
from formats.errors import UserError
from formats.jsonfile import read_json
from formats.model_checks import check_tensors, config_from_dict, model_shapes  # noqa: F401 (also this module's API)

FORMAT, VERSION = "torchlyra-checkpoint", 2
STATE, META, TOKENIZER, OPTIMIZER = "state", "meta", "tokenizer", "optimizer"
DAMAGED_DIR = "damaged"                  # damaged steps are moved here (not a step name for Orbax)
TRAIN_STATE, PARAMS_ONLY = "train_state", "params"
# State groups holding parameters: trained ones, and a --freeze run's frozen ones (a LoRA run
# stores no frozen group: its base is referenced, formats/lora_checkpoint.py).
PARAM_GROUPS = ("params", "frozen")
LORA_META = "lora"      # meta key of a LoRA checkpoint: its spec and base reference (formats/lora_checkpoint.py)


def is_lora_meta(meta: dict) -> bool:
    """Whether checkpoint metadata is a LoRA checkpoint's (adapters and a base reference)."""
    return isinstance(meta.get(LORA_META), dict)


def _orbax():
    """orbax.checkpoint, with its absl log lines (e.g. about per-item metadata files it does not
    write) kept to errors: the messages that matter here are ours."""
    import absl.logging
    import orbax.checkpoint as ocp

    absl.logging.set_verbosity(absl.logging.ERROR)
    return ocp


# ---- layouts: stored parameters -> per-layer torch names --------------------------------------
def _per_layer(params: dict, cfg: ModelConfig) -> dict:
    return params


def _stacked(tag: str):
    def unstack(params: dict, cfg: ModelConfig) -> dict:
        from jax_bridge.layer_stack import LayerLayout

        return LayerLayout.from_tag(tag, cfg).unstack(params)
    return unstack


# layout tag -> function(stored params, model record) -> {per-layer torch name: array}. "stacked"
# and "grouped": the scanned layers' parameters with a leading layer axis, one period over every
# layer or one scan per run of identical layers (jax_bridge/layer_stack.py).
LAYOUTS: dict[str, Callable[[dict, ModelConfig], dict]] = {"per_layer": _per_layer, "stacked": _stacked("stacked"),
                                                          "grouped": _stacked("grouped")}


class NoCheckpoint(UserError):
    """A checkpoints directory holds no step at all."""


def _flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


# ---- the tokenizer item ----------------------------------------------------------------------
def _tokenizer_item():
    """(save args class, restore args class) of an Orbax item holding the tokenizer's files."""
    ocp = _orbax()

    global _TOKENIZER_ARGS
    if _TOKENIZER_ARGS is not None:
        return _TOKENIZER_ARGS

    class TokenizerHandler(ocp.handlers.CheckpointHandler):
        def save(self, directory, args):
            import jax

            from formats.tokenizer import save_tokenizer
            if jax.process_index() == 0:        # one writer for the shared files, as Orbax's JSON item
                Path(directory).mkdir(parents=True, exist_ok=True)
                save_tokenizer(args.encoding, Path(directory))

        def restore(self, directory, args=None):
            from formats.tokenizer import load_tokenizer
            return load_tokenizer(Path(directory))

        def metadata(self, directory):
            return None

    @ocp.args.register_with_handler(TokenizerHandler, for_save=True)
    @dataclasses.dataclass
    class TokenizerSave(ocp.args.CheckpointArgs):
        encoding: object

    @ocp.args.register_with_handler(TokenizerHandler, for_restore=True)
    @dataclasses.dataclass
    class TokenizerRestore(ocp.args.CheckpointArgs):
        pass

    _TOKENIZER_ARGS = (TokenizerSave, TokenizerRestore)
    return _TOKENIZER_ARGS


_TOKENIZER_ARGS = None


# ---- writing ----------------------------------------------------------------------------------
@dataclasses.dataclass
class SaveRecord:
    step: int
    blocking_s: float                 # time save() held the caller
    total_s: float | None = None      # until the manifest was written
    bytes: int | None = None


class CheckpointWriter:
    """Periodic checkpoints of a run into `root`: asynchronous, atomic, the last `keep` kept.
    Every process of a multi-host run calls save() (Orbax writes each process's shards); the
    manifest is written by the primary process after Orbax's rename."""

    def __init__(self, root: str | os.PathLike, *, keep: int, compress: bool = False):
        ocp = _orbax()

        self.root = Path(root).absolute()      # Orbax (tensorstore) refuses relative paths
        self.root.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True, create=True,
            temporary_path_class=hooked_temporary_path(self._step_written))
        # Arrays stored uncompressed (as params_writer stores them): zstd saved 4% of a float32
        # model's bytes, 10% of its optimizer state's (the 0.57 B Llama's step: 4.29 GB, raw 4.63),
        # and made every read decode whole chunks (a stacked tensor is one chunk); raw, a reader
        # copies just its slice out of the mapped files (formats/checkpoint_weights.py).
        # compress: zstd, as checkpoints were written before (tests read such ones).
        handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
        handlers.add(STATE, ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler(use_compression=compress))
        handlers.add(OPTIMIZER, ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler(use_compression=compress))
        handlers.add(META, ocp.args.JsonSave)
        handlers.add(TOKENIZER, _tokenizer_item()[0])
        self._manager = ocp.CheckpointManager(self.root, options=options, handler_registry=handlers)
        self.records: list[SaveRecord] = []
        self._started: dict[int, float] = {}

    def _step_written(self, final: Path) -> None:
        size = write_manifest(final)
        record = next((r for r in self.records if r.step == int(final.name)), None)
        if record is not None:
            record.total_s, record.bytes = time.perf_counter() - self._started[record.step], size

    def save(self, step: int, state: dict, meta: dict, tokenizer=None) -> SaveRecord:
        """Start writing `state` (a pytree of jax arrays) with JSON `meta`; returns once the
        arrays are copied off the devices, so the caller may donate them to the next step."""
        ocp = _orbax()

        weights = {k: v for k, v in state.items() if k != "opt_state"}
        items = {STATE: ocp.args.PyTreeSave(weights),
                 META: ocp.args.JsonSave(_meta(step, meta, state, tokenizer))}
        if "opt_state" in state:
            items[OPTIMIZER] = ocp.args.PyTreeSave({"opt_state": state["opt_state"]})
        if tokenizer is not None:
            items[TOKENIZER] = _tokenizer_item()[0](tokenizer)
        start = time.perf_counter()
        self._started[step] = start
        fault_while_saving(step)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        record = SaveRecord(step, time.perf_counter() - start)
        self.records.append(record)
        return record

    def wait(self) -> None:
        """Block until the last save is complete (manifest written)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _meta(step: int, meta: dict, state: dict, tokenizer) -> dict:
    reserved = {"format", "version", "step", "contents"}
    clash = reserved & set(meta)
    if clash:
        raise ValueError(f"checkpoint meta may not set reserved key(s) {sorted(clash)}")
    out = {"format": FORMAT, "version": VERSION, "step": int(step),
           "contents": TRAIN_STATE if "opt_state" in state else PARAMS_ONLY, "layout": "per_layer", **meta}
    if tokenizer is not None:
        out["tokenizer"] = {"dir": TOKENIZER, "name": tokenizer.name}
    return out


def save_checkpoint(dir: str | os.PathLike, model_state: dict[str, torch.Tensor], model_cfg: ModelConfig, *,
                    step: int = 0, extra: dict | None = None, tokenizer=None, overwrite: bool | None = None) -> Path:
    """Write a parameters-only checkpoint (what `torchlyra import` makes; `--init-from` starts a
    run from it) as a checkpoints directory holding one step. The whole directory is published
    atomically. overwrite=None replaces an existing checkpoint and refuses any other non-empty
    directory; True replaces anything, False nothing."""
    import jax

    check_tensors({k: tuple(v.shape) for k, v in model_state.items()}, model_shapes(model_cfg),
                  f"save_checkpoint({dir})")
    params = {k: jax.numpy.asarray(v.detach().to("cpu", torch.float32).numpy()) for k, v in model_state.items()}
    meta = {"model": model_cfg.to_dict(), **(extra or {})}
    policy = _holds_checkpoint if overwrite is None else ("always" if overwrite else "never")
    with staged_dir(dir, replace=policy) as tmp:
        writer = CheckpointWriter(tmp, keep=1)
        writer.save(step, {"params": params}, meta, tokenizer)
        writer.close()
    return Path(dir)


STORED_DTYPES = ("float32", "bfloat16")    # a parameters-only checkpoint may keep bf16 sources


@contextlib.contextmanager
def params_writer(dir: str | os.PathLike, model_cfg: ModelConfig, *, step: int = 0, extra: dict | None = None,
                  tokenizer=None, overwrite: bool | None = None):
    """Write a parameters-only checkpoint one tensor at a time: yields `add(name, array)`; each
    array goes to disk (an Orbax partial save) before the next is made, so host memory holds one
    tensor, never the model. Float32 or bfloat16 arrays (kept as given; loaders widen to float32).
    Names and shapes are checked against the model config, and the directory is published only
    when complete (overwrite as in save_checkpoint)."""
    from orbax.checkpoint.experimental import v1 as ocp_v1
    from orbax.checkpoint.experimental.v1 import partial

    _orbax()
    expected, found = model_shapes(model_cfg), {}
    policy = _holds_checkpoint if overwrite is None else ("always" if overwrite else "never")
    with staged_dir(dir, replace=policy) as tmp:
        step_dir = tmp.absolute() / str(step)

        def add(name: str, array) -> None:
            array = np.asarray(array)
            if name in found:
                raise ValueError(f"params_writer: tensor {name} added twice")
            if str(array.dtype) not in STORED_DTYPES:
                raise ValueError(f"params_writer: tensor {name} has dtype {array.dtype}, expected {STORED_DTYPES}")
            found[name] = tuple(array.shape)
            # The save is synchronous, so Orbax need not guard the array with a copy of its own;
            # uncompressed, tensorstore writes straight from it, where zstd would first buffer the
            # whole encoded tensor (measured: +1x the tensor's size in anonymous memory).
            options = ocp_v1.options
            with ocp_v1.Context(memory_options=options.MemoryOptions(deepcopy_host_arrays=False),
                                array_options=options.ArrayOptions(saving=options.ArrayOptions.Saving(
                                    use_compression=False))):
                partial.save(step_dir, {"params": {name: array}})

        yield add
        check_tensors(found, expected, f"{dir}")
        partial.finalize(step_dir)
        if not (step_dir / STATE).is_dir():
            raise RuntimeError(f"Orbax's partial save wrote no {STATE}/ item in {step_dir}")
        meta = _meta(step, {"model": model_cfg.to_dict(), **(extra or {})}, {"params": found}, tokenizer)
        (step_dir / META).mkdir()
        (step_dir / META / "metadata").write_text(json.dumps(meta))
        if tokenizer is not None:
            from formats.tokenizer import save_tokenizer
            save_tokenizer(tokenizer, step_dir / TOKENIZER)
        write_manifest(step_dir)


def _holds_checkpoint(path: Path) -> bool:
    try:
        return bool(step_dirs(path)) or _is_step_dir(path)
    except UserError:
        return False


# ---- locating and verifying ---------------------------------------------------------------
def _is_step_dir(path: Path) -> bool:
    return (path / META).is_dir() and (path / STATE).is_dir()


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every finalized step directory under `root`, oldest first."""
    return sorted((int(p.name), p) for p in Path(root).iterdir() if p.is_dir() and p.name.isdigit())


def checkpoints_root(path: str | os.PathLike) -> Path | None:
    """The checkpoints directory named by `path` (a run directory or the directory itself), or
    None when `path` is one step directory. UserError for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: checkpoint directory not found")
    if _is_step_dir(path):
        return None
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if any(p.name.isdigit() or p.name == DAMAGED_DIR or ".orbax-checkpoint-tmp" in p.name for p in path.iterdir()):
        return path
    config = path / "config.json"
    if config.is_file():
        found = read_json(config)
        if isinstance(found, dict) and found.get("format") == FORMAT:
            raise UserError(f"{path}: a version-{found.get('version')} torchlyra checkpoint (model.safetensors + "
                            f"config.json), a format this version no longer reads; expected version {VERSION} "
                            f"(Orbax step directories). Retrain, or export it to Hugging Face with the torchlyra "
                            f"that wrote it and bring it back with `torchlyra import`")
        if isinstance(found, dict) and "model_type" in found:
            raise UserError(f"{path}: a Hugging Face model directory, not a torchlyra checkpoint; convert it "
                            f"with `torchlyra import --hf {path} --out DIR`")
    raise UserError(f"{path}: no torchlyra checkpoint here (expected a run directory, its checkpoints/ "
                    f"directory, or one step directory holding {STATE}/ and {META}/)")


def move_aside(step_dir: Path) -> Path:
    """Move a damaged step out of Orbax's sight (so the step can be saved again); returns where."""
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    dest = step_dir.parent / DAMAGED_DIR / f"step-{step_dir.name}-{stamp}"
    dest.parent.mkdir(exist_ok=True)
    os.rename(step_dir, dest)
    return dest


def find_checkpoint(path: str | os.PathLike, *, move_damaged: bool = False, resume: bool = False,
                    report: Callable[[str], None] | None = None) -> Path:
    """The newest complete, verified step directory named by `path`. Damaged or incomplete newer
    steps are reported in one line each (and moved aside when `move_damaged`: only the run that
    owns the directory should) and the previous step is used. A step directory named directly
    must verify itself. Every file is hashed for a `resume`; any other reader reads the weights
    only, and the optimizer state's files are checked for presence and size, not hashed."""
    report = report or (lambda line: print(line, file=sys.stderr))
    unhashed = None if resume else OPTIMIZER
    root = checkpoints_root(path)
    if root is None:
        verify_manifest(Path(path), unhashed)
        return Path(path)
    steps = step_dirs(root)
    if not steps:
        raise NoCheckpoint(f"{root}: holds no checkpoint")
    problems = []
    for _, step_dir in reversed(steps):
        try:
            verify_manifest(step_dir, unhashed)
            return step_dir
        except CheckpointDamaged as e:
            problems.append(str(e))
            where = f"; moved to {move_aside(step_dir)}" if move_damaged else ""
            report(f"warning: {e}{where}; trying the previous checkpoint")
    raise UserError(f"{root}: no complete checkpoint ({problems[0]}" + (f"; {len(problems) - 1} older ones too"
                    if len(problems) > 1 else "") + "). Restore the directory from a copy, or start a new run "
                    "(another --out, or --init-from a parameters checkpoint)")


def read_meta(step_dir: Path) -> tuple[dict, ModelConfig]:
    """(meta, its ModelConfig) of one step directory, validated."""
    path = step_dir / META / "metadata"
    if not path.is_file():
        raise CheckpointDamaged(f"checkpoint {step_dir}: {META}/metadata is missing")
    meta = read_json(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise UserError(f"{path}: field 'format' expected {FORMAT!r}, found {found!r}")
    if meta.get("version") != VERSION:
        raise UserError(f"{path}: field 'version' expected {VERSION}, found {meta.get('version')!r}")
    if not isinstance(meta.get("step"), int):
        raise UserError(f"{path}: field 'step' expected an integer, found {meta.get('step')!r}")
    if meta.get("layout") not in LAYOUTS:
        raise UserError(f"{path}: field 'layout' is {meta.get('layout')!r}; this version reads {sorted(LAYOUTS)}")
    meta["step_dir"] = str(step_dir.resolve())
    return meta, config_from_dict(meta.get("model"), f"{path} field 'model'")


# ---- restoring ----------------------------------------------------------------------------------
def stored_shapes(step_dir: Path) -> dict[tuple, tuple[tuple[int, ...], str]]:
    """Flattened path -> (shape, dtype) of every array of the step's weights and optimizer state
    (no data read)."""
    ocp = _orbax()

    out = {}
    for item in (STATE, OPTIMIZER):
        if item == STATE or (Path(step_dir) / item).is_dir():
            meta = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(Path(step_dir).absolute() / item)
            tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
            out.update({k: (tuple(v.shape), str(v.dtype)) for k, v in _flatten(dict(tree)).items()})
    return out


def _check_target(step_dir: Path, stored: dict, target: dict) -> None:
    """Refuse a restore whose target differs from what is stored, naming the tensors."""
    def names(flat):
        return {"/".join(map(str, k)): tuple(v) for k, v in flat.items()}

    found = names({k: s for k, (s, _) in stored.items() if k[0] in {t[0] for t in target}})
    check_tensors(found, names(target), f"checkpoint {step_dir}")


def restore_train_state(step_dir: str | os.PathLike, target: dict, *, layout: str = "per_layer") -> dict:
    """Restore {"params", "opt_state"} onto `target`, a matching pytree of jax arrays or
    `jax.ShapeDtypeStruct`s whose `.sharding` says where each array goes (any mesh: Orbax reads
    only each device's shards)."""
    import jax
    ocp = _orbax()

    step_dir = Path(step_dir)
    meta, _ = read_meta(step_dir)
    if meta.get("contents") != TRAIN_STATE:
        raise UserError(f"checkpoint {step_dir} holds parameters only (contents={meta.get('contents')!r}): "
                        f"start a new run from it with --init-from, not --resume")
    if meta["layout"] != layout:
        raise UserError(f"checkpoint {step_dir} stores layout {meta['layout']!r}, this run uses {layout!r}")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), target)
    _check_target(step_dir, stored_shapes(step_dir), {k: v.shape for k, v in _flatten(abstract).items()})
    restore = lambda item, tree: ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(  # noqa: E731
        step_dir.absolute() / item, args=ocp.args.StandardRestore(tree))
    if not (step_dir / OPTIMIZER).is_dir():              # written before the optimizer item: one item
        return restore(STATE, abstract)
    weights = restore(STATE, {k: v for k, v in abstract.items() if k != "opt_state"})
    return {**weights, **restore(OPTIMIZER, {"opt_state": abstract["opt_state"]})}


def restore_params_to_host(step_dir: Path, stored: dict) -> dict[str, np.ndarray]:
    """The parameters among `stored` (stored_shapes entries) as host arrays: the trained ones
    ("params") and a --freeze run's frozen ones ("frozen"), in one dict."""
    ocp = _orbax()

    groups = {g: [k[1] for k in stored if k[0] == g] for g in PARAM_GROUPS}
    groups = {g: names for g, names in groups.items() if names}
    item = {g: {n: np.zeros(0, np.float32) for n in names} for g, names in groups.items()}
    restore_args = {g: {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names} for g, names in groups.items()}
    restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
        step_dir.absolute() / STATE, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                                 partial_restore=True))
    return {n: v for g in groups for n, v in restored[g].items()}


def refuse_transformers_model(record, where: str) -> None:
    """One line for a reader of our GPT-OSS checkpoints only (the measurement scripts that call
    `load_checkpoint` without `transformers_ok`) given a `train --model-config` run's model."""
    if not isinstance(record, ModelConfig):
        raise UserError(f"{where} holds a transformers {record.model_type} model; this reads our GPT-OSS "
                        f"checkpoints only (every torchlyra command takes both)")


def open_checked(path, transformers_ok: bool = False):
    """(step_dir, meta, model record, stored shapes and dtypes, "checkpoint DIR") of the newest
    complete checkpoint named by `path`, every stored parameter's dtype checked. The record is a
    ModelConfig, or with `transformers_ok` also a transformers model's TransformersSpec (every
    command; `refuse_transformers_model` otherwise)."""
    step_dir = find_checkpoint(path)
    meta, cfg = read_meta(step_dir)
    stored = stored_shapes(step_dir)
    where = f"checkpoint {step_dir}"
    if is_lora_meta(meta):
        raise UserError(f"{where} holds LoRA adapters of the base {meta['lora']['base']['path']}, not a whole model: "
                        f"load it with formats.lora_checkpoint.load_lora_model")
    if not transformers_ok:
        refuse_transformers_model(cfg, where)
    for key, (_, dtype) in stored.items():
        if key[0] in PARAM_GROUPS and dtype not in STORED_DTYPES:
            raise UserError(f"{where}: tensor {key[-1]} has dtype {dtype}, expected one of {', '.join(STORED_DTYPES)}")
    return step_dir, meta, cfg, stored, where


def iter_params(path: str | os.PathLike):
    """(model record, meta, iterator of (per-layer torch name, float32 numpy array)) of the newest
    complete checkpoint named by `path`, restoring one stored tensor at a time: host memory holds
    one stored tensor (for the stacked layout, one parameter of all layers), never the model. The
    record is a ModelConfig or, for a `train --model-config` run, a TransformersSpec."""
    step_dir, meta, cfg, stored, where = open_checked(path, transformers_ok=True)
    names = {k: v for k, v in stored.items() if k[0] in PARAM_GROUPS}
    # Names and shapes checked before any data is read: zero-stride placeholders hold no memory.
    placeholders = {k[1]: np.broadcast_to(np.float32(0), shape) for k, (shape, _) in names.items()}
    check_tensors({k: v.shape for k, v in LAYOUTS[meta["layout"]](placeholders, cfg).items()}, model_shapes(cfg), where)

    def tensors():
        for key, (shape, dtype) in names.items():
            one = restore_params_to_host(step_dir, {key: (shape, dtype)})
            for torch_name, value in LAYOUTS[meta["layout"]](one, cfg).items():
                yield torch_name, np.asarray(value, dtype=np.float32)

    return cfg, {k: v for k, v in meta.items() if k != "model"}, tensors()


def load_checkpoint(path: str | os.PathLike, *, transformers_ok: bool = False) -> tuple[dict[str, torch.Tensor],
                                                                                         ModelConfig, dict]:
    """(state_dict with per-layer torch names, model record, meta) of the newest complete
    checkpoint named by `path` (run directory, checkpoints directory or step directory), or of
    a Hugging Face directory (step 0, meta "hf_dir" set): gpt-oss as released (MXFP4 dequantized
    on the host, or unquantized), or with `transformers_ok` another family's
    (formats/transformers_import.py). meta holds everything but "model", plus "step_dir" (where
    it was read from). The record is a ModelConfig, or with `transformers_ok` also a
    TransformersSpec."""
    from formats.hf_model import is_hf_dir, load_hf
    from formats.transformers_import import is_transformers_dir, load_transformers_dir, read_spec

    if is_transformers_dir(path):
        if not transformers_ok:
            refuse_transformers_model(read_spec(path), f"Hugging Face directory {path}")
        return load_transformers_dir(path)
    if is_hf_dir(path):
        return load_hf(path)
    step_dir, meta, cfg, stored, where = open_checked(path, transformers_ok)
    params = LAYOUTS[meta["layout"]](restore_params_to_host(step_dir, stored), cfg)
    check_tensors({k: tuple(v.shape) for k, v in params.items()}, model_shapes(cfg), where)
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in params.items()}
    return state, cfg, {k: v for k, v in meta.items() if k != "model"}


def tokenizer_dir(checkpoint_dir: str | os.PathLike, meta: dict) -> Path | None:
    """The tokenizer directory of the checkpoint `meta` was read from (None if it has none)."""
    ref = meta.get("tokenizer") or {}
    if ref.get("dir") is None:
        return None
    base = Path(meta["step_dir"]) if "step_dir" in meta else Path(checkpoint_dir)
    return (base / ref["dir"]).resolve()


def checkpoint_tokenizer(checkpoint_dir: str | os.PathLike, meta: dict):
    """(tiktoken Encoding or None, one line saying which) of the checkpoint `meta` was read from:
    ours from its tokenizer item; a Hugging Face directory's when recognised (o200k_harmony, or a
    torchlyra export's tiktoken/: formats/hf_tokenizer.py)."""
    if meta.get("hf_dir"):
        from formats.hf_tokenizer import recognize
        return recognize(Path(meta["hf_dir"]))
    tok_dir = tokenizer_dir(checkpoint_dir, meta)
    if tok_dir is None:
        return None, "its metadata names no tokenizer (field tokenizer.dir)"
    from formats.tokenizer import load_tokenizer
    enc = load_tokenizer(tok_dir)
    return enc, f"{enc.name} (from {tok_dir})"
