#!/usr/bin/env python3
"""XLA:CPU thunk time per model op, from a jax.profiler trace and the program's compiled HLO
(`scripts/step_experiments.py profile` writes both). Needs `xprof` (not a project dependency:
`pip install xprof` in any venv; nothing else from the project is imported).

    python scripts/xla_profile_summary.py TRACE_DIR HLO_TXT

Thunks overlap (two may run at once, each timed whole), so the sums exceed wall time and single
ops are inflated: read the shares, not the milliseconds.
"""
import sys


def summarize(trace_dir: str, hlo_path: str):
    """Thunk milliseconds per model op (forward / backward), summed over the traced calls."""
    import collections
    import glob
    import gzip
    import json
    import re

    from xprof.convert import raw_to_tool_data

    path = sorted(glob.glob(f"{trace_dir}/plugins/profile/*/*.xplane.pb"))[-1]
    data, _ = raw_to_tool_data.xspace_to_tool_data([path], "trace_viewer@", {})
    try:
        data = gzip.decompress(data)
    except (OSError, TypeError):
        pass
    events = json.loads(data)
    events = events["traceEvents"] if isinstance(events, dict) else events
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    hlo = open(hlo_path).read()
    op_of = dict(re.findall(r"\n\s*(?:ROOT )?%?([\w.-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo))
    for loop in re.findall(r"\n\s*(?:ROOT )?%?([\w.-]+) = [^\n]* while\(", hlo):
        op_of.pop(loop, None)         # a loop's thunk spans its body's thunks, which count on their own
    tags = ("routed_experts", "linear_cross_entropy", "attention", "rms_norm", "router", "linear")
    sums = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or not threads.get((e["pid"], e["tid"]), "").startswith("tf_XLAEigen"):
            continue
        name = op_of.get(e["name"])
        if name is None:
            continue
        tag = next((t for t in tags if t in name), "other")
        sums[("backward " if "transpose(" in name else "forward ") + tag] += e["dur"] / 1e3
    total = sum(sums.values())
    for key, ms in sums.most_common():
        print(f"  {key:35s} {ms:9.1f} ms  {100 * ms / total:5.1f}%")


if __name__ == "__main__":
    summarize(sys.argv[1], sys.argv[2])
