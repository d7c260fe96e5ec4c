"""CORE-6 (BIG-bench JSON): the six BIG-bench tasks of DCLM's CORE suite, read from BIG-bench's
own task.json files and run as DCLM runs them (10-shot, delimiter " "; language_identification
multiple choice over its 11 languages picked by log-likelihood per token, the other five language
modelling scored by exact match). Not comparable to published CORE: DCLM scores its own converted
copies (other formatting and counts, e.g. qa_wikidata 20,321 vs 20,442 here) and averages 22 tasks.

An example's context is BIG-bench's task_prefix + example_input_prefix + input +
example_output_prefix, stripped; its answer the target (qa_wikidata: the first of a list) or the
choice whose target score is 1.
"""
from __future__ import annotations

from formats.errors import UserError
from train.evaluation import bigbench
from train.evaluation.tasks import LANGUAGE_MODELING, MULTIPLE_CHOICE, Example, Task, TaskSettings

SUITE_NAME = "CORE-6 (BIG-bench JSON)"
NOT_COMPARABLE = ("not comparable to published CORE: BIG-bench's own JSON files (not DCLM's converted copies: "
                  "other formatting and counts) and 6 of DCLM's 22 tasks")
# task -> (kind, BIG-bench task folders); cs_algorithms' examples are in its two subtask folders.
CORE_TASKS = {
    "qa_wikidata": (LANGUAGE_MODELING, ("qa_wikidata",)),
    "dyck_languages": (LANGUAGE_MODELING, ("dyck_languages",)),
    "operators": (LANGUAGE_MODELING, ("operators",)),
    "repeat_copy_logic": (LANGUAGE_MODELING, ("repeat_copy_logic",)),
    "cs_algorithms": (LANGUAGE_MODELING, ("cs_algorithms/lcs", "cs_algorithms/valid_parentheses")),
    "language_identification": (MULTIPLE_CHOICE, ("language_identification",)),
}
NUM_FEWSHOT = 10


def context_of(task: dict, example: dict) -> str:
    return (task.get("task_prefix", "") + task.get("example_input_prefix", "\n") + example["input"]
            + task.get("example_output_prefix", "\n")).strip()


def convert(name: str, folder: str, task: dict) -> list[Example]:
    """BIG-bench examples as our Examples (a malformed one named by folder and index)."""
    out = []
    for i, ex in enumerate(task["examples"]):
        where = f"BIG-bench {folder} example {i}"
        if not isinstance(ex, dict) or not isinstance(ex.get("input"), str):
            raise UserError(f"{where}: field 'input' expected a string")
        context = context_of(task, ex)
        if "target_scores" in ex:
            scores = ex["target_scores"]
            choices = tuple(scores)
            gold = [c for c in choices if scores[c] == 1]
            if len(gold) != 1:
                raise UserError(f"{where}: field 'target_scores' expected exactly one choice scored 1, found {len(gold)}")
            out.append(Example(context, gold[0], choices, choices.index(gold[0])))
        else:
            target = ex.get("target")
            target = target[0] if isinstance(target, list) and target else target
            if not isinstance(target, str) or not target:
                raise UserError(f"{where}: field 'target' expected a non-empty string or list of them")
            out.append(Example(context, target))
    return out


def core_tasks() -> list[Task]:
    """The six tasks, their task.json files fetched and cached on first use."""
    folders = [f for _, fs in CORE_TASKS.values() for f in fs]
    files = bigbench.task_files(folders)
    tasks = []
    for name, (kind, task_folders) in CORE_TASKS.items():
        examples = []
        for folder in task_folders:
            examples += convert(name, folder, bigbench.read_task(files[folder]))
        if kind == MULTIPLE_CHOICE and any(len(e.choices) < 2 for e in examples):
            raise UserError(f"BIG-bench {name}: a multiple-choice example with fewer than 2 choices")
        settings = TaskSettings(name=name, kind=kind, num_fewshot=NUM_FEWSHOT, delimiter=" ", normalize="tokens")
        tasks.append(Task(settings, tuple(examples), source=f"bigbench==1.0.0 {', '.join(task_folders)}",
                          meta={"suite": SUITE_NAME}))
    return tasks
