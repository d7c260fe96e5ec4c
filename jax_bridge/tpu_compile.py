"""Compiling for TPU on a host without one: libtpu's deviceless topologies run the real TPU
compiler (XLA:TPU and Mosaic) for compile-only devices, as MaxText's train_compile does.

    quiet_libtpu()                        no libtpu start-up errors on hosts without TPU chips
    topology_devices("v5e:2x2")           the compile-only devices of a slice (cached; one chip: "v5e:1x1")
    hbm_bytes(device)                     HBM the compiler lets one device use (asked once)
    lower_for / compile_for(fn, specs, device)  the program for one device; CompileStats (bytes,
                                          seconds, Mosaic kernels and their scoped VMEM limits)
    scoped_vmem_peak(make_fn, specs, device)  the largest Mosaic kernel's VMEM, by the compiler

Inputs and outputs are compiled with layouts left to the compiler (`Layout.AUTO`): a kernel
measured alone then sees its operands in the layout an upstream op inside a train step would
hand it, not the default HBM layout of a standalone argument (on TPU a [N, 2880] bf16 argument
defaults to column-major, which would add a transposing copy that a real step does not make).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import time

import jax

# Per-chip HBM by generation (GiB), from Google's published figures; the compiler's own limit
# per device is what `hbm_bytes` reports (slightly less: runtime reservations; on v4 the
# compile-only devices are single TensorCores, each with half the chip's 32 GiB).
CHIP_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e",
                "TPU v6e": "v6e"}
TOPOLOGY_EXAMPLES = ("v5e:1x1", "v6e:1x1", "v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2", "v5e:4x4")
# libtpu lays a slice out on hosts of 2x2x1 chips unless told otherwise, and refuses a slice those
# do not divide ("not divisible by the given (or default) chips_per_host_bounds 2x2x1"): a single
# chip (v5e:1x1, v6e:1x1: v5litepod-1, v6e-1) is one host holding fewer chips.
DEFAULT_CHIPS_PER_HOST = (2, 2, 1)
_GOOGLE_PCI_VENDOR = "0x1ae0"


class TopologyError(ValueError):
    """A topology name libtpu does not know, or libtpu missing."""


def _has_tpu_chips() -> bool:
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if open(vendor).read().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def quiet_libtpu() -> None:
    """On a host without TPU chips, give libtpu the two settings whose absence makes it log
    errors at start-up ("could not determine TPU accelerator type / worker hostnames"); it
    then starts silently, compiles the same programs, and JAX still runs on CPU. Also let
    several processes load libtpu at once: by default the first one holds /tmp/libtpu_lockfile
    and the others fail ("Internal error when accessing libtpu multi-process lockfile"), which
    protects a real chip; compile-only use has none to protect. Values already set, and hosts
    with TPU chips, are left alone. Must run before JAX initializes its backends (jax_bridge's
    package import does it)."""
    if _has_tpu_chips():
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def generation(device) -> str:
    """'v5e', 'v6e', ... of a TPU device."""
    try:
        return DEVICE_KINDS[device.device_kind]
    except KeyError:
        raise TopologyError(f"unknown TPU device kind {device.device_kind!r}") from None


def host_bounds(name: str) -> dict:
    """get_topology_desc's host keywords for topology `name`: none where the default hosts
    (DEFAULT_CHIPS_PER_HOST) divide the slice; for a smaller slice (one chip: 'v5e:1x1') hosts
    of its own size, `chips_per_host_bounds` its dimensions capped at the default's. A name
    that does not parse gets none (libtpu names the problem)."""
    try:
        dims = [int(d) for d in name.split(":", 1)[1].split("x")]
    except (IndexError, ValueError):
        return {}
    dims = (dims + [1] * 3)[:3]
    if any(d < 1 for d in dims) or all(d % b == 0 for d, b in zip(dims, DEFAULT_CHIPS_PER_HOST)):
        return {}
    return {"chips_per_host_bounds": tuple(min(d, b) for d, b in zip(dims, DEFAULT_CHIPS_PER_HOST))}


@functools.lru_cache(maxsize=None)
def topology_devices(name: str) -> tuple:
    """Compile-only TPU devices of topology `name` (e.g. 'v5e:1x1', 'v5e:2x2', 'v4:2x2x1'); nothing runs."""
    from jax.experimental import topologies

    quiet_libtpu()
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise TopologyError("compiling for TPU needs libtpu (pinned in requirements.lock; `make install` "
                            "installs it)") from None
    try:
        return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name, **host_bounds(name)).devices)
    except Exception as e:  # noqa: BLE001 - libtpu's errors name the problem; keep one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TopologyError(f"unknown TPU topology {name!r} ({first}); examples: "
                            f"{', '.join(TOPOLOGY_EXAMPLES)}") from None


def device_of(topology: str, index: int = 0):
    return topology_devices(topology)[index]


@functools.lru_cache(maxsize=None)
def hbm_bytes(device) -> int:
    """The HBM one device may use, as the TPU compiler states it: a program needing more than
    any chip has is compiled and the limit read from its refusal."""
    from jax.sharding import SingleDeviceSharding

    huge = jax.ShapeDtypeStruct((1 << 17, 1 << 20), jax.numpy.float32, sharding=SingleDeviceSharding(device))
    try:
        jax.jit(lambda a: jax.numpy.sin(a)[::-1] * 2).lower(huge).compile()
    except Exception as e:  # noqa: BLE001
        found = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(e))
        if found:
            return int(float(found.group(1)) * (1 << 30))
        raise
    raise AssertionError("a 512 GiB program compiled: cannot read the HBM limit")


@dataclasses.dataclass
class Kernel:
    """One Mosaic kernel (tpu_custom_call) of a compiled program."""
    name: str
    scoped_vmem_limit: int | None   # bytes requested (vmem_limit_bytes); None: the compiler's default


@dataclasses.dataclass
class CompileStats:
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int
    code_bytes: int
    seconds: float
    kernels: list[Kernel]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_KERNEL = re.compile(r'^\s*(?:ROOT )?%([\w.-]+?)(?:\.\d+)? = .*custom_call_target="tpu_custom_call"')
_SCOPED = re.compile(r'"scoped_memory_configs":\[\{[^\]]*?"size":"?(\d+)')


def mosaic_kernels(hlo_text: str) -> list[Kernel]:
    out = []
    for line in hlo_text.splitlines():
        found = _KERNEL.search(line)
        if found:
            scoped = _SCOPED.search(line)
            out.append(Kernel(found.group(1), int(scoped.group(1)) if scoped else None))
    return out


def _auto(device, tree):
    """The same pytree of shardings on `device` whose layouts the compiler chooses."""
    from jax.experimental.layout import Format, Layout
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda _: Format(Layout.AUTO, sharding), tree)


def lower_for(fn, args, device, *, donate_argnums=()):
    """jax.jit(fn).lower for pytrees of ShapeDtypeStructs on one compile-only TPU device, with
    input and output layouts left to the compiler."""
    args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), tuple(args))
    outs = jax.eval_shape(fn, *args)
    return jax.jit(fn, in_shardings=_auto(device, args), out_shardings=_auto(device, outs),
                   donate_argnums=donate_argnums).lower(*args)


def compile_for(fn, specs, device, *, donate_argnums=()):
    """Compile `fn` for `specs` (pytrees of ShapeDtypeStructs) on one compile-only TPU device.
    Returns (compiled, CompileStats). Nothing runs."""
    start = time.perf_counter()
    compiled = lower_for(fn, specs, device, donate_argnums=donate_argnums).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    stats = CompileStats(argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
                         temp_bytes=int(mem.temp_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
                         peak_bytes=int(getattr(mem, "peak_memory_in_bytes", 0) or 0),
                         code_bytes=int(mem.generated_code_size_in_bytes), seconds=round(seconds, 2),
                         kernels=mosaic_kernels(compiled.as_text()))
    return compiled, stats


_VMEM_OOM = re.compile(r"Scoped allocation with size ([\d.]+)([KMG]) and limit ([\d.]+)([KMG])")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _vmem_refusal(error: Exception):
    """(size, limit) in bytes from a scoped-VMEM refusal, or None."""
    found = _VMEM_OOM.search(str(error))
    if not found:
        return None
    size, unit, limit, limit_unit = found.groups()
    return int(float(size) * _UNITS[unit]), int(float(limit) * _UNITS[limit_unit])


def scoped_vmem_peak(make_fn, specs, device, *, start: int = 1 << 20, cap: int = 128 << 20,
                     resolution: int = 1 << 20) -> int:
    """The smallest scoped VMEM limit with which every Mosaic kernel of `make_fn(limit)`'s
    program compiles, by the TPU compiler: i.e. what its largest kernel needs.
    `make_fn(vmem_limit_bytes)` builds the program with every kernel's limit set to that value.
    A refusal that states our limit ("Scoped allocation with size S and limit L") names one
    kernel's need S (to 0.01 MiB), and the limit jumps to it; otherwise the limit doubles and
    the answer is bisected to `resolution`. A few compiles per program."""
    def compiles(limit):
        try:
            compile_for(make_fn(limit), specs, device)
            return True, None
        except Exception as e:  # noqa: BLE001
            refusal = _vmem_refusal(e)
            if refusal is None:
                raise
            size, stated = refusal
            exact = abs(stated - limit) <= (1 << 14)   # the refusal is about the limit we set
            return False, size if exact and size > limit else None

    low, limit = 0, start
    while True:
        ok, size = compiles(limit)
        if ok:
            break
        low = limit
        limit = size + (1 << 14) if size else 2 * limit   # + the 0.01 MiB rounding of the report
        if limit > cap:
            raise RuntimeError(f"a kernel needs more than {cap >> 20} MiB of scoped VMEM")
    high = limit
    while high - low > resolution:
        mid = (low + high) // 2
        ok, size = compiles(mid)
        if ok:
            high = mid
        else:
            low = max(mid, (size or 0))
    return high
