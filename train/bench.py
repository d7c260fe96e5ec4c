"""`torchlyra bench kernels`: temporary memory and speed of every registered kernel implementation.
(`torchlyra bench data`, the data pipeline's throughput, lives in train/data/bench.py.)

For each op (attention, cross_entropy, moe), shape set (tiny, lyra-small) and direction (forward;
forward+backward = jax.value_and_grad of the sum of all outputs w.r.t. all float inputs), every
implementation in the op registry is compiled (never run) from `jax.ShapeDtypeStruct`s, and its
compiled program's `memory_analysis().temp_size_in_bytes` is compared with the `xla`
implementation's. Plain-JAX implementations are also timed at tiny shapes (median of a few calls
after warm-up); Pallas kernels on CPU run in an interpreter whose speed means nothing, so their
time is reported as "interpret" and not measured.

Which program is analysed ("analysed as" column):
  plain      : a plain-JAX implementation (xla, ragged_dot), compiled by XLA for CPU.
  tpu-interp : the TPU (Mosaic) kernel run by the faithful TPU interpreter
               (`pltpu.InterpretParams`). Every HBM array the kernels read or write is an XLA
               buffer (argument, output, or temp between kernels); the simulated VMEM / SMEM
               scratch is not, so the temp size is the HBM the design needs beyond its inputs
               and outputs (plus a few block-sized staging buffers of the interpreter).
               cross_entropy's backend='cpu' is this mode. attention / moe / megablox run
               generic interpret mode for backend='cpu'; here their `interpret=True` is swapped
               for `pltpu.InterpretParams()` while lowering (same kernels, same grid).
  interpret  : the generic Pallas interpreter (used when the TPU interpreter cannot lower the
               kernel, e.g. splash). It copies its inputs into its loop state, so the temp size
               overstates the kernel's.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from train.errors import UserError

OPS = ("attention", "cross_entropy", "moe")
SHAPE_SETS = ("tiny", "lyra-small")
DIRECTIONS = ("fwd", "fwd+bwd")

# Lyra's published savings of temporary memory against the plain reference (% saved), per
# (op, direction); None: no published goal for that row.
# Ops whose plain reference is not the `xla` implementation: savings against it are noted too.
REFERENCE = {"moe": "ragged_dot"}

GOALS = {
    ("cross_entropy", "fwd"): 99.9, ("cross_entropy", "fwd+bwd"): 99.9,
    ("moe", "fwd"): 99.9, ("moe", "fwd+bwd"): 99.9,
    ("attention", "fwd"): None, ("attention", "fwd+bwd"): 98.5,
}


@dataclass
class Case:
    """One benchmark problem: an op at a shape set, with input specs and static kwargs."""
    op: str
    shape: str              # tiny | lyra-small
    label: str              # human-readable variant (window, dims)
    dtype: str
    specs: list             # [(shape tuple, dtype name, kind)]; kind: float | int | labels | groups
    kwargs: dict = field(default_factory=dict)
    dims: dict = field(default_factory=dict)


def _cases(op: str, shape: str) -> list[Case]:
    dt = "float32" if shape == "tiny" else "bfloat16"   # tiny: the CPU training dtype; Lyra Small: bf16
    if op == "attention":
        b, hq, hkv, t, d, w = (8, 4, 2, 256, 64, 64) if shape == "tiny" else (4, 16, 4, 4096, 128, 128)
        out = []
        for window in (w, 0):
            out.append(Case(op, shape, f"B{b} H{hq}/{hkv} T{t} D{d} " + (f"win{window}" if window else "full"), dt,
                            [((b, hq, t, d), dt, "float"), ((b, hkv, t, d), dt, "float"),
                             ((b, hkv, t, d), dt, "float"), ((hq,), "float32", "float")],
                            dict(sliding_window=window, scale=d ** -0.5),
                            dict(B=b, Hq=hq, Hkv=hkv, T=t, D=d, window=window)))
        return out
    if op == "cross_entropy":
        n, h, v = (2048, 256, 4096) if shape == "tiny" else (16384, 2048, 201088)
        return [Case(op, shape, f"N{n} H{h} V{v}", dt,
                     [((n, h), dt, "float"), ((v, h), dt, "float"), ((n,), "int32", "labels")],
                     dict(ignore_index=-100), dict(N=n, H=h, V=v))]
    if op == "moe":
        m, h, i, e = (4096, 256, 256, 8) if shape == "tiny" else (32768, 2048, 384, 16)
        return [Case(op, shape, f"M{m} H{h} I{i} E{e}", dt,
                     [((m, h), dt, "float"), ((e,), "int32", "groups"), ((e, h, 2 * i), dt, "float"),
                      ((e, 2 * i), dt, "float"), ((e, i, h), dt, "float"), ((e, h), dt, "float")],
                     dict(alpha=1.702, limit=7.0), dict(M=m, H=h, I=i, E=e))]
    raise UserError(f"unknown op {op!r}")


# ---- building the functions ---------------------------------------------------------------------
def _float_positions(case: Case) -> tuple[int, ...]:
    return tuple(i for i, (_, _, kind) in enumerate(case.specs) if kind == "float")


def _make_fn(fn, case: Case, direction: str, kernel_kwargs: dict, vjp: bool = False):
    """f(*inputs) for the direction: the op itself, or value_and_grad of the sum of its outputs.
    vjp=True: forward+backward as f(*inputs, *cotangents) -> (outputs, input grads) instead, so
    the op's outputs and incoming gradients are the program's outputs / arguments, not temps."""
    import jax
    import jax.numpy as jnp

    kwargs = {**case.kwargs, **kernel_kwargs}

    def fwd(*args):
        return fn(*args, **kwargs)

    if direction == "fwd":
        return fwd
    floats = _float_positions(case)

    if vjp:
        from pallas_kernels.memory import vjp_program
        return vjp_program(fwd, floats, n_inputs=len(case.specs))

    def fwd_bwd(*args):
        def loss(*fl):
            full = list(args)
            for pos, x in zip(floats, fl):
                full[pos] = x
            out = fwd(*full)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return sum(jnp.sum(o.astype(jnp.float32)) for o in outs)
        return jax.value_and_grad(loss, argnums=tuple(range(len(floats))))(*(args[p] for p in floats))

    return fwd_bwd


def _abstract_inputs(case: Case, fn=None, kernel_kwargs=None, vjp: bool = False):
    """ShapeDtypeStructs of the inputs; with vjp, followed by the cotangents of fn's outputs."""
    import jax
    import jax.numpy as jnp
    specs = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d, _ in case.specs]
    if vjp:
        out = jax.eval_shape(lambda *a: fn(*a, **case.kwargs, **(kernel_kwargs or {})), *specs)
        specs += [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in jax.tree_util.tree_leaves(out)]
    return specs


def _concrete_inputs(case: Case, seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    key = jax.random.PRNGKey(seed)
    out = []
    for s, d, kind in case.specs:
        key, sub = jax.random.split(key)
        if kind == "float":
            out.append((jax.random.normal(sub, s, jnp.float32) * 0.5).astype(d))
        elif kind == "labels":
            out.append(jax.random.randint(sub, s, 0, case.dims["V"], jnp.int32))
        elif kind == "groups":  # uneven but deterministic expert loads summing to M
            e, m = s[0], case.dims["M"]
            w = np.random.default_rng(seed).dirichlet(np.ones(e) * 2.0)
            sizes = np.floor(w * m).astype(np.int32)
            sizes[0] += m - sizes.sum()
            out.append(jnp.asarray(sizes, jnp.int32))
        else:
            raise AssertionError(kind)
    return out


# ---- analysis modes ----------------------------------------------------------------------------
@contextlib.contextmanager
def _tpu_interpreter():
    """While lowering: every pallas_call asked for generic interpret mode (interpret=True) gets
    the TPU interpreter instead (pltpu.InterpretParams()); kernels already asking for it or for
    Mosaic are untouched."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    original = pl.pallas_call

    def pallas_call(*args, **kwargs):
        if kwargs.get("interpret") is True:
            kwargs["interpret"] = pltpu.InterpretParams()
        return original(*args, **kwargs)

    pl.pallas_call = pallas_call
    try:
        yield
    finally:
        pl.pallas_call = original


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
    """Implementations with a `backend=` argument are Pallas kernels (interpreted on CPU)."""
    try:
        return "backend" in inspect.signature(fn).parameters
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
    ctx = {"opaque": opaque_pallas_calls, "tpu-interp": _tpu_interpreter}.get(mode, contextlib.nullcontext)()
    start = time.perf_counter()
    with _time_budget(budget), ctx:
        compiled = jax.jit(f).lower(*abstract).compile()
    seconds = time.perf_counter() - start
    if seconds > budget > 0:
        raise _Timeout(f"compile took {seconds:.0f} s, over the {budget:g} s budget")
    return compiled, seconds


def _time_calls(compiled, inputs, warmup: int, repeats: int) -> float:
    import jax
    for _ in range(warmup):
        jax.block_until_ready(compiled(*inputs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:240]


# ---- the run --------------------------------------------------------------------------------------
def _bench_case(case: Case, impls: dict, args, log) -> list[dict]:
    rows = []
    concrete = None
    for direction in DIRECTIONS:
        base = None
        for name, impl in impls.items():
            row = dict(op=case.op, shape=case.shape, case=case.label, dims=case.dims, dtype=case.dtype,
                       impl=name, direction=direction, analysed_as=None, temp_bytes=None,
                       ratio_to_xla=None, saved_pct=None, goal_pct=None, meets_goal=None,
                       time_s=None, time_ratio_to_xla=None, time_note=None, compile_s=None, error=None,
                       note=None)
            try:
                fn = impl.load()
            except Exception as e:  # noqa: BLE001 - a row records its failure
                row["error"] = _short_error(e)
                rows.append(row)
                continue
            kernel = _is_kernel(fn)
            kernel_kwargs = {"backend": "cpu"} if kernel else {}
            vjp = not args.sum_loss and direction == "fwd+bwd"
            f = _make_fn(fn, case, direction, kernel_kwargs, vjp)
            compiled = None
            attempts = ["opaque", "tpu-interp", "interpret"] if kernel else ["plain"]
            notes = []
            for mode in attempts:
                try:
                    abstract = _abstract_inputs(case, fn, kernel_kwargs, vjp)
                    compiled, secs = _compile(f, abstract, args.compile_timeout, mode)
                    row["analysed_as"], row["compile_s"] = mode, round(secs, 2)
                    break
                except _Timeout as e:
                    notes.append(f"{mode}: {e}")
                    break  # a slow compile will not be faster in the other mode
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{mode}: {_short_error(e)}")
            if notes:
                row["error" if compiled is None else "note"] = "; ".join(notes)
            if compiled is not None:
                mem = compiled.memory_analysis()
                row["temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
                if not kernel and args.time and case.shape == "tiny" and not vjp:
                    try:
                        if concrete is None:
                            concrete = _concrete_inputs(case)
                        row["time_s"] = _time_calls(compiled, concrete, args.warmup, args.repeats)
                    except Exception as e:  # noqa: BLE001
                        row["time_note"] = f"run failed: {_short_error(e)}"
                elif kernel:
                    row["time_note"] = "interpret"
                elif not args.time:
                    row["time_note"] = "not timed"
                else:
                    row["time_note"] = "compile only"
            row["kernel"] = kernel
            if name == "xla":
                base = row
            rows.append(row)
            log(_format_row(row) if args.verbose else None)
        block = rows[-len(impls):]
        ref_name = REFERENCE.get(case.op, "xla")
        ref = next((r for r in block if r["impl"] == ref_name), None)
        for row in block:
            _compare(row, base, ref if ref_name != "xla" else None)
    return rows


def _compare(row: dict, base: dict | None, ref: dict | None = None) -> None:
    """Ratios to the xla row; goals judged for kernel rows only. `ref`: the op's plain reference
    when it is not `xla` (moe: ragged_dot), whose saving is added as a note."""
    if base is None or row is base:
        return
    if row["temp_bytes"] is not None and base.get("temp_bytes"):
        row["ratio_to_xla"] = row["temp_bytes"] / base["temp_bytes"]
        row["saved_pct"] = 100.0 * (1.0 - row["ratio_to_xla"])
        goal = GOALS.get((row["op"], row["direction"])) if row.get("kernel") else None
        row["goal_pct"] = goal
        if goal is not None:
            row["meets_goal"] = row["saved_pct"] >= goal
    if ref is not None and row is not ref and row["temp_bytes"] is not None and ref.get("temp_bytes"):
        row["saved_vs_reference_pct"] = 100.0 * (1.0 - row["temp_bytes"] / ref["temp_bytes"])
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
    """The table's note: a failed TPU-interpreter attempt is named by its exception type only
    (the JSON keeps the whole text)."""
    if not note:
        return ""
    parts = []
    for part in note.split("; "):
        if part.startswith("tpu-interp: "):
            part = "TPU interpreter failed (" + part[len("tpu-interp: "):].split(":")[0] + "), generic interpret used"
        parts.append(part)
    return "; ".join(parts)


def _format_row(row: dict) -> str:
    return " | ".join(_cells(row))


def _cells(row: dict) -> list[str]:
    if row["error"]:
        tail = ["-", "-", "-", "-", "-", "-", "ERROR: " + row["error"]]
    else:
        ratio = "1 (base)" if row["impl"] == "xla" else (f"{row['ratio_to_xla']:.4f}" if row["ratio_to_xla"] is not None else "-")
        saved = f"{row['saved_pct']:.2f}%" if row["saved_pct"] is not None else "-"
        if row["meets_goal"] is None:
            goal = "-"
        else:
            goal = ("yes" if row["meets_goal"] else "NO") + f" (>={row['goal_pct']}%)"
        if row["time_s"] is not None:
            t = f"{row['time_s'] * 1e3:.2f} ms"
        else:
            t = row["time_note"] or "-"
        tr = "1 (base)" if row["impl"] == "xla" and row["time_s"] is not None else (
            f"{row['time_ratio_to_xla']:.2f}" if row["time_ratio_to_xla"] is not None else "-")
        tail = [_bytes(row["temp_bytes"]), ratio, saved, goal, t, tr, _short_note(row.get("note"))]
    return [row["op"], row["shape"], row["case"], row["dtype"], row["impl"], row["direction"],
            row["analysed_as"] or "-"] + tail


HEADER = ["op", "shapes", "case", "dtype", "impl", "dir", "analysed as", "temp memory", "vs xla",
          "saved", "goal met", "time/call", "time vs xla", "note"]


def format_table(rows: list[dict]) -> str:
    """A Markdown table (readable as plain text too)."""
    body = [_cells(r) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(HEADER)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    out = [line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(b) for b in body]
    return "\n".join(out)


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "nproc": os.cpu_count()}
    try:
        info["nproc"] = int(subprocess.run(["nproc"], capture_output=True, text=True, timeout=5).stdout.strip())
    except Exception:  # noqa: BLE001
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
    except Exception:  # noqa: BLE001
        pass
    try:
        import jax
        info["jax"] = jax.__version__
        info["jax_backend"] = jax.default_backend()
    except Exception:  # noqa: BLE001
        pass
    return info


# ---- CLI ------------------------------------------------------------------------------------------
def _parse_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise UserError(f"--{what}: expected a comma-separated list of {', '.join(allowed)}; found {text!r}")
    return items


def add_arguments(parser) -> None:
    from train.data import bench as data_bench

    parser.add_argument("what", choices=["kernels", "data"], help="what to benchmark")
    data_bench.add_arguments(parser)
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    parser.add_argument("--shapes", default=",".join(SHAPE_SETS),
                        help=f"comma-separated shape sets (default: {','.join(SHAPE_SETS)})")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated ops (default: {','.join(OPS)})")
    parser.add_argument("--impls", default=None,
                        help="comma-separated implementation names to keep (default: all registered; "
                             "xla is always kept as the baseline)")
    parser.add_argument("--no-time", dest="time", action="store_false",
                        help="memory analysis only: time nothing")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row (median; default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before timing (default 2)")
    parser.add_argument("--compile-timeout", type=float, default=180.0,
                        help="seconds allowed per compile before the row records an error (default 180)")
    parser.add_argument("--sum-loss", action="store_true",
                        help="measure forward+backward as value_and_grad of sum(outputs) instead of the default "
                             "(inputs, output cotangents) -> (outputs, grads), where outputs and cotangents are "
                             "the program's own outputs and arguments, not temps")
    parser.add_argument("--verbose", action="store_true", help="print each row as it is measured")


def _command_line(args) -> str:
    parts = ["torchlyra", "bench", "kernels", "--shapes", args.shapes, "--ops", args.ops]
    if args.impls:
        parts += ["--impls", args.impls]
    if not args.time:
        parts.append("--no-time")
    if args.sum_loss:
        parts.append("--sum-loss")
    if args.json:
        parts += ["--json", args.json]
    return " ".join(parts)


def run(args) -> int:
    if args.what == "data":
        from train.data import bench as data_bench
        return data_bench.run(args)
    shapes = _parse_list(args.shapes, SHAPE_SETS, "shapes")
    ops = _parse_list(args.ops, OPS, "ops")
    if args.repeats < 1 or args.warmup < 0:
        raise UserError(f"--repeats must be >= 1 and --warmup >= 0; found {args.repeats}, {args.warmup}")

    import jax  # noqa: F401 - after argument checks, so bad input fails fast

    from jax_bridge import registry

    keep = None if args.impls is None else {s.strip() for s in args.impls.split(",") if s.strip()} | {"xla"}
    log = lambda s: s is not None and print(s, file=sys.stderr, flush=True)
    started = time.perf_counter()
    rows = []
    for op in ops:
        impls = registry.implementations(op)
        impls = {"xla": impls["xla"], **{n: i for n, i in impls.items() if n != "xla"}}  # base first
        if keep is not None:
            impls = {n: i for n, i in impls.items() if n in keep}
        for shape in shapes:
            for case in _cases(op, shape):
                rows.extend(_bench_case(case, impls, args, log))
    elapsed = time.perf_counter() - started

    print(format_table(rows))
    goal_rows = [r for r in rows if r["meets_goal"] is not None]
    met = sum(r["meets_goal"] for r in goal_rows)
    errors = sum(1 for r in rows if r["error"])
    big = [r for r in goal_rows if r["shape"] == "lyra-small"]
    print(f"\n{len(rows)} rows in {elapsed:.0f} s; {errors} rows with errors. Goal (Lyra's published savings, "
          f"stated for Lyra Small shapes) met in {sum(r['meets_goal'] for r in big)} of {len(big)} lyra-small rows "
          f"that have one ({met} of {len(goal_rows)} over all shape sets; at tiny shapes fixed overheads dominate).")
    print("temp memory: compiled-program temporaries (memory_analysis().temp_size_in_bytes), compile only; "
          "fwd+bwd is the vjp program (inputs, output cotangents) -> (outputs, grads) unless --sum-loss. "
          "opaque: each pallas_call replaced by an opaque call with its output shapes, i.e. what the program "
          "holds outside the kernels (kernel VMEM not counted); tpu-interp: TPU kernel under the TPU interpreter; interpret: generic Pallas interpreter "
          "(copies inputs, overstates); plain: plain JAX. Times: CPU, tiny shapes, plain-JAX implementations only.")
    if args.json:
        report = dict(
            command=_command_line(args),
            date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            machine=machine_info(), elapsed_s=round(elapsed, 1), goals={f"{k[0]} {k[1]}": v for k, v in GOALS.items()},
            settings=dict(shapes=shapes, ops=ops, time=args.time, repeats=args.repeats, warmup=args.warmup,
                          backward="value_and_grad of sum(outputs)" if args.sum_loss else "vjp with output cotangents as inputs",
                          compile_timeout_s=args.compile_timeout),
            rows=rows)
        directory = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(directory, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}")
    return 0
