"""One jitted JAX train step: forward, JAX autodiff, gradient accumulation over micro-batches
with `lax.scan`, and the torch optimizer's update, all in a single program with the train
state donated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import torch

from jax_bridge import registry, sharding
from jax_bridge.env import get_env
from jax_bridge.lowering import model_function, optimizer_function, optimizer_state_to_jax, params_to_jax
from torch_model.optim import OptimizerConfig, plan_parameters

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True)
class StepConfig:
    kernels: str | dict | None = None     # e.g. "attention=pallas,moe=xla"; None = auto
    compute_dtype: str = "float32"         # "bfloat16": bf16 compute, float32 master weights
    micro_batches: int = 1                 # gradient accumulation steps inside the jit
    matmul_precision: str = "highest"      # explicit: TPU's default float32 matmul is bf16 passes

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"StepConfig.compute_dtype must be one of {list(COMPUTE_DTYPES)}, "
                             f"found {self.compute_dtype!r}")
        if self.micro_batches < 1:
            raise ValueError(f"StepConfig.micro_batches must be >= 1, found {self.micro_batches}")


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
                 step_cfg: StepConfig = StepConfig(), mesh=None):
        self.model, self.opt_cfg, self.cfg, self.mesh = model, opt_cfg, step_cfg, mesh
        self.env = get_env()
        self.kernels = registry.resolve(step_cfg.kernels)
        self.layout = "per_layer"       # how state.params are stored (train/checkpoint.py LAYOUTS)
        self.plan = plan_parameters(model.named_parameters())
        self.forward = model_function(model)
        self.update = optimizer_function(self.plan, opt_cfg)
        self.compute_dtype = COMPUTE_DTYPES[step_cfg.compute_dtype]
        self.trace_count = 0
        self._jitted = jax.jit(self._step, donate_argnums=(0,))
        self._jitted_eval = jax.jit(self._eval)

    # ---- state --------------------------------------------------------------------------------
    def init_state(self) -> TrainState:
        state = TrainState(params_to_jax(self.model), optimizer_state_to_jax(self.model, self.plan))
        return state if self.mesh is None else sharding.shard_state(state, self.mesh)

    # ---- traced functions -----------------------------------------------------------------------
    def loss_and_metrics(self, params, inputs, labels):
        with registry.routed(self.env, self.kernels), jax.default_matmul_precision(self.cfg.matmul_precision):
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
        with jax.default_matmul_precision(self.cfg.matmul_precision):
            params, opt_state, stats = self.update(state.params, grads, state.opt_state, lr_scale)
        metrics = jax.tree.map(lambda m: m.mean(0), micro_metrics)
        # A non-finite loss or gradient norm skips the update here, with no host round trip:
        # parameters and optimizer state (its step count too) stay as they were, while the
        # caller's step counter, learning-rate schedule and data move on.
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(stats["grad_norm"])
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), TrainState(params, opt_state), state)
        metrics.update(grad_norm=stats["grad_norm"], grad_norm_clipped=stats["grad_norm_clipped"],
                       skipped=jnp.logical_not(finite).astype(jnp.int32))
        return new_state, metrics

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
        """(loss, metrics), grads for one batch [batch, seq_len+1] (for parity checks)."""
        return jax.jit(self._grads)(params, jnp.asarray(tokens, dtype=jnp.int32))


def _scalar_metrics(out: dict) -> dict:
    """The loss parts, plus for MoE models the routed-token fraction per layer and expert
    ("expert_fraction" [layers, experts]) and its largest value times E (1.0: balanced)."""
    metrics = {k: v for k, v in out.items() if v.ndim == 0}
    if "expert_fraction" in out:
        frac = out["expert_fraction"]
        metrics["expert_fraction"] = frac
        metrics["expert_load_max"] = frac.max() * frac.shape[-1]
    return metrics
