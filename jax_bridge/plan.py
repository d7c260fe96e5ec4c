"""Will a preset fit a TPU slice? Compile the real train step for it without weights and read the
TPU compiler's per-chip memory figures.

A torch model built on the `meta` device (no weights) is lowered through torchax as usual and the
one-jit train step (`TrainStep._step`, the trainer's) is compiled, with abstract state
(`jax.ShapeDtypeStruct`), by the TPU compiler for the compile-only devices of the topology
(jax_bridge/tpu_compile.py). Nothing is allocated or run, so a 20B model plans on a laptop.

Two forms:
- a mesh over every chip of the slice (`mesh=""`: all on `fsdp`, the trainer's default; or
  "data=2,fsdp=4", ...): the state carries the shardings of `sharding.py`, the tokens are split
  over the batch axes, and the compiler partitions the step (SPMD) into one program per chip,
  collectives included; its memory figures are one chip's;
- one chip, replicated (`mesh=None`): every chip holds the whole train state and runs
  `batch_size / chips` rows; the gradient all-reduce is not part of the compiled program.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import NamedTuple

from jax_bridge import tpu_compile

_OOM = re.compile(r"total memory required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)G\)")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
ONE_CHIP = "none"          # the CLI's --mesh value for the one-chip, replicated form


@dataclasses.dataclass
class Plan:
    preset: str
    topology: str
    device_kind: str
    generation: str
    chips: int
    mesh: str                    # e.g. "fsdp=8", or "none" (one chip, replicated state)
    n_layers: int
    params: int
    seq_len: int
    batch_size: int              # global rows per micro-step
    rows_per_chip: int
    micro_batches: int
    scan_layers: bool
    remat: str
    kernels: dict
    compute_dtype: str
    matmul_precision: str
    hbm_bytes: int               # what the compiler lets one device use
    ns_dtype: str = "float32"    # Muon's Newton-Schulz
    optimizer: str = "muon"      # muon: Muon + AdamW by role; adamw: AdamW for every parameter
    moe_routing: str = "even"    # the routing the fused MoE kernels' cost estimates assume (roofline only)
    # Per chip, from the state's shapes and shardings (not the compiler): the shards one chip holds.
    param_bytes: int = 0         # float32 master weights
    optimizer_bytes: int = 0     # Muon momentum, AdamW moments, step counts
    grad_bytes: int = 0          # one gradient per parameter shard, in the parameters' dtype (the step
                                 # reduces gradients into the parameters' sharding); inside temporaries
    compute_copy_bytes: int = 0  # the masters' copy in the compute dtype the step carries (TrainStep.compute_copy)
    # Per chip, by the TPU compiler.
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    temp_bytes: int | None = None
    total_bytes: int | None = None   # arguments + outputs - aliased (donated) + temporaries
    fits: bool | None = None
    lower_s: float | None = None
    compile_s: float | None = None   # wall clock
    compile_cpu_s: float | None = None   # this process's CPU time while compiling (the host is shared)
    error: str | None = None
    roofline: object | None = None   # jax_bridge.roofline.Roofline, when asked for
    packed: bool = False             # the SFT step: packed rows with segment ids and loss weights
    rl: str = ""                     # the GRPO update step (PolicyGradientConfig as text), "" otherwise
    # LoRA (--lora): only the adapters train; the frozen base is an argument in the compute dtype.
    lora: str = ""                   # the spec, "" for a full fine-tune
    trainable_params: int = 0        # parameters with gradients and optimizer state
    frozen_bytes: int = 0            # per chip: the frozen base's shards (compute dtype, routers float32)
    base_dtype: str = "compute"      # "mxfp4": the frozen experts held as released (bytes and scales)
    expert_delta_bytes: int = 0      # per chip: one layer's W + scaling * B A of its expert stacks, which
                                     # peft's expert LoRA forms in every forward (inside temporaries)
    rollout: dict | None = None      # with rl and a RolloutShape: RolloutPlan as a dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RolloutShape(NamedTuple):
    """What one RL rollout decodes: `completions` rows together (prompts per step x group size
    G: each prompt prefilled once, its cache copied G times), prompts of at most `prompt_tokens`,
    at most `new_tokens` each, sampled at temperature T with `top_k` / `top_p` (the sampled
    tokens' log-probabilities and entropies kept, as `rl` asks)."""
    completions: int
    prompt_tokens: int
    new_tokens: int
    group_size: int = 8
    top_k: int = 0
    top_p: float = 1.0


@dataclasses.dataclass
class ProgramMemory:
    """One compiled program's per-chip bytes, by the TPU compiler (or its refusal)."""
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0              # refused: the temporaries the compiler asked for
    total_bytes: int = 0             # arguments + outputs - aliased + temporaries
    compile_s: float = 0.0           # wall clock
    compile_cpu_s: float = 0.0       # this process's CPU time while compiling (the host is shared)
    error: str | None = None         # the compiler's out-of-memory refusal


@dataclasses.dataclass
class RolloutPlan:
    """The rollout's prefill and decode-loop programs (jax_bridge.decoding.Decoder, as `rl` runs
    them) beside the update step, per chip. The decoder's parameters are the policy's in the
    compute dtype: the buffers the train state already holds where the dtype is the same (a
    LoRA base, float32 routers), its own copies otherwise (`own_bytes`: every cast trainable)."""
    completions: int
    prompt_tokens: int
    new_tokens: int
    group_size: int
    prompt_rows: int                 # rows the prefill computes (bucketed; global under a mesh)
    batch: int                       # rows decoded: prompt_rows x group_size
    prompt_len: int                  # the prompt bucket
    length: int                      # prompt bucket + new tokens, bucketed: the KV cache's positions
    kernels: dict
    param_bytes: int                 # the decoder's parameters
    own_bytes: int                   # of which its own copies (the rest shared with the train state)
    reference_bytes: int             # the KL reference's copy (full fine-tuning with beta > 0), else 0
    cache_bytes: int                 # the KV cache (bf16 keys and values, sliding layers a ring)
    prefill: ProgramMemory
    decode: ProgramMemory
    gathered_per_call: int = 0       # decode loop: all-gathers outside the loop, once per call
    gathered_per_token: int = 0      # inside it: every generated token
    other_per_token: int = 0         # its other collectives per token
    update_peak_bytes: int = 0       # the update step's total + the decoder's own copies + the reference
    rollout_peak_bytes: int = 0      # the train state held + the larger program's total - shared buffers
    fits: bool = False               # update and rollout both fit one chip's HBM


def plan(preset: str, topology: str, *, mesh: str | dict | None = None, seq_len: int | None = None,
         batch_size: int = 8, micro_batches: int = 1, scan_layers: bool = False, remat: str = "none",
         kernels: str | dict | None = "auto", kernel_options: str | dict | None = None,
         compute_dtype: str | None = None, matmul_precision: str | None = None,
         model_overrides: dict | None = None, optimizer=None, roofline: bool = False, packed: bool = False,
         lora: str | None = None, rl=None, rollout: RolloutShape | None = None, model_record=None,
         base_dtype: str = "compute", moe_routing: str = "even") -> Plan:
    """Compile `preset`'s train step for TPU `topology` and report one chip's memory; `model_record`: a
    transformers model's or a module's record (TransformersSpec, ModuleSpec) planned instead (then
    `preset` only names it in the report; seq_len is required).
    mesh: None = one chip, replicated state; a --mesh spec ("" = every chip on fsdp) = the sharded
    step over every chip. model_overrides: ModelConfig fields (e.g. {"n_layers": 2}); seq_len
    defaults to the preset's. A program that does not fit is reported (fits=False, temp_bytes from
    the compiler's refusal), not raised. Bad mesh / batch: ValueError. roofline: also break the
    compiled step down by op category (jax_bridge/roofline.py; one chip's share of the work).
    packed: the SFT step (packed conversations: tokens, loss weights, segment ids and positions;
    segment-masked attention). lora: a --lora spec: the LoRA step (peft's adapters trained, the
    base frozen in the compute dtype and passed to the step undonated). rl: a PolicyGradientConfig:
    the GRPO update step (packed rollouts with its per-token float32 fields; implies packed);
    with `rollout` also the rollout's prefill and decode programs (`plan_rollout`). moe_routing:
    the routing the fused MoE kernels' cost estimates assume (pallas_kernels.moe.cost_routing:
    "even" or "random"); it moves the roofline only, never the program."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_bridge import kernel_tiles as tile_tables, registry, sharding
    from jax_bridge.step import StepConfig, TrainStep
    from pallas_kernels import moe
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    from torch_model.optim import OptimizerConfig

    devices = tpu_compile.topology_devices(topology)
    device = devices[0]
    chips = len(devices)
    device_mesh = None if mesh is None else sharding.make_mesh(mesh or None, devices)
    if device_mesh is None:
        if batch_size % chips:
            raise ValueError(f"batch_size {batch_size} must be a multiple of the {chips} chips of {topology} "
                             "(each chip runs batch_size / chips rows)")
        rows = batch_size // chips
    else:
        shards = sharding.batch_shards(device_mesh)
        if batch_size % shards:
            raise ValueError(f"batch_size {batch_size} must be a multiple of the {shards} batch shards of mesh "
                             f"{sharding.describe(device_mesh)} (the batch is split over data x fsdp x expert)")
        rows = batch_size // shards
    if model_record is not None:
        if not seq_len or model_overrides:
            raise ValueError("plan of a transformers model: give seq_len; layer overrides are not built for these "
                             "models")
        cfg = model_record.replace(max_seq_len=seq_len)
    else:
        cfg = get_preset(preset)
        seq_len = seq_len or cfg.max_seq_len
        cfg = cfg.replace(**{"max_seq_len": seq_len, **(model_overrides or {})})
    spec = None
    if rollout is not None:      # the KV cache and the rotary tables span prompt + completion
        cfg = cfg.replace(max_seq_len=max(seq_len, rollout.prompt_tokens + rollout.new_tokens))
    if base_dtype == "mxfp4" and (not lora or model_record is not None or rl is not None):
        raise ValueError("base_dtype mxfp4 is planned for a gpt-oss LoRA step (give lora; not rl or a transformers model)")
    with torch.device("meta"):
        if model_record is None:
            model = GptOssForCausalLM(cfg)
        elif hasattr(cfg, "facts"):             # a module model (torch_model/module_lm.py)
            from jax_bridge.module_probe import build_record

            model = build_record(cfg, meta=True)
        else:
            model = cfg.build()
        if base_dtype == "mxfp4":
            from torch_model.model import mxfp4_expert_modules
            mxfp4_expert_modules(model)
        if lora:
            from torch_model.lora import apply_lora, parse_lora_spec, unwrap
            spec = parse_lora_spec(lora)
            model = apply_lora(model, spec)
            if rl is not None:   # as `rl` builds it: the step on the model peft changed in place
                model = unwrap(model)
    step_cfg = StepConfig(kernels=kernels, compute_dtype=compute_dtype, micro_batches=micro_batches,
                          matmul_precision=matmul_precision, platform="tpu", kernel_options=kernel_options,
                          tpu_generation=tpu_compile.generation(device),
                          scan_layers=scan_layers, remat=remat, policy_gradient=rl)
    packed = packed or rl is not None
    optimizer = optimizer or OptimizerConfig()
    step = TrainStep(model, optimizer, step_cfg, mesh=device_mesh)
    if packed:
        registry.check_segments(step.kernels)
    state = step.abstract_state()
    frozen = step.abstract_frozen()
    compute = step.compute_copy_spec(state.params)
    result = Plan(preset=preset, topology=topology, device_kind=device.device_kind,
                  generation=tpu_compile.generation(device), chips=chips,
                  mesh=ONE_CHIP if device_mesh is None else sharding.describe(device_mesh), n_layers=cfg.n_layers,
                  params=cfg.param_counts()["total"], seq_len=seq_len, batch_size=batch_size, rows_per_chip=rows,
                  micro_batches=micro_batches, scan_layers=scan_layers, remat=remat, kernels=dict(step.kernels),
                  compute_dtype=step_cfg.compute_dtype, matmul_precision=step_cfg.matmul_precision,
                  hbm_bytes=tpu_compile.hbm_bytes(device), ns_dtype=optimizer.ns_dtype, optimizer=optimizer.optimizer,
                  moe_routing=moe_routing,
                  param_bytes=sharding.shard_bytes(state.params),
                  optimizer_bytes=sharding.shard_bytes(state.opt_state),
                  grad_bytes=sharding.shard_bytes(state.params),
                  packed=packed, rl="" if rl is None else _describe_rl(rl), lora=lora or "", trainable_params=sum(math.prod(a.shape) for a in
                                                                    jax.tree.leaves(state.params)),
                  frozen_bytes=sharding.shard_bytes(frozen), base_dtype=base_dtype,
                  compute_copy_bytes=sharding.shard_bytes(compute),
                  expert_delta_bytes=expert_delta_bytes(frozen, cfg.n_layers) if spec and spec.target_parameters else 0)
    held = result.param_bytes + result.optimizer_bytes + result.grad_bytes + result.frozen_bytes + \
        result.compute_copy_bytes
    if held > result.hbm_bytes:         # no need to compile: the state alone does not fit
        result.fits = False
        result.error = (f"parameters, optimizer state and gradients alone need {gib(held)} per chip, more than "
                        f"{gib(result.hbm_bytes)}: not compiled")
        return result
    start = time.perf_counter()
    with tile_tables.recording() as lookups:     # the tuned tiles each kernel call takes
        if device_mesh is None:
            tokens = _batch_spec(jax.ShapeDtypeStruct((micro_batches, rows, seq_len + 1), jnp.int32), packed,
                                 step.float_fields)
            lr_scale = jax.ShapeDtypeStruct((), jnp.float32)
            with moe.cost_routing(moe_routing):
                lowered = tpu_compile.lower_for(step._step, (state, compute, tokens, lr_scale, frozen), device,
                                                donate_argnums=(0, 1))
        else:
            # The trainer's inputs: sharded state, the global batch split over the batch axes; the
            # outputs take the shardings the step constrains them to.
            tokens = _batch_spec(jax.ShapeDtypeStruct((micro_batches, batch_size, seq_len + 1), jnp.int32,
                                                      sharding=sharding.batch_sharding(device_mesh)), packed,
                                 step.float_fields)
            lr_scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(device_mesh, P()))
            with moe.cost_routing(moe_routing):
                lowered = jax.jit(step._step, donate_argnums=(0, 1)).lower(state, compute, tokens, lr_scale, frozen)
    result.lower_s = round(time.perf_counter() - start, 2)
    memory, compiled = _compiled_memory(lowered.compile)
    result.compile_s, result.compile_cpu_s, result.temp_bytes = memory.compile_s, memory.compile_cpu_s, memory.temp_bytes
    if compiled is None:
        result.fits, result.error = False, memory.error
        return result
    result.argument_bytes, result.output_bytes = memory.argument_bytes, memory.output_bytes
    result.alias_bytes, result.total_bytes = memory.alias_bytes, memory.total_bytes
    result.fits = result.total_bytes <= result.hbm_bytes
    if roofline:
        from jax_bridge import roofline as roofline_mod

        tokens_per_chip = rows * seq_len * micro_batches if device_mesh is None else \
            batch_size * seq_len * micro_batches // chips
        whole_experts = device_mesh is None or all(device_mesh.shape.get(a, 1) == 1 for a in ("tensor", "expert"))
        tiles = kernel_tiles(step.kernels, step_cfg.kernel_options, cfg, seq_len, tokens_per_chip, whole_experts,
                             step_cfg.tpu_generation, lookups)
        result.roofline = roofline_mod.roofline(compiled, result.generation, tiles=tiles)
    if rollout is not None:
        if rl is None:
            raise ValueError("a rollout is planned with the RL update step (rl=...)")
        result.rollout = dataclasses.asdict(plan_rollout(result, model, step, rollout, devices, device_mesh, rl.beta))
    return result


def plan_rollout(update: Plan, model, step, shape: RolloutShape, devices, device_mesh, beta: float) -> RolloutPlan:
    """Compile the rollout's prefill and decode programs for the slice beside the update step
    `update` (already planned, its state's bytes known): the programs `torchlyra rl` runs
    (jax_bridge.decoding.Decoder with the policy's parameters in the compute dtype, the rollout
    batch split over the mesh's batch axes; without a mesh each chip decodes its share of the
    completions with the whole model)."""
    import numpy as np

    from jax_bridge import decoding, sharding
    from jax_bridge.sampling import SamplingMode
    from torch_model.kv_cache import cache_slots

    group = shape.group_size
    if shape.completions % group:
        raise ValueError(f"rollout: {shape.completions} completions must be a multiple of the group size {group}")
    prompts = shape.completions // group
    if device_mesh is None:
        if prompts % len(devices):
            raise ValueError(f"rollout: {prompts} prompts must be a multiple of the {len(devices)} chips "
                             "(each chip decodes its share)")
        mesh, prompts = sharding.make_mesh(None, devices[:1]), prompts // len(devices)
    else:
        mesh = device_mesh
    prompt_rows, prompt_len, length = decoding.buckets(prompts, shape.prompt_tokens, shape.new_tokens,
                                                       sharding.batch_shards(mesh), group)
    batch = prompt_rows * group
    params = decoding.decoder_params(model, step.compute_dtype, mesh)
    decoder = decoding.Decoder(model, kernels=decoding.generation_kernels(step.cfg.kernels, "tpu"), platform="tpu",
                               compute_dtype=step.cfg.compute_dtype, matmul_precision=step.cfg.matmul_precision,
                               mesh=mesh, params=params, tpu_generation=step.cfg.tpu_generation,
                               kernel_options=step.cfg.kernel_options)
    # The decoder's own buffers: the casts of the trainable parameters (a frozen base is already
    # in the compute dtype, a float32 router stays float32: the train state's buffers).
    masters = step.abstract_state().params
    own = {n: a for n, a in params.items() if n in masters and masters[n].dtype != a.dtype}
    if set(params) != set(masters) | set(step.frozen_names):
        raise ValueError("rollout: the decoder's parameter names are not the update step's")
    # Full fine-tuning's KL reference: the starting parameters, copied in the compute dtype.
    reference = sharding.shard_bytes(params) if beta and not step.frozen_names else 0
    cfg = model.cfg
    slots = sum(cache_slots(cfg, layer, length) for layer in range(cfg.n_layers))
    kv_bytes = 2 * batch * cfg.n_kv_heads * cfg.head_dim * slots * np.dtype(step.compute_dtype).itemsize
    out = RolloutPlan(completions=shape.completions, prompt_tokens=shape.prompt_tokens, new_tokens=shape.new_tokens,
                      group_size=group, prompt_rows=prompt_rows, batch=batch, prompt_len=prompt_len, length=length, kernels=dict(decoder.decode_kernels),
                      param_bytes=sharding.shard_bytes(params), own_bytes=sharding.shard_bytes(own),
                      reference_bytes=reference,
                      cache_bytes=kv_bytes // sharding.batch_shards(mesh), prefill=ProgramMemory(),
                      decode=ProgramMemory())
    mode = SamplingMode(greedy=False, top_k=shape.top_k, top_p=shape.top_p < 1, penalty=False, logprobs=True)
    n_stop = decoding.stop_slots(3)          # harmony's <|return|>, <|end|>, <|call|> (or EOS)
    out.prefill, prefill = _compiled_memory(lambda: decoder.prefill_program(prompt_rows, prompt_len, length, mode,
                                                                            n_stop, repeat=group))
    if prefill is None:
        return out
    out.decode, decode = _compiled_memory(lambda: decoder.decode_program(batch, length, mode, n_stop,
                                                                         prefill.out_info[0]))
    if decode is None:
        return out
    out.__dict__.update(decoding.loop_collectives(decode))
    shared = out.param_bytes - out.own_bytes
    # the update's state, with the bf16 copy the train step keeps between steps
    held = update.param_bytes + update.optimizer_bytes + update.frozen_bytes + update.compute_copy_bytes + reference
    out.update_peak_bytes = (update.total_bytes or 0) + out.own_bytes + reference
    out.rollout_peak_bytes = held + max(out.prefill.total_bytes, out.decode.total_bytes) - shared
    out.fits = bool(update.fits) and max(out.update_peak_bytes, out.rollout_peak_bytes) <= update.hbm_bytes
    return out


def _compiled_memory(build):
    """(ProgramMemory, the compiled program) of `build()`, which compiles one program (timed);
    an out-of-memory refusal is a result (the program None), anything else is raised."""
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        compiled = build()
    except Exception as e:  # noqa: BLE001 - an out-of-memory refusal is a result, anything else is raised
        found = _OOM.search(str(e))
        if not found:
            raise
        compiled, memory = None, ProgramMemory(temp_bytes=int(float(found.group(1)) * _UNITS[found.group(2)]),
                                               error=str(e).strip().splitlines()[0][:400])
    else:
        mem = compiled.memory_analysis()
        args, outs = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
        alias, temp = int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes)
        memory = ProgramMemory(args, outs, alias, temp, args + outs - alias + temp)
    memory.compile_s = round(time.perf_counter() - start, 2)
    memory.compile_cpu_s = round(time.process_time() - cpu_start, 2)
    return memory, compiled


def expert_delta_bytes(frozen: dict, n_layers: int) -> int:
    """Per chip, one layer's share of the frozen expert weight stacks: the size of the merged
    weight W + scaling * B A that peft's expert LoRA forms for each stack in every forward (and
    that the backward keeps per layer unless rematerialized)."""
    # peft keeps the base tensor inside its wrappers: mlp.experts.base_layer.base_layer.gate_up_proj
    from jax_bridge import sharding

    experts = {n: a for n, a in frozen.items()
               if ".mlp.experts." in n and n.endswith((".gate_up_proj", ".down_proj"))}
    return sharding.shard_bytes(experts) // n_layers


# Slice shapes of each generation, smallest first (compile-only topologies libtpu accepts; v5e and
# v6e are also rented as one chip: v5litepod-1, v6e-1).
SLICES = {"v5e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
          "v6e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
          "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8"),
          "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8")}


def smallest_slice(preset: str, generation: str, *, rows_per_chip: int = 1, report=None, **plan_kwargs) -> list[Plan]:
    """Plan `preset` on the slices of `generation` (every chip on fsdp unless plan_kwargs name a
    mesh), smallest first, with `rows_per_chip` sequences per chip, until one fits. Returns every
    plan made; the last one fits unless none did. Slices whose state alone exceeds a chip's HBM
    are not compiled."""
    if generation not in SLICES:
        raise ValueError(f"--find-slice: expected one of {', '.join(SLICES)}, found {generation!r}")
    plans = []
    for shape in SLICES[generation]:
        topology = f"{generation}:{shape}"
        chips = math.prod(int(d) for d in shape.split("x"))
        try:
            plans.append(plan(preset, topology, **{"mesh": "", **plan_kwargs, "batch_size": rows_per_chip * chips}))
        except ValueError as e:     # e.g. a mesh whose axes do not divide the model at this size
            plans.append(Plan(preset=preset, topology=topology, device_kind="", generation=generation, chips=chips,
                              mesh=str(plan_kwargs.get("mesh", "")), n_layers=0, params=0, seq_len=0, batch_size=0,
                              rows_per_chip=rows_per_chip, micro_batches=1, scan_layers=False, remat="", kernels={},
                              compute_dtype="", matmul_precision="", hbm_bytes=0, fits=False,
                              error=str(e).splitlines()[0]))
        if report:
            report(plans[-1])
        if plans[-1].fits:
            break
    return plans


def kernel_tiles(kernels: dict, options, cfg, seq_len: int, tokens: int, whole_experts: bool = True,
                 generation: str | None = None, lookups=()) -> dict:
    """The tile sizes each Pallas kernel of the step runs with on a TPU of `generation`: the
    options given, else the kernel's defaults for these shapes (recorded beside a roofline: tiles
    are not tuned from it). An implementation with a table of tuned tiles: the table and, per call
    key the step's trace looked up (`lookups`: kernel_tiles.Lookup), its tiles or "default".
    whole_experts: no mesh axis splits the experts or their width, so the fused MoE's rows per
    chip are tokens x experts per token at the full expert width (else its defaults before the
    VMEM-budget shrink are reported)."""
    import jax.numpy as jnp

    from jax_bridge import kernel_tiles, registry
    from pallas_kernels import attention, cross_entropy, moe

    given = registry.parse_kernel_options(options)
    tiles = {}
    for op, name in kernels.items():
        mine = dict(given.get(op, {}).get(name, {}))
        tuned = mine.pop(kernel_tiles.TUNED, None)
        if tuned is not None:   # chosen per call shape from the table (its entries, else the defaults)
            calls = {u.key: u.options or "default" for u in lookups if (u.op, u.implementation) == (op, name)}
            tiles[f"{op}.{name}"] = {"table": tuned["path"], "calls": calls, **mine}
            continue
        if (op, name) == ("attention", "pallas"):
            block_q, block_kv = attention.default_block_sizes(seq_len, cfg.head_dim, "tpu")
            mine = {"block_q": block_q, "block_kv": block_kv, **mine}
        elif (op, name) == ("attention", "splash"):
            mine = attention.splash_block_sizes(seq_len, cfg.head_dim, **mine)
        elif (op, name) == ("cross_entropy", "pallas"):
            block_n, block_v = cross_entropy.default_block_sizes(tokens, cfg.d_model, cfg.vocab_size, "tpu")
            mine = {"block_n": block_n, "block_v": block_v, **mine}
        elif (op, name) == ("moe", "pallas") and whole_experts and getattr(cfg, "experts_per_token", 0):
            given_tiles = {k: mine[k] for k in ("block_m", "block_i", "block_m_dw", "block_i_dw", "vmem_capacity_bytes",
                                                "gate_up_layout") if k in mine}   # as the registry binds the kernel: the options over the target's
            mine = moe.fused_tiles(tokens * cfg.experts_per_token, cfg.d_model, cfg.expert_dim, jnp.bfloat16,
                                   num_experts=cfg.n_experts,
                                   **{**registry.target_keywords(moe.fused_tiles, "tpu", generation), **given_tiles})
        elif (op, name) == ("moe", "pallas"):
            block_m, block_i = moe.DEFAULT_FUSED_TILES["tpu"]
            mine = {"block_m": block_m, "block_i": block_i, "note": "before the VMEM-budget shrink", **mine}
        if mine:
            tiles[f"{op}.{name}"] = mine
    return tiles


def _describe_rl(cfg) -> str:
    return (f"loss={cfg.loss},ratio={cfg.ratio},beta={cfg.beta:g},iterations={cfg.iterations},"
            f"epsilon={cfg.epsilon:g},epsilon_high={cfg.epsilon_high:g}")


def _batch_spec(tokens, packed: bool, float_fields: tuple = ()):
    """The step's batch argument: the token array, or a packed batch's four arrays of its shape
    (plus GRPO's per-token float32 fields)."""
    import jax
    import jax.numpy as jnp

    from jax_bridge.step import PACKED_FIELDS

    if not packed:
        return tokens
    dtype = {"weights": jnp.float32, **{k: jnp.float32 for k in float_fields}}
    return {k: jax.ShapeDtypeStruct(tokens.shape, dtype.get(k, jnp.int32), sharding=tokens.sharding)
            for k in (*PACKED_FIELDS, *float_fields)}


def gib(n: int | None) -> str:
    """Bytes in GiB, or MiB below one GiB (a small plan's figures stay readable)."""
    if n is None:
        return "-"
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def format_plan(p: Plan) -> str:
    kernels = ", ".join(f"{op}={name}" for op, name in p.kernels.items())
    if p.mesh == ONE_CHIP:
        placement = f"{p.rows_per_chip} rows per chip x {p.chips} (replicated state)"
    else:
        placement = f"{p.rows_per_chip} rows per chip (batch split over the mesh's data axes)"
    lines = [f"plan: {p.preset} ({p.n_layers} layers, {p.params / 1e9:.2f}B parameters) on {p.topology}: "
             f"{p.chips} x {p.device_kind}, mesh {p.mesh if p.mesh != ONE_CHIP else 'none (one chip)'}",
             f"  step: seq {p.seq_len}, global batch {p.batch_size} = {placement}, {p.micro_batches} "
             f"micro-batch(es){' of packed rows (SFT: segment ids, loss weights)' if p.packed and not p.rl else ''}"
             f"{f' of packed rollouts (GRPO update: {p.rl}; per-token advantages and log-probabilities)' if p.rl else ''}; "
             f"layers {'scanned' if p.scan_layers else 'looped'}, remat {p.remat}; "
             f"{p.compute_dtype} compute, matmul precision {p.matmul_precision}, "
             f"{f'Newton-Schulz {p.ns_dtype}' if p.optimizer == 'muon' else 'AdamW for every parameter'}; "
             f"kernels {kernels}"
             + (f" (their cost estimates: {p.moe_routing} routing)" if p.moe_routing != "even" else ""),
             f"  per chip, from the shardings: parameters {gib(p.param_bytes)}, optimizer {gib(p.optimizer_bytes)}, "
             f"gradients {gib(p.grad_bytes)} (one per parameter shard, float32; part of the temporaries)"
             + (f", their {p.compute_dtype} copy {gib(p.compute_copy_bytes)} (written by the update, read by the "
                f"next step's forward)" if p.compute_copy_bytes else ""),
             *([f"  LoRA {p.lora}: {p.trainable_params / 1e6:.1f}M trainable parameters (the state above); frozen "
                f"base {gib(p.frozen_bytes)} per chip ("
                + ("experts MXFP4 as released, the rest " if p.base_dtype == "mxfp4" else "")
                + f"{p.compute_dtype}, an argument, not donated)"
                + (f"; peft's expert LoRA forms W + scaling * B A per layer: {gib(p.expert_delta_bytes)} per chip "
                   f"per layer, inside the temporaries" if p.expert_delta_bytes else "")] if p.lora else []),
             f"  per chip, by the compiler: arguments {gib(p.argument_bytes)}, outputs {gib(p.output_bytes)} "
             f"({gib(p.alias_bytes)} donated from the arguments), temporaries {gib(p.temp_bytes)}",
             f"  total {gib(p.total_bytes)} of {gib(p.hbm_bytes)} HBM per chip (the compiler's limit; "
             f"{tpu_compile.CHIP_HBM_GIB.get(p.generation, '?')} GiB chip): "
             + ("fits" if p.fits else "DOES NOT FIT"),
             f"  lower {p.lower_s} s, compile {p.compile_s} s wall / {p.compile_cpu_s} s CPU (TPU compiler, on this host)"]
    if p.lower_s is None:       # not compiled: the state alone was over the chip's HBM
        lines = lines[:4 if p.lora else 3] + [f"  {p.error}; DOES NOT FIT"]
    elif p.error:
        lines.append(f"  compiler: {p.error}")
    if p.rollout is not None:
        lines.extend(format_rollout(p.rollout, p.hbm_bytes))
    return "\n".join(lines)


def format_rollout(r: dict, hbm_bytes: int) -> list[str]:
    def program(name, m):
        if m["error"]:
            return f"    {name}: {m['error']}; DOES NOT FIT"
        return (f"    {name}: arguments {gib(m['argument_bytes'])}, outputs {gib(m['output_bytes'])} "
                f"({gib(m['alias_bytes'])} donated), temporaries {gib(m['temp_bytes'])}, total "
                f"{gib(m['total_bytes'])}; compiled in {m['compile_s']} s")

    kernels = ", ".join(f"{op}={name}" for op, name in r["kernels"].items())
    lines = [f"  rollout: {r['completions']} completions, G {r['group_size']} per prompt (prompts <= {r['prompt_tokens']} "
             f"tokens, <= {r['new_tokens']} new, sampled with log-probabilities and entropies): prefill of "
             f"{r['prompt_rows']} prompt rows (bucket {r['prompt_len']}) copied G times, decode loop of {r['batch']} rows, "
             f"KV cache {r['length']} positions; kernels {kernels}",
             f"    per chip: decoder parameters {gib(r['param_bytes'])} ({gib(r['own_bytes'])} its own copies, the "
             f"rest the train state's buffers), KV cache {gib(r['cache_bytes'])}"
             + (f", KL reference copy {gib(r['reference_bytes'])}" if r["reference_bytes"] else ""),
             program("prefill", r["prefill"])]
    if r["prefill"]["error"]:
        return lines + ["    decode loop: not compiled (the prefill does not fit)"]
    lines.append(program("decode loop", r["decode"]))
    if r["decode"]["error"]:
        return lines
    lines += [f"    decode loop moves per chip: {gib(r['gathered_per_token'])} all-gathered per token, "
              f"{gib(r['gathered_per_call'])} per call (hoisted out of the loop), {gib(r['other_per_token'])} "
              "other collectives per token",
              f"    peak per chip: update {gib(r['update_peak_bytes'])} (its total + the decoder's own copies"
              f"{' + the reference' if r['reference_bytes'] else ''}), rollout {gib(r['rollout_peak_bytes'])} "
              f"(the train state + the larger program): update and rollout "
              + (f"fit {gib(hbm_bytes)}" if r["fits"] else f"DO NOT FIT {gib(hbm_bytes)}")]
    return lines
