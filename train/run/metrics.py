"""Training metrics: one JSON object per line in metrics.jsonl (optionally mirrored to TensorBoard),
the step timer that measures training steps only, and the per-layer expert-load statistics.

Record kinds: "run" (setup), "train" (a logged step), "eval", "checkpoint", "resume", "stop".
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import numpy as np

from formats.atomic import write_atomic


def _clean(value):
    """JSON-safe: numpy/jax scalars to float, arrays to lists, NaN and infinities to null."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if hasattr(value, "shape") and getattr(value, "shape", ()) != ():
        return _clean(np.asarray(value).tolist())
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: Path) -> list[dict]:
    """Every parseable record (a line cut short by a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def truncate_after(path: Path, step: int) -> int:
    """Drop the records of steps after `step` (a resumed run writes them again); returns how many."""
    if not Path(path).exists():
        return 0
    records = read_metrics(path)
    keep = [r for r in records if r.get("step", 0) <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep).encode())
    return len(records) - len(keep)


class MetricsWriter:
    """Appends records to metrics.jsonl; with `tensorboard_dir`, scalars of train/eval records
    also go to TensorBoard event files. `resume_step` keeps the records up to that step."""

    def __init__(self, path: Path, *, resume_step: int | None = None, tensorboard_dir: Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            truncate_after(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard_dir is not None:
            from tensorboardX import SummaryWriter

            # purge_step hides events an interrupted run logged past the resumed step.
            self._tb = SummaryWriter(str(tensorboard_dir), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict) -> None:
        record = _clean(record)
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None and record.get("kind") in ("train", "eval"):
            for name, value in _scalars(record):
                self._tb.add_scalar(f"{record['kind']}/{name}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _scalars(record: dict, prefix: str = ""):
    for key, value in record.items():
        if key in ("kind", "step") or key == "expert_fraction":
            continue
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, list):
            yield from ((f"{prefix}{key}/{i}", v) for i, v in enumerate(value) if v is not None)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix + key, value


def expert_load(fraction) -> dict:
    """Per MoE layer, the load of its experts as fraction of routed tokens x E (1.0 = even):
    min, max and the coefficient of variation (std / mean of the fractions)."""
    frac = np.asarray(fraction, dtype=np.float64)            # [layers, experts]
    n = frac.shape[-1]
    mean = frac.mean(-1)
    return {"min": (frac.min(-1) * n).tolist(), "max": (frac.max(-1) * n).tolist(),
            "cv": (frac.std(-1) / np.where(mean > 0, mean, 1)).tolist()}


class StepTimer:
    """Wall time of training steps only: what runs inside `paused()` (evaluation, checkpoint
    saves) is left out, and timing starts after the first step is dispatched (compilation)."""

    def __init__(self):
        self._mark: float | None = None
        self._excluded = 0.0
        self._steps = 0

    @property
    def started(self) -> bool:
        return self._mark is not None

    def start(self) -> None:
        self._mark, self._excluded, self._steps = time.perf_counter(), 0.0, 0

    def count(self, steps: int = 1) -> None:
        self._steps += steps

    @contextlib.contextmanager
    def paused(self):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - begin

    def lap(self, running: int = 0) -> float | None:
        """Seconds per step since the last lap (None before any timed step); call once the step
        that ends the lap is done. `running`: steps counted after it, still on the device; they
        belong to the next lap, which starts now (when the lap's last step ended)."""
        done = self._steps - running
        if self._mark is None or done <= 0:
            return None
        now = time.perf_counter()
        per_step = (now - self._mark - self._excluded) / done
        self._mark, self._excluded, self._steps = now, 0.0, running
        return per_step
