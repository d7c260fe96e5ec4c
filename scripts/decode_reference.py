#!/usr/bin/env python3
"""A minimal hand-written JAX decode loop at the 0.57 B Llama's shapes (docs/models/llama-570m.json):
what XLA reaches on this chip without torchax, the registry or the generator, as a yardstick for
`generate`'s decode program (scripts/decode_profile.py). Greedy, 128 steps per call, KV cache of
192 slots, weights stacked per kind; "oi": Linear weights as torch stores them ([out, in]), "io":
transposed ([in, out]).

    python scripts/decode_reference.py
"""
import sys, time, functools
import jax, jax.numpy as jnp
L, D, H, KV, HD, F, V = 12, 2048, 16, 8, 128, 5632, 4096

def init(key, orient):
    ks = iter(jax.random.split(key, 16))
    def w(o, i):  # torch layout [out, in] or [in, out]
        shape = (L, o, i) if orient == "oi" else (L, i, o)
        return (jax.random.normal(next(ks), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
    p = dict(q=w(H*HD, D), k=w(KV*HD, D), v=w(KV*HD, D), o=w(D, H*HD), g=w(F, D), u=w(F, D), d=w(D, F),
             n1=jnp.ones((L, D), jnp.bfloat16), n2=jnp.ones((L, D), jnp.bfloat16),
             emb=(jax.random.normal(next(ks), (V, D)) * 0.02).astype(jnp.bfloat16))
    return p

def mm(x, w, orient):
    if orient == "oi":
        return jnp.einsum("bi,oi->bo", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum("bi,io->bo", x, w, preferred_element_type=jnp.float32).astype(x.dtype)

def norm(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-5)).astype(x.dtype) * w

def step(p, x, kc, vc, pos, orient, unrolled=True):
    b = x.shape[0]
    def layer(i, x, kc, vc):
        h = norm(x, p["n1"][i])
        q = mm(h, p["q"][i], orient).reshape(b, KV, H // KV, HD)
        k = mm(h, p["k"][i], orient).reshape(b, KV, 1, HD)
        v = mm(h, p["v"][i], orient).reshape(b, KV, 1, HD)
        kc_i = jax.lax.dynamic_update_slice(kc[i], k, (0, 0, pos, 0))
        vc_i = jax.lax.dynamic_update_slice(vc[i], v, (0, 0, pos, 0))
        s = jnp.einsum("bkgd,bksd->bkgs", q, kc_i, preferred_element_type=jnp.float32) * HD ** -0.5
        s = jnp.where(jnp.arange(kc.shape[3]) <= pos, s, -1e30)
        a = jax.nn.softmax(s, -1).astype(x.dtype)
        o = jnp.einsum("bkgs,bksd->bkgd", a, vc_i, preferred_element_type=jnp.float32).astype(x.dtype)
        x = x + mm(o.reshape(b, H * HD), p["o"][i], orient)
        h = norm(x, p["n2"][i])
        x = x + mm(jax.nn.silu(mm(h, p["g"][i], orient)) * mm(h, p["u"][i], orient), p["d"][i], orient)
        return x, kc.at[i].set(kc_i), vc.at[i].set(vc_i)
    for i in range(L):
        x, kc, vc = layer(i, x, kc, vc)
    logits = jnp.einsum("bd,vd->bv", norm(x, 1.0), p["emb"], preferred_element_type=jnp.float32)
    return logits, kc, vc

@functools.partial(jax.jit, static_argnames=("orient", "n"), donate_argnums=(2, 3))
def loop(p, tok, kc, vc, start, orient, n):
    def body(i, c):
        tok, kc, vc = c
        x = p["emb"][tok]
        logits, kc, vc = step(p, x, kc, vc, start + i, orient)
        return jnp.argmax(logits, -1).astype(jnp.int32), kc, vc
    return jax.lax.fori_loop(0, n, body, (tok, kc, vc))

for orient in ("oi", "io"):
    p = init(jax.random.key(0), orient)
    for b in (1, 8, 64):
        S = 192
        kc = jnp.zeros((L, b, KV, S, HD), jnp.bfloat16); vc = jnp.zeros_like(kc)
        tok = jnp.zeros((b,), jnp.int32)
        n = 128
        out = loop(p, tok, kc, vc, 32, orient, n); jax.block_until_ready(out)
        tok, kc, vc = out
        ts = []
        for _ in range(3):
            t = time.perf_counter(); out = loop(p, tok, kc, vc, 32, orient, n); jax.block_until_ready(out); ts.append(time.perf_counter() - t)
            tok, kc, vc = out
        ms = min(ts) / n * 1e3
        wb = sum(a.size * 2 for a in jax.tree.leaves(p))
        print(f"ideal {orient} batch {b}: {ms:.3f} ms/step, floor {wb/819e9*1e3:.3f} ms ({wb/819e9*1e3/ms:.0%})", flush=True)
