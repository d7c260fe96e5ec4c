"""Tuned kernel tiles: the best tile options per (op, implementation, call shape) on one device
kind, as `torchlyra bench kernels --tune` measured them there, and their lookup when a traced call
of that shape is bound (`--kernel-options TABLE.json`, see `registry.parse_kernel_options`).

A table is JSON:
    {"format": "torchlyra-kernel-tiles", "version": 1, "platform": "tpu", "device_kind": "TPU v6e",
     "entries": {op: {implementation: {call key: {"options": {...}, "seconds": s}}}}}
A call key names the shapes that decide a kernel's tiles (see `call_key`), so a table serves
every run whose per-device calls have those shapes. Tiles change the speed, not the result
beyond float rounding; a call whose key is not in the table runs its default tiles, and says so
once.
"""
from __future__ import annotations

import json
import sys
from typing import Any

FORMAT = "torchlyra-kernel-tiles"
VERSION = 1
TUNED = "tuned"          # the key under which a table's entries travel in the nested kernel options


class TileTableError(ValueError):
    """A tile table that cannot be used: names the file, the field, what was expected and found."""


def _dims(shape) -> str:
    return "x".join(str(int(d)) for d in shape)


def call_key(op: str, args: tuple, kwargs: dict) -> str | None:
    """The shapes that decide `op`'s tiles, from the arguments of one call (arrays or
    ShapeDtypeStructs; per device under a mesh); None for an op that takes no tiles."""
    import jax.numpy as jnp

    if op == "attention":
        q, k = args[0], args[1]
        return f"q={_dims(q.shape)} kv_heads={k.shape[1]} window={int(kwargs['sliding_window'])} " \
               f"dtype={jnp.dtype(q.dtype).name}"
    if op == "cross_entropy":
        hidden, weight = args[0], args[1]
        return f"hidden={_dims(hidden.shape)} vocab={weight.shape[0]} dtype={jnp.dtype(hidden.dtype).name}"
    if op == "moe":
        x, gate_up = args[0], args[2]
        return f"rows={_dims(x.shape)} experts={gate_up.shape[0]} inner={gate_up.shape[2] // 2} " \
               f"dtype={jnp.dtype(x.dtype).name}"
    return None


def new_table(platform: str, device_kind: str) -> dict:
    return {"format": FORMAT, "version": VERSION, "platform": platform, "device_kind": device_kind, "entries": {}}


def add_entry(table: dict, op: str, implementation: str, key: str, options: dict, seconds: float) -> None:
    table["entries"].setdefault(op, {}).setdefault(implementation, {})[key] = {"options": dict(options),
                                                                               "seconds": float(seconds)}


def read(path: str) -> dict:
    """The table at `path`, checked field by field (TileTableError naming the file and field)."""
    try:
        with open(path) as fh:
            table = json.load(fh)
    except OSError as e:
        raise TileTableError(f"kernel tiles {path}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise TileTableError(f"kernel tiles {path}: not JSON ({e.msg} at line {e.lineno})") from None
    expect = {"format": FORMAT, "version": VERSION}
    if not isinstance(table, dict):
        raise TileTableError(f"kernel tiles {path}: expected an object, found {type(table).__name__}")
    for field, value in expect.items():
        if table.get(field) != value:
            raise TileTableError(f"kernel tiles {path}: field {field!r} must be {value!r}, found {table.get(field)!r}")
    for field in ("platform", "device_kind"):
        if not isinstance(table.get(field), str):
            raise TileTableError(f"kernel tiles {path}: field {field!r} must be a string, found {table.get(field)!r}")
    entries = table.get("entries")
    if not isinstance(entries, dict):
        raise TileTableError(f"kernel tiles {path}: field 'entries' must be an object, found {entries!r}")
    for op, per_impl in entries.items():
        if not isinstance(per_impl, dict):
            raise TileTableError(f"kernel tiles {path}: entries.{op} must map implementations to their entries")
        for impl, per_key in per_impl.items():
            if not isinstance(per_key, dict) or not all(
                    isinstance(e, dict) and isinstance(e.get("options"), dict) for e in per_key.values()):
                raise TileTableError(f"kernel tiles {path}: entries.{op}.{impl} must map call keys to "
                                     f"{{\"options\": {{...}}, \"seconds\": s}}")
    return table


def tuned_options(table: dict, path: str) -> dict[str, dict[str, dict[str, Any]]]:
    """{op: {implementation: {TUNED: the table's entries for it, with where they come from}}}: the
    shape of `registry.parse_kernel_options`' result, so tuned and explicit options merge there."""
    return {op: {impl: {TUNED: {"path": path, "platform": table["platform"],
                                "device_kind": table["device_kind"], "entries": per_key}}
                 for impl, per_key in per_impl.items()}
            for op, per_impl in table["entries"].items()}


_REPORTED: set = set()


def options_for(op: str, implementation: str, tuned: dict, key: str | None) -> dict:
    """The tuned options of this call's key, or {} (said once per key on stderr: default tiles)."""
    entry = tuned["entries"].get(key) if key is not None else None
    if entry is not None:
        return dict(entry["options"])
    if (tuned["path"], op, implementation, key) not in _REPORTED:
        _REPORTED.add((tuned["path"], op, implementation, key))
        print(f"kernel tiles: {tuned['path']} has no entry for {op}={implementation} at {key}; "
              f"its default tiles run", file=sys.stderr, flush=True)
    return {}
