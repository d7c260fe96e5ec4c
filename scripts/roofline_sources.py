"""Which source ops a compiled step's roofline time comes from (BENCHMARKS "`plan --roofline`:
how fast could it run?"): runs `torchlyra plan ... --roofline` and sums the roofline time of every
op of the chosen categories by the `op_name` its HLO metadata gives (the torch op or JAX primitive it
lowers from), loop trips included. `plan --roofline` itself lists only the five costliest ops.

    python scripts/roofline_sources.py [--categories elementwise,copies] [--match REGEX] [--top 40] \\
        -- --preset lyra-small --topology v6e:2x2 --mesh none --seq-len 4096 --batch-size 16 --remat save-matmuls

--match REGEX: also print the ops whose op_name matches and their total (e.g. `routed_experts`:
the MoE dispatch). Ops without an op_name are the compiler's own (HBM <-> VMEM prefetches and
evictions).
"""
import argparse
import collections
import os
import re
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--categories", default="elementwise,copies",
                        help="roofline categories to list, by prefix (default: elementwise,copies)")
    parser.add_argument("--match", default=None, help="regex on op_name: list those ops and their total")
    parser.add_argument("--top", type=int, default=40, help="source groups printed (default 40)")
    parser.add_argument("plan_args", nargs=argparse.REMAINDER, help="-- then `torchlyra plan` arguments")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jax_bridge import roofline
    from train.cli import main as cli

    captured = {}
    priced = roofline.roofline

    def keep(compiled, generation, **kw):
        captured.update(text=roofline.module_text(compiled), generation=generation)
        return priced(compiled, generation, **kw)

    roofline.roofline = keep
    plan_args = [a for a in args.plan_args if a != "--"]
    if cli(["plan", *plan_args, "--roofline"]) != 0 or not captured:
        sys.exit("the plan did not compile a step")
    text = captured["text"]
    source = {}
    for line in text.splitlines():
        defined = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if defined:
            found = re.search(r'op_name="([^"]*)"', line)
            source[defined.group(1)] = found.group(1) if found else ""
    ops, _, _ = roofline.collect_ops(text, roofline.xla_cost_fn())
    peak, bandwidth = roofline.device_peaks(captured["generation"])
    fixed = roofline.op_cost(captured["generation"])
    prefixes = tuple(args.categories.split(","))
    chosen = [(roofline.op_seconds(op, peak, bandwidth, fixed)[0] * op.trips, op) for op in ops
              if op.category.startswith(prefixes)]
    groups, counts = collections.defaultdict(float), collections.Counter()
    for seconds, op in chosen:
        name = re.sub(r"\[\d+\]", "", source.get(op.name, ""))
        key = "/".join(name.split("/")[-2:]) if name else "(no op_name: the compiler's own copies)"
        groups[key] += seconds
        counts[key] += 1
    print(f"\n{args.categories}: {sum(s for s, _ in chosen) * 1e3:.2f} ms over {len(chosen)} ops, by source:")
    for key, seconds in sorted(groups.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {seconds * 1e3:8.2f} ms {counts[key]:5d} ops  {key}")
    if args.match:
        hits = sorted(((s, op) for s, op in chosen if re.search(args.match, source.get(op.name, ""))),
                      key=lambda t: -t[0])
        print(f"\nops matching {args.match!r}: {sum(s for s, _ in hits) * 1e3:.2f} ms over {len(hits)} ops")
        for seconds, op in hits:
            print(f"  {seconds * 1e3:7.3f} ms x{op.trips:<3} {op.name:36} {op.shape[:70]}")


if __name__ == "__main__":
    main()
