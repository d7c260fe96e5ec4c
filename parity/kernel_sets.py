"""The kernel sets the parity suite runs: by default all-xla, then each other registered
implementation of each op with the rest at xla (`default_kernel_sets`), or the sets a user names
(`parse_kernel_sets`, e.g. 'attention=pallas,moe=xla'). `covering_kernel_sets` packs isolated sets
into the fewest sets that still run every implementation once (the test suite's bfloat16 rows).
"""
from __future__ import annotations

from collections.abc import Mapping

from jax_bridge import registry
from pallas_kernels.platform import host_platform
from parity.report import SKIP, Row
from formats.errors import UserError


def kernel_label(choice: Mapping[str, str]) -> str:
    return ",".join(f"{op}={choice[op]}" for op in registry.OPS)


def default_kernel_sets(platform: str | None = None, unrouted: dict[str, str] | None = None
                        ) -> tuple[list[dict[str, str]], list[Row]]:
    """All-xla, then each other registered implementation of each op with the rest at xla.
    Implementations registered for other platforms only are returned as SKIP rows (listed in
    the report, never dropped silently), as is each op of `unrouted` (op -> why the model makes no
    call of it: a module model's own experts, say), whose implementations would run nothing."""
    platform = platform or host_platform()
    base = {op: "xla" for op in registry.OPS}
    unrouted = unrouted or {}
    sets = [dict(base)]
    skipped = [Row(f"{op}=*", "-", "skip", "kernel set", status=SKIP, message=f"the model makes no {op} call: {why}")
               for op, why in unrouted.items()]
    for op in (op for op in registry.OPS if op not in unrouted):
        for name, impl in registry.implementations(op).items():
            if name == "xla":
                continue
            choice = {**base, op: name}
            if not impl.trains:
                skipped.append(Row(kernel_label(choice), "-", "skip", "kernel set", status=SKIP,
                                   message=f"{op}={name} is generation only (no backward): checked against the "
                                           f"reference by tests/test_kernel_decode.py and the generation tests"))
            elif platform not in impl.platforms:
                skipped.append(Row(kernel_label(choice), "-", "skip", "kernel set", status=SKIP,
                                   message=f"{op}={name} runs on {', '.join(impl.platforms)}, not on {platform}"))
            else:
                sets.append(choice)
    return sets, skipped


def covering_kernel_sets(sets) -> list[dict[str, str]]:
    """The fewest kernel sets that run every non-xla implementation of `sets` once: set k takes
    each op's k-th implementation (`pallas`, ours, first, so set 0 is our kernels together), the
    ops that have run out at xla. A failure here names a combination, not one kernel: the suite
    keeps isolated sets where its bounds are tight (float32) and covers bfloat16 this way."""
    per_op = {op: [] for op in registry.OPS}
    for choice in sets:
        for op, name in choice.items():
            if name != "xla" and name not in per_op[op]:
                per_op[op].append(name)
    for names in per_op.values():
        names.sort(key=lambda name: name != "pallas")          # stable: registry order after ours
    depth = max((len(names) for names in per_op.values()), default=0)
    return [{op: names[k] if k < len(names) else "xla" for op, names in per_op.items()} for k in range(depth)]


def parse_kernel_sets(specs) -> list[dict[str, str]]:
    """Kernel sets from strings like 'attention=pallas,moe=xla' (several per string with ';'),
    or dicts. Ops a set does not name run at `xla`; a bare name ('pallas') applies to every op.
    Unknown ops or implementations are a UserError."""
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    sets = []
    for spec in specs:
        parts = [spec] if isinstance(spec, Mapping) else [p.strip() for p in spec.split(";") if p.strip()]
        for part in parts:
            try:
                choice = registry.parse_kernel_spec(part)
            except registry.KernelError as e:
                raise UserError(str(e)) from None
            if isinstance(part, str) and "=" in part:
                named = {p.split("=", 1)[0].strip() for p in part.split(",")}
            else:
                named = set(part) if isinstance(part, Mapping) else set(registry.OPS)
            choice = {op: (name if op in named else "xla") for op, name in choice.items()}
            for op, name in choice.items():
                known = registry.implementations(op)
                if name != "auto" and name not in known:
                    raise UserError(f"--kernels: unknown implementation {op}={name}; "
                                    f"registered: {', '.join(known)}")
            sets.append(choice)
    if not sets:
        raise UserError("--kernels: no kernel set given")
    return sets
