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

from train.cluster import join
from train.run.config import TrainConfig, load_config_file
from formats.errors import UserError


def run_training(cfg: TrainConfig, *, explicit: dict | None = None, show_progress: bool = True) -> dict:
    """Train (or continue, with cfg.resume) a run; returns its summary. `explicit` are the settings
    the user gave (a resumed run takes the rest from its checkpoint)."""
    import jax

    if jax.process_count() == 1:
        return _train(cfg, explicit, show_progress)
    # Every process ends together: none waits alone at JAX's shutdown (host_timeout_s) while
    # process 0 writes plots and samples; a failed collective may be a dead peer.
    with join.together("run", cfg.host_timeout_s):
        return _train(cfg, explicit, show_progress)


def _train(cfg: TrainConfig, explicit: dict | None, show_progress: bool) -> dict:
    from train.cluster.preemption import StopSignals
    from train.run.profiling import StepProfiler
    from train.run.trainer import Trainer, resume_point

    from jax_bridge.distributed import say

    cfg, resume_dir, meta = resume_point(cfg, explicit or {})
    if meta and meta["step"] >= cfg.steps:
        say(f"{cfg.out}: the run already reached step {meta['step']} (--steps {cfg.steps}); nothing to do "
              f"(pass a larger --steps to extend it)")
        return {"steps": meta["step"], "already_finished": True, "checkpoint": str(resume_dir)}
    trainer = Trainer(cfg, resume_dir, meta, explicit=explicit, show_progress=show_progress)
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
_FLAGS = {"preset": str, "data": str, "out": str, "steps": int, "batch_size": int, "seq_len": int,
          "micro_batches": int, "lr": float, "adam_lr": float, "warmup_steps": int, "kernels": str,
          "kernel_options": str, "compute_dtype": str, "seed": int, "eval_every": int, "eval_batches": int, "eval_tasks": str, "eval_tasks_limit": int, "samples": int,
          "log_every": int, "checkpoint_every": int, "keep_checkpoints": int, "init_from": str,
          "max_consecutive_skips": int, "host_timeout_s": int, "mesh": str, "remat": str, "lora": str,
          "adapter_optimizer": str, "ns_dtype": str, "base_dtype": str, "dpo": str, "profile_steps": str,
          "model_config": str}
_SWITCHES = {"resume": "continue the run in --out from its newest complete checkpoint",
             "tensorboard": "also write TensorBoard event files to OUT/tensorboard",
             "truncate": "chat data: cut a conversation longer than a row to one row (default: drop it)"}
_BOOLEANS = {"scan_layers": "decoder layers as one lax.scan over stacked parameters (default), or a loop",
             "document_masking": "each document (conversation) its own segment: attention stays inside it and "
                                 "positions restart (default: on for chat data, off for text)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="JSON file of training settings (flags override it)")
    for name, kind in _FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)
    for name, help_text in _SWITCHES.items():
        parser.add_argument("--" + name, dest=name, action="store_const", const=True, default=None, help=help_text)
    for name, help_text in _BOOLEANS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, action=argparse.BooleanOptionalAction,
                            default=None, help=help_text)
    parser.add_argument("--freeze", dest="freeze", action="append", default=None, metavar="PATTERN",
                        help="leave the parameters whose names match this shell-style pattern untrained "
                             "(repeatable), e.g. '*.mlp.router.*' or 'model.embed_tokens.weight'")
    join.add_arguments(parser)


def config_from_args(args) -> tuple[TrainConfig, dict]:
    """(config, the settings given explicitly by the config file and flags)."""
    explicit = load_config_file(args.config) if args.config else {}
    explicit.update({k: getattr(args, k) for k in (*_FLAGS, *_SWITCHES, *_BOOLEANS, "freeze")
                     if getattr(args, k, None) is not None})
    try:
        return TrainConfig(**explicit), explicit
    except TypeError as e:
        raise UserError(f"config: {e}") from None


def run(args) -> int:
    from jax_bridge import distributed
    from torch_model.config import PRESETS

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
