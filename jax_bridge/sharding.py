"""Where arrays live on a device mesh: the one place that decides sharding.

Today: data parallelism. The batch is split over the `data` axis; parameters and optimizer
state follow `PARAM_RULES` (all replicated for now). Adding FSDP, tensor or expert parallelism
means adding mesh axes and rules here, keyed by parameter name, without touching the model.
"""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data",)
# (regex on the parameter name, PartitionSpec); first match wins.
PARAM_RULES: list[tuple[str, P]] = [
    (r".*", P()),
]


def make_mesh(data: int | None = None, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    data = data or len(devices)
    if data > len(devices):
        raise ValueError(f"mesh: asked for data={data} devices, only {len(devices)} available")
    return Mesh(np.array(devices[:data]).reshape(data), MESH_AXES)


def param_spec(name: str) -> P:
    for pattern, spec in PARAM_RULES:
        if re.fullmatch(pattern, name):
            return spec
    raise ValueError(f"sharding: no rule for parameter {name!r}")


def shard_state(state, mesh: Mesh):
    """Place params (and the optimizer state, which mirrors them by name) per PARAM_RULES."""

    def place(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        name = next((n for n in reversed(names) if isinstance(n, str) and "." in n), None)
        spec = param_spec(name) if name else P()
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Tokens [micro_batches, batch, seq_len + 1]: the batch axis is split over `data`."""
    return NamedSharding(mesh, P(None, "data", None))
