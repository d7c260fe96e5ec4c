"""Conversations rendered with a Hugging Face tokenizer's own chat template (a converted
`--tokenizer hf:DIR` carrying one), through transformers' renderer (what `apply_chat_template`
calls), with a loss weight per token: 1 on what each assistant message writes (its content and
the template's end-of-turn text after it), 0 on everything else.

Which characters are the assistant's: a template with `{% generation %}` marks them itself (TRL's
assistant-only loss uses the same marks); otherwise the span of assistant message i is what the
conversation through message i adds to the prompt for a reply after message i - 1
(`add_generation_prompt`). That needs a template that renders earlier turns the same whatever
follows; one that does not (it rewrites an earlier turn) is refused for that conversation.
"""
from __future__ import annotations

import numpy as np

from formats.errors import UserError
from formats.tokenizer import bos_id


class TemplateMismatch(UserError):
    """The template cannot be read as prompt + assistant spans for a conversation; says why."""


def _render(enc, messages: list[dict], *, prompt: bool = False, marks: bool = False):
    from transformers.utils.chat_template_utils import render_jinja_template

    specials = {"eos_token": enc.document_end}
    if enc.document_start != enc.document_end:
        specials["bos_token"] = enc.document_start
    rendered, indices = render_jinja_template([messages], chat_template=enc.chat_template,
                                              add_generation_prompt=prompt, return_assistant_tokens_mask=marks,
                                              **specials)
    return (rendered[0], indices[0]) if marks else rendered[0]


def assistant_spans(enc, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, [(start, end) character span of each assistant message])."""
    replies = sum(m["role"] == "assistant" for m in messages)
    if "{% generation %}" in enc.chat_template.replace("{%- generation %}", "{% generation %}"):
        text, spans = _render(enc, messages, marks=True)
        if len(spans) != replies:
            raise TemplateMismatch(f"chat template of {enc.name}: it marks {len(spans)} generation span(s) in a "
                                   f"conversation of {replies} assistant message(s)")
        return text, [tuple(s) for s in spans]
    text, spans = _render(enc, messages), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = _render(enc, messages[:i], prompt=True), _render(enc, messages[:i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise TemplateMismatch(f"chat template of {enc.name}: it renders the turns before assistant message {i} differently "
                                   "once later messages follow")
        spans.append((len(before), len(through)))
    return text, spans


def render_weighted(enc, messages: list[dict], first_trained: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32, loss weights uint8) of one conversation (parse_record's output), rendered
    by the tokenizer's template and tokenized piece by piece at the spans' edges; the assistant
    messages from index `first_trained` on are trained (a preference pair's answers after its
    prompt). The document start a template writes first is dropped (the packer puts one before
    every document)."""
    if any(m.get("thinking") for m in messages):
        raise TemplateMismatch(f"chat template of {enc.name}: an assistant message has 'thinking', which the chat-template path does not render")
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text, spans = assistant_spans(enc, plain)
    replies = [i for i, m in enumerate(plain) if m["role"] == "assistant"]
    spans = [span for i, span in zip(replies, spans) if i >= first_trained]
    ids, weights, at = [], [], 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, weight in ((text[at:start], 0), (text[start:end], 1)):
            part = enc.encode(piece, allowed_special="all")
            ids += part
            weights += [weight] * len(part)
        at = end
    if ids != enc.encode(text, allowed_special="all"):
        raise TemplateMismatch(f"chat template of {enc.name}: a token crosses the edge of an assistant span (tokenized whole, the ids differ)")
    if ids and ids[0] == bos_id(enc) and enc.document_start != enc.document_end:
        ids, weights = ids[1:], weights[1:]
    return np.asarray(ids, np.int32), np.asarray(weights, np.uint8)


def check_template(enc, where: str) -> None:
    if not enc.chat_template:
        raise UserError(f"{where}: tokenizer {enc.name!r} has no chat template (neither chat_template.jinja nor "
                        "tokenizer_config.json's 'chat_template'): conversations cannot be rendered")
