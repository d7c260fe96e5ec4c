"""HBM bytes, FLOPs and roofline time of the Pallas attention kernels (forward, dq, dkv) and of
the linear cross-entropy (differentiated: the forward that accumulates E, and dW; plain: the
forward) at Lyra Small's and gpt-oss-20b's shapes with the default TPU tiles, from their cost
estimates (the block-plan count of pallas_kernels/cost.py), priced at one chip's published peaks
(jax_bridge/roofline.py). Jaxprs only, nothing compiled (BENCHMARKS.md "Kernel cost estimates and
instruction counts"). Run it at two commits to compare.

    python scripts/kernel_costs.py [--generation v6e]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# attention per layer: (batch per chip, query heads, kv heads, sequence, head dim); each model
# alternates windowed and full layers
ATTENTION = {"lyra-small, 4 x 4096": (4, 16, 4, 4096, 128), "gpt-oss-20b, 1 x 4096": (1, 64, 8, 4096, 64)}
WINDOW = 128
# the LM head per step and chip: (tokens, hidden, vocabulary)
CROSS_ENTROPY = {"lyra-small, 4 x 4096": (16384, 2048, 201088), "gpt-oss-20b, 1 x 4096": (4096, 2880, 201088)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generation", default="v6e")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import jax
    import jax.numpy as jnp

    from helpers import pallas_calls
    from jax_bridge.roofline import device_peaks
    from pallas_kernels.attention import attention_pallas
    from pallas_kernels.cross_entropy import linear_cross_entropy_pallas

    peak, bandwidth = device_peaks(args.generation)

    def show(fn, specs):
        for p in pallas_calls(fn, *specs):
            c = p["cost_estimate"]
            seconds = max(c.flops / peak, c.bytes_accessed / bandwidth)
            bound = "memory" if c.bytes_accessed / bandwidth > c.flops / peak else "compute"
            print(f"  {p['name']}: {c.bytes_accessed / 1e9:.3f} GB, {c.flops / 1e12:.3f} TFLOP, "
                  f"{seconds * 1e3:.3f} ms on {args.generation} ({bound}-bound)")

    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    for name, (b, hq, hkv, t, d) in ATTENTION.items():
        for window in (WINDOW, 0):
            loss = lambda *a, w=window: attention_pallas(  # noqa: E731
                *a, sliding_window=w, scale=d ** -0.5, platform="tpu").astype(jnp.float32).sum()
            print(f"attention, {name}, {'window %d' % window if window else 'full causal'} (group {hq // hkv}):")
            show(jax.grad(loss, argnums=(0, 1, 2, 3)), (bf16(b, hq, t, d), bf16(b, hkv, t, d), bf16(b, hkv, t, d),
                                                        jax.ShapeDtypeStruct((hq,), jnp.float32)))
    for name, (n, h, v) in CROSS_ENTROPY.items():
        specs = (bf16(n, h), bf16(v, h), jax.ShapeDtypeStruct((n,), jnp.int32))
        loss = lambda *a: linear_cross_entropy_pallas(*a, platform="tpu")[0].sum()  # noqa: E731
        print(f"cross-entropy, {name}, differentiated:")
        show(jax.grad(loss, argnums=(0, 1)), specs)
        print(f"cross-entropy, {name}, forward only:")
        show(loss, specs)


if __name__ == "__main__":
    main()
