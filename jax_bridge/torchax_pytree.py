"""torchax's walks over each op's arguments, without torch's generic pytree where it is not needed.

torchax dispatches every torch op through `Environment.dispatch`, which walks the op's arguments
and results five times with `torch.utils._pytree` (find the tensors, unwrap views, torch -> jax,
jax -> torch), on every lowering of every program: walked here, the 2-layer `tiny` step lowers
1.43x faster with the xla kernels and 1.14x with the Pallas ones (BENCHMARKS.md, 2026-12-07;
`scripts/compile_time.py --compare-walks`). Ops take a few tensors and numbers in tuples,
lists and dicts; those are walked here directly, and any other container torch's pytree knows
(namedtuples, torch.Size, torch.return_types, OrderedDict, ...) is handed to torch's own function,
so the results are torch's, node type for node type (tests/test_compat_and_registry.py).
Applied by `torchax_compat.import_torchax` to the module torchax dispatches from.
"""
from __future__ import annotations

import types as _types

import torch
import torch.utils._pytree as torch_pytree

# Leaves without asking torch's registry (a tensor subclass is never a pytree node).
_LEAF_TYPES = frozenset([int, float, bool, complex, str, bytes, type(None), slice, type(Ellipsis), torch.dtype,
                         torch.device, torch.memory_format, torch.layout])


def _is_leaf(tree) -> bool:
    return type(tree) in _LEAF_TYPES or isinstance(tree, torch.Tensor) or torch_pytree.tree_is_leaf(tree)


def tree_map_only(types, fn, tree, *rest, **kwargs):
    """torch_pytree.tree_map_only(types, fn, tree)."""
    if rest or kwargs:
        return torch_pytree.tree_map_only(types, fn, tree, *rest, **kwargs)
    return _map_only(types, fn, tree)


def _map_only(types, fn, tree):
    kind = type(tree)
    if kind is tuple:
        return tuple(_map_only(types, fn, x) for x in tree)
    if kind is list:
        return [_map_only(types, fn, x) for x in tree]
    if kind is dict:
        return {k: _map_only(types, fn, v) for k, v in tree.items()}
    if not _is_leaf(tree):
        return torch_pytree.tree_map_only(types, fn, tree)
    return fn(tree) if isinstance(tree, types) else tree


def tree_map(fn, tree, *rest, **kwargs):
    """torch_pytree.tree_map(fn, tree)."""
    if rest or kwargs:
        return torch_pytree.tree_map(fn, tree, *rest, **kwargs)
    return _map_only(object, fn, tree)


def tree_leaves(tree, *rest, **kwargs) -> list:
    """torch_pytree.tree_leaves(tree)."""
    if rest or kwargs:
        return torch_pytree.tree_leaves(tree, *rest, **kwargs)
    leaves: list = []
    _collect(tree, leaves)
    return leaves


def _collect(tree, leaves: list) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for x in tree:
            _collect(x, leaves)
    elif kind is dict:
        for x in tree.values():
            _collect(x, leaves)
    elif _is_leaf(tree):
        leaves.append(tree)
    else:
        leaves.extend(torch_pytree.tree_leaves(tree))


def tree_flatten(tree, *rest, **kwargs):
    """torch_pytree.tree_flatten(tree): (leaves, spec). torchax reads only the leaves of each op's
    arguments, so the spec, torch's own, is built only when it is read."""
    if rest or kwargs:
        return torch_pytree.tree_flatten(tree, *rest, **kwargs)
    return _Flattened(tree)


class _Flattened(tuple):
    """(leaves, spec): the leaves walked here, torch's spec computed on access."""

    def __new__(cls, tree):
        self = super().__new__(cls, (tree_leaves(tree), None))
        self._tree = tree
        return self

    def __getitem__(self, i):
        if i in (1, -1):
            return torch_pytree.tree_flatten(self._tree)[1]
        return super().__getitem__(i)

    def __iter__(self):
        yield super().__getitem__(0)
        yield self[1]


def module_for(original: _types.ModuleType) -> _types.ModuleType:
    """A stand-in for `torch.utils._pytree` in a module that imported it: these functions, and
    torch's for every other name."""
    module = _types.ModuleType(original.__name__)
    module.__dict__.update(original.__dict__)
    module.tree_map_only, module.tree_map, module.tree_flatten = tree_map_only, tree_map, tree_flatten
    module.tree_leaves, module._torchlyra_fast = tree_leaves, True
    return module
