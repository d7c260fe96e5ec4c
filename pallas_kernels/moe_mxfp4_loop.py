"""Grouped expert MLP over a frozen MXFP4 expert base, expert by expert: the CPU training path.

Same signature and result as `moe_mxfp4.moe_mxfp4_reference`. Where `moe_mxfp4_xla` decodes
every stack whole on every call, and autodiff keeps the decoded stacks for the backward pass (a
layer's local experts in float32: 2.5 GiB per process for a two-process LoRA step of the small
released shape), this walks work items of (expert, up to `chunk` of its sorted rows) as
generation's `decode` does (pallas_kernels/moe_decode.py), decoding the item's expert alone. The
backward pass is written out (custom_vjp) and walks the items again, decoding each expert anew:
the base is frozen, so it gives the rows' gradient only (the weights' and biases' are zero, as
in every `moe_mxfp4` implementation). Plain JAX; on TPU the Pallas kernel decodes tiles in VMEM.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe import clamped_swiglu_grad
from pallas_kernels.moe_decode import default_chunk, moe_mxfp4_decode, mxfp4_expert, over_work_items
from pallas_kernels.moe_mxfp4 import check_mxfp4_experts
from pallas_kernels.platform import dot_precision


def moe_mxfp4_loop(x, group_sizes, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                   down_bias, *, alpha: float = 1.702, limit: float = 7.0, up_shift: float = 1.0,
                   chunk: int | None = None):
    """y [M, H]: each sorted row through its own expert, decoded from MXFP4 as its rows come.
    `chunk`: rows per work item (default: twice the mean rows per expert, at least 2)."""
    experts, _, _ = check_mxfp4_experts(x, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                                        down_bias)
    if x.shape[0] == 0:
        return x
    stacks = (gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias)
    return _looped(x, group_sizes.astype(jnp.int32), stacks, float(alpha), float(limit), float(up_shift),
                   default_chunk(x.shape[0], experts, chunk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _looped(x, sizes, stacks, alpha, limit, up_shift, chunk):
    # The forward is generation's: work items, each expert decoded alone.
    return moe_mxfp4_decode(x, sizes, *stacks, alpha=alpha, limit=limit, up_shift=up_shift, chunk=chunk)


def _looped_fwd(x, sizes, stacks, alpha, limit, up_shift, chunk):
    return _looped(x, sizes, stacks, alpha, limit, up_shift, chunk), (x, sizes, stacks)


def _looped_bwd(alpha, limit, up_shift, chunk, residuals, dy):
    x, sizes, stacks = residuals
    precision = dot_precision(x.dtype)

    def dx_of_item(e, rows, dy_rows):
        gate_up, gate_up_bias, down, _ = mxfp4_expert(stacks, e, x.dtype)
        pre = jnp.dot(rows, gate_up, precision=precision, preferred_element_type=jnp.float32)
        pre = pre + gate_up_bias.astype(jnp.float32)
        dh = jnp.dot(dy_rows.astype(x.dtype), down.T, precision=precision, preferred_element_type=jnp.float32)
        dpre = clamped_swiglu_grad(pre, dh, alpha=alpha, limit=limit, up_shift=up_shift).astype(x.dtype)
        return jnp.dot(dpre, gate_up.T, precision=precision, preferred_element_type=jnp.float32)

    dx = over_work_items((x, dy.astype(x.dtype)), sizes, chunk, dx_of_item)
    return dx, None, jax.tree.map(jnp.zeros_like, stacks)


_looped.defvjp(_looped_fwd, _looped_bwd)
