"""A released transformers directory whose stored layout transformers converts on load (Qwen3-MoE,
OLMoE, Mixtral, DeepSeek-V3, ...: one tensor per expert, fused into the model's expert stacks) read
as the model's own tensors, slice by slice, so `--init-from` and `import` stream it as they stream
a directory stored under the model's names.

The conversion is transformers' own declaration for the family
(`transformers.conversion_mapping.get_checkpoint_conversion_mapping`), interpreted here for the
operations that only move tensors: renamings, `MergeModulelist(dim=0)` (experts stacked on a new
leading axis) and then `Concatenate(dim=d)` (e.g. gate and up fused). A declaration with any other
operation is not interpreted: the caller loads the directory whole through `from_pretrained`
instead, and says so. Nothing here names a family.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from formats.hf_weights import Entry, HFWeights, normalize_index


@dataclasses.dataclass(frozen=True)
class Fused:
    """One model tensor made of stored ones: parts[p][e] is pattern p's tensor of expert e, stacked
    on axis 0, the patterns concatenated along `concat_dim` (of the stacked tensor)."""
    parts: tuple[tuple[str, ...], ...]
    concat_dim: int | None


def conversion_rules(model_type: str) -> list | None:
    """transformers' conversion declaration for `model_type` ([] when the stored layout is the
    model's), or None when it uses an operation this reader does not interpret."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    rules = get_checkpoint_conversion_mapping(model_type) or []
    for rule in rules:
        kinds = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(rule, "operations", [])]
        if type(rule).__name__ == "WeightRenaming" and not kinds:
            continue
        if type(rule).__name__ == "WeightConverter" and kinds and kinds[0] == ("MergeModulelist", 0) and \
                all(name == "Concatenate" and dim >= 1 for name, dim in kinds[1:2]) and len(kinds) <= 2:
            continue
        return None
    return list(rules)


def _renamed(name: str, rules) -> str:
    for rule in rules:
        if type(rule).__name__ == "WeightRenaming":
            for source, target in zip(rule.source_patterns, rule.target_patterns):
                name = re.sub(source, target, name)
    return name


def converted_names(stored: list[str], rules) -> dict[str, str | Fused]:
    """Model name -> the stored tensor it is, or the Fused tensors it is made of."""
    out: dict[str, str | Fused] = {}
    groups: dict[tuple[str, int], dict[str, dict[int, str]]] = {}     # (target, rule) -> pattern -> expert -> stored
    converters = [r for r in rules if type(r).__name__ == "WeightConverter"]
    for name in stored:
        renamed = _renamed(name, rules)
        for k, rule in enumerate(converters):
            found = None
            for pattern in rule.source_patterns:
                regex = re.escape(pattern).replace(r"\*", r"(\d+)")
                match = re.search(regex, renamed)
                if match:
                    found = pattern, match
                    break
            if found:
                pattern, match = found
                target = renamed[:match.start()] + rule.target_patterns[0] + renamed[match.end():]
                groups.setdefault((target, k), {}).setdefault(pattern, {})[int(match.group(1))] = name
                break
        else:
            out[renamed] = name
    for (target, k), by_pattern in groups.items():
        rule = converters[k]
        concat = [op.dim for op in rule.operations[1:]]
        parts = []
        for pattern in rule.source_patterns:
            experts = by_pattern.get(pattern, {})
            if sorted(experts) != list(range(len(experts))) or not experts:
                return {}                     # experts missing or numbered with gaps: not this layout
            parts.append(tuple(experts[e] for e in range(len(experts))))
        out[target] = Fused(tuple(parts), concat[0] if concat else None)
    return out


class ConvertedWeights:
    """The model's tensors (names, shapes, values by slice) over a directory's stored ones, as
    HFWeights presents a directory stored under the model's names; `entries` and
    `bytes_requested` as there."""

    def __init__(self, stored: HFWeights, names: dict[str, str | Fused]):
        self.stored, self.names = stored, names
        self.entries: dict[str, Entry] = {}
        for name, source in names.items():
            if isinstance(source, str):
                entry = stored.entries[source]
                self.entries[name] = dataclasses.replace(entry, name=name)
                continue
            first = [stored.entries[part[0]] for part in source.parts]
            per_expert = list(first[0].shape)
            if source.concat_dim is not None:
                per_expert[source.concat_dim - 1] = sum(e.shape[source.concat_dim - 1] for e in first)
            self.entries[name] = Entry(name, (len(source.parts[0]), *per_expert), first[0].dtype, first[0].file)

    @property
    def bytes_requested(self) -> int:
        return self.stored.bytes_requested

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        """The values of `name` (or of the slice `index`) in the stored dtype, reading only the
        stored slices that the requested block covers."""
        source = self.names[name]
        if isinstance(source, str):
            return self.stored.read(source, index)
        experts, *rest = normalize_index(index, self.entries[name].shape)
        pieces, offset = [], 0
        for part in source.parts:
            local = list(rest)
            if source.concat_dim is not None:
                d = source.concat_dim - 1
                size = self.stored.entries[part[0]].shape[d]
                lo, hi = max(rest[d].start, offset), min(rest[d].stop, offset + size)
                offset += size
                if lo >= hi:
                    continue
                local[d] = slice(lo - (offset - size), hi - (offset - size))
            pieces.append(np.stack([self.stored.read(part[e], tuple(local)) for e in range(*experts.indices(len(part)))]))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=source.concat_dim)
