"""`torchlyra rl`: reinforcement learning on verifiable rewards (GRPO and its DAPO, Dr. GRPO and
GSPO variants) from a checkpoint, with rollouts from the compiled decode loop.

The loop below is the whole run; each line calls one job of `train/rl/trainer.py`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from formats.errors import UserError
from train.rl.config import RLConfig, load_config_file, resumed_config

_FLAGS = {"init_from": str, "prompts": str, "out": str, "steps": int, "prompts_per_step": int, "group_size": int,
          "temperature": float, "top_p": float, "top_k": int, "max_new_tokens": int, "max_prompt_tokens": int,
          "loss": str, "ratio": str, "epsilon": float, "epsilon_high": float, "beta": float, "iterations": int,
          "scale_rewards": str, "lr": float, "adam_lr": float, "adapter_optimizer": str, "micro_batches": int, "lora": str,
          "compute_dtype": str, "kernels": str, "mesh": str, "seed": int, "log_every": int, "eval_prompts": str,
          "eval_every": int, "checkpoint_every": int, "keep_checkpoints": int, "isolation": str}
_SWITCHES = {"mask_truncated": "completions that reach --max-new-tokens without a stop train no token",
             "drop_zero_std": "replace groups whose rewards are all equal by new prompts' groups (DAPO)",
             "tensorboard": "also write TensorBoard event files to OUT/tensorboard",
             "resume": "continue the run in --out from its newest checkpoint"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="JSON file of rl settings (flags override it)")
    parser.add_argument("--reward", dest="reward", action="append", default=None, metavar="SPEC",
                        help="exact:FIELD | regex:PATTERN | humaneval | python:FILE.py:NAME (repeatable)")
    parser.add_argument("--reward-weights", dest="reward_weights", default=None,
                        help="comma-separated weights, one per --reward (default 1 each)")
    for name, kind in _FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)
    for name, help_text in _SWITCHES.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, action="store_const", const=True, default=None,
                            help=help_text)


def config_from_args(args) -> tuple[RLConfig, dict]:
    explicit = load_config_file(args.config) if args.config else {}
    explicit.update({k: getattr(args, k) for k in (*_FLAGS, *_SWITCHES, "reward") if getattr(args, k, None) is not None})
    if args.reward_weights is not None:
        try:
            explicit["reward_weights"] = [float(w) for w in args.reward_weights.split(",")]
        except ValueError:
            raise UserError(f"--reward-weights: expected comma-separated numbers, found {args.reward_weights!r}") from None
    return _config(explicit), explicit


def _config(explicit: dict) -> RLConfig:
    out = Path(explicit.get("out", RLConfig.__dataclass_fields__["out"].default))
    if explicit.get("resume"):
        from train.rl.trainer import newest_checkpoint

        step_dir = newest_checkpoint(out)
        if step_dir is not None:
            from formats.checkpoint import read_meta

            meta, _ = read_meta(step_dir)
            if "rl_config" not in meta:
                raise UserError(f"--resume: {step_dir} is not a checkpoint of an rl run")
            return resumed_config(meta["rl_config"], explicit, str(step_dir))
    try:
        return RLConfig(**explicit)
    except TypeError as e:
        raise UserError(f"config: {e}") from None


def run_rl(cfg: RLConfig) -> dict:
    from formats.checkpoint import read_meta
    from train.rl.trainer import RLTrainer, newest_checkpoint

    out = Path(cfg.out)
    step_dir = newest_checkpoint(out)
    meta = None
    if step_dir is not None:
        if not cfg.resume:
            raise UserError(f"{out} already holds a run ({step_dir}): pass --resume to continue it, or choose another --out")
        meta, _ = read_meta(step_dir)
        meta["step_dir"] = str(step_dir)
        if meta["step"] >= cfg.steps:
            return {"steps": meta["step"], "already_finished": True, "checkpoint": str(step_dir)}
    trainer = RLTrainer(cfg, step_dir, meta)
    try:
        if trainer.done == 0:
            trainer.evaluate()
        while trainer.done < cfg.steps:
            batch, metrics = trainer.rollout()
            metrics.update(trainer.update(batch))
            if trainer.done % cfg.log_every == 0 or trainer.done == cfg.steps:
                trainer.log(metrics)
            if trainer.done % cfg.eval_every == 0 or trainer.done == cfg.steps:
                trainer.evaluate()
            if trainer.done % cfg.checkpoint_every == 0:
                trainer.save()
        return trainer.finish()
    finally:
        trainer.close()


def run(args) -> int:
    cfg, _ = config_from_args(args)
    summary = run_rl(cfg)
    if summary.get("already_finished"):
        print(f"{cfg.out}: the run already reached step {summary['steps']}; pass a larger --steps to extend it")
        return 0
    print(f"\nrl: {summary['steps']} steps in {summary['seconds']:.0f} s\nmetrics:    {summary['metrics']}\n"
          f"plots:      {', '.join(summary['plots'])}\ncheckpoint: {summary['checkpoint']}")
    return 0
