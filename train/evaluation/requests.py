"""What an evaluation asks of a model and what it gets back: the token-level requests shared by
the task runner, the lm-eval backend and every scorer (the compiled one and the eager reference).

Truncation follows lm-eval's `hf` backend: a request longer than the window keeps its last
`max_length + 1` tokens (context dropped from the left); the count dropped is reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from formats.errors import UserError


@dataclass(frozen=True)
class LoglikelihoodRequest:
    """Score `continuation` after `context` (token ids). The context is never empty: a caller
    that has none puts the document start (BOS) there, as lm-eval puts its prefix token."""
    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class Loglikelihood:
    logprob: float        # sum over the continuation of log p(token | all tokens before it)
    greedy: bool          # every continuation token is the argmax of its distribution
    tokens: int           # continuation tokens scored
    truncated: int        # context tokens dropped from the left to fit the window


@dataclass(frozen=True)
class GenerationRequest:
    """Greedy continuation of `prompt` for at most `max_new_tokens` tokens, cut before the first
    of the `stop` strings (and at the tokenizer's stop tokens)."""
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    text: str             # decoded continuation, cut before the stop string that ended it
    tokens: tuple[int, ...]
    truncated: int        # prompt tokens dropped from the left to fit the window


class Scorer(Protocol):
    """A model that answers requests. `max_length`: the window (positions one forward sees)."""
    max_length: int

    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]: ...


def window(request: LoglikelihoodRequest, max_length: int) -> tuple[list[int], int, int]:
    """(tokens fed + the last target: at most max_length + 1 ids, continuation count, context
    tokens dropped). The model reads tokens[:-1] and predicts tokens[1:]."""
    if not request.context:
        raise UserError("loglikelihood request: empty context (put the document start token there)")
    if not request.continuation:
        raise UserError("loglikelihood request: empty continuation")
    if len(request.continuation) > max_length:
        raise UserError(f"loglikelihood request: continuation of {len(request.continuation)} tokens is longer "
                        f"than the model's window of {max_length}")
    tokens = list(request.context) + list(request.continuation)
    dropped = max(0, len(tokens) - (max_length + 1))
    return tokens[dropped:], len(request.continuation), dropped
