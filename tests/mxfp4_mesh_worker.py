"""Run by tests/test_mxfp4_base.py on 4 simulated CPU devices: the MXFP4 expert dispatch
(`moe_mxfp4` under `shard_map`, experts split over `expert` and `tensor`, rows over `fsdp`)
against one device, forward and the gradients of the rows and routing weights, on each mesh
given (one process for all: the one-device reference runs once). Prints one JSON line,
{mesh: errors}.

usage: python tests/mxfp4_mesh_worker.py MESH [MESH ...]"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from helpers import rel_err  # noqa: E402
from jax_bridge import moe_dispatch, sharding  # noqa: E402
from pallas_kernels.moe_mxfp4 import moe_mxfp4_xla  # noqa: E402
from test_kernel_moe_mxfp4 import make_inputs  # noqa: E402

(x, _, w1b, w1s, b1, w2b, w2s, b2), _ = make_inputs(7, 32, 64, 32, 4)
rng = np.random.default_rng(7)
experts = jnp.asarray(np.stack([rng.choice(4, 2, replace=False) for _ in range(32)]), jnp.int32)
weights = jnp.asarray(rng.random((32, 2)), jnp.float32)
stacks = (w1b, w1s, b1, w2b, w2s, b2)


def loss(routed):
    def f(x, weights):
        y = routed(x, experts, weights, *stacks, alpha=1.702, limit=7.0, up_shift=1.0)
        return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size), y
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


(_, one), (dx1, dw1) = loss(moe_dispatch.routed_experts(moe_mxfp4_xla))(x, weights)
results = {}
for spec in sys.argv[1:]:
    mesh = sharding.make_mesh(spec)
    (_, many), (dxm, dwm) = loss(moe_dispatch.routed_experts(moe_mxfp4_xla, mesh=mesh, mxfp4=True))(x, weights)
    results[spec] = {"forward": rel_err(many, one), "dx": rel_err(dxm, dx1), "dweights": rel_err(dwm, dw1),
                     "devices": len(jax.devices())}
print(json.dumps(results))
