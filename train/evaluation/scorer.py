"""The compiled scorer: log-likelihoods of continuations from one jitted forward of the lowered
model (the train step's kernels, dtype and precision defaults, sharded by the training mesh
rules), requests sorted by length and batched into bucketed shapes that compile once each.

Each bucket's program takes right-padded token rows and the positions of each row's scored
targets (its continuation) and returns, per row, the summed target log-probability and whether
every scored target is the argmax: logits are formed on device, for the scored positions only, a
slice at a time, and never leave it. Right padding needs no attention mask: attention is causal,
so no real position sees a pad token. Requests that share a context (a multiple-choice
question's choices) compute it once instead: train.evaluation.shared_context.
"""
from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from torch_model.lora import tracing_scope
from formats.errors import UserError
from train.evaluation.requests import (GenerationRequest, GenerationResult, Loglikelihood, LoglikelihoodRequest,
                                       window)
from train.evaluation.shared_context import (ContextPrograms, continuation_bucket, continuation_inputs,
                                             plan_batches, prefill_inputs)
from train.evaluation.target_logprobs import Compilation, HiddenStates, head_name, positions_tile, request_scores

MIN_LENGTH = 16                  # shortest length bucket (positions per row)
MIN_SCORED = 8                   # fewest scored positions per row a program takes
IN_FLIGHT = 4                    # batches dispatched ahead of the one whose results are read


def length_bucket(positions: int, max_length: int) -> int:
    """Positions a row is padded to: the next of 16, 24, 32, 48, 64, 96, ... (powers of two and
    1.5 x powers of two: at most a third of a row is padding), at most max_length."""
    power = 1 << max(0, positions - 1).bit_length()
    bucket = power * 3 // 4 if power >= 2 * MIN_LENGTH and positions <= power * 3 // 4 else power
    return min(max(MIN_LENGTH, bucket), max_length)


def scored_bucket(targets: int, positions: int) -> int:
    """Scored positions a row's program takes: the next power of two (at least MIN_SCORED), at
    most the row's positions."""
    return min(max(MIN_SCORED, 1 << max(0, targets - 1).bit_length()), positions)


def rows_bucket(rows: int, batch_size: int, shards: int) -> int:
    """Rows a batch is padded to: a full batch is batch_size; a last partial one the next power
    of two below it; either rounded up to a multiple of the mesh's batch shards."""
    rows = batch_size if rows >= batch_size else min(batch_size, 1 << max(0, rows - 1).bit_length())
    return -(-rows // shards) * shards


class CompiledScorer:
    """`loglikelihood(requests)` on the lowered model (see the module docstring). `mesh`: None
    (one device), a `--mesh` spec string or a jax Mesh; `compute_dtype` None: the train step's
    default for the platform (CPU float32, TPU/GPU bfloat16), and its matmul precision with it.
    Parameters are held in the compute dtype (the router in float32, as in the step).
    `share_contexts` (default: without a mesh): requests with the same context compute it once
    (train.evaluation.shared_context); not built under a mesh, where every request runs the
    one-forward program. `weights`: where the parameters the model holds on `meta` are read
    from, each device's block placed directly (formats/lora_inference.open_inference_model), over
    `sharding.inference_mesh(mesh)` (`self.mesh`: fsdp folded into tensor); `set_params` gives it
    parameters as arrays instead, on `mesh` as given."""

    def __init__(self, model: torch.nn.Module, *, kernels: str | dict | None = "xla", mesh=None,
                 batch_size: int = 16, max_length: int | None = None, compute_dtype: str | None = None,
                 platform: str | None = None, scan_layers: bool = True, progress: bool = True, tokenizer=None,
                 share_contexts: bool | None = None, weights=None):
        import jax

        from jax_bridge import registry, sharding
        from jax_bridge.env import get_env
        from jax_bridge.layer_stack import layered_forward
        from jax_bridge.model_on_mesh import ModelOnMesh
        from jax_bridge.step import COMPUTE_DTYPES, StepConfig

        cfg = model.cfg
        self.max_length = max_length or cfg.max_seq_len
        if not 0 < self.max_length <= cfg.max_position_embeddings:
            raise UserError(f"scorer: max_length must be in [1, {cfg.max_position_embeddings}] "
                            f"(the model's max_position_embeddings), found {self.max_length}")
        if batch_size < 1:
            raise UserError(f"scorer: batch_size must be >= 1, found {batch_size}")
        try:
            self.step_cfg = StepConfig(kernels=kernels, compute_dtype=compute_dtype, platform=platform,
                                       scan_layers=scan_layers)
            self.kernels = registry.resolve(self.step_cfg.kernels, self.step_cfg.platform, ops=registry.model_ops(model))
        except (registry.KernelError, ValueError) as e:
            raise UserError(f"scorer: {e}") from None
        if isinstance(mesh, str):
            try:
                mesh = sharding.make_mesh(mesh)
            except ValueError as e:
                raise UserError(str(e)) from None
        try:
            self.on_mesh = ModelOnMesh(model, mesh, scan_layers=scan_layers)
            if weights is not None:          # only run here: split for inference
                self.on_mesh = self.on_mesh.for_inference(self.step_cfg.compute_dtype)
        except ValueError as e:
            raise UserError(f"--mesh: {e}") from None
        mesh = self.on_mesh.mesh
        self.cfg, self.mesh, self.batch_size, self.progress = cfg, mesh, batch_size, progress
        self.model, self.tokenizer, self.kernel_spec = model, tokenizer, kernels
        self._generator = None          # generate()'s GreedyGenerator, built on first use
        self.shards = 1 if mesh is None else sharding.batch_shards(mesh)
        self.env = get_env()
        self.compute_dtype = COMPUTE_DTYPES[self.step_cfg.compute_dtype]
        self.layout = self.on_mesh.layers
        self.forward = layered_forward(HiddenStates(model), self.layout, mesh=mesh)
        self.head_name = head_name(model)
        self.compilations: list[Compilation] = []
        self._programs: dict[tuple, object] = {}
        self.weights = weights          # the source of what the model holds on `meta` (formats/mesh_loader.py)
        if weights is not None:
            from formats import mesh_loader

            self.params = mesh_loader.place_model(model, weights, self.abstract_params(model), mesh, layout=self.layout)
        else:
            self.params = None if next(model.parameters()).is_meta else self._place(model)
        self._jitted = jax.jit(self._score, compiler_options=sharding.compiler_options(mesh))
        if share_contexts and mesh is not None:
            raise UserError("scorer: share_contexts is not built under a mesh (leave it unset there)")
        self.context_programs = None
        if share_contexts or (share_contexts is None and mesh is None and getattr(model, "kv_cache", True)):
            try:
                self.context_programs = ContextPrograms(self, model)
            except (registry.KernelError, ValueError) as e:
                raise UserError(f"scorer: {e}") from None

    # ---- parameters --------------------------------------------------------------------------------
    def _host_params(self, model) -> dict:
        from jax_bridge.step import cast_params, host_array

        host = {name: host_array(p) for name, p in model.named_parameters()}
        return self.layout.stack(cast_params(host, self.compute_dtype))

    def _place(self, model) -> dict:
        return self.on_mesh.place(self._host_params(model))

    def set_params(self, params: dict) -> None:
        """New values for every parameter, named as this scorer's layout stacks them (a train
        state's with the same `scan_layers`), any float dtype: cast to the compute dtype where
        the scorer holds it so and placed on its shardings (device arrays stay on their devices;
        nothing is gathered). The compiled programs are reused."""
        from jax_bridge.step import replace_params

        abstract = self.abstract_params(self.model)
        shardings = None if self.mesh is None else {n: a.sharding for n, a in abstract.items()}
        self.params = replace_params(params, abstract, self.compute_dtype, shardings, "CompiledScorer.set_params")

    def abstract_params(self, model) -> dict:
        """The parameters' shapes, dtypes and shardings as the program takes them (the model may
        live on the `meta` device): for compiling without weights (`lower`)."""
        import jax

        from jax_bridge.lowering import abstract_params
        from jax_bridge.step import in_compute_dtype

        flat = {n: jax.ShapeDtypeStruct(a.shape, self.compute_dtype if in_compute_dtype(n, a.dtype) else a.dtype)
                for n, a in abstract_params(model).items()}
        stacked = self.layout.stack(flat, stack=lambda xs: jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype))
        shardings = self.on_mesh.shardings(stacked)
        if shardings is None:
            return stacked
        return {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[n]) for n, a in stacked.items()}

    # ---- the program -------------------------------------------------------------------------------
    def _score(self, params, tokens, index, scored):
        """tokens [B, T + 1] int32 (right-padded); index [B, K] int32: positions t whose target
        tokens[:, t + 1] is scored, where scored [B, K] is True -> (summed log-probability [B]
        float32, every scored target is the argmax [B])."""
        import jax
        import jax.numpy as jnp

        from jax_bridge import registry, sharding

        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        rows, width = index.shape
        tile = positions_tile(rows, width, self.cfg.vocab_size, self.shards)
        with registry.routed(self.env, self.kernels, platform=self.step_cfg.platform,
                             options=self.step_cfg.kernel_options, mesh=self.mesh,
                             generation=self.step_cfg.tpu_generation), \
                jax.default_matmul_precision(self.step_cfg.matmul_precision), tracing_scope(self.model):
            hidden = sharding.constrain(self.forward(params, inputs), self.mesh, ("batch", None, None))
            picked = jnp.take_along_axis(hidden, index[..., None], axis=1)            # [B, K, H]
            head = params[self.head_name] if self.head_name else None
            return request_scores(picked, head, jnp.take_along_axis(targets, index, 1), scored,
                                  tile, self.step_cfg.matmul_precision)

    def _batch_specs(self, rows: int, positions: int, scored: int):
        import jax
        import jax.numpy as jnp

        shard = self._batch_sharding()
        return (jax.ShapeDtypeStruct((rows, positions + 1), jnp.int32, sharding=shard),
                jax.ShapeDtypeStruct((rows, scored), jnp.int32, sharding=shard),
                jax.ShapeDtypeStruct((rows, scored), jnp.bool_, sharding=shard))

    def _batch_sharding(self):
        from jax_bridge import sharding

        if self.mesh is None:
            return None
        return sharding.rows_sharding(self.mesh)

    def lower(self, rows: int, positions: int, scored: int | None = None, params=None):
        """The scoring program of one bucket as a `jax.stages.Lowered`; scored: positions scored
        per row (default all); params: abstract ones from `abstract_params` to compile without
        weights (default this scorer's)."""
        return self._jitted.lower(params if params is not None else self.params,
                                  *self._batch_specs(rows, positions, scored or positions))

    def program(self, rows: int, positions: int, scored: int):
        """The compiled program of a bucket: compiled on first use, then kept."""
        return self.compiled((rows, positions, scored), lambda: self.lower(rows, positions, scored))

    def compiled(self, key: tuple, lower):
        """The program under `key`, `lower()` compiled on first use (the time recorded in
        `compilations`), then kept: every program of this scorer, shared-context ones included."""
        if key not in self._programs:
            started = time.perf_counter()
            self._programs[key] = lower().compile()
            self.compilations.append(Compilation(key, time.perf_counter() - started))
        return self._programs[key]

    # ---- requests ----------------------------------------------------------------------------------
    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]:
        """Results in request order. Requests are windowed (requests.window: lm-eval's left
        truncation) and run in batches of `batch_size` rows: with `context_programs`, those whose
        window keeps the whole context grouped by context (each context computed once per batch,
        and kept for the next batch when it has the same contexts: batch size 1 reuses it across
        a multiple-choice question's choices), the others sorted longest first, one forward each."""
        from tqdm import tqdm

        if self.params is None:
            raise UserError("scorer: built without weights (a meta-device model): it can only be lowered")
        windows = [window(r, self.max_length) for r in requests]
        for i, (tokens, _, _) in enumerate(windows):
            bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise UserError(f"loglikelihood request {i}: token id {bad[0]} is outside the model's vocabulary "
                                f"[0, {self.cfg.vocab_size})")
        shared = [i for i, w in enumerate(windows) if w[2] == 0] if self.context_programs is not None else []
        alone = sorted(set(range(len(windows))) - set(shared), key=lambda i: -len(windows[i][0]))
        results: list[Loglikelihood | None] = [None] * len(windows)
        in_flight: collections.deque = collections.deque()

        def collect(bar):
            from jax_bridge import sharding

            chunk, logprob, greedy = in_flight.popleft()
            logprob, greedy = sharding.to_host((logprob, greedy))     # on every process: the mesh may span them
            for row, i in enumerate(chunk):
                _, n, dropped = windows[i]
                results[i] = Loglikelihood(logprob=float(logprob[row]), greedy=bool(greedy[row]), tokens=n,
                                           truncated=dropped)
            bar.update(len(chunk))

        with tqdm(total=len(windows), desc="loglikelihood", unit="req", disable=not self.progress or None) as bar:
            # Dispatched without waiting: the host prepares the next batches while these run.
            batches = [self._dispatch_shared(requests, shared)] if shared else []
            batches.append(self._dispatch_alone(windows, alone))
            for batch in (b for dispatched in batches for b in dispatched):
                in_flight.append(batch)
                if len(in_flight) > IN_FLIGHT:
                    collect(bar)
            while in_flight:
                collect(bar)
        return results

    def _dispatch_alone(self, windows, order):
        """(request indices, log-probabilities, greedy flags) per batch of the one-forward program."""
        import jax

        shard = self._batch_sharding()
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            rows = rows_bucket(len(chunk), self.batch_size, self.shards)
            positions = length_bucket(len(windows[chunk[0]][0]) - 1, self.max_length)
            width = scored_bucket(max(windows[i][1] for i in chunk), positions)
            tokens = np.zeros((rows, positions + 1), np.int32)
            index = np.zeros((rows, width), np.int32)
            scored = np.zeros((rows, width), bool)
            for row, i in enumerate(chunk):
                ids, n, _ = windows[i]
                tokens[row, :len(ids)] = ids
                index[row, :n] = np.arange(len(ids) - 1 - n, len(ids) - 1)   # the continuation's targets
                scored[row, :n] = True
            program = self.program(rows, positions, width)
            inputs = (jax.device_put(a, shard) for a in (tokens, index, scored))
            yield (chunk, *program(self.params, *inputs))

    def _dispatch_shared(self, requests, indices):
        """(request indices, log-probabilities, greedy flags) per batch of shared-context rows:
        one program prefills the batch's contexts and scores its rows on them; a batch with the
        previous batch's contexts scores its rows on the kept cache instead."""
        contexts = [r.context for r in requests]
        lengths = [len(r.continuation) for r in requests]
        previous = None          # (contexts, prefill length, cache) of the last prefill
        for batch in plan_batches(contexts, lengths, indices, self.batch_size):
            rows = rows_bucket(len(batch.rows), self.batch_size, 1)
            width = continuation_bucket(max(lengths[i] for i in batch.rows))
            prefill = length_bucket(max(len(c) for c in batch.contexts) - 1, self.max_length)
            context_of_row = np.zeros(rows, np.int32)
            context_of_row[:len(batch.rows)] = batch.context_of_row
            inputs = (context_of_row, *continuation_inputs([contexts[i] for i in batch.rows],
                                                           [requests[i].continuation for i in batch.rows], rows, width))
            kept = previous is not None and previous[0] == batch.contexts
            if kept and previous[2].full_positions.shape[1] >= prefill + width:     # the cache has room for these rows
                yield (list(batch.rows), *self.context_programs.score(previous[2], *inputs, start=prefill))
                continue
            context_rows = rows_bucket(len(batch.contexts), self.batch_size, 1)
            ids, positions = prefill_inputs(batch.contexts, context_rows, prefill)
            cache, logprob, greedy = self.context_programs.prefill_and_score(ids, positions, prefill + width, *inputs)
            previous = (batch.contexts, prefill, cache)
            yield list(batch.rows), logprob, greedy

    def generator(self):
        """The GreedyGenerator on the same model, kernels, mesh, batch size and window, built once;
        needs the tokenizer (stop strings are text)."""
        if self.tokenizer is None:
            raise UserError("scorer: generation needs the model's tokenizer (this checkpoint has none)")
        if self._generator is None:
            from train.evaluation.greedy import GreedyGenerator

            self._generator = GreedyGenerator(self.model, self.tokenizer, kernels=self.kernel_spec, mesh=self.mesh,
                                              batch_size=self.batch_size, max_length=self.max_length,
                                              weights=self.weights)
        return self._generator

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Greedy continuations (`generator()`)."""
        return self.generator().generate(requests, progress=self.progress)


# ---- loading ------------------------------------------------------------------------------------
def checkpoint_info(meta: dict) -> dict:
    """What a report card says of the model: its name, where it was read from, the step and the
    tokens seen (step x micro-batches x batch x sequence length of its train config: the token
    slots trained by this run; None when the checkpoint has no train config, e.g. an import)."""
    step_dir = Path(meta["step_dir"])
    if meta.get("hf_dir"):
        name = step_dir.name
    else:
        name = step_dir.parent.parent.name if step_dir.parent.name == "checkpoints" else step_dir.parent.name
    run = meta.get("train_config") or {}
    per_step = [run.get(k) for k in ("micro_batches", "batch_size", "seq_len")]
    tokens = int(meta["step"]) * int(np.prod(per_step)) if all(isinstance(v, int) for v in per_step) else None
    return {"model": name, "preset": run.get("preset"), "checkpoint": str(step_dir), "step": int(meta["step"]),
            "tokens_seen": tokens}


def load_evaluated_model(checkpoint_or_hf_dir, *, merge: bool = False, base_dtype: str = "compute"):
    """(float32 model in eval mode, tokenizer or None, one line saying which tokenizer, info) of a
    checkpoint (run, checkpoints or step directory), a Hugging Face GptOss directory or a LoRA
    checkpoint (base + adapters unmerged, or merged with `merge`), loaded as every inference
    command loads them; info: `checkpoint_info`."""
    from formats.lora_inference import inference_tokenizer, load_inference_model

    model, meta = load_inference_model(checkpoint_or_hf_dir, merge=merge, base_dtype=base_dtype)
    tokenizer, found = inference_tokenizer(checkpoint_or_hf_dir, meta)
    return model, tokenizer, found, checkpoint_info(meta)


def load_scorer(checkpoint_or_hf_dir, *, kernels: str | dict | None = "auto", mesh=None, batch_size: int = 16,
                max_length: int | None = None, merge: bool = False, base_dtype: str = "compute", **scorer_options):
    """(CompiledScorer, tokenizer or None, info) of a checkpoint (as `load_evaluated_model` reads
    it), its weights read from their files onto the scorer's devices. Other keywords go to
    CompiledScorer."""
    from formats.lora_inference import inference_tokenizer, open_inference_model

    model, meta, weights = open_inference_model(checkpoint_or_hf_dir, merge=merge, base_dtype=base_dtype)
    tokenizer, _ = inference_tokenizer(checkpoint_or_hf_dir, meta)
    scorer = CompiledScorer(model, kernels=kernels, mesh=mesh, batch_size=batch_size, max_length=max_length,
                            tokenizer=tokenizer, weights=weights, **scorer_options)
    info = checkpoint_info(meta)
    return scorer, tokenizer, info
