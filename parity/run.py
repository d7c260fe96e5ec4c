"""The parity suite: the lowered JAX train step against eager CPU PyTorch, per kernel set.

Ground truth is eager PyTorch in float32 on CPU: `GptOssForCausalLM` forward (logits),
forward/backward of the training loss (every parameter's gradient) and one `MuonAdamW` step.
The lowered side is `TrainStep(model, opt_cfg, StepConfig(kernels=set, compute_dtype=dtype))`,
for every requested kernel set and compute dtype; per run it compares

  logits     the forward in the step's compute dtype (max_abs, rel, cos over all tokens; top1
             and kl over the tokens both paths routed alike, see tolerances.py)
  loss       the training loss
  grad       every parameter's gradient, by parameter name (so a failure names layer and op),
             the whole gradient vector and the global gradient norm
  param      every parameter after one optimizer step, by name, plus the whole vector
  routing    per MoE layer, the fraction of tokens whose chosen experts differ. Measured on the
             real choices: a forward hook on each `mlp.router` records the router logits and
             the top-k experts that each path's own forward computed (eager: torch.topk on the
             eager hidden states; lowered: the traced forward's top-k on its hidden states, in
             the compute dtype), so it measures end-to-end routing agreement.

The post-step parameters come from the lowered optimizer (`TrainStep.update`: the torch
`muon_adamw_update` traced through torchax) applied to that run's lowered gradients. For one
micro-batch this is the train step's math exactly; the optimizer is compiled once per suite
rather than once per kernel set. `full_step=True` (`--full-step`) instead runs the compiled train
step itself (`TrainStep.__call__`), which compiles forward + backward a second time per run.

Default kernel sets: all ops at `xla`, then, for each op, each other registered implementation
with the remaining ops at `xla`, so every registered implementation of every op is covered once
(one registered only for other backends is listed as a SKIP line). A kernel set that cannot be
built or run (an implementation not written yet, a kernel that raises) is an ERROR line and fails
the suite; nothing is skipped or replaced silently.

The parity inputs make every part of the loss and every mask case visible: presets run with
their sliding window cut to PARITY_WINDOW (16) at sequence 80, with small kernel tiles
(PARITY_TILES: attention blocks 16/32, so the sequence spans several blocks, the window skips
whole blocks and the last block is partial), about one label in ten at the ignore index, and
non-zero router balance, router z-loss and LM z-loss coefficients (PARITY_LOSS). The report
prints, per kernel set, the mask cases it exercised (`parity/coverage.py`).

Self-test (`--selftest`, `parity/selftest.py`): the planted-bug catalogue of `parity/planted.py`
must fail. Trajectory (`--trajectory`, `parity/trajectory.py`): 100 steps against a golden
eager trajectory.

Tolerances: `parity/tolerances.py`. CLI: `torchlyra parity` (`add_arguments`, `run`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_bridge import registry
from jax_bridge.lowering import optimizer_function, optimizer_state_to_jax, params_to_jax
from jax_bridge.step import COMPUTE_DTYPES, StepConfig, TrainStep, cast_params
from pallas_kernels.platform import host_platform
from parity import compare, coverage, planted, tolerances
from torch_model.model import IGNORE_INDEX
from torch_model.config import ConfigError, ModelConfig, get_preset
from torch_model.model import GptOssForCausalLM
from torch_model.optim import MuonAdamW, OptimizerConfig, plan_parameters
from train.errors import UserError

PASS, FAIL, ERROR, SKIP, INFO = "PASS", "FAIL", "ERROR", "SKIP", "INFO"   # INFO: reported, not bounded
VECTOR = "<all parameters>"
GRAD_VECTOR = "<all gradients>"
GRAD_NORM = "<global norm>"
PER_EXPERT = " (per expert)"

# The default parity inputs (see the module docstring).
PARITY_SEQ_LEN = 80
PARITY_WINDOW = 16
PARITY_IGNORE_FRACTION = 0.1
PARITY_TILES = ("attention.pallas.block_q=16,attention.pallas.block_kv=32,"
                "cross_entropy.pallas.block_n=32,cross_entropy.pallas.block_v=1024,"
                "moe.pallas.block_m=16,moe.pallas.block_i=128,moe.megablox.block_m=16,moe.xla.block_m=16")
# Large enough that each term's gradient is visible through bf16 noise (a sign error in the LM
# z-loss must fail in bf16), small enough that cross-entropy still dominates the loss. The router
# z-loss at 0.1 (training uses ~1e-4) also gives the router a well-conditioned gradient term: with
# 0.01 the router's gradient is a difference of nearly equal terms through the top-k softmax and
# its bf16 error reached rel 0.61 / norm ratio 0.86 (tiny, seeds 0-2), too noisy to see a 20%
# scaling; with 0.1 the same runs gave rel <= 0.14 / norm ratio 0.99..1.01.
PARITY_LOSS = {"router_aux_loss_coef": 0.1, "router_z_loss_coef": 0.1, "lm_z_loss_coef": 0.05}


def parity_config(cfg: ModelConfig, window: int | None = PARITY_WINDOW, loss: Mapping | None = None) -> ModelConfig:
    """The parity run's model: the sliding window cut to `window` (None: unchanged) and the loss
    coefficients of PARITY_LOSS (or `loss`). The weights' shapes do not change."""
    changes = dict(PARITY_LOSS if loss is None else loss)
    if not cfg.is_moe:
        changes = {k: v for k, v in changes.items() if not k.startswith("router")}
    if window is not None and cfg.sliding_window:
        changes["sliding_window"] = window
        changes["layer_types"] = cfg.layer_types
    return cfg.replace(**changes)


# =============================================================================================
# Report
# =============================================================================================
@dataclass
class Row:
    """One check: a tensor (or scalar) of one run (kernel set x dtype) against the ground truth.
    category: logits | loss | grad | param | routing | hf | error | skip. A row without bounds
    is reported only (status INFO)."""
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
        return self.status in (FAIL, ERROR)

    def to_dict(self) -> dict:
        return {"kernels": self.kernels, "dtype": self.dtype, "category": self.category, "name": self.name,
                "metrics": self.metrics, "tolerance": [b.to_dict() for b in self.bounds],
                "tolerance_text": tolerances.describe(self.bounds), "status": self.status,
                "passed": not self.failed, "message": self.message}

    def line(self) -> str:
        text = f"  {self.status:<5} {self.category:<7} {self.name:<46} {_format_metrics(self.metrics)}"
        if self.status not in (ERROR, SKIP):
            text += f"  [{tolerances.describe(self.bounds) or 'reported only'}]"
        return text + (f"  {self.message}" if self.message else "")


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
        cfg = s.get("model_config", {})
        kinds = cfg.get("layer_types", [])
        windows = [f"{kinds.count(k)} {k.split('_')[0]}" for k in ("sliding_attention", "full_attention") if k in kinds]
        lines = [f"parity: {s.get('source', 'model')} ({s['n_layers']} layers, d_model {s['d_model']}, "
                 f"{s['n_experts']} experts, window {cfg.get('sliding_window', '?')} on "
                 f"{' + '.join(windows) or '?'} layers), batch {s['batch']}, seq_len {s['seq_len']}, seed {s['seed']}, "
                 f"{s.get('ignored_labels', 0)} labels ignored, backend {s['backend']}; "
                 f"post-step params from {s['post_step']}",
                 f"loss coefficients: {s.get('loss_coefficients', {})}; kernel options: {s.get('kernel_options') or '-'}",
                 "ground truth: eager PyTorch float32 on CPU; tolerances: parity/tolerances.py"]
        shown_coverage = set()
        for kernels, dtype in self.runs():
            rows = self.select(kernels, dtype)
            status = ERROR if any(r.status == ERROR for r in rows) else FAIL if any(r.failed for r in rows) \
                else SKIP if all(r.status == SKIP for r in rows) else PASS
            lines.append(f"== {kernels} | {dtype} | {status}")
            if kernels in s.get("coverage", {}) and kernels not in shown_coverage:
                shown_coverage.add(kernels)
                lines.extend(f"  cover {line}" for line in s["coverage"][kernels])
            if status in (ERROR, SKIP):
                lines.extend(r.line() for r in rows if r.status == status)
                continue
            groups: dict[tuple, list[Row]] = {}      # per-tensor rows apart from the aggregates <...>
            for r in rows:
                groups.setdefault((r.category, r.bounds, r.name.startswith("<")), []).append(r)
            for (category, bounds, _), group in groups.items():
                lines.append(_summary_line(category, bounds, group))
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


def _format_value(key: str, value) -> str:
    if value is None:
        return "-"
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


# =============================================================================================
# Kernel sets
# =============================================================================================
def kernel_label(choice: Mapping[str, str]) -> str:
    return ",".join(f"{op}={choice[op]}" for op in registry.OPS)


def default_kernel_sets(platform: str | None = None) -> tuple[list[dict[str, str]], list[Row]]:
    """All-xla, then each other registered implementation of each op with the rest at xla.
    Implementations registered for other platforms only are returned as SKIP rows (listed in
    the report, never dropped silently)."""
    platform = platform or host_platform()
    base = {op: "xla" for op in registry.OPS}
    sets, skipped = [dict(base)], []
    for op in registry.OPS:
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


# =============================================================================================
# The two runs
# =============================================================================================
@dataclass
class Run:
    """What both paths produce, as numpy (float32 or the compute dtype)."""
    logits: np.ndarray
    loss: float
    grads: dict[str, np.ndarray]
    grad_norm: float
    params_after: dict[str, np.ndarray]
    routing: list[tuple[np.ndarray, np.ndarray]]     # per MoE layer: (router logits [N, E], experts [N, k])


def _routers(model) -> list[tuple[str, torch.nn.Module]]:
    return [(f"model.layers.{i}.mlp.router", layer.mlp.router)
            for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "router")]


@contextlib.contextmanager
def _capture_routing(model):
    """Record (router logits, chosen experts) of every MoE layer, in layer order."""
    captured = []
    handles = [router.register_forward_hook(lambda mod, inputs, out: captured.append((out[0], out[2])))
               for _, router in _routers(model)]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(jax.device_get(x))


def parity_inputs(vocab_size: int, batch: int, seq_len: int, seed: int,
                  ignore_fraction: float = PARITY_IGNORE_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels), int64 [batch, seq_len]: uniform random tokens seeded with `seed`,
    labels the next token, a seeded `ignore_fraction` of the labels at the ignore index (at least
    one per row when the fraction is > 0, and never all of them)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)
    ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if ignore_fraction > 0:
        n = min(seq_len - 1, max(1, round(ignore_fraction * seq_len)))
        for row in labels:
            row[torch.randperm(seq_len, generator=gen)[:n]] = IGNORE_INDEX
    return ids, labels


def eager_run(model, ids: torch.Tensor, labels: torch.Tensor, opt_cfg: OptimizerConfig) -> Run:
    """Ground truth: eager float32 PyTorch. `model` is left unchanged (the step runs on a copy)."""
    with torch.no_grad(), _capture_routing(model) as captured:
        logits = model(ids)
    routing = [(_np(lg), _np(ex)) for lg, ex in captured]
    trained = copy.deepcopy(model)
    optimizer = MuonAdamW(trained, opt_cfg)
    trained.zero_grad()
    out = trained(ids, labels)
    out["loss"].backward()
    grads = {n: _np(p.grad) if p.grad is not None else np.zeros(p.shape, np.float32)
             for n, p in trained.named_parameters()}
    optimizer.step()
    return Run(logits=_np(logits), loss=float(out["loss"].item()), grads=grads,
               grad_norm=float(optimizer.last_stats["grad_norm"].item()),
               params_after={n: _np(p) for n, p in trained.named_parameters()}, routing=routing)


class _Lowered:
    """What every lowered run shares: parameters, initial optimizer state, and the optimizer
    update compiled once per optimizer configuration (it does not depend on the kernels or the
    compute dtype)."""

    def __init__(self, model, opt_cfg: OptimizerConfig):
        self.plan = plan_parameters(model.named_parameters())
        self.params = params_to_jax(model)
        self.opt_state = optimizer_state_to_jax(model, self.plan)
        self.opt_cfg = opt_cfg
        self._updates: dict[OptimizerConfig, object] = {}

    def update(self, grads, opt_cfg: OptimizerConfig | None = None):
        """(params after one step, grad_norm) from `grads` with `opt_cfg` (default: the suite's)."""
        opt_cfg = opt_cfg or self.opt_cfg
        if opt_cfg not in self._updates:
            self._updates[opt_cfg] = jax.jit(optimizer_function(self.plan, opt_cfg))
        after, _, stats = self._updates[opt_cfg](self.params, grads, self.opt_state, jnp.float32(1.0))
        return after, stats["grad_norm"]


class LoweredProbe:
    """The lowered forward (logits and routing) and gradients of one kernel set and compute dtype,
    compiled once: `probe(params, ids, labels, selector=0) -> (logits, routing, loss, grads)`.
    `selector` picks a planted bug when the kernel set is the planted one (parity/planted.py);
    other kernels ignore it."""

    def __init__(self, model, opt_cfg: OptimizerConfig, kernels: Mapping[str, str], dtype: str,
                 kernel_options=None):
        # Parity compares against float32-exact eager torch: every non-kernel matmul at 'highest'.
        self.model = model
        self.step = TrainStep(model, opt_cfg, StepConfig(kernels=dict(kernels), compute_dtype=dtype,
                                                         matmul_precision="highest",
                                                         kernel_options=_options_for(kernels, kernel_options)))
        self.kernels = self.step.kernels
        self._jitted = jax.jit(self._probe)

    def _probe(self, params, ids, labels, selector):
        step = self.step
        with planted.selected(selector):
            with _capture_routing(self.model) as captured:
                with step.routing():
                    logits = step.forward(cast_params(params, step.compute_dtype), ids)
                routing = [step.env.t2j_iso(pair) for pair in captured]
            (loss, _), grads = jax.value_and_grad(step.loss_and_metrics, has_aux=True)(params, ids, labels)
        return logits, routing, loss, grads

    def __call__(self, params, ids, labels, selector: int = 0):
        return self._jitted(params, jnp.asarray(ids, jnp.int32), jnp.asarray(labels, jnp.int32),
                            jnp.int32(selector))


def _options_for(kernels: Mapping[str, str], options) -> dict:
    """The kernel options of the implementations this set uses (the others are not checked)."""
    nested = registry.parse_kernel_options(options)
    return {op: {name: opts for name, opts in per.items() if kernels.get(op) == name}
            for op, per in nested.items() if kernels.get(op) in per}


def lowered_run(probe: LoweredProbe, shared: _Lowered, ids, labels, selector: int = 0,
                opt_cfg: OptimizerConfig | None = None, full_step_tokens=None) -> Run:
    """One lowered run: the probe's forward and gradients, then one optimizer step on them (or,
    with `full_step_tokens` [batch, seq_len + 1], the compiled train step itself)."""
    logits, routing, loss, grads = probe(shared.params, ids, labels, selector)
    if full_step_tokens is not None:
        state, metrics = probe.step(probe.step.init_state(), jnp.asarray(full_step_tokens, jnp.int32)[None])
        after, grad_norm = state.params, metrics["grad_norm"]
    else:
        after, grad_norm = shared.update(grads, opt_cfg)
    return Run(logits=_np(logits), loss=float(loss), grads={n: _np(g) for n, g in grads.items()},
               grad_norm=float(grad_norm), params_after={n: _np(p) for n, p in after.items()},
               routing=[(_np(lg), _np(ex)) for lg, ex in routing])


def _is_stacked_experts(name: str, array) -> bool:
    """An expert weight stack [E, in, out] (checked per expert). Not the biases [E, out]: a bias
    gradient is a plain sum over the expert's tokens, so one token routed differently in bf16
    moves a small expert's slice by up to 7% (measured), while its weights stay within 3%."""
    return ".mlp.experts." in name and np.ndim(array) >= 3 and np.shape(array)[0] > 1


def compare_runs(ref: Run, got: Run, before: Mapping[str, np.ndarray], kernels: str, dtype: str,
                 router_names: list[str]) -> list[Row]:
    """Every check of one run against the ground truth."""
    tol = lambda check, name=None: tolerances.bounds(dtype, check, name)  # noqa: E731
    same_route = None
    if router_names and len(got.routing) == len(ref.routing) == len(router_names):
        same_route = np.logical_and.reduce([compare.same_experts(g[1], e[1]) for g, e in zip(got.routing, ref.routing)])
    rows = [Row(kernels, dtype, "logits", "logits", compare.logits_metrics(got.logits, ref.logits, same_route),
                tol("logits")),
            Row(kernels, dtype, "loss", "loss", compare.tensor_metrics(got.loss, ref.loss), tol("loss"))]
    names = list(ref.grads)
    flat = lambda d: np.concatenate([np.asarray(d[n], np.float64).ravel() for n in names])  # noqa: E731
    for name in names:
        if name in got.grads:
            rows.append(Row(kernels, dtype, "grad", name, compare.tensor_metrics(got.grads[name], ref.grads[name]),
                            tol("grad", name)))
        else:
            rows.append(Row(kernels, dtype, "grad", name, bounds=tol("grad", name), status=FAIL,
                            message="no gradient in the lowered run"))
    for name in names:        # each expert's slice on its own: one expert wrong is ~1/E of the tensor
        if name in got.grads and _is_stacked_experts(name, ref.grads[name]):
            metrics, worst = compare.per_slice_metrics(got.grads[name], ref.grads[name])
            rows.append(Row(kernels, dtype, "grad", name + PER_EXPERT, metrics, tol("grad_expert"),
                            message=f"worst: expert {worst}"))
    if all(n in got.grads for n in names):
        rows.append(Row(kernels, dtype, "grad", GRAD_VECTOR, compare.tensor_metrics(flat(got.grads), flat(ref.grads)),
                        tol("grad_vector")))
    rows.append(Row(kernels, dtype, "grad", GRAD_NORM, compare.tensor_metrics(got.grad_norm, ref.grad_norm),
                    tol("grad_norm")))
    for name in names:
        if name in got.params_after:
            metrics = compare.tensor_metrics(got.params_after[name], ref.params_after[name])
            metrics.update(compare.update_metrics(got.params_after[name], ref.params_after[name], before[name]))
            rows.append(Row(kernels, dtype, "param", name, metrics, tol("param")))
        else:
            rows.append(Row(kernels, dtype, "param", name, bounds=tol("param"), status=FAIL,
                            message="no parameter in the lowered run"))
    if all(n in got.params_after for n in names):
        metrics = compare.tensor_metrics(flat(got.params_after), flat(ref.params_after))
        metrics.update(compare.update_metrics(flat(got.params_after), flat(ref.params_after), flat(before)))
        rows.append(Row(kernels, dtype, "param", VECTOR, metrics, tol("param_vector")))
    if len(got.routing) != len(router_names) or len(ref.routing) != len(router_names):
        rows.append(Row(kernels, dtype, "routing", "routers", bounds=tol("routing"), status=FAIL,
                        message=f"captured {len(got.routing)} lowered / {len(ref.routing)} eager router calls, "
                                f"expected {len(router_names)}"))
    else:
        for name, (g_logits, g_experts), (e_logits, e_experts) in zip(router_names, got.routing, ref.routing):
            rows.append(Row(kernels, dtype, "routing", name,
                            compare.routing_metrics(g_experts, e_experts, g_logits, e_logits), tol("routing")))
    return rows



# =============================================================================================
# The suite
# =============================================================================================
def _load_state_dict(model, state_dict: Mapping) -> None:
    tensors = {k: (v.detach() if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v, np.float32)))
               .to(torch.float32) for k, v in state_dict.items()}
    expected = dict(model.named_parameters())
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise UserError(f"state dict does not fit the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                        f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, p in expected.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise UserError(f"state dict: {name} has shape {tuple(tensors[name].shape)}, "
                            f"the model expects {tuple(p.shape)}")
    model.load_state_dict(tensors, strict=True)


_HF_METRICS = {"max_abs_err": "max_abs", "rel_err": "rel", "top1_agreement": "top1_exact"}


def _hf_rows(model_cfg, state_dict, ids) -> list[Row]:
    """Eager model vs transformers' GptOssForCausalLM (eager, float32) on the same tokens, through
    `parity.hf_parity.compare_with_transformers` (imported only for --hf), held to the `hf` check."""
    label, name = "transformers GptOssForCausalLM", "logits"
    try:
        from parity.hf_parity import compare_with_transformers

        result = compare_with_transformers(model_cfg, state_dict, ids)
    except Exception as e:  # noqa: BLE001 - a comparison that cannot run is a failed check
        return [Row(label, "float32", "hf", name, status=ERROR, message=f"{type(e).__name__}: {_first_line(e)}")]
    if not isinstance(result, Mapping) or not set(_HF_METRICS) <= set(result):
        return [Row(label, "float32", "hf", name, status=ERROR,
                    message=f"compare_with_transformers returned {result!r:.200}")]
    metrics = {ours: float(result[theirs]) for theirs, ours in _HF_METRICS.items()}
    details = ", ".join(f"{k}={v}" for k, v in result.items() if k not in _HF_METRICS)
    return [Row(label, "float32", "hf", name, metrics, tolerances.bounds("float32", "hf"), message=details)]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _check_request(dtypes, batch: int, seq_len: int, ignore_fraction: float, kernel_options) -> None:
    for dtype in dtypes:
        if dtype not in COMPUTE_DTYPES or dtype not in tolerances.TOLERANCES:
            raise UserError(f"--dtype: unknown compute dtype {dtype!r}; choose from {', '.join(tolerances.DTYPES)}")
    if batch < 1 or seq_len < 2:
        raise UserError(f"--batch must be >= 1 and --seq-len >= 2, found batch={batch}, seq_len={seq_len}")
    if not 0 <= ignore_fraction < 1:
        raise UserError(f"--ignore-fraction must be in [0, 1), found {ignore_fraction}")
    try:
        registry.check_options(kernel_options)
    except registry.KernelError as e:
        raise UserError(str(e)) from None


def build_model(model_cfg: ModelConfig, state_dict: Mapping | None, seed: int):
    model = GptOssForCausalLM(model_cfg)
    if state_dict is None:
        model.reset_parameters(seed)
    else:
        _load_state_dict(model, state_dict)
    return model


def run_parity(model_cfg: ModelConfig, state_dict: Mapping | None = None, *, kernel_sets=None,
               dtypes=("float32",), batch: int = 2, seq_len: int = PARITY_SEQ_LEN, seed: int = 0,
               opt_cfg: OptimizerConfig = OptimizerConfig(), include_hf: bool = False,
               full_step: bool = False, kernel_options=PARITY_TILES,
               ignore_fraction: float = PARITY_IGNORE_FRACTION, progress=None) -> Report:
    """Compare the lowered train step with eager PyTorch for every kernel set and dtype.

    model_cfg: the model, used as given (`parity_config` makes the parity run's model from a
    preset); state_dict: its weights (None: random init seeded with `seed`). kernel_sets: None
    (every registered implementation, see `default_kernel_sets`) or strings / dicts as
    `parse_kernel_sets` takes. dtypes: compute dtypes of the lowered run. kernel_options: tile
    sizes etc. (registry syntax). Inputs: `parity_inputs` (random ids, `ignore_fraction` of the
    labels ignored; 0 with full_step, whose token layout has no ignored labels).
    progress: callable(str) or None.
    """
    dtypes = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
    if full_step:
        ignore_fraction = 0.0
    _check_request(dtypes, batch, seq_len, ignore_fraction, kernel_options)
    if kernel_sets is None:
        sets, rows = default_kernel_sets()
    else:
        sets, rows = parse_kernel_sets(kernel_sets), []
    say = progress or (lambda msg: None)

    model = build_model(model_cfg, state_dict, seed)
    ids, labels = parity_inputs(model_cfg.vocab_size, batch, seq_len, seed, ignore_fraction)
    tokens = torch.cat([ids, labels[:, -1:]], 1).numpy() if full_step else None
    report = Report(setup={
        "n_layers": model_cfg.n_layers, "d_model": model_cfg.d_model, "n_experts": model_cfg.n_experts,
        "model_config": model_cfg.to_dict(), "weights": "random (seeded)" if state_dict is None else "state dict",
        "batch": batch, "seq_len": seq_len, "seed": seed, "dtypes": list(dtypes),
        "ignored_labels": int((labels == IGNORE_INDEX).sum()), "kernel_options": str(kernel_options or ""),
        "loss_coefficients": {k: getattr(model_cfg, k) for k in PARITY_LOSS},
        "optimizer": dataclasses.asdict(opt_cfg), "backend": host_platform(),
        "post_step": "TrainStep.__call__ (full step)" if full_step else "TrainStep.update on the lowered gradients",
        "coverage": {}, "jax": jax.__version__, "torch": torch.__version__})
    report.rows.extend(rows)

    say("eager PyTorch float32 reference ...")
    reference = eager_run(model, ids, labels, opt_cfg)
    router_names = [name for name, _ in _routers(model)]
    shared = _Lowered(model, opt_cfg)
    before = {n: _np(p) for n, p in shared.params.items()}
    for choice in sets:
        label = kernel_label(choice)
        for dtype in dtypes:
            say(f"lowered {label} | {dtype} ...")
            try:
                probe = LoweredProbe(model, opt_cfg, choice, dtype, kernel_options)
                run = lowered_run(probe, shared, ids.numpy(), labels.numpy(), full_step_tokens=tokens)
            except Exception as e:  # noqa: BLE001 - a kernel set that cannot run is a failed check
                report.rows.append(Row(label, dtype, "error", "kernel set", status=ERROR,
                                       message=f"{type(e).__name__}: {_first_line(e)}"))
                continue
            resolved = kernel_label(probe.kernels)
            report.setup["coverage"][resolved] = coverage.describe(
                probe.kernels, model_cfg, batch, seq_len, probe.step.cfg.kernel_options, labels.numpy(),
                [experts for _, experts in reference.routing])
            new_rows = compare_runs(reference, run, before, resolved, dtype, router_names)
            report.rows.extend(new_rows)
            say(f"  {'FAIL' if any(r.failed for r in new_rows) else 'PASS'} {resolved} | {dtype}")
    if include_hf:
        say("Hugging Face transformers comparison ...")
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        report.rows.extend(_hf_rows(model_cfg, state, ids.clone()))
    return report


# =============================================================================================
# CLI: torchlyra parity
# =============================================================================================
def add_arguments(parser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="tiny",
                        help="model preset, random weights seeded by --seed (default: tiny); its sliding window "
                             f"is cut to --window")
    source.add_argument("--checkpoint", metavar="DIR", help="compare a checkpoint's weights instead of a preset")
    parser.add_argument("--kernels", action="append", metavar="SET",
                        help="kernel set, e.g. 'attention=pallas,moe=xla' (unnamed ops run xla); repeatable or "
                             "';'-separated. Default: all-xla plus every other registered implementation of each op")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(tolerances.DTYPES),
                        help="compute dtype(s) of the lowered run (default: both)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=PARITY_SEQ_LEN,
                        help=f"tokens per row (default {PARITY_SEQ_LEN}: longer than the window and the tiles)")
    parser.add_argument("--window", type=int, default=PARITY_WINDOW,
                        help=f"sliding window of a preset's sliding layers (default {PARITY_WINDOW}); 0 keeps the "
                             "preset's. A checkpoint keeps its own")
    parser.add_argument("--kernel-options", default=PARITY_TILES, metavar="OPTS",
                        help="op.implementation.option=value,... (default: small tiles, so the sequence spans "
                             f"several blocks: {PARITY_TILES})")
    parser.add_argument("--ignore-fraction", type=float, default=PARITY_IGNORE_FRACTION,
                        help=f"fraction of labels at the ignore index (default {PARITY_IGNORE_FRACTION})")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights and the tokens")
    parser.add_argument("--full-step", action="store_true",
                        help="take post-step parameters from the compiled train step itself (slower; no ignored labels)")
    parser.add_argument("--hf", action="store_true", help="also compare with Hugging Face transformers")
    parser.add_argument("--selftest", action="store_true",
                        help="run the planted-bug catalogue (parity/planted.py) on a micro model: every bug must "
                             "fail, in float32 and bfloat16; exit 0 only if all are caught")
    parser.add_argument("--trajectory", action="store_true",
                        help="100 steps of a micro model on the bundled data, eager PyTorch vs the lowered step "
                             "(float32); both sides are run")
    parser.add_argument("--json", metavar="OUT", help="write every check (metrics, tolerance, pass/fail) as JSON")
    parser.add_argument("--verbose", action="store_true", help="print every check, not only the failing ones")


def _write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    except OSError as e:
        raise UserError(f"--json: cannot write {path}: {e.strerror}") from None


def run(args) -> int:
    """Run the suite from parsed arguments; print the table; 0 if every check passed, else 1."""
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.selftest or args.trajectory:
        from parity import selftest, trajectory

        code = 0
        if args.selftest:
            result = selftest.run_selftest(dtypes=tuple(args.dtype), progress=say)
            print(result.format(verbose=args.verbose))
            _write_json(args.json, result.to_json())
            code |= 0 if result.passed else 1
        if args.trajectory:
            result = trajectory.run_trajectory(eager=True, progress=say)
            print(result.format())
            if not args.selftest:
                _write_json(args.json, result.to_json())
            code |= 0 if result.passed else 1
        return code
    if args.checkpoint:
        try:
            from train.checkpoint import load_checkpoint
        except ImportError as e:
            raise UserError(f"--checkpoint: checkpoint loading is not available ({e})") from None
        state_dict, model_cfg, _ = load_checkpoint(args.checkpoint)
        model_cfg, source = parity_config(model_cfg, window=None), f"checkpoint {args.checkpoint}"
    else:
        try:
            model_cfg = get_preset(args.preset)
        except ConfigError as e:
            raise UserError(f"--preset: {e}") from None
        if args.window < 0:
            raise UserError(f"--window must be >= 0, found {args.window}")
        model_cfg = parity_config(model_cfg, window=args.window or None)
        state_dict, source = None, f"preset {args.preset}"
    report = run_parity(model_cfg, state_dict, kernel_sets=args.kernels, dtypes=tuple(args.dtype),
                        batch=args.batch, seq_len=args.seq_len, seed=args.seed, include_hf=args.hf,
                        full_step=args.full_step, kernel_options=args.kernel_options,
                        ignore_fraction=args.ignore_fraction, progress=say)
    report.setup["source"] = source
    print(report.format(verbose=args.verbose))
    _write_json(args.json, report.to_json())
    return 0 if report.passed else 1
