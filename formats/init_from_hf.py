"""`--init-from HF_DIR`: a transformers GptOss directory (gpt-oss as released, MXFP4 experts, or
unquantized) loaded straight into the sharded train state. Each process reads from the
safetensors shards only the slices its own devices hold (`jax.make_array_from_callback` asks for
exactly those; formats/hf_weights.py reads them with `get_slice` and dequantizes on the host), so
no process ever holds a tensor it does not own, let alone the model. Optimizer state starts at
zeros, made on the devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from formats.hf_model import is_hf_dir, open_hf
from formats.hf_weights import HFWeights
from formats.errors import UserError
from formats.transformers_import import is_transformers_dir


def is_gpt_oss_dir(path) -> bool:
    """A gpt-oss directory, which --init-from streams onto the mesh (another family's directory:
    formats/transformers_import.py)."""
    return is_hf_dir(path) and not is_transformers_dir(path)


def open_for_init(path):
    """(ModelConfig, HFWeights) of an HF directory that --init-from can load without a conversion."""
    cfg, weights = open_hf(path)
    if not cfg.is_moe:
        raise UserError(f"--init-from {path}: a one-expert model loads directly only as a MoE; for the dense "
                        f"preset convert it first (`torchlyra import --hf {path} --out CK --dense`)")
    return cfg, weights


def source_names(layout, names) -> dict[str, list[str] | str]:
    """Train-state parameter name -> the per-layer (= transformers) name(s) it is made of: a
    list, one per layer along the leading axis, for stacked parameters."""
    return layout.stack({n: n for n in names}, stack=list)


def read_param(weights: HFWeights, source, index) -> np.ndarray:
    """The float32 values of `index` (a tuple of slices) of one train-state parameter."""
    if isinstance(source, str):
        return np.asarray(weights.read(source, index), np.float32)
    layers, rest = index[0], index[1:]
    return np.stack([np.asarray(weights.read(source[j], rest), np.float32)
                     for j in range(*layers.indices(len(source)))])


def init_params(step, weights: HFWeights) -> dict:
    """The train state's parameters (step.layer_layout, step.mesh), each device's block read
    from `weights` on demand."""
    abstract = step.abstract_state().params
    sources = source_names(step.layer_layout, [n for n, _ in step.model.named_parameters()])
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def make(name, a):
        sharding = a.sharding if step.mesh is not None else single
        read: dict[tuple, np.ndarray] = {}      # devices of this process holding the same block read it once

        def block(index):
            key = tuple(s.indices(n)[:2] for s, n in zip(index, a.shape))
            if key not in read:
                read[key] = read_param(weights, sources[name], index)
            return read[key]

        return jax.make_array_from_callback(a.shape, sharding, block)

    return {name: make(name, a) for name, a in abstract.items()}


def zero_optimizer_state(step):
    """The optimizer state at zeros (what a fresh run starts from), created on its devices."""
    abstract = step.abstract_state().opt_state
    shardings = None if step.mesh is None else jax.tree.map(lambda a: a.sharding, abstract)
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=shardings)()


def init_state(step, weights: HFWeights):
    """A fresh TrainState whose parameters come from `weights` (see the module docstring)."""
    from jax_bridge.step import TrainState

    return TrainState(init_params(step, weights), zero_optimizer_state(step))
