"""The MoE token dispatch (`jax_bridge/moe_dispatch.py`): grouping rows by expert and mixing the
results back equals a per-token dense reference, forward and backward, and its backward moves rows
with gathers only (no scatter-add)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import moe_dispatch
from jax_bridge.moe_dispatch import mix_experts, stable_order


def grouped_linear(rows, group_sizes, w, b, *, alpha, limit, up_shift):
    """A grouped GEMM with a per-expert bias: the kernels' signature, the simplest body."""
    expert_of_row = jnp.repeat(jnp.arange(w.shape[0]), group_sizes, total_repeat_length=rows.shape[0])
    return jax.lax.ragged_dot(rows, w, group_sizes) + b[jnp.clip(expert_of_row, 0, w.shape[0] - 1)]


def dense_reference(x, experts, weights, w, b, first_expert):
    """y[n] = sum_j weights[n, j] * (x[n] @ w[e] + b[e]), e = experts[n, j] - first_expert; choices
    of experts not held here add nothing."""
    local = experts - (first_expert or 0)
    held = ((local >= 0) & (local < w.shape[0])).astype(x.dtype)
    one_hot = jax.nn.one_hot(local, w.shape[0], dtype=x.dtype)                          # [R, k, E]
    per_expert = jnp.einsum("rh,eho->reo", x, w) + b[None]                              # [R, E, O]
    chosen = jnp.einsum("rke,reo->rko", one_hot, per_expert)
    mixed = (weights.astype(x.dtype) * held)[..., None] * chosen
    return mixed.sum(1)


CASES = [  # rows, hidden, out, experts held, k, first_expert (None: all held), experts in the model
    (7, 8, 5, 4, 2, None, 4),
    (33, 16, 12, 6, 3, None, 6),        # odd rows, k 3
    (5, 8, 8, 16, 1, None, 16),         # most experts empty
    (16, 8, 5, 4, 4, 4, 12),            # expert parallel: experts 4..7 held, other choices add 0
    (9, 8, 5, 3, 2, 0, 9),
]


@pytest.mark.parametrize("grouping", ["sorts", "comparisons"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,hidden,out,held,k,first_expert,n_experts", CASES)
def test_dispatch_matches_dense_reference_forward_and_backward(rows, hidden, out, held, k, first_expert,
                                                                  n_experts, dtype, grouping, monkeypatch):
    """Both groupings: by sorts, and by comparisons (up to moe_dispatch.COMPARED_COPIES copies)."""
    monkeypatch.setattr(moe_dispatch, "COMPARED_COPIES", 0 if grouping == "sorts" else 10**6)
    rng = np.random.default_rng(rows * 31 + held)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.normal(size=(rows, hidden)), dt)
    experts = jnp.asarray(np.stack([rng.choice(n_experts, k, replace=False) for _ in range(rows)]), jnp.int32)
    weights = jnp.asarray(rng.random((rows, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(held, hidden, out)) / np.sqrt(hidden), dt)
    b = jnp.asarray(rng.normal(size=(held, out)), dt)
    cotangent = jnp.asarray(rng.normal(size=(rows, out)), dt)

    def dispatched(x, weights, w, b):
        y = mix_experts(grouped_linear, x, experts, weights, w, b, first_expert=first_expert, alpha=0.0, limit=0.0,
                        up_shift=0.0)
        return (y.astype(jnp.float32) * cotangent).sum(), y

    def reference(x, weights, w, b):
        y = dense_reference(x, experts, weights, w, b, first_expert)
        return (y.astype(jnp.float32) * cotangent).sum(), y

    (_, y), grads = jax.jit(jax.value_and_grad(dispatched, argnums=(0, 1, 2, 3), has_aux=True))(x, weights, w, b)
    (_, y_ref), grads_ref = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2, 3), has_aux=True))(x, weights, w, b)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=tol, atol=tol)
    for name, g, r in zip(("x", "weights", "w", "b"), grads, grads_ref):
        scale = float(jnp.abs(r.astype(jnp.float32)).max()) or 1.0
        err = float(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)).max()) / scale
        assert err < tol, f"d{name}: max error {err:.2e} of its largest entry (tolerance {tol})"


def test_the_grouping_by_comparisons_is_the_stable_sorts():
    """stable_order of a few copies (comparisons) gives the permutation, its inverse and the
    weights in sorted order that the sorts give, ties kept in their order (stable)."""
    rng = np.random.default_rng(3)
    for n, experts in ((1, 4), (2, 8), (7, 3), (64, 8), (100, 33)):
        key = jnp.asarray(rng.integers(0, experts, n), jnp.int32)
        weights = jnp.asarray(rng.random(n), jnp.float32)
        compared = stable_order(key, weights)
        _, order, weights_sorted = jax.lax.sort((key, jnp.arange(n, dtype=jnp.int32), weights), num_keys=1,
                                                is_stable=True)
        np.testing.assert_array_equal(compared[0], order)
        np.testing.assert_array_equal(compared[1], weights_sorted)
        np.testing.assert_array_equal(np.asarray(compared[2])[np.asarray(order)], np.arange(n))
        assert compared[0].dtype == jnp.int32 and compared[1].dtype == weights.dtype
    jaxpr = str(jax.make_jaxpr(stable_order)(jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.float32)))
    assert "sort" not in jaxpr and "scatter" not in jaxpr and "gather" not in jaxpr, jaxpr


def test_dispatch_moves_rows_with_gathers_only():
    """The transpose of 'take each row's k copies' and of 'mix them back' are gathers (fused by XLA
    with the sum over k or the routing weight), never a scatter-add over the [R k, H] rows; the
    group sizes, the inverse permutation and the routing weights in sorted order come from
    comparisons and sorts, never a scatter or a gather of single values (both slow on a TPU)."""
    rng = np.random.default_rng(0)
    rows, hidden, held, k = 12, 8, 4, 2
    x = jnp.asarray(rng.normal(size=(rows, hidden)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(held, k, replace=False) for _ in range(rows)]), jnp.int32)
    weights = jnp.asarray(rng.random((rows, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(held, hidden, hidden)), jnp.float32)
    b = jnp.zeros((held, hidden), jnp.float32)

    def one_linear(rows, group_sizes, w, b, **_):          # the dispatch's ops alone in the jaxpr
        return rows @ w[0]

    def loss(x, weights):
        return mix_experts(one_linear, x, experts, weights, w, b, alpha=0.0, limit=0.0, up_shift=0.0).sum()

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, weights))
    assert "scatter" not in jaxpr, "the dispatch scatters (a TPU runs a scatter element by element)"
    gathered = re.findall(r"(\w+\[[\d,]*\]) = gather\[", jaxpr)
    # the rows sorted [R k, H] and their k copies back [R, H], each in the forward and transposed
    want = [f"f32[{rows},{hidden}]"] * (2 * k) + [f"f32[{rows * k},{hidden}]"] * 2
    assert sorted(gathered) == sorted(want), f"gathers other than of rows: {gathered}"


# MESH@ROWS: 8 rows are fewer bytes than the stacks and the head (the rows come to them), 512 more
# (the stacks and the head are gathered); MXFP4 stacks split over `tensor` never move their rows over `fsdp`.
FSDP_CASES = {"fsdp=4@8": True, "fsdp=2,tensor=2@8": True, "data=2,fsdp=2@8": True, "fsdp=2,tensor=2@512": False}


def test_under_fsdp_the_rows_come_to_the_weights_or_the_weights_are_gathered_both_equal_one_device():
    """tests/fsdp_rows_worker.py on 4 simulated CPU devices: the expert dispatch (bf16 stacks with
    every gradient, frozen MXFP4 stacks) and the cross-entropy (`xla` under GSPMD, `pallas` per
    device) take the way `sharding.fsdp_gathers_rows` chooses, and either way equal one device."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from worker_env import worker_env

    worker = Path(__file__).parent / "fsdp_rows_worker.py"
    proc = subprocess.run([sys.executable, str(worker), *FSDP_CASES], env=worker_env(4), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results.pop("devices") == 4
    assert len(results) == 4 * len(FSDP_CASES)
    for name, result in results.items():
        case = name.split()[0]
        moves = FSDP_CASES[case] and not ("mxfp4" in name and "tensor" in case)
        assert result.pop("rows_move") is moves, name
        assert max(result.values()) < 1e-6, (name, result)
