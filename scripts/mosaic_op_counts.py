#!/usr/bin/env python3
"""What a Pallas kernel's body costs in TPU instructions, on a CPU host: each Mosaic kernel of an
op's forward+backward program compiled for a TPU (the real compiler, deviceless) and the
operations of its final LLO counted by unit, side by side with a baseline saved earlier.

    python scripts/mosaic_op_counts.py --op attention --impl pallas --shape lyra-small \
        [--case full] [--topology v5e:1x1] [--json OUT] [--baseline EARLIER.json]

The counts are static: every operation of the kernel's body once (a loop body once, each
branch of `pl.when` once), not how often it runs. They tell what a change to a kernel's body
adds or removes (a lane permute, a multiply per score), which a CPU host cannot time; a chip
times it (`torchlyra bench kernels`). Units, by the LLO operation's name:
  mxu      vmatmul, vmatres, matmul_*          the matrix unit's pushes and results
  xlu      *.xlane.*, vperm*, vsetperm, vrot*  cross-lane work: reductions, permutes, rotates
  eup      vexp, vln, vrecip, vrsqrt, ...      transcendentals
  vpu      the other vector operations        elementwise arithmetic, selects, packs, casts
  memory   vector_load, vector_store           VMEM loads and stores
How to compare two versions: run at the first with --json A.json, then at the second with
--baseline A.json.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

UNITS = ("mxu", "xlu", "eup", "vpu", "memory")
EUP = ("vexp", "vln", "vlog", "vrecip", "vrsqrt", "vsqrt", "vtanh", "vpow", "vsigmoid")


def unit_of(name: str) -> str | None:
    """The unit of one LLO operation name ('vadd.f32', 'vmax.xlane.f32', ...); None: scalar or
    bookkeeping (constants, address arithmetic, types)."""
    if name.startswith(("vmatmul", "vmatres", "matmul_")):
        return "mxu"
    if ".xlane" in name or name.startswith(("vperm", "vsetperm", "vrot")):
        return "xlu"
    if name.startswith(EUP):
        return "eup"
    if name.startswith(("vector_load", "vector_store")):
        return "memory"
    if name.startswith("v"):
        return "vpu"
    return None


def count_dump(dump_dir: str) -> dict[str, dict]:
    """{kernel name: {"ops": {op: n}, "units": {unit: n}}} of every kernel's final LLO in a
    --xla_mosaic_dump_to directory (a kernel is its module's `func.func @NAME`, the pallas_call's name)."""
    kernels = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*post-finalize-llo.txt"))):
        text = Path(path).read_text()
        named = re.search(r"func\.func @([\w.]+)\(", text)
        name = named.group(1) if named else Path(path).name
        ops = collections.Counter(re.findall(r"\bllo\.([a-z_0-9.]+)", text))
        units = collections.Counter()
        for op, n in ops.items():
            unit = unit_of(op)
            if unit:
                units[unit] += n
        key, i = name, 2
        while key in kernels:                        # two kernels of the same name: keep both
            key, i = f"{name}#{i}", i + 1
        kernels[key] = {"ops": dict(sorted(ops.items())), "units": {u: units.get(u, 0) for u in UNITS}}
    return kernels


def compile_with_dump(op: str, impl: str, shape: str, case_label: str | None, topology: str, dump_dir: str) -> str:
    """Compile the op's forward+backward at the benchmark case for `topology` with Mosaic's
    dumps written to `dump_dir` (libtpu reads LIBTPU_INIT_ARGS when it starts: set here, before
    JAX is imported). Returns the case's label."""
    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} --xla_mosaic_dump_to={dump_dir}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jax_bridge import registry, tpu_compile
    from train.bench.kernel_cases import abstract_inputs, kernel_cases, make_fn

    cases = kernel_cases(op, shape, dtype="bfloat16")
    chosen = [c for c in cases if case_label is None or case_label in c.label]
    if not chosen:
        raise SystemExit(f"--case {case_label!r}: none of {[c.label for c in cases]}")
    case = chosen[0]
    device = tpu_compile.device_of(topology)
    implementation = registry.implementations(op)[impl]
    fn = implementation.honouring_contract(implementation.load())
    kwargs = registry.target_keywords(fn, "tpu", tpu_compile.generation(device))
    tpu_compile.compile_for(make_fn(fn, case, "fwd+bwd", kwargs), abstract_inputs(case), device)
    return case.label


def table(counts: dict, baseline: dict | None) -> str:
    lines = [f"{'kernel':28s} " + " ".join(f"{u:>16s}" for u in UNITS)]
    for kernel, row in counts.items():
        before = (baseline or {}).get(kernel, {}).get("units")
        cells = []
        for u in UNITS:
            now = row["units"][u]
            cells.append(f"{before[u]:>7d} -> {now:<6d}" if before else f"{now:>16d}")
        lines.append(f"{kernel:28s} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", required=True, help="attention, cross_entropy, moe, moe_mxfp4")
    parser.add_argument("--impl", default="pallas")
    parser.add_argument("--shape", default="lyra-small", help="a shape set of `bench kernels`: tiny, lyra-small, gpt-oss-20b")
    parser.add_argument("--case", help="a part of the case's label, e.g. 'full' or 'win128' (default: the first case)")
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--baseline", help="counts written earlier with --json, shown beside these (before -> now)")
    parser.add_argument("--ops", action="store_true", help="also list every LLO operation that changed (or all)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as dump:
        label = compile_with_dump(args.op, args.impl, args.shape, args.case, args.topology, dump)
        counts = count_dump(dump)
    if not counts:
        raise SystemExit("no Mosaic kernel was compiled (is this implementation a Pallas kernel on TPU?)")
    baseline = json.loads(Path(args.baseline).read_text())["kernels"] if args.baseline else None
    print(f"{args.op}={args.impl} at {args.shape} ({label}), bf16, forward+backward, compiled for {args.topology}; "
          f"static counts of each kernel's final LLO" + (f", before ({args.baseline}) -> now" if baseline else ""))
    print(table(counts, baseline))
    if args.ops:
        for kernel, row in counts.items():
            before = (baseline or {}).get(kernel, {}).get("ops", {})
            changed = {op: (before.get(op, 0), n) for op, n in row["ops"].items() if before.get(op, 0) != n}
            changed.update({op: (n, 0) for op, n in before.items() if op not in row["ops"]})
            print(f"  {kernel}: " + ", ".join(f"{op} {a}->{b}" if baseline else f"{op} {b}"
                                              for op, (a, b) in sorted(changed.items())))
    if args.json:
        Path(args.json).write_text(json.dumps({"op": args.op, "impl": args.impl, "shape": args.shape, "case": label,
                                               "topology": args.topology, "kernels": counts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
