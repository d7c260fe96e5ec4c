"""`torchlyra bench kernels --tune TABLE.json`: sweep our Pallas kernels' tiles on the present
device and keep the fastest per call shape in a table the op registry reads
(`--kernel-options TABLE.json`; format in jax_bridge/kernel_tiles.py).

Each candidate is the op's forward and backward in one program (inputs and output cotangents in,
outputs and input gradients out), compiled and timed on this device (median of `--repeats` calls
after `--warmup`). A candidate the compiler refuses (a tile over VMEM, a shape rule) is reported
with its error and skipped: whether a tile fits is the compiler's verdict. On CPU the kernels run
in the Pallas interpreter, whose speed says nothing of a TPU's: there the sweep tests the
mechanics only. The jax-shipped kernels (splash, megablox) are not swept.
"""
from __future__ import annotations

import itertools
import json
import os
import sys

from formats.errors import UserError

# Tile values tried per (op, implementation): option -> values, and the case dimension each
# option may not exceed.
CANDIDATES = {
    ("attention", "pallas"): {"block_q": (128, 256, 512, 1024), "block_kv": (128, 256, 512, 1024)},
    ("cross_entropy", "pallas"): {"block_n": (256, 512, 1024, 2048), "block_v": (256, 512, 1024)},
    # block_m_dw: the dW kernel's own row tile (the defaults give it 256 where the row kernels take 512)
    ("moe", "pallas"): {"block_m": (128, 256, 512), "block_i": (128, 256, 512), "block_m_dw": (128, 256, 512)},
}
LIMIT = {"block_q": "T", "block_kv": "T", "block_n": "N", "block_v": "V", "block_m": "M", "block_i": "I",
         "block_m_dw": "M"}


def parse_candidates(text: str | None) -> dict:
    """'cross_entropy.pallas.block_n=128/256,cross_entropy.pallas.block_v=512' -> CANDIDATES with
    those options' values replaced (the other options of a named implementation keep theirs)."""
    out = {k: dict(v) for k, v in CANDIDATES.items()}
    if not text:
        return out
    for part in text.split(","):
        key, sep, values = part.partition("=")
        path = key.strip().split(".")
        if not sep or len(path) != 3 or (path[0], path[1]) not in CANDIDATES or path[2] not in CANDIDATES[path[0], path[1]]:
            known = ", ".join(f"{op}.{impl}.{o}" for (op, impl), opts in CANDIDATES.items() for o in opts)
            raise UserError(f"--tune-candidates: expected OP.IMPL.OPTION=V1/V2/..., one of {known}; found {part!r}")
        try:
            out[path[0], path[1]][path[2]] = tuple(int(v) for v in values.split("/"))
        except ValueError:
            raise UserError(f"--tune-candidates: {key.strip()} takes integers separated by '/', found {values!r}") from None
    return out


def candidate_options(op: str, impl: str, dims: dict, candidates: dict) -> list[dict]:
    """Every combination of the implementation's tile values that fits the case's dimensions."""
    options = candidates[op, impl]
    names = list(options)
    allowed = [[v for v in options[n] if v <= dims[LIMIT[n]]] or [min(options[n])] for n in names]
    return [dict(zip(names, combo)) for combo in itertools.product(*allowed)]


def _device():
    import jax

    from pallas_kernels.platform import host_platform
    return host_platform(), jax.devices()[0].device_kind


def _measure(case, fn, platform: str, tiles: dict, args):
    """Seconds per forward+backward call of `fn` with `tiles` (compiled and run here)."""
    import jax
    import jax.numpy as jnp

    from train.bench.kernel_cases import abstract_inputs, concrete_inputs, make_fn, time_calls

    from jax_bridge.registry import target_keywords
    from jax_bridge.step import target_generation

    kw = {**target_keywords(fn, platform, target_generation(platform, None)), **tiles}
    program = make_fn(fn, case, "fwd+bwd", kw, vjp=True)
    abstract = abstract_inputs(case, fn, kw, vjp=True)
    compiled = jax.jit(program).lower(*abstract).compile()
    inputs = concrete_inputs(case)
    key = jax.random.PRNGKey(1)
    for spec in abstract[len(inputs):]:                       # the output cotangents
        key, sub = jax.random.split(key)
        inputs.append(jax.random.normal(sub, spec.shape, jnp.float32).astype(spec.dtype))
    return time_calls(compiled, inputs, args.warmup, args.repeats)


def _load_or_new(path: str, platform: str, device_kind: str) -> dict:
    from jax_bridge import kernel_tiles
    if not os.path.exists(path):
        return kernel_tiles.new_table(platform, device_kind)
    try:
        table = kernel_tiles.read(path)
    except kernel_tiles.TileTableError as e:
        raise UserError(f"--tune: {e}") from None
    if (table["platform"], table["device_kind"]) != (platform, device_kind):
        raise UserError(f"--tune: {path} holds tiles tuned on {table['device_kind']} ({table['platform']}); this "
                        f"device is {device_kind} ({platform}): write a table per device kind")
    return table


def run(args, shapes: list[str], ops: list[str]) -> int:
    from formats.atomic import write_atomic
    from jax_bridge import kernel_tiles, registry
    from train.bench.kernel_cases import abstract_inputs, kernel_cases, short_error

    candidates = parse_candidates(args.tune_candidates)
    platform, device_kind = _device()
    table = _load_or_new(args.tune, platform, device_kind)
    note = " (Pallas interpreted: the mechanics, not a choice)" if platform == "cpu" else ""
    print(f"Tuning kernel tiles on {device_kind} ({platform}){note}")
    tuned = 0
    for op in ops:
        for impl in [i for (o, i) in candidates if o == op and registry.runs_on(o, i, platform)]:
            fn = registry.implementations(op)[impl].load()
            for shape in shapes:
                for case in kernel_cases(op, shape):
                    results = []
                    for tiles in candidate_options(op, impl, case.dims, candidates):
                        label = " ".join(f"{k}={v}" for k, v in tiles.items())
                        try:
                            seconds = _measure(case, fn, platform, tiles, args)
                        except Exception as e:   # the compiler's verdict on this tile: reported, skipped
                            print(f"  {op}={impl} {case.label} {label}: refused ({short_error(e)})", file=sys.stderr)
                            continue
                        results.append((seconds, tiles))
                        if args.verbose:
                            print(f"  {op}={impl} {case.label} {label}: {seconds * 1e3:.3f} ms", file=sys.stderr)
                    if not results:
                        raise UserError(f"--tune: every candidate tile of {op}={impl} at {case.label} was refused")
                    best_s, best = min(results, key=lambda r: r[0])
                    key = kernel_tiles.call_key(op, tuple(abstract_inputs(case)), case.kwargs)
                    kernel_tiles.add_entry(table, op, impl, key, best, best_s)
                    tuned += 1
                    worst_s = max(r[0] for r in results)
                    print(f"{op}={impl} {shape} {case.label}: {' '.join(f'{k}={v}' for k, v in best.items())} "
                          f"{best_s * 1e3:.3f} ms, {len(results)} candidates (slowest {worst_s * 1e3:.3f} ms, "
                          f"{worst_s / best_s:.2f}x)")
    os.makedirs(os.path.dirname(os.path.abspath(args.tune)), exist_ok=True)
    write_atomic(args.tune, (json.dumps(table, indent=1, sort_keys=True) + "\n").encode())
    print(f"wrote {args.tune}: {tuned} entries tuned now; use it with --kernel-options {args.tune}")
    return 0
