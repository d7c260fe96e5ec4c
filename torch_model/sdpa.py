"""`F.scaled_dot_product_attention` as the `attention` op sees it: which calls the op expresses.

A module written against PyTorch's SDPA never heard of the op registry. Under the bridge every
SDPA call comes here (jax_bridge/env.py installs the override): a call the `attention` op
expresses (causal, no mask, no dropout, grouped heads by `enable_gqa` or equal heads, any
`scale`) runs the registry's implementation; any other call runs the plain computation and is
counted with its reason, never approximated. `unroutable` is the one decision; the module probe
(jax_bridge/module_probe.py) reports it per call before a run starts.
"""
from __future__ import annotations

import torch

from torch_model import ops


def unroutable(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
               scale=None, enable_gqa: bool = False) -> str | None:
    """Why the `attention` op cannot compute this SDPA call as PyTorch does (None: it can).
    The op is causal attention of the last Tq queries over Tk keys (bottom-right aligned);
    PyTorch aligns `is_causal` top-left, so the two agree only where Tq == Tk."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return f"inputs of {query.dim()} dims (the op takes [B, H, T, D])"
    if attn_mask is not None:
        return "an attn_mask (the op takes causal attention only)"
    if dropout_p:
        return f"dropout_p={dropout_p} (no kernel applies dropout)"
    if not is_causal:
        return "is_causal=False (the op is causal)"
    if query.shape[2] != key.shape[2]:
        return f"is_causal with {query.shape[2]} queries and {key.shape[2]} keys (PyTorch aligns it top-left)"
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not (enable_gqa and hq % hkv == 0):
        return f"{hq} query heads over {hkv} key heads without enable_gqa"
    if value.shape[-1] != query.shape[-1]:
        return f"values of width {value.shape[-1]} beside queries of {query.shape[-1]}"
    return None


def attention_op(query, key, value, scale=None):
    """The `attention` op for a call `unroutable` accepts: q [B, Hq, T, D], k/v [B, Hkv, T, D]
    -> [B, Hq, T, D], no sinks, no window."""
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    sinks = torch.full((query.shape[1],), ops.NO_SINK, dtype=query.dtype, device=query.device)
    return ops.OPS["attention"](query, key, value, sinks, 0, scale)
