"""Choosing the next token from logits inside a compiled decode loop (pure JAX).

Order and semantics follow transformers' logits processors: repetition penalty (a seen token's
logit is divided by the penalty if positive, multiplied if negative), then temperature, top-k,
top-p (the smallest set of most likely tokens whose probability reaches p), then a categorical
draw. Temperature 0 is greedy (argmax after the penalty). What changes the program's structure
(greedy or not, k, whether top-p / the penalty apply) is static; the values are traced, so one
program serves every temperature, p and penalty.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingMode(NamedTuple):
    """The static part: one compiled program per distinct mode."""
    greedy: bool
    top_k: int            # 0: no top-k
    top_p: bool
    penalty: bool
    logprobs: bool = False    # also each chosen token's log-probability and the entropy (token_logprob)


class SamplingValues(NamedTuple):
    """The traced part (float32 / int32 scalars and the stop ids [S], -1 = unused). `allowed`
    [V] bool: the ids that may be chosen (those the tokenizer can decode); None allows all."""
    temperature: jax.Array
    top_p: jax.Array
    penalty: jax.Array
    stop_ids: jax.Array
    allowed: jax.Array | None = None


def apply_repetition_penalty(logits, seen, penalty):
    """logits [B, V] float32; seen [B, V] bool: tokens already in the row's prompt or output."""
    penalized = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalized, logits)


def top_p_keep(sorted_logits, top_p):
    """Keep mask over logits sorted in descending order: a token stays while the probability of
    the tokens before it is below p (so the first always stays)."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    return before < top_p


def next_token(logits, seen, key, mode: SamplingMode, values: SamplingValues):
    """-> (tokens [B] int32, next key). logits: [B, V] (any float dtype)."""
    logits = logits.astype(jnp.float32)
    if values.allowed is not None:      # never an id the tokenizer cannot decode (a padded vocabulary)
        logits = jnp.where(values.allowed, logits, -jnp.inf)
    if mode.penalty:
        logits = apply_repetition_penalty(logits, seen, values.penalty)
    if mode.greedy:
        return first_argmax(logits), key
    key, draw = jax.random.split(key)
    logits = logits / values.temperature
    if not mode.top_k and not mode.top_p:
        return jax.random.categorical(draw, logits, axis=-1).astype(jnp.int32), key
    # Candidates in descending order: the k best, or every token when only top-p applies.
    k = mode.top_k or logits.shape[-1]
    candidates, ids = jax.lax.top_k(logits, k)
    if mode.top_p:
        candidates = jnp.where(top_p_keep(candidates, values.top_p), candidates, -jnp.inf)
    choice = jax.random.categorical(draw, candidates, axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32), key


def token_logprob(logits, tokens, temperature):
    """(log-probability of each row's token [B], entropy [B]) under softmax(logits / temperature)
    over the WHOLE vocabulary: the model's distribution at that temperature, before the tokenizer
    mask, the repetition penalty, top-k and top-p (the policy whose log-probabilities the RL
    objective uses; the train step's cross-entropy sees the same vocabulary)."""
    z = logits.astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    return chosen, -(jnp.exp(logp) * logp).sum(-1)


def first_argmax(logits):
    """argmax over the last axis (the first of equal maxima), as two plain reductions: XLA:CPU
    runs jnp.argmax's variadic (value, index) reduce an order of magnitude slower."""
    best = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(logits == best, index, logits.shape[-1]), axis=-1)


def is_stop(tokens, stop_ids):
    """[B] bool: the token is one of the stop ids (stop_ids [S], -1 entries never match)."""
    return jnp.any((tokens[:, None] == stop_ids[None, :]) & (stop_ids[None, :] >= 0), axis=-1)


def mark_seen(seen, tokens):
    """seen [B, V] with tokens [B, T] added (entries < 0, i.e. padding, are dropped)."""
    rows = jnp.broadcast_to(jnp.arange(seen.shape[0])[:, None], tokens.shape)
    cols = jnp.where(tokens >= 0, tokens, seen.shape[1])      # out of range -> dropped
    return seen.at[rows, cols].set(True, mode="drop")
