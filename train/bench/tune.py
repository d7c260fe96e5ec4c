"""`torchlyra bench kernels --tune TABLE.json`: sweep our Pallas kernels' tiles on the present
device and keep the fastest per call shape in a table the op registry reads (a committed
jax_bridge/tiles/GENERATION.json by default on that TPU generation, any other with
`--kernel-options TABLE.json`; format in jax_bridge/kernel_tiles.py).

The call shapes are those of `bench kernels`' shape sets (`--shapes`), or those of a training run
(`--preset` or `--model-config`, `--batch-size`, `--seq-len`): its step's forward is traced,
without weights, on this device's platform in its compute dtype, and every kernel call's key is
taken, so the table holds exactly the keys that run looks up (one chip, no mesh).

Each candidate is the op's forward and backward in one program (inputs and output cotangents in,
outputs and input gradients out), compiled and timed on this device (median of `--repeats` calls
after `--warmup`). A candidate the compiler refuses (a tile over VMEM, a shape rule) is reported
with its error and skipped: whether a tile fits is the compiler's verdict. On CPU the kernels run
in the Pallas interpreter, whose speed says nothing of a TPU's: there the sweep tests the
mechanics only. The jax-shipped kernels (splash, megablox) are not swept. An existing table of
the same device kind keeps its other entries (a key tuned again is replaced); the file is
written atomically.
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


def run_model(args):
    """The model of --preset / --model-config on the `meta` device (no weights), at --seq-len;
    None when neither is given."""
    import torch

    from torch_model.config import ConfigError, get_preset
    from torch_model.model import GptOssForCausalLM

    if args.preset is None and args.model_config is None:
        return None
    if args.preset is not None and args.model_config is not None:
        raise UserError("--preset and --model-config name two models: give one")
    if args.seq_len is None or args.seq_len < 1 or args.batch_size < 1:
        raise UserError(f"--tune of a run's shapes: give --seq-len and --batch-size >= 1 (found {args.seq_len}, "
                        f"{args.batch_size})")
    try:
        if args.model_config is not None:
            from torch_model.transformers_lm import TransformersSpec

            with torch.device("meta"):
                return TransformersSpec.from_file(args.model_config).replace(max_seq_len=args.seq_len).build()
        cfg = get_preset(args.preset).replace(max_seq_len=args.seq_len)
    except ConfigError as e:
        raise UserError(str(e)) from None
    with torch.device("meta"):
        return GptOssForCausalLM(cfg)


def run_keys(model, ops: list[str], platform: str, batch: int, seq_len: int, compute_dtype: str | None) -> dict:
    """{op: [call keys]} of the kernel calls of `model`'s train step on one chip of `platform`
    (`batch` rows of `seq_len` per micro-batch, in `compute_dtype`; None: the platform's): its
    forward traced without weights, every tunable op probed (kernel_tiles.probe_options). The
    keys do not depend on which implementation runs, so each op is traced with its plain-JAX one."""
    import jax
    import jax.numpy as jnp

    from jax_bridge import kernel_tiles
    from jax_bridge.step import StepConfig, TrainStep

    tunable = sorted({op for op, _ in CANDIDATES if op in ops})
    step_cfg = StepConfig(kernels={op: "xla" for op in tunable}, platform=platform, compute_dtype=compute_dtype,
                          kernel_options=kernel_tiles.probe_options([(op, "xla") for op in tunable], platform))
    step = TrainStep(model, step_cfg=step_cfg)
    params = {**step.abstract_state().params, **step.abstract_frozen()}
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    with kernel_tiles.recording() as lookups:
        jax.eval_shape(lambda p, t: step.loss_and_metrics(p, t[:, :-1], t[:, 1:])[0], params, tokens)
    keys: dict = {}
    for u in lookups:
        if u.op not in tunable:     # the ops left on "auto" (Pallas on a TPU) are looked up too
            continue
        if u.key not in keys.setdefault(u.op, []):
            keys[u.op].append(u.key)
    return keys


def _cases(args, shapes: list[str], ops: list[str], platform: str) -> list:
    """The problems to tune: the run's call keys (--preset / --model-config), else the shape sets'."""
    from jax_bridge import kernel_tiles
    from train.bench.kernel_cases import abstract_inputs, case_for_key, kernel_cases

    model = run_model(args)
    if model is None:
        return [case for op in ops if any(o == op for o, _ in CANDIDATES) for shape in shapes
                for case in kernel_cases(op, shape)]
    cases = []
    for op, keys in run_keys(model, ops, platform, args.batch_size, args.seq_len, args.compute_dtype).items():
        for key in keys:
            case = case_for_key(op, key)
            found = kernel_tiles.call_key(op, tuple(abstract_inputs(case)), case.kwargs)
            if found != key:          # the problem timed must be the call looked up
                raise AssertionError(f"--tune: the {op} problem of {key!r} has key {found!r}")
            cases.append(case)
    print(f"{len(cases)} call shapes of {args.model_config or args.preset} at batch {args.batch_size} x seq "
          f"{args.seq_len}: " + "; ".join(f"{c.op} {c.label} {c.dtype}" for c in cases))
    return cases


def run(args, shapes: list[str], ops: list[str]) -> int:
    from jax_bridge import kernel_tiles, registry
    from train.bench.kernel_cases import abstract_inputs, short_error

    candidates = parse_candidates(args.tune_candidates)
    platform, device_kind = _device()
    table = _load_or_new(args.tune, platform, device_kind)
    note = " (Pallas interpreted: the mechanics, not a choice)" if platform == "cpu" else ""
    print(f"Tuning kernel tiles on {device_kind} ({platform}){note}")
    tuned = 0
    for case in _cases(args, shapes, ops, platform):
        op, shape = case.op, case.shape
        for impl in [i for (o, i) in candidates if o == op and registry.runs_on(o, i, platform)]:
            fn = registry.implementations(op)[impl].load()
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
            _write(args.tune, table)       # after each entry: a run stopped midway keeps what it measured
            tuned += 1
            worst_s = max(r[0] for r in results)
            print(f"{op}={impl} {shape} {case.label}: {' '.join(f'{k}={v}' for k, v in best.items())} "
                  f"{best_s * 1e3:.3f} ms, {len(results)} candidates (slowest {worst_s * 1e3:.3f} ms, "
                  f"{worst_s / best_s:.2f}x)")
    _write(args.tune, table)
    generation = kernel_tiles.generation_of(device_kind)
    committed = generation is not None and os.path.abspath(args.tune) == kernel_tiles.committed_path(generation)
    total = sum(len(per_key) for per_impl in table["entries"].values() for per_key in per_impl.values())
    print(f"wrote {args.tune}: {tuned} entries tuned now, {total} in all; " + (f"programs compiled for a TPU {generation} take it by default" if committed
                         else f"use it with --kernel-options {args.tune}"))
    return 0


def _write(path: str, table: dict) -> None:
    from formats.atomic import write_atomic

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, (json.dumps(table, indent=1, sort_keys=True) + "\n").encode())
