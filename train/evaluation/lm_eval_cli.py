"""`torchlyra lm-eval ARGS...`: lm-eval's own command line with the `torchlyra` backend registered
(`--model torchlyra` unless another model is named), e.g.
`torchlyra lm-eval --model_args checkpoint=runs/tiny --tasks T --include_path DIR --log_samples`."""
from __future__ import annotations

import argparse
import contextlib
import io
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


CLUSTER_FLAGS = {"--coordinator": "coordinator", "--num-processes": "num_processes", "--process-id": "process_id"}
# lm-eval's options that write files: given to process 0 only (every process computes the same).
WRITING_FLAGS = {"--output_path": 1, "-o": 1, "--log_samples": 0, "-s": 0, "--wandb_args": 1, "--hf_hub_log_args": 1}


def split_cluster_flags(argv: list[str]) -> tuple[list[str], dict]:
    """(lm-eval's arguments, our cluster settings) of `torchlyra lm-eval ARGS`: `--coordinator`,
    `--num-processes` and `--process-id` (as `train` takes them) are ours, the rest lm-eval's."""
    rest, cluster, i = [], dict.fromkeys(CLUSTER_FLAGS.values()), 0
    while i < len(argv):
        flag, _, value = argv[i].partition("=")
        if flag in CLUSTER_FLAGS:
            if not value:
                i += 1
                value = argv[i] if i < len(argv) else None
            cluster[CLUSTER_FLAGS[flag]] = value if flag == "--coordinator" else int(value)
        else:
            rest.append(argv[i])
        i += 1
    return rest, cluster


def without_writing(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].partition("=")[0]
        if flag in WRITING_FLAGS:
            i += 1 + (WRITING_FLAGS[flag] if "=" not in argv[i] else 0)
            continue
        out.append(argv[i])
        i += 1
    return out


def run(args) -> int:
    """On several processes every one runs lm-eval alike (the same requests, in lockstep over the
    global mesh: the backend's scorer); process 0 alone prints and writes lm-eval's output."""
    import argparse as _argparse

    from train.cluster import join

    lm_args, cluster = split_cluster_flags(list(args.lm_eval_args))
    code = join.join(_argparse.Namespace(argv=args.argv, **cluster), "lm-eval")
    if code is not None:          # this process supervised the others
        return code
    import jax

    if jax.process_index() != 0:
        lm_args = without_writing(lm_args)
    with join.together("lm-eval"), (contextlib.redirect_stdout(io.StringIO()) if jax.process_index()
                                    else contextlib.nullcontext()):
        return _run(lm_args)


def _run(lm_args: list[str]) -> int:
    import jax
    from lm_eval.__main__ import cli_evaluate

    from train.evaluation.lm_eval_backend import register
    from train.startup import Startup

    register()
    startup = Startup()             # where the command's time goes; our backend marks its loading
    # lm-eval's bootstrap pool and its table writer start worker processes; forked from a process
    # that runs JAX (multithreaded) they may deadlock, so while lm-eval runs they come from a
    # fork server (a clean single-threaded process) instead.
    saved_argv, saved_method = sys.argv, multiprocessing.get_start_method(allow_none=True)
    sys.argv = lm_eval_argv(lm_args)
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        cli_evaluate()
    finally:
        sys.argv = saved_argv
        multiprocessing.set_start_method(saved_method, force=True)
    if len(startup.phases) > 1:     # our backend marked its loading: it ran (not another lm-eval model)
        startup.mark("lm-eval's tasks and scoring")
        cache = jax.config.jax_compilation_cache_dir or None
        print(startup.line(cache, label="time"))
    return 0
