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
             the top-k experts that each path's own router computed (eager: torch.topk on the
             eager hidden states; lowered: the traced forward's top-k on its hidden states).

The lowered run sends every token to the experts the eager run chose (`runs.forced_routing`),
weighted by its own router's softmax at them: top-k is discontinuous, and in a trained model one
near-tie broken the other way by bf16 sends a token through an expert whose output differs by
O(1), which attention carries to every later token and gradient (the demo's step-300 checkpoint:
embedding gradient cos 0.91 from 2.5% flipped tokens). With the choice forced, the checks measure
the arithmetic; the routing check measures the flips.

Inputs are packed by default: each row holds 2-3 segments of different lengths with
positions restarting at each, odd rows a padded tail with its own segment id; both runs (every
kernel set; logits, loss, gradients, the full step) take those segment ids and positions, and the
coverage lines say how many attention tiles a segment boundary masks or skips. `segments=False`
(`--no-segments`) runs unsegmented rows for comparison. The Hugging Face comparison (`--hf`) stays
unsegmented: transformers' GptOss takes no segment ids, so it runs the same tokens as plain rows.

The modules: `inputs.py` (model, weights, tokens), `kernel_sets.py`, `runs.py` (the eager and
the lowered run; `full_step=True`, `--full-step`, runs the compiled train step itself),
`checks.py` (the rows of one run), `report.py`, `tolerances.py`, `coverage.py` (the mask and
tile cases a set exercised, printed per kernel set); the CLI `torchlyra parity` is `run.py`.

Default kernel sets: all ops at `xla`, then, for each op, each other registered implementation
with the remaining ops at `xla`, so every registered implementation of every op is covered once
(one registered only for other backends is listed as a SKIP line). A kernel set that cannot be
built or run (an implementation not written yet, a kernel that raises) is an ERROR line, one an op
contract refuses (an implementation written before `segment_ids` on packed rows) a REFUSED line;
either fails the suite; nothing is skipped or replaced silently.

Self-test (`--selftest`, `parity/selftest.py`): the planted-bug catalogue of `parity/planted.py`
must fail. Trajectory (`--trajectory`, `parity/trajectory.py`): 100 steps against a golden
eager trajectory.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np
import torch

from jax_bridge import registry
from jax_bridge.step import COMPUTE_DTYPES
from pallas_kernels.platform import host_platform
from parity import coverage, tolerances
from parity.checks import compare_runs
from parity.inputs import (PARITY_BATCH, PARITY_IGNORE_FRACTION, PARITY_LOSS, ParityBatch, build_model,
                           parity_inputs, parity_shape, reference_model)
from parity.kernel_sets import default_kernel_sets, kernel_label, parse_kernel_sets
from parity.report import ERROR, Report, Row, first_line, run_verdict, unmade_run_row
from parity.runs import LoweredProbe, SharedLowered, compile_in_parallel, eager_run, lowered_run, routers, to_numpy
from torch_model.causal_lm import IGNORE_INDEX, PAD_SEGMENT
from torch_model.config import ModelConfig
from torch_model.module_lm import ModuleSpec
from torch_model.optim import OptimizerConfig
from formats.errors import UserError


_HF_METRICS = {"max_abs_err": "max_abs", "rel_err": "rel", "top1_agreement": "top1_exact"}


def _hf_rows(model_cfg, state_dict, ids) -> list[Row]:
    """Eager model vs transformers' GptOssForCausalLM (eager, float32) on the same tokens as
    unsegmented rows (transformers' GptOss takes no segment ids or per-row positions), through
    `parity.hf_parity.compare_with_transformers` (imported only for --hf), held to the `hf` check."""
    label, name = "transformers GptOssForCausalLM", "logits"
    try:
        from parity.hf_parity import compare_with_transformers

        result = compare_with_transformers(model_cfg, state_dict, ids)
    except Exception as e:  # noqa: BLE001 - a comparison that cannot run is a failed check
        return [Row(label, "float32", "hf", name, status=ERROR, message=f"{type(e).__name__}: {first_line(e)}")]
    if not isinstance(result, Mapping) or not set(_HF_METRICS) <= set(result):
        return [Row(label, "float32", "hf", name, status=ERROR,
                    message=f"compare_with_transformers returned {result!r:.200}")]
    metrics = {ours: float(result[theirs]) for theirs, ours in _HF_METRICS.items()}
    details = ", ".join(f"{k}={v}" for k, v in result.items() if k not in _HF_METRICS)
    return [Row(label, "float32", "hf", name, metrics, tolerances.bounds("float32", "hf"), message=details)]


def _experts(model, model_cfg) -> int:
    """Experts per MoE layer: the config's, or a module model's expert stacks' first dimension."""
    if not isinstance(model_cfg, ModuleSpec):
        return model_cfg.n_experts
    params = dict(model.named_parameters())
    return max((params[n].shape[0] for n, role in model.roles().items() if role.startswith("experts")), default=0)


def _segments_summary(segment_ids) -> str:
    """'packed: row 0: 3 segments of 27+30+23, row 1: ...' or 'none (unsegmented rows)'."""
    if segment_ids is None:
        return "none (unsegmented rows)"
    rows = []
    for i, row in enumerate(segment_ids):
        ids, counts = np.unique(row, return_counts=True)
        real = [int(c) for s, c in zip(ids, counts) if s != PAD_SEGMENT]
        pad = int(counts[ids == PAD_SEGMENT].sum())
        rows.append(f"row {i}: {len(real)} segment{'s' if len(real) > 1 else ''} of {'+'.join(map(str, real))}"
                    + (f" + {pad} padding" if pad else ""))
    return "packed: " + "; ".join(rows)


def _module_eager_run(truth, data: ParityBatch, opt_cfg, model_cfg):
    """eager_run; for a user's module, its forward failing on the parity rows (a module built for
    shorter rows than this platform's parity shape, say) is named in one line with the shape."""
    try:
        return eager_run(truth, data, opt_cfg)
    except Exception as e:  # noqa: BLE001 - the user's own code: any failure is named, with the shape
        if not isinstance(model_cfg, ModuleSpec):
            raise
        batch, seq_len = data.ids.shape
        raise UserError(f"--module {model_cfg.spec}: its eager forward failed on {batch} x {seq_len} tokens "
                        f"({type(e).__name__}: {first_line(e)}); a module that takes fewer tokens a row "
                        f"needs --seq-len at most its length (this platform's parity shape is {seq_len})") from e


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


def run_parity(model_cfg, state_dict: Mapping | None = None, *, kernel_sets=None,
               dtypes=("float32",), batch: int = PARITY_BATCH, seq_len: int | None = None, seed: int = 0,
               opt_cfg: OptimizerConfig = OptimizerConfig(), include_hf: bool = False,
               full_step: bool = False, kernel_options=None,
               ignore_fraction: float = PARITY_IGNORE_FRACTION, inputs=None, compiler_options: dict | None = None,
               segments: bool = True, progress=None) -> Report:
    """Compare the lowered train step with eager PyTorch for every kernel set and dtype.

    model_cfg: the model, used as given (`parity_config` makes the parity run's model from a
    preset), our ModelConfig or a transformers model's TransformersSpec (its ground truth is
    transformers' own eager attention and experts on the same weights); state_dict: its weights
    (None: random init seeded with `seed`). kernel_sets: None
    (every registered implementation, see `default_kernel_sets`) or strings / dicts as
    `parse_kernel_sets` takes, or {dtype: such sets} to run other sets per dtype (then `dtypes`
    is its keys). dtypes: compute dtypes of the lowered run. seq_len, kernel_options (tile sizes
    etc., registry syntax; "" none): None takes this platform's (`parity.inputs.parity_shape`: small
    tiles on CPU, 128-row tiles on TPU). Inputs: `parity_inputs` (random ids, `ignore_fraction` of the
    labels ignored; packed rows unless `segments` is False; unsegmented with full_step, no ignored
    labels: the bare token layout has none). inputs: a `ParityBatch` to use instead (e.g.
    `text_inputs` for a trained model) or (ids, labels) int64 [batch, seq_len] (unsegmented rows).
    compiler_options: XLA options of the lowered compiles (the tests pass FAST_COMPILE).
    progress: callable(str) or None.
    """
    dtypes = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
    seq_len, kernel_options = parity_shape(host_platform(), seq_len, kernel_options)
    if isinstance(kernel_sets, Mapping) and kernel_sets and set(kernel_sets) <= set(tolerances.TOLERANCES):
        by_dtype = {dtype: parse_kernel_sets(specs) for dtype, specs in kernel_sets.items()}   # sets per dtype
        dtypes = tuple(by_dtype)
    else:
        by_dtype = None
    if full_step and not segments:
        ignore_fraction = 0.0
    _check_request(dtypes, batch, seq_len, ignore_fraction, kernel_options)
    if include_hf and not isinstance(model_cfg, ModelConfig):
        raise UserError("--hf compares our GPT-OSS decoder with transformers' GptOss; a transformers model's "
                        "reference already is transformers' own eager attention and experts")
    if by_dtype is not None:
        sets, rows = list({kernel_label(c): c for per in by_dtype.values() for c in per}.values()), []
    elif kernel_sets is None:
        sets, rows = default_kernel_sets(unrouted=model_cfg.unrouted_ops() if isinstance(model_cfg, ModuleSpec) else None)
    else:
        sets, rows = parse_kernel_sets(kernel_sets), []
    say = progress or (lambda msg: None)

    model = build_model(model_cfg, state_dict, seed)
    if inputs is None:
        data = parity_inputs(model_cfg.vocab_size, batch, seq_len, seed, ignore_fraction, segments=segments)
    else:
        data = inputs if isinstance(inputs, ParityBatch) else ParityBatch.from_pairs(*inputs)
        batch, seq_len = data.ids.shape
    ids, labels = data.ids, data.labels
    segment_ids = data.model_inputs()["segment_ids"].numpy() if data.segmented else None
    report = Report(setup={
        "n_layers": model_cfg.n_layers, "d_model": model_cfg.d_model, "n_experts": _experts(model, model_cfg),
        "windows": [model_cfg.window_of_layer(i) for i in range(model_cfg.n_layers)], "model_config": model_cfg.to_dict(), "weights": "random (seeded)" if state_dict is None else "state dict",
        "batch": batch, "seq_len": seq_len, "seed": seed, "dtypes": list(dtypes),
        "ignored_labels": int((labels == IGNORE_INDEX).sum()), "segments": _segments_summary(segment_ids),
        "kernel_options": str(kernel_options or ""),
        "loss_coefficients": {k: getattr(model_cfg, k) for k in PARITY_LOSS},
        "optimizer": dataclasses.asdict(opt_cfg), "backend": host_platform(),
        "post_step": "TrainStep.__call__ (full step)" if full_step else "TrainStep.update on the lowered gradients",
        "coverage": {}, "jax": jax.__version__, "torch": torch.__version__})
    report.rows.extend(rows)

    truth = reference_model(model)
    say(f"eager PyTorch float32 reference{'' if truth is model else ' (transformers eager attention and experts)'} ...")
    reference = _module_eager_run(truth, data, opt_cfg, model_cfg)
    router_names = [name for name, _ in routers(model)]
    shared = SharedLowered(model, opt_cfg, compiler_options)
    before = {n: to_numpy(p) for n, p in shared.params.items()}
    # Every run's probe is traced first, one after the other, then all are compiled at once on
    # the host's cores (XLA compiles outside the GIL; on a TPU host compiling is most of a run),
    # then each runs and is compared in turn.
    runs = [(choice, dtype) for choice in sets for dtype in dtypes if by_dtype is None or choice in by_dtype[dtype]]
    made = []
    say(f"lowered runs: tracing {len(runs)} ...")
    for choice, dtype in runs:
        try:
            probe = LoweredProbe(model, opt_cfg, choice, dtype, kernel_options, compiler_options)
            probe.lower(shared.params, data, forced=reference)
            made.append((choice, dtype, probe, None))
        except Exception as e:  # noqa: BLE001 - a kernel set that cannot run is a failed check
            made.append((choice, dtype, None, e))
    compile_in_parallel([probe for _, _, probe, _ in made if probe is not None], say)
    for choice, dtype, probe, error in made:
        label = kernel_label(choice)
        say(f"lowered {label} | {dtype} ...")
        try:
            if error is not None:
                raise error
            run = lowered_run(probe, shared, data, reference, full_step=full_step)
        except Exception as e:  # noqa: BLE001 - a kernel set that cannot run is a failed check
            hint = ""
            if getattr(e, "keyword", None) == "segment_ids" and data.segmented:
                hint = "; the parity rows are packed by default: --no-segments runs plain rows"
            report.rows.append(unmade_run_row(label, dtype, e, hint=hint))
            continue
        resolved = kernel_label(probe.kernels)
        report.setup["coverage"][resolved] = coverage.describe(
            probe.kernels, model_cfg, batch, seq_len, probe.step.cfg.kernel_options, labels.numpy(),
            [experts for _, experts in reference.routing], segment_ids=segment_ids)
        new_rows = compare_runs(reference, run, before, resolved, dtype, router_names)
        report.rows.extend(new_rows)
        for line in run_verdict(resolved, dtype, new_rows):
            say(line)
    if include_hf:
        say("Hugging Face transformers comparison ...")
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        report.rows.extend(_hf_rows(model_cfg, state, ids.clone()))
    return report
