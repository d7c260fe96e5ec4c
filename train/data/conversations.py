"""Conversations for supervised fine-tuning: OpenAI chat records checked and normalized, then
rendered in harmony with the project's renderer (or, with a Hugging Face tokenizer, by its own chat template:
train/data/chat_template.py), token by token, with a loss weight per token:
1 on what the assistant writes after `<|start|>assistant` (channel header, content, closing
`<|end|>` / `<|return|>`), 0 on everything else.

Thinking (an assistant message's `thinking`, harmony's `analysis` channel) is kept on the last
assistant turn (the assistant messages after the last non-assistant message) and dropped from
earlier ones once a later final answer exists. The last message, when it is the assistant's final
answer, ends with `<|return|>` as in openai-harmony's render_conversation_for_training.
"""

from __future__ import annotations

import numpy as np

from formats.errors import UserError
from formats.tokenizer_json import HFEncoding
from train.data import chat_template
from train.generation import chat

ROLES = ("system", "developer", "user", "assistant")


class MalformedRecord(ValueError):
    """A record that cannot be a training conversation; the message says why (one short clause)."""


def parse_record(obj, messages_field: str = "messages") -> list[dict]:
    """The messages of one record as [{"role", "content", "thinking"}] (thinking: assistant only,
    None when absent), or MalformedRecord: no messages, unknown role, non-text content, no
    assistant turn."""
    if not isinstance(obj, dict):
        raise MalformedRecord(f"expected a JSON object with field {messages_field!r}, found {type(obj).__name__}")
    messages = obj.get(messages_field)
    if not isinstance(messages, list) or not messages:
        found = "none" if messages is None else type(messages).__name__ if not isinstance(messages, list) else "[]"
        raise MalformedRecord(f"no messages: field {messages_field!r} expected a non-empty list, found {found}")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise MalformedRecord(f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content, thinking = text_parts(m.get("content")), m.get("thinking") if role == "assistant" else None
        if m.get("tool_calls"):
            raise MalformedRecord(f"message {i}: non-text content (tool_calls)")
        if not isinstance(content, str) and not (role == "assistant" and content is None and thinking):
            raise MalformedRecord(f"message {i}: non-text content ({type(content).__name__})")
        if thinking is not None and not isinstance(thinking, str):
            raise MalformedRecord(f"message {i}: non-text thinking ({type(thinking).__name__})")
        out.append({"role": role, "content": content or "", "thinking": thinking or None})
    if not any(m["role"] == "assistant" for m in out):
        raise MalformedRecord("no assistant turn")
    return out


def text_parts(content):
    """OpenAI's content as a list of text parts ([{"type": "text", "text": ...}]) joined into one
    string; anything else is returned as it is (parse_record judges it)."""
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return content


def harmony_messages(messages: list[dict]) -> list[tuple[str, str, str | None]]:
    """(role, content, channel) of every harmony message the conversation renders to, thinking
    dropped where the rule above says."""
    last_turn = max((i + 1 for i, m in enumerate(messages) if m["role"] != "assistant"), default=0)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and (m["content"] or not m["thinking"])]
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            out.append((m["role"], m["content"], None))
            continue
        if m["thinking"] and (i >= last_turn or not any(j > i for j in answers)):
            out.append(("assistant", m["thinking"], "analysis"))
        if i in answers:
            out.append(("assistant", m["content"], "final"))
    return out


def render_weighted(enc, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32, loss weights uint8) of one conversation (parse_record's output); a
    Hugging Face tokenizer renders it with its own chat template (train/data/chat_template.py)."""
    if isinstance(enc, HFEncoding):
        return chat_template.render_weighted(enc, messages)
    prompt = len(chat.render(enc, [], reply=True))  # <|start|>assistant: the prompt for a reply, not trained
    ids, weights = [], []
    rendered = harmony_messages(messages)
    for k, (role, content, channel) in enumerate(rendered):
        part = chat.render(enc, [chat.Message(role, content, channel)], reply=False)
        if role == "assistant" and channel == "final" and k == len(rendered) - 1:
            part[-1] = chat.special(enc, chat.RETURN)  # the conversation's last answer: done
        ids += part
        weights += [0] * len(part) if role != "assistant" else [0] * prompt + [1] * (len(part) - prompt)
    return np.asarray(ids, np.int32), np.asarray(weights, np.uint8)


def text_of(messages: list[dict]) -> str:
    """All the text of a conversation (training a bpe:N vocabulary on chat data)."""
    return "\n".join(part for m in messages for part in (m["content"], m["thinking"] or "") if part)


def check_chat_tokenizer(enc, where: str) -> None:
    """Refuse, naming the tokenizer, one without harmony's chat tokens (o200k_base, a ranks file,
    or a bpe:N vocabulary made before bpe:N reserved them), or a Hugging Face one without a chat
    template."""
    from formats.tokenizer import HARMONY_CHAT_TOKENS

    if isinstance(enc, HFEncoding):
        return chat_template.check_template(enc, where)
    missing = [t for t in HARMONY_CHAT_TOKENS[:-1] if t not in enc._special_tokens]  # <|constrain|>: unused here
    if missing:
        raise UserError(f"{where}: tokenizer {enc.name!r} lacks harmony's chat tokens ({', '.join(missing)}): "
                        "use o200k_harmony, or a bpe:N vocabulary trained by this version (bpe:N now reserves "
                        "them; an older one, and a model trained with it, must be made again)")
