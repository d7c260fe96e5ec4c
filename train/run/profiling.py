"""`train --profile-steps A:B`: a `jax.profiler` trace of train steps A to B (counted from 1, both
included) in the run directory's `profile/`, which TensorBoard's profile plugin and XProf read
(`tensorboard --logdir OUT/profile`). The trace starts once the steps before A are done and ends
after step B's results are on the host, so it holds the device work of those steps and nothing
else, not only their dispatch; the run then writes the step's
HLO and the trace's summary beside it (Trainer.profiled, train/run/profile_summary.py)."""
from __future__ import annotations

import re
from pathlib import Path

from formats.errors import UserError


def parse_profile_steps(spec: str, steps: int | None = None) -> tuple[int, int] | None:
    """"A:B" -> (A, B) with 1 <= A <= B (<= steps when given); "" -> None."""
    if not spec:
        return None
    found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(spec))
    if not found or not 1 <= int(found.group(1)) <= int(found.group(2)):
        raise UserError(f"config: profile_steps must be A:B with 1 <= A <= B (train steps, counted from 1), "
                        f"found {spec!r}")
    first, last = int(found.group(1)), int(found.group(2))
    if steps is not None and last > steps:
        raise UserError(f"config: profile_steps {spec} ends after the run's last step ({steps})")
    return first, last


class StepProfiler:
    """Starts the trace before step A and stops it after step B (a resumed run past A starts at
    its first step inside the range). No-op without a range."""

    def __init__(self, spec: str, directory: Path, steps: int):
        self.range = parse_profile_steps(spec, steps)
        self.directory = Path(directory)
        self.active = False

    def before(self, step: int, running=None) -> None:
        """`step` is about to run; `running`: what the steps already dispatched produce (the train
        state). The trace starts once they are done: the loop fetches metrics a step late
        (Trainer.queue_log), so an earlier step may still run, and its tail in the trace would
        count as a third, partial run of the traced steps (on a v5e chip, 2026-12-06: 3 runs for
        steps 10-11, a per-step time 15% short)."""
        import jax

        if self.range and not self.active and self.range[0] <= step <= self.range[1]:
            jax.block_until_ready(running)
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, metrics) -> dict | None:
        """`step` has been dispatched with these metrics; after step B, returns the trace's record."""
        import jax

        if not self.active or step < self.range[1]:
            return None
        from jax_bridge.distributed import say

        jax.block_until_ready(metrics)
        self.close()
        say(f"profile: steps {self.range[0]}-{self.range[1]} traced into {self.directory} "
            f"(tensorboard --logdir {self.directory})")
        files = sorted(str(p.relative_to(self.directory)) for p in self.directory.rglob("*.xplane.pb"))
        return {"kind": "profile", "step": step, "steps": list(self.range), "directory": str(self.directory),
                "files": files}

    def close(self) -> None:
        import jax

        if self.active:
            jax.profiler.stop_trace()
            self.active = False
