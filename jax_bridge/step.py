"""One jitted JAX train step: forward, JAX autodiff, gradient accumulation over micro-batches
with `lax.scan`, and the torch optimizer's update, all in a single program with the train
state donated.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import torch

from jax_bridge import registry, sharding
from jax_bridge.env import get_env
from jax_bridge.lowering import (abstract_optimizer_state, abstract_params, model_function, optimizer_function,
                                 optimizer_state_to_jax, params_to_jax)
from pallas_kernels.platform import check_platform, host_platform
from torch_model.optim import OptimizerConfig, plan_parameters

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MATMUL_PRECISIONS = ("default", "high", "highest")
# Per-platform defaults (issue 12): accelerators compute in bf16 (float32 master weights); the CPU
# computes in float32, where its matmuls are real float32 and parity with eager torch holds.
DEFAULT_COMPUTE_DTYPE = {"cpu": "float32", "gpu": "bfloat16", "tpu": "bfloat16"}


def default_matmul_precision(compute_dtype: str) -> str:
    """The model's non-kernel matmuls: float32 compute means float32 accuracy ("highest": on TPU
    the default would be one bf16 pass, on GPU tf32); bf16 compute takes the native "default"
    (exact products, float32 accumulation). Kernels choose their own dots' precision from their
    input dtype (pallas_kernels.platform.dot_precision) whatever is set here."""
    return "highest" if compute_dtype == "float32" else "default"


@dataclass(frozen=True)
class StepConfig:
    kernels: str | dict | None = None       # e.g. "attention=pallas,moe=xla"; None = auto
    compute_dtype: str | None = None         # "float32" | "bfloat16" (float32 master weights either
                                             # way); None or "auto": DEFAULT_COMPUTE_DTYPE[platform]
    micro_batches: int = 1                   # gradient accumulation steps inside the jit
    matmul_precision: str | None = None      # the model's non-kernel matmuls (and the optimizer);
                                             # None: default_matmul_precision(compute_dtype)
    platform: str | None = None              # compiled FOR: "cpu" | "gpu" | "tpu"; None: this host's
    kernel_options: str | dict | None = None  # per implementation, e.g. "attention.pallas.block_q=256"

    def __post_init__(self):
        # Resolved once, here, outside any tracing; frozen, so through object.__setattr__.
        platform = check_platform(self.platform or host_platform(), "StepConfig.platform")
        compute = self.compute_dtype if self.compute_dtype not in (None, "auto") else DEFAULT_COMPUTE_DTYPE[platform]
        if compute not in COMPUTE_DTYPES:
            raise ValueError(f"StepConfig.compute_dtype must be one of {list(COMPUTE_DTYPES)} or 'auto', "
                             f"found {self.compute_dtype!r}")
        precision = self.matmul_precision or default_matmul_precision(compute)
        if precision not in MATMUL_PRECISIONS:
            raise ValueError(f"StepConfig.matmul_precision must be one of {list(MATMUL_PRECISIONS)}, "
                             f"found {self.matmul_precision!r}")
        if self.micro_batches < 1:
            raise ValueError(f"StepConfig.micro_batches must be >= 1, found {self.micro_batches}")
        object.__setattr__(self, "platform", platform)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "matmul_precision", precision)
        object.__setattr__(self, "kernel_options", registry.parse_kernel_options(self.kernel_options))


class TrainState(NamedTuple):
    params: dict        # float32 master weights
    opt_state: dict


def cast_params(params, dtype):
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


class TrainStep:
    """Builds the state and the compiled step for a torch model.

    `step(state, tokens, lr_scale) -> (state, metrics)` where tokens is int32
    [micro_batches, batch, seq_len + 1] (inputs are tokens[..., :-1], labels tokens[..., 1:]).
    """

    def __init__(self, model: torch.nn.Module, opt_cfg: OptimizerConfig = OptimizerConfig(),
                 step_cfg: StepConfig | None = None, mesh=None):
        step_cfg = step_cfg or StepConfig()
        self.model, self.opt_cfg, self.cfg, self.mesh = model, opt_cfg, step_cfg, mesh
        self.env = get_env()
        self.platform = step_cfg.platform
        self.kernels = registry.resolve(step_cfg.kernels, self.platform)
        registry.check_options(step_cfg.kernel_options)
        self.layout = "per_layer"       # how state.params are stored (train/checkpoint.py LAYOUTS)
        self.plan = plan_parameters(model.named_parameters())
        self.forward = model_function(model)
        self.update = optimizer_function(self.plan, opt_cfg)
        self.compute_dtype = COMPUTE_DTYPES[step_cfg.compute_dtype]
        self.trace_count = 0
        self._jitted = jax.jit(self._step, donate_argnums=(0,))
        self._jitted_eval = jax.jit(self._eval)
        self._jitted_grads = jax.jit(self._grads)
        self._jitted_update = jax.jit(self._update, donate_argnums=(0, 2))

    # ---- state --------------------------------------------------------------------------------
    def init_state(self) -> TrainState:
        state = TrainState(params_to_jax(self.model), optimizer_state_to_jax(self.model, self.plan))
        return state if self.mesh is None else sharding.shard_state(state, self.mesh)

    def abstract_state(self) -> TrainState:
        """The state's shapes and dtypes, without weights (a `meta`-device model works): what
        `jax_bridge.plan` compiles the step for."""
        return TrainState(abstract_params(self.model), abstract_optimizer_state(self.model, self.plan))

    # ---- traced functions -----------------------------------------------------------------------
    @contextlib.contextmanager
    def routing(self):
        """While tracing: the model's hot ops run the chosen kernels (compiled for this step's
        platform, with their options) and its own matmuls run at the step's precision."""
        with registry.routed(self.env, self.kernels, platform=self.platform, options=self.cfg.kernel_options), \
                jax.default_matmul_precision(self.cfg.matmul_precision):
            yield

    def loss_and_metrics(self, params, inputs, labels):
        with self.routing():
            out = self.forward(cast_params(params, self.compute_dtype), inputs, labels)
        return out["loss"], out

    def _grads(self, params, tokens):
        return jax.value_and_grad(self.loss_and_metrics, has_aux=True)(params, tokens[:, :-1], tokens[:, 1:])

    def _step(self, state: TrainState, tokens, lr_scale):
        self.trace_count += 1          # runs only while tracing: counts compilations
        zeros = jax.tree.map(jnp.zeros_like, state.params)

        def accumulate(grad_sum, micro_tokens):
            (_, out), grads = self._grads(state.params, micro_tokens)
            return jax.tree.map(jnp.add, grad_sum, grads), _scalar_metrics(out)

        grad_sum, micro_metrics = jax.lax.scan(accumulate, zeros, tokens)
        grads = jax.tree.map(lambda g: g / tokens.shape[0], grad_sum)
        params, opt_state, stats = self._update(state.params, grads, state.opt_state, lr_scale)
        metrics = jax.tree.map(lambda m: m.mean(0), micro_metrics)
        # A non-finite loss or gradient norm skips the update here, with no host round trip:
        # parameters and optimizer state (its step count too) stay as they were, while the
        # caller's step counter, learning-rate schedule and data move on.
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(stats["grad_norm"])
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), TrainState(params, opt_state), state)
        metrics.update(grad_norm=stats["grad_norm"], grad_norm_clipped=stats["grad_norm_clipped"],
                       skipped=jnp.logical_not(finite).astype(jnp.int32))
        return new_state, metrics

    def _update(self, params, grads, opt_state, lr_scale):
        with jax.default_matmul_precision(self.cfg.matmul_precision):
            return self.update(params, grads, opt_state, lr_scale)

    def _eval(self, params, tokens):
        _, out = self.loss_and_metrics(params, tokens[:, :-1], tokens[:, 1:])
        return _scalar_metrics(out)

    # ---- public API ---------------------------------------------------------------------------
    def __call__(self, state: TrainState, tokens, lr_scale=1.0):
        tokens = jnp.asarray(tokens, dtype=jnp.int32)
        if self.mesh is not None:
            tokens = jax.device_put(tokens, sharding.batch_sharding(self.mesh))
        if tokens.ndim != 3 or tokens.shape[0] != self.cfg.micro_batches:
            raise ValueError(f"train step: tokens must be [micro_batches={self.cfg.micro_batches}, batch, "
                             f"seq_len+1], found shape {tuple(tokens.shape)}")
        return self._jitted(state, tokens, jnp.asarray(lr_scale, jnp.float32))

    def evaluate(self, params, tokens):
        """Loss metrics of one batch [batch, seq_len+1] without updating anything."""
        return self._jitted_eval(params, jnp.asarray(tokens, dtype=jnp.int32))

    def grads(self, params, tokens):
        """(loss, metrics), grads for one batch [batch, seq_len+1] (for parity checks and the
        step benchmark's forward+backward)."""
        return self._jitted_grads(params, jnp.asarray(tokens, dtype=jnp.int32))

    def apply_update(self, params, grads, opt_state, lr_scale=1.0):
        """(params, opt_state, stats): the optimizer update alone, jitted as inside the step
        (params and opt_state donated); the step benchmark times it apart."""
        return self._jitted_update(params, grads, opt_state, jnp.asarray(lr_scale, jnp.float32))

    def lower(self, state: TrainState, tokens, lr_scale=1.0):
        """The step's `jax.stages.Lowered` (trace + lowering); `.compile()` it to time the compile."""
        return self._jitted.lower(state, jnp.asarray(tokens, dtype=jnp.int32), jnp.asarray(lr_scale, jnp.float32))


def _scalar_metrics(out: dict) -> dict:
    """The loss parts, plus for MoE models the routed-token fraction per layer and expert
    ("expert_fraction" [layers, experts]) and its largest value times E (1.0: balanced)."""
    metrics = {k: v for k, v in out.items() if v.ndim == 0}
    if "expert_fraction" in out:
        frac = out["expert_fraction"]
        metrics["expert_fraction"] = frac
        metrics["expert_load_max"] = frac.max() * frac.shape[-1]
    return metrics
