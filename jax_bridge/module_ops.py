"""What a plain module's forward reaches under the bridge, besides the torch ops torchax lowers.

- `F.scaled_dot_product_attention`: a call the `attention` op expresses (torch_model/sdpa.py
  decides) runs the op, hence the implementation the registry chose; any other call runs
  torchax's own lowering (the whole score matrix formed), and is counted with its reason.
- `torch._grouped_mm` (x [M, K] sorted by group, w [G, K, N], `offs` the groups' cumulative
  ends), which torchax 0.0.13 has no lowering for: `jax.lax.ragged_dot`, the grouped GEMM the
  registry's `moe=ragged_dot` reference runs (rows past the last offset come out 0, as in torch).

While `recording()` is open (the module probe, jax_bridge/module_probe.py), SDPA calls are
recorded instead and answer zeros of their output's shape: the probe reads shapes, not values.
"""
from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp
import torch

from torch_model import sdpa

# Traced SDPA calls of this process by where they went: "attention op", or "plain: REASON".
ROUTED = collections.Counter()
_recorder: list | None = None
_torchax_sdpa = None        # torchax's own SDPA entry, which `install` replaces
_env = None                 # the environment `install` overrode, entered around the attention op


@contextlib.contextmanager
def torchax_own_sdpa(env):
    """Within: SDPA calls run torchax's own lowering, as a plain torchax program runs them (the
    peer that scripts/torchax_peer_step.py times beside ours)."""
    import torch.nn.functional as F

    ours = env._ops[F.scaled_dot_product_attention]
    env._ops[F.scaled_dot_product_attention] = _torchax_sdpa
    try:
        yield
    finally:
        env._ops[F.scaled_dot_product_attention] = ours


@contextlib.contextmanager
def recording(into: list):
    """Within: each SDPA call appends ("sdpa", None, (query shape, key shape, is_causal, why the op
    cannot take it or None)) to `into`, and answers zeros."""
    global _recorder
    saved, _recorder = _recorder, into
    try:
        yield into
    finally:
        _recorder = saved


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """F.scaled_dot_product_attention under the bridge (see the module docstring)."""
    reason = sdpa.unroutable(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if _recorder is not None:
        _recorder.append(("sdpa", None, (tuple(query.shape), tuple(key.shape), is_causal, reason)))
        return query.new_zeros((*query.shape[:-1], value.shape[-1]))
    if reason is None:
        ROUTED["attention op"] += 1
        with _env:               # torchax calls this with its dispatch mode alone: the op needs its function mode
            return sdpa.attention_op(query, key, value, scale)
    ROUTED[f"plain: {reason}"] += 1
    from jax_bridge.torchax_compat import import_torchax

    return import_torchax().ops.jtorch._sdpa_reference(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                       enable_gqa)


def grouped_mm(x, w, offs=None, bias=None, out_dtype=None):
    """aten._grouped_mm for the 2-D x 3-D case torchtitan's MoE uses (see the module docstring)."""
    if bias is not None or offs is None or x.ndim != 2 or w.ndim != 3:
        raise NotImplementedError(f"torch._grouped_mm: x {x.ndim}-D, w {w.ndim}-D, offs "
                                  f"{'given' if offs is not None else 'none'}, bias {'given' if bias is not None else 'none'}: "
                                  f"only x [M, K] by w [G, K, N] with offs and no bias is lowered")
    ends = offs.astype(jnp.int32)
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
    out = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    return out.astype(out_dtype if out_dtype is not None else x.dtype)


def install(env) -> None:
    """Route the calls above in `env` (`jax_bridge.env.get_env`, once)."""
    import torch.nn.functional as F
    import torchax.interop as interop

    global _torchax_sdpa, _env
    _torchax_sdpa, _env = env._ops.get(F.scaled_dot_product_attention), env
    env.override_op_definition(F.scaled_dot_product_attention, scaled_dot_product_attention)
    env.override_op_definition(torch.ops.aten._grouped_mm.default, interop.torch_view(grouped_mm))
