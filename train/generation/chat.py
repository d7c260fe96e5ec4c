"""Chat in OpenAI's harmony format (gpt-oss), for models with an o200k_harmony tokenizer.

A conversation renders as `<|start|>{role}[<|channel|>{channel}]<|message|>{content}<|end|>` per
message, then `<|start|>assistant` for the reply to come; the reply ends with `<|return|>`
(200002, done) or `<|call|>` (200012, a tool call). Roles and text are encoded with the
tokenizer's ordinary encoding, special tokens by their ids in the tokenizer, so any tiktoken
Encoding that carries the harmony special tokens works. Checked token for token against the
`openai-harmony` package (tests/test_chat.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from formats.errors import UserError
from train.generation.text_stream import TextStream

ROLES = ("system", "developer", "user", "assistant")
START, MESSAGE, END, CHANNEL = "<|start|>", "<|message|>", "<|end|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
STOPS = (RETURN, CALL)


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    channel: str | None = None     # assistant messages: "final", "analysis" or "commentary"

    def __post_init__(self):
        if self.role not in ROLES:
            raise UserError(f"chat message: role must be one of {', '.join(ROLES)}, found {self.role!r}")
        if not isinstance(self.content, str):
            raise UserError(f"chat message: content must be text, found {type(self.content).__name__}")


def special(enc, name: str) -> int:
    """The id of a harmony special token, or a UserError saying the tokenizer is not harmony's."""
    try:
        return enc._special_tokens[name]
    except KeyError:
        raise UserError(f"chat needs a tokenizer with the harmony special tokens (o200k_harmony); "
                        f"tokenizer {enc.name!r} has no {name}") from None


def render(enc, messages: list[Message], *, reply: bool = True) -> list[int]:
    """Token ids of the conversation; with `reply`, ending with the header of the assistant's
    next message (what `openai_harmony`'s render_conversation_for_completion(..., ASSISTANT)
    gives)."""
    ids: list[int] = []
    for m in messages:
        ids += [special(enc, START), *enc.encode_ordinary(m.role)]
        if m.channel:
            ids += [special(enc, CHANNEL), *enc.encode_ordinary(m.channel)]
        ids += [special(enc, MESSAGE), *enc.encode_ordinary(m.content), special(enc, END)]
    if reply:
        ids += [special(enc, START), *enc.encode_ordinary("assistant")]
    return ids


def stop_tokens(enc) -> tuple[int, ...]:
    return tuple(special(enc, name) for name in STOPS)


def reply_text(enc, tokens: list[int]) -> tuple[str, str | None]:
    """(text, channel) of a generated reply: the content after its last `<|message|>` (the
    channel, if the model wrote one, from the header before it), up to a stop or `<|end|>`."""
    ends = {special(enc, name) for name in (*STOPS, END)}
    cut = next((i for i, t in enumerate(tokens) if t in ends), len(tokens))
    tokens = tokens[:cut]
    message, channel_id = special(enc, MESSAGE), special(enc, CHANNEL)
    start = max((i for i, t in enumerate(tokens) if t == message), default=-1)
    channel = None
    if start >= 0:
        header = tokens[:start]
        if channel_id in header:
            channel = enc.decode(header[header.index(channel_id) + 1:]).strip()
    return enc.decode(tokens[start + 1:]), channel


def read_messages(path: str | os.PathLike) -> list[Message]:
    """A conversation from a JSON file: a list of {"role", "content"[, "channel"]} objects."""
    from formats.jsonfile import read_json

    data = read_json(path)
    if not isinstance(data, list) or not data:
        raise UserError(f"{path}: expected a non-empty JSON list of messages, found {type(data).__name__}")
    messages = []
    for i, item in enumerate(data):
        keys = set(item) if isinstance(item, dict) else set()
        if not {"role", "content"} <= keys or keys - {"role", "content", "channel"}:
            raise UserError(f"{path}: message {i} must be an object with role, content and optionally channel; "
                            f"found {json.dumps(item)[:80]}")
        messages.append(Message(item["role"], item["content"], item.get("channel")))
    return messages


class ReplyStream:
    """Prints a harmony reply as its tokens arrive: the text of each message (a channel other than
    `final` named in brackets), not the format's special tokens."""

    def __init__(self, enc, out=None):
        self.enc, self.text = enc, TextStream(enc, out)
        self.ids = {name: special(enc, name) for name in (START, MESSAGE, END, CHANNEL, *STOPS)}
        self.header: list[int] = []
        self.in_message = False

    def __call__(self, tokens: list[int]) -> None:
        for t in tokens:
            if t == self.ids[MESSAGE]:
                self.in_message = True
                if self.ids[CHANNEL] in self.header:
                    channel = self.enc.decode(self.header[self.header.index(self.ids[CHANNEL]) + 1:]).strip()
                    if channel != "final":
                        self.text.out.write(f"[{channel}] ")
                self.header = []
            elif t in (self.ids[END], self.ids[RETURN], self.ids[CALL]):
                self.in_message = False
                self.text.out.write("\n" if t == self.ids[END] else "")
            elif t == self.ids[START]:
                self.header = []
            elif self.in_message:
                self.text([t])
            else:
                self.header.append(t)

    def close(self) -> None:
        self.text.close()
