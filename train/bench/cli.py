"""The `torchlyra bench` command: one subcommand per benchmark module of this package (kernels, step,
generate, data); each module owns its flags and its run."""
from __future__ import annotations

import importlib

# subcommand -> (module, help)
BENCHMARKS = {
    "kernels": ("train.bench.kernels", "kernel temporary memory (and CPU speed)"),
    "step": ("train.bench.step", "the train step against eager, compiled and transformers PyTorch peers "
                                 "(speed ratios, MFU)"),
    "generate": ("train.bench.generate", "decode tokens/s and time to first token against transformers"),
    "data": ("train.bench.data", "preparation vs raw tiktoken, and loader throughput"),
    "eval": ("train.bench.evaluation", "multiple-choice scoring examples/s against lm-eval's hf backend"),
}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="what", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, (module, help_text) in BENCHMARKS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text))


def run(args) -> int:
    return importlib.import_module(BENCHMARKS[args.what][0]).run(args)
