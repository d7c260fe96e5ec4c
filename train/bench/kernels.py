"""`torchlyra bench kernels`: temporary memory (and, on CPU, speed) of every registered kernel
implementation, by the CPU's XLA and, with `--platform tpu --topology v6e:2x2`, by the real TPU
compiler (libtpu, deviceless: nothing runs). The other benchmarks live beside it in train/bench/.

For each op (attention, cross_entropy, moe), shape set (tiny, lyra-small, gpt-oss-20b) and
direction (forward; forward+backward), every implementation in the op registry is compiled (never
run) from `jax.ShapeDtypeStruct`s, and its program's `memory_analysis().temp_size_in_bytes` is
compared with the `xla` implementation's. Forward+backward is the vjp program (inputs, output
cotangents) -> (outputs, input gradients): outputs and incoming gradients are the program's own
results and arguments, so what is left is what the implementation holds (`--sum-loss`:
value_and_grad of sum(outputs) instead).

CPU-XLA accounting ("analysed as"):
  plain      a plain-JAX implementation (xla, ragged_dot) compiled by XLA for CPU.
  opaque     every pallas_call (ours, splash's, megablox's alike) replaced by an opaque call with
             its outputs: what the program allocates in HBM around its kernels; kernel VMEM is not
             counted. The same accounting for every Pallas implementation.
  tpu-interp / interpret   only when opaque fails: the kernel run by the TPU-simulating / generic
             Pallas interpreter, which copies inputs into its loop state and so overstates; such
             rows are printed in a separate table with the reason.
TPU accounting (`--platform tpu`): the TPU compiler's own temp bytes for the same programs
compiled for one chip of the topology, input and output layouts left to the compiler (as inside a
train step), Mosaic kernels compiled for real; plus each kernel's scoped VMEM limit and, with
`--vmem`, the VMEM the largest kernel needs (the compiler's figure, for implementations that take
`vmem_limit_bytes`). A program that needs more HBM than the chip has is reported with the
compiler's figure ("needs X"), which is then its temp size.
Plain-JAX implementations are also timed on CPU at tiny shapes (median of a few calls after
warm-up); interpreted Pallas kernels' CPU speed means nothing and is not measured.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import json
import re
import signal
import sys
import time

from train.bench.kernel_cases import (Case, abstract_inputs, concrete_inputs, kernel_cases, make_fn,
                                      short_error, time_calls)
from train.bench.machine import machine_info
from train.bench.table import markdown_table
from formats.errors import UserError

OPS = ("attention", "cross_entropy", "moe")       # the default --ops
ALL_OPS = OPS + ("moe_mxfp4",)                     # moe_mxfp4: the experts of a frozen MXFP4 base
SHAPE_SETS = ("tiny", "lyra-small", "gpt-oss-20b")
DEFAULT_SHAPE_SETS = ("tiny", "lyra-small")
DIRECTIONS = ("fwd", "fwd+bwd")

# Lyra's published savings of temporary memory against the plain reference (% saved), per
# (op, direction); None: no published goal for that row.
# Ops whose plain reference is not the `xla` implementation: savings against it are noted too.
REFERENCE = {"moe": "ragged_dot", "moe_mxfp4": "ragged_dot"}

GOALS = {
    ("cross_entropy", "fwd"): 99.9, ("cross_entropy", "fwd+bwd"): 99.9,
    ("moe", "fwd"): 99.9, ("moe", "fwd+bwd"): 99.9,
    ("attention", "fwd"): None, ("attention", "fwd+bwd"): 98.5,
}


# ---- analysis modes ----------------------------------------------------------------------------
class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_budget(seconds: float):
    """Raise _Timeout once `seconds` pass (SIGALRM; checked when control is back in Python, so a
    long XLA compile is reported as over budget when it returns). No-op off the main thread."""
    import threading
    if seconds <= 0 or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"over the {seconds:g} s compile budget")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _is_kernel(fn) -> bool:
    """Implementations with a `platform=` argument are Pallas kernels (interpreted on CPU)."""
    try:
        return "platform" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _compile(f, abstract, budget: float, mode: str):
    """mode 'opaque': each pallas_call becomes an opaque call with its output shapes, so the
    figure is what the program allocates outside the kernels (what a TPU program would hold in
    HBM; the interpreters instead copy kernel inputs into loop state). 'tpu-interp': the TPU
    interpreter. 'interpret' / 'plain': as written."""
    import jax

    from pallas_kernels.memory import opaque_pallas_calls

    jax.clear_caches()  # the same function lowered under another mode must not hit a cache
    ctx = opaque_pallas_calls() if mode == "opaque" else contextlib.nullcontext()
    start = time.perf_counter()
    with _time_budget(budget), ctx:
        compiled = jax.jit(f).lower(*abstract).compile()
    seconds = time.perf_counter() - start
    if seconds > budget > 0:
        raise _Timeout(f"compile took {seconds:.0f} s, over the {budget:g} s budget")
    return compiled, seconds


# ---- the TPU compiler --------------------------------------------------------------------------
_HBM_OOM = re.compile(r"total memory required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _tpu_measure(fn, case: Case, direction: str, args, device) -> dict:
    """The row's TPU figures: temp bytes, compile seconds, Mosaic kernels with their scoped VMEM
    limits, and (--vmem, implementations taking vmem_limit_bytes) the largest kernel's need."""
    from jax_bridge import registry, tpu_compile

    vjp = not args.sum_loss and direction == "fwd+bwd"
    kernel = _is_kernel(fn)
    kw = registry.target_keywords(fn, "tpu", tpu_compile.generation(device)) if kernel else {}
    f = make_fn(fn, case, direction, kw, vjp)
    abstract = abstract_inputs(case, fn, kw, vjp)
    out = dict(tpu_temp_bytes=None, tpu_compile_s=None, tpu_kernels=None, vmem_need_bytes=None, tpu_error=None)
    start = time.perf_counter()
    try:
        _, stats = tpu_compile.compile_for(f, abstract, device)
    except Exception as e:  # noqa: BLE001 - a row records its failure
        found = _HBM_OOM.search(str(e))
        if found:   # does not fit the chip: the compiler's requirement is the figure
            out["tpu_temp_bytes"] = int(float(found.group(1)) * _UNITS[found.group(2)])
            out["tpu_error"] = "does not fit the chip's HBM (the compiler's requirement is shown)"
        else:
            out["tpu_error"] = short_error(e)
        out["tpu_compile_s"] = round(time.perf_counter() - start, 2)
        return out
    out.update(tpu_temp_bytes=stats.temp_bytes, tpu_compile_s=stats.seconds,
               tpu_kernels=[dataclasses.asdict(k) for k in stats.kernels])
    if args.vmem and kernel and "vmem_limit_bytes" in inspect.signature(fn).parameters:
        make = lambda limit: make_fn(fn, case, direction, {**kw, "vmem_limit_bytes": limit}, vjp)
        out["vmem_need_bytes"] = tpu_compile.scoped_vmem_peak(make, abstract, device)
    return out


# ---- the run --------------------------------------------------------------------------------------
def _cpu_measure(fn, case: Case, direction: str, args) -> tuple[dict, object]:
    """The row's CPU-XLA figures (see the module docstring) and the compiled program."""
    kernel = _is_kernel(fn)
    vjp = not args.sum_loss and direction == "fwd+bwd"
    out = dict(analysed_as=None, temp_bytes=None, compile_s=None, error=None, note=None)
    compiled, notes = None, []
    for mode in (["opaque", "tpu-interp", "interpret"] if kernel else ["plain"]):
        # tpu-interp: the same kernels in the TPU-simulating interpreter (platform.py's
        # interpret='tpu'); the others compile for platform 'cpu' as they are.
        kw = ({"platform": "cpu", "interpret": "tpu"} if mode == "tpu-interp" else
              {"platform": "cpu"} if kernel else {})
        try:
            f = make_fn(fn, case, direction, kw, vjp)
            compiled, secs = _compile(f, abstract_inputs(case, fn, kw, vjp), args.compile_timeout, mode)
            out["analysed_as"], out["compile_s"] = mode, round(secs, 2)
            break
        except _Timeout as e:
            notes.append(f"{mode}: {e}")
            break  # a slow compile will not be faster in the other mode
        except Exception as e:  # noqa: BLE001
            notes.append(f"{mode}: {short_error(e)}")
    if notes:
        out["error" if compiled is None else "note"] = "; ".join(notes)
    if compiled is not None:
        mem = compiled.memory_analysis()
        out["temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
    return out, compiled


def _bench_case(case: Case, impls: dict, args, log, device=None) -> list[dict]:
    rows = []
    concrete = None
    for direction in DIRECTIONS:
        block = []
        for name, impl in impls.items():
            row = dict(op=case.op, shape=case.shape, case=case.label, dims=case.dims, dtype=case.dtype,
                       impl=name, direction=direction, accounting="tpu" if device is not None else "cpu",
                       ratio_to_xla=None, saved_pct=None, goal_pct=None, meets_goal=None,
                       time_s=None, time_ratio_to_xla=None, time_note=None)
            try:
                fn = impl.load()
            except Exception as e:  # noqa: BLE001 - a row records its failure
                row.update(analysed_as=None, temp_bytes=None, error=short_error(e), note=None, kernel=False)
                block.append(row)
                continue
            kernel = _is_kernel(fn)
            row["kernel"] = kernel
            cpu, compiled = _cpu_measure(fn, case, direction, args)
            row.update(cpu)
            vjp = not args.sum_loss and direction == "fwd+bwd"
            if compiled is not None:
                if not kernel and args.time and case.shape == "tiny" and not vjp:
                    try:
                        if concrete is None:
                            concrete = concrete_inputs(case)
                        row["time_s"] = time_calls(compiled, concrete, args.warmup, args.repeats)
                    except Exception as e:  # noqa: BLE001
                        row["time_note"] = f"run failed: {short_error(e)}"
                else:
                    row["time_note"] = "interpret" if kernel else ("compile only" if args.time else "not timed")
            if device is not None:
                row.update(_tpu_measure(fn, case, direction, args, device))
            block.append(row)
            log(_format_row(row) if args.verbose else None)
        base = next((r for r in block if r["impl"] == "xla"), None)
        ref_name = REFERENCE.get(case.op, "xla")
        ref = next((r for r in block if r["impl"] == ref_name), None)
        for row in block:
            _compare(row, base, ref if ref_name != "xla" else None)
        rows.extend(block)
    return rows


def _measure(row: dict):
    """The figure goals and ratios are judged on: the TPU compiler's when it was asked."""
    return row.get("tpu_temp_bytes") if row["accounting"] == "tpu" else row.get("temp_bytes")


def _compare(row: dict, base: dict | None, ref: dict | None = None) -> None:
    """Ratios to the xla row; goals judged for kernel rows only. `ref`: the op's plain reference
    when it is not `xla` (moe: ragged_dot), whose saving is added as a note."""
    if base is None or row is base:
        return
    mine, theirs = _measure(row), _measure(base)
    if mine is not None and theirs:
        row["ratio_to_xla"] = mine / theirs
        row["saved_pct"] = 100.0 * (1.0 - row["ratio_to_xla"])
        goal = GOALS.get((row["op"], row["direction"])) if row.get("kernel") else None
        row["goal_pct"] = goal
        if goal is not None:
            row["meets_goal"] = row["saved_pct"] >= goal
    if ref is not None and row is not ref and mine is not None and _measure(ref):
        row["saved_vs_reference_pct"] = 100.0 * (1.0 - mine / _measure(ref))
        text = f"{row['saved_vs_reference_pct']:.2f}% saved vs {ref['impl']}"
        row["note"] = f"{text}; {row['note']}" if row.get("note") else text
    if row["time_s"] is not None and base.get("time_s"):
        row["time_ratio_to_xla"] = row["time_s"] / base["time_s"]


# ---- output -------------------------------------------------------------------------------------
def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _short_note(note) -> str:
    """The table's note: a failed attempt is named by its exception type only (the JSON keeps
    the whole text)."""
    if not note:
        return ""
    parts = []
    for part in note.split("; "):
        mode, sep, rest = part.partition(": ")
        if sep and mode in ("opaque", "tpu-interp"):
            part = f"{mode} failed ({rest.split(':')[0]})"
        parts.append(part)
    return "; ".join(parts)


def _format_row(row: dict) -> str:
    return " | ".join(_cells(row))


def _vmem_cell(row: dict) -> str:
    kernels = row.get("tpu_kernels") or []
    limits = sorted({k["scoped_vmem_limit"] for k in kernels if k["scoped_vmem_limit"]})
    text = f"{len(kernels)} kernels" if kernels else "-"
    if limits:
        text += ", limit " + "/".join(f"{b >> 20}" for b in limits) + " MiB"
    elif kernels:
        text += ", default limit"
    if row.get("vmem_need_bytes"):
        text += f", needs {row['vmem_need_bytes'] / (1 << 20):.1f} MiB"
    return text


def _cells(row: dict) -> list[str]:
    head = [row["op"], row["shape"], row["case"], row["dtype"], row["impl"], row["direction"]]
    tpu = row["accounting"] == "tpu"
    if row["error"] and not tpu:
        return head + ["-"] * 9 + ["ERROR: " + row["error"]]
    ratio = "1 (base)" if row["impl"] == "xla" else (f"{row['ratio_to_xla']:.4f}" if row["ratio_to_xla"] is not None else "-")
    saved = f"{row['saved_pct']:.2f}%" if row["saved_pct"] is not None else "-"
    goal = "-" if row["meets_goal"] is None else ("yes" if row["meets_goal"] else "NO") + f" (>={row['goal_pct']}%)"
    cpu = f"{_bytes(row.get('temp_bytes'))} ({row.get('analysed_as') or '-'})"
    if tpu:
        note = "; ".join(x for x in (row.get("tpu_error"), _short_note(row.get("note")), row.get("error")) if x)
        tpu_temp = ("needs " if (row.get("tpu_error") or "").startswith("does not fit") else "") + _bytes(row.get("tpu_temp_bytes"))
        return head + [cpu, tpu_temp, ratio, saved, goal,
                       "-" if row.get("tpu_compile_s") is None else f"{row['tpu_compile_s']:.1f} s",
                       _vmem_cell(row), note]
    t = f"{row['time_s'] * 1e3:.2f} ms" if row["time_s"] is not None else (row["time_note"] or "-")
    tr = "1 (base)" if row["impl"] == "xla" and row["time_s"] is not None else (
        f"{row['time_ratio_to_xla']:.2f}" if row["time_ratio_to_xla"] is not None else "-")
    return head + [row["analysed_as"] or "-", _bytes(row["temp_bytes"]), ratio, saved, goal, t, tr,
                   _short_note(row.get("note"))]


HEADER = ["op", "shapes", "case", "dtype", "impl", "dir", "analysed as", "temp memory", "vs xla",
          "saved", "goal met", "time/call", "time vs xla", "note"]
TPU_HEADER = ["op", "shapes", "case", "dtype", "impl", "dir", "CPU-XLA temp (analysed as)", "TPU temp",
              "vs xla (TPU)", "saved (TPU)", "goal met (TPU)", "TPU compile", "Mosaic kernels: scoped VMEM", "note"]


def format_table(rows: list[dict]) -> str:
    """A Markdown table (readable as plain text too)."""
    header = TPU_HEADER if rows and rows[0]["accounting"] == "tpu" else HEADER
    return markdown_table(header, [_cells(r) for r in rows])


def split_by_accounting(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(rows measured alike: plain, opaque or by the TPU compiler; CPU rows that fell back to an
    interpreter, which overstates and must not be ranked beside the others)."""
    odd = [r for r in rows if r["accounting"] == "cpu" and r.get("analysed_as") in ("tpu-interp", "interpret")]
    return [r for r in rows if r not in odd], odd


# ---- CLI ------------------------------------------------------------------------------------------
def _parse_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise UserError(f"--{what}: expected a comma-separated list of {', '.join(allowed)}; found {text!r}")
    return items


def add_arguments(parser) -> None:
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated shape sets of {','.join(SHAPE_SETS)} (default: {','.join(DEFAULT_SHAPE_SETS)})")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated ops of {','.join(ALL_OPS)} (default: {','.join(OPS)})")
    parser.add_argument("--impls", default=None,
                        help="comma-separated implementation names to keep (default: all registered, and on a TPU "
                             "tokamax's kernels beside them: train/bench/kernel_peers.py; xla is always kept as the "
                             "baseline)")
    parser.add_argument("--platform", choices=["cpu", "tpu"], default=None,
                        help="tpu: also compile every program with the real TPU compiler (libtpu, deviceless) "
                             "and judge the goals on its figures; cpu: the CPU's XLA. Default: this host's: on a "
                             "CPU host the CPU analysis, on a TPU host every implementation timed on the chip "
                             "(train/bench/kernel_speed.py)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the inputs' dtype (default: tiny shapes float32 on CPU, everything else bfloat16)")
    parser.add_argument("--topology", default="v6e:2x2",
                        help="TPU slice compiled for with --platform tpu, e.g. v5e:2x2, v6e:2x2, v4:2x2x1 "
                             "(default: v6e:2x2; one chip of it is used)")
    parser.add_argument("--vmem", action="store_true",
                        help="with --platform tpu: also find the VMEM the largest kernel of each program needs "
                             "(a few more compiles per row)")
    parser.add_argument("--no-time", dest="time", action="store_false",
                        help="memory analysis only: time nothing")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row (median; default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before timing (default 2)")
    parser.add_argument("--compile-timeout", type=float, default=180.0,
                        help="seconds allowed per CPU compile before the row records an error (default 180)")
    parser.add_argument("--sum-loss", action="store_true",
                        help="measure forward+backward as value_and_grad of sum(outputs) instead of the default "
                             "(inputs, output cotangents) -> (outputs, grads), where outputs and cotangents are "
                             "the program's own outputs and arguments, not temps")
    parser.add_argument("--verbose", action="store_true", help="print each row as it is measured")
    parser.add_argument("--tune", metavar="TABLE.json",
                        help="instead: sweep our Pallas kernels' tiles on this machine's device at --shapes (or a "
                             "run's shapes: --preset / --model-config) and write the fastest per call shape to "
                             "TABLE.json (merged into an existing table of the same device kind), which --kernel-options "
                             "TABLE.json then uses, or every program for this TPU generation when committed as "
                             "tiles/GENERATION.json beside jax_bridge/kernel_tiles.py (train/bench/tune.py)")
    parser.add_argument("--preset", default=None,
                        help="with --tune: the call shapes of this preset's train step (one chip, --batch-size rows "
                             "of --seq-len per micro-batch) instead of --shapes")
    parser.add_argument("--model-config", metavar="CONFIG.json", default=None,
                        help="with --tune: the call shapes of this transformers model's train step, as --preset")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="with --preset / --model-config: rows per micro-batch (default: 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="with --preset / --model-config: sequence length")
    parser.add_argument("--compute-dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="with --preset / --model-config: the run's compute dtype (default: auto, the "
                             "platform's: bfloat16 on TPU)")
    parser.add_argument("--tune-candidates", metavar="SPEC",
                        help="with --tune: tile values to try instead of the built-in ones, e.g. "
                             "cross_entropy.pallas.block_n=256/512,cross_entropy.pallas.block_v=512")


def _command_line(args) -> str:
    parts = ["torchlyra", "bench", "kernels", "--shapes", args.shapes, "--ops", args.ops]
    if args.dtype:
        parts += ["--dtype", args.dtype]
    if args.impls:
        parts += ["--impls", args.impls]
    if args.platform == "tpu":
        parts += ["--platform", "tpu", "--topology", args.topology] + (["--vmem"] if args.vmem else [])
    if not args.time:
        parts.append("--no-time")
    if args.sum_loss:
        parts.append("--sum-loss")
    if args.json:
        parts += ["--json", args.json]
    return " ".join(parts)


_METHOD = {
    "cpu": "temp memory: compiled-program temporaries (memory_analysis().temp_size_in_bytes), compile only; "
           "fwd+bwd is the vjp program (inputs, output cotangents) -> (outputs, grads) unless --sum-loss. "
           "opaque: every pallas_call (ours and the jax-shipped kernels alike) replaced by an opaque call with its "
           "output shapes, i.e. what the program holds outside the kernels (kernel VMEM not counted); plain: plain "
           "JAX. Times: CPU, tiny shapes, plain-JAX implementations only.",
    "tpu": "TPU temp: the TPU compiler's temporaries for one chip, layouts chosen by the compiler, Mosaic kernels "
           "compiled for real (VMEM inside them is not HBM); goals are judged on it. CPU-XLA temp: the same program "
           "compiled for CPU (opaque = pallas_calls as opaque calls). Mosaic kernels: their count, the scoped VMEM "
           "limit each requested (default: the compiler's), and with --vmem the largest kernel's need.",
}


def _keep(args) -> set | None:
    """--impls as a set (xla always kept: the baseline); None keeps every implementation."""
    return None if args.impls is None else {s.strip() for s in args.impls.split(",") if s.strip()} | {"xla"}


def _write_json(path: str, report: dict) -> None:
    from formats.atomic import write_atomic

    write_atomic(path, json.dumps(report, indent=1).encode())
    print(f"wrote {path}")


def _run_on_device(args, shapes: list[str], ops: list[str], host: str) -> int:
    """Every implementation timed on this host's accelerator (train/bench/kernel_speed.py)."""
    import jax

    from train.bench import kernel_speed

    args.dtype = args.dtype or "bfloat16"
    started = time.perf_counter()
    rows = kernel_speed.run(args, shapes, ops, _keep(args))
    elapsed = time.perf_counter() - started
    print(f"Kernel speed on {jax.devices()[0].device_kind} ({host}), {args.dtype}")
    print(kernel_speed.format_table(rows))
    errors = sum(1 for r in rows if r["error"])
    print(f"\n{len(rows)} rows in {elapsed:.0f} s; {errors} rows with errors.")
    print(kernel_speed.METHOD)
    if args.json:
        _write_json(args.json, dict(
            command=_command_line(args), date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            machine=machine_info(), elapsed_s=round(elapsed, 1),
            settings=dict(shapes=shapes, ops=ops, dtype=args.dtype, repeats=args.repeats, warmup=args.warmup,
                          accounting="timed on the device", device_kind=jax.devices()[0].device_kind),
            rows=rows))
    return 0


def run(args) -> int:
    run_shapes = args.preset is not None or args.model_config is not None
    if run_shapes and not args.tune:
        raise UserError("--preset / --model-config are for --tune (the call shapes of a run's step)")
    if run_shapes and args.shapes is not None:
        raise UserError("--tune: give --shapes or a run's shapes (--preset / --model-config), not both")
    args.shapes = args.shapes or ",".join(DEFAULT_SHAPE_SETS)
    shapes = _parse_list(args.shapes, SHAPE_SETS, "shapes")
    ops = _parse_list(args.ops, ALL_OPS, "ops")
    if args.repeats < 1 or args.warmup < 0:
        raise UserError(f"--repeats must be >= 1 and --warmup >= 0; found {args.repeats}, {args.warmup}")
    if args.tune:
        if args.platform == "tpu":
            raise UserError("--tune times the kernels on this machine's own device; --platform tpu compiles for a "
                            "TPU without one (run --tune on the TPU host)")
        from train.bench import tune
        return tune.run(args, shapes, ops)
    if args.tune_candidates:
        raise UserError("--tune-candidates is for --tune")
    from pallas_kernels.platform import host_platform

    host = host_platform()
    if args.platform is None and host != "cpu":
        return _run_on_device(args, shapes, ops, host)
    if args.platform == "cpu" and host != "cpu":
        raise UserError(f"--platform cpu: this host's JAX runs on {host}; the CPU analysis needs a CPU backend "
                        f"(run with JAX_PLATFORMS=cpu), or leave --platform out to time the kernels on the {host}")
    args.platform = args.platform or "cpu"

    from jax_bridge import registry, tpu_compile   # after argument checks, so bad input fails fast

    device = None
    if args.platform == "tpu":
        try:
            device = tpu_compile.device_of(args.topology)
        except tpu_compile.TopologyError as e:
            raise UserError(f"--topology: {e}") from None
    keep = _keep(args)
    log = lambda s: s is not None and print(s, file=sys.stderr, flush=True)
    started = time.perf_counter()
    rows = []
    for op in ops:
        impls = registry.implementations(op)
        impls = {"xla": impls["xla"], **{n: i for n, i in impls.items() if n != "xla"}}  # base first
        if keep is not None:
            impls = {n: i for n, i in impls.items() if n in keep}
        for shape in shapes:
            for case in kernel_cases(op, shape, dtype=args.dtype):
                rows.extend(_bench_case(case, impls, args, log, device))
    elapsed = time.perf_counter() - started

    alike, odd = split_by_accounting(rows)
    where = f" (TPU: {device.device_kind}, one chip of {args.topology})" if device is not None else ""
    print(f"Kernel temporary memory{where}")
    print(format_table(alike))
    if odd:
        print("\nMeasured differently (their opaque accounting failed, so an interpreter's program was measured; it "
              "copies inputs into its loop state and overstates, so these rows are not comparable to the table above):")
        print(format_table(odd))
    goal_rows = [r for r in alike if r["meets_goal"] is not None]
    met = sum(r["meets_goal"] for r in goal_rows)
    errors = sum(1 for r in rows if r["error"] or r.get("tpu_error"))
    big = [r for r in goal_rows if r["shape"] == "lyra-small"]
    print(f"\n{len(rows)} rows in {elapsed:.0f} s; {errors} rows with errors or notes. Goal (Lyra's published savings, "
          f"stated for Lyra Small shapes) met in {sum(r['meets_goal'] for r in big)} of {len(big)} lyra-small rows "
          f"that have one ({met} of {len(goal_rows)} over all shape sets; at tiny shapes fixed overheads dominate).")
    print(_METHOD[args.platform])
    if args.json:
        report = dict(
            command=_command_line(args),
            date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            machine=machine_info(), elapsed_s=round(elapsed, 1), goals={f"{k[0]} {k[1]}": v for k, v in GOALS.items()},
            settings=dict(shapes=shapes, ops=ops, time=args.time, repeats=args.repeats, warmup=args.warmup,
                          platform=args.platform, topology=args.topology if device is not None else None,
                          device_kind=device.device_kind if device is not None else None,
                          backward="value_and_grad of sum(outputs)" if args.sum_loss else "vjp with output cotangents as inputs",
                          compile_timeout_s=args.compile_timeout),
            rows=rows)
        _write_json(args.json, report)
    return 0
