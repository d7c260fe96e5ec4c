"""Examples to token requests: few-shot prompts drawn with a fixed seed, plain text for base models
(document start, then the shots and the question, "\\n\\n" apart) or harmony for chat tasks (each
shot a user turn and an assistant `final` reply; the answer scored after the reply's header).

Plain text is tokenized as lm-eval does: context and answer joined, the answer's tokens being what
follows the context's own tokens; trailing spaces of the context move to the answer.
"""
from __future__ import annotations

import random

from train.evaluation.requests import GenerationRequest, LoglikelihoodRequest
from train.evaluation.tasks import GENERATIVE, MULTIPLE_CHOICE, Example, Task


def fewshot(task: Task, index: int) -> list[Example]:
    """The shots of example `index`: num_fewshot others, drawn by random.Random(seed + index)."""
    n = min(task.settings.num_fewshot, len(task.examples) - 1)
    if n <= 0:
        return []
    # Positions in the list of the other examples (all but `index`), without building that list:
    # the same draw as sampling the list itself, but O(shots) per example instead of O(examples).
    picks = random.Random(task.settings.seed + index).sample(range(len(task.examples) - 1), n)
    return [task.examples[p + (p >= index)] for p in picks]


class PromptBuilder:
    """Requests for one task's examples with one tokenizer; `bos`: the document start id that
    leads every plain-text context (chat prompts start with `<|start|>` instead)."""

    def __init__(self, task: Task, tokenizer, bos: int):
        self.task, self.enc, self.bos = task, tokenizer, bos
        if task.settings.chat:
            from train.generation import chat

            chat.special(tokenizer, chat.START)       # a tokenizer without harmony's tokens: one line

    # ---- plain text ---------------------------------------------------------------------------
    def plain_prefix(self, index: int) -> str:
        d = self.task.settings.delimiter
        shots = "".join(f"{e.context.strip()}{d}{e.answer}\n\n" for e in fewshot(self.task, index))
        return shots + self.task.examples[index].context.strip()

    def plain_pair(self, context: str, answer: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        answer = self.task.settings.delimiter + answer
        stripped = context.rstrip(" ")
        context, answer = stripped, context[len(stripped):] + answer
        context_ids = self.enc.encode_ordinary(context)
        whole = self.enc.encode_ordinary(context + answer)
        return (self.bos, *context_ids), tuple(whole[len(context_ids):])

    # ---- harmony ------------------------------------------------------------------------------
    def chat_prompt(self, index: int) -> tuple[int, ...]:
        from train.generation import chat

        messages = []
        for e in fewshot(self.task, index):
            messages += [chat.Message("user", e.context.strip()), chat.Message("assistant", e.answer, "final")]
        messages.append(chat.Message("user", self.task.examples[index].context.strip()))
        header = [chat.special(self.enc, chat.CHANNEL), *self.enc.encode_ordinary("final"),
                  chat.special(self.enc, chat.MESSAGE)]
        return (*chat.render(self.enc, messages), *header)

    # ---- requests -----------------------------------------------------------------------------
    def loglikelihood_requests(self, index: int) -> list[LoglikelihoodRequest]:
        """One request per choice (multiple choice) or one for the answer (language modelling)."""
        example = self.task.examples[index]
        answers = example.choices if self.task.settings.kind == MULTIPLE_CHOICE else (example.answer,)
        if self.task.settings.chat:
            prompt = self.chat_prompt(index)
            return [LoglikelihoodRequest(prompt, tuple(self.enc.encode_ordinary(a))) for a in answers]
        prefix = self.plain_prefix(index)
        return [LoglikelihoodRequest(*self.plain_pair(prefix, a)) for a in answers]

    def generation_request(self, index: int) -> GenerationRequest:
        assert self.task.settings.kind == GENERATIVE
        s = self.task.settings
        if s.chat:
            prompt = self.chat_prompt(index)
        else:
            prompt = (self.bos, *self.enc.encode_ordinary(self.plain_prefix(index) + s.delimiter.rstrip(" ")))
        return GenerationRequest(prompt, s.max_new_tokens, s.stop)
