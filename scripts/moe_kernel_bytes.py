"""HBM bytes of the fused MoE kernels' block plans (their cost estimates, pallas_kernels/cost.py)
at gpt-oss-20b's and Lyra Small's expert shapes with the default TPU tiles, beside the closed
formulas the estimates used before; `--stream-spare` restores the spare work items' weight
streaming (the "before" of `_live_tile`). Jaxprs only, nothing compiled (BENCHMARKS.md "Honest
byte counts").

    python scripts/moe_kernel_bytes.py [--stream-spare]
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (M rows = tokens x experts per token, H, I, E); the second is the square H = I = 1024 layer of
# the first table in BENCHMARKS, the third Lyra Small as configured (H 2048, I 384)
SHAPES = {"gpt-oss-20b layer, 16k rows": (16384, 2880, 2880, 32), "lyra-small layer, 32k rows": (32768, 1024, 1024, 16),
          "lyra-small as configured, 32k rows": (32768, 2048, 384, 16)}


def main() -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import jax
    import jax.numpy as jnp

    import pallas_kernels.moe as moe
    from helpers import pallas_calls

    if "--stream-spare" in sys.argv:
        moe._live_tile = lambda w, j, num_active, nj: j
    for name, (m, h, i, e) in SHAPES.items():
        specs = tuple(jax.ShapeDtypeStruct(s, d) for s, d in [((m, h), jnp.bfloat16), ((e,), jnp.int32),
                      ((e, h, 2 * i), jnp.bfloat16), ((e, 2 * i), jnp.bfloat16), ((e, i, h), jnp.bfloat16),
                      ((e, h), jnp.bfloat16)])
        loss = lambda x, gs, wu, bu, wd, bd: moe.moe_experts_pallas(  # noqa: E731
            x, gs, wu, bu, wd, bd, platform="tpu").astype(jnp.float32).sum()
        params = pallas_calls(jax.grad(loss, argnums=(0, 2, 3, 4, 5)), *specs)
        calls = {p["name"]: p["cost_estimate"] for p in params}
        # The tiles the kernels were built with: the forward's grid (items, I tiles) and its x and
        # gate_up blocks ([tm, H], [., H, 2 ti]).
        forward = next(p["grid_mapping"] for p in params if p["name"] == "moe_fused_fwd")
        nj = forward.grid[1]
        nj_w = next(p["grid_mapping"] for p in params if p["name"] == "moe_fused_dw").grid[0]
        tm = forward.block_mappings[0].block_shape[0].block_size
        ti = forward.block_mappings[1].block_shape[2].block_size // 2
        xp, w1, w2 = m * h * 2, e * h * 2 * i * 2, e * i * h * 2
        before = {"moe_fused_fwd": 2 * xp + w1 + w2, "moe_fused_dx": 3 * xp + w1 + w2,
                  "moe_fused_dw": 2 * nj_w * xp + 2 * (w1 + w2)}
        print(f"{name}: tm={tm} ti={ti} ({nj} I tiles; dW {nj_w})")
        for kernel, c in calls.items():
            print(f"  {kernel}: counted {c.bytes_accessed / 1e9:.2f} GB, closed formula {before[kernel] / 1e9:.2f} GB, "
                  f"{c.flops / 1e12:.2f} TFLOP")


if __name__ == "__main__":
    main()
