"""Training-run configuration: one typed dataclass; the CLI and `--config FILE` fill it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from formats.errors import UserError
from formats.jsonfile import read_json

REMATS = ("none", "full", "save-matmuls")          # per layer: what the backward keeps (jax_bridge/layer_stack.py)
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "tiny"
    data: str = "data/shakespeare"
    out: str = "runs/tiny"
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    micro_batches: int = 1
    lr: float = 0.02               # Muon
    adam_lr: float = 3e-3          # AdamW
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1      # cosine decay floor, as a fraction of the peak
    weight_decay: float = 0.0
    kernels: str = "auto"
    kernel_options: str = ""       # per implementation, e.g. "attention.pallas.block_q=256"
    compute_dtype: str = "auto"    # auto: bfloat16 on TPU/GPU (float32 master weights), float32 on CPU
    mesh: str = ""                 # e.g. "data=2,fsdp=4"; "" = every device on fsdp (one device: none)
    scan_layers: bool = True       # decoder layers as one lax.scan over stacked parameters
    remat: str = "none"            # per layer: none | full | save-matmuls
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    eval_tasks: str = ""           # also score these tasks at each evaluation (as `eval --tasks`: core, FILE.jsonl)
    eval_tasks_limit: int = 100    # the first N examples of each such task
    log_every: int = 10
    checkpoint_every: int = 100    # steps between periodic checkpoints (the last step is always saved)
    keep_checkpoints: int = 3      # the newest K are kept
    resume: bool = False           # continue from the newest complete checkpoint in `out`
    init_from: str | None = None   # parameters from this checkpoint, fresh optimizer state
    tensorboard: bool = False      # also write TensorBoard event files to out/tensorboard
    max_consecutive_skips: int = 20   # non-finite steps in a row before the run stops
    host_timeout_s: int = 30       # many hosts: a peer silent this long is lost; the others stop (exit 75)
    samples: int = 2
    sample_tokens: int = 120
    temperature: float = 0.8
    top_k: int = 40
    model: dict = field(default_factory=dict)      # ModelConfig overrides
    model_config: str | None = None   # a transformers config.json: that model instead of a preset (torch_model/transformers_lm.py)
    module: str | None = None      # path/to/file.py:NAME or package.module:NAME: a plain nn.Module (torch_model/module_lm.py)
    module_args: dict = field(default_factory=dict)   # the keyword arguments NAME is called with
    optimizer: str = "muon"        # muon: Muon + AdamW by role; adamw: AdamW (at adam_lr) for every parameter
    document_masking: bool | None = None   # segment ids per document; None: on for chat data, off for text
    truncate: bool = False         # chat: a conversation longer than a row is cut to one row (default: dropped)
    lora: str = ""                 # peft LoRA on the --init-from model, e.g. "r=16,alpha=32,dropout=0,targets=all-linear+experts"
    freeze: list = field(default_factory=list)   # shell-style patterns of parameter names left untrained
    adapter_optimizer: str = "muon"   # LoRA adapters of linear layers: muon | adamw (expert adapters: adamw)
    ns_dtype: str = "float32"      # Muon's Newton-Schulz iteration: float32 | bfloat16 (faster on TPU)
    base_dtype: str = "compute"    # a LoRA run's frozen experts: compute (the compute dtype) | mxfp4 (as released)
    dpo: str = ""                  # DPO on preference pairs, e.g. "beta=0.1,loss=sigmoid,label_smoothing=0"
    profile_steps: str = ""        # "A:B": a jax.profiler trace of steps A..B into OUT/profile (train/run/profiling.py)
    compile_cache: str = ""        # persistent compilation cache directory, or "off"; "": $TORCHLYRA_COMPILE_CACHE or
                                   # ~/.cache/torchlyra/jax-compile (jax_bridge/compile_cache.py)

    def __post_init__(self):
        positive = ("steps", "batch_size", "micro_batches", "eval_every", "eval_tasks_limit", "log_every", "checkpoint_every",
                    "keep_checkpoints", "max_consecutive_skips", "host_timeout_s")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"config: {name} must be a positive integer, found {value!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise UserError(f"config: seq_len must be an integer >= 2, found {self.seq_len!r}")
        for name in ("lr", "adam_lr"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise UserError(f"config: {name} must be a number > 0, found {value!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserError(f"config: min_lr_ratio must be in [0, 1], found {self.min_lr_ratio!r}")
        if self.remat not in REMATS:
            raise UserError(f"config: remat must be none, full or save-matmuls, found {self.remat!r}")
        if not isinstance(self.scan_layers, bool):
            raise UserError(f"config: scan_layers must be true or false, found {self.scan_layers!r}")
        if self.document_masking not in (None, True, False):
            raise UserError(f"config: document_masking must be true, false or null (auto), found {self.document_masking!r}")
        if not isinstance(self.truncate, bool):
            raise UserError(f"config: truncate must be true or false, found {self.truncate!r}")
        self._check_lora()
        self._check_dpo()
        self._check_model_config()
        self._check_module()
        from torch_model.optim import NS_DTYPES

        if self.ns_dtype not in NS_DTYPES:
            raise UserError(f"config: ns_dtype must be {' or '.join(NS_DTYPES)}, found {self.ns_dtype!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise UserError(f"config: compute_dtype must be auto, float32 or bfloat16, found {self.compute_dtype!r}")

    def _check_model_config(self) -> None:
        """A transformers model comes from model_config or, for --init-from and LoRA, from the
        checkpoint it starts from (never both)."""
        if not self.model_config:
            return
        if self.model:
            raise UserError("config: model overrides shape a preset; with model_config edit the transformers config")
        if self.init_from:
            raise UserError(f"config: init_from with model_config: the run takes its model from the checkpoint "
                            f"{self.init_from}; drop model_config (--model-config)")

    def _check_module(self) -> None:
        """A module model comes from --module (or, for --init-from and --resume, from its run's
        record: --module then only says where its code is); never beside a preset's overrides or a
        transformers config."""
        from torch_model.optim import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"config: optimizer must be {' or '.join(OPTIMIZERS)}, found {self.optimizer!r}")
        if not isinstance(self.module_args, dict):
            raise UserError(f"config: module_args must be a JSON object of keyword arguments, found "
                            f"{self.module_args!r}")
        if self.module_args and not self.module:
            raise UserError("config: module_args are the keyword arguments of --module; give --module")
        if not self.module:
            return
        if not isinstance(self.module, str):
            raise UserError(f"config: module must be a string such as 'examples/gpt.py:GPT', found {self.module!r}")
        if self.model_config or self.model:
            raise UserError("config: --module names the model; drop "
                            + ("--model-config" if self.model_config else "the model overrides (its --module-args "
                                                                          "shape it)"))
        if self.document_masking:
            raise UserError("config: a module model takes tokens only (no segment ids): document masking is refused; "
                            "train it on text data with --no-document-masking")

    def _check_lora(self) -> None:
        from torch_model.config import ConfigError
        from torch_model.lora import parse_lora_spec
        from torch_model.optim import ADAPTER_OPTIMIZERS

        if not isinstance(self.lora, str):
            raise UserError(f"config: lora must be a string such as 'r=16,alpha=32,targets=all-linear', found {self.lora!r}")
        if self.lora:
            try:
                parse_lora_spec(self.lora)
            except ConfigError as e:
                raise UserError(str(e)) from None
            if not self.init_from:
                raise UserError("config: lora needs init_from (--init-from), the base model the adapters train on: "
                                "a checkpoint or a Hugging Face directory")
        if not isinstance(self.freeze, (list, tuple)) or not all(isinstance(p, str) and p for p in self.freeze):
            raise UserError(f"config: freeze must be a list of name patterns such as ['*.mlp.router.*'], "
                            f"found {self.freeze!r}")
        from formats.mxfp4 import BASE_DTYPES

        if self.base_dtype not in BASE_DTYPES:
            raise UserError(f"config: base_dtype must be {' or '.join(BASE_DTYPES)}, found {self.base_dtype!r}")
        if self.base_dtype == "mxfp4" and not self.lora:
            raise UserError("config: base_dtype mxfp4 keeps a LoRA run's frozen experts as released (MXFP4); it needs "
                            "lora (--lora), with init_from a released gpt-oss directory")
        if self.adapter_optimizer not in ADAPTER_OPTIMIZERS:
            raise UserError(f"config: adapter_optimizer must be {' or '.join(ADAPTER_OPTIMIZERS)}, "
                            f"found {self.adapter_optimizer!r}")

    def _check_dpo(self) -> None:
        from torch_model.config import ConfigError
        from torch_model.preference import parse_preference_spec

        if not isinstance(self.dpo, str):
            raise UserError(f"config: dpo must be a string such as 'beta=0.1,loss=sigmoid', found {self.dpo!r}")
        if self.dpo:
            try:
                parse_preference_spec(self.dpo)
            except ConfigError as e:
                raise UserError(str(e)) from None
            if not self.init_from:
                raise UserError("config: dpo needs init_from (--init-from), the model whose answers it prefers "
                                "and the reference it is held to (a checkpoint or a Hugging Face directory)")

        from train.run.profiling import parse_profile_steps

        parse_profile_steps(self.profile_steps, self.steps)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# What a resumed run may change; every other field must match the checkpoint's, or the resumed
# run would not continue the same training (model, data, batch, sequence, optimizer, schedule).
CHANGEABLE_ON_RESUME = ("steps", "log_every", "eval_every", "eval_batches", "eval_tasks", "eval_tasks_limit", "checkpoint_every", "keep_checkpoints",
                        "tensorboard", "max_consecutive_skips", "host_timeout_s", "samples", "sample_tokens", "temperature", "top_k",
                        "kernels", "kernel_options", "mesh", "remat", "profile_steps", "compile_cache", "module", "out",
                        "resume", "init_from")


def resumed_config(saved: dict, explicit: dict, where: str) -> TrainConfig:
    """The checkpoint's TrainConfig with the explicitly given settings applied; a setting that
    may not change on resume is refused naming the field."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    base = {k: v for k, v in saved.items() if k in known}
    for name, value in explicit.items():
        if name not in CHANGEABLE_ON_RESUME and name in base and base[name] != value:
            raise UserError(f"--resume: {name} is {value!r} here but {base[name]!r} in {where}; a resumed run "
                            f"may change only {', '.join(CHANGEABLE_ON_RESUME[:-3])} (start a new run, or "
                            f"--init-from its checkpoint, to change {name})")
    return TrainConfig(**{**base, **explicit, "resume": True})


def load_config_file(path: str, config_type: type = None) -> dict:
    """A JSON object with the fields of `config_type` (default TrainConfig, with an optional
    "model": {ModelConfig overrides}; `rl` passes RLConfig)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {path} does not exist")
    data = read_json(p)
    if not isinstance(data, dict):
        raise UserError(f"config file {path}: expected a JSON object, found {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(config_type or TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"config file {path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return data
