"""The parity suite's report: one `Row` per check (a tensor or scalar of one run against the
ground truth, its metrics, bounds and status) and the `Report` of a whole suite, printed as a
table (one summary line per check group, failing rows in full) or written as JSON. A run that
could not be made is one row: REFUSED where an implementation's op contract refused it (the
registry's ContractError: the kernel is not at fault, the request is), ERROR otherwise
(`unmade_run_row`); either fails the suite.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jax_bridge import registry
from parity import tolerances

PASS, FAIL, ERROR, SKIP, INFO = "PASS", "FAIL", "ERROR", "SKIP", "INFO"   # INFO: reported, not bounded
REFUSED = "REFUSED"     # an op contract refused the kernel set (registry.ContractError)
# Names of the aggregate rows (they start with "<": the report groups them apart) and the suffix
# of the per-expert rows (one row per expert of an expert weight stack, named with its token count).
VECTOR = "<all parameters>"
GRAD_VECTOR = "<all gradients>"
GRAD_NORM = "<global norm>"
PER_EXPERT_FORMAT = " (expert {})"


def is_expert_row(name: str) -> bool:
    return name.endswith(")") and " (expert " in name


@dataclass
class Row:
    """One check: a tensor (or scalar) of one run (kernel set x dtype) against the ground truth.
    category: logits | loss | grad | param | routing | hf | error | contract | skip. A row without
    bounds is reported only (status INFO)."""
    kernels: str
    dtype: str
    category: str
    name: str
    metrics: dict = field(default_factory=dict)
    bounds: tuple = ()
    status: str = ""
    message: str = ""

    def __post_init__(self):
        if not self.status:
            self.status = INFO if not self.bounds else \
                PASS if all(b.holds(self.metrics) for b in self.bounds) else FAIL

    @property
    def failed(self) -> bool:
        return self.status in (FAIL, ERROR, REFUSED)

    def to_dict(self) -> dict:
        return {"kernels": self.kernels, "dtype": self.dtype, "category": self.category, "name": self.name,
                "metrics": self.metrics, "tolerance": [b.to_dict() for b in self.bounds],
                "tolerance_text": tolerances.describe(self.bounds), "status": self.status,
                "passed": not self.failed, "message": self.message}

    def line(self) -> str:
        text = f"  {self.status:<5} {self.category:<7} {self.name:<46} {_format_metrics(self.metrics)}"
        if self.status not in (ERROR, REFUSED, SKIP):
            text += f"  [{tolerances.describe(self.bounds) or 'reported only'}]"
        return text + (f"  {self.message}" if self.message else "")


def attention_summary(windows) -> str:
    """The parity header's attention: each layer's window as the model describes it (0: full)."""
    sliding = [w for w in windows if w]
    if not sliding:
        return "no sliding window"
    counts = [f"{len(sliding)} sliding"] + ([f"{len(windows) - len(sliding)} full"] if len(sliding) < len(windows) else [])
    sizes = sorted(set(sliding))
    return f"window{'s' if len(sizes) > 1 else ''} {'/'.join(map(str, sizes))} on {' + '.join(counts)} layers"


@dataclass
class Report:
    setup: dict
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and not any(r.failed for r in self.rows)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.failed]

    def runs(self) -> list[tuple[str, str]]:
        """(kernels, dtype) in the order they ran."""
        return list(dict.fromkeys((r.kernels, r.dtype) for r in self.rows))

    def select(self, kernels: str | None = None, dtype: str | None = None, category: str | None = None) -> list[Row]:
        return [r for r in self.rows if (kernels is None or r.kernels == kernels)
                and (dtype is None or r.dtype == dtype) and (category is None or r.category == category)]

    def failing_names(self, kernels: str | None = None, dtype: str | None = None,
                      category: str | None = None) -> set[str]:
        return {r.name for r in self.select(kernels, dtype, category) if r.failed}

    def format(self, verbose: bool = False) -> str:
        """Per run: one summary line per check group (worst value and where), then every failing
        row in full (every row with verbose)."""
        s = self.setup
        if "windows" in s:
            attention = attention_summary(s["windows"])
        else:                                       # a setup without per-layer windows: read the config's
            cfg = s.get("model_config", {})
            kinds = cfg.get("layer_types") or []
            attention = attention_summary([cfg.get("sliding_window") if k == "sliding_attention" else 0 for k in kinds])
        lines = [f"parity: {s.get('source', 'model')} ({s['n_layers']} layers, d_model {s['d_model']}, "
                 f"{s['n_experts']} experts, {attention}), batch {s['batch']}, seq_len {s['seq_len']}, seed {s['seed']}, "
                 f"{s.get('ignored_labels', 0)} labels ignored, backend {s['backend']}; "
                 f"post-step params from {s['post_step']}",
                 f"loss coefficients: {s.get('loss_coefficients', {})}; kernel options: {s.get('kernel_options') or '-'}",
                 "ground truth: eager PyTorch float32 on CPU; tolerances: parity/tolerances.py"]
        if "segments" in s:
            lines.append(f"segments: {s['segments']}")
        shown_coverage = set()
        for kernels, dtype in self.runs():
            rows = self.select(kernels, dtype)
            status = next((s for s in (ERROR, REFUSED) if any(r.status == s for r in rows)), None) or \
                (FAIL if any(r.failed for r in rows) else SKIP if all(r.status == SKIP for r in rows) else PASS)
            lines.append(f"== {kernels} | {dtype} | {status}")
            if kernels in s.get("coverage", {}) and kernels not in shown_coverage:
                shown_coverage.add(kernels)
                lines.extend(f"  cover {line}" for line in s["coverage"][kernels])
            if status in (ERROR, REFUSED, SKIP):
                lines.extend(r.line() for r in rows if r.status == status)
                continue
            # Per-tensor rows apart from the aggregates <...>; the per-expert rows in one group
            # whatever their bounds (which follow each expert's token count).
            groups: dict[tuple, list[Row]] = {}
            for r in rows:
                key = (r.category, "per expert") if is_expert_row(r.name) else (r.category, r.bounds, r.name[:1] == "<")
                groups.setdefault(key, []).append(r)
            for key, group in groups.items():
                lines.append(_expert_summary_line(group) if key[1] == "per expert" else _summary_line(key[0], key[1], group))
            shown = rows if verbose else [r for r in rows if r.failed]
            if shown:
                lines.append("  -- every check:" if verbose else "  -- failing checks:")
                lines.extend(r.line() for r in shown)
        n_fail = len(self.failures())
        bad_runs = sorted({f"{r.kernels} | {r.dtype}" for r in self.failures()})
        verdict = (f"parity: PASS ({len(self.runs())} runs, {len(self.rows)} checks)" if self.passed else
                   f"parity: FAIL ({n_fail} failing of {len(self.rows)} checks, in: {'; '.join(bad_runs)})")
        lines.append(verdict)
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"setup": self.setup, "passed": self.passed,
                "tolerances": {dt: {k: [b.to_dict() for b in bs] for k, bs in checks.items()}
                               for dt, checks in tolerances.TOLERANCES.items()},
                "entries": [r.to_dict() for r in self.rows]}


SHOWN_FAILURES = 12       # failing checks printed under a run's verdict as it finishes


def run_verdict(kernels: str, dtype: str, rows: list[Row]) -> list[str]:
    """The progress lines of one finished run: PASS / FAIL, then its failing checks (at most
    SHOWN_FAILURES): a suite stopped early (a time limit, a later crash) still says what failed,
    not only the table at the end."""
    failing = [r for r in rows if r.failed]
    lines = [f"  {'FAIL' if failing else 'PASS'} {kernels} | {dtype}"] + [r.line() for r in failing[:SHOWN_FAILURES]]
    if len(failing) > SHOWN_FAILURES:
        lines.append(f"  ... and {len(failing) - SHOWN_FAILURES} more failing checks (the final table lists them)")
    return lines


def unmade_run_row(kernels: str, dtype: str, error: BaseException, name: str = "kernel set", hint: str = "") -> Row:
    """The row of a run that could not be made: REFUSED (category `contract`) when an op contract
    refused an implementation, its one line as the message; ERROR otherwise, with the exception's
    type and first line. `hint`: appended to a refusal."""
    if isinstance(error, registry.ContractError):
        return Row(kernels, dtype, "contract", name, status=REFUSED, message=f"{first_line(error)}{hint}")
    return Row(kernels, dtype, "error", name, status=ERROR, message=f"{type(error).__name__}: {first_line(error)}")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _format_value(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "tokens":
        return str(int(value))
    if key.endswith("cos"):
        return f"{value:.7f}"
    if key.startswith("top1") or key == "mismatch" or key.endswith("ratio"):
        return f"{value:.4f}"
    return f"{value:.2e}"


def _format_metrics(metrics: dict) -> str:
    return " ".join(f"{k}={_format_value(k, v)}" for k, v in metrics.items())


def _summary_line(category: str, bounds: tuple, group: list[Row]) -> str:
    failing = sum(r.failed for r in group)
    status = FAIL if failing else PASS if bounds else INFO
    if len(group) == 1:
        r = group[0]
        detail = f"{r.name}: {_format_metrics(r.metrics)}"
    else:
        # Worst value of each bounded metric (of rel and cos when reported only), and where.
        watched = bounds or [tolerances.Bound(m, 0.0, upper=not m.endswith("cos"))
                             for m in ("rel", "update_cos") if any(m in r.metrics for r in group)]
        parts = []
        for b in watched:
            def badness(r, b=b):
                v = r.metrics.get(b.metric)
                return (r.failed, np.inf if v is None or not np.isfinite(v) else v if b.upper else -v)
            worst = max(group, key=badness)
            parts.append(f"worst {b.metric}={_format_value(b.metric, worst.metrics.get(b.metric))} ({worst.name})")
        detail = f"{len(group)} tensors, {failing} failing; " + ", ".join(parts)
    return f"  {status:<5} {category:<7} {detail}  [{tolerances.describe(bounds) or 'reported only'}]"


def _expert_summary_line(group: list[Row]) -> str:
    """The per-expert rows of one run: how many were judged (the rest had too few tokens to judge,
    see tolerances.expert_bounds), how many failed, and the worst judged slice of each metric."""
    judged = [r for r in group if r.status != INFO]
    failing = sum(r.failed for r in group)
    status = FAIL if failing else PASS if judged else INFO
    parts = []
    for metric, upper in (("slice_cos", False), ("slice_norm_off", True)):
        def badness(r, metric=metric, upper=upper):
            v = r.metrics.get("slice_cos") if metric == "slice_cos" else abs(np.log(r.metrics.get("slice_norm_ratio", 1.0)))
            return (r.failed, np.inf if not np.isfinite(v) else v if upper else -v)
        if judged:
            worst = max(judged, key=badness)
            shown = "slice_cos" if metric == "slice_cos" else "slice_norm_ratio"
            parts.append(f"worst {shown}={_format_value(shown, worst.metrics.get(shown))} ({worst.name}, "
                         f"{worst.metrics.get('tokens', '?')} tokens)")
    detail = (f"{len(group)} expert slices, {len(group) - len(judged)} with too few tokens to judge (reported), "
              f"{failing} failing; " + ", ".join(parts))
    return f"  {status:<5} grad    {detail}  [bounds by token count: tolerances.expert_bounds]"
