"""`torchlyra rl`: reinforcement learning on verifiable rewards (GRPO and its DAPO, Dr. GRPO and
GSPO variants) from a checkpoint, with rollouts from the compiled decode loop.

The loop below is the whole run; each line calls one job of `train/rl/trainer.py`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from formats.errors import UserError
from torch_model.optim import ADAPTER_OPTIMIZERS
from torch_model.policy_gradient import LOSSES as PG_LOSSES, RATIOS, SCALES
from train.evaluation.sandbox import ISOLATIONS
from train.rl.config import RLConfig, load_config_file, resumed_config
from train.run.config import COMPUTE_DTYPES
from train.run.flags import REPEATED, SWITCH, Flag, add_flags, given

# One row per flag of RLConfig: `--field-name` (dest: the field) in its group, with its help; the
# default shown is the field's (train/run/flags.py). Adding a flag is adding a row (and the field).
_GROUPS = {
    "model": "the policy: a checkpoint, and LoRA adapters on it",
    "data": "prompts and the rewards of their completions",
    "rollouts": "completions sampled by the compiled decode loop with the policy's current parameters",
    "objective": "GRPO as TRL computes it, with its DAPO, Dr. GRPO and GSPO variants (docs/fine-tune.md)",
    "optimization": "as train: Muon for the hidden weight matrices, AdamW for the rest; constant rates, no warm-up",
    "parallelism and kernels": "as train; the update step and the decode loop both run on the mesh",
    "evaluation": None,
    "checkpoints": "OUT holds checkpoints/, metrics.jsonl and plots/",
    "logging": None,
}
_FLAGS = {
    # model
    "init_from": Flag("model", "the checkpoint the policy starts from: ours (a run, its checkpoints/ or a step "
                               "directory) or a Hugging Face directory", metavar="DIR", required=True),
    "lora": Flag("model", "train LoRA adapters on it, the base frozen, as train --lora (e.g. r=8,alpha=16)",
                 metavar="SPEC", unset="off: every parameter trains"),
    # data
    "prompts": Flag("data", "JSONL prompt records: chat `messages` or plain `prompt` text, with any fields the "
                            "rewards read", metavar="FILE.jsonl", required=True),
    "reward": Flag("data", "a reward of each completion (repeatable; their weighted sum counts): exact:FIELD (1 "
                           "when the final answer is the record's FIELD), regex:PATTERN (1 when it matches), "
                           "humaneval (1 when the record's tests pass), python:FILE.py:NAME (your function)",
                   kind=REPEATED, metavar="SPEC", required=True),
    "reward_weights": Flag("data", "comma-separated weights, one per --reward", metavar="W,...", unset="1 each"),
    "isolation": Flag("data", "network isolation of the humaneval reward's sandbox: namespace (a network "
                              "namespace), guard (socket calls refused), both, or auto (both where the host "
                              "allows namespaces, else guard)", choices=ISOLATIONS),
    # rollouts
    "prompts_per_step": Flag("rollouts", "prompts per rollout batch; a step's completions are this times "
                                         "--group-size", int),
    "group_size": Flag("rollouts", "completions sampled per prompt (G, at least 2): advantages compare a "
                                   "group's completions", int),
    "temperature": Flag("rollouts", "sampling temperature (the objective's log-probabilities are under "
                                    "softmax(z / T) too)", float),
    "top_p": Flag("rollouts", "nucleus sampling; 1: off", float),
    "top_k": Flag("rollouts", "top-k sampling; 0: off", int),
    "max_new_tokens": Flag("rollouts", "new tokens per completion at most", int),
    "max_prompt_tokens": Flag("rollouts", "tokens per prompt at most; a longer prompt is cut from the left "
                                          "(counted)", int),
    "drop_zero_std": Flag("rollouts", "replace groups whose rewards are all equal by new prompts' groups "
                                      "(DAPO's dynamic sampling)", kind=SWITCH),
    "seed": Flag("rollouts", "seed of the prompt order, each step's sampling and the LoRA adapters", int),
    # objective
    "loss": Flag("objective", "how the token losses make the step's loss: dapo (their sum over the step's "
                              "completion tokens / the tokens' count), grpo (each completion's mean, then the mean "
                              "over completions), dr_grpo (the sum / (completions x max_new_tokens))",
                 choices=PG_LOSSES),
    "ratio": Flag("objective", "importance ratio per token, or per sequence (GSPO: the exp of the mean log-ratio)",
                  choices=RATIOS),
    "epsilon": Flag("objective", "clip range: the ratio is clipped to [1 - epsilon, 1 + epsilon-high]", float),
    "epsilon_high": Flag("objective", "the clip range's upper side (DAPO uses 0.28)", float, unset="--epsilon"),
    "beta": Flag("objective", "weight of the k3 KL term to the reference (the starting parameters; with --lora "
                              "the adapters off); 0: no reference computed", float),
    "iterations": Flag("objective", "updates on each rollout batch (mu); the ratio is to the rollout's "
                                    "log-probabilities", int),
    "scale_rewards": Flag("objective", "advantages: the reward minus its group's mean, divided by the standard "
                                       "deviation of the group, of the batch, or none", choices=SCALES),
    "mask_truncated": Flag("objective", "completions that reach --max-new-tokens without a stop train no token",
                           kind=SWITCH),
    # optimization
    "steps": Flag("optimization", "rollout-and-update steps in all (with --resume, a larger number extends the "
                                  "run)", int),
    "lr": Flag("optimization", "learning rate of Muon (the hidden weight matrices; LoRA adapters with "
                               "--adapter-optimizer muon)", float),
    "adam_lr": Flag("optimization", "learning rate of AdamW (embeddings, head, routers, vectors)", float),
    "adapter_optimizer": Flag("optimization", "optimizer of the LoRA adapters of linear layers (the experts' "
                                              "adapters always take AdamW)", choices=ADAPTER_OPTIMIZERS),
    "micro_batches": Flag("optimization", "the update's rows split into this many micro-batches of the one "
                                          "compiled step (the same gradient, less memory)", int),
    # parallelism and kernels
    "mesh": Flag("parallelism and kernels", "device mesh, as train --mesh, e.g. fsdp=2", metavar="AXIS=SIZE,...",
                 unset="every device on fsdp; on one device no mesh"),
    "kernels": Flag("parallelism and kernels", "kernel choice, as train --kernels (the decode loop's too)",
                    metavar="SPEC"),
    "compute_dtype": Flag("parallelism and kernels", "dtype of the matmuls and activations, as train "
                                                     "--compute-dtype (auto: bfloat16 on TPU and GPU, float32 on "
                                                     "CPU)", choices=COMPUTE_DTYPES),
    # evaluation
    "eval_prompts": Flag("evaluation", "held-out prompt records, each scored on one greedy completion every "
                                       "--eval-every steps and at the first and last", metavar="FILE.jsonl",
                         unset="none"),
    "eval_every": Flag("evaluation", "steps between evaluations on --eval-prompts", int),
    # checkpoints
    "out": Flag("checkpoints", "run directory", metavar="DIR"),
    "resume": Flag("checkpoints", "continue the run in --out from its newest checkpoint; flags beside it may "
                                  "change the length, the cadences, kernels, --eval-prompts and --isolation, "
                                  "nothing else", kind=SWITCH),
    "checkpoint_every": Flag("checkpoints", "steps between checkpoints (the last step is always saved)", int),
    "keep_checkpoints": Flag("checkpoints", "the newest N checkpoints are kept, older ones deleted", int),
    # logging
    "log_every": Flag("logging", "steps between metric records in OUT/metrics.jsonl (the last step is logged "
                                 "too)", int),
    "tensorboard": Flag("logging", "also write TensorBoard event files to OUT/tensorboard", kind=SWITCH),
    "compile_cache": Flag("logging", "persistent compilation cache directory, or off: a second run (or a "
                                     "--resume) loads the update step's and the decode loop's programs instead "
                                     "of compiling them", metavar="DIR",
                          unset="$TORCHLYRA_COMPILE_CACHE, else ~/.cache/torchlyra/jax-compile"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.json",
                        help="JSON file of rl settings, any RLConfig field (flags override it)")
    add_flags(parser, _FLAGS, RLConfig, _GROUPS)


def config_from_args(args) -> tuple[RLConfig, dict]:
    explicit = load_config_file(args.config) if args.config else {}
    explicit.update(given(args, _FLAGS))
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
    from jax_bridge import compile_cache
    from jax_bridge.distributed import say
    from train.rl.trainer import RLTrainer, newest_checkpoint
    from train.startup import Startup

    cache, before = compile_cache.enable(cfg.compile_cache or None), compile_cache.events()
    startup = Startup()             # where the start goes: printed and recorded after the first update
    startup.start_devices()
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
    startup.mark("finding the checkpoint")
    trainer = RLTrainer(cfg, step_dir, meta, startup)
    try:
        if trainer.done == 0 and trainer.evaluate() is not None:
            startup.mark("first evaluation")
        while trainer.done < cfg.steps:
            batch, metrics = trainer.rollout()
            if startup is not None:
                startup.mark("first rollout")
            metrics.update(trainer.update(batch))
            if startup is not None:
                startup.mark("first update")
                trainer.report_start(startup, cache)
                startup = None
            if trainer.done % cfg.log_every == 0 or trainer.done == cfg.steps:
                trainer.log(metrics)
            if trainer.done % cfg.eval_every == 0 or trainer.done == cfg.steps:
                trainer.evaluate()
            if trainer.done % cfg.checkpoint_every == 0:
                trainer.save()
        result = trainer.finish()
    finally:
        trainer.close()
    say(compile_cache.describe(cache, before))
    return result


def run(args) -> int:
    cfg, _ = config_from_args(args)
    summary = run_rl(cfg)
    if summary.get("already_finished"):
        print(f"{cfg.out}: the run already reached step {summary['steps']}; pass a larger --steps to extend it")
        return 0
    print(f"\nrl: {summary['steps']} steps in {summary['seconds']:.0f} s\nmetrics:    {summary['metrics']}\n"
          f"plots:      {', '.join(summary['plots'])}\ncheckpoint: {summary['checkpoint']}")
    return 0
