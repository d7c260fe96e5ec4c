"""`--tasks` names to tasks and a whole evaluation: "core" (CORE-6, BIG-bench JSON), one of its six
task names, "humaneval" (pass@1, evalgen's sandboxed runner) or a task file (FILE.jsonl), comma
separated; the results of every task and the suite scores (CORE-6: the mean centered accuracy).
"""
from __future__ import annotations

from pathlib import Path

from formats.errors import UserError
from train.evaluation.core import CORE_TASKS, NOT_COMPARABLE, SUITE_NAME, core_tasks
from train.evaluation.runner import run_task
from train.evaluation.tasks import read_task_file

CORE, HUMANEVAL = "core", "humaneval"
KNOWN = (CORE, HUMANEVAL, *CORE_TASKS)


def parse_spec(spec: str) -> list[str]:
    """The comma-separated names; an unknown name (not a known task, not a .jsonl file) is one
    UserError listing the known ones."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise UserError(f"--tasks: expected task names or .jsonl files, found {spec!r}")
    for name in names:
        if name not in KNOWN and not name.endswith(".jsonl"):
            raise UserError(f"--tasks: unknown task {name!r}; known: {', '.join(KNOWN)}, or a task file FILE.jsonl")
        if name.endswith(".jsonl") and not Path(name).is_file():
            raise UserError(f"--tasks: task file {name} does not exist")
    return names


def load_tasks(names: list[str]) -> list:
    """Task objects for the log-likelihood and generative runner (humaneval is run apart)."""
    tasks, core = [], None
    for name in names:
        if name == HUMANEVAL:
            continue
        if name == CORE or name in CORE_TASKS:
            core = core or core_tasks()
            tasks += core if name == CORE else [t for t in core if t.name == name]
        else:
            tasks.append(read_task_file(name))
    seen = set()
    for t in tasks:
        if t.name in seen:
            raise UserError(f"--tasks: task {t.name!r} is named twice")
        seen.add(t.name)
    return tasks


def humaneval(generator, tokenizer, *, limit, progress) -> dict:
    """HumanEval pass@1: evalgen's runner, programs executed in its sandbox (humaneval.py)."""
    from train.evaluation.humaneval import PROBLEMS, run_humaneval

    result = run_humaneval(generator, tokenizer, limit=limit, progress=progress)
    return {"kind": "generative", "centered": result["score"], "of": PROBLEMS, **result}


def run_suite(names: list[str], tasks: list, *, scorer, generator, tokenizer, bos: int, limit: int | None = None,
              progress: bool = True) -> dict:
    """{"tasks": [per-task results], "suites": [suite scores]} for the parsed --tasks names and
    their loaded tasks (parse_spec, load_tasks)."""
    results = [run_task(t, scorer=scorer, generator=generator, tokenizer=tokenizer, bos=bos, limit=limit,
                        progress=progress) for t in tasks]
    if HUMANEVAL in names:
        results.append(humaneval(generator, tokenizer, limit=limit, progress=progress))
    suites = []
    core = [r for r in results if r["task"] in CORE_TASKS]
    if CORE in names:
        suites.append({"name": SUITE_NAME, "score": sum(r["centered"] for r in core) / len(core),
                       "metric": "mean centered accuracy", "tasks": [r["task"] for r in core], "note": NOT_COMPARABLE})
    return {"tasks": results, "suites": suites}
