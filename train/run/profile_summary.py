"""Where a profiled run's train steps spent their time (`train --profile-steps`, `torchlyra profile
RUN`): per op category of `plan --roofline`, measured beside the roofline's prediction; the step's
wall time against its ops' time, the gaps between steps, the ops furthest over their prediction.

A run with `--profile-steps A:B` (train/run/profiling.py) writes into OUT/profile/ the
jax.profiler trace (plugins/profile/<time>/<host>.xplane.pb) and, beside it, the compiled step's
optimized HLO (`step.hlo.txt`) and what it was compiled for (`step.json`); the summary reads them
with `jax.profiler.ProfileData` (jaxlib's own reader: no xprof, no TensorBoard), writes
`summary.json` there and prints a table (at the end of the run, and again with this command).

Measured: on a TPU, the device's "XLA Ops" line holds one event per HLO instruction executed, one
at a time, named by the instruction's text; an event belongs to the program run on the "XLA
Modules" line that holds its start. On a CPU, XLA:CPU's thunks run on host threads, each event
naming its instruction and module (stats `hlo_op`, `hlo_module`), several at once, so their sum
can exceed the wall time (the busy time is their union); runs are told apart by their dispatches
(`PjitFunction(NAME)` for module `jit_NAME`). Either way a while, call or conditional spans its
body's ops, which have events of their own: control ops are left out, so op times are exclusive.
Events are matched to the HLO by instruction name; one the HLO lacks is reported as such.

Predicted: the roofline of the same HLO at the published peaks of the TPU generation the step was
compiled for (roofline.CHIPS), op by op as `plan --roofline` prices it; none on a CPU.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import re
import socket
from pathlib import Path

from formats.errors import UserError
from jax_bridge import hlo_text as hlo
from jax_bridge import roofline

STEP_HLO, STEP_META, SUMMARY = "step.hlo.txt", "step.json", "summary.json"
UNMATCHED = "not matched to the step's HLO"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = {"programs": [], "listening": False}     # (jax's name of each program compiled, seconds)


@dataclasses.dataclass
class OpEvent:
    name: str            # the HLO instruction's name
    start_ns: float
    duration_ns: float
    signature: tuple | None = None   # (opcode, shape without layouts) where the event spells out its instruction (TPU)


@dataclasses.dataclass
class ProgramRun:
    module: str          # the HLO module's name, e.g. jit__step
    start_ns: float
    duration_ns: float   # TPU: the module's run on the device; CPU: its first op's start to its last op's end
    ops: list


# ---- what a profiled run writes beside its trace ---------------------------------------------

def _count_compile(event: str, seconds: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        _compiles["programs"].append((kwargs.get("fun_name", ""), seconds))


def save_step_program(directory: Path, step, state, tokens, lr_scale, **meta) -> dict:
    """The compiled step (jax_bridge.step.TrainStep.compiled: the executable the traced calls
    ran, from jax.jit's caches) written beside the trace: its optimized HLO (STEP_HLO) and
    STEP_META (module name, platform, TPU generation, libtpu's cost analysis, `meta`, and
    whether a second compile was needed). Returns the meta."""
    import time

    import jax

    if not _compiles["listening"]:
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        _compiles["listening"] = True
    before, start = len(_compiles["programs"]), time.perf_counter()
    compiled = step.compiled(state, tokens, lr_scale)
    text = roofline.module_text(compiled)
    module = module_name(text)          # jit_NAME, which jax's compile events call jit(NAME)
    again = [s for name, s in _compiles["programs"][before:] if name == f"jit({module.removeprefix('jit_')})"]
    return save_program(directory, compiled, text=text, platform=step.platform, generation=step.cfg.tpu_generation,
                        compiled_note=(f"compiled again in {sum(again):.1f} s (jax.jit's cache did not hold the step)"
                                       if again else "the executable the steps ran, from jax.jit's cache: no second "
                                                     "compile"),
                        seconds=round(time.perf_counter() - start, 2), **meta)


def save_program(directory: Path, compiled, *, platform: str, generation: str | None, compiled_note: str,
                 text: str | None = None, **meta) -> dict:
    """A compiled program the trace ran, written beside it: its optimized HLO (STEP_HLO; `text`
    when the caller has it already) and STEP_META (module name, platform, TPU generation, libtpu's
    cost analysis, `meta`). A program that loops (generation's decode) gives `loop_steps`, the
    iterations the trace holds in all: the summary is then per iteration. Returns the meta."""
    text = roofline.module_text(compiled) if text is None else text
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    record = {"module": module_name(text), "hlo": STEP_HLO, "platform": platform, "generation": generation,
              "compiled": compiled_note,
              "cost": {k: float(v) for k, v in dict(cost or {}).items() if "{" not in k}, **meta}   # the totals
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STEP_HLO).write_text(text)
    (directory / STEP_META).write_text(json.dumps(record, indent=1) + "\n")
    return record


def module_name(text: str) -> str:
    found = re.match(r"\s*HloModule ([\w.\-]+)", text)
    if found is None:
        raise UserError("step HLO: no 'HloModule NAME' header")
    return found.group(1)


# ---- reading the trace --------------------------------------------------------------------------

def profile_directory(path) -> Path:
    """A run directory or its profile/ directory -> the profile directory (checked)."""
    path = Path(path)
    for candidate in (path / "profile", path):
        if (candidate / "plugins" / "profile").is_dir():
            return candidate
    raise UserError(f"{path}: no profile (expected {path / 'profile' / 'plugins' / 'profile'}: written by "
                    f"`torchlyra train --profile-steps A:B`)")


def find_trace(directory: Path) -> Path:
    """The newest trace's .xplane.pb (this host's, when several hosts wrote one)."""
    runs = sorted(p for p in (directory / "plugins" / "profile").iterdir() if p.is_dir())
    files = sorted(runs[-1].glob("*.xplane.pb")) if runs else []
    if len(files) == 1:
        return files[0]
    mine = [f for f in files if f.name == f"{socket.gethostname()}.xplane.pb"]
    if mine:
        return mine[0]
    raise UserError(f"{directory}: {'no .xplane.pb trace' if not files else 'one trace per host'} in "
                    f"{runs[-1] if runs else directory / 'plugins' / 'profile'}"
                    + (f" ({', '.join(f.name for f in files)}): summarise on the host that wrote the one wanted"
                       if files else ""))


def read_trace(path: Path) -> tuple[str, str, list[ProgramRun], int]:
    """(plane name, platform, program runs in time order, op events outside any run) of a trace:
    the first TPU device's plane when there is one, else the host's (XLA:CPU)."""
    from jax.profiler import ProfileData

    try:
        space = ProfileData.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the reader's errors name the problem; keep one line
        raise UserError(f"{path}: not a readable jax.profiler trace ({str(e).strip().splitlines()[0][:200]})") from None
    planes = {plane.name: plane for plane in space.planes}
    devices = sorted((n for n in planes if re.fullmatch(r"/device:TPU:\d+", n)), key=lambda n: int(n.rsplit(":", 1)[1]))
    if devices:
        return (devices[0], "tpu", *_device_runs(planes[devices[0]]))
    if "/host:CPU" in planes:
        return ("/host:CPU", "cpu", *_host_runs(planes["/host:CPU"]))
    raise UserError(f"{path}: no TPU device plane and no host plane in the trace (planes: {', '.join(planes)})")


def _device_runs(plane) -> tuple[list[ProgramRun], int]:
    """A TPU device plane: runs from "XLA Modules", op events from "XLA Ops" by time."""
    lines = {line.name: list(line.events) for line in plane.lines}
    missing = [name for name in ("XLA Modules", "XLA Ops") if name not in lines]
    if missing:
        raise UserError(f"trace plane {plane.name}: no {' or '.join(repr(m) for m in missing)} line "
                        f"(lines: {', '.join(lines)})")
    runs = sorted((ProgramRun(re.sub(r"\(\d+\)$", "", e.name), e.start_ns, e.duration_ns, [])
                   for e in lines["XLA Modules"]), key=lambda r: r.start_ns)
    starts, outside, read = [r.start_ns for r in runs], 0, {}
    for e in lines["XLA Ops"]:
        i = bisect.bisect_right(starts, e.start_ns) - 1
        if i < 0 or e.start_ns >= runs[i].start_ns + runs[i].duration_ns:
            outside += 1
            continue
        if e.name not in read:
            read[e.name] = _instruction_of(e.name)
        runs[i].ops.append(OpEvent(*read[e.name][:1], e.start_ns, e.duration_ns, read[e.name][1]))
    return runs, outside


def _instruction_of(text: str) -> tuple[str, tuple | None]:
    """(name, (opcode, shape without layouts)) of an event named by its instruction's text."""
    try:
        ins = hlo.parse_instruction(text)
    except ValueError:
        ins = None
    if ins is not None:
        return ins.name, (ins.opcode, hlo.without_layouts(ins.shape))
    found = re.match(r"%?([\w.\-]+)", text)
    return (found.group(1) if found else text), None


def _async_neutral(signature: tuple) -> tuple:
    """(opcode, shape) with an asynchronous op's opcode as `async-start` / `-update` / `-done`: one
    printer writes a wrapped slice's halves as `slice-start` and `slice-done` (XLA's syntax sugar,
    as `roofline.module_text` does), another as `async-start` and `async-done`. A v5e profile of
    `small-o200k` (2026-12-06) left 436 traced ops unmatched as "another instruction" (1.5 ms a
    step), as many as its step's asynchronous halves, all named slice-done.N or slice-start.N."""
    opcode, shape = signature
    for half in ("-start", "-update", "-done"):
        if opcode.endswith(half):
            return "async" + half, shape
    return opcode, shape


def _host_runs(plane) -> tuple[list[ProgramRun], int]:
    """XLA:CPU: thunk events (stats hlo_op, hlo_module) on any thread, grouped into runs by their
    `run_id` stat (one per execution). Without one, split at the module's dispatches (the outermost
    `PjitFunction(NAME)` events of module jit_NAME): dispatch is asynchronous, so a run whose first
    op starts after the next dispatch lands in the next run (a test counted 2 runs of 3, now and
    then, on a loaded host)."""
    ops: dict[str, list[OpEvent]] = {}
    by_run: dict[tuple[str, int], list[OpEvent]] = {}
    dispatches: dict[str, list[float]] = {}
    for line in plane.lines:
        open_until = {}                      # a dispatch's name -> the end of the outermost one open
        for e in line.events:
            name = e.name
            if name.startswith("$"):         # Python frames
                continue
            if name.startswith("PjitFunction("):
                module = "jit_" + name[len("PjitFunction("):-1]
                if e.start_ns >= open_until.get(module, -1.0):
                    dispatches.setdefault(module, []).append(e.start_ns)
                    open_until[module] = e.start_ns + e.duration_ns
                continue
            if name.startswith(("ThunkExecutor", "ThreadpoolListener", "end: ")):
                continue
            stats = dict(e.stats)
            if "hlo_op" in stats:
                module, op = str(stats.get("hlo_module", "")), OpEvent(str(stats["hlo_op"]), e.start_ns, e.duration_ns)
                if "run_id" in stats:
                    by_run.setdefault((module, int(stats["run_id"])), []).append(op)
                else:
                    ops.setdefault(module, []).append(op)
    runs = [_run_of(module, events) for (module, _), events in by_run.items()]
    for module, events in ops.items():
        starts = sorted(dispatches.get(module, [])) or [min(e.start_ns for e in events)]
        split: list[list[OpEvent]] = [[] for _ in starts]
        for e in events:
            split[max(bisect.bisect_right(starts, e.start_ns) - 1, 0)].append(e)
        runs += [_run_of(module, run) for run in split if run]
    return sorted(runs, key=lambda r: r.start_ns), 0


def _run_of(module: str, ops: list[OpEvent]) -> ProgramRun:
    """A run spanning its ops' events."""
    start = min(e.start_ns for e in ops)
    return ProgramRun(module, start, max(e.start_ns + e.duration_ns for e in ops) - start, ops)


def _busy_ns(events) -> float:
    """The union of the events' intervals."""
    total, begin, end = 0.0, None, None
    for start, stop in sorted((e.start_ns, e.start_ns + e.duration_ns) for e in events):
        if end is None or start > end:
            total += 0.0 if end is None else end - begin
            begin, end = start, stop
        else:
            end = max(end, stop)
    return total + (0.0 if end is None else end - begin)


# ---- the summary --------------------------------------------------------------------------------

def _row_order(row: str) -> tuple:
    rank = {c: i for i, c in enumerate(roofline.CATEGORIES)}
    return (rank.get(row.split(":")[0] if row.startswith("kernel") else row, len(rank)), row)


def summarize(path, *, top: int = 10, cost_fn=None) -> dict:
    """The summary of the profile under `path` (a run directory or its profile/): see the module
    docstring. cost_fn: the roofline's cost analysis (default: the generic one on the CPU)."""
    directory = profile_directory(path)
    if not (directory / STEP_META).is_file() or not (directory / STEP_HLO).is_file():
        raise UserError(f"{directory}: no {STEP_HLO} / {STEP_META} beside the trace (a profiled run writes them "
                        f"when its trace ends): profile the run again")
    meta = json.loads((directory / STEP_META).read_text())
    text = (directory / STEP_HLO).read_text()
    module = module_name(text)
    trace = find_trace(directory)
    plane, platform, runs, outside = read_trace(trace)
    steps = [r for r in runs if r.module == module]
    if not steps:
        raise UserError(f"{trace}: no run of {module} in the trace (programs: "
                        f"{', '.join(sorted({r.module for r in runs})) or 'none'})")
    traced = meta.get("steps")
    partial = 0
    if traced and not meta.get("loop_steps") and len(steps) > traced[1] - traced[0] + 1:
        # The trace ends after step B and nothing runs after it: the runs beyond B - A + 1 come
        # first, a step that was still running when the trace began (its tail only).
        partial = len(steps) - (traced[1] - traced[0] + 1)
        steps = steps[partial:]
    n = int(meta.get("loop_steps") or len(steps))     # per step: per train step, or per loop iteration
    comps, _ = hlo.parse_module(text)
    index = {ins.name: ins for _, lines in comps.values() for ins in map(hlo.parse_instruction, lines) if ins}

    rows_of: dict[str, str] = {}

    def row_of(name: str) -> str:
        if name not in rows_of:
            ins = index[name]
            category = roofline.categorize(ins, comps)
            rows_of[name] = roofline.row_name(category, roofline.kernel_name(ins) if category == "kernel" else "")
        return rows_of[name]

    measured: dict[str, float] = {}      # instruction -> ns over every run
    events: dict[str, int] = {}
    unmatched: dict[str, float] = {}     # traced ops the HLO lacks, or holds as another instruction
    different = set()
    control = lambda e: e.signature[0] in roofline.CONTROL if e.signature else \
        e.name in index and index[e.name].opcode in roofline.CONTROL
    for run in steps:
        for e in run.ops:
            if control(e):          # spans its body's ops, counted on their own
                continue
            ins = index.get(e.name)
            if ins is not None and e.signature is not None and \
                    _async_neutral(e.signature) != _async_neutral((ins.opcode, hlo.without_layouts(ins.shape))):
                different.add(e.name)
                ins = None
            if ins is None:
                unmatched[e.name] = unmatched.get(e.name, 0.0) + e.duration_ns
            else:
                measured[e.name] = measured.get(e.name, 0.0) + e.duration_ns
                events[e.name] = events.get(e.name, 0) + 1
    predicted, prediction = _prediction(meta, text, platform, cost_fn)
    rows: dict[str, dict] = {}
    for name, ns in measured.items():
        row = rows.setdefault(row_of(name), {"measured_ns": 0.0, "instructions": 0, "events": 0})
        row["measured_ns"] += ns
        row["instructions"] += 1
        row["events"] += events[name]
    table = []
    for row in sorted(set(rows) | set(prediction.get("rows", {})), key=_row_order):
        got = rows.get(row, {"measured_ns": 0.0, "instructions": 0, "events": 0})
        ms = got["measured_ns"] / n / 1e6
        want = prediction["rows"].get(row) if "rows" in prediction else None
        table.append({"row": row, "measured_ms": ms, "predicted_ms": want,
                      "difference_ms": None if want is None else ms - want,
                      "instructions": got["instructions"], "events_per_step": got["events"] / n})
    op_ns = sum(measured.values()) + sum(unmatched.values())
    busy = [_busy_ns([e for e in run.ops if not control(e)]) for run in steps]
    wall = [run.duration_ns for run in steps]
    gaps = [b.start_ns - (a.start_ns + a.duration_ns) for a, b in zip(steps, steps[1:])]
    per_op = []
    for name in set(measured) | set(predicted):
        ms = measured.get(name, 0.0) / n / 1e6
        want = predicted.get(name)
        base = index.get(name.split("/")[0])
        per_op.append({"name": name, "row": row_of(name) if name in index else "collectives",
                       "opcode": index[name].opcode if name in index else "", "measured_ms": ms,
                       "predicted_ms": want, "difference_ms": ms - (want or 0.0), "events_per_step": events.get(name, 0) / n,
                       "shape": hlo.without_layouts(base.shape) if base is not None else ""})
    per_op.sort(key=lambda o: -o["difference_ms"])
    others = {}
    for run in runs:
        if run.module != module:
            other = others.setdefault(run.module, {"module": run.module, "runs": 0, "ms": 0.0})
            other["runs"] += 1
            other["ms"] += run.duration_ns / 1e6
    return {
        "trace": str(trace.relative_to(directory)), "hlo": STEP_HLO, "plane": plane, "platform": platform,
        "module": module, "generation": meta.get("generation"), "steps": meta.get("steps"), "runs": len(steps),
        "loop_steps": meta.get("loop_steps"), "partial_runs_left_out": partial,
        "compiled": meta.get("compiled"),
        "per_step_ms": {"wall": sum(wall) / n / 1e6, "ops": op_ns / n / 1e6, "busy": sum(busy) / n / 1e6,
                        "idle_in_program": (sum(wall) - sum(busy)) / n / 1e6,
                        "between_steps": sum(gaps) / len(gaps) / 1e6 if gaps else None},
        "rows": table,
        "unmatched": {"instructions": len(unmatched), "another_instruction": len(different),
                      "ms": sum(unmatched.values()) / n / 1e6,
                      "examples": sorted(unmatched, key=lambda k: -unmatched[k])[:5]},
        "ops_outside_runs": outside,
        "call": _call(meta, wall, runs, steps[0]),
        "other_programs": sorted(others.values(), key=lambda o: -o["ms"]),
        "prediction": {k: v for k, v in prediction.items() if k != "rows"},
        "top": per_op[:top],
    }


def _call(meta: dict, wall: list[float], runs: list[ProgramRun], first: ProgramRun) -> dict | None:
    """A traced call that timed itself on the host (generate's decode, `host_seconds`, from the
    first token on the host to the last): that time beside its program's runs on the device, the
    difference (dispatch, transfers, fetching the results; negative where the program was queued
    and ran before the first token reached the host), and the device's idle time between the
    program run before it (the prefill) and its first run, on the device's own clock. None for
    the train step's profile."""
    if meta.get("host_seconds") is None:
        return None
    host, program = meta["host_seconds"] * 1e3, sum(wall) / 1e6
    before = [r for r in runs if r.start_ns + r.duration_ns <= first.start_ns]
    previous = max(before, key=lambda r: r.start_ns + r.duration_ns) if before else None
    return {"host_ms": host, "program_ms": program, "outside_ms": host - program,
            "previous_program": previous.module if previous else None,
            "idle_before_ms": (first.start_ns - previous.start_ns - previous.duration_ns) / 1e6 if previous else None}


def _prediction(meta: dict, text: str, platform: str, cost_fn) -> tuple[dict, dict]:
    """({instruction (or fusion/collective): predicted ms per step}, {rows: {row: ms}, step_ms,
    ...}) from the roofline of the step's HLO; ({}, {"none": why}) where there is none."""
    generation = meta.get("generation")
    if platform != "tpu" or meta.get("platform") != "tpu":
        return {}, {"none": f"no roofline for a {platform} trace (the roofline prices TPU programs)"}
    if generation not in roofline.CHIPS:
        return {}, {"none": f"no published peaks for TPU generation {generation!r} (known: {', '.join(roofline.CHIPS)})"}
    cost_fn = cost_fn or roofline.xla_cost_fn()
    collected = roofline.collect_ops(text, cost_fn)
    r = roofline.roofline_of_ops(collected, text, meta.get("cost", {}), generation, cost_fn=cost_fn)
    per_op = {}
    for op in collected[0]:
        seconds = roofline.op_seconds(op, r.peak_flops, r.hbm_bandwidth, r.op_cost)[0]
        per_op[op.name] = per_op.get(op.name, 0.0) + seconds * op.trips * 1e3
    return per_op, {"rows": {row.category: row.seconds * 1e3 for row in r.rows}, "generation": generation,
                    "peak_tflops": r.peak_flops / 1e12, "hbm_gbps": r.hbm_bandwidth / 1e9,
                    "step_ms": r.seconds * 1e3, "memory_bound_share": r.memory_bound_share,
                    "unpriced_ops": len(r.unpriced_ops), "unknown_trip_counts": r.unknown_trip_counts,
                    "kernels_without_estimate": r.kernels_without_estimate}


def format_summary(s: dict) -> str:
    """The summary as the table a profiled run prints."""
    per = s["per_step_ms"]
    predicted = "none" not in s["prediction"]
    steps = s.get("steps")
    loop = s.get("loop_steps")
    lines = [f"profile: {s['runs']} run(s) of {s['module']}" + (f" (steps {steps[0]}-{steps[1]})" if steps else "")
             + (f", {loop} loop iterations in all" if loop else "")
             + (f" ({s['partial_runs_left_out']} earlier run left out: it began before the trace, only its tail"
                f" is in it)" if s.get("partial_runs_left_out") else "")
             + f" on {s['plane']}, per {'iteration' if loop else 'step'}: measured op time (exclusive)"
             + (f" beside the roofline at {s['generation']}'s peaks ({s['prediction']['peak_tflops']:.0f} TFLOP/s, "
                f"{s['prediction']['hbm_gbps']:.0f} GB/s)" if predicted else f"; {s['prediction']['none']}"),
             f"  {'category':36} {'measured':>11}" + (f" {'predicted':>11} {'difference':>11}" if predicted else "")
             + f" {'share':>6}"]
    ops = per["ops"] or 1.0
    unmatched = s["unmatched"]
    for row in s["rows"] + ([{"row": UNMATCHED, "measured_ms": unmatched["ms"], "predicted_ms": None,
                              "difference_ms": None}] if unmatched["instructions"] else []):
        note = "  (overlapped with compute: not in the predicted step)" if predicted and row["row"] == "collectives" else ""
        lines.append(f"  {row['row'][:36]:36} {row['measured_ms']:8.2f} ms"
                     + ((f" {row['predicted_ms']:8.2f} ms" if row["predicted_ms"] is not None else f" {'-':>11}")
                        + (f" {row['difference_ms']:+8.2f} ms" if row["difference_ms"] is not None else f" {'-':>11}")
                        if predicted else "")
                     + f" {row['measured_ms'] / ops:6.1%}{note}")
    total = f"  {'ops (sum)':36} {per['ops']:8.2f} ms"
    if predicted:
        step = s["prediction"]["step_ms"]
        total += f" {step:8.2f} ms {per['ops'] - step:+8.2f} ms"
    lines.append(total)
    gap = per["between_steps"]
    lines.append(f"  the step's wall time on the device {per['wall']:.2f} ms: ops busy {per['busy']:.2f} ms, idle inside "
                 f"the program {per['idle_in_program']:.2f} ms; between steps "
                 + (f"{gap:.2f} ms (nothing of the step running: dispatch, data, metrics, other programs)"
                    if gap is not None else "- (one run traced)"))
    if s["platform"] == "cpu" and per["ops"] > per["busy"] * 1.05:
        lines.append(f"  (XLA:CPU runs thunks on several threads at once: their sum is {per['ops'] / per['busy']:.2f}x "
                     f"the busy time; read the shares)")
    if predicted:
        step = s["prediction"]["step_ms"]
        lines.append(f"  the roofline's step {step:.2f} ms; the device took {per['wall']:.2f} ms per step, "
                     f"{per['wall'] - step:+.2f} ms ({per['wall'] / step:.2f}x)" if step else "  the roofline's step: 0 ms")
    if unmatched["instructions"]:
        lines.append(f"  {unmatched['instructions']} traced op(s) not matched to the step's HLO ("
                     f"{unmatched['another_instruction']} of them named there for another instruction: was the HLO "
                     f"written by this run?), e.g. " + ", ".join(unmatched["examples"]))
    call = s.get("call")
    if call:
        lines.append(f"  the call: {call['host_ms']:.2f} ms on the host's clock (first token to last), the program's "
                     f"{s['runs']} run(s) on the device {call['program_ms']:.2f} ms: "
                     f"{call['outside_ms']:+.2f} ms outside the program (dispatch, transfers, fetching the results; "
                     f"negative where it ran before the first token reached the host)")
        if call.get("previous_program"):
            lines.append(f"  the device idle {call['idle_before_ms']:.3f} ms between {call['previous_program']}'s end "
                         f"and the program's start")
    if s["other_programs"]:
        lines.append("  other programs in the trace: " + "; ".join(
            f"{o['module']} x{o['runs']} {o['ms']:.2f} ms" for o in s["other_programs"]))
    if s["top"]:
        lines.append("  ops furthest over their prediction (per step):" if predicted else "  most expensive ops (per step):")
        for o in s["top"]:
            lead = f"{o['difference_ms']:+9.3f}" if predicted else f"{o['measured_ms']:9.3f}"
            want = f", predicted {o['predicted_ms']:.3f} ms" if o["predicted_ms"] is not None else ""
            lines.append(f"    {lead} ms  {o['row'][:28]:28} {o['name']} -> {o['shape'][:60]}: measured "
                         f"{o['measured_ms']:.3f} ms (x{o['events_per_step']:g} per step){want}")
    return "\n".join(lines)


def write_summary(path, *, top: int = 10, cost_fn=None) -> tuple[dict, Path]:
    """summarize, written as SUMMARY into the profile directory."""
    summary = summarize(path, top=top, cost_fn=cost_fn)
    out = profile_directory(path) / SUMMARY
    out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary, out


# ---- two summaries side by side ------------------------------------------------------------------

def read_summary(path) -> dict:
    """A summary.json, or a profiled run (or its profile/) summarised now with every op listed."""
    path = Path(path)
    if path.is_file():
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a profile summary ({e})") from None
        missing = [k for k in ("rows", "top", "per_step_ms") if k not in s]
        if missing:
            raise UserError(f"{path}: not a profile summary written by `torchlyra profile` (no {', '.join(missing)})")
        return s
    return summarize(path, top=1 << 30)


def compare(a: dict, b: dict, top: int = 20) -> dict:
    """Where summary `a`'s step differs from `b`'s (e.g. scanned against unrolled layers): per row,
    and per op group (row, opcode, output shape: instruction names differ between two programs),
    measured ms and events per step in each, the largest differences first. `listed_ms` says how
    much of each step the summaries' `top` lists hold (a summary written with a small --top
    lists only its ops furthest over their prediction)."""
    def groups(s):
        out = {}
        for o in s["top"]:
            g = out.setdefault((o["row"], o["opcode"], o["shape"]), {"ms": 0.0, "events": 0.0})
            g["ms"] += o["measured_ms"]
            g["events"] += o["events_per_step"]
        return out

    rows_a, rows_b = ({r["row"]: r for r in s["rows"]} for s in (a, b))
    rows = [{"row": name, "a_ms": rows_a.get(name, {}).get("measured_ms", 0.0),
             "b_ms": rows_b.get(name, {}).get("measured_ms", 0.0),
             "a_events": rows_a.get(name, {}).get("events_per_step", 0.0),
             "b_events": rows_b.get(name, {}).get("events_per_step", 0.0)}
            for name in rows_a | rows_b]
    ga, gb = groups(a), groups(b)
    zero = {"ms": 0.0, "events": 0.0}
    ops = [{"row": k[0], "opcode": k[1], "shape": k[2], "a_ms": ga.get(k, zero)["ms"], "b_ms": gb.get(k, zero)["ms"],
            "a_events": ga.get(k, zero)["events"], "b_events": gb.get(k, zero)["events"]}
           for k in ga | gb]
    apart = lambda o: -abs(o["a_ms"] - o["b_ms"])
    rows.sort(key=apart)
    ops.sort(key=apart)
    return {"wall_ms": (a["per_step_ms"]["wall"], b["per_step_ms"]["wall"]),
            "ops_ms": (a["per_step_ms"]["ops"], b["per_step_ms"]["ops"]),
            "listed_ms": (sum(g["ms"] for g in ga.values()), sum(g["ms"] for g in gb.values())),
            "rows": rows, "ops": ops[:top]}


def format_comparison(c: dict, a_name: str, b_name: str) -> str:
    wa, wb = c["wall_ms"]
    lines = [f"A = {a_name}, B = {b_name}: the step's wall time on the device {wa:.2f} against {wb:.2f} ms "
             f"(A - B {wa - wb:+.2f} ms)",
             f"  {'category':36} {'A':>11} {'B':>11} {'A - B':>11} {'events A/B':>13}"]
    for r in c["rows"]:
        lines.append(f"  {r['row'][:36]:36} {r['a_ms']:8.2f} ms {r['b_ms']:8.2f} ms {r['a_ms'] - r['b_ms']:+8.2f} ms "
                     f"{r['a_events']:6g}/{r['b_events']:<6g}")
    (la, lb), (oa, ob) = c["listed_ms"], c["ops_ms"]
    lines.append(f"  op groups (category, opcode, output shape) furthest apart; the summaries list {la:.2f} of "
                 f"{oa:.2f} ms (A) and {lb:.2f} of {ob:.2f} ms (B) of their ops:")
    for o in c["ops"]:
        lines.append(f"    {o['a_ms'] - o['b_ms']:+8.3f} ms  {o['row'][:24]:24} {o['opcode'][:14]:14} {o['shape'][:60]:60} "
                     f"A {o['a_ms']:.3f} ms x{o['a_events']:g}, B {o['b_ms']:.3f} ms x{o['b_events']:g}")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("run", help="a run directory profiled with `train --profile-steps A:B` (or its profile/; "
                                    "with --against, also a summary.json)")
    parser.add_argument("--top", type=int, default=10, help="ops listed by measured - predicted time (default: 10); "
                                                             "with --against, the op groups listed")
    parser.add_argument("--against", metavar="OTHER",
                        help="set RUN's step beside OTHER's, per category and op group (each a profiled run or a "
                             "summary.json it wrote; one written with a small --top lists only some ops)")


def run(args) -> int:
    if args.top < 0:
        raise UserError(f"--top must be >= 0, found {args.top}")
    if args.against:
        print(format_comparison(compare(read_summary(args.run), read_summary(args.against), top=args.top),
                                args.run, args.against))
        return 0
    summary, out = write_summary(args.run, top=args.top)
    print(format_summary(summary))
    print(f"wrote {out}")
    return 0
