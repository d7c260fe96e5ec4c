"""The op registry: every hot operation has named implementations, chosen per run.

One table below lists them all. An implementation is a JAX function with the signature of the
op's plain-JAX reference (see `pallas_kernels/__init__.py`). The bridge routes the model's
`torch.ops.torchlyra.*` calls to the chosen implementations while it traces the train step.

Users add their own with one call:

    from jax_bridge.registry import register_implementation
    register_implementation("attention", "mine", my_attention_fn, backends=("tpu",))

and select it with `--kernels attention=mine`.

Under a device mesh an implementation runs either inside `shard_map` on each device's share
(`spmd="shard_map"`, the default: right for any function, required for Pallas kernels, which
GSPMD cannot split) or as one global program split by GSPMD (`spmd="gspmd"`, plain JAX only);
see `sharded_ops.py`. The MoE op's token dispatch always runs per device (`moe_dispatch.py`).
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Callable

import jax

OPS = ("attention", "cross_entropy", "moe")
BACKENDS = ("cpu", "gpu", "tpu")
# What `auto` picks, best first, per backend.
AUTO_PREFERENCE = {"tpu": ("pallas", "xla"), "gpu": ("pallas", "xla"), "cpu": ("xla",)}


class KernelError(ValueError):
    """A requested kernel does not exist or cannot run here. Never silently replaced."""


@dataclass
class Implementation:
    op: str
    name: str
    target: Callable | str              # the function, or "module:attribute" imported on first use
    backends: tuple[str, ...] = BACKENDS
    description: str = ""
    spmd: str = "shard_map"             # under a mesh: "shard_map" (per device) or "gspmd" (plain JAX)
    _fn: Callable | None = field(default=None, repr=False)

    def load(self) -> Callable:
        if self._fn is None:
            if callable(self.target):
                self._fn = self.target
            else:
                module, attr = self.target.split(":")
                try:
                    self._fn = getattr(importlib.import_module(module), attr)
                except (ImportError, AttributeError) as e:
                    raise KernelError(f"kernel {self.op}={self.name}: cannot load {self.target}: {e}") from e
        return self._fn


_TABLE: dict[str, dict[str, Implementation]] = {op: {} for op in OPS}


def register_implementation(op: str, name: str, fn: Callable | str, *, backends=BACKENDS, description: str = "",
                            spmd: str = "shard_map"):
    """Add (or replace) implementation `name` of `op`. `fn` has the op's reference signature;
    `spmd` says how it runs under a mesh ("shard_map", or "gspmd" for plain-JAX functions)."""
    if op not in _TABLE:
        raise KernelError(f"unknown op {op!r}; ops are: {', '.join(OPS)}")
    if name == "auto":
        raise KernelError("'auto' is reserved: it picks the best implementation for the backend")
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise KernelError(f"unknown backend(s) {sorted(unknown)} for {op}={name}; backends are {BACKENDS}")
    if spmd not in ("shard_map", "gspmd"):
        raise KernelError(f"{op}={name}: spmd must be 'shard_map' or 'gspmd', found {spmd!r}")
    _TABLE[op][name] = Implementation(op, name, fn, tuple(backends), description, spmd)


def implementations(op: str) -> dict[str, Implementation]:
    return dict(_TABLE[op])


# ---- the built-in table -----------------------------------------------------------------------
_K = "pallas_kernels"
register_implementation("attention", "xla", f"{_K}.attention:attention_reference", spmd="gspmd",
                        description="plain JAX, materializes [T, T] scores")
register_implementation("attention", "pallas", f"{_K}.attention:attention_pallas",
                        description="flash attention (Mosaic TPU / Triton GPU; interpret on CPU)")
register_implementation("attention", "splash", f"{_K}.attention:attention_splash", backends=("cpu", "tpu"),
                        description="jax-shipped splash attention (TPU; interpret on CPU)")
register_implementation("cross_entropy", "xla", f"{_K}.cross_entropy:linear_cross_entropy_reference", spmd="gspmd",
                        description="plain JAX, materializes [N, V] logits")
register_implementation("cross_entropy", "pallas", f"{_K}.cross_entropy:linear_cross_entropy_pallas",
                        description="vocab-tiled online log-sum-exp (Mosaic TPU / Triton GPU; interpret on CPU)")
register_implementation("moe", "xla", f"{_K}.moe:moe_experts_xla", spmd="gspmd",
                        description="plain JAX tiled grouped GEMM")
register_implementation("moe", "ragged_dot", f"{_K}.moe:moe_experts_reference", spmd="gspmd",
                        description="jax.lax.ragged_dot (the reference)")
register_implementation("moe", "megablox", f"{_K}.moe:moe_experts_megablox", backends=("cpu", "tpu"),
                        description="jax-shipped megablox gmm (TPU; interpret on CPU)")
register_implementation("moe", "pallas", f"{_K}.moe:moe_experts_pallas", backends=("cpu", "tpu"),
                        description="fused grouped expert MLP: up + clamped SwiGLU + down in VMEM (Mosaic TPU; interpret on CPU)")


# ---- selection --------------------------------------------------------------------------------
def current_backend() -> str:
    backend = jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm") else backend


def parse_kernel_spec(spec: str | dict | None) -> dict[str, str]:
    """'attention=pallas,moe=xla' (or a dict, or 'auto', or a single name for every op) ->
    {op: implementation name}; ops not named get 'auto'."""
    choice = {op: "auto" for op in OPS}
    if spec is None or spec == "":
        return choice
    if isinstance(spec, str):
        if "=" not in spec:
            return {op: spec.strip() for op in OPS}
        items = {}
        for part in spec.split(","):
            if "=" not in part:
                raise KernelError(f"--kernels: expected op=name, found {part!r}")
            op, name = (s.strip() for s in part.split("=", 1))
            items[op] = name
        spec = items
    for op, name in spec.items():
        if op not in OPS:
            raise KernelError(f"--kernels: unknown op {op!r}; ops are: {', '.join(OPS)}")
        choice[op] = name
    return choice


def resolve(spec: str | dict | None, backend: str | None = None) -> dict[str, str]:
    """Turn a kernel spec into concrete names that exist and can run on `backend`."""
    backend = backend or current_backend()
    resolved = {}
    for op, name in parse_kernel_spec(spec).items():
        table = _TABLE[op]
        if name == "auto":
            name = next((n for n in AUTO_PREFERENCE.get(backend, ("xla",)) if n in table), None)
            if name is None:
                raise KernelError(f"no implementation of {op} for backend {backend}")
        if name not in table:
            raise KernelError(f"unknown implementation {op}={name}; registered: {', '.join(table)}")
        if backend not in table[name].backends:
            raise KernelError(f"{op}={name} cannot run on backend {backend!r} "
                              f"(it runs on: {', '.join(table[name].backends)})")
        table[name].load()
        resolved[op] = name
    return resolved


def describe(resolved: dict[str, str], backend: str | None = None) -> str:
    backend = backend or current_backend()
    mode = " (Pallas in interpret mode on CPU)" if backend == "cpu" and any(
        n in ("pallas", "splash", "megablox") for n in resolved.values()) else ""
    return ", ".join(f"{op}={name}" for op, name in resolved.items()) + f" on {backend}{mode}"


# ---- routing the torch ops --------------------------------------------------------------------
def _adapters(resolved: dict[str, str], mesh=None):
    """JAX callables with the torch ops' positional schemas, calling the chosen implementations
    (per device or under GSPMD when a mesh is given)."""
    from jax_bridge import moe_dispatch, sharded_ops

    impl = {op: _TABLE[op][resolved[op]] for op in OPS}
    attn, ce, moe = (impl[op].load() for op in OPS)
    if mesh is not None:
        attn = sharded_ops.attention(attn, mesh, impl["attention"].spmd)
        ce = sharded_ops.cross_entropy(ce, mesh, impl["cross_entropy"].spmd)

    def grouped(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha, limit):
        return moe(x, group_sizes.astype("int32"), gate_up, gate_up_bias, down, down_bias, alpha=alpha, limit=limit)

    routed_experts = moe_dispatch.routed_experts(grouped, mesh=mesh)

    def attention(q, k, v, sinks, sliding_window, scale):
        return attn(q, k, v, sinks, sliding_window=int(sliding_window), scale=float(scale))

    def cross_entropy(hidden, weight, labels, ignore_index):
        return ce(hidden, weight, labels, ignore_index=int(ignore_index))

    def moe_experts(x, experts, weights, gate_up, gate_up_bias, down, down_bias, alpha, limit):
        return routed_experts(x, experts.astype("int32"), weights, gate_up, gate_up_bias, down, down_bias,
                              alpha=float(alpha), limit=float(limit))

    return {"attention": attention, "cross_entropy": cross_entropy, "moe": moe_experts}


@contextlib.contextmanager
def routed(env, resolved: dict[str, str], mesh=None):
    """Within this block (used at trace time), the torchax env runs the chosen implementations
    for the model's custom ops (sharded over `mesh` if given); the env's previous table is
    restored afterwards."""
    import torchax.interop as interop

    from torch_model.ops import OPS as TORCH_OPS

    adapters = _adapters(resolved, mesh)
    saved = {}
    for op, fn in adapters.items():
        key = TORCH_OPS[op].default
        saved[key] = env._ops.get(key)
        env.override_op_definition(key, interop.torch_view(fn))
    try:
        yield
    finally:
        for key, previous in saved.items():
            if previous is None:
                env._ops.pop(key, None)
            else:
                env._ops[key] = previous
