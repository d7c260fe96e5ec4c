"""Rollouts for `rl`: G completions per prompt from the compiled decode loop (train/generation),
the policy's current parameters handed in as arrays each rollout (no recompile, no second engine;
a LoRA policy unmerged), each sampled token's log-probability under softmax(z / T) over the whole
vocabulary and that distribution's entropy. Completions stop at `<|return|>` / `<|call|>` /
`<|end|>` (chat) or the document end (plain text); one that reaches max_new_tokens without a stop
is truncated. The reward sees the final answer's text (chat: the content of the reply's last
message) or the plain continuation."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from train.generation.sampling import SamplingConfig
from train.rl.prompts import Prompt


@dataclass
class Sample:
    prompt: Prompt
    tokens: list[int]           # the completion (its stop token last, when it stopped)
    text: str                   # what the rewards see
    truncated: bool
    logps: list[float]          # the sampler's, per completion token
    entropy: list[float]


def stop_ids(enc, chat: bool) -> tuple[int, ...]:
    from formats.tokenizer import end_id
    from train.generation import chat as harmony

    if chat:
        return (*harmony.stop_tokens(enc), harmony.special(enc, harmony.END), end_id(enc))
    return (end_id(enc),)


def completion_text(enc, tokens: list[int], chat: bool, stops: tuple[int, ...]) -> str:
    from train.generation import chat as harmony

    if chat:
        return harmony.reply_text(enc, tokens)[0]
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return enc.decode(tokens[:cut])


def sample_groups(generator, prompts: list[Prompt], group_size: int, sampling: SamplingConfig, enc):
    """(G samples per prompt, prompt-major, the Generation) with `sampling` (its seed: this rollout's)."""
    chat = prompts[0].chat
    stops = stop_ids(enc, chat)
    sampling = dataclasses.replace(sampling, stop_tokens=stops, logprobs=True)
    gen = generator.generate([p.tokens for p in prompts], sampling, samples_per_prompt=group_size)
    samples = []
    for i, (tokens, stopped) in enumerate(zip(gen.tokens, gen.stopped)):
        prompt = prompts[i // group_size]
        samples.append(Sample(prompt, tokens, completion_text(enc, tokens, chat, stops),
                              not stopped and len(tokens) >= sampling.max_new_tokens, gen.logprobs[i],
                              gen.entropies[i]))
    return samples, gen
