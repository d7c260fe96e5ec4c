"""The one vocabulary of kernel modes: the platform a program is compiled FOR, and how a Pallas
kernel runs there. Every kernel file asks `kernel_mode` and `dot_precision`; nothing here or in
the kernels reads `jax.default_backend()` at trace time (`host_platform` is called once, outside).

  platform  "tpu": the Mosaic kernels, compiled.     "gpu": the Triton kernels, compiled.
            "cpu": the TPU-family kernels run by the generic Pallas interpreter (CPU tiles).
  interpret None (the platform's own way), "generic" (jax's generic Pallas interpreter: fast on
            CPU) or "tpu" (the TPU-simulating interpreter, pltpu.InterpretParams: VMEM/SMEM,
            grid semantics, NaN-filled buffers, race detection; slow). An override for tests and
            measurement: e.g. platform "gpu" + interpret "generic" runs the Triton kernels on CPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

PLATFORMS = ("cpu", "gpu", "tpu")
INTERPRETERS = ("generic", "tpu")


def host_platform() -> str:
    """The platform of this process's default JAX backend, in PLATFORMS terms. Call it once,
    outside tracing (StepConfig does), and pass the result down."""
    backend = jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm", "gpu") else backend


def vmem_capacity_bytes(generation: str | None) -> int | None:
    """VMEM per TensorCore of a TPU generation ('v4', 'v5e', 'v5p', 'v6e', 'v7x'), from jax's own
    table (pltpu.get_tpu_info_for_chip); None when none is given or jax does not know it: kernels
    then keep budgets that fit every TPU from v5p on (64 MiB)."""
    if generation is None:
        return None
    from jax.experimental.pallas import tpu as pltpu

    try:     # jax names v7x '7x'
        chip = pltpu.ChipVersion(generation[1:] if generation.startswith("v7") else generation)
    except ValueError:
        return None
    return pltpu.get_tpu_info_for_chip(chip, 1).vmem_capacity_bytes


def check_platform(platform: str, who: str = "kernel") -> str:
    if platform not in PLATFORMS:
        raise ValueError(f"{who}: unknown platform {platform!r}; expected one of {', '.join(PLATFORMS)}")
    return platform


@dataclasses.dataclass(frozen=True)
class KernelMode:
    """How one kernel call runs: which kernel family, compiled or interpreted."""
    platform: str              # the target platform (selects default tiles)
    family: str                # "tpu" (Mosaic kernels) | "gpu" (Triton kernels)
    interpret: object          # None (compiled), "generic", "tpu" or a pltpu.InterpretParams

    @property
    def compiled(self) -> bool:
        return self.interpret is None

    def pallas_interpret(self):
        """The value for pallas_call's `interpret=`."""
        if self.interpret is None:
            return False
        if self.interpret == "generic":
            return True
        if self.interpret == "tpu":
            from jax.experimental.pallas import tpu as pltpu
            return pltpu.InterpretParams()
        return self.interpret

    def shipped_interpret(self) -> bool:
        """jax-shipped TPU kernels (splash, megablox) take a boolean `interpret`."""
        if self.interpret not in (None, "generic"):
            raise ValueError("jax-shipped kernels take only a boolean interpret flag; "
                             "interpret='tpu' is not available for them (use 'generic')")
        return self.interpret is not None


def kernel_mode(platform: str, interpret=None, *, who: str,
                families: tuple[str, ...] = ("tpu", "gpu"), hint: str = "") -> KernelMode:
    """The mode of kernel `who` compiled for `platform` (see the module docstring). `interpret`
    may also be a pltpu.InterpretParams: the TPU interpreter with those settings (race detection,
    several cores).
    `families`: the kernel families `who` has; asking for another is a NotImplementedError
    that names the alternatives, never a silent fallback."""
    check_platform(platform, who)
    tpu_params = type(interpret).__name__ == "InterpretParams"
    if interpret is not None and not tpu_params and interpret not in INTERPRETERS:
        raise ValueError(f"{who}: unknown interpret mode {interpret!r}; expected None or one of "
                         f"{', '.join(INTERPRETERS)}")
    family = "gpu" if platform == "gpu" else "tpu"
    if family not in families:
        raise NotImplementedError(f"{who} has no {platform} kernel (it has: {', '.join(families)} kernels)"
                                  + (f"; {hint}" if hint else ""))
    if platform == "cpu" and interpret is None:
        interpret = "generic"
    if family == "gpu" and (interpret == "tpu" or tpu_params):
        raise ValueError(f"{who}: the TPU interpreter cannot run the GPU (Triton) kernels; use 'generic'")
    return KernelMode(platform, family, interpret)


def dot_precision(dtype) -> lax.Precision:
    """The precision of a kernel's dots for operands of `dtype`: float32 -> HIGHEST (real float32
    products; TPU's default is one bf16 pass, Triton's tf32), anything narrower -> DEFAULT (exact
    products, float32 accumulation). Always explicit: a dot with precision=None inherits the
    caller's jax.default_matmul_precision, and Mosaic rejects HIGHEST on bf16 operands
    ("Bad lhs type")."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def precision_name(dtype) -> str:
    """dot_precision as a jax.default_matmul_precision name."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else "default"


def with_matmul_precision(fn, precision: str):
    """fn traced, forward AND backward, under jax.default_matmul_precision(precision).

    For jax-shipped kernels (splash, megablox) whose dots take the ambient precision: their
    custom_vjp backward is traced when the caller transposes, outside any context the caller's
    forward set, so the precision is pinned here for both passes. Integer arguments get no
    gradient."""
    ctx = functools.partial(jax.default_matmul_precision, precision)

    @jax.custom_vjp
    def call(*args):
        with ctx():
            return fn(*args)

    def fwd(*args):
        with ctx():
            out, pullback = jax.vjp(fn, *args)
        return out, pullback

    def bwd(pullback, cotangent):
        with ctx():
            grads = pullback(cotangent)
        return tuple(None if g.dtype == jax.dtypes.float0 else g for g in grads)

    call.defvjp(fwd, bwd)
    return call


__all__ = ["PLATFORMS", "INTERPRETERS", "KernelMode", "kernel_mode", "host_platform", "check_platform",
           "dot_precision", "precision_name", "with_matmul_precision"]
