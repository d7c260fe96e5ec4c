#!/usr/bin/env python3
"""float32 arithmetic of this host's device against float64 NumPy: exp, log, log1p, log_sigmoid,
sigmoid, softplus and tanh over 200,001 points in [-30, 30] (XLA), exp and log inside a Pallas
kernel (Mosaic on a TPU, interpreted elsewhere), and a float32 matmul at HIGHEST (XLA and Mosaic).
Prints the largest relative error, ulps and median ulps of each. On the v5e (BENCHMARKS.md, "TPU
float32 arithmetic") log_sigmoid was off by up to 4,008 ulps: why the DPO test bounds its loss apart on a TPU.

    python3 scripts/float32_accuracy.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax, jax.numpy as jnp, numpy as np
x = np.linspace(-30, 30, 200001).astype(np.float32)
x64 = x.astype(np.float64)
ref = {"exp": np.exp(np.clip(x64, -80, 80)), "log(|x|+2)": np.log(np.abs(x64) + 2), "log1p(|x|)": np.log1p(np.abs(x64)),
       "log_sigmoid": -np.logaddexp(0, -x64), "sigmoid": 1 / (1 + np.exp(-x64)), "softplus": np.logaddexp(0, x64),
       "tanh": np.tanh(x64)}
fns = {"exp": lambda a: jnp.exp(jnp.clip(a, -80, 80)), "log(|x|+2)": lambda a: jnp.log(jnp.abs(a) + 2),
       "log1p(|x|)": lambda a: jnp.log1p(jnp.abs(a)), "log_sigmoid": jax.nn.log_sigmoid, "sigmoid": jax.nn.sigmoid,
       "softplus": jax.nn.softplus, "tanh": jnp.tanh}


def report(label, got, want, points):
    """The largest relative error (and where), the largest and median error in float32 ulps."""
    rel = np.abs(got - want) / np.maximum(np.abs(want), 1e-30)
    ulp = np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    i = int(np.argmax(rel))
    print(f"{label} max rel {rel.max():.3e} at x={points[i]:.4f}; max ulps {ulp.max():.1f}; median ulps {np.median(ulp):.2f}")


print("device", jax.devices()[0].device_kind)
for name, fn in fns.items():
    report(f"{name:14s}", np.asarray(jax.jit(fn)(jnp.asarray(x)), np.float64), ref[name], x)

# The same functions inside a Pallas (Mosaic) kernel: the attention and cross-entropy kernels' exp and log.
from jax.experimental import pallas as pl
mosaic = {"exp": jnp.exp, "log(|x|+2)": lambda a: jnp.log(jnp.abs(a) + 2)}
xs = np.linspace(-30, 30, 1024 * 128).astype(np.float32).reshape(1024, 128)
interpret = jax.devices()[0].platform != "tpu"
for name, fn in mosaic.items():
    def kernel(x_ref, o_ref, fn=fn):
        o_ref[...] = fn(x_ref[...])
    got = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(xs.shape, jnp.float32), interpret=interpret)(
        jnp.asarray(xs)), np.float64).ravel()
    points = xs.astype(np.float64).ravel()
    report(f"mosaic {name:12s}", got, np.exp(points) if name == "exp" else np.log(np.abs(points) + 2), points)

# float32 matmuls at HIGHEST: XLA's and Mosaic's (the kernels' dot_precision for float32), against float64.
rng = np.random.default_rng(0)
a, b = rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal((512, 256)).astype(np.float32)
want = a.astype(np.float64) @ b.astype(np.float64)
hi = jax.lax.Precision.HIGHEST
xla = np.asarray(jax.jit(lambda x, y: jnp.dot(x, y, precision=hi, preferred_element_type=jnp.float32))(a, b), np.float64)
def mm(x_ref, y_ref, o_ref):
    o_ref[...] = jax.lax.dot_general(x_ref[...], y_ref[...], (((1,), (0,)), ((), ())), precision=hi,
                                     preferred_element_type=jnp.float32)
mos = np.asarray(pl.pallas_call(mm, out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32), interpret=interpret)(a, b), np.float64)
for name, got in (("xla", xla), ("mosaic", mos)):
    print(f"matmul f32 HIGHEST {name:6s} rel (norm) {np.linalg.norm(got - want) / np.linalg.norm(want):.3e}; "
          f"max abs {np.abs(got - want).max():.3e}")
