"""Task formats: multiple choice, language modelling (CORE's exact match) and generative, and the
user's task files (`--tasks FILE.jsonl`: one example per line, an optional first line of settings).

A task file's lines are JSON objects of one type, given by a "type" field or inferred from the keys:
  multiple_choice    {"context": str, "choices": [str, ...], "gold": int}
  language_modeling  {"context": str, "continuation": str}
  generative         {"prompt": str, "reference": str}
The optional first line {"task": {...}} sets TaskSettings fields (name, num_fewshot, delimiter,
normalize, chat, stop, max_new_tokens, baseline, seed).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from formats.errors import UserError

MULTIPLE_CHOICE, LANGUAGE_MODELING, GENERATIVE = "multiple_choice", "language_modeling", "generative"
KINDS = (MULTIPLE_CHOICE, LANGUAGE_MODELING, GENERATIVE)
# What each kind's example holds: required keys and their types.
FIELDS = {MULTIPLE_CHOICE: {"context": str, "choices": list, "gold": int},
          LANGUAGE_MODELING: {"context": str, "continuation": str},
          GENERATIVE: {"prompt": str, "reference": str}}


@dataclass(frozen=True)
class Example:
    """One example; `context` is the prompt (generative: the prompt), `answer` the gold text
    (multiple choice: choices[gold]; generative: the reference)."""
    context: str
    answer: str
    choices: tuple[str, ...] = ()
    gold: int = 0


@dataclass(frozen=True)
class TaskSettings:
    name: str
    kind: str
    num_fewshot: int = 0
    delimiter: str = " "           # between a context and its answer (DCLM's default)
    normalize: str = "tokens"      # multiple choice: pick by log-likelihood per token, or "none" (the sum)
    chat: bool = False             # render as a harmony conversation (chat models)
    stop: tuple[str, ...] = ("\n",)    # generative: the answer ends before the first of these
    max_new_tokens: int = 32
    baseline: float | None = None  # random-guess accuracy; None: 1/choices (multiple choice) or 0
    seed: int = 1234               # few-shot examples of example i: random.Random(seed + i)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UserError(f"task {self.name}: type must be one of {', '.join(KINDS)}, found {self.kind!r}")
        if self.normalize not in ("tokens", "none"):
            raise UserError(f"task {self.name}: normalize must be tokens or none, found {self.normalize!r}")
        if not isinstance(self.num_fewshot, int) or self.num_fewshot < 0:
            raise UserError(f"task {self.name}: num_fewshot must be an integer >= 0, found {self.num_fewshot!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise UserError(f"task {self.name}: max_new_tokens must be a positive integer, found {self.max_new_tokens!r}")
        if self.baseline is not None and not 0 <= self.baseline < 1:
            raise UserError(f"task {self.name}: baseline must be in [0, 1), found {self.baseline!r}")


@dataclass(frozen=True)
class Task:
    settings: TaskSettings
    examples: tuple[Example, ...]
    source: str = ""               # where the examples came from, for the report
    meta: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def baseline(self) -> float:
        if self.settings.baseline is not None:
            return self.settings.baseline
        if self.settings.kind == MULTIPLE_CHOICE:
            return math.fsum(1 / len(e.choices) for e in self.examples) / len(self.examples)
        return 0.0


def centered(accuracy: float, baseline: float) -> float:
    """DCLM's centered accuracy: 0 at random guessing, 1 at perfect."""
    return (accuracy - baseline) / (1 - baseline)


def infer_kind(record: dict) -> str | None:
    if "type" in record:
        return record["type"]
    for kind in (MULTIPLE_CHOICE, LANGUAGE_MODELING, GENERATIVE):
        if set(FIELDS[kind]) <= set(record):
            return kind
    return None


def parse_example(record, kind: str | None, where: str) -> tuple[str, Example]:
    """(kind, Example) of one task-file line; a UserError naming `where` (file:line) when malformed."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, found {type(record).__name__}")
    found = infer_kind(record)
    if found is None:
        raise UserError(f"{where}: cannot tell the task type: expected a \"type\" field or the keys of one of "
                        + "; ".join(f"{k} ({', '.join(v)})" for k, v in FIELDS.items()) + f", found keys {sorted(record)}")
    if found not in KINDS:
        raise UserError(f"{where}: field 'type' expected one of {', '.join(KINDS)}, found {found!r}")
    if kind is not None and found != kind:
        raise UserError(f"{where}: type {found} in a {kind} task (every line of a file is one type)")
    for key, typ in FIELDS[found].items():
        value = record.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise UserError(f"{where}: field '{key}' expected {typ.__name__}, found {json.dumps(value)[:60]}")
    if found == MULTIPLE_CHOICE:
        choices = record["choices"]
        if len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise UserError(f"{where}: field 'choices' expected a list of at least 2 non-empty strings, "
                            f"found {json.dumps(choices)[:60]}")
        if not 0 <= record["gold"] < len(choices):
            raise UserError(f"{where}: field 'gold' expected an index in [0, {len(choices)}), found {record['gold']}")
        return found, Example(record["context"], choices[record["gold"]], tuple(choices), record["gold"])
    if found == LANGUAGE_MODELING:
        if not record["continuation"]:
            raise UserError(f"{where}: field 'continuation' is empty")
        return found, Example(record["context"], record["continuation"])
    return found, Example(record["prompt"], record["reference"])


def settings_from(record: dict, name: str, kind: str, where: str) -> TaskSettings:
    known = {f.name for f in dataclasses.fields(TaskSettings)} - {"kind"}
    if not isinstance(record, dict) or set(record) - known:
        raise UserError(f"{where}: field 'task' expected an object with keys among {', '.join(sorted(known))}, "
                        f"found {json.dumps(record)[:80]}")
    values = dict(record)
    if "stop" in values:
        if not isinstance(values["stop"], list) or not all(isinstance(s, str) and s for s in values["stop"]):
            raise UserError(f"{where}: field 'stop' expected a list of non-empty strings, found {json.dumps(values['stop'])[:60]}")
        values["stop"] = tuple(values["stop"])
    try:
        return TaskSettings(**{"name": name, **values, "kind": kind})
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def read_task_file(path: str | Path) -> Task:
    """A user task from a JSONL file; malformed input is one UserError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"task file {path} does not exist")
    header, examples, kind = None, [], None
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not UTF-8 text ({e})") from None
    for number, line in enumerate(lines, 1):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
        if isinstance(record, dict) and "task" in record and not examples and header is None:
            header = (record["task"], where)
            continue
        kind, example = parse_example(record, kind, where)
        examples.append(example)
    if not examples:
        raise UserError(f"task file {path}: no examples (one JSON object per line)")
    name = path.stem
    settings = settings_from(header[0], name, kind, header[1]) if header else TaskSettings(name=name, kind=kind)
    return Task(settings, tuple(examples), source=str(path))
