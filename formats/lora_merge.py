"""A LoRA checkpoint's base with its adapters merged, read block by block (`--merge`): a source for
the one loader (formats/mesh_loader.py) under the plain model's names. Each block is the base's
block + scaling x that block of B A, formed from B's rows and A's columns alone (an expert
stack's from its experts' factors, laid out as peft's ParamWrapper lays them), so no process
holds a merged tensor whole; a `modules_to_save` module's values are its trained copy's. What
peft's `merge_and_unload` computes (tests/test_lora_commands.py holds the two together).
"""
from __future__ import annotations

import numpy as np

from formats.hf_weights import normalize_index


class MergedWeights:
    """`weights` (the base, any source the loader reads) merged with the adapters of `wrapped`
    (the peft model of the checkpoint, its adapters on the host, its base possibly on `meta`)."""

    def __init__(self, weights, wrapped):
        from torch_model.lora import ADAPTER_NAME, base_parameter_of, is_trained_copy, unwrap

        self.weights, self.entries = weights, weights.entries
        inner = unwrap(wrapped)
        self.trained = {base_parameter_of(n)[0]: p.detach().float().numpy()
                        for n, p in inner.named_parameters() if is_trained_copy(n)}
        self.factors: dict[str, tuple] = {}
        for path, module in inner.named_modules():
            if ADAPTER_NAME not in getattr(module, "lora_A", {}):
                continue
            name = f"{path.replace('.base_layer', '')}.{getattr(module, 'parameter_name', 'weight')}"
            a, b = (getattr(module, f"lora_{r}")[ADAPTER_NAME].weight.detach().float().numpy() for r in "AB")
            experts = getattr(module, "num_experts", 1) if hasattr(module, "parameter_name") else 1
            layout = ("experts_out_in" if getattr(module, "_did_swap_in_out_features", False) else "experts_in_out") \
                if experts > 1 else ("in_out" if getattr(module, "fan_in_fan_out", False) else "out_in")
            self.factors[name] = (a, b, float(module.scaling[ADAPTER_NAME]), experts, layout)

    @property
    def bytes_requested(self) -> int:
        return self.weights.bytes_requested

    def stored_key(self, name: str) -> tuple:
        """Where `name` is read from (formats/mesh_loader.py `place` groups reads by it)."""
        key = getattr(self.weights, "stored_key", None)
        return ("trained", name) if name in self.trained else key(name) if key is not None else ("base", name)

    def release(self) -> None:
        release = getattr(self.weights, "release", None)
        if release is not None:
            release()

    def read(self, name: str, index=None) -> np.ndarray:
        if name in self.trained:
            return self.trained[name][normalize_index(index, self.trained[name].shape)]
        if name not in self.factors:
            return self.weights.read(name, index)
        index = normalize_index(index, self.entries[name].shape)
        return np.asarray(self.weights.read(name, index), np.float32) + self._delta(name, index)

    def _delta(self, name: str, index: tuple) -> np.ndarray:
        """scaling x (B A)[index] (peft's get_delta_weight, restricted to the block)."""
        a, b, scaling, experts, layout = self.factors[name]
        if layout == "out_in":                                 # nn.Linear weight [out, in]
            rows, cols = index
            delta = b[rows] @ a[:, cols]
        elif layout == "in_out":
            rows, cols = index
            delta = (b[cols] @ a[:, rows]).T
        else:    # A [E*r, in] expert-major, B [out, r*E] rank-major: peft's reshapes to e r i and o r e
            a = a.reshape(experts, -1, a.shape[-1])
            b = b.reshape(b.shape[0], -1, experts)
            e, first, second = index
            if layout == "experts_in_out":                     # [E, in, out]
                delta = np.einsum("ore,eri->eio", b[second][:, :, e], a[e][:, :, first])
            else:                                              # [E, out, in]
                delta = np.einsum("ore,eri->eoi", b[first][:, :, e], a[e][:, :, second])
        return (delta * scaling).astype(np.float32)
