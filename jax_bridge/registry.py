"""The op registry: every hot operation has named implementations, chosen per run.

One table below lists them all. An implementation is a JAX function with the signature of the
op's contract (`op_contracts.py`: positional arguments, keywords, return value, gradients,
platforms, each op's versions), checked when it is registered (a "module:attribute" target: when
first loaded): an extra required argument, a keyword the op passes that it lacks, an unknown
platform is refused then, in one line naming the op, the implementation, what is wrong and the
contract version. The bridge routes the model's `torch.ops.torchlyra.*` calls to the chosen
implementations while it traces the train step.

An implementation written for an older contract says so (`contract_version=N`): the keywords
added after N that it does not take are omitted while they hold the default that reproduces the
op of version N (attention's `segment_ids` None, moe's `up_shift` 1.0), and a call with another
value is refused by name at trace time (`ContractError`, before the kernel is called), never a
TypeError and never a silently dropped argument. One that accepts **kwargs takes every keyword of
the version it was written for.

Every call names the platform the program is compiled FOR (`platform` in "cpu", "gpu", "tpu";
see `pallas_kernels/platform.py`): an implementation whose signature has a `platform` keyword
receives it (all built-in kernels do); one without it (a plain-JAX function) is called without
it. Per-implementation options (tile sizes) come from `kernel_options`, e.g.
"attention.pallas.block_q=256,cross_entropy.pallas.block_v=1024"; each option must be a keyword
parameter of that implementation. A part naming a JSON file ("tiles.json") is a table of tuned
tiles per call shape (`kernel_tiles.py`, written by `torchlyra bench kernels --tune`); options
given explicitly override it. A program compiled for a TPU generation with a committed table
takes that table by default (`kernel_tiles.with_tables`); the part "tiles=off" turns it off.

Users add their own with one call:

    from jax_bridge.registry import register_implementation
    register_implementation("attention", "mine", my_attention_fn, platforms=("tpu",))
    register_implementation("attention", "old", fn_without_segment_ids, contract_version=1)

and select it with `--kernels attention=mine`.

Under a device mesh an implementation runs either inside `shard_map` on each device's share
(`spmd="shard_map"`, the default: right for any function, required for Pallas kernels, which
GSPMD cannot split) or as one global program split by GSPMD (`spmd="gspmd"`, plain JAX only);
see `sharded_ops.py`. The MoE op's token dispatch always runs per device (`moe_dispatch.py`).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from jax_bridge import kernel_tiles
from jax_bridge.op_contracts import CONTRACTS, CallPlan, holds_default, read_signature
from pallas_kernels.platform import PLATFORMS, check_platform, host_platform, vmem_capacity_bytes

OPS = ("attention", "cross_entropy", "moe")      # the training forward's ops
GENERATION_OPS = ("cached_attention",)           # used only by the KV-cache forward (generation)
# Ops of models whose frozen weights stay quantized on the device (an MXFP4 expert base): resolved
# alongside OPS by the programs of such a model, with the same `auto` preference.
QUANTIZED_OPS = ("moe_mxfp4",)
# What `auto` picks, best first, per platform; per op it takes the first that is registered for
# that platform (MoE has no GPU Pallas kernel, so GPU gets moe=xla; only the MoE ops have a
# `loop`: for `moe` the CPU's fastest grouped GEMM, BENCHMARKS.md's train step; for `moe_mxfp4` the
# one that decodes an expert at a time in training too).
AUTO_PREFERENCE = {"tpu": ("pallas", "xla"), "gpu": ("pallas", "xla"), "cpu": ("loop", "xla")}
# Where one op's `auto` differs from its platform's: the Pallas cached attention has passed the TPU
# compiler and the CPU interpreter, not yet a chip (tests/test_chip_kernels.py holds it to the
# reference there); until the hardware tier has run it, TPU generation takes it only when asked.
AUTO_PREFERENCE_BY_OP = {("cached_attention", "tpu"): ("xla",)}


class KernelError(ValueError):
    """A requested kernel does not exist or cannot run here. Never silently replaced."""


class ContractError(KernelError):
    """An implementation does not meet its op's contract (at registration or first load), or was
    written for an older contract that cannot honour this call (`keyword`: the keyword it lacks)."""

    def __init__(self, message: str, op: str, name: str, keyword: str | None = None):
        super().__init__(message)
        self.op, self.name, self.keyword = op, name, keyword


@dataclass
class Implementation:
    op: str
    name: str
    target: Callable | str              # the function, or "module:attribute" imported on first use
    platforms: tuple[str, ...] = PLATFORMS
    description: str = ""
    spmd: str = "shard_map"             # under a mesh: "shard_map" (per device) or "gspmd" (plain JAX)
    trains: bool = True                 # differentiable: usable in the train step (False: generation only)
    contract_version: int | None = None  # the op's contract it was written for (None: the current one)
    _fn: Callable | None = field(default=None, repr=False)
    _plan: CallPlan | None = field(default=None, repr=False)

    def load(self) -> Callable:
        """The function, imported on first use and held to the op's contract (ContractError)."""
        if self._fn is None:
            if callable(self.target):
                fn = self.target
            else:
                module, attr = self.target.split(":")
                try:
                    fn = getattr(importlib.import_module(module), attr)
                except (ImportError, AttributeError) as e:
                    raise KernelError(f"kernel {self.op}={self.name}: cannot load {self.target}: {e}") from e
            plan, problems = read_signature(self.op, fn, self.contract_version)
            if problems:
                raise _refused(self.op, self.name, self.contract_version, problems,
                               "" if callable(self.target) else f" ({self.target})")
            self._fn, self._plan = fn, plan
        return self._fn

    def _parameters(self) -> tuple[frozenset[str], bool]:
        """(keyword parameters: contract keywords, `platform`, options; accepts **kwargs)."""
        self.load()
        return self._plan.keyword_params, self._plan.var_keyword

    def takes(self, keyword: str) -> bool:
        """Whether the op may pass this contract keyword whatever its value (False: the
        implementation was written before it, and runs only while it holds its default)."""
        self.load()
        return self._plan.takes(keyword)

    def honouring_contract(self, fn: Callable) -> Callable:
        """`fn` called as the op's current contract calls it: the keywords added after the
        implementation's version, which it does not take, dropped while they hold their default;
        another value is a ContractError naming it, raised before the kernel is called."""
        self.load()
        omitted = self._plan.omitted
        if not omitted:
            return fn

        def call(*args, **kwargs):
            for keyword, default in omitted.items():
                value = kwargs.pop(keyword, default)
                if not holds_default(value, default):
                    raise unhonoured(self.op, self.name, keyword, value)
            return fn(*args, **kwargs)
        return call

    def check_options(self, options: dict) -> None:
        if kernel_tiles.TUNED in options:
            tuned = options[kernel_tiles.TUNED]
            options = {k: v for k, v in options.items() if k != kernel_tiles.TUNED}
            for key, entry in tuned["entries"].items():
                try:
                    self.check_options(entry["options"])
                except KernelError as e:
                    raise KernelError(f"{e} (kernel tiles {tuned['path']}, entry {key})") from None
        names, var_kw = self._parameters()
        reserved = {k.name for k in CONTRACTS[self.op].keywords} | {"platform"}
        bad = sorted(o for o in options if o in reserved or (o not in names and not var_kw))
        if bad:
            allowed = sorted(names - reserved)
            raise KernelError(f"kernel option(s) {', '.join(f'{self.op}.{self.name}.{o}' for o in bad)} "
                              f"not accepted by {self.op}={self.name}; its options: {', '.join(allowed) or 'none'}")

    def bind(self, platform: str, options: dict, generation: str | None = None) -> Callable:
        """The function with `platform` (when it takes it) and the options bound. A TPU kernel
        with a `vmem_capacity_bytes` option is told the VMEM of the TPU `generation` compiled for
        (when known and not given), which sizes its tiles. With a table of tuned tiles, each call
        (traced: its shapes are static) takes the entry of its shapes, under the options given
        explicitly. Called as the op's current contract calls it (`honouring_contract`)."""
        raw, extra = self.load(), dict(options)
        fn = self.honouring_contract(raw)
        tuned = extra.pop(kernel_tiles.TUNED, None)
        for key, value in target_keywords(raw, platform, generation).items():
            extra.setdefault(key, value)
        if tuned is None:
            return (lambda *args, **kwargs: fn(*args, **kwargs, **extra)) if extra else fn
        if tuned["platform"] != platform:
            raise KernelError(f"kernel tiles {tuned['path']} were tuned on {tuned['platform']} "
                              f"({tuned['device_kind']}); this program compiles for {platform}")

        def with_tuned_tiles(*args, **kwargs):
            key = kernel_tiles.call_key(self.op, args, kwargs)
            return fn(*args, **kwargs, **{**kernel_tiles.options_for(self.op, self.name, tuned, key), **extra})
        return with_tuned_tiles


def target_keywords(fn: Callable, platform: str, generation: str | None = None) -> dict:
    """What tells a kernel function the target it compiles for: `platform` (when it takes it),
    and on a TPU of a known `generation` its VMEM per core (`vmem_capacity_bytes`, when it takes
    that option: the fused MoE sizes its tiles by it)."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    out = {"platform": platform} if "platform" in params or var_kw else {}
    capacity = vmem_capacity_bytes(generation) if platform == "tpu" else None
    if capacity is not None and "vmem_capacity_bytes" in params:
        out["vmem_capacity_bytes"] = capacity
    return out


_TABLE: dict[str, dict[str, Implementation]] = {op: {} for op in OPS + GENERATION_OPS + QUANTIZED_OPS}


def register_implementation(op: str, name: str, fn: Callable | str, *, platforms=PLATFORMS, description: str = "",
                            backends=None, spmd: str = "shard_map", trains: bool = True,
                            contract_version: int | None = None):
    """Add (or replace) implementation `name` of `op`. `fn` meets the op's contract
    (`op_contracts.CONTRACTS[op]`), plus, optionally, a `platform` keyword and option keywords;
    a callable is checked now, a "module:attribute" target when first loaded (ContractError, one
    line). `contract_version`: the contract version it was written for (default: the current
    one); keywords added since are optional (see the module docstring). `platforms`: where it runs
    (`backends` is the older name of the same argument). `spmd`: how it runs under a mesh
    ("shard_map", or "gspmd" for plain-JAX functions). `trains=False`: no backward (generation only);
    the train step refuses it."""
    if backends is not None:
        platforms = backends
    if op not in _TABLE:
        raise KernelError(f"unknown op {op!r}; ops are: {', '.join(_TABLE)}")
    if name == "auto":
        raise KernelError("'auto' is reserved: it picks the best implementation for the platform")
    allowed = CONTRACTS[op].platforms
    unknown = [p for p in platforms if p not in allowed]
    if unknown:
        raise _refused(op, name, contract_version, [f"claims unknown platform(s) {', '.join(map(repr, unknown))} "
                                                    f"(platforms: {', '.join(allowed)})"])
    if spmd not in ("shard_map", "gspmd"):
        raise KernelError(f"{op}={name}: spmd must be 'shard_map' or 'gspmd', found {spmd!r}")
    impl = Implementation(op, name, fn, tuple(platforms), description, spmd, trains, contract_version)
    if callable(fn):
        impl.load()                 # a user's function is held to the contract now
    _TABLE[op][name] = impl


def _refused(op: str, name: str, version, problems: list[str], target: str = "") -> ContractError:
    current = CONTRACTS[op].version
    shown = version if isinstance(version, int) and 1 <= version <= current else current
    return ContractError(f"{op}={name}{target} does not meet the {op} contract v{shown}: {'; '.join(problems)}",
                         op, name)


_GIVEN = object()       # a keyword given a value other than its default (segment ids, for check_segments)


def unhonoured(op: str, name: str, keyword: str, value=_GIVEN) -> ContractError:
    """The refusal of implementation `name`, written before `keyword` existed, for a call whose
    `keyword` does not hold the default that reproduces its version."""
    impl, k = _TABLE[op][name], CONTRACTS[op].keyword(keyword)
    given = f"{keyword}={value!r}" if isinstance(value, numbers.Number) else f"{keyword} given"
    others = []
    for other, candidate in _TABLE[op].items():
        if impl.trains and not candidate.trains:
            continue                # a training call is offered what trains (not moe=decode)
        try:
            if candidate.takes(keyword):
                others.append(other)
        except KernelError:
            pass                    # one that cannot load is not offered
    return ContractError(f"{op}={name} cannot run {k.needed_by}: it was written for {op} contract "
                         f"v{impl._plan.version}, before {keyword} (v{k.since}), so the op calls it only while "
                         f"{keyword}={k.default!r} (here: {given}); choose one of: {', '.join(others) or 'none'}",
                         op, name, keyword)


def unregister_implementation(op: str, name: str) -> None:
    """Remove implementation `name` of `op` (for tests and the parity self-test's planted kernels)."""
    if op not in _TABLE or name not in _TABLE[op]:
        raise KernelError(f"no implementation {op}={name} to unregister")
    del _TABLE[op][name]


def implementations(op: str) -> dict[str, Implementation]:
    return dict(_TABLE[op])


# ---- the built-in table -----------------------------------------------------------------------
_K = "pallas_kernels"
register_implementation("attention", "xla", f"{_K}.attention:attention_xla", spmd="gspmd",
                        description="plain JAX, the reference over query chunks of at most 256 MiB of float32 "
                                    "scores (each formed again in the backward)")
register_implementation("attention", "pallas", f"{_K}.attention:attention_pallas",
                        description="flash attention (Mosaic TPU / Triton GPU; interpreted on CPU)")
register_implementation("attention", "splash", f"{_K}.attention:attention_splash", platforms=("cpu", "tpu"),
                        description="jax-shipped splash attention (TPU; interpreted on CPU)")
register_implementation("cross_entropy", "xla", f"{_K}.cross_entropy:linear_cross_entropy_xla", spmd="gspmd",
                        description="plain JAX, the reference over token chunks of at most 1 GiB of float32 logits "
                                    "(each formed again in the backward)")
register_implementation("cross_entropy", "pallas", f"{_K}.cross_entropy:linear_cross_entropy_pallas",
                        description="vocab-tiled online log-sum-exp (Mosaic TPU / Triton GPU; interpreted on CPU)")
register_implementation("moe", "xla", f"{_K}.moe:moe_experts_xla", spmd="gspmd",
                        description="plain JAX tiled grouped GEMM")
register_implementation("moe", "loop", f"{_K}.moe_loop:moe_experts_loop", spmd="gspmd",
                        description="plain JAX, expert by expert 2-D GEMMs over row tiles (CPU default)")
register_implementation("moe", "ragged_dot", f"{_K}.moe:moe_experts_reference", spmd="gspmd",
                        description="jax.lax.ragged_dot (the reference)")
register_implementation("moe", "megablox", f"{_K}.moe:moe_experts_megablox", platforms=("cpu", "tpu"),
                        description="jax-shipped megablox gmm (TPU; interpreted on CPU)")
register_implementation("moe", "pallas", f"{_K}.moe:moe_experts_pallas", platforms=("cpu", "tpu"),
                        description="fused grouped expert MLP: up + clamped SwiGLU + down in VMEM (Mosaic TPU; interpreted on CPU)")
register_implementation("moe", "decode", f"{_K}.moe_decode:moe_experts_decode", trains=False,
                        description="generation's few rows: reads only the experts in use (CPU default for generation)")
register_implementation("cached_attention", "xla", f"{_K}.decode_attention:cached_attention_reference",
                        spmd="gspmd", description="plain JAX over the cache slots, masked by token position "
                                                  "(the reference; widens the cache to float32)")
register_implementation("cached_attention", "pallas", f"{_K}.decode_attention:cached_attention_pallas",
                        platforms=("cpu", "tpu"), trains=False,
                        description="the cache read block by block in its own dtype, only the blocks of visible "
                                    "slots (Mosaic TPU; interpreted on CPU)")
register_implementation("moe_mxfp4", "xla", f"{_K}.moe_mxfp4:moe_mxfp4_xla", spmd="gspmd",
                        description="decode the MXFP4 stacks per call, then the plain JAX tiled grouped GEMM")
register_implementation("moe_mxfp4", "ragged_dot", f"{_K}.moe_mxfp4:moe_mxfp4_reference", spmd="gspmd",
                        description="decode the MXFP4 stacks per call, then jax.lax.ragged_dot (the reference)")
register_implementation("moe_mxfp4", "loop", f"{_K}.moe_mxfp4_loop:moe_mxfp4_loop", spmd="gspmd",
                        description="expert by expert, each decoded as its rows come, forward and backward "
                                    "(CPU default)")
register_implementation("moe_mxfp4", "decode", f"{_K}.moe_decode:moe_mxfp4_decode", trains=False,
                        description="generation's few rows: decodes only the experts in use, one at a time "
                                    "(CPU default for generation)")
register_implementation("moe_mxfp4", "pallas", f"{_K}.moe_mxfp4:moe_mxfp4_pallas", platforms=("cpu", "tpu"),
                        description="fused expert MLP decoding MXFP4 tiles in VMEM: 4.25 bits per weight from HBM "
                                    "(Mosaic TPU; interpreted on CPU)")


# ---- selection --------------------------------------------------------------------------------
def parse_kernel_spec(spec: str | dict | None, ops: tuple[str, ...] = OPS) -> dict[str, str]:
    """'attention=pallas,moe=xla' (or a dict, or 'auto', or a single name for every op) ->
    {op: implementation name}; ops not named get 'auto'."""
    choice = {op: "auto" for op in ops}
    if spec is None or spec == "":
        return choice
    if isinstance(spec, str):
        if "=" not in spec:
            return {op: spec.strip() for op in ops}
        items = {}
        for part in spec.split(","):
            if "=" not in part:
                raise KernelError(f"--kernels: expected op=name, found {part!r}")
            op, name = (s.strip() for s in part.split("=", 1))
            items[op] = name
        spec = items
    for op, name in spec.items():
        if op not in _TABLE:
            raise KernelError(f"--kernels: unknown op {op!r}; ops are: {', '.join(_TABLE)}")
        choice[op] = name
    return choice


def _option_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_kernel_options(spec: str | dict | None) -> dict[str, dict[str, dict[str, Any]]]:
    """'attention.pallas.block_q=256,moe.pallas.block_m=128' (or the nested dict
    {op: {implementation: {option: value}}}) -> that nested dict. Values are ints, floats,
    booleans or strings. A part 'FILE.json' reads a table of tuned tiles (kernel_tiles.py): its
    entries go under each implementation's kernel_tiles.TUNED key; the part 'tiles=off' (no
    committed table) is kept under kernel_tiles.SWITCH. Which options an
    implementation takes is checked by `check_options`."""
    if spec is None or spec == "" or spec == {}:
        return {}
    if isinstance(spec, str):
        nested: dict = {}
        for part in spec.split(","):
            if part.strip() == f"{kernel_tiles.SWITCH}={kernel_tiles.OFF}":   # no committed table
                nested[kernel_tiles.SWITCH] = {"committed": False}
                continue
            if "=" not in part and part.strip().endswith(".json"):   # a table of tuned tiles
                path = part.strip()
                try:
                    table = kernel_tiles.read(path)
                except kernel_tiles.TileTableError as e:
                    raise KernelError(f"--kernel-options: {e}") from None
                for op, per_impl in kernel_tiles.tuned_options(table, path).items():
                    for name, opts in per_impl.items():
                        nested.setdefault(op, {}).setdefault(name, {}).update(opts)
                continue
            key, sep, value = part.partition("=")
            path = key.strip().split(".")
            if not sep or len(path) != 3 or not all(path):
                raise KernelError(f"--kernel-options: expected op.implementation.option=value, found {part!r}")
            nested.setdefault(path[0], {}).setdefault(path[1], {})[path[2]] = _option_value(value)
        spec = nested
    out = {}
    for op, per_impl in spec.items():
        if op == kernel_tiles.SWITCH:
            out[op] = dict(per_impl)
            continue
        if op not in _TABLE:
            raise KernelError(f"--kernel-options: unknown op {op!r}; ops are: {', '.join(_TABLE)}")
        if not isinstance(per_impl, dict) or not all(isinstance(v, dict) for v in per_impl.values()):
            raise KernelError(f"--kernel-options: {op} must map implementation names to option dicts, "
                              f"found {per_impl!r}")
        out[op] = {name: dict(opts) for name, opts in per_impl.items()}
    return out


def check_options(options: dict) -> None:
    """Every named implementation exists and accepts its options (loud, before any tracing)."""
    for op, per_impl in parse_kernel_options(options).items():
        for name, opts in per_impl.items() if op != kernel_tiles.SWITCH else ():
            if name not in _TABLE[op]:
                raise KernelError(f"--kernel-options: unknown implementation {op}={name}; "
                                  f"registered: {', '.join(_TABLE[op])}")
            _TABLE[op][name].check_options(opts)


def check_trainable(resolved: dict[str, str]) -> None:
    """The train step differentiates every op: refuse a generation-only implementation by name."""
    for op, name in resolved.items():
        if not _TABLE[op][name].trains:
            others = ", ".join(n for n, impl in _TABLE[op].items() if impl.trains)
            raise KernelError(f"{op}={name} is for generation only (it has no backward); for training choose "
                              f"one of: {others}")


def check_segments(resolved: dict[str, str]) -> None:
    """A segment-masked run (packed conversations, document masking), checked before tracing:
    the attention implementation must take segment ids; one written before them is refused by
    name (the refusal its first traced call would give)."""
    name = resolved["attention"]
    if not _TABLE["attention"][name].takes("segment_ids"):
        raise unhonoured("attention", name, "segment_ids")


def model_ops(model, ops: tuple[str, ...] = OPS) -> tuple[str, ...]:
    """`ops` and the ops this torch model's weights add (QUANTIZED_OPS for an MXFP4 expert base):
    what a program tracing the model resolves."""
    from torch_model.model import has_mxfp4_experts

    return ops + (QUANTIZED_OPS if has_mxfp4_experts(model) else ())


def runs_on(op: str, name: str, platform: str) -> bool:
    return platform in _TABLE[op][name].platforms


def resolve(spec: str | dict | None, platform: str | None = None, ops: tuple[str, ...] = OPS) -> dict[str, str]:
    """Turn a kernel spec into concrete names that exist and can run on `platform` (default:
    this host's), for `ops` (generation passes OPS + GENERATION_OPS)."""
    platform = check_platform(platform or host_platform(), "kernel registry")
    resolved = {}
    for op, name in parse_kernel_spec(spec, ops).items():
        table = _TABLE[op]
        if name == "auto":
            preference = AUTO_PREFERENCE_BY_OP.get((op, platform), AUTO_PREFERENCE[platform])
            name = next((n for n in preference if n in table and runs_on(op, n, platform)), None)
            if name is None:
                raise KernelError(f"no implementation of {op} for platform {platform}")
        if name not in table:
            raise KernelError(f"unknown implementation {op}={name}; registered: {', '.join(table)}")
        if not runs_on(op, name, platform):
            raise KernelError(f"{op}={name} cannot run on platform {platform!r} "
                              f"(it runs on: {', '.join(table[name].platforms)})")
        table[name].load()
        resolved[op] = name
    return resolved


def describe(resolved: dict[str, str], platform: str | None = None, unrouted=()) -> str:
    """`op=name, ... on platform`; an op in `unrouted` (one the model never calls: a module's own
    experts, `ModuleSpec.unrouted_ops`) is marked so, its implementation running nothing."""
    platform = platform or host_platform()
    mode = " (Pallas interpreted on CPU)" if platform == "cpu" and any(
        n in ("pallas", "splash", "megablox") for op, n in resolved.items() if op not in unrouted) else ""
    return ", ".join(f"{op}={name}" + (" (not called)" if op in unrouted else "")
                     for op, name in resolved.items()) + f" on {platform}{mode}"


# ---- routing the torch ops --------------------------------------------------------------------
def _adapters(resolved: dict[str, str], platform: str, options: dict, mesh=None, generation: str | None = None):
    """JAX callables with the torch ops' positional schemas, calling the chosen implementations
    (per device or under GSPMD when a mesh is given) for `platform` (a TPU's `generation`)."""
    from jax_bridge import moe_dispatch, sharded_ops

    options = parse_kernel_options(options)
    impl = {op: _TABLE[op][name] for op, name in resolved.items()}
    fns = {op: impl[op].bind(platform, options.get(op, {}).get(name, {}), generation)
           for op, name in resolved.items()}
    attn, ce, moe = fns["attention"], fns["cross_entropy"], fns["moe"]
    if mesh is not None:
        attn = sharded_ops.attention(attn, mesh, impl["attention"].spmd)
        ce = sharded_ops.cross_entropy(ce, mesh, impl["cross_entropy"].spmd)

    def grouped(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha, limit, up_shift):
        return moe(x, group_sizes.astype("int32"), gate_up, gate_up_bias, down, down_bias, alpha=alpha, limit=limit,
                   up_shift=up_shift)

    routed_experts = moe_dispatch.routed_experts(grouped, mesh=mesh)

    def attention(q, k, v, sinks, sliding_window, scale, segment_ids=None):
        if segment_ids is None:
            return attn(q, k, v, sinks, sliding_window=int(sliding_window), scale=float(scale))
        return attn(q, k, v, sinks, sliding_window=int(sliding_window), scale=float(scale),
                    segment_ids=segment_ids.astype("int32"))

    def cross_entropy(hidden, weight, labels, ignore_index):
        return ce(hidden, weight, labels, ignore_index=int(ignore_index))

    def moe_experts(x, experts, weights, gate_up, gate_up_bias, down, down_bias, alpha, limit, up_shift=1.0):
        return routed_experts(x, experts.astype("int32"), weights, gate_up, gate_up_bias, down, down_bias,
                              alpha=float(alpha), limit=float(limit), up_shift=float(up_shift))

    routed_mxfp4 = moe_dispatch.routed_experts(fns["moe_mxfp4"], mesh=mesh, mxfp4=True) if "moe_mxfp4" in fns else None

    def moe_experts_mxfp4(x, experts, weights, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                          down_bias, alpha, limit, up_shift=1.0):
        return routed_mxfp4(x, experts.astype("int32"), weights, gate_up_blocks, gate_up_scales, gate_up_bias,
                            down_blocks, down_scales, down_bias, alpha=float(alpha), limit=float(limit),
                            up_shift=float(up_shift))

    cached = fns.get("cached_attention")
    if cached is not None and mesh is not None:
        cached = sharded_ops.cached_attention(cached, mesh, impl["cached_attention"].spmd)

    def cached_attention(q, k, v, sinks, q_positions, k_positions, sliding_window, scale):
        return cached(q, k, v, sinks, q_positions.astype("int32"), k_positions.astype("int32"),
                      sliding_window=int(sliding_window), scale=float(scale))

    adapters = {"attention": attention, "cross_entropy": cross_entropy, "moe": moe_experts,
                "moe_mxfp4": moe_experts_mxfp4, "cached_attention": cached_attention}
    return {op: adapters[op] for op in resolved}


@contextlib.contextmanager
def routed(env, resolved: dict[str, str], *, platform: str, options: dict | None = None, mesh=None,
           generation: str | None = None):
    """Within this block (used at trace time), the torchax env runs the chosen implementations,
    compiled for `platform` (a TPU: of `generation`, 'v5e', 'v6e', ..., when known) with their
    `options` (sharded over `mesh` if given), for the model's custom ops; the env's previous
    table is restored afterwards."""
    import torchax.interop as interop

    from torch_model.ops import OPS as TORCH_OPS

    adapters = _adapters(resolved, check_platform(platform, "kernel registry"), options or {}, mesh, generation)
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
