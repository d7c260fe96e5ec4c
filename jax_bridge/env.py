"""The torchax environment, created once (through the torch 2.13 compatibility shim)."""
from __future__ import annotations

import functools

from jax_bridge.torchax_compat import import_torchax


@functools.lru_cache(maxsize=None)
def get_env():
    torchax = import_torchax()
    import torch_model.ops  # noqa: F401  (registers torch.ops.torchlyra.* before routing)
    return torchax.default_env()
