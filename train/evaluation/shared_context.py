"""Requests that share a context, scored with the context computed once: which requests share
(`plan_batches`) and the two programs that score them (`ContextPrograms`): a prefill of the
contexts into a KV cache, then the continuations as rows reading that cache.

A request's context minus its last token is prefilled (left-padded rows, the model's own
`forward_cached` lowered by torchax); each continuation row is that last context token followed
by the continuation minus its last token, at the positions that follow its context, so every
scored target's log-probability comes from the continuation row itself. Only requests whose
window keeps the whole context (requests.window drops nothing) share. A truncated request's
window starts at a different token for each continuation length, so its tokens are not the
shared context followed by the continuation and there is nothing to share: it is scored by the
one-forward program, which is not a fallback but the same computation (the two agree with the
eager scorer to float rounding, tests/test_eval_scorer.py), done without the reuse.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from torch_model import kv_cache
from torch_model.lora import tracing_scope
from train.evaluation.target_logprobs import HiddenStates, positions_tile, request_scores

MIN_CONTINUATION = 8     # fewest continuation positions per row a program takes (> 1: see Attention.forward_cached)


class ContextBatch(NamedTuple):
    contexts: tuple[tuple[int, ...], ...]   # distinct contexts, prefilled once each
    rows: tuple[int, ...]                   # request indices, at most batch_size
    context_of_row: tuple[int, ...]         # each row's index into `contexts`


def plan_batches(contexts: Sequence[tuple[int, ...]], continuation_lengths: Sequence[int], indices: Sequence[int],
                 batch_size: int) -> list[ContextBatch]:
    """Batches of `batch_size` rows over the requests `indices`: grouped by context (longest
    contexts first, so a batch's contexts have similar lengths; each group's longest continuation
    first), cut every `batch_size` rows; a batch holds each of its distinct contexts once."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        groups.setdefault(contexts[i], []).append(i)
    ordered = sorted(groups.values(), key=lambda g: -len(contexts[g[0]]))
    flat = [i for g in ordered for i in sorted(g, key=lambda i: -continuation_lengths[i])]
    batches = []
    for start in range(0, len(flat), batch_size):
        rows = tuple(flat[start:start + batch_size])
        distinct = tuple(dict.fromkeys(contexts[i] for i in rows))
        slot = {c: k for k, c in enumerate(distinct)}
        batches.append(ContextBatch(distinct, rows, tuple(slot[contexts[i]] for i in rows)))
    return batches


def continuation_bucket(length: int) -> int:
    """Positions a continuation row is padded to: the next power of two, at least MIN_CONTINUATION."""
    return max(MIN_CONTINUATION, 1 << max(0, length - 1).bit_length())


def prefill_inputs(contexts: Sequence[tuple[int, ...]], rows: int, positions: int):
    """(ids, positions) [rows, positions] int32: each context minus its last token, left-padded
    (padding and missing rows at position kv_cache.EMPTY)."""
    ids = np.zeros((rows, positions), np.int32)
    pos = np.full((rows, positions), kv_cache.EMPTY, np.int32)
    for row, context in enumerate(contexts):
        fed = context[:-1]
        if fed:
            ids[row, positions - len(fed):] = fed
            pos[row, positions - len(fed):] = np.arange(len(fed))
    return ids, pos


def continuation_inputs(contexts, continuations, rows: int, positions: int):
    """(ids, positions, targets, scored) [rows, positions] for (context, continuation) pairs:
    ids = last context token + continuation[:-1] at the positions after the context, targets =
    the continuation; right padding at position kv_cache.EMPTY, never scored."""
    ids = np.zeros((rows, positions), np.int32)
    pos = np.full((rows, positions), kv_cache.EMPTY, np.int32)
    targets = np.zeros((rows, positions), np.int32)
    scored = np.zeros((rows, positions), bool)
    for row, (context, continuation) in enumerate(zip(contexts, continuations)):
        n = len(continuation)
        ids[row, :n] = (context[-1], *continuation[:-1])
        pos[row, :n] = np.arange(len(context) - 1, len(context) - 1 + n)
        targets[row, :n] = continuation
        scored[row, :n] = True
    return ids, pos, targets, scored


class ContextPrograms:
    """The programs of a CompiledScorer for shared contexts: prefill + score (a batch with new
    contexts, one call) and score (rows reading a kept cache), on the scorer's parameters,
    kernels, precision and tracing scope, compiled once per bucket by the scorer (`compiled`)."""

    def __init__(self, scorer, model: torch.nn.Module):
        import jax

        from jax_bridge import registry
        from jax_bridge.lowering import model_function

        self.scorer = scorer
        self.kernels = registry.resolve(scorer.step_cfg.kernels, scorer.step_cfg.platform,
                                        ops=registry.model_ops(model, registry.OPS + registry.GENERATION_OPS))
        self.forward_cached = model_function(HiddenStates(model), "forward_cached")
        self._prefill_jit = jax.jit(self._prefill_and_score, static_argnames="slots")
        self._score_jit = jax.jit(self._score)

    def _run(self, params, *args):
        import jax

        from jax_bridge import registry

        s = self.scorer
        with registry.routed(s.env, self.kernels, platform=s.step_cfg.platform, options=s.step_cfg.kernel_options,
                             generation=s.step_cfg.tpu_generation), \
                jax.default_matmul_precision(s.step_cfg.matmul_precision), tracing_scope(s.model):
            return self.forward_cached(s.layout.unstack(params), *args)

    def _prefill_and_score(self, params, context_ids, context_positions, *rows, slots: int):
        """The contexts prefilled into a cache of `slots` slots, then `_score` of the rows on it:
        (cache, summed log-probabilities, greedy flags), one program (one call per batch)."""
        import jax.numpy as jnp

        from jax_bridge.decoding import empty_cache

        s = self.scorer
        empty = empty_cache(s.env, s.model, context_ids.shape[0], slots, s.compute_dtype)
        _, cache = self._run(params, context_ids, context_positions, empty, jnp.int32(0))
        return (cache, *self._score(params, cache, *rows, jnp.int32(context_ids.shape[1])))

    def _score(self, params, cache, context_of_row, ids, positions, targets, scored, start):
        import jax

        s = self.scorer
        row_cache = jax.tree.map(lambda a: a[context_of_row], cache)       # each row reads its context
        hidden, _ = self._run(params, ids, positions, row_cache, start)
        tile = positions_tile(*ids.shape, s.cfg.vocab_size, 1)
        # Outside _run's scope: the head's matmul takes the step's precision as an argument.
        head = params[s.head_name] if s.head_name else None
        return request_scores(hidden, head, targets, scored, tile, s.step_cfg.matmul_precision)

    def prefill_and_score(self, context_ids: np.ndarray, context_positions: np.ndarray, slots: int, *rows):
        """(the contexts' KV cache of `slots` slots, on device; summed log-probability [rows];
        every target is the argmax [rows]) for left-padded contexts and continuation `rows`
        (context_of_row, ids, positions, targets, scored: see `score`)."""
        args = (context_ids, context_positions, *rows)
        key = ("prefill", *context_ids.shape, slots, *rows[1].shape)
        program = self.scorer.compiled(key, lambda: self._prefill_jit.lower(self.scorer.params, *map(_spec, args),
                                                                      slots=slots))
        return program(self.scorer.params, *args)

    def score(self, cache, context_of_row, ids, positions, targets, scored, start: int):
        """(summed log-probability [rows], every target is the argmax [rows]) of continuation
        rows reading `cache` (row r reads context context_of_row[r]); start: the prefill length."""
        import jax

        args = (context_of_row, ids, positions, targets, scored, np.int32(start))
        cache_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), cache)
        key = ("continue", len(cache.full_positions), cache.full_positions.shape[1], *ids.shape)
        program = self.scorer.compiled(key, lambda: self._score_jit.lower(self.scorer.params, cache_spec,
                                                                    *map(_spec, args)))
        return program(self.scorer.params, cache, *args)


def _spec(array):
    import jax

    return jax.ShapeDtypeStruct(np.shape(array), np.asarray(array).dtype)
