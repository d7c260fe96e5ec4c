"""`torchlyra bench kernels` on an accelerator host: every registered implementation of each op
compiled for this host's device and TIMED there, forward and forward+backward, at the shape sets
of Lyra's benchmark (tiny, Lyra Small, gpt-oss-20b; what fits the chip), side by side in one run.

Per row: the median seconds per call (calls back to back, enough of them that a sample lasts a
few milliseconds, so dispatch does not dominate small shapes), the achieved FLOP/s and HBM bytes/s
with their share of the chip's published peaks (jax_bridge/roofline.CHIPS), the speed-up over the
`xla` implementation of the same problem (its time / this time), the device compiler's temporary
bytes, and, where Lyra published one for v6e, Lyra's speed-up over its matched XLA.

FLOPs are the problem's useful work, the same for every implementation (a kernel that recomputes
does more): attention 4·B·Hq·D per visible (query, key) pair forward, twice that backward;
cross-entropy 2·N·H·V forward, 4·N·H·V backward; MoE 6·M·H·I forward, twice that backward.
Bytes are the least HBM traffic any implementation needs: its inputs and outputs read or written
once (forward+backward: also the output cotangents and the input gradients).
"""
from __future__ import annotations

import math
import statistics
import sys
import time

from train.bench import kernel_peers
from train.bench.kernel_cases import Case, concrete_inputs, float_positions, kernel_cases, make_fn, short_error
from train.bench.table import markdown_table

# Lyra's published v6e speed-ups over matched XLA (its README's kernel table), per (op, direction,
# case): what our v5e rows are read beside. MoE: Lyra times the up projection + SwiGLU and the
# down projection apart (4.80x, 3.76x); our op fuses both, so its row carries both figures.
LYRA_V6E = {("cross_entropy", "fwd", None): "1.45x", ("cross_entropy", "fwd+bwd", None): "1.16x",
            ("attention", "fwd", "window"): "3.98x", ("attention", "fwd+bwd", "window"): "5.27x",
            ("moe", "fwd", None): "up+SwiGLU 4.80x, down 3.76x"}
SAMPLE_SECONDS = 0.005      # one timing sample runs calls back to back for at least this long
MAX_CALLS = 200


def lyra_figure(case: Case, direction: str) -> str:
    window = "window" if case.dims.get("window") else None
    return LYRA_V6E.get((case.op, direction, window if case.op == "attention" else None), "")


def visible_pairs(t: int, window: int) -> int:
    """(query, key) pairs a causal (window W > 0: sliding) attention row of T tokens computes."""
    if not window or window >= t:
        return t * (t + 1) // 2
    return window * (window + 1) // 2 + (t - window) * window


def useful_flops(case: Case, direction: str) -> float:
    """The problem's FLOPs (module docstring); forward+backward is three times the forward."""
    d = case.dims
    if case.op == "attention":
        fwd = 4.0 * d["B"] * d["Hq"] * d["D"] * visible_pairs(d["T"], d["window"])
    elif case.op == "cross_entropy":
        fwd = 2.0 * d["N"] * d["H"] * d["V"]
    else:                               # moe, moe_mxfp4: up (H -> 2I) and down (I -> H) per row
        fwd = 6.0 * d["M"] * d["H"] * d["I"]
    return fwd * (3 if direction == "fwd+bwd" else 1)


def least_bytes(inputs, outputs, floats: tuple[int, ...], direction: str) -> int:
    """Inputs and outputs once; forward+backward adds the output cotangents and the gradients of
    the float inputs (at positions `floats`)."""
    size = lambda a: math.prod(a.shape) * a.dtype.itemsize
    total = sum(size(x) for x in inputs) + sum(size(o) for o in outputs)
    if direction == "fwd+bwd":
        total += sum(size(o) for o in outputs) + sum(size(inputs[i]) for i in floats)
    return total


def time_per_call(compiled, inputs, warmup: int, repeats: int) -> float:
    """Median seconds per call over `repeats` samples, each a run of back-to-back calls."""
    import jax

    for _ in range(max(1, warmup)):
        jax.block_until_ready(compiled(*inputs))
    start = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    once = time.perf_counter() - start
    calls = max(1, min(MAX_CALLS, math.ceil(SAMPLE_SECONDS / max(once, 1e-7))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = compiled(*inputs)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def measure(fn, case: Case, direction: str, kernel_kwargs: dict, inputs, warmup: int, repeats: int,
            floats: tuple[int, ...] | None = None) -> dict:
    """One row's figures (time, FLOP/s, bytes/s, temp bytes) or its error, compiled for and run on
    the default device. `floats`: the inputs that take gradients (default: the case's float
    inputs; a peer in its own layout gives its own)."""
    import jax

    from jax.tree_util import tree_leaves

    floats = float_positions(case) if floats is None else floats
    row = dict(time_s=None, temp_bytes=None, flops=useful_flops(case, direction), bytes=None, error=None)
    try:
        forward = make_fn(fn, case, "fwd", kernel_kwargs)
        outputs = tree_leaves(jax.eval_shape(forward, *inputs))
        args = list(inputs)
        if direction == "fwd+bwd":
            from pallas_kernels.memory import vjp_program

            key = jax.random.PRNGKey(1)
            args += [jax.random.normal(key, o.shape, "float32").astype(o.dtype) for o in outputs]
            program = vjp_program(forward, floats, n_inputs=len(inputs))
        else:
            program = forward
        compiled = jax.jit(program).lower(*args).compile()
        memory = compiled.memory_analysis()
        row["temp_bytes"] = int(memory.temp_size_in_bytes) if memory is not None else None
        row["bytes"] = least_bytes(inputs, outputs, floats, direction)
        row["time_s"] = time_per_call(compiled, args, warmup, repeats)
    except Exception as e:  # noqa: BLE001 - a row records its failure (out of HBM, a refused tile)
        row["error"] = short_error(e)
    return row


def run(args, shapes: list[str], ops: list[str], keep: set | None) -> list[dict]:
    """Rows for every (op, shape set, case, implementation, direction) on this host's device."""
    import jax

    from jax_bridge import registry, roofline, tpu_compile
    from pallas_kernels.platform import host_platform

    platform = host_platform()
    device = jax.devices()[0]
    generation = tpu_compile.generation(device) if platform == "tpu" else None
    peak_flops, bandwidth = roofline.device_peaks(generation) if generation in roofline.CHIPS else (None, None)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    peers = platform == "tpu" and (keep is None or kernel_peers.LIBRARY in keep)
    if peers and kernel_peers.version() is None:
        log(f"{kernel_peers.LIBRARY} does not import here: its peer rows are left out")
        peers = False
    rows = []
    for op in ops:
        impls = {n: i for n, i in registry.implementations(op).items()
                 if i.trains and registry.runs_on(op, n, platform) and (keep is None or n in keep)}
        impls = {"xla": impls["xla"], **{n: i for n, i in impls.items() if n != "xla"}}   # the base first
        peer = kernel_peers.peer_of(op) if peers else None
        for shape in shapes:
            for case in kernel_cases(op, shape, dtype=args.dtype):
                inputs = concrete_inputs(case)
                peer_inputs = None if peer is None else peer.prepare(case, inputs)
                for direction in ("fwd", "fwd+bwd"):
                    block = []

                    def add(name, figures, note=""):
                        row = dict(op=op, shape=shape, case=case.label, dtype=case.dtype, impl=name,
                                   direction=direction, device=device.device_kind,
                                   lyra_v6e=lyra_figure(case, direction), note=note, **figures)
                        if row["time_s"]:
                            row["tflops"] = row["flops"] / row["time_s"] / 1e12
                            row["gbps"] = row["bytes"] / row["time_s"] / 1e9
                            row["flops_share"] = row["flops"] / row["time_s"] / peak_flops if peak_flops else None
                            row["hbm_share"] = row["bytes"] / row["time_s"] / bandwidth if bandwidth else None
                        base = (block[0] if block else row)["time_s"]      # xla's, measured first
                        row["speedup_vs_xla"] = base / row["time_s"] if base and row["time_s"] else None
                        block.append(row)
                        log(format_row(row))      # with its ratio: a run cut short keeps what it printed

                    for name, impl in impls.items():
                        fn = impl.honouring_contract(impl.load())
                        kwargs = registry.target_keywords(fn, platform, generation)
                        add(name, measure(fn, case, direction, kwargs, inputs, args.warmup, args.repeats))
                    if peer is not None:
                        fn = peer.build(case, kernel_peers.implementation(op, platform))
                        add(peer.name, measure(fn, case, direction, {}, peer_inputs, args.warmup, args.repeats,
                                               floats=peer.floats(case)), note=peer.note)
                    rows.extend(block)
    return rows


HEADER = ["op", "shapes", "case", "dtype", "impl", "dir", "time/call", "TFLOP/s", "% peak", "GB/s", "% HBM",
          "vs xla", "Lyra v6e vs xla", "temp", "note"]


def _cells(row: dict) -> list[str]:
    head = [row["op"], row["shape"], row["case"], row["dtype"], row["impl"], row["direction"]]
    if row["time_s"] is None:
        note = row.get("note", "")
        return head + ["-"] * 6 + [row["lyra_v6e"], "-", (f"{note}; " if note else "") + "ERROR: " + (row["error"] or "")[:160]]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    speed = row.get("speedup_vs_xla")
    temp = row["temp_bytes"]
    return head + [f"{row['time_s'] * 1e3:.3f} ms", f"{row['tflops']:.1f}", pct(row.get("flops_share")),
                   f"{row['gbps']:.0f}", pct(row.get("hbm_share")),
                   "1 (base)" if row["impl"] == "xla" else ("-" if speed is None else f"{speed:.2f}x"),
                   row["lyra_v6e"], "-" if temp is None else f"{temp / (1 << 20):.1f} MiB", row.get("note", "")]


def format_row(row: dict) -> str:
    return " | ".join(_cells(row))


def format_table(rows: list[dict]) -> str:
    return markdown_table(HEADER, [_cells(r) for r in rows])


METHOD = ("time/call: median of --repeats samples, each a run of back-to-back calls of the compiled program on "
          "the device (after --warmup calls); fwd+bwd is the vjp program (inputs, output cotangents) -> (outputs, "
          "input gradients). TFLOP/s: the problem's useful FLOPs (attention 4*B*Hq*D per visible pair, "
          "cross-entropy 2*N*H*V, MoE 6*M*H*I; backward twice the forward) per second; GB/s: inputs and outputs "
          "(and cotangents, gradients) once, per second; % of the chip's published peaks. vs xla: the xla "
          "implementation's time over this one's. temp: the device compiler's temporaries.")
