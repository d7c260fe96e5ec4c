#!/usr/bin/env python3
"""The decode step's output-matrix product, logits [R, V] = h [R, D] @ W^T with W [V, D], timed on
this device side by side: XLA as the decoder runs it (W in the model's [V, D] layout), XLA on a
[D, V] copy, and a Pallas matrix-vector kernel that streams W in row blocks, by one or two
double-buffered block specs. Each is timed as a loop of dependent products inside one program (the device's
time per product, no dispatch), in GB/s of W read and as a share of the chip's HBM bandwidth, with
ratios against the first. At one prompt `small-o200k`'s head is 206 of the 238 MB a token reads;
on the v5e its product took 0.273 ms, 92% of the bandwidth (BENCHMARKS.md, "Decoding on one TPU v5e
chip"): whether a kernel reads it faster decides whether decoding at one prompt can reach 70% of
the HBM floor.

    python3 scripts/decode_head_bench.py [--vocab 201088] [--hidden 512] [--rows 1,8]
                                         [--blocks 4096,8192,16384] [--iters 50] [--repeats 5]

On a CPU host the Pallas kernel runs in the interpreter at whatever shapes are given: a check of
the mechanics and of the results against XLA's, whose times say nothing of a TPU's.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pallas_head(x, w, *, block: int, streams: int, interpret: bool):
    """x [R, D] @ w[V, D]^T -> [R, V] bf16, W read in [block, D] row blocks, double-buffered, by
    `streams` block specs at once (grid step i takes blocks i*streams .. i*streams+streams-1: that
    many DMAs in flight, where one stream leaves the DMA engine idle while a step computes)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    rows, hidden = x.shape
    vocab = w.shape[0]
    last = pl.cdiv(vocab, block) - 1

    def kernel(x_ref, *refs):
        *w_refs, out_ref = refs
        for j, w_ref in enumerate(w_refs):
            out_ref[:, j * block:(j + 1) * block] = jax.lax.dot_general(
                x_ref[...], w_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(out_ref.dtype)

    # Past the last block a stream re-reads it (its columns fall outside the output and are dropped).
    w_specs = [pl.BlockSpec((block, hidden), lambda i, j=j: (jnp.minimum(i * streams + j, last), 0)) for j in range(streams)]
    vmem = 2 * (streams * block * hidden + rows * streams * block + rows * hidden) * w.dtype.itemsize
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(vocab, block * streams),),
        in_specs=[pl.BlockSpec((rows, hidden), lambda i: (0, 0)), *w_specs],
        out_specs=pl.BlockSpec((rows, streams * block), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((rows, vocab), jnp.bfloat16),
        compiler_params=None if interpret else pltpu.CompilerParams(vmem_limit_bytes=min(100 << 20, max(32 << 20, 2 * vmem))),
        interpret=interpret)(x, *[w] * streams)


def candidates(blocks, interpret: bool) -> dict:
    """name -> (the weight's layout, product(x, weight) -> [R, V] bf16)."""
    import functools

    import jax.numpy as jnp

    out = {"xla [V, D] (the decoder's)": ("vd", lambda x, w: jnp.dot(x, w.T).astype(jnp.bfloat16)),
           "xla [D, V]": ("dv", lambda x, wt: jnp.dot(x, wt).astype(jnp.bfloat16))}
    for block in blocks:
        for streams in (1, 2):
            out[f"pallas [V, D] block {block}, {streams} stream(s)"] = (
                "vd", functools.partial(pallas_head, block=block, streams=streams, interpret=interpret))
    return out


def timed_loop(product, iters: int):
    """A program running `iters` products, each input nudged by the previous output's row maxima:
    no product can be skipped or reordered, and every logit is needed (a nudge by a slice of the
    output let XLA compute only that slice's columns at 8 rows). Its time over iters is one
    product's on the device."""
    import jax
    import jax.numpy as jnp

    def run(x, w):
        def body(_, x):
            y = product(x, w)
            return x + (y.max(axis=1, keepdims=True) * 1e-6).astype(x.dtype)
        return jax.lax.fori_loop(0, iters, body, x)
    return jax.jit(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--blocks", default="4096,8192,16384", help="the Pallas kernel's row blocks of W")
    parser.add_argument("--iters", type=int, default=50, help="products per timed program")
    parser.add_argument("--repeats", type=int, default=5, help="timed programs per candidate (median)")
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_bridge.kernel_tiles import generation_of
    from jax_bridge.roofline import device_peaks
    from pallas_kernels.platform import host_platform

    platform = host_platform()
    interpret = platform != "tpu"
    kind = jax.devices()[0].device_kind
    generation = generation_of(kind)
    bandwidth = device_peaks(generation)[1] if generation else None
    key = jax.random.key(0)
    w = (jax.random.normal(key, (args.vocab, args.hidden), jnp.float32) * 0.02).astype(jnp.bfloat16)
    layouts = {"vd": w, "dv": jnp.asarray(w.T)}
    nbytes = w.size * w.dtype.itemsize
    blocks = [int(b) for b in args.blocks.split(",")]
    print(f"logits = h @ W^T, W [{args.vocab}, {args.hidden}] bf16 ({nbytes / 1e6:.1f} MB) on {kind}"
          + ("" if bandwidth is None else f" ({bandwidth / 1e9:.0f} GB/s)")
          + (" (Pallas interpreted: times mean nothing)" if interpret else ""))
    print("| rows | product | per product | GB/s | of HBM bandwidth | vs the decoder's | max |diff| vs xla |")
    print("|---|---|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        x = jax.random.normal(jax.random.key(rows), (rows, args.hidden), jnp.float32).astype(jnp.bfloat16)
        reference = np.asarray(jnp.dot(x, w.T, preferred_element_type=jnp.float32))
        first = None
        for name, (layout, product) in candidates(blocks, interpret).items():
            weight = layouts[layout]
            try:
                diff = float(np.abs(np.asarray(product(x, weight), np.float32) - reference).max())
                loop = timed_loop(product, args.iters)
                jax.block_until_ready(loop(x, weight))
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    jax.block_until_ready(loop(x, weight))
                    times.append((time.perf_counter() - started) / args.iters)
            except Exception as e:          # a tile the compiler refuses is a row of the table, not the end
                print(f"| {rows} | {name} | refused: {str(e).splitlines()[0][:120]} | | | | |")
                continue
            seconds = statistics.median(times)
            first = first or seconds
            share = "-" if bandwidth is None else f"{nbytes / seconds / bandwidth:.1%}"
            print(f"| {rows} | {name} | {seconds * 1e3:.4f} ms | {nbytes / seconds / 1e9:.0f} | {share} | "
                  f"{first / seconds:.3f}x | {diff:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
