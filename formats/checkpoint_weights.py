"""The parameters of one of our checkpoints, read by slice: what `formats/hf_weights.py` is for a
Hugging Face directory. Every tensor is addressed by its per-layer torch name whatever layout the
checkpoint stores (`checkpoint.LAYOUTS`: a stacked tensor is read one layer at a time), and a
read asks tensorstore for the requested slice only, so a process reading its devices' blocks
never holds a tensor it does not own. Orbax writes each array as a zarr array in an OCDBT
database under `state/`, keyed `<group>.<stored name>`.
"""
from __future__ import annotations

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
    `read(name, index)` and `bytes_requested` as HFWeights has them."""

    def __init__(self, step_dir: Path, meta: dict, model_cfg, stored: dict):
        from jax_bridge.layer_stack import LayerLayout

        self.dir, self.bytes_requested = Path(step_dir), 0
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

    def _array(self, key: tuple):
        """The tensorstore handle of one stored array (opened once)."""
        import tensorstore as ts

        if key not in self._arrays:
            base = {"driver": "ocdbt", "base": f"file://{(self.dir / checkpoint.STATE).absolute()}",
                    "path": ".".join(key)}
            errors = []
            for driver in ("zarr", "zarr3"):       # Orbax's default, and its zarr3 option
                try:
                    self._arrays[key] = ts.open({"driver": driver, "kvstore": base}, open=True, read=True).result()
                    break
                except ValueError as e:
                    errors.append(f"{driver}: {e}")
            else:
                raise UserError(f"checkpoint {self.dir}: tensor {'/'.join(key)} cannot be opened ({'; '.join(errors)})")
        return self._arrays[key]

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The values of `name` (or of the slice `index`, a tuple of slices) in the stored dtype."""
        ref = self._where[name]
        index = normalize_index(index, self.entries[name].shape)
        stored = (ref.layer, *index) if ref.layer is not None else index
        values = np.asarray(self._array(ref.key)[stored].read().result())
        self.bytes_requested += values.nbytes
        return values


def open_weights(path) -> tuple[object, dict, CheckpointWeights]:
    """(model record, meta, CheckpointWeights) of the newest complete checkpoint named by `path`
    (checked as `checkpoint.load_checkpoint` checks it; nothing read but metadata)."""
    step_dir, meta, cfg, stored, _ = checkpoint.open_checked(path, transformers_ok=True)
    return cfg, {k: v for k, v in meta.items() if k != "model"}, CheckpointWeights(step_dir, meta, cfg, stored)
