#!/usr/bin/env python3
"""A hand-written JAX decode loop at the 0.57 B Llama's shapes (docs/models/llama-570m.json): what
XLA reaches on this chip without torchax, the op registry or the generator, a yardstick for
`generate`'s decode program (scripts/decode_profile.py times that one). Greedy, 128 steps per call
after a 32-token start, a bf16 KV cache of 192 slots per layer (one array per layer, updated in
place), plain-JAX attention. Linear weights "oi": as torch stores them ([out, in]); "io":
transposed ([in, out]).

    python scripts/decode_reference.py [BATCH ...]      (default: 1 8 64)

Prints ms per step and the share of the weights-only HBM floor (819 GB/s: a v5e).
"""
import functools
import sys
import time

import jax
import jax.numpy as jnp

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 12, 2048, 16, 8, 128, 5632, 4096
SLOTS, START, STEPS = 192, 32, 128
BANDWIDTH = 819e9


def init(key, layout: str) -> dict:
    keys = iter(jax.random.split(key, 16))

    def weight(out_dim, in_dim):
        shape = (LAYERS, out_dim, in_dim) if layout == "oi" else (LAYERS, in_dim, out_dim)
        return (jax.random.normal(next(keys), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

    return dict(q=weight(HEADS * HEAD_DIM, HIDDEN), k=weight(KV_HEADS * HEAD_DIM, HIDDEN),
                v=weight(KV_HEADS * HEAD_DIM, HIDDEN), o=weight(HIDDEN, HEADS * HEAD_DIM), gate=weight(MLP, HIDDEN),
                up=weight(MLP, HIDDEN), down=weight(HIDDEN, MLP), norm1=jnp.ones((LAYERS, HIDDEN), jnp.bfloat16),
                norm2=jnp.ones((LAYERS, HIDDEN), jnp.bfloat16),
                embed=(jax.random.normal(next(keys), (VOCAB, HIDDEN)) * 0.02).astype(jnp.bfloat16))


def linear(x, w, layout: str):
    spec = "bi,oi->bo" if layout == "oi" else "bi,io->bo"
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def rms_norm(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-5)).astype(x.dtype) * w


def layer(p, i, x, keys, values, pos, layout: str):
    b = x.shape[0]
    h = rms_norm(x, p["norm1"][i])
    q = linear(h, p["q"][i], layout).reshape(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    k = linear(h, p["k"][i], layout).reshape(b, KV_HEADS, 1, HEAD_DIM)
    v = linear(h, p["v"][i], layout).reshape(b, KV_HEADS, 1, HEAD_DIM)
    keys = jax.lax.dynamic_update_slice(keys, k, (0, 0, pos, 0))
    values = jax.lax.dynamic_update_slice(values, v, (0, 0, pos, 0))
    scores = jnp.einsum("bkgd,bksd->bkgs", q, keys, preferred_element_type=jnp.float32) * HEAD_DIM ** -0.5
    scores = jnp.where(jnp.arange(SLOTS) <= pos, scores, -1e30)
    probs = jax.nn.softmax(scores, -1).astype(x.dtype)
    attended = jnp.einsum("bkgs,bksd->bkgd", probs, values, preferred_element_type=jnp.float32).astype(x.dtype)
    x = x + linear(attended.reshape(b, HEADS * HEAD_DIM), p["o"][i], layout)
    h = rms_norm(x, p["norm2"][i])
    mlp = jax.nn.silu(linear(h, p["gate"][i], layout)) * linear(h, p["up"][i], layout)
    return x + linear(mlp, p["down"][i], layout), keys, values


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnums=(2,))
def decode(p, tokens, cache, layout: str):
    def step(i, carry):
        tokens, cache = carry
        x = p["embed"][tokens]
        new = []
        for n, (keys, values) in enumerate(cache):
            x, keys, values = layer(p, n, x, keys, values, START + i, layout)
            new.append((keys, values))
        logits = jnp.einsum("bd,vd->bv", rms_norm(x, 1.0), p["embed"], preferred_element_type=jnp.float32)
        return jnp.argmax(logits, -1).astype(jnp.int32), tuple(new)

    return jax.lax.fori_loop(0, STEPS, step, (tokens, cache))


def main(batches):
    for layout in ("oi", "io"):
        p = init(jax.random.key(0), layout)
        floor = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(p)) / BANDWIDTH
        for b in batches:
            zeros = lambda: jnp.zeros((b, KV_HEADS, SLOTS, HEAD_DIM), jnp.bfloat16)
            state = (jnp.zeros((b,), jnp.int32), tuple((zeros(), zeros()) for _ in range(LAYERS)))
            state = jax.block_until_ready(decode(p, *state, layout=layout))        # compile, first run
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                state = jax.block_until_ready(decode(p, *state, layout=layout))
                best = min(best, time.perf_counter() - started)
            ms = best / STEPS * 1e3
            print(f"reference {layout} batch {b}: {ms:.3f} ms per step; weights-only floor {floor * 1e3:.3f} ms "
                  f"({floor * 1e3 / ms:.0%})", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8, 64])
