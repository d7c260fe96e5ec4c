"""`torchlyra parity --selftest`: the parity suite must catch every planted bug.

On a micro model (2 layers: one sliding, one full; 4 experts; window 8 at sequence 80, ignored
labels and all loss coefficients on, as the default parity run) the suite runs the planted kernel
set (parity/planted.py) once per compute dtype: first the control (no bug live: must PASS, so a
failure below is the bug's, not the planted set's), then each bug. A bug is caught when the suite
fails AND a failing check names a tensor where the bug lives (`PlantedBug.at_fault`).

Twice: on random init, and on the same model trained TRAINED_STEPS steps (`trained_weights`: eager
MuonAdamW on the trajectory's Shakespeare bytes), whose sharper logits and uneven routing are what
a user's checkpoint brings; the trained run's inputs are windows of that text. Both weight sets
share the compiled programs (the weights are arguments). Rows are packed as in the parity matrix
(segment ids and restarting positions; the planted attention takes segment ids) unless
`segments` is False.

LoRA (`run_lora_selftest`): the lowered peft model against eager peft on MICRO; the control must
pass and each bug of `planted.LORA_BUGS` (the adapter's scaling applied twice) must fail, naming
an adapter.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from parity import planted, trajectory
from parity.checks import compare_runs
from parity.inputs import build_model, parity_config, parity_inputs, reference_model, text_inputs
from parity.kernel_sets import parse_kernel_sets
from parity.lora_parity import run_lora_parity
from parity.report import Report, Row
from parity.runs import LoweredProbe, SharedLowered, eager_run, lowered_run, routers, to_numpy
from torch_model.config import ModelConfig
from torch_model.lora import parse_lora_spec
from torch_model.optim import MuonAdamW, OptimizerConfig

# Window 8, not the matrix's 16: one extra key is then 1/9 of a window instead of 1/17, which
# takes the off-by-one window bug from the edge of bf16 noise (q_proj gradient cos 0.974-0.977,
# logits top1 0.91-0.98 at window 16) to well past it (cos 0.947, top1 0.88, kl 1.6e-4).
MICRO = parity_config(ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                  n_experts=4, experts_per_token=2, expert_dim=64, max_seq_len=80), window=8)
CONTROL = "control (no bug)"
RANDOM, TRAINED = "random init", "trained"
WEIGHTS = (RANDOM, TRAINED)
# Trained with the training-time loss coefficients of `tiny` (the parity run then weights every
# term as usual); 100 steps of batch 4 take the cross-entropy on text windows from 6.26 to 2.11,
# the largest logit from 0.67 to 7.7, and leave the experts' loads uneven (39 to 125 tokens of 320).
TRAINED_STEPS, TRAINED_BATCH = 100, 4
TRAINING_LOSS = {"router_aux_loss_coef": 1e-2, "router_z_loss_coef": 0.0, "lm_z_loss_coef": 0.0}


def text_tokens() -> np.ndarray:
    """The trajectory's Shakespeare text (parity/golden, no download) as byte ids."""
    return np.frombuffer(trajectory.load_golden()["text"].encode("ascii"), np.uint8).astype(np.int64)


def trained_weights(steps: int = TRAINED_STEPS, seed: int = 0, seq_len: int = 80) -> dict[str, torch.Tensor]:
    """MICRO's weights after `steps` eager float32 MuonAdamW steps on consecutive windows of
    `text_tokens` (batch TRAINED_BATCH x seq_len, wrapping around). One torch thread: on 64-wide
    matrices threads cost more than they save (3.5x slower with 2 on a busy 2-core machine)."""
    model = build_model(MICRO.replace(**TRAINING_LOSS), None, seed)
    optimizer = MuonAdamW(model, OptimizerConfig())
    data = torch.from_numpy(text_tokens())
    per_step = TRAINED_BATCH * (seq_len + 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in tqdm(range(steps), desc="training the self-test's micro model", leave=False, disable=None):
            start = (step * per_step) % (len(data) - per_step)
            batch = data[start:start + per_step].view(TRAINED_BATCH, seq_len + 1)
            model.zero_grad()
            model(batch[:, :-1], batch[:, 1:])["loss"].backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@dataclass
class Outcome:
    bug: str
    dtype: str
    caught: bool              # the suite failed
    named: bool               # ... and named a tensor where the bug lives
    failing: list[str] = field(default_factory=list)     # failing checks, "category name"
    note: str = ""
    weights: str = RANDOM     # RANDOM or TRAINED

    @property
    def ok(self) -> bool:
        return (not self.caught) if self.bug == CONTROL else (self.caught and self.named)


@dataclass
class SelftestReport:
    outcomes: list[Outcome]
    skipped: list[tuple[str, str, str]]       # (bug, dtype, computed reason)
    report: Report                            # every check of every run
    # Per (weights, dtype), what the magnitude tests perturb: (eager run, control run, params
    # before, routers).
    controls: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and all(o.ok for o in self.outcomes)

    def weights(self) -> list[str]:
        return list(dict.fromkeys(o.weights for o in self.outcomes))

    def outcome(self, bug: str, dtype: str, weights: str = RANDOM) -> Outcome:
        return next(o for o in self.outcomes if (o.bug, o.dtype, o.weights) == (bug, dtype, weights))

    def format(self, verbose: bool = False) -> str:
        setup = self.report.setup
        lines = [f"parity self-test: planted bugs on {setup.get('model', 'a micro model')} "
                 f"({setup.get('n_layers', MICRO.n_layers)} layers, d_model {setup.get('d_model', MICRO.d_model)}, "
                 f"{setup.get('n_experts', MICRO.n_experts)} experts, window "
                 f"{setup.get('window', MICRO.sliding_window)}, seq_len {setup['seq_len']}, "
                 f"{'packed rows' if self.report.setup.get('segmented') else 'unsegmented rows'}); "
                 f"each must fail the suite, naming the tensors at fault; on {' and on '.join(self.weights())} weights",
                 f"  {'bug':<20} {'weights':<12} {'dtype':<9} {'result':<10} failing checks (tensors named)"]
        for o in self.outcomes:
            result = ("PASS" if not o.caught else "FAILED!") if o.bug == CONTROL else \
                ("caught" if o.ok else "MISSED" if not o.caught else "UNNAMED")
            lines.append(f"  {o.bug:<20} {o.weights:<12} {o.dtype:<9} {result:<10} {_names(o.failing, verbose)}"
                         + (f"  [{o.note}]" if o.note else ""))
        for bug, dtype, why in self.skipped:
            lines.append(f"  {bug:<20} {'-':<12} {dtype:<9} {'not run':<10} {why}")
        n = sum(o.bug != CONTROL for o in self.outcomes)
        caught = sum(o.ok for o in self.outcomes if o.bug != CONTROL)
        lines.append(f"parity self-test: {'PASS' if self.passed else 'FAIL'} ({caught} of {n} planted bugs caught "
                     f"and named; controls {'pass' if all(o.ok for o in self.outcomes if o.bug == CONTROL) else 'FAIL'})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"passed": self.passed, "setup": self.report.setup,
                "outcomes": [vars(o) | {"ok": o.ok} for o in self.outcomes],
                "skipped": [{"bug": b, "dtype": d, "reason": r} for b, d, r in self.skipped],
                "entries": [r.to_dict() for r in self.report.rows]}


def _names(failing: list[str], verbose: bool) -> str:
    if verbose or len(failing) <= 6:
        return ", ".join(failing) or "-"
    return ", ".join(failing[:6]) + f", ... (+{len(failing) - 6})"


def _failing(rows: list[Row]) -> list[str]:
    """Failing checks, per-tensor ones first (they name the culprit), aggregates last."""
    bad = [r for r in rows if r.failed]
    bad.sort(key=lambda r: (r.name.startswith("<"), r.category not in ("grad", "param"), r.category))
    return [f"{r.category} {r.name}" for r in bad]


def run_selftest(dtypes=("float32", "bfloat16"), bugs=planted.CATALOGUE, seed: int = 0, batch: int = 2,
                 seq_len: int = 80, opt_cfg: OptimizerConfig = OptimizerConfig(), weights=WEIGHTS,
                 trained_state=None, compiler_options: dict | None = None, segments: bool = True,
                 model_cfg=MICRO, progress=None) -> SelftestReport:
    """Run the control and every planted bug in each dtype, on each of `weights` (RANDOM,
    TRAINED); see the module docstring. trained_state: TRAINED's weights (None: `trained_weights`
    of `seed`). compiler_options: XLA options of the compiles. model_cfg: MICRO, or a transformers
    model's record (random weights only; its ground truth is transformers' eager attention and
    experts, as in the suite); a bug of a part the model lacks is listed as not run, with why."""
    say = progress or (lambda msg: None)
    if model_cfg is not MICRO and TRAINED in weights:
        raise ValueError("run_selftest: trained weights are MICRO's; another model runs on random weights only")
    window = max((model_cfg.window_of_layer(i) for i in range(model_cfg.n_layers)), default=0)
    described = "a micro model" if model_cfg is MICRO else f"a transformers {model_cfg.model_type}"
    report = Report(setup={"model": described, "n_layers": model_cfg.n_layers, "d_model": model_cfg.d_model,
                           "n_experts": model_cfg.n_experts, "window": window,
                           "model_config": model_cfg.to_dict(), "batch": batch, "seq_len": seq_len, "seed": seed,
                           "backend": "cpu", "post_step": "TrainStep.update on the lowered gradients",
                           "source": f"self-test {described.removeprefix('a ')}", "weights": list(weights),
                           "segmented": segments,
                           "trained": {"steps": TRAINED_STEPS, "batch": TRAINED_BATCH, "loss": TRAINING_LOSS}})
    cases = []              # per weight set: (name, model, batch)
    for name in weights:
        if name == TRAINED:
            if trained_state is None:
                say(f"self-test: training the micro model {TRAINED_STEPS} steps (eager) ...")
                trained_state = trained_weights(seed=seed, seq_len=seq_len)
            model = build_model(MICRO, trained_state, seed)
            data = text_inputs(text_tokens(), batch, seq_len, seed, segments=segments)
        elif name == RANDOM:
            model = build_model(model_cfg, None, seed)
            data = parity_inputs(model_cfg.vocab_size, batch, seq_len, seed, segments=segments)
        else:
            raise ValueError(f"run_selftest: unknown weights {name!r}; choose from {WEIGHTS}")
        cases.append((name, model, data))
    outcomes, skipped, controls = [], [], {}
    probes, shared = {}, None
    missing = {bug.name: planted.not_applicable(bug, cases[0][1]) for bug in bugs}
    skipped += [(name, "-", why) for name, why in missing.items() if why]
    bugs = tuple(bug for bug in bugs if not missing[bug.name])
    with planted.registered(model_cfg) as spec:
        kernels = parse_kernel_sets(spec)[0]
        for weights_name, model, data in cases:
            say(f"self-test ({weights_name}): eager PyTorch float32 reference ...")
            reference = eager_run(reference_model(model), data, opt_cfg)
            router_names = [name for name, _ in routers(model)]
            # One compiled update and one probe per dtype serve every weight set.
            shared = SharedLowered(model, opt_cfg, compiler_options) if shared is None else shared.with_weights(model)
            before = {n: to_numpy(p) for n, p in shared.params.items()}
            for dtype in dtypes:
                if dtype not in probes:
                    say(f"self-test: compiling the planted kernel set | {dtype} ...")
                    probes[dtype] = LoweredProbe(model, opt_cfg, kernels, dtype, compiler_options=compiler_options)
                for bug in (None, *bugs):
                    name = CONTROL if bug is None else bug.name
                    if bug is not None and dtype not in bug.dtypes:
                        if weights_name == cases[0][0]:
                            skipped.append((name, dtype, bug.why_not))
                        continue
                    changed = None
                    if bug is not None and bug.optimizer:
                        changed = opt_cfg.replace(**{k: getattr(opt_cfg, k) * f for k, f in bug.optimizer.items()})
                    run = lowered_run(probes[dtype], shared, data, reference,
                                      selector=bug.selector if bug is not None else 0, opt_cfg=changed)
                    rows = compare_runs(reference, run, before, f"{name} @ {weights_name}", dtype, router_names)
                    report.rows.extend(rows)
                    failing = _failing(rows)
                    named = bug is not None and any(f in r.name for r in rows if r.failed and not r.name.startswith("<")
                                                    for f in bug.at_fault)
                    outcomes.append(Outcome(name, dtype, bool(failing), named, failing, weights=weights_name))
                    if bug is None:
                        controls[weights_name, dtype] = (reference, run, before, router_names)
                    say(f"  {name} | {weights_name} | {dtype}: {'FAIL' if failing else 'pass'} "
                        f"({len(failing)} failing checks)")
    return SelftestReport(outcomes, skipped, report, controls)


def failing_tensor_names(outcome: Outcome) -> set[str]:
    """The per-tensor names among an outcome's failing checks (for tests)."""
    return {f.split(" ", 1)[1] for f in outcome.failing if not f.split(" ", 1)[1].startswith("<")}


# ---- LoRA: the lowered peft model against eager peft (parity/lora_parity.py) ------------------------
LORA_SPEC = "r=4,alpha=8,targets=all-linear+experts"    # alpha != r: a scaling slip changes the output
LORA_WEIGHTS = "random init, LoRA"


def run_lora_selftest(bugs=tuple(planted.LORA_BUGS), seed: int = 0, kernel_set: str = "xla", seq_len: int = 80,
                      train_steps: int = 1, compiler_options: dict | None = None, progress=None) -> SelftestReport:
    """The LoRA rows on MICRO (float32, `kernel_set`): the control (with `train_steps` LoRA train
    steps) must pass, each planted LoRA bug (live in the lowered run only) must fail naming an
    adapter."""
    spec = parse_lora_spec(LORA_SPEC)
    report = Report(setup={"source": "self-test micro model", "lora": LORA_SPEC, "seed": seed})
    outcomes = []
    for name in (None, *bugs):
        run = run_lora_parity(MICRO, spec, kernel_sets=[kernel_set], seed=seed, seq_len=seq_len,
                              compiler_options=compiler_options, planted_bug=name,
                              train_steps=train_steps if name is None else 0, progress=progress)
        rows = run.rows
        report.rows.extend(rows)
        failing = _failing(rows)
        bug = planted.LORA_BUGS.get(name)
        named = bug is not None and any(f in r.name for r in rows if r.failed for f in bug.at_fault)
        outcomes.append(Outcome(name or CONTROL, "float32", bool(failing), named, failing, weights=LORA_WEIGHTS))
    return SelftestReport(outcomes, [], report)
