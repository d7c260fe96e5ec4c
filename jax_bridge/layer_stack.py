"""The decoder stack as the bridge runs it: stacked layer parameters, one `lax.scan`, remat.

Layer types repeat with a period (GPT-OSS: sliding, full, sliding, full, ...). Stacked, the
parameters of the layers at the same place in the period share one array with a leading layer
axis: `model.layers.stack0.self_attn.q_proj.weight` holds layers 0, 2, 4, ... and `stack1` layers
1, 3, 5, ... (period 2). The scan then runs one period per step, so every layer inside keeps its
static attention window, and the compiled program stops growing with depth. Each layer can be
rematerialized in the backward pass (`remat`: none | full | save-matmuls). The torch model knows
none of this: the bridge replaces `Backbone.run_layers` while it traces, and calls each torch
layer through `functional_call`. Per-layer names (`model.layers.3...`) come back with `unstack`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import numpy as np

from jax_bridge import sharding
from jax_bridge.env import get_env
from jax_bridge.lowering import model_function

LAYERS = "model.layers."
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,                    # keep only each layer's input
    "save-matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,   # keep projections' outputs
}
_PER_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_STACKED = re.compile(r"model\.layers\.stack(\d+)\.(.+)")


def layer_period(layer_types) -> int:
    """Smallest p dividing the layer count such that layer i has the type of layer i mod p."""
    n = len(layer_types)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(layer_types[i] == layer_types[i % p] for i in range(n)))


@dataclass(frozen=True)
class LayerLayout:
    """How the train state holds the decoder layers' parameters: per layer, or stacked."""
    n_layers: int
    period: int = 1
    stacked: bool = False

    @classmethod
    def for_config(cls, cfg, stacked: bool) -> "LayerLayout":
        return cls(cfg.n_layers, layer_period(cfg.layer_types), stacked)

    @property
    def depth(self) -> int:
        """Scan length: how many periods the stack holds."""
        return self.n_layers // self.period

    @property
    def tag(self) -> str:
        """How checkpoints name this layout ("per_layer" or "stacked"; the period follows from
        the model config's layer types)."""
        return "stacked" if self.stacked else "per_layer"

    @classmethod
    def from_tag(cls, tag: str, cfg) -> "LayerLayout":
        if tag not in ("per_layer", "stacked"):
            raise ValueError(f"unknown layer layout {tag!r} (expected 'per_layer' or 'stacked')")
        return cls.for_config(cfg, stacked=tag == "stacked")

    # ---- names and arrays ----------------------------------------------------------------------
    def stack(self, params: dict, stack=np.stack) -> dict:
        """{per-layer name: array} -> {stacked name: array with a leading layer axis}; other
        names pass through. Identity for the per-layer layout."""
        if not self.stacked:
            return dict(params)
        out, slots = {}, {}
        for name, value in params.items():
            m = _PER_LAYER.fullmatch(name)
            if not m:
                out[name] = value
                continue
            i, rest = int(m.group(1)), m.group(2)
            slots.setdefault((i % self.period, rest), {})[i // self.period] = value
        for (slot, rest), layers in sorted(slots.items()):
            if sorted(layers) != list(range(self.depth)):
                raise ValueError(f"stacking {rest}: layers {sorted(layers)} of slot {slot}, expected {self.depth}")
            out[f"{LAYERS}stack{slot}.{rest}"] = stack([layers[j] for j in range(self.depth)])
        return out

    def unstack(self, params: dict) -> dict:
        """{stacked name: array} -> {per-layer name: array} (slices along the layer axis)."""
        if not self.stacked:
            return dict(params)
        out = {}
        for name, value in params.items():
            m = _STACKED.fullmatch(name)
            if not m:
                out[name] = value
                continue
            slot, rest = int(m.group(1)), m.group(2)
            for j in range(self.depth):
                out[f"{LAYERS}{j * self.period + slot}.{rest}"] = value[j]
        return out

    def map_state(self, fn, tree):
        """Apply `stack` or `unstack` (fn) to every dict keyed by parameter names inside a
        train-state pytree (parameters, optimizer moments), leaving everything else as is."""
        if isinstance(tree, dict):
            if any(isinstance(k, str) and k.startswith(LAYERS) for k in tree):
                return fn(tree)
            return {k: self.map_state(fn, v) for k, v in tree.items()}
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            return type(tree)(*(self.map_state(fn, v) for v in tree))
        return tree


def layered_forward(model, layout: LayerLayout, *, remat: str = "none", mesh=None, method: str = "forward"):
    """fn(params, *args) -> model.<method>(*args), like `lowering.model_function`, with the decoder stack
    run here: a `lax.scan` over the stacked parameters (or a loop over per-layer ones), each
    layer under the remat policy, the hidden state kept split over the batch between layers."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, found {remat!r}")
    env = get_env()
    backbone = model.model
    templates = list(backbone.layers)[: layout.period] if layout.stacked else list(backbone.layers)
    layer_fns = [model_function(layer, call=backbone.call_layer) for layer in templates]
    if remat != "none":
        layer_fns = [jax.checkpoint(f, policy=REMAT_POLICIES[remat], prevent_cse=not layout.stacked)
                     for f in layer_fns]
    whole = model_function(model, method)
    activation = ("batch", None, None)

    def run(layer_params, h, cos, sin, *segments):        # segments: () or (segment_ids,)
        h = sharding.constrain(h, mesh, activation)
        if not layout.stacked:
            stats = []
            for i, layer_fn in enumerate(layer_fns):
                h, st = layer_fn(_params_of(layer_params, f"{LAYERS}{i}."), h, cos, sin, *segments)
                h = sharding.constrain(h, mesh, activation)
                stats.append(st)
            return h, stats
        slots = [_params_of(layer_params, f"{LAYERS}stack{s}.") for s in range(layout.period)]

        def period(h, slot_params):
            outs = []
            for layer_fn, p in zip(layer_fns, slot_params):
                h, st = layer_fn(p, h, cos, sin, *segments)
                h = sharding.constrain(h, mesh, activation)
                outs.append(st)
            return h, outs

        h, ys = jax.lax.scan(period, h, slots)
        stats = [jax.tree.map(lambda a, j=i // layout.period: a[j], ys[i % layout.period]) for i in range(layout.n_layers)]
        return h, stats

    def fn(params, *args):
        layer_params = {n: v for n, v in params.items() if n.startswith(LAYERS)}
        others = {n: v for n, v in params.items() if not n.startswith(LAYERS)}

        def run_layers(x, cos, sin, *segments):        # called by the torch Backbone with torchax tensors
            return env.j2t_iso(run(layer_params, *env.t2j_iso((x, cos, sin, *segments))))

        backbone.run_layers = run_layers
        try:
            return whole(others, *args)
        finally:
            del backbone.run_layers

    return fn


def _params_of(params: dict, prefix: str) -> dict:
    return {n[len(prefix):]: v for n, v in params.items() if n.startswith(prefix)}
