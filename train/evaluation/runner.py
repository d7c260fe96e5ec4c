"""Runs tasks on a scorer (log-likelihoods) and a generator (greedy text): each task's requests in
chunks under a progress bar, then its score: accuracy (multiple choice: raw and per-token
normalised, the task's choice first), exact match (language modelling, generative), centered
accuracy, and the examples whose prompt was truncated from the left to fit the window.
"""
from __future__ import annotations

from tqdm import tqdm

from formats.errors import UserError
from train.evaluation.greedy import cut_at_stop
from train.evaluation.prompts import PromptBuilder
from train.evaluation.tasks import GENERATIVE, LANGUAGE_MODELING, MULTIPLE_CHOICE, Task, centered

CHUNK = 256      # requests per scorer call: progress granularity, and room for the scorer's batching


def limited(task: Task, limit: int | None) -> range:
    """The indices evaluated: the first `limit` examples (shots still come from all of them)."""
    return range(len(task.examples) if limit is None else min(limit, len(task.examples)))


def score_loglikelihood(task: Task, scorer, builder: PromptBuilder, indices: range, progress: bool) -> dict:
    requests, owner = [], []
    for i in indices:
        made = builder.loglikelihood_requests(i)
        requests += made
        owner += [i] * len(made)
    results = []
    with tqdm(total=len(requests), desc=task.name, unit="req", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(requests), CHUNK):
            results += scorer.loglikelihood(requests[start:start + CHUNK])
            bar.update(min(CHUNK, len(requests) - start))
    per_example, truncated, at = [], 0, 0
    for i in indices:
        example = task.examples[i]
        n = len(example.choices) if task.settings.kind == MULTIPLE_CHOICE else 1
        mine, at = results[at:at + n], at + n
        truncated += any(r.truncated > 0 for r in mine)
        if task.settings.kind == MULTIPLE_CHOICE:
            raw = [r.logprob for r in mine]
            per_token = [r.logprob / r.tokens for r in mine]
            pick_raw, pick_norm = raw.index(max(raw)), per_token.index(max(per_token))
            per_example.append({"index": i, "gold": example.gold, "logprobs": raw, "tokens": [r.tokens for r in mine],
                                "pred": pick_norm if task.settings.normalize == "tokens" else pick_raw,
                                "correct_raw": pick_raw == example.gold, "correct_per_token": pick_norm == example.gold})
            per_example[-1]["correct"] = per_example[-1]["pred"] == example.gold
        else:
            per_example.append({"index": i, "logprob": mine[0].logprob, "tokens": mine[0].tokens,
                                "correct": mine[0].greedy})
    n = max(len(per_example), 1)
    scores = {"accuracy": sum(e["correct"] for e in per_example) / n}
    if task.settings.kind == MULTIPLE_CHOICE:
        scores["accuracy_raw"] = sum(e["correct_raw"] for e in per_example) / n
        scores["accuracy_per_token"] = sum(e["correct_per_token"] for e in per_example) / n
    return {**scores, "truncated": truncated, "per_example": per_example}


def score_generative(task: Task, generator, builder: PromptBuilder, indices: range, progress: bool) -> dict:
    if generator is None:
        raise UserError(f"task {task.name}: a generative task needs a generator (train/evaluation/greedy.py), none given")
    requests = [builder.generation_request(i) for i in indices]
    results = []
    with tqdm(total=len(requests), desc=task.name, unit="ex", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(requests), CHUNK):
            results += generator.generate(requests[start:start + CHUNK])
            bar.update(min(CHUNK, len(requests) - start))
    per_example = []
    for i, r in zip(indices, results):
        text = cut_at_stop(r.text, task.settings.stop)[0]
        per_example.append({"index": i, "output": text, "correct": text.strip() == task.examples[i].answer.strip()})
    n = max(len(per_example), 1)
    return {"accuracy": sum(e["correct"] for e in per_example) / n,
            "truncated": sum(r.truncated > 0 for r in results), "per_example": per_example}


METRICS = {MULTIPLE_CHOICE: {"tokens": "accuracy (per-token log-likelihood)", "none": "accuracy (log-likelihood)"},
           LANGUAGE_MODELING: "exact match (greedy)", GENERATIVE: "exact match (generated)"}


def run_task(task: Task, *, scorer, generator, tokenizer, bos: int, limit: int | None = None,
             progress: bool = True) -> dict:
    """One task's result: metric, score, baseline, centered, examples, truncated, per example."""
    builder = PromptBuilder(task, tokenizer, bos)
    indices = limited(task, limit)
    kind = task.settings.kind
    if kind == GENERATIVE:
        result = score_generative(task, generator, builder, indices, progress)
    else:
        result = score_loglikelihood(task, scorer, builder, indices, progress)
    metric = METRICS[kind][task.settings.normalize] if kind == MULTIPLE_CHOICE else METRICS[kind]
    baseline = task.baseline
    return {"task": task.name, "kind": kind, "metric": metric, "score": result["accuracy"],
            "baseline": baseline, "centered": centered(result["accuracy"], baseline),
            "examples": len(indices), "of": len(task.examples), "truncated": result["truncated"],
            "num_fewshot": task.settings.num_fewshot, "chat": task.settings.chat, "source": task.source,
            **{k: v for k, v in result.items() if k.startswith("accuracy_")}, "per_example": result["per_example"]}
