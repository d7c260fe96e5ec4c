"""Lower the PyTorch model and optimizer into pure JAX functions through torchax.

Nothing here re-implements the model or the optimizer: both run as their torch code, traced by
torchax into JAX. Kernel routing happens at trace time (`registry.routed`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from jax_bridge.env import get_env
from torch_model.optim import OptimizerConfig, init_state, muon_adamw_update, plan_parameters


def params_to_jax(model: torch.nn.Module) -> dict[str, jax.Array]:
    """The model's parameters as a flat dict of JAX arrays keyed by parameter name."""
    env = get_env()
    return {name: env.t2j_copy(p.detach()) for name, p in model.named_parameters()}


def params_to_torch(params: dict[str, jax.Array]) -> dict[str, torch.Tensor]:
    """JAX arrays back to CPU torch tensors (for checkpoints and eager use)."""
    import numpy as np

    out = {}
    for name, value in params.items():
        arr = np.asarray(jax.device_get(value))
        if arr.dtype == jnp.bfloat16:
            out[name] = torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(np.array(arr))
    return out


def model_function(model: torch.nn.Module, method: str = "forward", call=None):
    """fn(params, *args) -> model.<method>(*args) with `params` substituted, as a JAX function;
    with `call`, fn(params, *args) -> call(model, *args). The module's buffers (a rotary
    embedding's `inv_freq`) enter as constants, so nothing of the eager module is read in the trace."""
    env = get_env()
    wrapped = method != "forward" or call is not None
    module = _CallAsForward(model, call or (lambda m, *a: getattr(m, method)(*a))) if wrapped else model
    prefix = "inner." if wrapped else ""

    def fn(params, *args):
        # Converted in each trace (a constant of that program; one kept across traces would leak
        # its tracer); a `meta` model's buffers (planning without weights) enter as zeros.
        buffers = {prefix + n: _buffer_value(env, b) for n, b in model.named_buffers()}
        torch_params, torch_args = env.j2t_iso(({**buffers, **{prefix + k: v for k, v in params.items()}}, args))
        # functional_call puts a tensor of a module reachable under several paths (one rotary module
        # for every layer, a module model's blocks under the boundary's names and its own) back under
        # one of them only: the traced values must not outlive the trace.
        held = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules() if m._parameters or m._buffers]
        try:
            with env:
                out = torch.func.functional_call(module, torch_params, torch_args)
        finally:
            for m, params_before, buffers_before in held:
                _put_back(m._parameters, params_before)
                _put_back(m._buffers, buffers_before)
        return env.t2j_iso(out)

    return fn


def _put_back(tensors: dict, before: dict) -> None:
    """A module's tensors as they were before the call, where the call left another value; a name
    the module no longer holds in that dict (a parametrization peft registered for the call and
    left in place after a failure) stays as it is."""
    for name, tensor in before.items():
        if name in tensors and tensors[name] is not tensor:
            tensors[name] = tensor


def _buffer_value(env, b: torch.Tensor):
    """A buffer as the traced program takes it: the host tensor's value; inside an enclosing
    model_function call (a decoder layer run by the layer stack inside the whole model's call),
    the value that call already substituted (a torchax tensor, which reports the `meta` device:
    read as meta, a layer's own buffers, such as Apertus's activation constants, went in as
    zeros); zeros for a `meta` model's buffers (planning without weights)."""
    from jax_bridge.torchax_compat import import_torchax

    if isinstance(b, import_torchax().tensor.Tensor):
        return env.t2j_iso(b)
    return jnp.zeros(b.shape, _abstract(b).dtype) if b.is_meta else env.t2j_copy(b.detach())


class _CallAsForward(torch.nn.Module):
    """Calls call(inner, *args) as `forward` (another method, or a layer through its backbone),
    for `functional_call`."""

    def __init__(self, inner: torch.nn.Module, call):
        super().__init__()
        self.inner, self._call = inner, call

    def forward(self, *args):
        return self._call(self.inner, *args)


def optimizer_function(plan, cfg: OptimizerConfig, *, matmul_precision: str, orthogonalize=None):
    """update(params, grads, state, lr_scale) -> (params, state, stats): the torch optimizer's
    own update, traced through torchax (`orthogonalize`: see muon_adamw_update), its matmuls
    (Muon's Newton-Schulz products) at `matmul_precision` ("default" | "high" | "highest", as
    jax.default_matmul_precision takes it) whatever the caller's scope: the precision is part of
    the function, so no program that traces it can leave it at the platform's default (on TPU one
    bf16 pass: a float32 step's update off by ~1e-3)."""
    env = get_env()

    def update(params, grads, state, lr_scale):
        torch_args = env.j2t_iso((params, grads, state, lr_scale))
        with jax.default_matmul_precision(matmul_precision), env:
            out = muon_adamw_update(*torch_args[:3], plan, cfg, torch_args[3], orthogonalize=orthogonalize)
        return env.t2j_iso(out)

    return update


def optimizer_state_to_jax(model: torch.nn.Module, plan) -> dict:
    env = get_env()
    state = init_state({n: p.detach() for n, p in model.named_parameters() if n in plan}, plan)
    return jax.tree.map(env.t2j_copy, state, is_leaf=lambda x: isinstance(x, torch.Tensor))


def _abstract(t: torch.Tensor) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(t.shape), jnp.dtype(str(t.dtype).removeprefix("torch.")))


def abstract_params(model: torch.nn.Module) -> dict[str, jax.ShapeDtypeStruct]:
    """The parameters' shapes and dtypes only: works for a model built on the `meta` device
    (no weights), which is how a plan for a big preset is compiled without the memory."""
    return {name: _abstract(p) for name, p in model.named_parameters()}


def abstract_optimizer_state(model: torch.nn.Module, plan) -> dict:
    """The optimizer state's shapes and dtypes (see abstract_params), for the parameters `plan`
    covers (the trainable ones)."""
    with torch.device("meta"):
        state = init_state({n: p.detach() for n, p in model.named_parameters() if n in plan}, plan)
    return jax.tree.map(_abstract, state, is_leaf=lambda x: isinstance(x, torch.Tensor))


__all__ = ["params_to_jax", "params_to_torch", "model_function", "optimizer_function",
           "optimizer_state_to_jax", "abstract_params", "abstract_optimizer_state", "plan_parameters"]
