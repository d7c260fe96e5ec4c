"""Tuned kernel tiles: the best tile options per (op, implementation, call shape) on one device
kind, as `torchlyra bench kernels --tune` measured them there, and their lookup when a traced call
of that shape is bound.

A table is JSON:
    {"format": "torchlyra-kernel-tiles", "version": 1, "platform": "tpu", "device_kind": "TPU v6e",
     "entries": {op: {implementation: {call key: {"options": {...}, "seconds": s}}}}}
A call key names the shapes that decide a kernel's tiles (see `call_key`), so a table serves
every run whose calls on each device have those shapes. Tiles change the speed, not the result
beyond float rounding.

Where tables come from (`with_tables`, the one place that decides):
  - committed, one per TPU generation (jax_bridge/tiles/GENERATION.json, tuned on that chip):
    taken by default by every program compiled for platform tpu and a known generation
    (StepConfig.tpu_generation, the Decoder's), never for another platform or generation;
  - given (`--kernel-options TABLE.json`, see `registry.parse_kernel_options`): replaces the
    committed table for the implementations it has entries for;
  - `--kernel-options tiles=off`: no committed table.
Options given explicitly (`op.implementation.option=value`) override a table's, option by
option. A call whose key is not in its table runs the kernel's default tiles and says so once on
stderr (and `untuned` lists it, for a run's summary): never silently. An attention call whose key
differs from an entry's in the batch alone runs that entry's tiles, also said once (`batch_neighbour`).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

FORMAT = "torchlyra-kernel-tiles"
VERSION = 1
TUNED = "tuned"          # the key under which a table's entries travel in the nested kernel options
# The committed tables, one per TPU generation: TABLES_DIR/GENERATION.json (package data).
TABLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiles")
# `--kernel-options tiles=off`: no committed table. Parsed kernel options carry it as
# {SWITCH: {"committed": False}} beside the ops (a dict, so code walking the ops passes it by).
SWITCH = "tiles"
OFF = "off"


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


def key_fields(key: str) -> dict[str, str]:
    """A call key's fields, as `call_key` wrote them: 'q=8x4x256x64 kv_heads=2 window=64
    dtype=float32' -> {'q': '8x4x256x64', 'kv_heads': '2', 'window': '64', 'dtype': 'float32'}."""
    fields = dict(part.split("=", 1) for part in key.split())
    if not fields or " ".join(f"{k}={v}" for k, v in fields.items()) != key:
        raise TileTableError(f"kernel tiles: {key!r} is not a call key (name=value fields separated by spaces)")
    return fields


def key_dims(text: str) -> tuple[int, ...]:
    """'8x4x256x64' -> (8, 4, 256, 64): a shape as a call key writes it."""
    return tuple(int(d) for d in text.split("x"))


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


# ---- the tables a program compiles with ------------------------------------------------------
def generation_of(device_kind: str) -> str | None:
    """'v5e', 'v6e', ... of a TPU device kind ('TPU v5 lite'); None for another device's."""
    from jax_bridge.tpu_compile import DEVICE_KINDS

    return DEVICE_KINDS.get(device_kind)


def committed_path(generation: str) -> str:
    return os.path.join(TABLES_DIR, f"{generation}.json")


def committed_generations() -> list[str]:
    """The TPU generations that have a committed table."""
    if not os.path.isdir(TABLES_DIR):
        return []
    return sorted(name[:-5] for name in os.listdir(TABLES_DIR) if name.endswith(".json"))


def read_committed(generation: str) -> dict | None:
    """The committed table of a TPU generation (None: there is none), refused when it was not
    tuned on that generation's chips."""
    path = committed_path(generation)
    if not os.path.exists(path):
        return None
    table = read(path)
    found = generation_of(table["device_kind"])
    if table["platform"] != "tpu" or found != generation:
        raise TileTableError(f"kernel tiles {path}: the table of {generation} holds tiles tuned on "
                             f"{table['device_kind']} ({table['platform']}); a committed table is tuned on its "
                             f"own generation's chips")
    return table


def committed_off(options: dict) -> bool:
    """Whether parsed kernel options say `tiles=off`."""
    return options.get(SWITCH, {}).get("committed", True) is False


def with_tables(options: dict, platform: str, generation: str | None) -> dict:
    """Parsed kernel options (`registry.parse_kernel_options`) with the committed table of the
    TPU `generation` compiled for under every implementation that has no table given (none off
    TPU, for an unknown generation, or after `tiles=off`). A TPU table given that was tuned on
    another generation is refused (TileTableError), as is a committed one."""
    for op, per_impl in options.items():
        for impl, opts in per_impl.items() if op != SWITCH else ():
            tuned = opts.get(TUNED)
            found = generation_of(tuned["device_kind"]) if tuned else None
            if platform == "tpu" and generation is not None and found is not None and found != generation:
                raise TileTableError(f"kernel tiles {tuned['path']} were tuned on {tuned['device_kind']} "
                                     f"({found}); this program compiles for a TPU {generation}")
    if platform != "tpu" or generation is None or committed_off(options):
        return options
    table = read_committed(generation)
    if table is None:
        return options
    out = {op: {impl: dict(opts) for impl, opts in per_impl.items()} for op, per_impl in options.items()}
    for op, per_impl in tuned_options(table, committed_path(generation)).items():
        for impl, opts in per_impl.items():
            out.setdefault(op, {}).setdefault(impl, {}).setdefault(TUNED, opts[TUNED])
    return out


def tables_in(options: dict) -> list[str]:
    """The paths of the tables in parsed kernel options."""
    return sorted({opts[TUNED]["path"] for op, per_impl in options.items() if op != SWITCH
                   for opts in per_impl.values() if opts.get(TUNED) and opts[TUNED]["path"]})


def probe_options(ops_impls, platform: str) -> dict:
    """Kernel options whose tables are empty probes (no path: silent) for these (op,
    implementation) pairs: under `recording`, each traced call's key is recorded."""
    probe = {"path": None, "platform": platform, "device_kind": "", "entries": {}}
    out: dict = {}
    for op, impl in ops_impls:
        out.setdefault(op, {})[impl] = {TUNED: probe}
    return out


# ---- lookups --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lookup:
    """One traced call's look-up in a table: options None when its key is not there."""
    op: str
    implementation: str
    key: str | None
    table: str | None
    options: dict | None


_RECORDERS: list[list] = []
_REPORTED: set = set()
_UNTUNED: list[Lookup] = []


@contextlib.contextmanager
def recording():
    """Within the block, every table look-up of a traced call is appended to the list it yields."""
    lookups: list[Lookup] = []
    _RECORDERS.append(lookups)
    try:
        yield lookups
    finally:
        _RECORDERS.remove(lookups)


def untuned(tables=None) -> list[dict]:
    """The calls (of this process) whose keys a table lacked, which ran their default tiles; only
    those of `tables` (paths) when given."""
    return [{"op": u.op, "implementation": u.implementation, "key": u.key, "table": u.table}
            for u in _UNTUNED if tables is None or u.table in tables]


def batch_neighbour(op: str, key: str | None, entries: dict) -> str | None:
    """For an attention call whose key the table lacks: the key of an entry that differs from it in
    the batch alone (q's first dimension), the nearest batch first (ties: the larger). The batch
    only lengthens the kernels' grid, whose tiles are chosen by sequence, heads, window and dtype,
    so an entry tuned at batch 8 serves batch 2. None for other ops (their row tiles divide the
    rows, which follow the batch) or when no such entry exists."""
    if op != "attention" or key is None:
        return None
    fields = key_fields(key)
    batch, *rest = key_dims(fields["q"])
    found = []
    for other in entries:
        theirs = key_fields(other)
        other_batch, *other_rest = key_dims(theirs["q"])
        if other_rest == rest and {**theirs, "q": ""} == {**fields, "q": ""}:
            found.append((abs(other_batch - batch), -other_batch, other))
    return min(found)[2] if found else None


def options_for(op: str, implementation: str, tuned: dict, key: str | None) -> dict:
    """The tuned options of this call's key; else those of its batch neighbour (said once per key
    on stderr); else {} (said once per key on stderr: default tiles)."""
    entries = tuned["entries"]
    entry = entries.get(key) if key is not None else None
    neighbour = batch_neighbour(op, key, entries) if entry is None else None
    if neighbour is not None:
        entry = entries[neighbour]
    options = dict(entry["options"]) if entry is not None else None
    lookup = Lookup(op, implementation, key, tuned["path"], options)
    for lookups in _RECORDERS:
        lookups.append(lookup)
    said = (tuned["path"], op, implementation, key)
    if tuned["path"] is None or (options is not None and neighbour is None) or said in _REPORTED:
        return options or {}
    _REPORTED.add(said)
    if options is not None:
        print(f"kernel tiles: {tuned['path']} has no entry for {op}={implementation} at {key}; the tiles tuned "
              f"at {neighbour} run (the batch does not choose them)", file=sys.stderr, flush=True)
        return options
    _UNTUNED.append(lookup)
    print(f"kernel tiles: {tuned['path']} has no entry for {op}={implementation} at {key}; "
          f"its default tiles run", file=sys.stderr, flush=True)
    return {}
