"""`torchlyra lm-eval ARGS...`: lm-eval's own command line with the `torchlyra` backend registered
(`--model torchlyra` unless another model is named), e.g.
`torchlyra lm-eval --model_args checkpoint=runs/tiny --tasks T --include_path DIR --log_samples`."""
from __future__ import annotations

import argparse
import multiprocessing
import sys

LM_EVAL_COMMANDS = ("run", "ls", "validate")


def lm_eval_argv(args: list[str]) -> list[str]:
    """lm-eval's argv for `torchlyra lm-eval ARGS`: its `run` command unless another is named
    (or help is asked for), with `--model torchlyra` unless a model is named."""
    from train.evaluation.lm_eval_backend import NAME

    if args and args[0] not in LM_EVAL_COMMANDS + ("-h", "--help"):
        args = ["run", *args]
    if args[:1] == ["run"] and not any(a == "--model" or a.startswith("--model=") for a in args):
        args = ["run", "--model", NAME, *args[1:]]
    return ["lm-eval", *args]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER,
                        help="lm-eval's own arguments (see `torchlyra lm-eval --help`)")
    # Every argument, options included, belongs to lm-eval: this parser must read none as its own.
    parser.prefix_chars = "\0"


def run(args) -> int:
    from lm_eval.__main__ import cli_evaluate

    from train.evaluation.lm_eval_backend import register

    register()
    # lm-eval's bootstrap pool and its table writer start worker processes; forked from a process
    # that runs JAX (multithreaded) they may deadlock, so while lm-eval runs they come from a
    # fork server (a clean single-threaded process) instead.
    saved_argv, saved_method = sys.argv, multiprocessing.get_start_method(allow_none=True)
    sys.argv = lm_eval_argv(list(args.lm_eval_args))
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        cli_evaluate()
    finally:
        sys.argv = saved_argv
        multiprocessing.set_start_method(saved_method, force=True)
    return 0
