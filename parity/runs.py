"""The two runs the parity suite compares: the ground truth (`eager_run`: eager float32 PyTorch
forward, backward and one `MuonAdamW` step) and the lowered JAX run of one kernel set and compute
dtype (`LoweredProbe` + `lowered_run`), both as a `Run` of numpy arrays.

The lowered post-step parameters come from the lowered optimizer (`SharedLowered.update`: the
torch `muon_adamw_update` traced through torchax) applied to that run's lowered gradients: for
one micro-batch this is the train step's math exactly, and the optimizer compiles once per suite
rather than once per kernel set. With `full_step=True`, `lowered_run` takes them from the
compiled train step itself (`TrainStep.__call__`). Both runs take the batch's segment ids and
positions (packed rows, `parity.inputs.ParityBatch`) when it has them. Routing is measured on each path's own
choices: a forward hook on each `mlp.router` records its logits and top-k experts. A module model's
routers (nn.Linear by the probe's roles) return logits only, its own code taking the top-k: the
lowered run takes the eager run's router logits as their values (`forced_router_logits`), so its
top-k chooses as the eager run chose, and their gradients flow through its own.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_bridge import registry
from jax_bridge.lowering import optimizer_function, optimizer_state_to_jax, params_to_jax
from jax_bridge.step import StepConfig, TrainStep, cast_params
from parity import planted
from parity.inputs import ParityBatch
from torch_model.optim import MuonAdamW, OptimizerConfig, plan_parameters
from torch_model.transformers_lm import softmax_of_chosen


@dataclass
class Run:
    """What both paths produce, as numpy (float32 or the compute dtype)."""
    logits: np.ndarray
    loss: float
    grads: dict[str, np.ndarray]
    grad_norm: float
    params_after: dict[str, np.ndarray]
    routing: list[tuple[np.ndarray, np.ndarray]]     # per MoE layer: (router logits [N, E], experts [N, k])
    router_logits: list[np.ndarray] = field(default_factory=list)   # per call of a module model's router


def routers(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, router) per MoE layer in layer order; each returns (logits, weights, experts)."""
    return model.routers()


@contextlib.contextmanager
def forward_hooks(modules, hooks):
    """`hooks[i]` registered as a forward hook of `modules[i]` while the block runs."""
    handles = [m.register_forward_hook(hook) for m, hook in zip(modules, hooks)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def capture_routing(model):
    """Record (router logits, chosen experts) of every MoE layer, in layer order."""
    captured = []
    modules = [router for _, router in routers(model)]
    with forward_hooks(modules, [lambda mod, inputs, out: captured.append((out[0], out[2]))] * len(modules)):
        yield captured


@contextlib.contextmanager
def forced_routing(model, experts):
    """While tracing the lowered run: MoE layer i sends each token to `experts[i]` ([N, k], the
    eager run's choice) instead of its own top-k, weighted by the softmax of its own router logits
    at those experts. A near-tie that bf16 breaks the other way then no longer sends a token
    through another expert, whose output in a trained model differs by O(1) and, through
    attention, moves every later token and every gradient; the routing check still measures the
    router's own choice (capture_routing, registered first, records it)."""
    def force(i, weighting):
        def hook(module, inputs, out):
            chosen = experts[i].long()
            return out[0], weighting(out[0], chosen), chosen
        return hook

    # Each family's router weights the chosen experts its own way (found by behaviour).
    modules = [router for _, router in routers(model)]
    with forward_hooks(modules, [force(i, getattr(m, "torchlyra_weighting", softmax_of_chosen))
                                 for i, m in enumerate(modules)]):
        yield


def logit_routers(model) -> list[torch.nn.Module]:
    """A module model's routers in call order, which return their logits only (none for ours and
    transformers' models, whose routers follow the `routers` protocol)."""
    return [router for _, router in getattr(model, "logit_routers", list)()]


@contextlib.contextmanager
def capture_router_logits(model):
    """Record the logits of every call of a module model's routers."""
    captured = []
    modules = logit_routers(model)
    with forward_hooks(modules, [lambda mod, inputs, out: captured.append(out)] * len(modules)):
        yield captured


@contextlib.contextmanager
def forced_router_logits(model, logits):
    """While tracing the lowered run: the i-th router call of a module model gives `logits[i]` (the
    eager run's, [N, E]) as its value and its own logits' gradient (the value of `own - own.detach()`
    is zero), so that the module's own top-k chooses the eager run's experts with the eager weights
    (see `forced_routing` for why); the gradient checks still measure the router's own arithmetic."""
    calls = iter(range(len(logits)))

    def force(module, inputs, out):
        return logits[next(calls)].to(out.dtype) + (out - out.detach())

    modules = logit_routers(model) if len(logits) else []
    with forward_hooks(modules, [force] * len(modules)):
        yield


def to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(jax.device_get(x))


def eager_run(model, batch: ParityBatch, opt_cfg: OptimizerConfig) -> Run:
    """Ground truth: eager float32 PyTorch on `batch` (its segment ids and positions, if packed).
    `model` is left unchanged (the step runs on a copy)."""
    ids, labels, packed = batch.ids, batch.labels, batch.model_inputs()
    with torch.no_grad(), capture_routing(model) as captured, capture_router_logits(model) as router_logits:
        logits = model(ids, **packed)
    routing = [(to_numpy(lg), to_numpy(ex)) for lg, ex in captured]
    trained = copy.deepcopy(model)
    optimizer = MuonAdamW(trained, opt_cfg)
    trained.zero_grad()
    out = trained(ids, labels, **packed)
    out["loss"].backward()
    grads = {n: to_numpy(p.grad) if p.grad is not None else np.zeros(p.shape, np.float32)
             for n, p in trained.named_parameters()}
    optimizer.step()
    return Run(logits=to_numpy(logits), loss=float(out["loss"].item()), grads=grads,
               grad_norm=float(optimizer.last_stats["grad_norm"].item()),
               params_after={n: to_numpy(p) for n, p in trained.named_parameters()}, routing=routing,
               router_logits=[to_numpy(lg) for lg in router_logits])


# Parity compares against float32-exact eager torch: the lowered run's non-kernel matmuls (the
# model's and the optimizer's) at 'highest' in either compute dtype (kernels choose their dots'
# precision from their operands' dtype).
PARITY_MATMUL_PRECISION = "highest"

# XLA compiler options for the test suite, where compiling dominates: the CPU backend's LLVM at
# -O0 compiles the same optimized XLA program in about half the time (a probe of the 2-layer
# parity model: 25 s -> 14 s; its gradients moved by at most 1e-7). Never the default.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


class SharedLowered:
    """What every lowered run shares: parameters, initial optimizer state, and the optimizer
    update compiled once per optimizer configuration (it does not depend on the kernels or the
    compute dtype; its matmuls at PARITY_MATMUL_PRECISION, as the probes' train step runs its
    own). `compiler_options`: XLA options of its compiles (None: the defaults)."""

    def __init__(self, model, opt_cfg: OptimizerConfig, compiler_options: dict | None = None):
        self.plan = plan_parameters(model)
        self.params = params_to_jax(model)
        self.opt_state = optimizer_state_to_jax(model, self.plan)
        self.opt_cfg = opt_cfg
        self.compiler_options = compiler_options
        self._updates: dict[OptimizerConfig, object] = {}

    def with_weights(self, model) -> SharedLowered:
        """The same for other weights of the same model shape, sharing the compiled updates."""
        other = SharedLowered(model, self.opt_cfg, self.compiler_options)
        other._updates = self._updates
        return other

    def program(self, opt_cfg: OptimizerConfig | None = None):
        """The jitted update(params, grads, opt_state, lr_scale) of `opt_cfg` (default: the suite's)."""
        opt_cfg = opt_cfg or self.opt_cfg
        if opt_cfg not in self._updates:
            self._updates[opt_cfg] = jax.jit(optimizer_function(self.plan, opt_cfg,
                                                                matmul_precision=PARITY_MATMUL_PRECISION),
                                             compiler_options=self.compiler_options)
        return self._updates[opt_cfg]

    def update(self, grads, opt_cfg: OptimizerConfig | None = None):
        """(params after one step, grad_norm) from `grads` with `opt_cfg` (default: the suite's)."""
        after, _, stats = self.program(opt_cfg)(self.params, grads, self.opt_state, jnp.float32(1.0))
        return after, stats["grad_norm"]


class LoweredProbe:
    """The lowered forward (logits and routing) and gradients of one kernel set and compute dtype,
    compiled once: `probe(params, batch, selector, forced) -> (logits, routing, loss, grads)`; a
    packed batch's positions and segment ids are arguments (one more compile than unpacked).
    `selector` picks a planted bug when the kernel set is the planted one (parity/planted.py);
    other kernels ignore it. `forced` (the eager `Run`): its experts, which both forwards use
    (`forced_routing`; a module model's router logits, `forced_router_logits`); `routing` is the
    lowered router's own choice."""

    _lowered = _compiled = _compile_error = None       # set by `lower` and `compile` (parity's suite)

    def __init__(self, model, opt_cfg: OptimizerConfig, kernels: Mapping[str, str], dtype: str,
                 kernel_options=None, compiler_options: dict | None = None):
        self.model = model
        self.step = TrainStep(model, opt_cfg, StepConfig(kernels=dict(kernels), compute_dtype=dtype,
                                                         matmul_precision=PARITY_MATMUL_PRECISION,
                                                         kernel_options=kernel_options_for(kernels, kernel_options)))
        self.kernels = self.step.kernels
        self._jitted = jax.jit(self._probe, compiler_options=compiler_options)

    def _probe(self, params, ids, labels, selector, forced, forced_logits, packed):
        # packed: () or (positions, segment_ids) [B, T], the model's arguments after the labels.
        step = self.step
        experts, router_logits = step.env.j2t_iso((forced, forced_logits))
        forcing = lambda: forced_router_logits(self.model, router_logits)  # noqa: E731
        with planted.selected(selector):
            with capture_routing(self.model) as captured, forced_routing(self.model, experts), forcing():
                with step.routing():
                    logits = step.forward(cast_params(params, step.compute_dtype), ids, None, *packed)
            routing = [step.env.t2j_iso(pair) for pair in captured]
            with forced_routing(self.model, experts), forcing():
                (loss, _), grads = jax.value_and_grad(step.loss_and_metrics, has_aux=True)(params, ids, labels, packed)
        return logits, routing, loss, grads

    @staticmethod
    def _arguments(params, batch: ParityBatch, selector: int, forced: Run | None) -> tuple:
        routing, router_logits = (forced.routing, forced.router_logits) if forced else ([], [])
        experts = np.stack([np.asarray(ex) for _, ex in routing]) if routing else np.zeros((0, 1, 1))
        logits = np.stack(router_logits) if router_logits else np.zeros((0, 1, 1), np.float32)
        packed = tuple(jnp.asarray(x.numpy(), jnp.int32) for x in batch.model_inputs().values())
        return (params, jnp.asarray(batch.ids.numpy(), jnp.int32), jnp.asarray(batch.labels.numpy(), jnp.int32),
                jnp.int32(selector), jnp.asarray(experts, jnp.int32), jnp.asarray(logits), packed)

    def lower(self, params, batch: ParityBatch, selector: int = 0, forced: Run | None = None):
        """Trace and lower the probe for these arguments now (in this thread: tracing is not
        thread-safe); `compile` then compiles it, which may run beside other probes' compiles."""
        self._lowered = self._jitted.lower(*self._arguments(params, batch, selector, forced))

    def compile(self):
        """Compile what `lower` lowered; the next call (with those arguments' shapes) runs it. An
        error is kept and raised by that call, so a set that cannot compile fails as its own row."""
        lowered, self._lowered = self._lowered, None
        try:
            self._compiled = lowered.compile()
        except Exception as e:  # noqa: BLE001 - raised again by __call__, inside the caller's handling
            self._compile_error = e

    def __call__(self, params, batch: ParityBatch, selector: int = 0, forced: Run | None = None):
        """`forced`: the eager run, whose routing the lowered run takes."""
        if self._compile_error is not None:
            raise self._compile_error
        compiled, self._compiled = self._compiled, None      # once: later calls go through the jit
        return (compiled or self._jitted)(*self._arguments(params, batch, selector, forced))


MAX_COMPILE_THREADS = 8     # each compile holds its own memory: a bound on a many-core host


def compile_in_parallel(probes: list[LoweredProbe], say=None) -> None:
    """Compile lowered probes at once, one thread per host core up to MAX_COMPILE_THREADS (XLA
    compiles outside the GIL): each keeps its executable, or its error for its own run to report."""
    if not probes:
        return
    workers = max(1, min(len(probes), os.cpu_count() or 1, MAX_COMPILE_THREADS))
    if say:
        say(f"lowered runs: compiling {len(probes)} on {workers} thread{'s' if workers > 1 else ''} ...")
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(LoweredProbe.compile, probes))


def kernel_options_for(kernels: Mapping[str, str], options) -> dict:
    """The kernel options of the implementations this set uses (the others are not checked)."""
    nested = registry.parse_kernel_options(options)
    return {op: {name: opts for name, opts in per.items() if kernels.get(op) == name}
            for op, per in nested.items() if kernels.get(op) in per}


def lowered_run(probe: LoweredProbe, shared: SharedLowered, batch: ParityBatch, reference: Run, selector: int = 0,
                opt_cfg: OptimizerConfig | None = None, full_step: bool = False) -> Run:
    """One lowered run on `batch`: the probe's forward and gradients, on the experts the eager
    `reference` chose, then one optimizer step on them (or, `full_step`, the compiled train step
    itself on `batch.step_tokens()`: its own routing; packed, its weighted loss)."""
    logits, routing, loss, grads = probe(shared.params, batch, selector, reference)
    if full_step:
        state, metrics = probe.step(probe.step.init_state(), batch.step_tokens())
        after, grad_norm = state.params, metrics["grad_norm"]
    else:
        after, grad_norm = shared.update(grads, opt_cfg)
    return Run(logits=to_numpy(logits), loss=float(loss), grads={n: to_numpy(g) for n, g in grads.items()},
               grad_norm=float(grad_norm), params_after={n: to_numpy(p) for n, p in after.items()},
               routing=[(to_numpy(lg), to_numpy(ex)) for lg, ex in routing])
