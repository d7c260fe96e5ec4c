"""A model compiled onto a mesh: the one owner of what placing a model needs to know of it.

The train step (jax_bridge/step.py), the decoder (jax_bridge/decoding.py) and the scorer
(train/evaluation/scorer.py) each compile a model onto a device mesh. What they read of the
model (its shape, the roles it declares for parameters beyond their names: transformers' expert
stacks, a module model's structure; how its layers are stacked) and where each of its arrays
lives are decided here, once, so that every program places a model of any kind alike.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_bridge import sharding
from jax_bridge.layer_stack import LayerLayout
from jax_bridge.lowering import abstract_params
from torch_model.causal_lm import keeps_float32, parameter_roles
from torch_model.lora import unwrap

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def in_compute_dtype(name: str, dtype) -> bool:
    """Whether a parameter is held in the compute dtype: floating ones are, except those the model
    keeps in float32 (torch_model.causal_lm.keeps_float32: the router); integer ones (an MXFP4
    base's bytes) keep theirs."""
    return jnp.issubdtype(dtype, jnp.floating) and not keeps_float32(name)


class ModelOnMesh:
    """`model` (peft-wrapped or not) placed on `mesh` (None: one device), its decoder layers
    stacked for a scan when `scan_layers` (and the model has layers to stack)."""

    def __init__(self, model, mesh=None, *, scan_layers: bool = False):
        self.model = unwrap(model)           # peft injects its layers in place: the torch model's facts
        self.cfg, self.mesh = self.model.cfg, mesh
        self.roles = parameter_roles(self.model)
        self.layers = LayerLayout.for_config(self.cfg, scan_layers)
        if mesh is not None:
            sharding.check_model_fits(self.cfg, mesh)

    def shardings(self, tree):
        """NamedSharding of every leaf of a state pytree keyed by parameter names (None: no mesh)."""
        return None if self.mesh is None else sharding.state_shardings(tree, self.mesh, self.roles)

    def spec(self, name: str, shape):
        """The PartitionSpec of one parameter (a stacked one too) on the mesh."""
        return sharding.param_spec(name, shape, self.mesh, self.roles)

    def place(self, host):
        """Host arrays onto the devices: split by the rules, or committed to one device."""
        if self.mesh is None:
            return jax.device_put(host, sharding.one_device())
        return sharding.place(host, self.shardings(host))

    def parameter_specs(self, compute_dtype) -> dict:
        """The parameters as a program that only runs the model holds them, without weights: shapes,
        dtypes (the compute dtype where `in_compute_dtype` says so) and, on a mesh, shardings.
        The model may be on `meta`: to compile without weights, or for a loader to fill."""
        compute = COMPUTE_DTYPES.get(compute_dtype, compute_dtype)
        flat = {n: jax.ShapeDtypeStruct(a.shape, compute if in_compute_dtype(n, a.dtype) else a.dtype)
                for n, a in abstract_params(self.model).items()}
        placed = self.shardings(flat)
        return flat if placed is None else {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed[n])
                                            for n, a in flat.items()}

    def for_inference(self, compute_dtype) -> "ModelOnMesh":
        """The same model on the mesh a command that only runs it uses (sharding.inference_mesh:
        `fsdp` folded into `tensor` where that holds fewer bytes per device)."""
        if self.mesh is None:
            return self
        folded = sharding.inference_mesh(self.mesh, self.cfg, ModelOnMesh(self.model).parameter_specs(compute_dtype),
                                         self.roles)
        return self if folded is self.mesh else ModelOnMesh(self.model, folded, scan_layers=self.layers.stacked)
