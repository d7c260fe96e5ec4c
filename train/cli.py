"""The `torchlyra` command: a thin layer of subcommands over the library.

Bad input is reported as one line naming the problem, with exit code 2 and no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

# subcommand -> (module with add_arguments/run, help)
COMMANDS = {
    "prepare": ("train.data.prepare", "tokenize text, JSONL or Parquet into ArrayRecord shards (default: Shakespeare)"),
    "train": ("train.run.loop", "train a model on prepared data"),
    "eval": ("train.evaluation.cli", "tasks (CORE-6, HumanEval, task files) or validation loss and bits per byte of a checkpoint"),
    "plot": ("train.run.plots", "plot a run's metrics (loss, learning rate, gradient norm, throughput, expert load)"),
    "profile": ("train.run.profile_summary", "summarise a run's profile (train --profile-steps): time per op "
                "category, measured beside the roofline's prediction"),
    "generate": ("train.generation.cli", "sample from a checkpoint"),
    "rl": ("train.rl.cli", "reinforcement learning on verifiable rewards (GRPO, DAPO, Dr. GRPO, GSPO) from a checkpoint"),
    "export": ("formats.export_cli", "write a checkpoint as Hugging Face files (LoRA: merged, or --adapter)"),
    "import": ("formats.hf_import", "read a Hugging Face GptOss directory into a checkpoint"),
    "parity": ("parity.run", "compare eager PyTorch with the lowered JAX run, per kernel set"),
    "bench": ("train.bench.cli", "benchmarks: kernel memory and speed, the train step against PyTorch peers"),
    "plan": ("train.run.plan", "compile the train step for a TPU slice (no weights, no TPU) and check it fits"),
    "lm-eval": ("train.evaluation.lm_eval_cli", "lm-evaluation-harness with the torchlyra backend (lm-eval's arguments)"),
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, without breaking a line inside a hyphenated word (--no-scan-layers, lyra-small)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `only` (a command's name), that command's arguments alone: the
    other commands' modules are not imported (a command starts about 1.5 s sooner)."""
    parser = argparse.ArgumentParser(prog="torchlyra", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        p.set_defaults(_module=module)
        if only in COMMANDS and name != only:
            continue
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def quiet_optional_packages() -> None:
    """torchao (torchtune's, in the `models` extra) is imported by transformers and peft wherever
    it is installed: its notes that its CUDA kernels do not load here, and torch's about the enums
    it registers, say nothing about the command run."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    quiet_optional_packages()
    from jax_bridge.registry import KernelError
    from torch_model.config import ConfigError
    from formats.errors import UserError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(only=argv[0] if argv else None).parse_args(argv)
    args.argv = argv           # a supervising parent runs the same command in a child
    if getattr(args, "_missing", False):
        print(f"torchlyra: error: the {args.command} command is not available in this build", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(args._module).run(args)
    except (UserError, ConfigError, KernelError) as e:
        print(f"torchlyra {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        # The module a command took (--module) is process state: the next command run in this
        # process (a notebook's, a test's) builds its own run's. Loaded only if a command used it.
        model_checks = sys.modules.get("formats.model_checks")
        if model_checks is not None:
            model_checks.take_module_from(None)


if __name__ == "__main__":
    sys.exit(main())
