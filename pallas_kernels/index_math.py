"""Integer arithmetic for index maps and grid sizing, on whatever it is given: Python ints (grid
sizes), NumPy arrays (the cost estimates evaluate a map at every grid step at once on the host,
so no JAX op is dispatched and none compiled) or traced int32 scalars (inside a kernel's program).
Traced values take lax.div / lax.rem, not // and %: floor division lowers to `sign`, which Mosaic
index maps cannot lower."""
import jax.numpy as jnp
import numpy as np
from jax import lax


def _host(*xs) -> bool:
    return all(isinstance(x, (int, np.integer, np.bool_, np.ndarray)) for x in xs)


def div(a, b):
    """a / b: floor for Python ints; truncated toward zero (lax.div's rule) otherwise."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    if _host(a, b):
        return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))
    return lax.div(a, b)


def rem(a, b):
    """The remainder of lax.rem (the dividend's sign)."""
    return np.fmod(a, b) if _host(a, b) else lax.rem(a, b)


def maximum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return np.maximum(a, b) if _host(a, b) else jnp.maximum(a, b)


def minimum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return np.minimum(a, b) if _host(a, b) else jnp.minimum(a, b)


def where(cond, a, b):
    return np.where(cond, a, b) if _host(cond, a, b) else jnp.where(cond, a, b)


def clip(a, lo, hi):
    return np.clip(a, lo, hi) if _host(a, lo, hi) else jnp.clip(a, lo, hi)
