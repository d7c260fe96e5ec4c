"""The parameters of one of our checkpoints, read by slice: what `formats/hf_weights.py` is for a
Hugging Face directory. Every tensor is addressed by its per-layer torch name whatever layout the
checkpoint stores (`checkpoint.LAYOUTS`: a stacked tensor is read one layer at a time), and a
read asks tensorstore for the requested slice only, so a process reading its devices' blocks
never holds a tensor it does not own. Orbax writes each array as a zarr array in an OCDBT
database under `state/`, keyed `<group>.<stored name>`; we write them uncompressed, and a read
copies its slice straight out of the mapped files. Checkpoints written before are zstd-compressed,
a stacked tensor one chunk: there a read keeps what it decoded for the reads that follow (`read`).
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from formats import checkpoint
from formats.errors import UserError
from formats.hf_weights import Entry, normalize_index

# Stored dtypes as hf_weights' Entry names them (its `nbytes` prices them).
_ENTRY_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


class _StoredRef:
    """A stored tensor's name in place of its values: LayerLayout.unstack indexes a stacked one
    by layer, which here records (stored key, layer) instead of slicing data."""

    def __init__(self, key: tuple, layer: int | None = None):
        self.key, self.layer = key, layer

    def __getitem__(self, j: int) -> "_StoredRef":
        return _StoredRef(self.key, j)


class CheckpointWeights:
    """Per-layer name -> Entry of every parameter of a checkpoint step (the trained ones and a
    --freeze run's frozen ones), validated against the model record from the stored shapes alone;
    `read(name, index)` and `bytes_requested` as HFWeights has them; `reads`: the tensorstore
    reads issued. Every array is opened once, through one tensorstore context that maps the
    checkpoint's files instead of copying them."""

    def __init__(self, step_dir: Path, meta: dict, model_cfg, stored: dict):
        from jax_bridge.layer_stack import LayerLayout

        self.dir, self.bytes_requested, self.reads = Path(step_dir), 0, 0
        params = {k: v for k, v in stored.items() if k[0] in checkpoint.PARAM_GROUPS}
        refs = {key[1]: _StoredRef(key) for key in params}
        layout = LayerLayout.from_tag(meta["layout"], model_cfg)
        self._where: dict[str, _StoredRef] = layout.unstack(refs)
        shapes = {}
        for name, ref in self._where.items():
            shape, dtype = params[ref.key]
            shapes[name] = tuple(shape[1:] if ref.layer is not None else shape)
            if dtype not in _ENTRY_DTYPES:
                raise UserError(f"checkpoint {self.dir}: tensor {name} has dtype {dtype}, expected one of "
                                f"{', '.join(_ENTRY_DTYPES)}")
        checkpoint.check_tensors(shapes, checkpoint.model_shapes(model_cfg), f"checkpoint {self.dir}")
        self.entries = {name: Entry(name, shapes[name], _ENTRY_DTYPES[params[ref.key][1]], checkpoint.STATE)
                        for name, ref in self._where.items()}
        self._arrays: dict[tuple, object] = {}
        self._context = None
        self._held: _Held | None = None
        self._compressed: set[tuple] = set()    # stored arrays whose chunks are decoded whole
        self._lock = threading.Lock()            # the handles and counters, for reads on several threads

    def independent_reads(self) -> bool:
        """Whether reads may run on several threads at once (`mesh_loader.place`): each copies its
        own slice out of the mapped files (what we write). A compressed checkpoint's reads share
        the chunks the last one decoded (`read_into`), so they run one at a time."""
        for key in {ref.key for ref in self._where.values()}:
            self._array(key)
        return not self._compressed

    def stored_key(self, name: str) -> tuple:
        """The stored array `name` is read from (every layer of a stacked one shares it): reads
        grouped by it decode each stored chunk once (see `read`)."""
        return self._where[name].key

    def release(self) -> None:
        """Drop the stored chunks the last read kept (see `read`)."""
        self._held = None

    def _array(self, key: tuple):
        """The tensorstore handle of one stored array (opened once)."""
        import tensorstore as ts

        with self._lock:
            if self._context is None:
                self._context = ts.Context({"file_io_mode": {"mode": "memmap"}})
            if key in self._arrays:
                return self._arrays[key]
            base = {"driver": "ocdbt", "base": f"file://{(self.dir / checkpoint.STATE).absolute()}",
                    "path": ".".join(key)}
            errors = []
            for driver in ("zarr", "zarr3"):       # Orbax's default, and its zarr3 option
                try:
                    self._arrays[key] = ts.open({"driver": driver, "kvstore": base}, open=True, read=True,
                                                context=self._context).result()
                    if _compressed(self._arrays[key]):
                        self._compressed.add(key)
                    return self._arrays[key]
                except ValueError as e:
                    errors.append(f"{driver}: {e}")
            raise UserError(f"checkpoint {self.dir}: tensor {'/'.join(key)} cannot be opened ({'; '.join(errors)})")

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The values of `name` (or of the slice `index`, a tuple of slices) in the stored dtype."""
        index = normalize_index(index, self.entries[name].shape)
        dtype = self._array(self._where[name].key).dtype.numpy_dtype
        out = np.empty(tuple(s.stop - s.start for s in index), dtype)
        self.read_into(name, index, out)
        return out

    def read_into(self, name: str, index: tuple | None, out: np.ndarray) -> None:
        """`read`, written into `out` (the slice's shape, a float dtype; cast as numpy casts).
        Uncompressed (what we write), tensorstore copies the slice out of the mapped files straight
        into `out`. A compressed chunk (checkpoints written before) is decoded whole by any read
        that touches it, so a read that covers part of its chunks reads them whole once and keeps
        them, and the reads after it that fall inside them (the other layers of a stack stored as
        one chunk, the next rows of a tensor read in pieces) are copied from them: host memory
        holds at most the chunks of one read, which tensorstore decodes anyway."""
        import tensorstore as ts

        ref = self._where[name]
        index = normalize_index(index, self.entries[name].shape)
        stored = ((slice(ref.layer, ref.layer + 1),) if ref.layer is not None else ()) + index
        array = self._array(ref.key)
        region = _chunk_cover(stored, array.chunk_layout.read_chunk.shape, array.shape) \
            if ref.key in self._compressed else stored
        with self._lock:
            self.bytes_requested += int(np.prod(out.shape)) * array.dtype.numpy_dtype.itemsize
            if region == stored:
                self.reads += 1
        if region == stored:
            source = array[(ref.layer, *index)] if ref.layer is not None else array[index]
            if source.dtype.numpy_dtype != out.dtype:
                source = ts.cast(source, out.dtype)
            ts.array(out, copy=False, write=True).write(source).result()
            return
        held = self._held
        if held is None or held.key != ref.key or not _inside(stored, held.region):
            self.release()          # before the next read: never two reads' chunks at once
            self.reads += 1
            held = self._held = _Held(ref.key, region, np.asarray(array[region].read().result()))
        values = held.values[tuple(slice(s.start - r.start, s.stop - r.start) for s, r in zip(stored, held.region))]
        out[...] = values[0] if ref.layer is not None else values


class _Held:
    """The stored chunks the last partial read decoded: `values` of `region` of stored array `key`."""

    def __init__(self, key: tuple, region: tuple, values: np.ndarray):
        self.key, self.region, self.values = key, region, values


def _compressed(array) -> bool:
    """Whether a zarr (v2 or v3) array's chunks pass through a codec beyond their raw bytes."""
    meta = array.spec().to_json()["metadata"]
    if "codecs" in meta:
        return any(c["name"] not in ("bytes", "transpose") for c in meta["codecs"])
    return meta.get("compressor") is not None or bool(meta.get("filters"))


def _chunk_cover(index: tuple, chunk: tuple, shape: tuple) -> tuple:
    """`index` (unit-step slices with bounds) widened to the whole chunks of a grid of `chunk`
    (from 0) that it touches."""
    return tuple(slice(s.start // c * c, min(-(-s.stop // c) * c, n)) if s.stop > s.start else s
                 for s, c, n in zip(index, chunk, shape))


def _inside(index: tuple, region: tuple) -> bool:
    return all(r.start <= s.start and s.stop <= r.stop for s, r in zip(index, region))


def open_weights(path) -> tuple[object, dict, CheckpointWeights]:
    """(model record, meta, CheckpointWeights) of the newest complete checkpoint named by `path`
    (checked as `checkpoint.load_checkpoint` checks it; nothing read but metadata)."""
    step_dir, meta, cfg, stored, _ = checkpoint.open_checked(path, transformers_ok=True)
    return cfg, {k: v for k, v in meta.items() if k != "model"}, CheckpointWeights(step_dir, meta, cfg, stored)
