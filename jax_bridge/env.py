"""The torchax environment, created once (through the torch 2.13 compatibility shim)."""
from __future__ import annotations

import functools
import warnings

from jax_bridge import accumulation, aten_overrides, module_ops
from jax_bridge.torchax_compat import import_torchax


@functools.lru_cache(maxsize=None)
def get_env():
    # torch's int64 indices become int32 under JAX's default 32-bit mode, by design.
    warnings.filterwarnings("ignore", message="Explicitly requested dtype int64", category=UserWarning)
    accumulation.install()    # bf16 gradients of broadcast parameters sum in float32
    torchax = import_torchax()
    import torch_model.ops  # noqa: F401  (registers torch.ops.torchlyra.* before routing)
    env = torchax.default_env()
    aten_overrides.install(env)    # aten.embedding without a scatter (sharded tables), aten.topk unsorted again
    module_ops.install(env)        # a plain module's SDPA calls to the attention op, torch._grouped_mm lowered
    return env
