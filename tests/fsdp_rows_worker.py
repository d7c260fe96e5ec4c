"""Run by tests/test_moe_dispatch.py on 4 simulated CPU devices: under `fsdp` the expert stacks
and the output head either stay where they lie and the rows come to them (few rows), or are
gathered (many rows): `sharding.fsdp_gathers_rows`. For each MESH@ROWS of argv, which way was
taken and the output and every gradient (rows, routing weights, every stack; the
hidden states and the head) against one device. Prints one JSON line."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from helpers import rel_err  # noqa: E402
from jax_bridge import moe_dispatch, registry, sharded_ops, sharding  # noqa: E402
from pallas_kernels.moe_loop import moe_experts_loop  # noqa: E402
from pallas_kernels.moe_mxfp4 import moe_mxfp4_xla  # noqa: E402
from test_kernel_moe_mxfp4 import make_inputs as mxfp4_inputs  # noqa: E402

H, I, E, K, V = 64, 32, 4, 2, 256


def moe_case(mesh, rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    f32 = lambda *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
    x = f32(rows, H, scale=2.0)
    experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]), jnp.int32)
    weights = jnp.asarray(rng.random((rows, K)), jnp.float32)
    stacks = (f32(E, H, 2 * I, scale=4 / np.sqrt(H)), f32(E, 2 * I), f32(E, I, H, scale=1 / np.sqrt(I)), f32(E, H))
    dy = f32(rows, H)

    def grads(routed):
        def loss(x, weights, *stacks):
            y = routed(x, experts, weights, *stacks, alpha=1.702, limit=7.0, up_shift=1.0)
            return jnp.sum(y * dy), y
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(x, weights, *stacks)

    (_, one), g1 = grads(moe_dispatch.routed_experts(moe_experts_loop))
    (_, many), gm = grads(moe_dispatch.routed_experts(moe_experts_loop, mesh=mesh))
    names = ("dx", "dweights", "dgate_up", "dgate_up_bias", "ddown", "ddown_bias")
    return {"rows_move": bool(moe_dispatch._experts_over_fsdp(mesh, x, experts, stacks, False)),
            "forward": rel_err(many, one), **{n: rel_err(b, a) for n, a, b in zip(names, g1, gm)}}


def mxfp4_case(mesh, rows: int, seed: int) -> dict:
    """The frozen MXFP4 stacks (no gradient of theirs): output, rows and routing weights."""
    (x, _, *stacks), dy = mxfp4_inputs(seed, rows, H, I, E)
    rng = np.random.default_rng(seed)
    experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]), jnp.int32)
    weights = jnp.asarray(rng.random((rows, K)), jnp.float32)

    def grads(routed):
        def loss(x, weights):
            y = routed(x, experts, weights, *stacks, alpha=1.702, limit=7.0, up_shift=1.0)
            return jnp.sum(y * dy), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, weights)

    (_, one), (dx1, dw1) = grads(moe_dispatch.routed_experts(moe_mxfp4_xla))
    (_, many), (dxm, dwm) = grads(moe_dispatch.routed_experts(moe_mxfp4_xla, mesh=mesh, mxfp4=True))
    return {"rows_move": bool(moe_dispatch._experts_over_fsdp(mesh, x, experts, stacks, True)),
            "forward": rel_err(many, one), "dx": rel_err(dxm, dx1), "dweights": rel_err(dwm, dw1)}


def cross_entropy_case(mesh, impl: str, rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((rows, H)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((V, H)) / 8, jnp.float32)
    labels = jnp.asarray(np.where(rng.random(rows) < 0.2, -100, rng.integers(0, V, rows)), jnp.int32)
    chosen = registry.implementations("cross_entropy")[impl]
    fn = chosen.bind("cpu", {}, None)

    def grads(ce):
        def loss(hidden, weight):
            nll, lse = ce(hidden, weight, labels, ignore_index=-100)
            return jnp.sum(nll) + 0.1 * jnp.sum(lse * lse), (nll, lse)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, weight)

    (_, (nll1, lse1)), (dh1, dw1) = grads(fn)
    (_, (nllm, lsem)), (dhm, dwm) = grads(sharded_ops.cross_entropy(fn, mesh, chosen.spmd))
    moves = sharded_ops._head_over_fsdp(mesh, hidden, weight, chosen.spmd)
    return {"rows_move": bool(moves), "nll": rel_err(nllm, nll1), "lse": rel_err(lsem, lse1),
            "dhidden": rel_err(dhm, dh1), "dweight": rel_err(dwm, dw1)}


results = {"devices": len(jax.devices())}
for case in sys.argv[1:]:          # MESH@ROWS
    spec, rows = case.split("@")
    mesh, rows = sharding.make_mesh(spec), int(rows)
    results[f"{case} moe"] = moe_case(mesh, rows, seed=rows)
    results[f"{case} moe_mxfp4"] = mxfp4_case(mesh, rows, seed=rows + 2)
    for impl in ("xla", "pallas"):
        results[f"{case} cross_entropy={impl}"] = cross_entropy_case(mesh, impl, rows, seed=rows + 1)
print(json.dumps(results))
