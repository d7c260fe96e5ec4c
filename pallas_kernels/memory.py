"""Compile-only memory measurement for kernels: XLA's temp (scratch) bytes of a jitted program,
on any backend, without running it or having the target hardware.

    temp_bytes(fn, *shape_dtype_structs)                    forward
    temp_bytes(vjp_program(fn, argnums), *specs, dy_spec)   forward + backward

`temp_size_in_bytes` excludes a program's arguments and outputs, so `vjp_program` takes the
cotangent dy as an INPUT and returns the outputs and the input cotangents: no loss reduction and
no [M, H] buffer common to every implementation is added, and what is left is what the
implementation itself allocates (residuals, intermediates, copies).

Two modes, report both:
  opaque=False  the program as it is compiled here. On CPU a pallas_call runs in interpret mode,
                which lowers to an XLA loop that copies its inputs into the loop state, so Pallas
                programs look larger than they are.
  opaque=True   every pallas_call is replaced by a pure_callback with the same outputs: the
                kernel becomes opaque, its operands and results stay in HBM, and its blocks and
                scratch (VMEM on TPU) are not counted. This is the estimate of what the TPU
                program allocates in HBM around its Mosaic kernels (VMEM use is NOT measured).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import pallas as pl


def _opaque_pallas_call(kernel, out_shape, **unused):
    """Stand-in for pl.pallas_call: same outputs, no kernel body (a host callback)."""
    del kernel, unused

    def call(*args):
        flat, tree = jax.tree.flatten(out_shape)
        flat = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in flat]
        # sequential under vmap (splash vmaps its kernel over the batch): one opaque call per element
        outs = jax.pure_callback(lambda *a: tuple(np.zeros(s.shape, s.dtype) for s in flat), tuple(flat), *args,
                                 vmap_method="sequential")
        return jax.tree.unflatten(tree, list(outs))

    return call


@contextlib.contextmanager
def opaque_pallas_calls():
    """Within the block, `pl.pallas_call` builds opaque callbacks (see the module docstring).
    Tracing caches are cleared on entry and exit so no kernel traced in the other mode is
    reused (jitted library code such as megablox caches its traces)."""
    original = pl.pallas_call
    jax.clear_caches()
    pl.pallas_call = _opaque_pallas_call
    try:
        yield
    finally:
        pl.pallas_call = original
        jax.clear_caches()


def temp_bytes(fn: Callable, *specs, opaque: bool = False) -> int:
    """XLA temp bytes of jax.jit(fn) compiled for `specs` (ShapeDtypeStructs) on the default
    backend; compile only, nothing runs. opaque=True: pallas_calls as opaque callbacks."""
    program = lambda *args: fn(*args)   # a fresh function: no jit cache hit across modes
    with opaque_pallas_calls() if opaque else contextlib.nullcontext():
        compiled = jax.jit(program).lower(*specs).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def vjp_program(fn: Callable, argnums: Sequence[int], n_inputs: int | None = None) -> Callable:
    """(*inputs, *cotangents) -> (outputs, cotangents of inputs[argnums]).

    `jax.vjp(fn, ...)` with the output cotangents as INPUTS and the outputs returned, so neither
    counts as a temp: what remains is what the implementation itself holds (residuals, copies).
    Non-differentiated inputs (e.g. integer group sizes) are held fixed. n_inputs: how many of
    the arguments are inputs (default: all but the last, i.e. one output)."""
    argnums = tuple(argnums)

    def program(*args):
        split = len(args) - 1 if n_inputs is None else n_inputs
        inputs, cotangents = args[:split], args[split:]

        def f(*diff):
            full = list(inputs)
            for i, d in zip(argnums, diff):
                full[i] = d
            return fn(*full)

        out, pullback = jax.vjp(f, *(inputs[i] for i in argnums))
        return out, pullback(tuple(cotangents) if isinstance(out, (tuple, list)) else cotangents[0])

    return program


# ---------------------------------------------------------------------------------------------
# The MoE table:  python -m pallas_kernels.memory [M H I E]   (default: Lyra Small, bf16)
# ---------------------------------------------------------------------------------------------
def moe_table(m: int = 32768, h: int = 2048, i: int = 384, e: int = 16, dtype=None) -> dict:
    """{implementation: {(pass, mode): temp bytes}} for every MoE implementation, pass in
    ('fwd', 'fwd+bwd'), mode in ('interpret', 'opaque'); Pallas ones compiled for platform 'cpu'."""
    import functools

    import jax.numpy as jnp

    from pallas_kernels import moe

    dt = jnp.bfloat16 if dtype is None else dtype
    specs = tuple(jax.ShapeDtypeStruct(s, d) for s, d in [((m, h), dt), ((e,), jnp.int32), ((e, h, 2 * i), dt),
                                                          ((e, 2 * i), dt), ((e, i, h), dt), ((e, h), dt)])
    dy = jax.ShapeDtypeStruct((m, h), dt)
    impls = {"reference": moe.moe_experts_reference, "xla": moe.moe_experts_xla,
             "pallas (fused)": functools.partial(moe.moe_experts_pallas, platform="cpu"),
             "megablox": functools.partial(moe.moe_experts_megablox, platform="cpu")}
    table = {}
    for name, fn in impls.items():
        row = table[name] = {}
        for kind, program, args in [("fwd", fn, specs), ("fwd+bwd", vjp_program(fn, (0, 2, 3, 4, 5)), specs + (dy,))]:
            for opaque in (False, True):
                row[kind, "opaque" if opaque else "interpret"] = temp_bytes(program, *args, opaque=opaque)
    return table


def _main(argv):
    m, h, i, e = (int(a) for a in argv) if argv else (32768, 2048, 384, 16)
    table = moe_table(m, h, i, e)
    cols = [(k, mode) for k in ("fwd", "fwd+bwd") for mode in ("interpret", "opaque")]
    base = table["reference"]
    print(f"MoE temp memory, M={m} H={h} I={i} E={e} bf16, {jax.default_backend()} compile; "
          f"MiB (% saved vs reference)")
    print(f"{'':16s}" + "".join(f"{k + ' ' + mode:>24s}" for k, mode in cols))
    for name, row in table.items():
        print(f"{name:16s}" + "".join(f"{row[c] / 2**20:12.3f} ({100 * (1 - row[c] / base[c]):7.3f}%)" for c in cols))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
