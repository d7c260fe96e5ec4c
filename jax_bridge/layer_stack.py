"""The decoder stack as the bridge runs it: stacked layer parameters, one `lax.scan`, remat.

Layer types repeat with a period (GPT-OSS: sliding, full, sliding, full, ...). Stacked, the
parameters of the layers at the same place in the period share one array with a leading layer
axis: `model.layers.stack0.self_attn.q_proj.weight` holds layers 0, 2, 4, ... and `stack1` layers
1, 3, 5, ... (period 2). The scan then runs one period per step, so every layer inside keeps its
static attention window, and the compiled program stops growing with depth. A stack whose types
do not repeat (3 dense layers, then MoE ones) scans each run of identical layers on its own
(`layer_groups`), its slots numbered on across the groups. Each layer can be
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
# Layout primitives, and elementwise ones: cheap to run again in the backward from what they read.
_LAYOUT = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "concatenate", "slice",
                     "iota", "copy", "copy_p"})
_ELEMENTWISE = _LAYOUT | {
    "convert_element_type", "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "exp2", "log",
    "log1p", "sqrt", "rsqrt", "pow", "integer_pow", "square", "tanh", "logistic", "erf", "sin", "cos", "clamp",
    "select_n", "eq", "ne", "lt", "gt", "le", "ge", "and", "or", "not"}
# What a custom-VJP function that only moves data runs: gathers and their index arithmetic.
_DATA_MOVEMENT = _LAYOUT | {"gather", "dynamic_slice", "div", "convert_element_type"}


def saves_all_but_float32_elementwise(prim, *avals, **params) -> bool:
    """The remat policy of scanned layers without remat under bf16 compute: every value the
    backward needs is saved but those that elementwise ops compute in, from or into float32 (a
    norm's or a softmax's float32 intermediates) and the outputs of custom-VJP functions that only
    move data (the MoE dispatch's gather of each row's copies, moe_dispatch.sort_rows); the
    backward computes them again from the saved compute-dtype values, statistics and indices. A
    scan stacks each saved value of every layer (and JAX rounds it, a pass of its own where a
    custom call made it); unrolled layers keep such values inside fusions, or leave the gathered
    rows where they lie. On `small-o200k` at 16 x 2048 for a v5e (deviceless, `torchlyra plan
    --roofline`): temporaries 4.61 -> 2.86 GiB, the step's roofline 204.60 -> 201.67 ms (looped:
    196.23); gpt-oss-600m 41.45 -> 21.88 GiB."""
    if prim.name == "custom_vjp_call":
        return not all(eqn.primitive.name in _DATA_MOVEMENT for eqn in params["call_jaxpr"].jaxpr.eqns)
    wide = params.get("new_dtype") == np.float32 or any(getattr(a, "dtype", None) == np.float32 for a in avals)
    return not (wide and prim.name in _ELEMENTWISE)


_PER_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_STACKED = re.compile(r"model\.layers\.stack(\d+)\.(.+)")


def layer_period(layer_types) -> int:
    """Smallest p dividing the layer count such that layer i has the type of layer i mod p."""
    n = len(layer_types)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(layer_types[i] == layer_types[i % p] for i in range(n)))


def layer_groups(layer_types) -> tuple[tuple[int, int, int], ...]:
    """The scans of a decoder stack, (first layer, period, depth) each: one over the whole stack
    when its types repeat with a period shorter than it; otherwise one per run of identical
    layers (e.g. 3 dense layers, then 58 MoE ones: two scans instead of 61 layers unrolled)."""
    n, period = len(layer_types), layer_period(layer_types)
    if period < n:
        return ((0, period, n // period),)
    groups, start = [], 0
    for i in range(1, n + 1):
        if i == n or layer_types[i] != layer_types[start]:
            groups.append((start, 1, i - start))
            start = i
    return tuple(groups)


@dataclass(frozen=True)
class LayerLayout:
    """How the train state holds the decoder layers' parameters: per layer, or stacked in
    groups (`layer_groups`: (first layer, period, depth) each). Stacked slots are numbered across
    the groups: `stack{k}` holds one place of one group's period for each of its `depth` steps."""
    n_layers: int
    stacked: bool = False
    groups: tuple = ()          # () for per-layer parameters

    @classmethod
    def for_config(cls, cfg, stacked: bool) -> "LayerLayout":
        stacked = stacked and cfg.n_layers > 0          # a module model whose blocks run unrolled has none
        return cls(cfg.n_layers, stacked, layer_groups(cfg.layer_types) if stacked else ())

    @property
    def grouped(self) -> bool:
        """Stacked in several groups whose names differ from one period over every layer (a
        group deeper than one layer); a layout of one period per group of depth 1 names its
        slots as "stacked" does."""
        return any(depth > 1 for _, _, depth in self.groups) and len(self.groups) > 1

    @property
    def tag(self) -> str:
        """How checkpoints name this layout: "per_layer", "stacked" (one period over every layer,
        the period following from the model's layer types) or "grouped" (`layer_groups`)."""
        return "per_layer" if not self.stacked else "grouped" if self.grouped else "stacked"

    @classmethod
    def from_tag(cls, tag: str, cfg) -> "LayerLayout":
        if tag == "per_layer":
            return cls.for_config(cfg, stacked=False)
        if tag == "stacked":       # one period over every layer, as checkpoints before groups hold them
            period = layer_period(cfg.layer_types)
            return cls(cfg.n_layers, True, ((0, period, cfg.n_layers // period),))
        if tag == "grouped":
            return cls.for_config(cfg, stacked=True)
        raise ValueError(f"unknown layer layout {tag!r} (expected 'per_layer', 'stacked' or 'grouped')")

    def slots(self) -> list[tuple[int, int, int, int]]:
        """Per stacked slot k (list index): (first layer, period, depth, place in the period)."""
        return [(start, period, depth, place) for start, period, depth in self.groups for place in range(period)]

    def _slot_of(self) -> dict[int, tuple[int, int]]:
        """Layer index -> (slot, step along that slot's stack)."""
        return {start + j * period + place: (k, j) for k, (start, period, depth, place) in enumerate(self.slots())
                for j in range(depth)}

    # ---- names and arrays ----------------------------------------------------------------------
    def stack(self, params: dict, stack=np.stack) -> dict:
        """{per-layer name: array} -> {stacked name: array with a leading layer axis}; other
        names pass through. Identity for the per-layer layout."""
        if not self.stacked:
            return dict(params)
        out, slots, where, depths = {}, {}, self._slot_of(), [depth for _, _, depth, _ in self.slots()]
        for name, value in params.items():
            m = _PER_LAYER.fullmatch(name)
            if not m:
                out[name] = value
                continue
            i, rest = int(m.group(1)), m.group(2)
            slot, j = where[i]
            slots.setdefault((slot, rest), {})[j] = value
        for (slot, rest), layers in sorted(slots.items()):
            depth = depths[slot]
            if sorted(layers) != list(range(depth)):
                raise ValueError(f"stacking {rest}: layers {sorted(layers)} of slot {slot}, expected {depth}")
            out[f"{LAYERS}stack{slot}.{rest}"] = stack([layers[j] for j in range(depth)])
        return out

    def unstack(self, params: dict) -> dict:
        """{stacked name: array} -> {per-layer name: array} (slices along the layer axis)."""
        if not self.stacked:
            return dict(params)
        out, slots = {}, self.slots()
        for name, value in params.items():
            m = _STACKED.fullmatch(name)
            if not m:
                out[name] = value
                continue
            slot, rest = int(m.group(1)), m.group(2)
            start, period, depth, place = slots[slot]
            for j in range(depth):
                out[f"{LAYERS}{start + j * period + place}.{rest}"] = value[j]
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


def layered_forward(model, layout: LayerLayout, *, remat: str = "none", mesh=None, method: str = "forward",
                    compute_dtype=None):
    """fn(params, *args) -> model.<method>(*args), like `lowering.model_function`, with the decoder stack
    run here: a `lax.scan` over the stacked parameters (or a loop over per-layer ones), each
    layer under the remat policy, the hidden state kept split over the batch between layers.
    Scanned layers without remat whose compute dtype is narrower than float32 save what
    `saves_all_but_float32_elementwise` lets them."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, found {remat!r}")
    env = get_env()
    backbone = model.model
    layers = layer_modules(backbone) if layout.n_layers else []
    # One function per stacked slot (the first layer of its place in its group), else per layer.
    templates = [layers[start + place] for start, _, _, place in layout.slots()] if layout.stacked else layers
    policy = REMAT_POLICIES[remat]
    if policy is None and layout.stacked and compute_dtype is not None and np.dtype(compute_dtype).itemsize < 4:
        policy = saves_all_but_float32_elementwise
    layer_fns = [_layer_call(model_function(layer, call=backbone.call_layer), policy, prevent_cse=not layout.stacked)
                 for layer in templates]
    whole = model_function(model, method)
    activation = ("batch", None, None)

    def run(layer_params, h, *extras):      # extras: what each layer takes besides h (ours: cos, sin, segments)
        h = sharding.constrain(h, mesh, activation)
        if not layout.stacked:
            stats = []
            for i, layer_fn in enumerate(layer_fns):
                h, st = layer_fn(_params_of(layer_params, f"{LAYERS}{i}."), h, *extras)
                h = sharding.constrain(h, mesh, activation)
                stats.append(st)
            return h, stats
        slots = [_params_of(layer_params, f"{LAYERS}stack{k}.") for k in range(len(layer_fns))]
        stats, first = [None] * layout.n_layers, 0
        for start, period, depth in layout.groups:         # one scan per group, in layer order
            fns = layer_fns[first:first + period]

            def one_period(h, slot_params, fns=fns):
                outs = []
                for layer_fn, p in zip(fns, slot_params):
                    h, st = layer_fn(p, h, *extras)
                    h = sharding.constrain(h, mesh, activation)
                    outs.append(st)
                return h, outs

            h, ys = jax.lax.scan(one_period, h, slots[first:first + period])
            for j in range(depth):
                for place in range(period):
                    stats[start + j * period + place] = jax.tree.map(lambda a, j=j: a[j], ys[place])
            first += period
        return h, stats

    def fn(params, *args):
        layer_params = {n: v for n, v in params.items() if n.startswith(LAYERS)}
        others = {n: v for n, v in params.items() if not n.startswith(LAYERS)}

        def run_layers(x, *extras):        # called by the torch backbone with torchax tensors
            return env.j2t_iso(run(layer_params, *env.t2j_iso((x, *extras))))

        backbone.run_layers = run_layers
        try:
            return whole(others, *args)
        finally:
            del backbone.run_layers

    return fn


def _params_of(params: dict, prefix: str) -> dict:
    return {n[len(prefix):]: v for n, v in params.items() if n.startswith(prefix)}


def layer_modules(backbone) -> list:
    """The backbone's layers in order (`model.layers`: a ModuleList, or a ModuleDict keyed 0..N-1)."""
    layers = backbone.layers
    return list(layers.values()) if hasattr(layers, "values") else list(layers)


def _layer_call(fn, policy, prevent_cse: bool):
    """fn(params, h, *extras) under the remat `policy` (None: as it is). What the layer takes
    besides h may hold leaves that are not arrays (a module's Python flags, None, ints): they stay
    constants of the layer's function, since jax.checkpoint takes arrays only."""
    if policy is None:
        return fn

    def call(params, h, *extras):
        leaves, tree = jax.tree.flatten(extras)
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

        def layer(params, h, values):
            full = list(leaves)
            for i, value in zip(arrays, values):
                full[i] = value
            return fn(params, h, *jax.tree.unflatten(tree, full))
        return jax.checkpoint(layer, policy=policy, prevent_cse=prevent_cse)(params, h, [leaves[i] for i in arrays])
    return call
