"""Generation through the lowered model: a prefill program and a decode-loop program per bucket.

The torch model's `forward_cached` (KV cache, static shapes) is traced by torchax. Prefill runs
the whole left-padded prompt batch in one call and samples the first token; the decode program
is one `lax.while_loop` that feeds each token back, updates the cache in place and samples on
device, until every row has stopped or a step limit is reached. The limit is an argument, so the
same compiled program serves any number of new tokens and streaming (several calls, each
continuing the donated state) alike. Programs are compiled ahead of time per bucket (batch,
prompt length, total length, sampling mode); each compilation is counted and timed.

A program's first run loads it onto the devices (on a TPU v5e, the 0.57 B Llama's first prefill
took 279 ms against a few ms after): `Decoder.first_run` runs a newly compiled pair once on an
all-padding batch, so that time is reported with the compilation, not as time to first token or
decode time. `Decoder.step_bytes` is what one decode step must read at the least (the HBM floor
of `torchlyra generate --timings`).

Precision follows the train step's per-platform defaults (jax_bridge/step.py: float32 and
"highest" matmuls on CPU, bf16 with "default" on accelerators). With a device mesh, parameters
are placed by the training rules (jax_bridge/sharding.py), the batch is split over the mesh's
batch axes and the kernels run as they do in training under that mesh.
"""
from __future__ import annotations

import functools
import math
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax.sharding import NamedSharding, PartitionSpec

from jax_bridge import compile_cache, kernel_tiles, registry, sharding
from jax_bridge.env import get_env
from jax_bridge.lowering import model_function, params_to_jax
from jax_bridge.model_on_mesh import ModelOnMesh
from pallas_kernels.platform import check_platform, host_platform
from jax_bridge.sampling import SamplingMode, SamplingValues, is_stop, mark_seen, next_token, token_logprob
from jax_bridge.step import (COMPUTE_DTYPES, DEFAULT_COMPUTE_DTYPE, cast_params, default_matmul_precision, host_array,
                             replace_params, target_generation)
from torch_model import kv_cache
from torch_model.lora import tracing_scope
from torch_model.model import has_mxfp4_experts

PROMPT_MULTIPLE = 32      # prompt lengths are padded up to a multiple of this
LENGTH_MULTIPLE = 64      # and the total (prompt bucket + new tokens) to a multiple of this


# The TPU compiler's memory-space assignment moved each layer's whole KV cache into VMEM to
# write one token's row there, and copied it back, every step: at the 0.57 B Llama's 64 rows x
# 128 slots, 805 MB of copies per token beside 1.15 GB of weights (jax_bridge/roofline.py on the
# v5e decode program; tests/test_generation_tpu.py). An allocation in VMEM whose uses read less
# than this share of the bytes it copies is refused: the caches stay in HBM and are updated in
# place, a weight prefetched once and read once (share 1) is still prefetched.
TPU_DECODE_OPTIONS = {"xla_tpu_msa_inefficient_use_to_copy_ratio": 0.8}


def batch_bucket(batch: int) -> int:
    return 1 << max(0, (batch - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def buckets(rows: int, longest_prompt: int, new_tokens: int, batch_shards: int = 1,
            group: int = 1) -> tuple[int, int, int]:
    """(prompt rows, prompt length, total length) of the programs that serve `rows` prompts of at
    most `longest_prompt` tokens, each continued `group` times by `new_tokens`: rows up to a
    power of two, then until the decoded rows (prompt rows x group) split evenly over the devices
    the batch is split over; the prompt and the total up to their multiples."""
    prompt_len = round_up(longest_prompt, PROMPT_MULTIPLE)
    return (round_up(batch_bucket(rows), batch_shards // math.gcd(group, batch_shards)), prompt_len,
            round_up(prompt_len + new_tokens, LENGTH_MULTIPLE))


def generation_kernels(kernels: str | dict | None, platform: str, model=None) -> dict[str, str]:
    """Kernels for generation: `kernels` over the ops the cached forward of `model` uses, except
    that on CPU an MoE left at `auto` (and an MXFP4 base's) gets the `decode` implementation, built
    for generation's row counts (pallas_kernels/moe_decode.py; the tiled `xla` one is tuned for
    training batches, and decodes MXFP4 stacks whole)."""
    ops = registry.OPS + registry.GENERATION_OPS
    choice = registry.parse_kernel_spec(kernels, ops=ops if model is None else registry.model_ops(model, ops))
    for op in ("moe", "moe_mxfp4"):
        if platform == "cpu" and choice.get(op) == "auto":
            choice[op] = "decode"
    return choice


def stop_slots(n_stop_ids: int) -> int:
    """Length of the stop-id argument for `n_stop_ids` stops (padded with -1: fewer programs)."""
    return round_up(max(1, n_stop_ids), 4)


class Layout(NamedTuple):
    transposed: bool        # Linear weights as [in, out]
    split_experts: bool     # expert weight matrices as one array per expert


class DecodeState(NamedTuple):
    tokens: jax.Array       # [B, L] int32: the left-padded prompt, then generated tokens (-1 once stopped)
    cache: kv_cache.KVCache
    last: jax.Array         # [B] int32: the newest token, fed next
    positions: jax.Array    # [B] int32: its position
    step: jax.Array         # int32: tokens generated so far
    done: jax.Array         # [B] bool: the row has produced a stop token (or is batch padding)
    seen: jax.Array         # [B, V] bool for the repetition penalty ([B, 1] when off)
    key: jax.Array          # PRNG key
    prompt_len: jax.Array   # int32: P, the sequence index of the first generated token
    logps: jax.Array        # [B, L] float32: each generated token's log-probability under softmax(z / T)
                            # over the whole vocabulary ([B, 1] unless SamplingMode.logprobs)
    entropy: jax.Array      # [B, L] float32: that distribution's entropy at each generated token


class FirstTokens(NamedTuple):
    """The prefill's first sampled tokens apart from its decode state: the decode program
    donates the state, so a call can queue the decode loop behind the prefill and still fetch
    these afterwards."""
    tokens: jax.Array       # [B] int32: each row's first generated token (-1 for batch padding)
    done: jax.Array         # [B] bool: the state's done flags after it


class Compilation(NamedTuple):
    program: str            # prefill | decode
    bucket: tuple
    seconds: float          # tracing + lowering + compiling (or loading from the persistent cache)
    from_cache: bool        # the persistent compilation cache held the executable


def empty_cache(env, model, rows: int, slots: int, dtype):
    """An empty generation cache of `rows` rows and `slots` positions as JAX arrays in `dtype`
    (inside a traced program: the model's own `new_cache`, through the torchax env; the static KV
    cache of torch_model/kv_cache.py, or a module model's tokens)."""
    with env:
        cache = model.new_cache(rows, slots, dtype=getattr(torch, jnp.dtype(dtype).name), device="jax")
    return env.t2j_iso(cache)


def decoder_params(model: torch.nn.Module, compute_dtype, mesh=None) -> dict:
    """The parameters as a Decoder holds them, without weights: shapes, dtypes (the compute dtype
    where `in_compute_dtype` says so) and, with a mesh, shardings (ModelOnMesh.parameter_specs).
    The model may be on `meta`: for compiling without weights, or for a loader to fill
    (formats/mesh_loader.py)."""
    return ModelOnMesh(model, mesh).parameter_specs(compute_dtype)


class Decoder:
    """Compiled prefill and decode programs for one model (parameters as JAX arrays, sharded over
    `mesh` when given). compute_dtype / matmul_precision None: the train step's defaults.
    tpu_generation: the TPU generation its kernels' tiles are sized for (StepConfig's; default this
    host's chips' on TPU); its committed tile table is taken under `kernel_options` (as
    StepConfig.kernel_options: "tiles=off" turns it off; see kernel_tiles.py).
    `params`: the parameters to use instead of the model's (in the compute dtype, placed): e.g.
    ShapeDtypeStructs for a model on the `meta` device, to compile without weights (see
    `abstract_params`)."""

    def __init__(self, model: torch.nn.Module, *, kernels: str | dict | None = "xla",
                 decode_kernels: str | dict | None = None, matmul_precision: str | None = None,
                 compute_dtype: str | None = None, compiler_options: dict | None = None,
                 platform: str | None = None, mesh=None, params: dict | None = None,
                 tpu_generation: str | None = None, kernel_options: str | dict | None = None):
        self.model, self.cfg = model, model.cfg
        self.env = get_env()
        self.platform = check_platform(platform or host_platform(), "Decoder platform")
        self.tpu_generation = target_generation(self.platform, tpu_generation)    # the TPU kernels' VMEM
        self.kernel_options = kernel_tiles.with_tables(registry.parse_kernel_options(kernel_options), self.platform,
                                                       self.tpu_generation)
        registry.check_options(self.kernel_options)
        ops = registry.model_ops(model, registry.OPS + registry.GENERATION_OPS)
        self.kernels = registry.resolve(kernels, self.platform, ops=ops)
        self.decode_kernels = (self.kernels if decode_kernels is None
                               else registry.resolve(decode_kernels, self.platform, ops=ops))
        self.compute_dtype = (DEFAULT_COMPUTE_DTYPE[self.platform] if compute_dtype in (None, "auto")
                              else compute_dtype)
        self.matmul_precision = matmul_precision or default_matmul_precision(self.compute_dtype)
        self.compiler_options = {**sharding.compiler_options(mesh), **(compiler_options or {})}
        self.mesh = mesh
        self.on_mesh = ModelOnMesh(model, mesh)
        compute = COMPUTE_DTYPES[self.compute_dtype]
        if params is not None:
            self.params = dict(params)
        elif mesh is None:
            self.params = cast_params(params_to_jax(model), compute)
        else:       # from the host straight into shards: no device ever holds a whole model
            self.params = self.on_mesh.place(cast_params({n: host_array(p) for n, p in model.named_parameters()},
                                                         compute))
        # Tuples in model order, never sets: the traced program (hence the persistent cache key)
        # must not depend on the process's string hashing.
        # A tied head's weight is the embedding's (named once, as the embedding): it keeps its layout.
        names = {id(p): n for n, p in model.named_parameters()}
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        self.linear_weights = tuple(names[id(module.weight)] for module in model.modules()
                                    if isinstance(module, torch.nn.Linear) and id(module.weight) not in embeddings)
        self.expert_weights = tuple(name for name in self.params
                                    if name.endswith(("experts.gate_up_proj", "experts.down_proj")))
        self._layouts: dict[Layout, dict] = {}
        self._forward = model_function(model, "forward_cached")
        self._programs: dict[tuple, object] = {}
        self._limits: dict[int, jax.Array] = {}
        self.compilations: list[Compilation] = []

    def set_params(self, params: dict) -> None:
        """New values for every parameter (JAX or numpy arrays keyed by the model's parameter
        names, any float dtype: cast here to the compute dtype), e.g. the policy's after each RL
        update. The compiled programs take the parameters as arguments: same shapes, no recompile.
        A LoRA model's adapters stay apart from the base (unmerged), as the step holds them."""
        # A frozen base already in the compute dtype on these shardings is shared with the train step.
        shardings = self.on_mesh.shardings(self.params)
        self.params = replace_params(params, self.params, COMPUTE_DTYPES[self.compute_dtype], shardings,
                                     "Decoder.set_params")
        self._layouts = {}

    # ---- parameter layouts ----------------------------------------------------------------------
    def layout(self, program: str, rows: int) -> "Layout":
        """How a program takes the parameters (`rows`: token rows per forward call).

        transposed: Linear weights come as [in, out] and are transposed back inside the program,
          which XLA folds into the matmul: XLA:CPU multiplies a few rows by an [in, out] matrix
          ~1.5x faster than by an [out, in] one (lm head at batch 8: 192 vs 298 us); one row is
          fastest as a matrix-vector product on the original layout. Decode steps only: a
          prefill runs once a call, as fast either way (the 0.57 B Llama's 32-token prompt:
          0.55 s), and the copy cost it 1.3 s. CPU only: measured there, and the transposed
          copies are a second copy of every Linear weight in device memory (accelerator
          compilers choose their layouts themselves), so one device only: under a mesh the
          weights are held once.
        split_experts: each expert's weight matrices come as separate arrays, stacked inside the
          program; the `decode` MoE then reads an expert through a static slice of the stack,
          which XLA resolves to that expert's own buffer (no copy), where a dynamic slice of one
          [E, ...] array copies the expert's weights on every step.
        """
        # Under a mesh an expert's slice of an expert-split array is no array of its own: not split.
        split = program == "decode" and self.decode_kernels.get("moe") == "decode" and self.mesh is None
        # Nor transposed: a mesh is for models too large to hold twice (CPU devices share the host's memory).
        return Layout(transposed=program == "decode" and rows > 1 and self.platform == "cpu" and self.mesh is None,
                      split_experts=split)

    def params_for(self, layout: "Layout") -> dict:
        if layout not in self._layouts:
            params = dict(self.params)
            if layout.transposed:
                params.update({k: jnp.transpose(params[k]) for k in self.linear_weights})
            if layout.split_experts:
                params.update({k: tuple(params[k]) for k in self.expert_weights})
            self._layouts[layout] = params
        return self._layouts[layout]

    def _forward_cached(self, params, ids, positions, cache, start, kernels, layout: "Layout"):
        params = dict(params)
        if layout.transposed:
            params.update({k: params[k].T for k in self.linear_weights})
        if layout.split_experts:
            params.update({k: jnp.stack(params[k]) for k in self.expert_weights})
        # The decode MoE's switch over static slices copies every expert unless they are split.
        options = self.kernel_options
        if kernels.get("moe") == "decode" and not layout.split_experts:
            options = {**options, "moe": {**options.get("moe", {}),
                                          "decode": {**options.get("moe", {}).get("decode", {}), "rows_alone": 0}}}
        with registry.routed(self.env, kernels, platform=self.platform, options=options, mesh=self.mesh,
                             generation=self.tpu_generation), \
                jax.default_matmul_precision(self.matmul_precision), tracing_scope(self.model):
            return self._forward(params, ids, positions, cache, start)

    def _empty_cache(self, batch: int, length: int):
        return empty_cache(self.env, self.model, batch, length, COMPUTE_DTYPES[self.compute_dtype])

    def _prefill(self, params, ids, positions, active, values, key, *, length: int, mode: SamplingMode,
                 repeat: int = 1):
        rows, prompt = ids.shape
        cache = self._empty_cache(rows, length)
        logits, cache = self._forward_cached(params, ids, positions, cache, jnp.int32(0), self.kernels,
                                             self.layout("prefill", rows * prompt))
        if repeat > 1:      # each prompt's `repeat` samples share its prefill: rows copied, prompt-major
            logits, cache, ids, positions, active = jax.tree.map(
                lambda x: jnp.repeat(x, repeat, axis=0), (logits, cache, ids, positions, active))
            if not self._split_prompts(rows):    # prefilled on every device: the copies split from here
                logits, cache, ids, positions, active = jax.tree.map(
                    lambda x: jax.lax.with_sharding_constraint(x, self._sharding(True)),
                    (logits, cache, ids, positions, active))
        batch = rows * repeat
        prompt_tokens = jnp.where(positions >= 0, ids, -1)
        seen = mark_seen(jnp.zeros((batch, self.cfg.vocab_size if mode.penalty else 1), bool),
                         prompt_tokens if mode.penalty else jnp.full_like(ids, -1))
        token, key = next_token(logits, seen, key, mode, values)
        if mode.penalty:
            seen = mark_seen(seen, token[:, None])
        tokens = jnp.full((batch, length), -1, jnp.int32).at[:, :prompt].set(prompt_tokens)
        tokens = tokens.at[:, prompt].set(jnp.where(active, token, -1))
        done = ~active | is_stop(token, values.stop_ids)
        width = length if mode.logprobs else 1
        logps, entropy = jnp.zeros((batch, width), jnp.float32), jnp.zeros((batch, width), jnp.float32)
        if mode.logprobs:
            lp, ent = token_logprob(logits, token, values.temperature)
            logps, entropy = logps.at[:, prompt].set(lp), entropy.at[:, prompt].set(ent)
        state = DecodeState(tokens, cache, token, positions[:, -1] + 1, jnp.int32(1), done, seen, key,
                            jnp.int32(prompt), logps, entropy)
        return state, FirstTokens(tokens[:, prompt], done)

    def _decode(self, params, state: DecodeState, limit, values, *, mode: SamplingMode):
        held = self._expert_bias_operands(params)

        def running(s):
            return (s.step < limit) & ~jnp.all(s.done)

        def step(s: DecodeState):
            start = s.prompt_len + s.step - 1          # sequence index of the token fed now
            step_params = {**params, **{k: b.reshape(b.shape[0], -1) for k, b in held.items()}}
            logits, cache = self._forward_cached(step_params, s.last[:, None], s.positions[:, None], s.cache, start,
                                                 self.decode_kernels, self.layout("decode", s.last.shape[0]))
            token, key = next_token(logits, s.seen, s.key, mode, values)
            seen = mark_seen(s.seen, token[:, None]) if mode.penalty else s.seen
            out = jnp.where(s.done, -1, token)
            tokens = jax.lax.dynamic_update_slice(s.tokens, out[:, None], (jnp.int32(0), start + 1))
            done = s.done | is_stop(token, values.stop_ids)
            logps, entropy = s.logps, s.entropy
            if mode.logprobs:
                lp, ent = token_logprob(logits, token, values.temperature)
                at = (jnp.int32(0), start + 1)
                logps = jax.lax.dynamic_update_slice(logps, lp[:, None], at)
                entropy = jax.lax.dynamic_update_slice(entropy, ent[:, None], at)
            return DecodeState(tokens, cache, token, s.positions + 1, s.step + 1, done, seen, key, s.prompt_len,
                               logps, entropy)

        return jax.lax.while_loop(running, step, state)

    def _expert_bias_operands(self, params) -> dict:
        """The expert biases [E, N] in the operand shape of the MoE kernel the decode loop runs,
        made once before the loop, where that kernel is a fused Pallas one: reshaped inside the
        loop, the TPU compiler relays each bias out with a copy per layer and token (8 of
        `small-o200k`'s 363 ops per token, about 14 us by its estimate; scripts/decode_loop_ops.py).
        The loop reshapes them back, which XLA cancels against the kernel's own reshape."""
        from pallas_kernels import moe, moe_mxfp4

        op = "moe_mxfp4" if has_mxfp4_experts(self.model) else "moe"
        if self.decode_kernels.get(op) != "pallas":
            return {}
        operand = {"moe": moe.bias_operand, "moe_mxfp4": moe_mxfp4.bias_operand}[op]
        return {k: operand(b) for k, b in params.items() if k.endswith(("experts.gate_up_proj_bias",
                                                                          "experts.down_proj_bias"))}

    # ---- placement --------------------------------------------------------------------------------
    @property
    def batch_shards(self) -> int:
        """Batch rows must be a multiple of this: the devices the batch is split over."""
        return 1 if self.mesh is None else sharding.batch_shards(self.mesh)

    def _sharding(self, split_rows: bool):
        """Inputs: rows split over the batch axes, or replicated (None: no mesh, one device)."""
        if self.mesh is None:
            return None
        return sharding.rows_sharding(self.mesh) if split_rows else NamedSharding(self.mesh, PartitionSpec())

    def _split_prompts(self, prompt_rows: int) -> bool:
        """Whether the prefill's prompt rows are split over the batch axes: when they divide
        evenly; fewer prompts than that (each continued G times) are prefilled on every device."""
        return prompt_rows % self.batch_shards == 0

    def place_inputs(self, ids, positions, active, values: SamplingValues, key):
        """The prefill program's inputs on the devices, as it was compiled for them: host arrays
        transferred as they are (no conversion program runs on the devices), all in one
        device_put (one at a time, each paid the host's dispatch anew: ~7 of them a call)."""
        inputs = (ids, positions, active, values, key)
        if self.mesh is None:
            return jax.device_put(inputs)
        rows, whole = self._sharding(self._split_prompts(ids.shape[0])), self._sharding(False)
        return jax.device_put(inputs, (rows, rows, rows, whole, whole))

    def place_limit(self, limit: int):
        """The decode loop's step limit on the devices, placed once per value and kept (the
        programs never donate it): a call's decode then starts without a transfer to the
        devices."""
        if limit not in self._limits:
            self._limits[limit] = jax.device_put(np.int32(limit), self._sharding(False))
        return self._limits[limit]

    def last_logits(self, ids, positions):
        """The last position's float32 logits of a left-padded prompt batch (ids, positions [B, T]
        numpy, B a multiple of batch_shards), computed as prefill computes them; for checks
        against other placements and references (jitted here, not bucketed or cached)."""
        batch, prompt = ids.shape
        layout = self.layout("prefill", batch * prompt)

        def run(params, ids, positions):
            cache = self._empty_cache(batch, prompt)
            logits, _ = self._forward_cached(params, ids, positions, cache, jnp.int32(0), self.kernels, layout)
            return logits.astype(jnp.float32)

        rows = self._sharding(True)
        put = jnp.asarray if rows is None else (lambda x: jax.device_put(x, rows))
        program = jax.jit(run, compiler_options=self.compiler_options)
        return np.asarray(program(self.params_for(layout), put(ids), put(positions)))

    # ---- compiled programs ----------------------------------------------------------------------
    def _compiled(self, program: str, bucket: tuple, build):
        key = (program, bucket)
        if key not in self._programs:
            started, before = time.perf_counter(), compile_cache.events()
            self._programs[key] = build()
            now = compile_cache.events()
            from_cache = now["hits"] > before["hits"] and now["misses"] == before["misses"]
            self.compilations.append(Compilation(program, bucket, time.perf_counter() - started, from_cache))
        return self._programs[key]

    def prefill_program(self, batch: int, prompt: int, length: int, mode: SamplingMode, n_stop: int,
                        repeat: int = 1):
        """The prefill of `batch` prompt rows; with `repeat` G, each continued G times: the
        program's state has batch x G rows (prompt i's at i*G .. i*G + G - 1). It returns
        (DecodeState, FirstTokens); the decode program takes its `out_info[0]`."""
        def build():
            def prefill(*a):        # named: the program is jit_prefill in HLO and profiles
                return self._prefill(*a, length=length, mode=mode, repeat=repeat)
            fn = jax.jit(prefill)
            params = self.params_for(self.layout("prefill", batch * prompt))
            rows, whole = self._sharding(self._split_prompts(batch)), self._sharding(False)
            key = jax.random.key_data(jax.random.key(0))
            args = (params, _spec((batch, prompt), jnp.int32, rows), _spec((batch, prompt), jnp.int32, rows),
                    _spec((batch,), jnp.bool_, rows), _values_spec(n_stop, self.cfg.vocab_size, whole),
                    _spec(key.shape, key.dtype, whole))
            return fn.lower(*args).compile(self.compiler_options)
        return self._compiled("prefill", (batch, prompt, length, mode, n_stop, repeat), build)

    def decode_programs(self) -> dict:
        """{bucket: compiled program} of each decode loop compiled so far."""
        return {bucket: program for (kind, bucket), program in self._programs.items() if kind == "decode"}

    def decode_collectives(self) -> dict:
        """{bucket: loop_collectives(program)} of each compiled decode program."""
        return {bucket: loop_collectives(program) for bucket, program in self.decode_programs().items()}

    def decode_program(self, batch: int, length: int, mode: SamplingMode, n_stop: int, state_spec):
        def build():
            def decode_loop(*a):    # named: the program is jit_decode_loop in HLO and profiles
                return self._decode(*a, mode=mode)
            fn = jax.jit(decode_loop, donate_argnums=(1,))
            params = self.params_for(self.layout("decode", batch))
            whole = self._sharding(False)
            values = _values_spec(n_stop, self.cfg.vocab_size, whole)
            tpu = TPU_DECODE_OPTIONS if self.platform == "tpu" else {}
            return fn.lower(params, state_spec, _spec((), jnp.int32, whole), values).compile(
                {**tpu, **sharding.loop_compiler_options(self.mesh), **self.compiler_options})
        return self._compiled("decode", (batch, length, mode, n_stop), build)

    def first_run(self, prefill, decode, prompt_rows: int, prompt: int, values: SamplingValues) -> float:
        """Run a prefill and decode program once on an all-padding batch of their bucket (no row
        is live: the decode loop ends at once) and wait: the first run of a program loads it onto
        the devices. Returns the seconds it took; call it before timing the programs."""
        started = time.perf_counter()
        rows = np.zeros(prompt_rows, bool)
        args = self.place_inputs(np.zeros((prompt_rows, prompt), np.int32), np.full((prompt_rows, prompt), -1, np.int32),
                                 rows, values, jax.random.PRNGKey(0))
        state, _ = prefill(self.params_for(self.layout("prefill", prompt_rows * prompt)), *args)
        state = decode(self.params_for(self.layout("decode", state.last.shape[0])), state, self.place_limit(0), args[3])
        jax.block_until_ready(state)
        return time.perf_counter() - started

    @functools.cached_property
    def _lookup_tables(self) -> frozenset:
        """The names of the embeddings not tied to a Linear (a step reads only its rows' rows of
        them), found once: the walk over the modules was most of the 1.2 ms step_bytes took in a
        traced generate call on the chip's host, paid by every call."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        tied = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Linear)}
        return frozenset(names[id(m.weight)] for m in self.model.modules()
                         if isinstance(m, torch.nn.Embedding) and id(m.weight) not in tied)

    def step_bytes(self, rows: int, kv_tokens) -> tuple[float, float]:
        """(weight bytes, KV cache bytes) a decode step of `rows` rows must read at the least,
        per device: every parameter once as held (the compute dtype, or MXFP4 blocks), except
        the experts no row is routed to (of E per MoE layer, k per row: E (1 - (1 - k/E)^rows)
        expected under uniform routing, exactly k at one row) and, for an embedding not tied to
        the head, all but the rows' own; plus each layer's keys and values of the tokens each row
        holds (`kv_tokens`: per row, its prompt and generated tokens; a sliding layer at most its
        window; any array shape: [steps, rows] sums the KV bytes of several steps). Under a mesh,
        what one device holds of them (an even split)."""
        cfg = self.cfg
        experts, k = getattr(cfg, "n_experts", 0), getattr(cfg, "experts_per_token", 0)
        reached = experts * (1 - (1 - k / experts) ** rows) if experts else 0.0
        weights = 0.0
        for name, a in self.params.items():
            size = sharding.held_bytes(a) if self.mesh is not None else math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
            if name in self._lookup_tables:
                size *= min(rows, a.shape[0]) / a.shape[0]
            elif experts and "experts." in name and a.shape and a.shape[0] == experts:
                size *= reached / experts
            weights += size
        itemsize = jnp.dtype(COMPUTE_DTYPES[self.compute_dtype]).itemsize
        per_token = 2 * cfg.n_kv_heads * cfg.head_dim * itemsize
        tokens = np.asarray(kv_tokens, np.int64)
        kv = sum(per_token * np.minimum(tokens, cfg.window_of_layer(i) or tokens).sum() for i in range(cfg.n_layers))
        shards = 1 if self.mesh is None else self.mesh.devices.size
        return weights, float(kv) / shards


_COLLECTIVES = ("all-gather", "all-gather-start", "all-reduce", "all-reduce-start", "all-to-all", "reduce-scatter",
                "collective-permute", "collective-permute-start")


def loop_collectives(compiled) -> dict:
    """What a compiled decode program moves between devices, from its HLO, in bytes per device:
    `gathered_per_call`, the all-gathers outside its while loop (once per call: XLA hoists the
    parameters' gathers out of the loop when it can, and each device then holds them whole while
    decoding); `gathered_per_token`, those inside the loop (every generated token);
    `other_per_token`, the loop's other collectives (all-to-all, all-reduce, ...). All 0 without a mesh.
    One collective is counted once: the TPU compiler splits one into several instructions (its
    asynchronous start, continuation and end fusions) that share a `channel_id`."""
    from jax_bridge import hlo_text

    comps, _ = hlo_text.parse_module(compiled.as_text())
    bodies = [name for lines in (c[1] for c in comps.values()) for line in lines
              for name in re.findall(r"body=%([\w.\-]+)", line)]
    inside = set(hlo_text.closure(bodies, comps))
    out = {"gathered_per_call": 0.0, "gathered_per_token": 0.0, "other_per_token": 0.0}
    channels = set()
    for name, (_, lines) in comps.items():
        for line in lines:
            ins = hlo_text.parse_instruction(line)
            if ins is None or ins.opcode not in _COLLECTIVES:
                continue
            channel = re.search(r"channel_id=(\d+)", ins.attrs)
            if channel:
                if channel.group(1) in channels:
                    continue
                channels.add(channel.group(1))
            size = hlo_text.array_bytes(hlo_text.leaves(ins.shape)[-1])
            gather = ins.opcode.startswith("all-gather")
            key = ("gathered_per_token" if gather else "other_per_token") if name in inside else \
                ("gathered_per_call" if gather else None)
            if key:
                out[key] += size
    return {k: int(v) for k, v in out.items()}


def _spec(shape, dtype, placement=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=placement)


def _values_spec(n_stop: int, vocab_size: int, placement=None) -> SamplingValues:
    f32 = _spec((), jnp.float32, placement)
    return SamplingValues(f32, f32, f32, _spec((n_stop,), jnp.int32, placement),
                          _spec((vocab_size,), jnp.bool_, placement))


def sampling_values(temperature: float, top_p: float, penalty: float, stop_ids: tuple[int, ...], n_stop: int,
                    allowed: np.ndarray):
    """The traced sampling values, as host arrays (Decoder.place_inputs puts them on the devices);
    `allowed` [V] bool marks the ids that may be chosen."""
    stops = np.full(n_stop, -1, np.int32)
    stops[:len(stop_ids)] = stop_ids
    return SamplingValues(np.float32(temperature), np.float32(top_p), np.float32(penalty), stops,
                          np.asarray(allowed, np.bool_))
