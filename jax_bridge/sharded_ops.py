"""The registry's attention, cached attention and cross-entropy implementations under a device mesh.

A Pallas kernel is one opaque custom call that GSPMD cannot split, so it runs inside `shard_map`
over the axes it is local on: attention over batch and heads (each device: its sequences, its
heads), cross-entropy over tokens, with a vocabulary split over `tensor` combined exactly (a
log-sum-exp across the shards). Plain-JAX implementations (`xla`) stay under GSPMD, with
sharding constraints on their inputs and outputs. The MoE op is in `moe_dispatch.py` (its token
sort always runs per device). Muon's orthogonalization runs on whole matrices per device.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_bridge import sharding

SHARD_MAP, GSPMD = "shard_map", "gspmd"
# Pallas calls declare output shapes without per-axis variance, which shard_map's replication
# check requires; the check is off for the per-device regions (autodiff stays exact: cotangents
# of unsplit inputs are summed over the axes they are not split on).
CHECK_VMA = False


def attention(fn, mesh, spmd: str):
    """fn(q [B, Hq, T, D], k, v [B, Hkv, T, D], sinks [Hq], *, sliding_window, scale[, segment_ids [B, T]])."""

    def call(q, k, v, sinks, *, sliding_window, scale, segment_ids=None):
        q_spec = sharding.logical_spec(mesh, ("batch", "heads"), q.shape)
        kv_spec = sharding.logical_spec(mesh, ("batch", "kv_heads"), k.shape)
        sink_spec = sharding.logical_spec(mesh, ("heads",), sinks.shape)
        seg = {} if segment_ids is None else {"segment_ids": segment_ids}
        if spmd == GSPMD:
            q, k, v = (sharding.constrain(a, mesh, ("batch", h)) for a, h in
                       ((q, "heads"), (k, "kv_heads"), (v, "kv_heads")))
            out = fn(q, k, v, sinks, sliding_window=sliding_window, scale=scale, **seg)
            return sharding.constrain(out, mesh, ("batch", "heads"))
        if segment_ids is None:
            local = lambda q, k, v, s: fn(q, k, v, s, sliding_window=sliding_window, scale=scale)
            return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, sink_spec),
                                 out_specs=q_spec, check_vma=CHECK_VMA)(q, k, v, sinks)
        seg_spec = sharding.logical_spec(mesh, ("batch", None), segment_ids.shape)
        local = lambda q, k, v, s, ids: fn(q, k, v, s, sliding_window=sliding_window, scale=scale, segment_ids=ids)
        return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, sink_spec, seg_spec),
                             out_specs=q_spec, check_vma=CHECK_VMA)(q, k, v, sinks, segment_ids)

    return call


def cached_attention(fn, mesh, spmd: str):
    """fn(q [B, Hq, Tq, D], k, v [B, Hkv, S, D], sinks [Hq], q_positions [B, Tq], k_positions [B, S], *,
    sliding_window, scale): a kernel per device over its rows and heads; plain JAX as GSPMD splits it."""
    if spmd == GSPMD:
        return fn

    def call(q, k, v, sinks, q_positions, k_positions, *, sliding_window, scale):
        q_spec = sharding.logical_spec(mesh, ("batch", "heads"), q.shape)
        kv_spec = sharding.logical_spec(mesh, ("batch", "kv_heads"), k.shape)
        sink_spec = sharding.logical_spec(mesh, ("heads",), sinks.shape)
        rows = sharding.logical_spec(mesh, ("batch", None), q_positions.shape)
        slots = sharding.logical_spec(mesh, ("batch", None), k_positions.shape)
        local = lambda *a: fn(*a, sliding_window=sliding_window, scale=scale)
        return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, sink_spec, rows, slots),
                             out_specs=q_spec, check_vma=CHECK_VMA)(q, k, v, sinks, q_positions, k_positions)

    return call


def cross_entropy(fn, mesh, spmd: str):
    """fn(hidden [N, H], weight [V, H], labels [N], *, ignore_index) -> (nll [N], lse [N])."""

    def call(hidden, weight, labels, *, ignore_index):
        over_fsdp = _head_over_fsdp(mesh, hidden, weight, spmd)
        if over_fsdp and spmd == SHARD_MAP:
            return _rows_to_the_head(fn, mesh, hidden, weight, labels, ignore_index=ignore_index)
        if spmd == GSPMD:
            # The head left split along its hidden dimension: so are the rows, all of them on
            # each device (a partial product of every logit per device, summed across `fsdp`).
            hidden = sharding.constrain(hidden, mesh, ("batch_but_fsdp", "embed") if over_fsdp else ("batch", None))
            labels = sharding.constrain(labels, mesh, ("batch",))
            nll, lse = fn(hidden, weight, labels, ignore_index=ignore_index)
            return sharding.constrain(nll, mesh, ("batch",)), sharding.constrain(lse, mesh, ("batch",))
        rows = P(sharding.batch_axes(mesh))
        w_spec = sharding.logical_spec(mesh, ("vocab", None), weight.shape)   # gathered over `embed`
        vocab_axis = w_spec[0] if len(w_spec) else None

        def local(h, w, y):
            if vocab_axis is None:
                return fn(h, w, y, ignore_index=ignore_index)
            return vocab_parallel_cross_entropy(fn, h, w, y, ignore_index=ignore_index, axis=vocab_axis)

        return jax.shard_map(local, mesh=mesh, in_specs=(P(*rows, None), w_spec, rows),
                             out_specs=(rows, rows), check_vma=CHECK_VMA)(hidden, weight, labels)

    return call


def _head_over_fsdp(mesh, hidden, weight, spmd: str) -> bool:
    """Whether the head stays split over `fsdp` as stored (along its hidden dimension) and the
    rows along `fsdp` come to it, rather than each device gathering it: `sharding.fsdp_gathers_rows`
    weighs the gathered rows with their gradient and what they add (per device kernels,
    `_rows_to_the_head`: a vocabulary-split copy of the device's slice; under GSPMD: the float32
    partial logits of every gathered row) against the gathered head."""
    if mesh is None or mesh.shape.get("fsdp", 1) == 1:
        return False
    stored = sharding.logical_spec(mesh, ("vocab", "embed"), weight.shape)
    vocab = stored[0] if len(stored) else None
    if len(stored) < 2 or stored[1] != "fsdp" or vocab not in (None, "tensor"):
        return False
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"] if vocab else 1
    if weight.shape[0] % (tensor * fsdp):
        return False
    rows = sharding.rows_along_fsdp(mesh, hidden.shape[0])
    head = weight.shape[0] // tensor * weight.shape[1] * weight.dtype.itemsize
    added = head // fsdp if spmd == SHARD_MAP else rows * weight.shape[0] // tensor * 4
    return sharding.fsdp_gathers_rows(mesh, 2 * rows * hidden.shape[1] * hidden.dtype.itemsize + added, head)


def _rows_to_the_head(fn, mesh, hidden, weight, labels, *, ignore_index: int):
    """Cross-entropy with the head left split over `fsdp` along its hidden dimension: each device
    turns its slice into one of the vocabulary ([V_l, H / fsdp] -> [V_l / fsdp, H], an
    all-to-all), gathers the rows of the devices along `fsdp`, runs `fn` on them over its
    vocabulary slice (combined exactly across `fsdp`, and `tensor` where it splits the
    vocabulary too: vocab_parallel_cross_entropy) and keeps its own rows."""
    rows = P(sharding.batch_axes(mesh))
    w_spec = sharding.logical_spec(mesh, ("vocab", "embed"), weight.shape)
    vocab = ("tensor", "fsdp") if w_spec[0] == "tensor" else "fsdp"

    def local(h, w, y):
        w = lax.all_to_all(w, "fsdp", split_axis=0, concat_axis=1, tiled=True)
        h_all, y_all = (lax.all_gather(a, "fsdp", axis=0, tiled=True) for a in (h, y))
        nll, lse = vocab_parallel_cross_entropy(fn, h_all, w, y_all, ignore_index=ignore_index, axis=vocab)
        start = lax.axis_index("fsdp") * h.shape[0]
        return lax.dynamic_slice_in_dim(nll, start, h.shape[0]), lax.dynamic_slice_in_dim(lse, start, h.shape[0])

    return jax.shard_map(local, mesh=mesh, in_specs=(P(*rows, None), w_spec, rows), out_specs=(rows, rows),
                         check_vma=CHECK_VMA)(hidden, weight, labels)


def vocab_parallel_cross_entropy(fn, hidden, weight, labels, *, ignore_index: int, axis):
    """Inside shard_map: this device holds vocabulary rows [i * V_l, (i + 1) * V_l) of the weight.
    The kernel runs on the local slice with the label moved into it (or 0 when the label lies
    elsewhere, which makes the kernel's nll give that slice's logit back as lse - nll); the
    log-sum-exps then combine across `axis` and the label's logit is taken from its owner."""
    v_local = weight.shape[0]
    local = labels - lax.axis_index(axis) * v_local
    inside = (local >= 0) & (local < v_local)
    nll_l, lse_l = fn(hidden, weight, jnp.where(inside, local, 0), ignore_index=ignore_index)
    peak = lax.stop_gradient(lax.pmax(lax.stop_gradient(lse_l), axis))
    lse = peak + jnp.log(lax.psum(jnp.exp(lse_l - peak), axis))
    target = lax.psum(jnp.where(inside, lse_l - nll_l, 0.0), axis)
    valid = labels != ignore_index
    return jnp.where(valid, lse - target, 0.0), jnp.where(valid, lse, 0.0)


def orthogonalizer(on_mesh):
    """Muon's orthogonalization for the torch optimizer of a model on a mesh
    (jax_bridge/model_on_mesh.py). A batch of matrices
    (stacked layers, experts) is flattened to one batch axis and spread over the devices along
    it, whole matrices per device, so the Newton-Schulz iteration needs no communication (split
    by the rules, each matrix's rows or columns would be gathered at every iteration); the
    result returns to the matrix split of the parameter's rules. A batch that no mesh axis
    divides, or a single matrix, keeps the parameter's own sharding (GSPMD splits the work)."""
    from torchax.interop import call_jax

    from torch_model.optim import newton_schulz

    mesh = on_mesh.mesh

    def place(t, spec):
        return call_jax(lambda a: jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, spec)), t)

    def orthogonalize(name, u, steps, coeffs, eps, dtype):
        shape = tuple(u.shape)
        flat_shape = (-1, *shape[-2:])        # one batch axis: an axis merged from split ones is not
        spread = sharding.whole_matrices_spec(mesh, (math.prod(shape[:-2]), *shape[-2:]))  # representable
        if spread is None:
            return newton_schulz(u, steps, coeffs, eps, dtype)
        home = on_mesh.spec(name, shape)
        home = tuple(home) + (None,) * (len(shape) - len(home))
        split = [i for i, axes in enumerate(home[:-2]) if axes]
        if len(split) == 1 and not any(home[-2:]):
            # The rules already hold whole matrices per device (experts split over their own
            # axis): that batch dimension first, the flattened batch keeps its split, and the
            # iteration runs where the matrices are, with no communication.
            i = split[0]
            order = (i, *(d for d in range(len(shape)) if d != i))
            moved = place(u, P(*home)).permute(order)
            flat_home = P(home[i], None, None)
            out = newton_schulz(place(moved.reshape(flat_shape), flat_home), steps, coeffs, eps, dtype)
            inverse = tuple(order.index(d) for d in range(len(shape)))
            return place(place(out, flat_home).reshape(tuple(moved.shape)).permute(inverse), P(*home))
        flat_home = P(None, *home[-2:])
        # Pin every step: left free, the partitioner would carry the spread split backwards
        # through the reshape, where it cannot be expressed, and gather whole stacks instead.
        flat = place(place(u, P(*home)).reshape(flat_shape), flat_home)
        out = newton_schulz(place(flat, spread), steps, coeffs, eps, dtype)
        return place(place(out, flat_home).reshape(shape), P(*home))

    return orthogonalize
