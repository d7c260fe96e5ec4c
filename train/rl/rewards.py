"""Rewards for `rl`: the built-ins and user functions, each called as
NAME(prompt: str, completion: str, record: dict) -> float | None, combined with weights.

  exact:FIELD          1.0 when the completion (the final answer) equals the record's FIELD after
                       collapsing whitespace, else 0.0
  regex:PATTERN        1.0 when re.search(PATTERN, completion) matches, else 0.0
  humaneval            1.0 when the record's HumanEval tests pass on prompt + completion in the
                       evaluation package's sandbox (record fields test, entry_point), else 0.0
  python:FILE.py:NAME  NAME from FILE.py (loaded once), the user's function

A completion's reward is the weighted sum of its rewards with the None ones left out (TRL's
nansum); all None gives 0, counted (`Scored.all_none`) for the run to warn about. A reward that
raises, or returns something that is not a number or None, stops with one line naming the reward
and the record.
"""
from __future__ import annotations

import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from formats.errors import UserError

KINDS = ("exact:FIELD", "regex:PATTERN", "humaneval", "python:FILE.py:NAME")


@dataclass(frozen=True)
class Reward:
    name: str           # the spec as given: the metric's name (reward/<name>)
    weight: float
    fn: Callable


def normalize(text: str) -> str:
    return " ".join(str(text).split())


def exact_reward(field: str):
    def exact(prompt: str, completion: str, record: dict):
        if field not in record:
            raise UserError(f"reward exact:{field}: the record has no field {field!r} (fields: {', '.join(record)})")
        return 1.0 if normalize(completion) == normalize(record[field]) else 0.0
    return exact


def regex_reward(pattern: str):
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise UserError(f"--reward regex:{pattern}: not a regular expression ({e})") from None

    def regex(prompt: str, completion: str, record: dict):
        return 1.0 if compiled.search(completion) else 0.0
    return regex


def humaneval_reward(isolation: str = "auto", timeout: float = 5.0):
    from train.evaluation.humaneval import check_program
    from train.evaluation.sandbox import resolve_isolation, run_program

    mode = resolve_isolation(isolation)

    def humaneval(prompt: str, completion: str, record: dict):
        missing = [f for f in ("prompt", "test", "entry_point") if f not in record]
        if missing:
            raise UserError(f"reward humaneval: the record has no field {missing[0]!r} (a HumanEval problem has "
                            "prompt, test, entry_point)")
        return 1.0 if run_program(check_program(record, completion), timeout=timeout, isolation=mode).passed else 0.0
    return humaneval


def python_reward(spec: str):
    """`FILE.py:NAME` -> the function, or one line saying why it cannot be had."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise UserError(f"--reward python:{spec}: expected python:FILE.py:NAME")
    if not Path(path).is_file():
        raise UserError(f"--reward python:{spec}: no file {path}")
    module_name = f"torchlyra_reward_{Path(path).stem}"
    try:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        loader_spec.loader.exec_module(module)
    except Exception as e:           # the user's module: any error while loading it is theirs
        sys.modules.pop(module_name, None)
        raise UserError(f"--reward python:{spec}: {path} does not load ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"--reward python:{spec}: {path} has no function {name!r}")
    return fn


def parse_reward(spec: str, weight: float = 1.0, *, isolation: str = "auto") -> Reward:
    kind, _, rest = spec.partition(":")
    if kind == "exact" and rest:
        fn = exact_reward(rest)
    elif kind == "regex" and rest:
        fn = regex_reward(rest)
    elif spec == "humaneval":
        fn = humaneval_reward(isolation)
    elif kind == "python" and rest:
        fn = python_reward(rest)
    else:
        raise UserError(f"--reward: unknown reward {spec!r} (expected one of {', '.join(KINDS)})")
    return Reward(spec, float(weight), fn)


def parse_rewards(specs: list[str], weights: list[float] | None = None, *, isolation: str = "auto") -> list[Reward]:
    if not specs:
        raise UserError("rl: give at least one --reward")
    if weights is not None and len(weights) != len(specs):
        raise UserError(f"--reward-weights: {len(weights)} weights for {len(specs)} rewards")
    names = [s for s in specs]
    if len(set(names)) != len(names):
        raise UserError("--reward: the same reward given twice")
    return [parse_reward(s, w, isolation=isolation) for s, w in zip(specs, weights or [1.0] * len(specs))]


@dataclass
class Scored:
    total: float                   # the weighted nansum
    values: list                   # each reward's value (None where it gave None)
    all_none: bool


def score(rewards: list[Reward], prompt: str, completion: str, record: dict, where: str) -> Scored:
    """One completion's rewards; `where` names the record (FILE:LINE) in any error."""
    values = []
    for r in rewards:
        try:
            v = r.fn(prompt, completion, record)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        except Exception as e:       # the user's reward: its failure stops the run, naming the record
            raise UserError(f"{where}: reward {r.name} raised {type(e).__name__}: {e}") from None
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                raise UserError(f"{where}: reward {r.name} returned {v!r}; expected a finite float or None")
            v = float(v)
        values.append(v)
    present = [r.weight * v for r, v in zip(rewards, values) if v is not None]
    return Scored(float(sum(present)), values, not present)
