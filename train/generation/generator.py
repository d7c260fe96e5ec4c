"""Text generation: one API (`generate`, `Generator`) for `torchlyra generate`, the trainer's
samples and `torchlyra bench generate`.

Prompts of any lengths are left-padded into one batch and prefilled in one call; decoding runs
in the compiled `lax.while_loop` of `jax_bridge.decoding` with a static KV cache and sampling
on device. Shapes are bucketed (batch to a power of two, prompt to a multiple of 32, prompt +
new tokens to a multiple of 64) so one pair of programs serves every request of a bucket; they
are compiled once per process, and the persistent JAX compilation cache makes a later process
load them instead of compiling. Compile time is reported apart from prefill and decode time.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from formats.errors import UserError
from train.generation.sampling import SamplingConfig


@dataclass
class Generation:
    """The result of one `generate` call. `tokens[i]`: the new tokens of prompt i (a stop token,
    when one ended the row, is the last). Times in seconds; compile time is kept apart."""
    tokens: list[list[int]]
    stopped: list[bool]
    bucket: tuple[int, int, int]          # (batch, prompt length, total length) compiled for
    compile_seconds: float                # compilations this call needed (0 when all were cached)
    compilations: list = field(default_factory=list)
    first_run_seconds: float = 0.0        # the new programs' first run (loading them), before any timing
    prefill_seconds: float = 0.0          # time to first token: prefill + first sample
    decode_seconds: float = 0.0
    decode_steps: int = 0                 # loop iterations after the first token
    rows: int = 0                         # real prompts (batch padding excluded)
    logprobs: list[list[float]] | None = None    # with SamplingConfig.logprobs: per new token, its
                                                 # log-probability under softmax(z / T), whole vocabulary
    entropies: list[list[float]] | None = None   # and that distribution's entropy
    decode_weight_bytes: float = 0.0      # what the decode steps must read at the least, summed over
    decode_kv_bytes: float = 0.0          # the steps (Decoder.step_bytes): weights, KV cache at its length
    hbm_bandwidth: float | None = None    # bytes/s of the TPU decoded on (roofline.CHIPS); None off TPU
    tpu_generation: str | None = None

    @property
    def decode_tokens_per_second(self) -> float:
        """Token slots per second of the decode loop, all rows together (a row that stopped early
        still counts its slots: the loop computes them)."""
        return self.rows * self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def floor_seconds(self) -> float | None:
        """The decode steps' HBM floor: the bytes they must read over the chip's HBM bandwidth
        (None off TPU: no published bandwidth to hold a CPU's time against)."""
        if self.hbm_bandwidth is None:
            return None
        return (self.decode_weight_bytes + self.decode_kv_bytes) / self.hbm_bandwidth

    @property
    def floor_share(self) -> float | None:
        """floor_seconds / decode_seconds: 1 would read every byte at the chip's bandwidth."""
        floor = self.floor_seconds
        return None if floor is None or self.decode_seconds <= 0 else floor / self.decode_seconds


class Generator:
    """A model ready to generate: its parameters on device and its compiled programs, kept
    across calls. `kernels` applies to prefill and decoding, `decode_kernels` (default: the same)
    to the decode loop alone; on CPU an MoE left at `auto` runs the `decode` implementation.
    With a `tokenizer`, only ids it can decode are ever chosen (the model's vocabulary may be
    larger: padded, or trained for another tokenizer); without one, any id of the model.
    `mesh` (jax_bridge.sharding.make_mesh): prefill and decoding run sharded by the training rules;
    with `weights`, over `sharding.inference_mesh(mesh)` (`self.mesh`): fsdp folded into tensor.
    `weights` (formats/lora_inference.open_inference_model): the source of the parameters the model
    holds on `meta`, each device's block read onto it (formats/mesh_loader.py) in `load_seconds`. `params`: the
    parameters by the model's names as arrays instead (e.g. a train state's, left on its devices;
    cast and placed as `set_params` does). `compute_dtype`: "float32" or "bfloat16" (None: the
    platform's, float32 on CPU and bf16 on accelerators; float32 decodes at "highest" precision).
    `kernel_options`: per-implementation options or a tile table, as for training (over the
    committed table of the TPU generation it runs on)."""

    def __init__(self, model, *, kernels: str | dict | None = "auto", decode_kernels: str | dict | None = None,
                 compile_cache: str | os.PathLike | None = None, tokenizer=None, mesh=None, weights=None,
                 params: dict | None = None, compute_dtype: str | None = None,
                 kernel_options: str | dict | None = None):
        import jax
        import numpy as np

        from jax_bridge import compile_cache as compile_cache_module
        from jax_bridge import registry
        from jax_bridge.decoding import Decoder, generation_kernels
        from jax_bridge.step import DEFAULT_COMPUTE_DTYPE
        from pallas_kernels.platform import host_platform
        from formats.tokenizer import decodable_ids

        self.allowed = (np.ones(model.cfg.vocab_size, bool) if tokenizer is None
                        else decodable_ids(tokenizer, model.cfg.vocab_size))

        self.compile_cache = compile_cache_module.enable(compile_cache)     # its directory, or None: off
        self.load_seconds: float | None = None      # reading `weights` onto the devices
        try:
            platform = host_platform()
            dtype = DEFAULT_COMPUTE_DTYPE[platform] if compute_dtype in (None, "auto") else compute_dtype
            if decode_kernels is not None:
                decode_kernels = generation_kernels(decode_kernels, platform, model)
            placed = None
            if weights is not None or params is not None:
                from jax_bridge.decoding import decoder_params

                if weights is not None and params is None:     # only run here: split for inference
                    from jax_bridge.model_on_mesh import ModelOnMesh

                    mesh = ModelOnMesh(model, mesh).for_inference(dtype).mesh
                placed = decoder_params(model, dtype, mesh)
                if weights is not None:
                    from formats import mesh_loader

                    started = time.perf_counter()
                    placed = jax.block_until_ready(mesh_loader.place_model(model, weights, placed, mesh))
                    self.load_seconds = time.perf_counter() - started
            self.decoder = Decoder(model, kernels=generation_kernels(kernels, platform, model),
                                   decode_kernels=decode_kernels, mesh=mesh, params=placed, compute_dtype=dtype,
                                   kernel_options=kernel_options)
            if params is not None:
                self.decoder.set_params(params)
        except registry.KernelError as e:
            raise UserError(str(e)) from None
        except ValueError as e:             # a mesh the model cannot be split over
            if mesh is None:
                raise
            raise UserError(f"generate --mesh: {e}") from None
        self.cfg, self.mesh = model.cfg, mesh

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike, **kwargs) -> "Generator":
        """The model of a checkpoint (ours, or a Hugging Face directory), restricted to the ids
        of its tokenizer when it has one."""
        model, tokenizer, weights = open_for_generation(directory, require_tokenizer=False)
        return cls(model, tokenizer=tokenizer, weights=weights, **kwargs)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig = SamplingConfig(), *,
                 on_tokens: Callable[[list[list[int]]], None] | None = None,
                 stream_every: int | None = None, samples_per_prompt: int = 1) -> Generation:
        """Continue each prompt (a list of token ids); with `samples_per_prompt` G, G times each
        (rows prompt-major: prompt i's samples are rows i*G .. i*G + G - 1), its prefill computed
        once and its KV cache copied G times. `on_tokens(new)` receives, per row, the tokens
        produced since its previous call: after the first token and then every `stream_every`
        decode steps (default: once, at the end). It may return the indices of rows to end there
        (a stop string seen in their text): they produce nothing more."""
        import jax
        import numpy as np

        from jax_bridge.decoding import buckets, sampling_values, stop_slots
        from jax_bridge.sharding import start_host_copies
        from torch_model.kv_cache import left_pad

        cfg, decoder = self.cfg, self.decoder
        prompts = [list(p) for p in prompts]
        _check_request(cfg, prompts, sampling, stream_every)
        longest, n_new = max(len(p) for p in prompts), sampling.max_new_tokens
        if not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
            raise ValueError(f"generate: samples_per_prompt must be a positive integer, found {samples_per_prompt!r}")
        group = samples_per_prompt
        rows = len(prompts) * group
        prompt_rows, prompt_len, length = buckets(len(prompts), longest, n_new, decoder.batch_shards, group)
        batch = prompt_rows * group
        mode = sampling.mode(cfg.vocab_size)
        n_stop = stop_slots(len(sampling.stop_tokens))
        before = len(decoder.compilations)
        prefill = decoder.prefill_program(prompt_rows, prompt_len, length, mode, n_stop, repeat=group)
        decode = decoder.decode_program(batch, length, mode, n_stop, prefill.out_info[0])
        compiled = decoder.compilations[before:]
        values = sampling_values(sampling.temperature or 1.0, sampling.top_p, sampling.repetition_penalty,
                                 sampling.stop_tokens, n_stop, self.allowed)
        first_run = decoder.first_run(prefill, decode, prompt_rows, prompt_len, values) if compiled else 0.0

        started = time.perf_counter()                  # time to first token: from here, compilation done
        ids, positions = left_pad(prompts + [[]] * (prompt_rows - len(prompts)), prompt_len)
        active = np.arange(prompt_rows) < len(prompts)
        args = decoder.place_inputs(ids.numpy().astype(np.int32), positions.numpy().astype(np.int32), active, values,
                                    jax.random.PRNGKey(sampling.seed))
        state, first = prefill(decoder.params_for(decoder.layout("prefill", prompt_rows * prompt_len)), *args)
        # Unstreamed, nothing the host learns from the first token changes the decode: its loop is
        # queued behind the prefill before the host waits, and the device runs the two back to back
        # (apart, it idled from the prefill's end until the first token's round trip and the loop's
        # dispatch were done: 1.47 ms in a 128-token call at one row on a v5e, 3% of its decode).
        # Not where the first tokens span processes: gathering them is a program, which would
        # wait for the whole loop.
        queued = on_tokens is None and n_new > 1 and all(x.is_fully_addressable for x in first)
        decode_params = decoder.params_for(decoder.layout("decode", batch))
        if queued:
            start_host_copies(first)
            state = decode(decode_params, state, decoder.place_limit(n_new), args[3])
        first_tokens, first_done = _host(first)
        prefill_seconds = time.perf_counter() - started
        emitted = 1
        if on_tokens is not None:
            ending = on_tokens(_new_tokens(first_tokens[:, None], rows, 0, 0, 1))     # a one-column token array
            state, first_done = _end_rows(state, first_done, ending)

        started = time.perf_counter()
        steps, done, tokens = 1, bool(first_done.all()), None
        chunk = stream_every or n_new
        while queued or (steps < n_new and not done):
            if not queued:
                state = decode(decode_params, state, decoder.place_limit(min(steps + chunk, n_new)), args[3])
            queued = False
            # One wait per chunk: the step, the rows' state and the tokens fetched together (apart,
            # each waited for a round trip of its own inside the timed decode).
            step, finished, tokens = _host((state.step, state.done, state.tokens))
            if on_tokens is not None:
                ending = on_tokens(_new_tokens(tokens, rows, prompt_len, emitted, int(step)))
                state, finished = _end_rows(state, finished, ending)
                emitted = int(step)
            steps, done = int(step), bool(finished.all())
        decode_seconds = time.perf_counter() - started
        if tokens is None:      # no decode ran: the prefill's tokens
            tokens = _host(state.tokens)

        new = _new_tokens(tokens, rows, prompt_len, 0, steps)
        stop = set(sampling.stop_tokens)
        logprobs = entropies = None
        if sampling.logprobs:
            logprobs = _new_values(_host(state.logps), tokens, rows, prompt_len, steps)
            entropies = _new_values(_host(state.entropy), tokens, rows, prompt_len, steps)
        # The decode steps 1 .. steps-1: at step t each row holds its prompt and t tokens.
        held = np.repeat([len(p) for p in prompts], group)[None, :] + np.arange(1, steps)[:, None]
        weight_bytes, kv_bytes = decoder.step_bytes(rows, held)
        weight_bytes *= steps - 1
        bandwidth = None
        if decoder.platform == "tpu" and decoder.tpu_generation is not None:
            from jax_bridge.roofline import device_peaks

            bandwidth = device_peaks(decoder.tpu_generation)[1]
        return Generation(tokens=new, stopped=[bool(t) and t[-1] in stop for t in new],
                          bucket=(batch, prompt_len, length), compile_seconds=sum(c.seconds for c in compiled),
                          compilations=compiled, first_run_seconds=first_run, prefill_seconds=prefill_seconds,
                          decode_seconds=decode_seconds, decode_steps=steps - 1, rows=rows, logprobs=logprobs,
                          entropies=entropies, decode_weight_bytes=weight_bytes, decode_kv_bytes=kv_bytes,
                          hbm_bandwidth=bandwidth, tpu_generation=decoder.tpu_generation)

    def set_params(self, params: dict) -> None:
        """The policy's current parameters (all of them, by the model's names), as arrays: the
        compiled programs are reused (jax_bridge.decoding.Decoder.set_params)."""
        self.decoder.set_params(params)


def _check_request(cfg, prompts: list[list[int]], sampling: SamplingConfig, stream_every: int | None) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("generate: give at least one prompt, each with at least one token")
    bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UserError(f"generate: token id {bad[0]} is outside the model's vocabulary [0, {cfg.vocab_size})")
    if stream_every is not None and stream_every < 1:
        raise UserError(f"generate: stream_every must be >= 1, found {stream_every}")
    longest = max(len(p) for p in prompts)
    if cfg.max_position_embeddings and longest + sampling.max_new_tokens > cfg.max_position_embeddings:
        raise UserError(f"generate: {longest} prompt tokens + {sampling.max_new_tokens} new ones exceed the "
                        f"model's max_position_embeddings ({cfg.max_position_embeddings})")


def _ended(shape, rows):
    """[B] bool: the rows a caller ended (on_tokens' answer)."""
    import numpy as np

    ending = np.zeros(shape, bool)
    if rows:
        ending[list(rows)] = True
    return ending


def _end_rows(state, done, rows):
    """(the decode state with these rows marked done (a caller's verdict, e.g. a stop string), in
    the placement the compiled decode program expects; the rows' done flags on the host). `done`:
    the state's flags as last fetched."""
    import jax

    if not rows:
        return state, done
    done = done | _ended(done.shape, rows)
    return state._replace(done=jax.device_put(done, state.done.sharding)), done


def _host(array):
    """A program's output as numpy on every process: gathered from the others' devices where the
    mesh spans processes (each runs the same generation in lockstep)."""
    from jax_bridge.sharding import to_host

    return to_host(array)


def _new_tokens(tokens, rows: int, prompt_len: int, start: int, stop: int) -> list[list[int]]:
    """Generated tokens start..stop-1 of each real row (-1 marks steps after the row stopped)."""
    block = tokens[:rows, prompt_len + start:prompt_len + stop]
    return [[int(t) for t in row if t >= 0] for row in block]


def _new_values(values, tokens, rows: int, prompt_len: int, stop: int) -> list[list[float]]:
    """Per real row, the values [B, L] at its generated tokens (as _new_tokens picks them)."""
    block, kept = values[:rows, prompt_len:prompt_len + stop], tokens[:rows, prompt_len:prompt_len + stop]
    return [[float(v) for v, t in zip(vrow, trow) if t >= 0] for vrow, trow in zip(block, kept)]


def generate(model_or_checkpoint, prompts: list[list[int]], sampling: SamplingConfig | None = None, *,
             kernels: str | dict | None = "auto", decode_kernels: str | dict | None = None,
             on_tokens=None, stream_every: int | None = None, tokenizer=None, **sampling_fields) -> Generation:
    """Generate from a torch model, a checkpoint directory or a `Generator` (which keeps its
    compiled programs: reuse one to generate repeatedly). Sampling settings come as a
    SamplingConfig or as its fields (max_new_tokens=..., temperature=..., ...). `tokenizer`
    (for a torch model): only ids it can decode are chosen; a checkpoint brings its own."""
    if sampling is None:
        sampling = SamplingConfig(**sampling_fields)
    elif sampling_fields:
        sampling = dataclasses.replace(sampling, **sampling_fields)
    if isinstance(model_or_checkpoint, Generator):
        generator = model_or_checkpoint
    elif isinstance(model_or_checkpoint, (str, os.PathLike)):
        generator = Generator.from_checkpoint(model_or_checkpoint, kernels=kernels, decode_kernels=decode_kernels)
    else:
        generator = Generator(model_or_checkpoint, kernels=kernels, decode_kernels=decode_kernels, tokenizer=tokenizer)
    return generator.generate(prompts, sampling, on_tokens=on_tokens, stream_every=stream_every)


def load_model(checkpoint: str | os.PathLike, *, merge: bool = False):
    """The float32 torch model of a checkpoint (through the one checkpoint loader: ours, or a
    Hugging Face directory; a LoRA checkpoint: base + adapters, merged if `merge`)."""
    from formats.lora_inference import load_inference_model

    return load_inference_model(checkpoint, merge=merge)[0]


def load_for_generation(checkpoint: str | os.PathLike, *, require_tokenizer: bool = True, merge: bool = False,
                        base_dtype: str = "compute"):
    """(model, tokenizer) of a checkpoint: one written by `torchlyra train` / `import`, or a
    Hugging Face directory (its tokenizer when recognised). A LoRA checkpoint gives its base with
    peft's LoRA layers (unmerged), or with `merge` the adapters merged into the weights. The
    tokenizer is None only when not required. base_dtype "mxfp4": the experts of a released gpt-oss
    base kept MXFP4 (formats/lora_inference.load_inference_model)."""
    from formats.lora_inference import inference_tokenizer, load_inference_model

    model, meta = load_inference_model(checkpoint, merge=merge, base_dtype=base_dtype)
    tokenizer, found = inference_tokenizer(checkpoint, meta)
    if tokenizer is None and require_tokenizer:
        raise UserError(f"checkpoint {checkpoint}: no tokenizer to generate text with (tokenizer: {found})")
    return model, tokenizer


def open_for_generation(checkpoint: str | os.PathLike, *, require_tokenizer: bool = True, merge: bool = False,
                        base_dtype: str = "compute"):
    """(model, tokenizer, weights) of a checkpoint as `load_for_generation` takes them, its weights
    left in their files for `Generator(weights=...)` to read onto the devices
    (formats/lora_inference.open_inference_model; weights None: the model holds them)."""
    from formats.lora_inference import inference_tokenizer, open_inference_model

    model, meta, weights = open_inference_model(checkpoint, merge=merge, base_dtype=base_dtype)
    tokenizer, found = inference_tokenizer(checkpoint, meta)
    if tokenizer is None and require_tokenizer:
        raise UserError(f"checkpoint {checkpoint}: no tokenizer to generate text with (tokenizer: {found})")
    return model, tokenizer, weights
