"""The fused MoE kernels' cost estimates under evenly routed rows (what `plan --roofline`
assumes: every expert's rows fill whole row tiles) against random routing (row counts per
expert drawn multinomially, so groups start mid-tile and straddling tiles are computed for two
experts), for the old tiles (256 rows, I 320) and the defaults (issue 36, BENCHMARKS "Roofline,
session 20"). Priced as the roofline does (v6e: 918 TFLOP/s, 1638 GB/s; per kernel the larger
of compute and memory time); totals per step for gpt-oss-20b's 24 layers with `--remat full`
(each layer's forward kernel runs twice, dx and dW once).

    python scripts/moe_routing_cost.py [--rows 16384] [--hidden 2880] [--inter 2880] [--experts 32] [--layers 24] \\
        [--sweep 256,384,512,640,768,1024] [--generation v6e]

--sweep: instead, the row kernels' row tile over these values (their I tile fitted to VMEM as the
defaults fit it; dW at 256 rows, I 320), per-step totals under both routings.
"""
import argparse
import os
import sys


PEAK_FLOPS, HBM = 918e12, 1638e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384, help="expert rows per chip (tokens x k)")
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--inter", type=int, default=2880)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--sweep", default=None, help="row tiles of the row kernels to compare, comma-separated")
    parser.add_argument("--generation", default=None,
                        help="the TPU generation whose VMEM sizes the default tiles (e.g. v6e; default: unknown, 64 MiB)")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "tests")]
    import jax
    import jax.numpy as jnp

    import pallas_kernels.moe as moe
    from helpers import pallas_calls

    m, h, i, e = args.rows, args.hidden, args.inter, args.experts
    bf16 = jnp.bfloat16
    specs = tuple(jax.ShapeDtypeStruct(s, d) for s, d in [((m, h), bf16), ((e,), jnp.int32), ((e, h, 2 * i), bf16),
                                                          ((e, 2 * i), bf16), ((e, i, h), bf16), ((e, h), bf16)])
    def estimates(tiles: dict, routing: str) -> dict:
        """name -> CostEstimate of each kernel, its metadata assuming `routing` (moe.cost_routing)."""
        def loss(x, gs, wu, bu, wd, bd):
            y = moe.moe_experts_pallas(x, gs, wu, bu, wd, bd, platform="tpu", **tiles)
            return y.astype(jnp.float32).sum()

        with moe.cost_routing(routing):
            calls = pallas_calls(jax.grad(loss, argnums=(0, 2, 3, 4, 5)), *specs)
        return {p["name"][len("moe_fused_"):]: p["cost_estimate"] for p in calls}

    def kernel_ms(cost: dict) -> dict:
        return {k: max(c.flops / PEAK_FLOPS, c.bytes_accessed / HBM) * 1e3 for k, c in cost.items()}

    def per_step(ms: dict) -> float:
        return args.layers * (2 * ms["fwd"] + ms["dx"] + ms["dw"])

    if args.sweep:
        for tm in (int(v) for v in args.sweep.split(",")):
            tiles = dict(block_m=tm, block_m_dw=256, block_i_dw=320)
            steps = {r: per_step(kernel_ms(estimates(tiles, r))) for r in moe.COST_ROUTINGS}
            print(f"{moe.fused_tiles(m, h, i, bf16, **tiles)}: per step " +
                  ", ".join(f"{r} routing {t:.1f} ms" for r, t in steps.items()))
        return
    from pallas_kernels.platform import vmem_capacity_bytes

    old = dict(block_m=256, block_i=320, block_m_dw=256, block_i_dw=320)
    defaults = {"vmem_capacity_bytes": vmem_capacity_bytes(args.generation)}
    for name, tiles in [("256 rows, I 320", old), ("defaults " + str(moe.fused_tiles(m, h, i, bf16, **defaults)),
                                                    defaults)]:
        for routing in moe.COST_ROUTINGS:
            cost = estimates(tiles, routing)
            ms = kernel_ms(cost)
            print(f"{name}, {routing} routing: " + ", ".join(
                f"{k} {c.bytes_accessed / 1e9:.2f} GB {c.flops / 1e12:.2f} TFLOP {ms[k]:.2f} ms"
                for k, c in sorted(cost.items())) + f"; per step {per_step(ms):.1f} ms")


if __name__ == "__main__":
    main()
