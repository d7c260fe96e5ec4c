"""Task scores during training (`train --eval-tasks core --eval-every N`): the tasks are read once at
start; at each evaluation the host parameters are scored by the eager reference scorer (float32)
on the first `limit` examples of each task, and the scores become fields of the "eval" record."""
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

    def __call__(self, host_params: dict) -> dict:
        """{"tasks": {name: score}, "tasks_centered": {name: centered}[, "core6": mean centered]}."""
        from formats.model_checks import build_model, load_weights
        from jax_bridge.step import host_tensor
        from train.evaluation.core import SUITE_NAME
        from train.evaluation.eager_scorer import EagerScorer

        model = build_model(self.model_cfg)         # ours or the run's transformers model
        if any(name.endswith("_blocks") for name in host_params):     # a LoRA run's MXFP4 expert base
            from torch_model.model import mxfp4_expert_modules
            mxfp4_expert_modules(model)
        load_weights(model, {k: host_tensor(v) for k, v in host_params.items()})
        evaluation = run_suite(self.names, self.tasks, scorer=EagerScorer(model.eval()), generator=None,
                               tokenizer=self.tokenizer, bos=self.model_cfg.bos_token_id, limit=self.limit,
                               progress=False)
        results = evaluation["tasks"]
        record = {"tasks": {r["task"]: r["score"] for r in results},
                  "tasks_centered": {r["task"]: r["centered"] for r in results}}
        record.update({"core6": s["score"] for s in evaluation["suites"] if s["name"] == SUITE_NAME})
        return record
