"""The `rl` command's prompt records (JSONL): chat `messages` (rendered in harmony up to the
assistant's reply to come) or plain `prompt` text (after the document start token), plus any
other fields, handed to the rewards. A prompt longer than its budget is cut from the left and
counted. A bad file or record: one line naming the file, line and field."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from formats.errors import UserError


@dataclass
class Prompt:
    where: str              # FILE:LINE, for messages
    text: str               # what the rewards see as the prompt
    tokens: list[int]
    record: dict
    chat: bool
    cut: bool = False       # the prompt was cut from the left to its budget


def read_records(path: str | Path) -> list[tuple[str, dict]]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts {path}: no such file")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object, found {type(record).__name__}")
        out.append((where, record))
    if not out:
        raise UserError(f"--prompts {path}: no records")
    return out


def render_prompt(where: str, record: dict, enc, budget: int) -> Prompt:
    from formats.tokenizer import bos_id
    from train.generation import chat

    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
        try:
            parsed = [chat.Message(m["role"], m["content"]) for m in messages]
        except (TypeError, KeyError) as e:
            raise UserError(f"{where}: field 'messages': each message needs role and content ({e})") from None
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        if parsed[-1].role == "assistant":
            raise UserError(f"{where}: the last message is the assistant's; a prompt ends with the turn it answers")
        tokens = chat.render(enc, parsed)
        text, is_chat = parsed[-1].content, True
    elif isinstance(record.get("prompt"), str):
        text, is_chat = record["prompt"], False
        tokens = [bos_id(enc), *enc.encode_ordinary(text)]
    else:
        raise UserError(f"{where}: expected a field 'messages' (chat) or 'prompt' (text)")
    cut = len(tokens) > budget
    return Prompt(where, text, tokens[-budget:], record, is_chat, cut)


def read_prompts(path: str | Path, enc, budget: int) -> list[Prompt]:
    prompts = [render_prompt(where, record, enc, budget) for where, record in read_records(path)]
    kinds = {p.chat for p in prompts}
    if len(kinds) > 1:
        raise UserError(f"--prompts {path}: mixes chat (messages) and plain (prompt) records; use one kind")
    return prompts
