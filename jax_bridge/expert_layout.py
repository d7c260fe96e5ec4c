"""transformers' expert stacks in the `moe` op's layout, converted once per train step.

Most families hold an experts module's `gate_up_proj` as [E, 2I, H] (`is_transposed` False) with
gate and up as two halves (`is_concatenated`), and `down_proj` as [E, H, I]; the `moe` op takes
x @ W layouts: [E, H, 2I] with gate and up interleaved, and [E, I, H]. `routed_experts` converts
them at each call, so a step of 16 micro-batches copied every expert stack, transposed and
interleaved, in each micro-batch's forward, its recompute under remat and its backward: 320 ms of
a 1,739 ms roofline step at Qwen3-30B-A3B's layer shapes on one v5e (BENCHMARKS.md, "Mixture-of-
experts layer shapes"). The train step converts them here once, before its micro-batches, has
`routed_experts` take them as they are while it traces, and converts their gradients back once
(the conversion is a permutation: its transpose is its inverse).

Experts under peft's LoRA (it adds its delta to the weights in the family's layout at each
forward) are left to `routed_experts`; frozen experts beside adapters elsewhere are converted."""
from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Where a parameter sits among the layers does not change its layout: per-layer and stacked names
# (`model.layers.3.` and `model.layers.stack1.`) are compared with the layer's place taken out.
_LAYER = re.compile(r"\.layers\.(?:stack)?\d+\.")


def _place_free(name: str) -> str:
    return _LAYER.sub(".layers.#.", name)


@dataclass(frozen=True)
class _Kind:
    transposed: bool          # the family's [E, H, 2I] / [E, I, H] already (x @ W)
    concatenated: bool        # gate and up as two halves, not interleaved
    part: str                 # gate_up_proj | gate_up_proj_bias | down_proj


def _interleave(x):
    """[..., gate | up] -> [..., g0, u0, g1, u1, ...]."""
    gate, up = jnp.split(x, 2, axis=-1)
    return jnp.stack((gate, up), axis=-1).reshape(x.shape)


def _deinterleave(x):
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return jnp.concatenate((pairs[..., 0], pairs[..., 1]), axis=-1)


def _to_op(kind: _Kind, x):
    if kind.part != "gate_up_proj_bias" and not kind.transposed:
        x = jnp.swapaxes(x, -1, -2)
    if kind.part != "down_proj" and kind.concatenated:
        x = _interleave(x)
    return x


def _from_op(kind: _Kind, x):
    if kind.part != "down_proj" and kind.concatenated:
        x = _deinterleave(x)
    if kind.part != "gate_up_proj_bias" and not kind.transposed:
        x = jnp.swapaxes(x, -1, -2)
    return x


def _is_peft_layer(module) -> bool:
    # A model holding peft's layers has imported peft; importing it here would cost every step 1-3 s.
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return tuners is not None and isinstance(module, tuners.BaseTunerLayer)


class ExpertLayout:
    """The expert parameters of one model that a step converts: by their names, layer place aside."""

    def __init__(self, kinds: dict[str, _Kind], modules: tuple):
        self._kinds, self._modules = kinds, modules

    @classmethod
    def of(cls, model) -> "ExpertLayout | None":
        """The layout of `model`'s transformers experts whose weights the op takes in another layout
        (None: no such experts, as in our GPT-OSS or a module model)."""
        from torch.nn.utils import parametrize

        from torch_model.transformers_lm import is_experts

        kinds, modules = {}, []
        named = dict(model.named_modules())
        adapted = [path for path, m in named.items() if _is_peft_layer(m)]
        for path, module in named.items():
            if not is_experts(module) or not hasattr(module, "torchlyra_activation") or \
                    parametrize.is_parametrized(module) or any(path.startswith(f"{a}.") for a in adapted):
                continue                    # under LoRA: peft adds its delta in the family's layout
            transposed, concatenated = bool(module.is_transposed), bool(module.is_concatenated)
            if transposed and not concatenated:
                continue                    # already the op's layout
            parts = ["gate_up_proj", "down_proj"] + (["gate_up_proj_bias"] if module.has_bias else [])
            for part in parts:
                kind = _Kind(transposed, concatenated, part)
                if kinds.setdefault(_place_free(f"{path}.{part}"), kind) != kind:
                    return None             # layers of one place disagree: left to routed_experts
            modules.append(module)
        return cls(kinds, tuple(modules)) if modules else None

    def _kind(self, name: str) -> _Kind | None:
        return self._kinds.get(_place_free(name))

    def to_op(self, params: dict) -> dict:
        """`params` with the expert weights among them in the op's layout (the rest as they are)."""
        return {n: _to_op(k, p) if (k := self._kind(n)) is not None else p for n, p in params.items()}

    def from_op(self, grads: dict) -> dict:
        """`grads` (in the op's layout, as to_op gave the parameters) back in the model's layout."""
        return {n: _from_op(k, g) if (k := self._kind(n)) is not None else g for n, g in grads.items()}

    def op_shardings(self, shardings: dict, params: dict) -> dict:
        """The parameters' shardings (by name; `params` gives their ranks) for their op-layout
        arrays: a transposed pair of axes takes its split along; interleaving keeps the axis's
        split (the values move)."""
        out = dict(shardings)
        for name, s in shardings.items():
            kind = self._kind(name)
            if kind is None or kind.transposed or kind.part == "gate_up_proj_bias":
                continue
            spec = list(s.spec) + [None] * (params[name].ndim - len(s.spec))
            spec[-1], spec[-2] = spec[-2], spec[-1]
            out[name] = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*spec))
        return out

    @contextlib.contextmanager
    def taken_as_given(self):
        """While a step traces: `routed_experts` takes these experts' weights as they come (to_op
        converted them)."""
        for module in self._modules:
            module.torchlyra_op_layout = True
        try:
            yield
        finally:
            for module in self._modules:
                module.torchlyra_op_layout = False
