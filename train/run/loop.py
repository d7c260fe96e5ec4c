"""`torchlyra train`: the training loop around the one-jit step.

The loop below is the whole schedule of a run; each line calls one job of `train/run/trainer.py`
(setup and resume, step, logging, evaluation, checkpoints, the end). Stopping signals live in
`train/cluster/preemption.py`, the checkpoint format in `formats/checkpoint.py`, metrics in
`train/run/metrics.py`, evaluation in `train/evaluation/`. A multi-host run trains under a small
parent process that reports a lost host in one line (`train/cluster/host_supervisor.py`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from formats.errors import UserError
from formats.mxfp4 import BASE_DTYPES
from torch_model.config import PRESETS
from torch_model.lora import LoraSpec
from torch_model.optim import ADAPTER_OPTIMIZERS, NS_DTYPES, OPTIMIZERS
from torch_model.preference import LOSSES as DPO_LOSSES, PreferenceConfig
from train.cluster import join
from train.run.config import COMPUTE_DTYPES, REMATS, TrainConfig, load_config_file
from formats.jsonfile import json_object
from train.run.flags import BOOLEAN, REPEATED, SWITCH, Flag, add_flags, field_defaults, given, spec_defaults


def run_training(cfg: TrainConfig, *, explicit: dict | None = None, show_progress: bool = True) -> dict:
    """Train (or continue, with cfg.resume) a run; returns its summary. `explicit` are the settings
    the user gave (a resumed run takes the rest from its checkpoint)."""
    import jax

    from train.startup import Startup

    startup = Startup()             # where the start goes: printed and recorded at the first step
    startup.start_devices()
    if jax.process_count() == 1:
        return _train(cfg, explicit, show_progress, startup)
    # Every process ends together: none waits alone at JAX's shutdown (host_timeout_s) while
    # process 0 writes plots and samples; a failed collective may be a dead peer.
    with join.together("run", cfg.host_timeout_s):
        return _train(cfg, explicit, show_progress, startup)


def train_module(module, **settings) -> dict:
    """Train `module`, a plain torch.nn.Module a notebook holds (forward(tokens [B, T]) -> logits
    [B, T, V], as docs/own-model.md describes), as `torchlyra train --module` trains one: `settings`
    are TrainConfig fields (data, out, steps, batch_size, seq_len, mesh, resume, ...). The run
    records no SPEC, so its later commands take `--module path/to/file.py:NAME` (and
    `--module-args`) to build it again; a resumed run is given the module again here. The
    module's own weights are the initial ones. Returns the run's summary (see `run_training`)."""
    from formats.model_checks import take_module_from

    if settings.get("module") or settings.get("model_config"):
        raise UserError("train_module: the module is the model; give no module or model_config setting")
    try:
        cfg = TrainConfig(**settings)
    except TypeError as e:
        raise UserError(f"train_module: {e}") from None
    take_module_from(module)
    try:
        return run_training(cfg, explicit=dict(settings))
    finally:
        take_module_from(None)


def _train(cfg: TrainConfig, explicit: dict | None, show_progress: bool, startup) -> dict:
    from jax_bridge import compile_cache
    from train.cluster.preemption import StopSignals
    from train.run.profiling import StepProfiler
    from train.run.trainer import Trainer, resume_point
    from jax_bridge.distributed import say

    cache = compile_cache.enable(cfg.compile_cache or None)
    cfg, resume_dir, meta = resume_point(cfg, explicit or {})
    startup.mark("finding the checkpoint")
    if meta and meta["step"] >= cfg.steps:
        say(f"{cfg.out}: the run already reached step {meta['step']} (--steps {cfg.steps}); nothing to do "
              f"(pass a larger --steps to extend it)")
        return {"steps": meta["step"], "already_finished": True, "checkpoint": str(resume_dir)}
    trainer = Trainer(cfg, resume_dir, meta, explicit=explicit, show_progress=show_progress,
                      startup=(startup, cache))
    profiler = StepProfiler(cfg.profile_steps, trainer.out / "profile", cfg.steps)
    try:
        with StopSignals() as stop:
            if trainer.done == 0:
                trainer.evaluate()
            while trainer.done < cfg.steps:
                profiler.before(trainer.done + 1, trainer.state)
                metrics = trainer.train_step(trainer.next_batch())
                trainer.write_pending_log()      # the previous log step's record, this step queued behind it
                traced = profiler.after(trainer.done, metrics)
                if traced is not None:
                    trainer.profiled(traced)
                if trainer.is_log_step():
                    trainer.queue_log(metrics)
                if trainer.done % cfg.eval_every == 0 or trainer.done == cfg.steps:
                    trainer.evaluate()
                if trainer.done % cfg.checkpoint_every == 0:
                    trainer.save()
                if stop.requested:
                    return trainer.stop(stop.reason)
            return trainer.finish()
    finally:
        profiler.close()
        trainer.close()


# ---- command line -------------------------------------------------------------------------------
# One row per flag of TrainConfig: `--field-name` (dest: the field) in its group, with its help; the
# default shown is the field's (flags.py). Adding a flag is adding a row (and the field).
_DEFAULTS = field_defaults(TrainConfig)
_GROUPS = {
    "model": "what trains: a preset, a transformers config, your own nn.Module, or the model of a checkpoint",
    "data": "prepared data (torchlyra prepare) and the rows cut from it",
    "optimization": "Muon for the hidden weight matrices, AdamW for embeddings, head, routers and vectors; "
                    "linear warm-up, then cosine decay",
    "parallelism and kernels": None,
    "evaluation and samples": None,
    "checkpoints": "OUT holds checkpoints/, metrics.jsonl, plots/, train_config.json and summary.json",
    "fine-tuning": "LoRA, frozen parameters and DPO, on the model of --init-from",
    "profiling and logging": None,
    join.MULTI_HOST: join.MULTI_HOST_HELP,
}
_FLAGS = {
    # model
    "preset": Flag("model", f"model preset: {', '.join(PRESETS)}; with --init-from the checkpoint's model trains "
                            "(a --preset given beside it must have its shapes)"),
    "model_config": Flag("model", "train the model of this transformers config.json instead of a preset "
                                  "(torch_model/transformers_lm.py)", metavar="CONFIG.json", unset="the --preset"),
    "module": Flag("model", "train your own nn.Module: path/to/file.py:NAME or package.module:NAME, a class or "
                            "function called with --module-args that returns a module whose forward(tokens [B, T]) "
                            "gives the logits [B, T, V] (docs/own-model.md); with --init-from or --resume, where the "
                            "run's module code is", metavar="SPEC", unset="a preset"),
    "module_args": Flag("model", "the keyword arguments of --module's NAME, a JSON object, e.g. "
                                 "'{\"vocab_size\": 4096, \"dim\": 256}'", json_object, metavar="JSON", unset="none"),
    "init_from": Flag("model", "start from this checkpoint's parameters with a fresh optimizer state: a run, its "
                               "checkpoints/ or a step directory, or a Hugging Face directory (read straight onto "
                               "the mesh)", metavar="DIR", unset="a new model, randomly initialized"),
    # data
    "data": Flag("data", "prepared data directory: text (next-token loss), conversations (prepare --chat: the "
                         "weighted tokens train) or preference pairs (prepare --preferences: needs --dpo)",
                 metavar="DIR"),
    "batch_size": Flag("data", "rows per micro-batch, over all devices (the global batch)", int, metavar="ROWS"),
    "seq_len": Flag("data", "tokens per row", int, metavar="TOKENS"),
    "seed": Flag("data", "seed of the data order, the initial weights (and LoRA adapters) and the samples", int),
    "document_masking": Flag("data", "each document (conversation) its own segment: attention stays inside it and "
                                     "positions restart; --no-document-masking: rows attend across documents",
                             kind=BOOLEAN, unset="on for chat data, off for text"),
    "truncate": Flag("data", "chat data: cut a conversation longer than a row to one row instead of dropping it",
                     kind=SWITCH),
    # optimization
    "steps": Flag("optimization", "optimizer steps in all (with --resume, a larger number extends the run)", int),
    "micro_batches": Flag("optimization", "gradient accumulation: each step sums the gradients of this many "
                                          "micro-batches of --batch-size rows, in one compiled step", int),
    "lr": Flag("optimization", "peak learning rate of Muon (the hidden weight matrices)", float),
    "adam_lr": Flag("optimization", "peak learning rate of AdamW (embeddings, head, routers, norms, biases)", float),
    "warmup_steps": Flag("optimization", "steps of linear warm-up to the peak learning rates; then cosine decay to "
                                         f"{_DEFAULTS['min_lr_ratio']:g} of the peak at --steps (min_lr_ratio in a "
                                         "--config file)", int),
    "optimizer": Flag("optimization", "muon: Muon for the hidden weight matrices, AdamW for the rest; adamw: AdamW "
                                      "for every parameter, at --adam-lr", choices=OPTIMIZERS),
    "ns_dtype": Flag("optimization", "dtype of Muon's Newton-Schulz iteration (bfloat16: slightly faster on TPU)",
                     choices=NS_DTYPES),
    "max_consecutive_skips": Flag("optimization", "a step with a non-finite loss or gradient norm skips its "
                                                  "update; this many in a row stop the run, with a checkpoint", int),
    # parallelism and kernels
    "mesh": Flag("parallelism and kernels", "device mesh: axis=size,... over data, fsdp, tensor, expert (one size "
                                            "may be -1: the remaining devices), e.g. data=2,fsdp=4",
                 metavar="AXIS=SIZE,...", unset="every device on fsdp; on one device no mesh"),
    "kernels": Flag("parallelism and kernels", "implementation of each op (attention, cross_entropy, moe): auto "
                                               "(per op the best that runs here), one name for every op (e.g. "
                                               "xla), or op=name,... such as attention=pallas,moe=xla "
                                               "(docs/kernels.md)", metavar="SPEC"),
    "kernel_options": Flag("parallelism and kernels", "per-implementation options op.name.option=value,... (e.g. "
                                                      "attention.pallas.block_q=256), a tile table FILE.json "
                                                      "(bench kernels --tune), or tiles=off",
                           metavar="SPEC", unset="on a TPU its generation's committed tile table, else each "
                                                 "kernel's default tiles"),
    "compute_dtype": Flag("parallelism and kernels", "dtype of the step's matmuls and activations (the master "
                                                     "weights stay float32); auto: bfloat16 on TPU and GPU, float32 "
                                                     "on CPU", choices=COMPUTE_DTYPES),
    "remat": Flag("parallelism and kernels", "per layer, what the backward recomputes: none (every activation "
                                             "kept), full (only each layer's input kept), save-matmuls (the "
                                             "projections' outputs kept)", choices=REMATS),
    "scan_layers": Flag("parallelism and kernels", "the decoder layers as one lax.scan over stacked parameters; "
                                                   "--no-scan-layers: a loop (longer compile)", kind=BOOLEAN),
    # evaluation and samples
    "eval_every": Flag("evaluation and samples", "steps between evaluations of validation loss and bits per byte "
                                                 "(also before the first step and after the last)", int),
    "eval_batches": Flag("evaluation and samples", "validation batches per evaluation", int),
    "eval_tasks": Flag("evaluation and samples", "also score these log-likelihood tasks at each evaluation, as "
                                                 "eval --tasks: core (CORE-6), one of its tasks, or FILE.jsonl",
                       metavar="TASKS", unset="none"),
    "eval_tasks_limit": Flag("evaluation and samples", "the first N examples of each --eval-tasks task", int,
                             metavar="N"),
    "samples": Flag("evaluation and samples", "texts sampled from the trained model at the end, 0: none (each "
                                              f"up to {_DEFAULTS['sample_tokens']} tokens at temperature "
                                              f"{_DEFAULTS['temperature']:g}, top-k {_DEFAULTS['top_k']}: "
                                              "sample_tokens, temperature, top_k in a --config file)", int),
    # checkpoints
    "out": Flag("checkpoints", "run directory", metavar="DIR"),
    "resume": Flag("checkpoints", "continue the run in --out from its newest complete checkpoint; flags beside "
                                  "it may change the length, the cadences, evaluation, samples, kernels, mesh, "
                                  "remat and profiling, nothing else", kind=SWITCH),
    "checkpoint_every": Flag("checkpoints", "steps between checkpoints (the last step is always saved)", int),
    "keep_checkpoints": Flag("checkpoints", "the newest N checkpoints are kept, older ones deleted", int,
                             metavar="N"),
    # fine-tuning
    "lora": Flag("fine-tuning", "train peft LoRA adapters, the base frozen: keys r, alpha, dropout, targets "
                                "(all-linear, attention, experts, module names, joined by +) and modules_to_save, "
                                "e.g. r=16,alpha=32,targets=all-linear+experts (keys left out: "
                                f"{spec_defaults(LoraSpec)})", metavar="SPEC", unset="off"),
    "adapter_optimizer": Flag("fine-tuning", "optimizer of the LoRA adapters of linear layers (the experts' "
                                             "adapters always take AdamW)", choices=ADAPTER_OPTIMIZERS),
    "base_dtype": Flag("fine-tuning", "a LoRA run's frozen experts: compute (in the compute dtype) or mxfp4 (as "
                                      "gpt-oss releases them; --init-from a released gpt-oss directory)",
                       choices=BASE_DTYPES),
    "freeze": Flag("fine-tuning", "leave the parameters whose names match this shell-style pattern untrained "
                                  "(repeatable), e.g. '*.mlp.router.*' or 'model.embed_tokens.weight'",
                   kind=REPEATED, metavar="PATTERN", unset="none"),
    "dpo": Flag("fine-tuning", "DPO on preference pairs (prepare --preferences), the --init-from model the "
                               f"reference: keys beta, loss ({' or '.join(DPO_LOSSES)}), label_smoothing (keys left "
                               f"out: {spec_defaults(PreferenceConfig)})", metavar="SPEC", unset="off"),
    # profiling and logging
    "log_every": Flag("profiling and logging", "steps between metric records in OUT/metrics.jsonl (the first and "
                                               "last step are logged too)", int),
    "tensorboard": Flag("profiling and logging", "also write TensorBoard event files to OUT/tensorboard",
                        kind=SWITCH),
    "compile_cache": Flag("profiling and logging", "persistent compilation cache directory, or off: a second run "
                                                   "(or a --resume) of the same step loads its programs instead of "
                                                   "compiling them", metavar="DIR",
                          unset="$TORCHLYRA_COMPILE_CACHE, else ~/.cache/torchlyra/jax-compile"),
    "profile_steps": Flag("profiling and logging", "a jax.profiler trace of train steps A to B (counted from 1) "
                                                   "into OUT/profile, summarised per op category (torchlyra "
                                                   "profile OUT)", metavar="A:B", unset="no trace"),
    # multi-host
    "host_timeout_s": Flag(join.MULTI_HOST, "seconds a peer may stay silent before it counts as lost; the other "
                                            "hosts then stop (exit 75)", int, metavar="SECONDS"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.json",
                        help="JSON file of training settings, any TrainConfig field (flags override it)")
    groups = add_flags(parser, _FLAGS, TrainConfig, _GROUPS)
    join.add_arguments(parser, groups[join.MULTI_HOST])


def config_from_args(args) -> tuple[TrainConfig, dict]:
    """(config, the settings given explicitly by the config file and flags)."""
    explicit = load_config_file(args.config) if args.config else {}
    explicit.update(given(args, _FLAGS))
    try:
        return TrainConfig(**explicit), explicit
    except TypeError as e:
        raise UserError(f"config: {e}") from None


def run(args) -> int:
    from jax_bridge import distributed

    cfg, explicit = config_from_args(args)
    code = join.join(args, "train", out=cfg.out, host_timeout_s=cfg.host_timeout_s)
    if code is not None:          # this process supervised the run
        return code
    if cfg.preset not in PRESETS:
        raise UserError(f"unknown preset {cfg.preset!r}; choose one of: {', '.join(PRESETS)}")
    summary = run_training(cfg, explicit=explicit)
    if "train_seconds" not in summary or not distributed.is_main_process():   # stopped, finished, or not process 0
        return 0
    start = summary.get("val_loss_start")
    bpb = summary["val_bpb_end"]
    print(f"\ntrained to step {summary['steps']} in {summary['train_seconds']:.0f} s; validation loss "
          + (f"{start:.3f} -> " if start is not None else "") + f"{summary['val_loss_end']:.3f}"
          + (f" ({bpb:.3f} bits/byte)" if bpb is not None else " (DPO loss per held-out pair)"))
    for s in summary["samples"]:
        print(f"\n--- sample ---\n{s['text']}")
    if summary.get("profile_summary"):
        from train.run.profile_summary import format_summary

        print("\n" + format_summary(json.loads(Path(summary["profile_summary"]).read_text())))
    print(f"\nmetrics:    {summary['metrics']}\nplots:      {', '.join(summary['plots'])}\n"
          + (f"profile:    {summary['profile_summary']}\n" if summary.get("profile_summary") else "")
          + f"checkpoint: {summary['checkpoint']}")
    return 0
