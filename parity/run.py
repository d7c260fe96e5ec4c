"""`torchlyra parity`: the command line of the parity suite (`add_arguments`, `run`): the suite
on a preset or a checkpoint (parity/suite.py), `--selftest` (parity/selftest.py) and
`--trajectory` (parity/trajectory.py); prints the table, writes `--json`, exits 0 on PASS.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from parity import selftest, tolerances, trajectory
from parity.inputs import (PARITY_BATCH, PARITY_IGNORE_FRACTION, PARITY_SEQ_LEN, PARITY_TILES, PARITY_WINDOW,
                           TPU_PARITY_SEQ_LEN, TPU_PARITY_TILES, parity_config)
from parity.lora_parity import run_lora_parity
from parity.report import Report
from parity.suite import run_parity
from torch_model.config import ConfigError, ModelConfig, get_preset
from torch_model.lora import parse_lora_spec
from formats.lora_inference import lora_meta
from formats.errors import UserError
from formats.model_checks import add_module_arguments


def add_arguments(parser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="tiny",
                        help="model preset, random weights seeded by --seed (default: tiny); its sliding window "
                             f"is cut to --window")
    source.add_argument("--checkpoint", metavar="DIR", help="compare a checkpoint's weights instead of a preset (ours, "
                        "a `train --model-config` run's, or a Hugging Face directory)")
    source.add_argument("--model-config", metavar="CONFIG.json",
                        help="a transformers model (as `train --model-config`), random weights seeded by --seed: "
                             "its reference is transformers' own eager attention and experts")
    add_module_arguments(parser, "your own nn.Module (as `train --module`: path/to/file.py:NAME or "
                                 "package.module:NAME), its own init seeded by --seed: its reference is its own eager "
                                 "forward and the plain cross-entropy of its logits; rows unsegmented (a module takes "
                                 "tokens only)", args_default="none", group=source)
    parser.add_argument("--kernels", action="append", metavar="SET",
                        help="kernel set, e.g. 'attention=pallas,moe=xla' (unnamed ops run xla); repeatable or "
                             "';'-separated. Default: all-xla plus every other registered implementation of each op")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(tolerances.DTYPES),
                        help="compute dtype(s) of the lowered run (default: both)")
    parser.add_argument("--batch", type=int, default=PARITY_BATCH, help=f"rows per batch (default {PARITY_BATCH})")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per row (default: {PARITY_SEQ_LEN} on CPU, {TPU_PARITY_SEQ_LEN} on TPU; longer "
                             "than the window and several of the platform's tiles)")
    parser.add_argument("--window", type=int, default=PARITY_WINDOW,
                        help=f"sliding window of a preset's sliding layers (default {PARITY_WINDOW}); 0 keeps the "
                             "preset's. A checkpoint keeps its own")
    parser.add_argument("--kernel-options", default=None, metavar="OPTS",
                        help="op.implementation.option=value,... ('' for none: the kernels' defaults). Default: "
                             f"tiles the platform accepts, so the sequence spans several blocks; on CPU small ones "
                             f"({PARITY_TILES}), on TPU 128-row ones ({TPU_PARITY_TILES})")
    parser.add_argument("--ignore-fraction", type=float, default=PARITY_IGNORE_FRACTION,
                        help=f"fraction of labels at the ignore index (default {PARITY_IGNORE_FRACTION})")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights and the tokens")
    parser.add_argument("--full-step", action="store_true",
                        help="take post-step parameters from the compiled train step itself (slower; with "
                             "--no-segments no ignored labels)")
    parser.add_argument("--no-segments", dest="segments", action="store_false",
                        help="unsegmented rows (one sequence per row, positions 0..T-1) instead of the default packed "
                             "rows of 2-3 segments with restarting positions and a padded tail")
    parser.add_argument("--hf", action="store_true", help="also compare with Hugging Face transformers")
    parser.add_argument("--selftest", action="store_true",
                        help="run the planted-bug catalogue (parity/planted.py) on a micro model: every bug must "
                             "fail, in float32 and bfloat16; exit 0 only if all are caught")
    parser.add_argument("--trajectory", action="store_true",
                        help="100 steps of a micro model on the bundled data, eager PyTorch vs the lowered step "
                             "(float32); both sides are run")
    parser.add_argument("--lora", metavar="SPEC",
                        help="the LoRA rows instead (parity/lora_parity.py): the preset or --model-config model "
                             "wrapped by peft with random adapters (e.g. r=16,alpha=32,targets=all-linear+experts), "
                             "lowered vs eager peft (a transformers model's: on transformers' own eager attention "
                             "and experts), float32, every kernel set")
    parser.add_argument("--base-dtype", default="compute", choices=("compute", "mxfp4"),
                        help="compute (default): the checkpoint's weights in each run's dtype. mxfp4 (a released "
                             "gpt-oss base with its experts kept MXFP4, as train/generate/eval take it) is refused: "
                             "no parity rows are built for it (tests/test_mxfp4_base.py holds it to the decoded base)")
    parser.add_argument("--lora-steps", type=int, default=2, metavar="N",
                        help="with --lora or a LoRA checkpoint: also N LoRA train steps (TrainStep) against eager "
                             "peft + MuonAdamW: adapters rel <= 2e-5 together (each 1e-4), the frozen base "
                             "bit-identical (default 2; 0: off)")
    from jax_bridge.compile_cache import HELP as COMPILE_CACHE_HELP

    parser.add_argument("--compile-cache", default=None, help=COMPILE_CACHE_HELP)
    parser.add_argument("--json", metavar="OUT", help="write every check (metrics, tolerance, pass/fail) as JSON")
    parser.add_argument("--verbose", action="store_true", help="print every check, not only the failing ones")


def _write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    except OSError as e:
        raise UserError(f"--json: cannot write {path}: {e.strerror}") from None


# The eager reference and the lowered run each hold the float32 weights, and each its gradients.
HOST_COPIES = 4


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (what the kernel can give without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def check_fits_host(checkpoint) -> None:
    """The parity suite's ground truth is eager PyTorch in float32 on this host: refuse, naming the
    limit, a checkpoint (or a LoRA checkpoint's base) whose model would not fit it."""
    from formats import mesh_loader
    from formats.lora_checkpoint import LORA_META, check_base
    from formats.lora_inference import lora_meta
    from formats.model_checks import model_shapes

    meta = lora_meta(checkpoint)
    path = check_base(meta[LORA_META]["base"], f"LoRA checkpoint {checkpoint}") if meta is not None else checkpoint
    cfg, _, _ = mesh_loader.open_weights(path)
    weights = 4 * sum(int(np.prod(shape)) for shape in model_shapes(cfg).values())
    need, have = HOST_COPIES * weights, available_host_bytes()
    if need > have:
        gib = 2**30
        raise UserError(f"parity --checkpoint {checkpoint}: the eager reference holds the whole model in float32 on "
                        f"this host ({weights / gib:.1f} GiB of weights, about {HOST_COPIES}x that with the lowered "
                        f"run and both gradients: {need / gib:.1f} GiB), and this host has {have / gib:.1f} GiB "
                        f"available; parity compares models that fit one host: check a smaller configuration of the "
                        f"same architecture (--preset, --model-config) and this checkpoint with `eval`")


def run(args) -> int:
    """Run the suite from parsed arguments; print the table; 0 if every check passed, else 1."""
    from jax_bridge import compile_cache
    from train.startup import Startup

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    cache, startup = compile_cache.enable(args.compile_cache), Startup()     # where the command's time goes
    code = _run(args, say)          # a refusal stays one line: the time's line follows a run only
    startup.mark("the checks")
    say(startup.line(cache, label="time"))
    return code


def _run(args, say) -> int:
    if args.base_dtype == "mxfp4":
        raise UserError("--base-dtype mxfp4: the parity suite has no rows for an MXFP4 expert base (its experts are "
                        "frozen bytes: no gradient to compare); a LoRA run, generate and eval on it are held to the "
                        "base decoded to float32 by tests/test_mxfp4_base.py, the moe_mxfp4 kernels to their "
                        "reference by tests/test_kernel_moe_mxfp4.py; parity --checkpoint DIR compares the decoded "
                        "base")
    if args.module_args and not args.module:
        raise UserError("--module-args: the keyword arguments of --module; give --module")
    if args.selftest or args.trajectory:
        code = 0
        if args.selftest and args.model_config:      # a transformers model: random weights, no LoRA rows
            from torch_model.transformers_lm import TransformersSpec

            result = selftest.run_selftest(dtypes=tuple(args.dtype), segments=args.segments, progress=say,
                                           model_cfg=TransformersSpec.from_file(args.model_config),
                                           weights=(selftest.RANDOM,))
        elif args.selftest:
            result = selftest.run_selftest(dtypes=tuple(args.dtype), segments=args.segments, progress=say)
            lora = selftest.run_lora_selftest(progress=say)
            result = selftest.SelftestReport(result.outcomes + lora.outcomes, result.skipped,
                                             Report(result.report.setup, result.report.rows + lora.report.rows),
                                             result.controls)
        if args.selftest:
            print(result.format(verbose=args.verbose))
            _write_json(args.json, result.to_json())
            code |= 0 if result.passed else 1
        if args.trajectory:
            result = trajectory.run_trajectory(eager=True, progress=say)
            print(result.format())
            if not args.selftest:
                _write_json(args.json, result.to_json())
            code |= 0 if result.passed else 1
        return code
    if args.checkpoint:
        check_fits_host(args.checkpoint)
    if args.checkpoint and lora_meta(args.checkpoint) is not None:
        return run_lora_checkpoint(args, say)
    if args.checkpoint:
        try:
            from formats.checkpoint import load_checkpoint
        except ImportError as e:
            raise UserError(f"--checkpoint: checkpoint loading is not available ({e})") from None
        state_dict, model_cfg, _ = load_checkpoint(args.checkpoint, transformers_ok=True)
        if isinstance(model_cfg, ModelConfig):
            model_cfg = parity_config(model_cfg, window=None)
        source = f"checkpoint {args.checkpoint}"
    elif args.model_config:
        from torch_model.transformers_lm import TransformersSpec

        model_cfg, state_dict, source = TransformersSpec.from_file(args.model_config), None, args.model_config
    elif args.module:
        from formats.model_checks import module_record

        model_cfg, state_dict, source = module_record(args.module, args.module_args or {}, 0), None, args.module
        if args.segments:
            say("--module: a module takes tokens only, so the rows are unsegmented (--no-segments)")
            args.segments = False
    else:
        try:
            model_cfg = get_preset(args.preset)
        except ConfigError as e:
            raise UserError(f"--preset: {e}") from None
        if args.window < 0:
            raise UserError(f"--window must be >= 0, found {args.window}")
        model_cfg = parity_config(model_cfg, window=args.window or None)
        state_dict, source = None, f"preset {args.preset}"
    if args.lora:
        report = run_lora_parity(model_cfg, parse_lora_spec(args.lora), state_dict, kernel_sets=args.kernels,
                                 batch=args.batch, seq_len=args.seq_len, seed=args.seed,
                                 kernel_options=args.kernel_options, train_steps=args.lora_steps, progress=say)
        return _print_lora(report, source, args)
    report = run_parity(model_cfg, state_dict, kernel_sets=args.kernels, dtypes=tuple(args.dtype),
                        batch=args.batch, seq_len=args.seq_len, seed=args.seed, include_hf=args.hf,
                        full_step=args.full_step, kernel_options=args.kernel_options,
                        ignore_fraction=args.ignore_fraction, segments=args.segments, progress=say)
    report.setup["source"] = source
    print(report.format(verbose=args.verbose))
    _write_json(args.json, report.to_json())
    return 0 if report.passed else 1


def _print_lora(report, source: str, args) -> int:
    report.setup["source"] = source
    print(report.format(verbose=args.verbose))
    _write_json(args.json, report.to_json())
    return 0 if report.passed else 1


def run_lora_checkpoint(args, say) -> int:
    """--checkpoint of a LoRA run: the LoRA rows on its base and its trained adapters."""
    from formats.lora_checkpoint import LORA_META, load_base_state, load_lora_model

    wrapped, model_cfg, meta = load_lora_model(args.checkpoint)
    if isinstance(model_cfg, ModelConfig):
        model_cfg = parity_config(model_cfg, window=None)
    adapters = {n: p.detach().clone() for n, p in wrapped.named_parameters() if p.requires_grad}
    report = run_lora_parity(model_cfg, parse_lora_spec(meta[LORA_META]["spec"]),
                             load_base_state(meta), adapters, kernel_sets=args.kernels, batch=args.batch,
                             seq_len=args.seq_len, seed=args.seed, kernel_options=args.kernel_options,
                             train_steps=args.lora_steps, progress=say)
    return _print_lora(report, f"LoRA checkpoint {args.checkpoint} (base {meta[LORA_META]['base']['path']})", args)
