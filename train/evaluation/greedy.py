"""Greedy generation for generative tasks: `GenerationRequest`s in, `GenerationResult`s out, on
the compiled generator (bucketed shapes, the decode loop on device, temperature 0), batched.

Stop strings are checked between decode chunks of `chunk_tokens` steps: a row whose text holds one
is ended there, so a short answer costs about its own length rather than `max_new_tokens` (decoding
everything and cutting afterwards would run every row to its limit: HumanEval completions stop
after a few dozen of 300+ tokens). The text is then cut before the earliest stop string it holds
(as lm-eval cuts). That equals decoding everything and cutting unless one stop string starts before
another but completes after it (overlapping stop strings; HumanEval's, each a newline and a
keyword, cannot). The tokenizer's stop tokens end a row inside the loop.
"""
from __future__ import annotations

from typing import Sequence

from formats.errors import UserError
from train.evaluation.requests import GenerationRequest, GenerationResult


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """(text before the earliest stop string, whether one was found)."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(found)], True) if found else (text, False)


class GreedyGenerator:
    """Answers generation requests with a model and its tokenizer. A result's `tokens` are those
    generated through the one that completed the stop string (or the stop token, or the limit). `max_length`: the window a
    prompt and its new tokens share (default: the model's max_seq_len); a longer prompt keeps its
    last `max_length - max_new_tokens` tokens (lm-eval's rule), the count dropped reported.
    `mesh`: a device mesh (jax_bridge.sharding.make_mesh) to run prefill and decoding sharded.
    `weights`: where the parameters the model holds on `meta` are read from (Generator's)."""

    def __init__(self, model, tokenizer, *, kernels: str | dict | None = "auto", mesh=None, batch_size: int = 8,
                 chunk_tokens: int = 16, max_length: int | None = None, compile_cache=None, weights=None):
        from formats.tokenizer import special_ids
        from train.generation.generator import Generator

        if batch_size < 1 or chunk_tokens < 1:
            raise UserError(f"GreedyGenerator: batch_size and chunk_tokens must be >= 1, found {batch_size}, "
                            f"{chunk_tokens}")
        cfg = model.cfg
        self.tokenizer, self.batch_size, self.chunk_tokens = tokenizer, batch_size, chunk_tokens
        self.max_length = min(max_length or cfg.max_seq_len, cfg.max_position_embeddings)
        stops = {*special_ids(tokenizer)["stop"], cfg.eos_token_id}
        self.stop_tokens = tuple(sorted(t for t in stops if t is not None and 0 <= t < cfg.vocab_size))
        self.generator = Generator(model, kernels=kernels, tokenizer=tokenizer, compile_cache=compile_cache,
                                   weights=weights, **({} if mesh is None else {"mesh": mesh}))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode_bytes([t for t in tokens if t not in self.stop_tokens]).decode("utf-8", "replace")

    def fit(self, request: GenerationRequest) -> tuple[list[int], int]:
        """(prompt kept, tokens dropped from its left)."""
        room = self.max_length - request.max_new_tokens
        if request.max_new_tokens < 1 or room < 1:
            raise UserError(f"generation request: max_new_tokens must be in [1, {self.max_length - 1}] (the window "
                            f"of {self.max_length} keeps at least one prompt token), found {request.max_new_tokens}")
        if not request.prompt:
            raise UserError("generation request: empty prompt (put the document start token there)")
        dropped = max(0, len(request.prompt) - room)
        return list(request.prompt[dropped:]), dropped

    def generate(self, requests: Sequence[GenerationRequest], *, progress: bool = False) -> list[GenerationResult]:
        """One result per request, in order. Requests run in batches of similar prompt length (so
        a batch pads little and few buckets are compiled)."""
        from tqdm import tqdm

        fitted = [self.fit(r) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: (len(fitted[i][0]), i))
        results: list[GenerationResult | None] = [None] * len(requests)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        with tqdm(total=len(requests), desc="generate", unit="request", disable=not progress) as bar:
            for batch in batches:
                answers = self._batch([requests[i] for i in batch], [fitted[i][0] for i in batch])
                for i, (text, tokens) in zip(batch, answers):
                    results[i] = GenerationResult(text=text, tokens=tuple(tokens), truncated=fitted[i][1])
                bar.update(len(batch))
        return results

    def _batch(self, requests: list[GenerationRequest], prompts: list[list[int]]) -> list[tuple[str, list[int]]]:
        from train.generation.sampling import SamplingConfig

        limits = [r.max_new_tokens for r in requests]
        produced: list[list[int]] = [[] for _ in requests]
        ended = [False] * len(requests)

        def on_tokens(new: list[list[int]]) -> list[int]:
            finished = []
            for row, tokens in enumerate(new):
                if ended[row]:
                    continue
                produced[row].extend(tokens)
                stop_string = cut_at_stop(self.decode(produced[row]), requests[row].stop)[1]
                if stop_string or len(produced[row]) >= limits[row]:
                    ended[row] = True
                    finished.append(row)
            return finished

        sampling = SamplingConfig(max_new_tokens=max(limits), temperature=0, stop_tokens=self.stop_tokens)
        self.generator.generate(prompts, sampling, on_tokens=on_tokens, stream_every=self.chunk_tokens)
        answers = []
        for request, tokens, limit in zip(requests, produced, limits):
            tokens = tokens[:limit]
            text, stopped = cut_at_stop(self.decode(tokens), request.stop)
            if stopped:          # drop what the last chunk produced after the stop string was complete
                tokens = tokens[:next(n for n in range(1, len(tokens) + 1)
                                      if cut_at_stop(self.decode(tokens[:n]), request.stop)[1])]
            answers.append((text, tokens))
        return answers
