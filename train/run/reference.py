"""The reference log-probabilities of a full fine-tuning DPO run: computed once before training
by the train step's own forward (packed rows, fused cross-entropy: the policy's arithmetic) on
every pair of both splits, and stored beside the data with the hash of the checkpoint they come
from. A later run from the same checkpoint reads them; one from another checkpoint (or with other
settings that change them) is refused in one line naming the file, never silently reused.

    DATA/reference_logps.npz    train, val: [pairs, 2] float32 sums (chosen, rejected)
    DATA/reference_logps.json   {"checkpoint": {path, sha256}, "settings": {...}}
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from formats.atomic import write_atomic
from formats.errors import UserError
from formats.jsonfile import read_json

ARRAYS, META = "reference_logps.npz", "reference_logps.json"


def reference_settings(compute_dtype: str, truncate: bool, seq_len: int) -> dict:
    """What, besides the checkpoint, changes the stored values: the compute dtype, and where
    pairs are cut to fit a row, the row length."""
    return {"compute_dtype": compute_dtype, "truncate": truncate, "seq_len": seq_len if truncate else None}


def check_reference(data_dir, source: dict, settings: dict) -> bool:
    """True when DATA holds reference log-probabilities of `source` with `settings`; False when
    it holds none; a one-line UserError when they are stale (another checkpoint or settings)."""
    meta_path = Path(data_dir) / META
    if not meta_path.is_file():
        return False
    meta = read_json(meta_path)
    stored = meta.get("checkpoint", {}) if isinstance(meta, dict) else {}
    if stored.get("sha256") != source["sha256"]:
        raise UserError(f"{meta_path}: stale reference log-probabilities: computed from {stored.get('path')} "
                        f"(sha256 {str(stored.get('sha256'))[:12]}), but this run's reference is {source['path']} "
                        f"(sha256 {source['sha256'][:12]}); delete {META} and {ARRAYS} there to recompute them")
    if meta.get("settings") != settings:
        raise UserError(f"{meta_path}: stale reference log-probabilities: computed with {meta.get('settings')}, "
                        f"this run has {settings}; delete {META} and {ARRAYS} there to recompute them")
    return True


def load_reference(data_dir, loaders: dict) -> dict:
    with np.load(Path(data_dir) / ARRAYS) as arrays:
        tables = {split: arrays[split] for split in loaders}
    for split, loader in loaders.items():
        if tables[split].shape != (len(loader.ds), 2):
            raise UserError(f"{Path(data_dir) / ARRAYS}: split {split!r} holds {tables[split].shape[0]} pairs' "
                            f"reference log-probabilities, the data {len(loader.ds)}; delete it to recompute")
    return tables


def compute_reference(step, params, data_dir, loaders: dict, source: dict, settings: dict) -> dict:
    """{split: [pairs, 2]} from one pass over each split (every row, the last batch padded),
    written beside the data. One process only: the values come back to the host whole."""
    import jax

    from jax_bridge.step import packed_batch

    if jax.process_count() > 1:
        raise UserError(f"{data_dir}: no reference log-probabilities yet ({META}); computing them runs on one "
                        "process: start this run once on a single host (or use --lora, whose reference is the base)")
    tables = {}
    for split, loader in loaders.items():
        table = np.zeros((len(loader.ds), 2), np.float32)
        for batch in loader.iter_eval_batches(pad_last=True):
            sums = np.asarray(jax.device_get(step.answer_logps(params, packed_batch(batch))))
            have = batch.pair_docs >= 0
            table[batch.pair_docs[have]] = sums[have]
        tables[split] = table
    buf = io.BytesIO()
    np.savez(buf, **tables)
    write_atomic(Path(data_dir) / ARRAYS, buf.getvalue())
    meta = {"checkpoint": {"path": source["path"], "sha256": source["sha256"]}, "settings": settings}
    write_atomic(Path(data_dir) / META, (json.dumps(meta, indent=2) + "\n").encode())
    return tables


def with_reference(batch: dict, pair_docs: np.ndarray, table: np.ndarray) -> dict:
    """The packed batch with field "reference" [..., P, 2]: each pair slot's stored values (0 where
    the slot holds no pair)."""
    values = table[np.maximum(pair_docs, 0)]
    return {**batch, "reference": np.where((pair_docs >= 0)[..., None], values, 0.0).astype(np.float32)}
