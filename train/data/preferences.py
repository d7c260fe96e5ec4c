"""Preference pairs for DPO (`torchlyra prepare --preferences`): TRL's conversational preference
records checked, then rendered in harmony (a Hugging Face tokenizer: its own chat template) as
one document per pair.

A record: {"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}
(TRL's conversational shape; a single message object is taken as a list of one). The prompt is
rendered before each answer (segments mask attention by equality, so the two sides cannot share
one prompt in a row), so a pair's document is prompt + chosen followed by prompt + rejected, and
its weights stream holds a code per token, (side << 1) | trained: 0 / 1 the chosen side's prompt /
answer tokens, 2 / 3 the rejected side's. The loader turns the two sides into two segments of the
same row (train/data/loader.py).
"""
from __future__ import annotations

import numpy as np

from formats.tokenizer_json import HFEncoding
from train.data import chat_template, conversations
from train.data.conversations import MalformedRecord
from train.generation import chat

FIELDS = ("prompt", "chosen", "rejected")
CHOSEN, REJECTED = 0, 1
TRAINED = 1       # bit 0 of a code: an answer token (trained)


def side_of(codes: np.ndarray) -> np.ndarray:
    return codes >> 1


def trained(codes: np.ndarray) -> np.ndarray:
    return codes & TRAINED


def _messages(obj, field: str, assistant_only: bool) -> list[dict]:
    value = obj.get(field)
    if isinstance(value, dict):
        value = [value]
    if value is None:
        raise MalformedRecord(f"no {field!r}")
    if not isinstance(value, list) or not value:
        raise MalformedRecord(f"field {field!r} expected a non-empty list of messages, found "
                              f"{'[]' if value == [] else type(value).__name__}")
    if assistant_only:
        roles = sorted({m.get("role") for m in value if isinstance(m, dict)} - {"assistant"}, key=str)
        if roles or not all(isinstance(m, dict) for m in value):
            raise MalformedRecord(f"field {field!r} expected assistant messages, found role {roles[0] if roles else '?'!r}")
    try:
        messages = conversations.parse_record({"messages": value}, "messages") if assistant_only else \
            _prompt_messages(value)
    except MalformedRecord as e:
        raise MalformedRecord(f"{field}: {e}") from None
    return messages


def _prompt_messages(value: list) -> list[dict]:
    """The prompt's messages (parse_record wants an assistant turn; a prompt has none at its end)."""
    parsed = conversations.parse_record({"messages": [*value, {"role": "assistant", "content": "x"}]}, "messages")
    return parsed[:-1]


def parse_pair(obj) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of one record, or MalformedRecord naming the problem:
    a missing field, a prompt that does not end with a user/system/developer turn, an answer
    with no final text, identical answers."""
    if not isinstance(obj, dict):
        raise MalformedRecord(f"expected a JSON object with fields {', '.join(FIELDS)}, found {type(obj).__name__}")
    prompt = _messages(obj, "prompt", assistant_only=False)
    chosen = _messages(obj, "chosen", assistant_only=True)
    rejected = _messages(obj, "rejected", assistant_only=True)
    if prompt[-1]["role"] == "assistant":
        raise MalformedRecord("prompt ends with an assistant message (it must end with the turn the answers reply to)")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer[-1]["content"]:
            raise MalformedRecord(f"{name}: the last message has no final text")
    if chosen == rejected:
        raise MalformedRecord("chosen and rejected are identical")
    return prompt, chosen, rejected


def _answer_tokens(enc, answer: list[dict]) -> int:
    """Tokens the answer's messages render to at the end of a conversation (conversations.py's
    rule: thinking kept on the last turn; the last message ends with <|return|>, same length)."""
    n = 0
    for m in answer:
        if m["thinking"]:
            n += len(chat.render(enc, [chat.Message("assistant", m["thinking"], "analysis")], reply=False))
        if m["content"] or not m["thinking"]:
            n += len(chat.render(enc, [chat.Message("assistant", m["content"], "final")], reply=False))
    return n


def render_side(enc, prompt: list[dict], answer: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained 0/1) of prompt + answer: only the answer's tokens trained (an assistant turn
    inside the prompt is context, not trained)."""
    if isinstance(enc, HFEncoding):      # rendered by its own chat template
        return chat_template.render_weighted(enc, prompt + answer, first_trained=len(prompt))
    ids, weights = conversations.render_weighted(enc, prompt + answer)
    weights = weights.copy()
    weights[:len(ids) - _answer_tokens(enc, answer)] = 0
    return ids, weights


def render_pair(enc, prompt: list[dict], chosen: list[dict], rejected: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32, codes uint8) of the pair's document: prompt + chosen, then prompt + rejected."""
    ids_c, w_c = render_side(enc, prompt, chosen)
    ids_r, w_r = render_side(enc, prompt, rejected)
    codes = np.concatenate([w_c, w_r | (REJECTED << 1)]).astype(np.uint8)
    return np.concatenate([ids_c, ids_r]).astype(np.int32), codes


def text_of(pair) -> str:
    prompt, chosen, rejected = pair
    return conversations.text_of(prompt + chosen + rejected)
