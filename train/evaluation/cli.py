"""`torchlyra eval`: with `--tasks`, task evaluation (CORE-6, HumanEval, task files) written as JSON
and a markdown report card; without, validation loss and bits per byte (validation.py), as before.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io

from formats.errors import UserError
from jax_bridge import compile_cache
from jax_bridge.compile_cache import HELP as COMPILE_CACHE_HELP
from train.cluster import join
from train.evaluation import validation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from formats.model_checks import add_module_arguments

    validation.add_arguments(parser)
    add_module_arguments(parser)
    parser.add_argument("--tasks", help="comma-separated: core (CORE-6, BIG-bench JSON), one of its tasks, humaneval, "
                                        "or FILE.jsonl (a task file); without it, validation loss and bits per byte")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N examples of each task")
    parser.add_argument("--report", help="write the markdown report card here")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per scoring or generation batch (16)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="the window a prompt is scored in (default: the model's max_seq_len); longer prompts "
                             "lose tokens on the left, counted per task")
    parser.add_argument("--mesh", default="",
                        help="device mesh for scoring, as for `train --mesh` (fsdp runs as tensor as far as the "
                             "heads divide)")
    parser.add_argument("--scorer", choices=("compiled", "eager"), default=None,
                        help="compiled (default): the jitted scoring program; eager: the float32 PyTorch reference (slow)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--compile-cache", default=None, help=COMPILE_CACHE_HELP)
    join.add_arguments(parser)


def load_model(checkpoint: str, merge: bool = False, base_dtype: str = "compute"):
    """(float32 torch model, tokenizer, model info) of a checkpoint (ours, a Hugging Face one, or
    LoRA adapters on their base)."""
    from train.evaluation.scorer import load_evaluated_model

    model, tokenizer, found, info = load_evaluated_model(checkpoint, merge=merge, base_dtype=base_dtype)
    if tokenizer is None:
        raise UserError(f"checkpoint {checkpoint}: no tokenizer to build prompts with (tokenizer: {found})")
    return model, tokenizer, info


def eager_generator(args, model, tokenizer):
    """The compiled greedy generator (train/evaluation/greedy.py) on the eager scorer's model (the
    compiled scorer has its own: `CompiledScorer.generator`)."""
    from train.evaluation.greedy import GreedyGenerator

    return GreedyGenerator(model, tokenizer, kernels=args.kernels, batch_size=args.batch_size,
                           max_length=args.max_length)


def run_tasks(args, startup=None) -> dict:
    """`startup` (train.startup.Startup), when given, is marked after the model loads and after
    the scoring."""
    import jax

    from train.evaluation.report import print_summary, report_card, write_json
    from train.evaluation.suite import HUMANEVAL, load_tasks, parse_spec, run_suite

    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit must be > 0, found {args.limit}")
    names = parse_spec(args.tasks)
    args.batch_size = 16 if args.batch_size is None else args.batch_size
    args.scorer = args.scorer or "compiled"
    tasks = load_tasks(names)                   # a bad name or task file fails before the model loads
    if args.scorer == "compiled":
        from train.evaluation.scorer import load_scorer

        mesh = join.command_mesh(args.mesh)
        scorer, tokenizer, info = load_scorer(args.checkpoint, kernels=args.kernels, mesh=mesh,
                                              batch_size=args.batch_size, max_length=args.max_length,
                                              merge=args.merge, base_dtype=args.base_dtype, progress=False)
        join.say_inference_mesh("eval", mesh, scorer.mesh)
        if tokenizer is None:
            raise UserError(f"checkpoint {args.checkpoint}: no tokenizer to build prompts with")
    else:
        if args.mesh:
            raise UserError("--mesh: the eager scorer runs on the host, unsharded; use --scorer compiled")
        from train.evaluation.eager_scorer import EagerScorer

        model, tokenizer, info = load_model(args.checkpoint, args.merge, args.base_dtype)
        if args.max_length is not None and not 0 < args.max_length <= model.cfg.max_position_embeddings:
            raise UserError(f"--max-length must be in [1, {model.cfg.max_position_embeddings}], found {args.max_length}")
        scorer = EagerScorer(model, args.max_length)
    if startup is not None:
        startup.mark("loading the model")
    bos = scorer.model.cfg.bos_token_id
    generative = HUMANEVAL in names or any(t.settings.kind == "generative" for t in tasks)
    generator = None
    if generative:
        generator = scorer.generator() if args.scorer == "compiled" else eager_generator(args, model, tokenizer)
    evaluation = run_suite(names, tasks, scorer=scorer, generator=generator, tokenizer=tokenizer,
                           bos=bos, limit=args.limit, progress=args.progress)
    if startup is not None:
        startup.mark("scoring")
    evaluation = {"model": info, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "scorer": args.scorer, "limit": args.limit, "window": scorer.max_length, **evaluation}
    print(f"checkpoint {info['checkpoint']} (step {info['step']}):")
    print_summary(evaluation)
    if jax.process_index() != 0:        # the results are written once
        return evaluation
    if args.json_out:
        write_json(args.json_out, evaluation)
        print(f"  written to {args.json_out}")
    if args.report:
        from formats.atomic import write_atomic

        write_atomic(args.report, report_card(evaluation).encode())
        print(f"  report card written to {args.report}")
    return evaluation


def run(args) -> int:
    """On several processes (`--tasks`): each loads its share of the weights, all score the same
    requests in lockstep over the global mesh; process 0 prints and writes the results."""
    code = join.join(args, "eval")
    if code is not None:          # this process supervised the others
        return code
    from formats.model_checks import take_module_from_args

    take_module_from_args(args)
    import jax

    if jax.process_count() > 1 and not args.tasks:
        raise UserError("eval: validation loss runs in one process; on several processes evaluate --tasks")
    with join.together("eval"), (contextlib.redirect_stdout(io.StringIO()) if jax.process_index()
                                 else contextlib.nullcontext()):
        return _run(args)


def _run(args) -> int:
    if not args.tasks:
        for flag in ("limit", "report", "max_length", "batch_size", "mesh", "scorer"):
            if getattr(args, flag) not in (None, ""):
                raise UserError(f"--{flag.replace('_', '-')} needs --tasks (without it, eval measures validation loss)")
    from train.startup import Startup

    cache, startup = compile_cache.enable(args.compile_cache), Startup()     # where the command's time goes
    if args.tasks:
        run_tasks(args, startup)
        code = 0
    else:
        code = validation.run(args)
        startup.mark("loading and scoring")
    print(f"  {startup.line(cache, label='time')}")
    return code
