"""Task scores during training (`train --eval-tasks core --eval-every N`): the tasks are read once at
start; at each evaluation the run's parameters, where they are (sharded on its mesh, nothing
gathered), are scored by the compiled scorer on the first `limit` examples of each task, every
process taking part, and the scores become fields of the "eval" record."""
from __future__ import annotations

from formats.errors import UserError
from train.evaluation.suite import HUMANEVAL, load_tasks, parse_spec, run_suite
from train.evaluation.tasks import GENERATIVE


class TaskEvaluator:
    def __init__(self, spec: str, tokenizer, model_cfg, limit: int):
        names = parse_spec(spec)
        if HUMANEVAL in names:
            raise UserError("--eval-tasks: humaneval runs generated programs; run it with `torchlyra eval`")
        self.names, self.tokenizer, self.model_cfg, self.limit = names, tokenizer, model_cfg, limit
        self.tasks = load_tasks(names)          # a fetch or a bad task file fails before training
        for task in self.tasks:
            if task.settings.kind == GENERATIVE:
                raise UserError(f"--eval-tasks: task {task.name} is generative; training evaluates "
                                "log-likelihood tasks only (run it with `torchlyra eval`)")

    def scorer(self, model, *, mesh, compute_dtype: str, scan_layers: bool):
        """The compiled scorer of the run's model (it may hold its weights on `meta`): built once,
        given the parameters at each evaluation (`__call__`)."""
        from train.evaluation.scorer import CompiledScorer

        return CompiledScorer(model, mesh=mesh, compute_dtype=compute_dtype, scan_layers=scan_layers,
                              tokenizer=self.tokenizer, progress=False)

    def __call__(self, scorer, params: dict) -> dict:
        """{"tasks": {name: score}, "tasks_centered": {name: centered}[, "core6": mean centered]} of
        `params` (named as the scorer's layout stacks them: the train state's)."""
        from train.evaluation.core import SUITE_NAME

        scorer.set_params(params)
        evaluation = run_suite(self.names, self.tasks, scorer=scorer, generator=None, tokenizer=self.tokenizer,
                               bos=self.model_cfg.bos_token_id, limit=self.limit, progress=False)
        results = evaluation["tasks"]
        record = {"tasks": {r["task"]: r["score"] for r in results},
                  "tasks_centered": {r["task"]: r["centered"] for r in results}}
        record.update({"core6": s["score"] for s in evaluation["suites"] if s["name"] == SUITE_NAME})
        return record
