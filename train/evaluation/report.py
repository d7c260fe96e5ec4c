"""An evaluation's outputs: the JSON file (every task's result, per-example details included) and
the markdown report card (the model, its step and tokens seen, the date; one row per task)."""
from __future__ import annotations

import json

from formats.atomic import write_atomic


def write_json(path, evaluation: dict) -> None:
    write_atomic(path, (json.dumps(evaluation, indent=1) + "\n").encode())


def percent(value, digits: int = 1) -> str:
    return "" if value is None else f"{100 * value:.{digits}f}%"


def report_card(evaluation: dict) -> str:
    """Markdown: a header about the model, one row per task, then the suite scores and notes."""
    model = evaluation["model"]
    seen = model.get("tokens_seen")
    preset = f" (preset {model['preset']})" if model.get("preset") else ""
    lines = [f"# Report card: {model.get('model', model['checkpoint'])}{preset}", "",
             f"- checkpoint `{model['checkpoint']}`",
             f"- step {model.get('step')}, tokens seen {'unknown' if seen is None else f'{seen:,}'}",
             f"- date {evaluation['date']}",
             f"- scorer {evaluation['scorer']}, window {evaluation.get('window')} tokens, "
             + (f"the first {evaluation['limit']} examples of each task" if evaluation.get("limit")
                else "every example of each task"), "",
             "| task | metric | score | centered | baseline | examples | truncated |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in evaluation["tasks"]:
        examples = f"{r['examples']:,}" + (f" of {r['of']:,}" if r.get("of", r["examples"]) != r["examples"] else "")
        lines.append(f"| {r['task']} | {r['metric']} | {percent(r['score'])} | {percent(r.get('centered'))} | "
                     f"{percent(r.get('baseline'))} | {examples} | {r.get('truncated', 0):,} |")
    for s in evaluation["suites"]:
        lines += ["", f"**{s['name']}**: {s['metric']} {percent(s['score'], 2)} over {', '.join(s['tasks'])}; {s['note']}."]
    lines += ["", "Centered accuracy: (accuracy - baseline) / (1 - baseline). Truncated: examples whose prompt "
              "lost tokens on the left to fit the model's window."]
    return "\n".join(lines) + "\n"


def print_summary(evaluation: dict) -> None:
    for r in evaluation["tasks"]:
        print(f"  {r['task']:<26} {r['metric']:<38} {percent(r['score']):>7}  centered {percent(r.get('centered')):>7}"
              f"  ({r['examples']:,} examples, {r.get('truncated', 0):,} truncated)")
    for s in evaluation["suites"]:
        print(f"  {s['name']}: {s['metric']} {percent(s['score'], 2)} ({s['note']})")
