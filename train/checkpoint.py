"""Training checkpoints: one directory, published atomically.

Layout: `model.safetensors` (our state_dict names, float32) and `config.json` =
{"format": "torchlyra-checkpoint", "version": 1, "model": ModelConfig.to_dict(), "step": int,
 ...extra keys such as "kernels", "tokenizer": {"dir": path relative to the checkpoint}}.

A save writes a hidden temporary directory beside the target, fsyncs it, then swaps it in with
one rename, so a crash at any point leaves either the previous checkpoint or the new one.
One writer per target directory is assumed (process 0 of a run).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import tempfile
from pathlib import Path

import safetensors.torch
import torch

from torch_model.config import ConfigError, ModelConfig
from train.atomic import fsync_path
from train.errors import UserError
from train.jsonfile import read_json

FORMAT, VERSION = "torchlyra-checkpoint", 1
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
RESERVED = ("format", "version", "model", "step")


# ---- shapes and validation -----------------------------------------------------------------
def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in our model's state_dict, taken from the model itself
    (built on the meta device: no memory, so it works for any preset)."""
    from torch_model.model import GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_tensors(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """UserError naming the first missing, extra or wrongly shaped tensor (expected vs found)."""
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{where}: tensor {missing[0]} is missing (expected shape {list(expected[missing[0]])}){more}")
    extra = [n for n in found if n not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise UserError(f"{where}: unexpected tensor {extra[0]} of shape {list(found[extra[0]])}{more}; "
                        f"the model config has no such parameter")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise UserError(f"{where}: tensor {name} has shape {list(found[name])}, expected {list(shape)}")


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


# ---- atomic directory publication ----------------------------------------------------------
def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(Path(dirpath))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _publish(tmp: Path, target: Path) -> None:
    _fsync_tree(tmp)
    if not target.exists():
        os.rename(tmp, target)
    elif _exchange(tmp, target):
        shutil.rmtree(tmp)                      # tmp now holds the previous contents
    else:
        # No atomic swap on this filesystem: a short window where the old copy sits at .old-*.
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / "x")
        os.rename(tmp, target)
        shutil.rmtree(old)
    fsync_path(target.parent)


@contextlib.contextmanager
def staged_dir(target: str | os.PathLike, *, replace: str = "never"):
    """Yield a fresh hidden directory beside `target`; publish it as `target` on normal exit,
    remove it on any exception (nothing partial is ever left).

    replace: "never" refuses an existing non-empty target, "always" replaces it; a callable
    path -> bool decides (used to replace only a previous checkpoint)."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise UserError(f"{target}: expected a directory, found a file")
    if target.is_dir() and any(target.iterdir()):
        allowed = replace(target) if callable(replace) else replace == "always"
        if not allowed:
            hint = (" and holds no torchlyra checkpoint (refusing to replace it)" if callable(replace)
                    else " (pass --overwrite to replace it)")
            raise UserError(f"{target}: output directory exists and is not empty{hint}")
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):   # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)   # mkdtemp's 0700 would otherwise become the published mode
    try:
        yield tmp
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- save / load ---------------------------------------------------------------------------
def _is_checkpoint(path: Path) -> bool:
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_checkpoint(dir: str | os.PathLike, model_state: dict[str, torch.Tensor], model_cfg: ModelConfig, *,
                    step: int = 0, extra: dict | None = None, tokenizer=None, overwrite: bool | None = None) -> Path:
    """Write a checkpoint atomically. By default (overwrite=None) an existing checkpoint at `dir`
    is replaced and any other non-empty directory refused; True replaces anything, False nothing.
    `tokenizer` (a tiktoken Encoding) is saved inside the same atomic write and recorded as
    {"tokenizer": {"dir": "."}}."""
    extra = dict(extra or {})
    clash = [k for k in RESERVED if k in extra]
    if clash:
        raise ValueError(f"save_checkpoint: extra may not set reserved key(s) {clash}")
    check_tensors({k: tuple(v.shape) for k, v in model_state.items()}, model_shapes(model_cfg),
                  f"save_checkpoint({dir})")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model_state.items()}
    if tokenizer is not None:
        extra["tokenizer"] = {"dir": "."}
    config = {"format": FORMAT, "version": VERSION, "model": model_cfg.to_dict(), "step": int(step), **extra}
    policy = _is_checkpoint if overwrite is None else ("always" if overwrite else "never")
    with staged_dir(dir, replace=policy) as tmp:
        safetensors.torch.save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            from train.data.tokenizer import save_tokenizer
            save_tokenizer(tokenizer, tmp)
    return Path(dir)


def read_config(dir: str | os.PathLike) -> tuple[dict, ModelConfig]:
    """(config.json as a dict, its ModelConfig), validated; for callers that need no tensors."""
    dir = Path(dir)
    if not dir.is_dir():
        raise UserError(f"{dir}: checkpoint directory not found")
    path = dir / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{path}: expected a torchlyra checkpoint config, found no file")
    config = read_json(path)
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        hint = " (a Hugging Face model? use `torchlyra import`)" if isinstance(config, dict) and "model_type" in config else ""
        raise UserError(f"{path}: field 'format' expected {FORMAT!r}, found {found!r}{hint}")
    if config.get("version") != VERSION:
        raise UserError(f"{path}: field 'version' expected {VERSION}, found {config.get('version')!r}")
    if not isinstance(config.get("step", 0), int):
        raise UserError(f"{path}: field 'step' expected an integer, found {config.get('step')!r}")
    return config, config_from_dict(config.get("model"), f"{path} field 'model'")


def load_checkpoint(dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], ModelConfig, dict]:
    """(state_dict, ModelConfig, meta): meta is config.json without "model" (step, kernels,
    tokenizer, ...). Every tensor is checked against the config: names, shapes, float32."""
    config, cfg = read_config(dir)
    weights = Path(dir) / WEIGHTS_FILE
    if not weights.is_file():
        raise UserError(f"{weights}: expected the checkpoint's weights, found no file")
    try:
        state = safetensors.torch.load_file(str(weights))
    except Exception as e:   # safetensors raises its own error types for truncated/garbled files
        raise UserError(f"{weights}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    check_tensors({k: tuple(v.shape) for k, v in state.items()}, model_shapes(cfg), str(weights))
    for name, t in state.items():
        if t.dtype != torch.float32:
            raise UserError(f"{weights}: tensor {name} has dtype {t.dtype}, expected torch.float32")
    meta = {k: v for k, v in config.items() if k != "model"}
    meta.setdefault("step", 0)
    return state, cfg, meta


def tokenizer_dir(checkpoint_dir: str | os.PathLike, meta: dict) -> Path | None:
    """The tokenizer directory named by meta["tokenizer"]["dir"] (relative to the checkpoint)."""
    d = (meta.get("tokenizer") or {}).get("dir")
    return None if d is None else (Path(checkpoint_dir) / d).resolve()
