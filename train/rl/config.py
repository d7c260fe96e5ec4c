"""The `rl` command's configuration: one typed dataclass (TRL's GRPOConfig defaults where they
apply); the CLI and `--config FILE` fill it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from formats.errors import UserError


@dataclass(frozen=True)
class RLConfig:
    init_from: str = ""            # the starting checkpoint (ours or a Hugging Face directory)
    prompts: str = ""              # JSONL prompt records (train/rl/prompts.py)
    reward: list = field(default_factory=list)       # reward specs (train/rl/rewards.py)
    reward_weights: list | None = None               # one per reward (default 1 each)
    out: str = "runs/rl"
    steps: int = 100
    prompts_per_step: int = 4      # prompts per rollout batch; completions = prompts_per_step x group_size
    group_size: int = 8            # TRL's num_generations
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: off
    max_new_tokens: int = 256      # TRL's max_completion_length
    max_prompt_tokens: int = 512   # TRL's max_prompt_length: longer prompts are cut from the left
    loss: str = "dapo"             # dapo | grpo | dr_grpo
    ratio: str = "token"           # token | sequence (GSPO)
    epsilon: float = 0.2
    epsilon_high: float | None = None     # None: epsilon
    beta: float = 0.0              # k3 KL to the reference (0: no reference computed)
    iterations: int = 1            # updates per rollout batch (mu)
    scale_rewards: str = "group"   # group | batch | none
    mask_truncated: bool = False
    drop_zero_std: bool = False    # DAPO's dynamic sampling: groups with equal rewards replaced by new ones
    lr: float = 0.002              # Muon (matrices; LoRA adapters with --adapter-optimizer muon)
    adam_lr: float = 0.0004        # AdamW (the rest)
    adapter_optimizer: str = "muon"
    micro_batches: int = 1         # the update's rows split into this many micro-batches (lax.scan in the step)
    lora: str = ""
    compute_dtype: str = "auto"
    kernels: str = "auto"
    mesh: str = ""
    seed: int = 0
    log_every: int = 1
    eval_prompts: str = ""         # held-out prompt records, scored (greedy, one completion) every eval_every
    eval_every: int = 10
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    tensorboard: bool = False
    compile_cache: str = ""        # persistent compilation cache directory, or "off"; "": as train's
    resume: bool = False
    isolation: str = "auto"        # the humaneval reward's sandbox

    def __post_init__(self):
        if not self.init_from:
            raise UserError("rl: --init-from is required (the checkpoint the policy starts from)")
        if not self.prompts:
            raise UserError("rl: --prompts FILE.jsonl is required")
        if not self.reward:
            raise UserError("rl: give at least one --reward (exact:FIELD, regex:PATTERN, humaneval, python:FILE.py:NAME)")
        for name in ("steps", "prompts_per_step", "max_new_tokens", "max_prompt_tokens", "log_every", "eval_every",
                     "checkpoint_every", "keep_checkpoints", "iterations", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"rl: {name} must be a positive integer, found {value!r}")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise UserError(f"rl: group_size must be an integer >= 2 (advantages compare a group's completions), "
                            f"found {self.group_size!r}")
        if not self.temperature > 0:
            raise UserError(f"rl: temperature must be > 0 (sampling), found {self.temperature!r}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UserError(f"rl: top_p must be in (0, 1] and top_k >= 0, found {self.top_p!r}, {self.top_k!r}")
        if not self.lr > 0 or not self.adam_lr > 0:
            raise UserError(f"rl: lr and adam_lr must be > 0, found {self.lr!r}, {self.adam_lr!r}")
        self.objective()        # its own checks, one line each

    def objective(self):
        from torch_model.config import ConfigError
        from torch_model.policy_gradient import PolicyGradientConfig

        try:
            return PolicyGradientConfig(loss=self.loss, ratio=self.ratio, epsilon=self.epsilon,
                                        epsilon_high=self.epsilon_high, beta=self.beta, iterations=self.iterations,
                                        scale_rewards=self.scale_rewards, mask_truncated=self.mask_truncated,
                                        max_new_tokens=self.max_new_tokens, temperature=self.temperature)
        except ConfigError as e:
            raise UserError(str(e)) from None

    @property
    def seq_len(self) -> int:
        """A row holds one sequence of the longest allowed length."""
        return self.max_prompt_tokens + self.max_new_tokens - 1

    def replace(self, **changes) -> "RLConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHANGEABLE_ON_RESUME = ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "tensorboard",
                        "compile_cache", "kernels", "out", "resume", "eval_prompts", "isolation")


def resumed_config(saved: dict, explicit: dict, where: str) -> RLConfig:
    known = {f.name for f in dataclasses.fields(RLConfig)}
    base = {k: v for k, v in saved.items() if k in known}
    for name, value in explicit.items():
        if name not in CHANGEABLE_ON_RESUME and name in base and base[name] != value:
            raise UserError(f"--resume: {name} is {value!r} here but {base[name]!r} in {where}; a resumed rl run may "
                            f"change only {', '.join(CHANGEABLE_ON_RESUME)}")
    return RLConfig(**{**base, **explicit, "resume": True})


def load_config_file(path: str) -> dict:
    """A JSON object with RLConfig fields (`train`'s reader, its errors)."""
    from train.run.config import load_config_file as read_config

    return read_config(path, RLConfig)
