"""HBM bytes and roofline time of the Pallas attention kernels (forward, dq, dkv) per layer at
Lyra Small's and gpt-oss-20b's shapes with the default TPU tiles, from their cost estimates (the
block-plan count of pallas_kernels/cost.py), priced at one chip's published peaks
(jax_bridge/roofline.py). Jaxprs only, nothing compiled (BENCHMARKS.md "Attention: a GQA group
per grid step"). Run it at two commits to compare block plans.

    python scripts/attention_kernel_bytes.py [--generation v6e]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (batch per chip, query heads, kv heads, sequence, head dim); each model alternates windowed and full layers
SHAPES = {"lyra-small, 4 x 4096": (4, 16, 4, 4096, 128), "gpt-oss-20b, 1 x 4096": (1, 64, 8, 4096, 64)}
WINDOW = 128


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

    peak, bandwidth = device_peaks(args.generation)
    for name, (b, hq, hkv, t, d) in SHAPES.items():
        for window in (WINDOW, 0):
            specs = (jax.ShapeDtypeStruct((b, hq, t, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, hkv, t, d), jnp.bfloat16),
                     jax.ShapeDtypeStruct((b, hkv, t, d), jnp.bfloat16), jax.ShapeDtypeStruct((hq,), jnp.float32))
            loss = lambda *a, w=window: attention_pallas(  # noqa: E731
                *a, sliding_window=w, scale=d ** -0.5, platform="tpu").astype(jnp.float32).sum()
            calls = {p["name"]: p["cost_estimate"] for p in pallas_calls(jax.grad(loss, argnums=(0, 1, 2, 3)), *specs)}
            print(f"{name}, {'window %d' % window if window else 'full causal'} (group {hq // hkv}):")
            for kernel, c in calls.items():
                seconds = max(c.flops / peak, c.bytes_accessed / bandwidth)
                bound = "memory" if c.bytes_accessed / bandwidth > c.flops / peak else "compute"
                print(f"  {kernel}: {c.bytes_accessed / 1e9:.3f} GB, {c.flops / 1e12:.3f} TFLOP, "
                      f"{seconds * 1e3:.3f} ms on {args.generation} ({bound}-bound)")


if __name__ == "__main__":
    main()
