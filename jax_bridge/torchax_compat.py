"""Make torchax 0.0.13 work on torch 2.13, without editing installed files.

Two breaks (see ../shared/STACK.md):
1. torch 2.13 removed the named-tensor (Dimname) overloads that torchax lists in `amp.py` and
   `decompositions.py`, so `import torchax` raises AttributeError. While torchax imports (and
   while it builds its first environment, where it loads decompositions lazily) a missing
   Dimname/names overload resolves to an inert placeholder; the lookup is restored afterwards.
2. torch 2.13's `freeze_rng_state` calls `set_rng_state(state)` with one argument on the
   current accelerator, which torchax makes `jax`; its `set_rng_state` requires `device`.

And one speed-up, not a fix: torchax's op dispatch walks each op's arguments with
jax_bridge/torchax_pytree.py instead of torch's generic pytree (the same results; a step
lowers 1.1-1.4x faster).

The fixes are gated on the need itself (the overloads are missing), so they are inert on torch
versions that still have them, and on a torchax that no longer asks for them. Upstream fixed them
after 0.0.13 (google/torchax #102): delete them when a release includes the fix.
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch

_applied = False


def _named_overloads_missing() -> bool:
    return "dim_Dimname" not in torch.ops.aten.prod.overloads()


class _MissingOverload:
    """Stands in for an overload torch no longer has. Hashable, never called in practice."""

    def __init__(self, packet_name: str, overload: str):
        self.name = f"{packet_name}.{overload} (removed in torch {torch.__version__})"

    def __repr__(self):
        return f"<missing overload {self.name}>"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} does not exist in this torch version")


def _is_named_tensor_overload(key: str) -> bool:
    return "Dimname" in key or "dimname" in key or "names" in key.split("_")


@contextlib.contextmanager
def _tolerate_missing_named_overloads():
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def getattr_with_placeholder(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if _is_named_tensor_overload(key):
                return _MissingOverload(self._qualified_op_name, key)
            raise

    packet.__getattr__ = getattr_with_placeholder
    try:
        yield
    finally:
        packet.__getattr__ = original


def _default_device_for_set_rng_state(device_module):
    original = device_module.set_rng_state
    if getattr(original, "_torchlyra_wrapped", False):
        return

    @functools.wraps(original)
    def set_rng_state(new_state, device=None):
        return original(new_state, device)

    set_rng_state._torchlyra_wrapped = True
    device_module.set_rng_state = set_rng_state


def import_torchax():
    """Import torchax (and build its default environment) with the fixes above if needed, and
    the faster argument walks."""
    global _applied
    if _named_overloads_missing():
        with _tolerate_missing_named_overloads():
            torchax = importlib.import_module("torchax")
            torchax.default_env()
        _default_device_for_set_rng_state(importlib.import_module("torchax.device_module"))
        _applied = True
    else:
        torchax = importlib.import_module("torchax")
    _fast_argument_walks(importlib.import_module("torchax.tensor"))
    return torchax


def _fast_argument_walks(dispatching) -> None:
    """torchax's module that dispatches each op walks its arguments through jax_bridge.torchax_pytree
    (torch's results, faster), once."""
    from jax_bridge import torchax_pytree

    if not getattr(dispatching.torch_pytree, "_torchlyra_fast", False):
        dispatching.torch_pytree = torchax_pytree.module_for(dispatching.torch_pytree)


def is_applied() -> bool:
    return _applied
