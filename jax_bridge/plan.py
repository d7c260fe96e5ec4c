"""Will a preset fit a TPU slice? Compile the real train step for it without weights and read the
TPU compiler's per-chip memory figures.

A torch model built on the `meta` device (no weights) is lowered through torchax as usual and the
one-jit train step is compiled, with abstract state (`jax.ShapeDtypeStruct`), by the TPU compiler
for one compile-only device of the topology (jax_bridge/tpu_compile.py). Nothing is allocated or
run, so a 20B model plans on a laptop.

Single chip, replicated: every chip holds the whole train state and runs `batch_size / chips`
rows (data parallelism), so the figures are one chip's. The gradient all-reduce of a real
data-parallel run is not part of the compiled program. The scale-out work extends `plan()` with
a mesh and shardings.
"""
from __future__ import annotations

import dataclasses
import re
import time

from jax_bridge import tpu_compile

_OOM = re.compile(r"total memory required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)G\)")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclasses.dataclass
class Plan:
    preset: str
    topology: str
    device_kind: str
    generation: str
    chips: int
    n_layers: int
    params: int
    seq_len: int
    batch_size: int              # global rows per micro-step
    rows_per_chip: int
    micro_batches: int
    kernels: dict
    compute_dtype: str
    matmul_precision: str
    hbm_bytes: int               # what the compiler lets one device use
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    temp_bytes: int | None = None
    total_bytes: int | None = None   # arguments + outputs - aliased (donated) + temporaries
    fits: bool | None = None
    lower_s: float | None = None
    compile_s: float | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan(preset: str, topology: str, *, seq_len: int | None = None, batch_size: int = 8, micro_batches: int = 1,
         kernels: str | dict | None = "auto", kernel_options: str | dict | None = None,
         compute_dtype: str | None = None, matmul_precision: str | None = None,
         model_overrides: dict | None = None, optimizer=None) -> Plan:
    """Compile `preset`'s train step for one chip of TPU `topology` and report its memory.
    model_overrides: ModelConfig fields (e.g. {"n_layers": 2}); seq_len defaults to the
    preset's. A program that does not fit is reported (fits=False, temp_bytes from the
    compiler's refusal), not raised."""
    import jax
    import jax.numpy as jnp
    import torch

    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    from torch_model.optim import OptimizerConfig

    devices = tpu_compile.topology_devices(topology)
    device = devices[0]
    chips = len(devices)
    if batch_size % chips:
        raise ValueError(f"batch_size {batch_size} must be a multiple of the {chips} chips of {topology} "
                         "(each chip runs batch_size / chips rows)")
    cfg = get_preset(preset)
    seq_len = seq_len or cfg.max_seq_len
    cfg = cfg.replace(**{"max_seq_len": seq_len, **(model_overrides or {})})
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    step_cfg = StepConfig(kernels=kernels, compute_dtype=compute_dtype, micro_batches=micro_batches,
                          matmul_precision=matmul_precision, platform="tpu", kernel_options=kernel_options)
    step = TrainStep(model, optimizer or OptimizerConfig(), step_cfg)
    rows = batch_size // chips
    state = step.abstract_state()
    tokens = jax.ShapeDtypeStruct((micro_batches, rows, seq_len + 1), jnp.int32)
    lr_scale = jax.ShapeDtypeStruct((), jnp.float32)
    result = Plan(preset=preset, topology=topology, device_kind=device.device_kind,
                  generation=tpu_compile.generation(device), chips=chips, n_layers=cfg.n_layers,
                  params=cfg.param_counts()["total"], seq_len=seq_len, batch_size=batch_size, rows_per_chip=rows,
                  micro_batches=micro_batches, kernels=dict(step.kernels), compute_dtype=step_cfg.compute_dtype,
                  matmul_precision=step_cfg.matmul_precision, hbm_bytes=tpu_compile.hbm_bytes(device))
    start = time.perf_counter()
    lowered = tpu_compile.lower_for(step._step, (state, tokens, lr_scale), device, donate_argnums=(0,))
    result.lower_s = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - an out-of-memory refusal is a result, anything else is raised
        found = _OOM.search(str(e))
        if not found:
            raise
        result.compile_s = round(time.perf_counter() - start, 2)
        result.temp_bytes = int(float(found.group(1)) * _UNITS[found.group(2)])
        result.fits, result.error = False, str(e).strip().splitlines()[0][:400]
        return result
    result.compile_s = round(time.perf_counter() - start, 2)
    mem = compiled.memory_analysis()
    result.argument_bytes, result.output_bytes = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
    result.alias_bytes, result.temp_bytes = int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes)
    result.total_bytes = result.argument_bytes + result.output_bytes - result.alias_bytes + result.temp_bytes
    result.fits = result.total_bytes <= result.hbm_bytes
    return result


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f} GiB"


def format_plan(p: Plan) -> str:
    kernels = ", ".join(f"{op}={name}" for op, name in p.kernels.items())
    lines = [f"plan: {p.preset} ({p.n_layers} layers, {p.params / 1e9:.2f}B parameters) on {p.topology}: "
             f"{p.chips} x {p.device_kind}",
             f"  step: seq {p.seq_len}, global batch {p.batch_size} = {p.rows_per_chip} rows per chip x {p.chips} "
             f"(replicated state), {p.micro_batches} micro-batch(es); {p.compute_dtype} compute, "
             f"matmul precision {p.matmul_precision}; kernels {kernels}",
             f"  per chip: arguments {gib(p.argument_bytes)}, outputs {gib(p.output_bytes)} "
             f"({gib(p.alias_bytes)} donated from the arguments), temporaries {gib(p.temp_bytes)}",
             f"  total {gib(p.total_bytes)} of {gib(p.hbm_bytes)} HBM per chip (the compiler's limit; "
             f"{tpu_compile.CHIP_HBM_GIB.get(p.generation, '?')} GiB chip): "
             + ("fits" if p.fits else "DOES NOT FIT"),
             f"  lower {p.lower_s} s, compile {p.compile_s} s (TPU compiler, on this host)"]
    if p.error:
        lines.append(f"  compiler: {p.error}")
    return "\n".join(lines)
