"""The parity rows of a LoRA model: the peft-wrapped torch model lowered through torchax against
eager peft on the same model (a transformers model's: peft on transformers' own eager attention
and experts, `eager_reference`), per kernel set, in float32 (logits rel <= 1e-5; every adapter
gradient rel <= 1e-4, parity/tolerances.py); the frozen base gets no gradient on either side.

Both runs use the suite's inputs (packed rows, ignored labels) and the lowered run takes the eager
run's experts (`runs.forced_routing`), as the main suite does. `planted_bug`: a LoRA bug of
parity/planted.py live in the lowered run only, for the self-test.
"""
from __future__ import annotations

import contextlib
import copy

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_bridge import registry
from jax_bridge.env import get_env
from jax_bridge.lowering import model_function, params_to_jax
from pallas_kernels.platform import host_platform
from parity import compare, planted, tolerances
from parity.inputs import PARITY_BATCH, PARITY_LOSS, ParityBatch, build_model, parity_inputs, parity_shape
from parity.kernel_sets import default_kernel_sets, kernel_label, parse_kernel_sets
from parity.report import ERROR, Report, Row, run_verdict, unmade_run_row
from parity.runs import PARITY_MATMUL_PRECISION, capture_routing, forced_routing, kernel_options_for, to_numpy
from torch_model import transformers_lm
from torch_model.causal_lm import IGNORE_INDEX
from torch_model.lora import LoraSpec, apply_lora, is_adapter_parameter, swapping_parametrized_tensors

DTYPE = "float32"          # the LoRA rows compare float32 paths (the bounds above)


def base_of(peft_model):
    """The model inside peft's wrapping (its routers are where routing is forced)."""
    return peft_model.base_model.model


def eager_reference(wrapped, spec: LoraSpec):
    """The eager ground truth of the peft model `wrapped`: itself, or for a transformers model the
    same base weights and adapters on transformers' own eager attention and experts."""
    base = base_of(wrapped)
    if not isinstance(base, transformers_lm.TransformersCausalLM):
        return wrapped
    reference = apply_lora(transformers_lm.build(copy.deepcopy(base.config), reference=True), spec)
    reference.load_state_dict(wrapped.state_dict())
    trained = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    for name, p in reference.named_parameters():
        p.requires_grad_(name in trained)
    return reference


def lora_parity_model(model_cfg, spec: LoraSpec, state_dict=None, adapters=None, seed: int = 0):
    """The peft-wrapped model: base weights `state_dict` (None: random, seeded), trained tensors
    `adapters` ({peft name: tensor} of every trainable one: LoRA A and B, and modules_to_save
    copies; None: A and B random, seeded, so that every adapter has a gradient: peft starts B at
    zero, which would leave A's gradient zero)."""
    wrapped = apply_lora(build_model(model_cfg, state_dict, seed), spec)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if adapters is not None and p.requires_grad:
                p.copy_(adapters[name])
            elif adapters is None and is_adapter_parameter(name):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return wrapped


def eager_lora_run(wrapped, batch: ParityBatch) -> dict:
    """Ground truth: eager peft in float32: logits, routing, loss, and every adapter's gradient
    (a frozen parameter's gradient must stay None)."""
    packed = batch.model_inputs()
    with torch.no_grad(), capture_routing(base_of(wrapped)) as captured:
        logits = wrapped(batch.ids, **packed)
    wrapped.zero_grad()
    loss = wrapped(batch.ids, batch.labels, **packed)["loss"]
    loss.backward()
    grads = {n: to_numpy(p.grad) for n, p in wrapped.named_parameters() if p.requires_grad}
    frozen_with_grad = [n for n, p in wrapped.named_parameters() if not p.requires_grad and p.grad is not None]
    wrapped.zero_grad()
    return {"logits": to_numpy(logits), "loss": loss.item(), "grads": grads, "frozen_with_grad": frozen_with_grad,
            "routing": [(to_numpy(lg), to_numpy(ex)) for lg, ex in captured]}


class LoraProbe:
    """The lowered forward (logits) and the adapters' loss gradient of one kernel set, compiled
    once: `probe(batch, forced) -> (logits, loss, grads)`; only the adapters are differentiated."""

    def __init__(self, wrapped, kernels, kernel_options, compiler_options=None, planted_bug=None):
        self.wrapped, self.planted_bug = wrapped, planted_bug
        self.kernels = registry.resolve(dict(kernels))
        self.options = kernel_options_for(self.kernels, kernel_options)
        params = params_to_jax(wrapped)
        trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
        self.adapters = {n: v for n, v in params.items() if n in trainable}
        self.frozen = {n: v for n, v in params.items() if n not in trainable}
        self._fn = model_function(wrapped)
        self._jitted = jax.jit(self._probe, compiler_options=compiler_options)

    @contextlib.contextmanager
    def _tracing(self, experts):
        env = get_env()
        bug = planted.lora_bug(self.planted_bug, self.wrapped) if self.planted_bug else contextlib.nullcontext()
        with registry.routed(env, self.kernels, platform=host_platform(), options=self.options), \
                jax.default_matmul_precision(PARITY_MATMUL_PRECISION), swapping_parametrized_tensors(self.wrapped), bug, \
                forced_routing(base_of(self.wrapped), env.j2t_iso(experts)):
            yield

    def _probe(self, adapters, frozen, ids, labels, forced, packed):
        with self._tracing(forced):
            logits = self._fn({**adapters, **frozen}, ids, None, *packed)
            loss, grads = jax.value_and_grad(
                lambda a: self._fn({**a, **frozen}, ids, labels, *packed)["loss"])(adapters)
        return logits, loss, grads

    def __call__(self, batch: ParityBatch, forced):
        experts = np.stack([np.asarray(ex) for _, ex in forced]) if forced else np.zeros((0, 1, 1))
        packed = tuple(jnp.asarray(x.numpy(), jnp.int32) for x in batch.model_inputs().values())
        logits, loss, grads = self._jitted(self.adapters, self.frozen, jnp.asarray(batch.ids.numpy(), jnp.int32),
                                           jnp.asarray(batch.labels.numpy(), jnp.int32),
                                           jnp.asarray(experts, jnp.int32), packed)
        return to_numpy(logits), float(loss), {n: to_numpy(g) for n, g in grads.items()}


def lora_rows(reference: dict, logits, loss, grads, label: str) -> list[Row]:
    """The rows of one lowered LoRA run against eager peft."""
    tol = lambda check: tolerances.bounds(DTYPE, check)  # noqa: E731
    rows = [Row(label, DTYPE, "logits", "logits (LoRA)", compare.logits_metrics(logits, reference["logits"]),
                tol("logits")),
            Row(label, DTYPE, "loss", "loss (LoRA)", compare.tensor_metrics(loss, reference["loss"]), tol("loss"))]
    for name, expected in reference["grads"].items():
        if name in grads:
            rows.append(Row(label, DTYPE, "grad", name, compare.tensor_metrics(grads[name], expected), tol("grad")))
        else:
            rows.append(Row(label, DTYPE, "grad", name, bounds=tol("grad"), status="FAIL",
                            message="no gradient in the lowered run"))
    if reference["frozen_with_grad"]:
        rows.append(Row(label, DTYPE, "grad", "frozen base", status=ERROR,
                        message=f"eager peft gave frozen parameters a gradient: {reference['frozen_with_grad'][:3]}"))
    return rows


def lora_step_rows(wrapped, tokens: torch.Tensor, choice, kernel_options, compiler_steps: int, label: str,
                   reference=None) -> list[Row]:
    """The LoRA train step itself (jax_bridge.step.TrainStep on the peft model: adapters trained,
    the base frozen) against eager peft + MuonAdamW on `reference` (default `wrapped`),
    `compiler_steps` steps on `tokens` [B, T+1]: the adapters after the steps (tolerances:
    lora_param, lora_param_vector) and every frozen tensor bit-identical. The step routes by its
    own router (no forced experts)."""
    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.lora import unwrap
    from torch_model.optim import MuonAdamW, OptimizerConfig

    trained = copy.deepcopy(wrapped if reference is None else reference)
    inner = unwrap(trained)
    optimizer = MuonAdamW(inner, OptimizerConfig())
    for _ in range(compiler_steps):
        inner.zero_grad()
        inner(tokens[:, :-1], tokens[:, 1:])["loss"].backward()
        optimizer.step()
    expected = {n: to_numpy(p) for n, p in inner.named_parameters() if p.requires_grad}
    step = TrainStep(copy.deepcopy(wrapped), OptimizerConfig(),
                     StepConfig(kernels=dict(choice), compute_dtype=DTYPE, matmul_precision=PARITY_MATMUL_PRECISION,
                                kernel_options=kernel_options_for(registry.resolve(dict(choice)), kernel_options)))
    state = step.init_state()
    frozen_before = {n: to_numpy(v) for n, v in step.frozen.items()}
    for _ in range(compiler_steps):
        state, _ = step(state, tokens.numpy()[None])
    rows = [Row(label, DTYPE, "param", f"{name} (after {compiler_steps} LoRA steps)",
                compare.tensor_metrics(to_numpy(state.params[name]), value), tolerances.bounds(DTYPE, "lora_param"))
            for name, value in expected.items()]
    names = list(expected)
    flat = lambda d: np.concatenate([np.asarray(d[n], np.float64).ravel() for n in names])  # noqa: E731
    rows.append(Row(label, DTYPE, "param", f"<all adapters after {compiler_steps} LoRA steps>",
                    compare.tensor_metrics(flat({n: to_numpy(state.params[n]) for n in names}), flat(expected)),
                    tolerances.bounds(DTYPE, "lora_param_vector")))
    for name, before in frozen_before.items():
        rows.append(Row(label, DTYPE, "frozen", name, compare.tensor_metrics(to_numpy(step.frozen[name]), before),
                        tolerances.bounds(DTYPE, "frozen")))
    return rows


def run_lora_parity(model_cfg, spec: LoraSpec, state_dict=None, adapters=None, *, kernel_sets=None,
                    batch: int = PARITY_BATCH, seq_len: int | None = None, seed: int = 0, kernel_options=None,
                    compiler_options=None, planted_bug: str | None = None, train_steps: int = 0,
                    progress=None) -> Report:
    """The LoRA rows for every kernel set (None: the suite's default sets), float32; with
    `train_steps`, also the LoRA train step's adapters and frozen base after that many steps.
    seq_len, kernel_options: None takes this platform's (`parity.inputs.parity_shape`)."""
    say = progress or (lambda msg: None)
    seq_len, kernel_options = parity_shape(host_platform(), seq_len, kernel_options)
    sets, rows = (default_kernel_sets() if kernel_sets is None else (parse_kernel_sets(kernel_sets), []))
    wrapped = lora_parity_model(model_cfg, spec, state_dict, adapters, seed)
    data = parity_inputs(model_cfg.vocab_size, batch, seq_len, seed)
    n_adapter = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    report = Report(setup={"n_layers": model_cfg.n_layers, "d_model": model_cfg.d_model,
                           "n_experts": model_cfg.n_experts, "model_config": model_cfg.to_dict(),
                           "windows": [model_cfg.window_of_layer(i) for i in range(model_cfg.n_layers)],
                           "lora": str(spec), "adapter_parameters": n_adapter, "batch": batch, "seq_len": seq_len,
                           "seed": seed, "dtypes": [DTYPE], "planted_bug": planted_bug,
                           "ignored_labels": int((data.labels == IGNORE_INDEX).sum()),
                           "segments": "packed" if data.segmented else "none (unsegmented rows)",
                           "loss_coefficients": {k: getattr(model_cfg, k) for k in PARITY_LOSS},
                           "kernel_options": str(kernel_options or ""),
                           "weights": "random (seeded)" if state_dict is None else "state dict",
                           "post_step": f"TrainStep (LoRA), {train_steps} steps" if train_steps else "not compared",
                           "backend": host_platform()})
    report.rows.extend(rows)
    truth = eager_reference(wrapped, spec)
    say(f"LoRA ({spec}): eager peft float32 reference"
        f"{'' if truth is wrapped else ' (transformers eager attention and experts)'} ...")
    reference = eager_lora_run(truth, data)
    for choice in sets:
        label = kernel_label(choice) + " +lora"
        say(f"lowered {label} ...")
        try:
            probe = LoraProbe(wrapped, choice, kernel_options, compiler_options, planted_bug)
            got = probe(data, reference["routing"])
        except Exception as e:  # noqa: BLE001 - a kernel set that cannot run is a failed check
            report.rows.append(unmade_run_row(label, DTYPE, e))
            continue
        new_rows = lora_rows(reference, *got, kernel_label(probe.kernels) + " +lora")
        if train_steps:
            tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq_len + 1),
                                   generator=torch.Generator().manual_seed(seed + 2))
            try:
                new_rows += lora_step_rows(wrapped, tokens, choice, kernel_options, train_steps,
                                           kernel_label(probe.kernels) + " +lora", truth)
            except Exception as e:  # noqa: BLE001 - a step that cannot run is a failed check
                new_rows.append(unmade_run_row(label, DTYPE, e, "LoRA train step"))
        report.rows.extend(new_rows)
        for line in run_verdict(label, DTYPE, new_rows):
            say(line)
    return report
