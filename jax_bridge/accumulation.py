"""Gradients of broadcast parameters accumulate in float32, on every backend.

A parameter that a forward broadcasts over the tokens (a norm's weight, a bias, a one-element
parameter such as Apertus's xIELU `alpha_p` / `alpha_n`) gets its gradient from JAX's transposes
of broadcasting (`lax._unbroadcast`, the transpose of `broadcast_in_dim`), which call
`lax.reduce_sum` in the cotangent's dtype: in a bfloat16 step, a bfloat16 sum over every token.
`lax.reduce_sum` does not widen narrow types (its docstring says so; `jnp.sum` does), and XLA's
CPU backend rounds the running sum to bfloat16 after every add: the gradient of a bf16 one
broadcast over 70,000 ones comes out as 8,192, and Apertus's `alpha_p` gradient came out 31% too
large in a 160-token parity step (eager transformers in bfloat16, which sums in float32: 2%).

`install()` replaces the `reduce_sum` those transposes call (the module global of
`jax._src.lax.lax`) with one that sums bfloat16 and float16 operands in float32 and rounds once.
Other dtypes and the public `jax.lax.reduce_sum` are unchanged. The result is the correctly
rounded sum where the old one was a bfloat16 accumulator; on a TPU the program gains two fused
converts. `jax_bridge.env.get_env` installs it, so every lowered step traces with it; a JAX whose
internals moved is refused at install, naming what is missing (tests/test_compat_and_registry.py).
"""
from __future__ import annotations

import jax.numpy as jnp

_NARROW = (jnp.bfloat16, jnp.float16)
_installed = False


def _lax_module():
    from jax._src.lax import lax as lax_internal

    missing = [name for name in ("reduce_sum", "_unbroadcast", "_broadcast_in_dim_transpose_rule",
                                 "convert_element_type") if not hasattr(lax_internal, name)]
    if missing:
        import jax

        raise RuntimeError(f"jax {jax.__version__}: jax._src.lax.lax has no {', '.join(missing)}; "
                           "jax_bridge/accumulation.py widens the gradient sums of broadcast parameters "
                           "through them (check that this JAX still sums them with lax.reduce_sum)")
    return lax_internal


def install() -> None:
    """Make the transposes of broadcasting sum narrow floats in float32 (idempotent)."""
    global _installed
    if _installed:
        return
    lax_internal = _lax_module()
    narrow_sum = lax_internal.reduce_sum

    def reduce_sum(operand, axes, *, out_sharding=None):
        dtype = getattr(operand, "dtype", None)
        if dtype is None or dtype not in _NARROW:
            return narrow_sum(operand, axes, out_sharding=out_sharding)
        wide = narrow_sum(lax_internal.convert_element_type(operand, jnp.float32), axes, out_sharding=out_sharding)
        return lax_internal.convert_element_type(wide, dtype)

    reduce_sum.__doc__ = f"{narrow_sum.__doc__ or ''}\n(torchlyra: narrow floats accumulate in float32.)"
    reduce_sum.__wrapped__ = narrow_sum
    lax_internal.reduce_sum = reduce_sum
    _installed = True


def installed() -> bool:
    return _installed
