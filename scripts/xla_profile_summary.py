#!/usr/bin/env python3
"""XLA:CPU thunk time per model op, from a jax.profiler trace and the program's compiled HLO
(`scripts/step_experiments.py profile` writes both; so does `torchlyra train --profile-steps`,
whose trace directory is OUT/profile and HLO OUT/profile/step.hlo.txt). The trace is read by
train/run/profile_summary.py (jax.profiler.ProfileData, in jaxlib: nothing beyond the lock);
each op is named by the model op that emitted it (its metadata op_name), forward or backward.
The view by roofline category, beside the roofline's prediction on a TPU, is
`torchlyra profile RUN`.

    python scripts/xla_profile_summary.py TRACE_DIR HLO_TXT

Thunks overlap (two may run at once, each timed whole), so the sums exceed wall time and single
ops are inflated: read the shares, not the milliseconds.
"""
import collections
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_bridge import hlo_text as hlo  # noqa: E402
from jax_bridge.roofline import CONTROL  # noqa: E402
from train.run import profile_summary  # noqa: E402

TAGS = ("routed_experts", "linear_cross_entropy", "attention", "rms_norm", "router", "linear")


def summarize(trace_dir: str, hlo_path: str) -> collections.Counter:
    """Thunk milliseconds per model op (forward / backward), summed over the traced runs of the
    HLO's module; control ops (a loop spans its body's thunks) and ops without an op_name left out."""
    text = Path(hlo_path).read_text()
    comps, _ = hlo.parse_module(text)
    op_of = {}
    for _, lines in comps.values():
        for ins in filter(None, map(hlo.parse_instruction, lines)):
            name = re.search(r'op_name="([^"]*)"', ins.attrs)
            if name and ins.opcode not in CONTROL:
                op_of[ins.name] = name.group(1)
    module = profile_summary.module_name(text)
    _, _, runs, _ = profile_summary.read_trace(profile_summary.find_trace(Path(trace_dir)))
    sums = collections.Counter()
    for run in runs:
        if run.module != module:
            continue
        for e in run.ops:
            name = op_of.get(e.name)
            if name is None:
                continue
            tag = next((t for t in TAGS if t in name), "other")
            sums[("backward " if "transpose(" in name else "forward ") + tag] += e.duration_ns / 1e6
    return sums


if __name__ == "__main__":
    sums = summarize(sys.argv[1], sys.argv[2])
    total = sum(sums.values()) or 1.0
    for key, ms in sums.most_common():
        print(f"  {key:35s} {ms:9.1f} ms  {100 * ms / total:5.1f}%")
