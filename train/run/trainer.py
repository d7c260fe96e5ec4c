"""What a training run does around the one-jit step, one method per job: setup (new run,
`--init-from`, `--resume`), one optimizer step, logging, evaluation, checkpoints, stopping and
finishing (plots, samples, summary). `train/run/loop.py` strings them together.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from jax_bridge.distributed import say
from formats import checkpoint, init_from_hf, lora_checkpoint, mesh_loader
from train.run import flops
from torch_model.config import ModelConfig
from train.run.config import TrainConfig, resumed_config
from formats.errors import UserError
from train.run.metrics import MetricsWriter, StepTimer, expert_load

DEFAULT_PROMPTS = ["ROMEO:", "First Citizen:\nWe are"]


class TrainingStopped(UserError):
    """The run stopped early on a problem (diverged, data error) after checkpointing its last good
    state; the message says where and how to go on."""


@dataclasses.dataclass(frozen=True)
class Mxfp4Base:
    """A LoRA run's base read from a released gpt-oss directory with its experts kept MXFP4
    (--base-dtype mxfp4): formats/mxfp4_experts.meta_released_base builds the model and the
    source the loader places it from."""
    weights: object         # formats.hf_weights.HFWeights


def build_model_config(cfg: TrainConfig, vocab_size: int, bos: int, eos: int):
    """The run's model record: the preset with its overrides, the transformers config of
    --model-config (torch_model/transformers_lm.py) or the module of --module (probed:
    torch_model/module_lm.py), with the tokenizer's special ids."""
    from torch_model.config import ConfigError, get_preset
    from torch_model.transformers_lm import TransformersSpec

    from formats.model_checks import given_module, module_record

    if cfg.module or given_module() is not None:     # --module, or the module train_module was given
        return module_record(cfg.module, cfg.module_args, cfg.seq_len).replace(bos_token_id=bos, eos_token_id=eos)
    if cfg.model_config:      # its refusals are ConfigErrors, one line at the command line
        return TransformersSpec.from_file(cfg.model_config).replace(bos_token_id=bos, eos_token_id=eos,
                                                                    max_seq_len=cfg.seq_len)
    try:
        model_cfg = get_preset(cfg.preset).replace(**cfg.model)
    except ConfigError as e:
        raise UserError(str(e)) from None
    return model_cfg.replace(bos_token_id=bos, eos_token_id=eos, max_seq_len=cfg.seq_len)


def resume_point(cfg: TrainConfig, explicit: dict) -> tuple[TrainConfig, Path | None, dict | None]:
    """(config, step directory, meta) of the checkpoint a --resume continues from, or (cfg, None,
    None) for a new run. A damaged newest checkpoint is reported, moved aside, and skipped."""
    import jax

    if cfg.model_config and "preset" in explicit:
        raise UserError("--preset and --model-config name two models: give one")
    if cfg.module and "preset" in explicit:
        raise UserError("--preset and --module name two models: give one")
    from formats.model_checks import given_module

    if not cfg.module and given_module() is None:
        build_model_config(cfg, vocab_size=0, bos=0, eos=0)   # a bad preset/model override fails first
    out = Path(cfg.out)
    root = out / "checkpoints"
    newest = checkpoint.step_dirs(root)[-1][0] if root.is_dir() and checkpoint.step_dirs(root) else None
    if not cfg.resume:
        if newest is not None:
            raise UserError(f"{out} already holds a run (checkpoints up to step {newest}): pass --resume "
                            f"to continue it, or choose another --out")
        return cfg, None, None
    def newest_complete():
        try:
            return (checkpoint.find_checkpoint(root, move_damaged=jax.process_index() == 0, resume=True)
                    if root.is_dir() else None)
        except checkpoint.NoCheckpoint:
            return None

    if jax.process_count() == 1:
        step_dir = newest_complete()
    else:
        # Process 0 alone moves damaged steps aside; the others look once it has, so all agree.
        from jax.experimental import multihost_utils

        step_dir = newest_complete() if jax.process_index() == 0 else None
        multihost_utils.sync_global_devices("torchlyra: resume point chosen")
        if jax.process_index() != 0:
            step_dir = newest_complete()
    if step_dir is None:
        say(f"--resume: no checkpoint in {root}; starting a new run")
        return cfg, None, None
    meta, _ = checkpoint.read_meta(step_dir)
    if not isinstance(meta.get("train_config"), dict) or meta.get("contents") != checkpoint.TRAIN_STATE:
        raise UserError(f"checkpoint {step_dir} is not a training checkpoint (no train state); start a new "
                        f"run from its parameters with --init-from {step_dir}")
    # host_timeout_s is this launch's: the cluster was joined with it before the checkpoint was read.
    resumed = resumed_config(meta["train_config"], {**explicit, "out": cfg.out, "host_timeout_s": cfg.host_timeout_s},
                             str(step_dir))
    return fit_mesh(resumed, explicit, step_dir), step_dir, meta


def fit_mesh(cfg: TrainConfig, explicit: dict, step_dir: Path) -> TrainConfig:
    """A resumed run on fewer (or more) devices than its checkpoint's, e.g. after losing hosts,
    with no --mesh given: the saved mesh cannot fit, so every device goes on fsdp (said once)."""
    import jax

    from jax_bridge import sharding

    if "mesh" in explicit or not cfg.mesh:
        return cfg
    try:
        sharding.parse_mesh(cfg.mesh, jax.device_count())
        return cfg
    except ValueError:
        say(f"--resume: the mesh of {step_dir} ({cfg.mesh}) does not fit the {jax.device_count()} devices of this "
            f"run; using every device on fsdp (give --mesh to choose)")
        return cfg.replace(mesh="")


def build_mesh(cfg: TrainConfig):
    """The run's device mesh: `--mesh`, or every device on `fsdp`; None on a single device."""
    import jax

    from jax_bridge import sharding

    if not cfg.mesh and jax.device_count() == 1:
        return None
    try:
        return sharding.make_mesh(cfg.mesh or None)
    except ValueError as e:
        raise UserError(str(e)) from None


class Trainer:
    def __init__(self, cfg: TrainConfig, resume_dir: Path | None = None, meta: dict | None = None, *,
                 explicit: dict | None = None, show_progress: bool = True, startup=None):
        """A new run (meta None) or one resumed from `resume_dir` (see resume_point). startup:
        (train.startup.Startup, the compilation cache directory or None) to mark the start's phases
        in, printed and recorded at the first step (None: a Startup of its own)."""
        import jax

        from train.startup import Startup

        from jax_bridge import registry
        from jax_bridge.step import StepConfig, TrainState, TrainStep
        from formats.model_checks import build_model, build_module_model, load_weights, take_module_from
        from torch_model.module_lm import ModuleSpec
        from torch_model.optim import OptimizerConfig
        from train.evaluation.validation import Evaluator, token_byte_lengths
        from train.data.loader import TokenLoader
        from formats.tokenizer import load_tokenizer

        self.out, self.primary, self.cfg, self.explicit = Path(cfg.out), jax.process_index() == 0, cfg, explicit or {}
        self.startup, self.compile_cache = startup or (Startup(), None)
        if meta:
            say(f"resuming from {resume_dir} (step {meta['step']})")
        try:
            registry.resolve(cfg.kernels)          # a bad kernel choice fails before any work
            registry.check_options(cfg.kernel_options)
        except registry.KernelError as e:
            raise UserError(str(e)) from None
        self.tokenizer = load_tokenizer(cfg.data)  # the data's: its special ids become the model's
        self.base_reference = None                 # a LoRA run's base (formats/lora_checkpoint.py)
        if cfg.module:        # where a module run's code is (a new run's, or the run's it starts from or resumes)
            take_module_from(cfg.module, cfg.module_args or None)
        self.model_cfg, init_state = self._model_config(meta, explicit or {})
        self.startup.mark("model record")
        if self.tokenizer.n_vocab > self.model_cfg.vocab_size:
            where = ("its --module-args" if isinstance(self.model_cfg, ModuleSpec) else "model.vocab_size")
            raise UserError(f"data vocabulary ({self.tokenizer.n_vocab}) is larger than the model's vocab_size "
                            f"({self.model_cfg.vocab_size}); make it >= {self.tokenizer.n_vocab} ({where})")
        loader_args = dict(global_batch=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                           process_index=jax.process_index(), process_count=jax.process_count(),
                           vocab_size=self.model_cfg.vocab_size, document_masking=cfg.document_masking,
                           truncate=cfg.truncate, accepts_batch=True)
        self.train_data = TokenLoader(cfg.data, "train", **loader_args)
        val_data = TokenLoader(cfg.data, "val", **loader_args)
        if isinstance(self.model_cfg, ModuleSpec) and self.train_data.yields_batch:
            what = ("preference pairs (DPO)" if self.train_data.pairs else "conversations" if self.train_data.chat
                    else "documents with document masking")
            raise UserError(f"{cfg.data}: {what} train as packed rows (segment ids, positions), which a module model "
                            f"does not take (its forward takes tokens only): a module trains on text data with "
                            f"--no-document-masking")
        self.preference = self._preference_config()
        self.startup.mark("data")

        torch.manual_seed(cfg.seed)
        streamed = mesh_loader.is_weights(init_state)
        restored_only = bool(meta) and init_state is None     # a resume: every weight is in the checkpoint
        if isinstance(init_state, Mxfp4Base):        # the experts' released bytes, read by slice, never decoded
            from formats.mxfp4_experts import meta_released_base

            self.model, init_state = meta_released_base(self.model_cfg, init_state.weights)
            streamed = True
        elif streamed or restored_only:
            # The weights go from their files (or the resumed checkpoint) straight onto the mesh:
            # the host model is built on `meta` and never holds them (formats/mesh_loader.py).
            self.model = build_model(self.model_cfg, meta=True)
        elif isinstance(self.model_cfg, ModuleSpec) and not meta and init_state is None:
            # A new module run: its blocks are checked on the weights, and the record keeps the result.
            self.model = build_module_model(self.model_cfg, new_run=True)
            self.model_cfg = self.model_cfg.replace(facts=self.model.facts)
        else:
            self.model = build_model(self.model_cfg)
            if init_state is not None:
                load_weights(self.model, init_state)
        torch.manual_seed(cfg.seed)     # adapters drawn alike however the base was built (on meta: no draws)
        self.peft_model = self._adapt(self.model)
        self.startup.mark("model")
        opt_cfg = OptimizerConfig(lr=cfg.lr, adam_lr=cfg.adam_lr, weight_decay=cfg.weight_decay,
                                  adapter_optimizer=cfg.adapter_optimizer, ns_dtype=cfg.ns_dtype,
                                  optimizer=cfg.optimizer)
        self.mesh = build_mesh(cfg)
        try:
            self.step = TrainStep(self.model, opt_cfg, StepConfig(
                kernels=cfg.kernels, compute_dtype=cfg.compute_dtype, micro_batches=cfg.micro_batches,
                kernel_options=cfg.kernel_options, scan_layers=cfg.scan_layers, remat=cfg.remat,
                preference=self.preference), mesh=self.mesh)
            if self.train_data.yields_batch:      # packed rows: attention must take segment ids
                registry.check_segments(self.step.kernels)
        except (registry.KernelError, ValueError) as e:
            raise UserError(str(e)) from None
        if self.step.frozen_names:
            self._report_trainable()
        self.startup.mark("train step")
        if streamed:
            started = time.perf_counter()
            self.state = jax.block_until_ready(mesh_loader.init_state(self.step, init_state,
                                                                      where=self._init_where(meta)))
            self._report_streamed(init_state, meta, time.perf_counter() - started)
        elif restored_only:
            self.state = self.step.abstract_state()     # the restore's target: nothing made on the host
        else:
            self.state = self.step.init_state()
        self.done, self.counters = 0, {"skipped_total": 0, "consecutive_skips": 0, "last_good_step": 0}
        if meta:
            restored = checkpoint.restore_train_state(resume_dir, self._restore_target(), layout=self.step.layout)
            if "frozen" in restored:
                self.step.place_frozen(restored.pop("frozen"))
            self.state = TrainState(**restored)
            self.train_data.load_state_dict(meta["loader"])
            self.done, self.counters = meta["step"], dict(meta.get("counters", self.counters))
        jax.block_until_ready(self.state)
        self.startup.mark("parameters")
        self.reference_source, self.reference = None, None     # DPO, full fine-tuning: stored log-probabilities
        if self.step.reference_in_batch:
            self._load_reference(meta, val_data)
        if self.preference is not None:
            from train.evaluation.preference import PreferenceEvaluator

            self.evaluator = PreferenceEvaluator(self.step, [self._packed(b, "val")
                                                             for b in val_data.iter_eval_batches(cfg.eval_batches)])
        else:
            self.evaluator = Evaluator(self.step, list(val_data.iter_eval_batches(cfg.eval_batches)),
                                       token_byte_lengths(self.tokenizer, self.model_cfg.vocab_size))
        self.task_evaluator, self.task_scorer = None, None
        if cfg.eval_tasks:
            from train.evaluation.periodic import TaskEvaluator

            self.task_evaluator = TaskEvaluator(cfg.eval_tasks, self.tokenizer, self.model_cfg, cfg.eval_tasks_limit)

        self.checkpoints = checkpoint.CheckpointWriter(self.out / "checkpoints", keep=cfg.keep_checkpoints)
        self.last_saved = self.done if meta else None
        self.peak, self.peak_source = flops.peak_flops(self.step.cfg.compute_dtype)   # "auto" resolved
        self.tokens_per_step = cfg.micro_batches * cfg.batch_size * cfg.seq_len
        self.timer, self._pending_skip, self._skipped_since_log, self.start_time = StepTimer(), None, 0, time.perf_counter()
        self._pending_log = None           # (metrics, step, lr scale) of a log step not yet written (queue_log)
        self.last_eval: dict = {}
        self.profile_summary: str | None = None     # profile/summary.json, once the traced steps are summarised
        self._loader_state = None        # set while a read is in flight (see next_batch)
        self.metrics = self._open_metrics(resume_dir, meta)
        self.startup.mark("evaluators and metrics")
        self._starting = True           # until the first step has run (report_start)
        if self.train_data.yields_batch:
            self._report_packing()
        self.bar = tqdm(total=cfg.steps, initial=self.done, desc="train", dynamic_ncols=True,
                        disable=not (show_progress and self.primary))

    def _report_packing(self) -> None:
        """Packed rows (chat, document masking): the packing of epoch 0, printed and logged."""
        summary = self.train_data.packing_summary()
        what = "conversations" if self.train_data.chat else "documents (document masking)"
        too_long = (f"; {summary['too_long']} longer than a row "
                    f"({'truncated' if self.cfg.truncate else 'dropped'})") if summary["too_long"] else ""
        say(f"packing: {what} into {summary['rows']:,} rows of {self.cfg.seq_len + 1} tokens per epoch, "
            f"efficiency {summary['efficiency']:.1%} (real tokens / row tokens){too_long}")
        self.write_record({"kind": "packing", "step": self.done, **summary})

    # ---- setup ------------------------------------------------------------------------------
    def _preference_config(self):
        """--dpo's settings (None without it); DPO and preference data come together or not at all."""
        from torch_model.preference import parse_preference_spec

        cfg, pairs = self.cfg, self.train_data.pairs
        if pairs and not cfg.dpo:
            raise UserError(f"{cfg.data} holds preference pairs (prepare --preferences): train on them with "
                            f"--dpo beta=0.1 --init-from CHECKPOINT")
        if cfg.dpo and not pairs:
            raise UserError(f"--dpo trains on preference pairs (torchlyra prepare --preferences), but {cfg.data} holds "
                            f"{'conversations' if self.train_data.chat else 'text'}")
        return parse_preference_spec(cfg.dpo) if cfg.dpo else None

    def _load_reference(self, meta: dict | None, val_data) -> None:
        """Full fine-tuning DPO: the reference log-probabilities of every pair, read from beside
        the data, or (a new run, none stored) computed now from the initial parameters."""
        from train.run import reference

        cfg = self.cfg
        source = (meta or {}).get("dpo_reference") or self.base_reference or \
            lora_checkpoint.base_reference(cfg.init_from, {"hf_dir": cfg.init_from})
        settings = reference.reference_settings(self.step.cfg.compute_dtype, cfg.truncate, cfg.seq_len)
        loaders = {"train": self.train_data, "val": val_data}
        if reference.check_reference(cfg.data, source, settings):
            self.reference = reference.load_reference(cfg.data, loaders)
            say(f"DPO reference: log-probabilities of {source['path']} read from {cfg.data}/{reference.META}")
        elif meta:
            raise UserError(f"{cfg.data}: the reference log-probabilities of this run ({reference.META}, from "
                            f"{source['path']}) are gone; they cannot be recomputed once training has begun")
        else:
            start = time.perf_counter()
            self.reference = reference.compute_reference(self.step, self.state.params, cfg.data, loaders, source,
                                                         settings)
            say(f"DPO reference: log-probabilities of {sum(len(t) for t in self.reference.values()):,} pairs from "
                f"{source['path']} computed in {time.perf_counter() - start:.1f} s, stored in {cfg.data}/{reference.ARRAYS}")
        self.reference_source = {"path": source["path"], "sha256": source["sha256"]}

    def _packed(self, batches, split: str) -> dict:
        """A step's micro-batches (a list of loader Batches) or one evaluation Batch -> the step's
        packed dict; a full fine-tuning DPO run's carries each pair's stored reference values."""
        from jax_bridge.step import packed_batch
        from train.run.reference import with_reference

        packed = packed_batch(batches)
        if self.reference is None:
            return packed
        pair_docs = batches.pair_docs if hasattr(batches, "pair_docs") else np.stack([b.pair_docs for b in batches])
        return with_reference(packed, pair_docs, self.reference[split])

    def _adapt(self, model):
        """--freeze and --lora applied to the torch model (its names: `torchlyra train --freeze`
        patterns match them); returns the peft model, or None without LoRA."""
        from torch_model.config import ConfigError
        from torch_model.freeze import freeze_parameters
        from torch_model.lora import apply_lora, parse_lora_spec

        try:
            wrapped = apply_lora(model, parse_lora_spec(self.cfg.lora)) if self.cfg.lora else None
            if self.cfg.freeze:
                freeze_parameters(model, self.cfg.freeze)
        except ConfigError as e:
            raise UserError(str(e)) from None
        return wrapped

    def _report_trainable(self) -> None:
        # An MXFP4 stack's values: two per byte of its blocks (its scale bytes are not weights).
        values = lambda n, p: 2 * p.numel() if n.endswith("_blocks") else 0 if n.endswith("_scales") else p.numel()
        counts = {kind: sum(values(n, p) for n, p in self.step.model.named_parameters() if p.requires_grad == kind)
                  for kind in (True, False)}
        what = f"LoRA {self.cfg.lora} on {self.base_reference['path']}" if self.cfg.lora else \
            f"--freeze {' '.join(self.cfg.freeze)}"
        held = (f"experts MXFP4 as released, the rest in {self.step.cfg.compute_dtype}" if self.cfg.base_dtype == "mxfp4"
                else f"held in {self.step.cfg.compute_dtype}")
        say(f"{what}: training {counts[True]:,} parameters ({counts[True] / sum(counts.values()):.2%}); "
            f"{counts[False]:,} frozen ({len(self.step.frozen_names)} tensors, {held}, no optimizer state)")

    @property
    def model_name(self) -> str:
        """How the run names its model: the preset, or the transformers model_type and where it
        came from (its config file, the checkpoint or directory it starts from or resumes)."""
        if self.cfg.model_config:
            return f"{self.model_cfg.model_type} ({self.cfg.model_config})"
        if hasattr(self.model_cfg, "facts"):
            return f"module {self.model_cfg.describe()}"
        if not isinstance(self.model_cfg, ModelConfig):
            return f"{self.model_cfg.model_type} (from {self.cfg.init_from or self.cfg.out})"
        if self.cfg.init_from and "preset" not in self.explicit:      # the checkpoint's shapes, not a preset's
            return f"from {self.cfg.init_from}"
        return self.cfg.preset

    def _saved_state(self) -> dict:
        """What a checkpoint holds: the train state, and a --freeze run's frozen parameters
        (a LoRA run's frozen base is only referenced: formats/lora_checkpoint.py)."""
        state = self.state._asdict()
        if self.step.frozen and not self.cfg.lora:
            state["frozen"] = self.step.frozen
        return state

    def _model_config(self, meta: dict | None, explicit: dict):
        """(model record, initial parameters): None for a new run's random ones and a resumed run
        (its checkpoint is restored onto the mesh); weights formats/mesh_loader.py reads onto the
        mesh (--init-from any checkpoint, a LoRA run's base); Mxfp4Base; or a host state_dict (a
        transformers directory whose conversion is not read by slice). An explicit preset/model
        must have the --init-from checkpoint's shapes."""
        from formats.tokenizer import bos_id, end_id

        cfg = self.cfg
        if meta:
            model_cfg = checkpoint.config_from_dict(meta["model"], f"checkpoint {meta['step_dir']} field 'model'")
            if not lora_checkpoint.is_lora_meta(meta):
                return model_cfg, None
            self.base_reference = meta[lora_checkpoint.LORA_META]["base"]
            path = lora_checkpoint.check_base(self.base_reference, f"LoRA checkpoint {meta['step_dir']}")
            _, _, weights = mesh_loader.open_weights(path)
            if cfg.base_dtype == "mxfp4":
                return model_cfg, Mxfp4Base(weights)
            if weights is None:
                state, _, _ = checkpoint.load_checkpoint(path, transformers_ok=True)
                return model_cfg, state
            return model_cfg, weights
        bos, eos = bos_id(self.tokenizer), end_id(self.tokenizer)
        if not cfg.init_from:
            return build_model_config(cfg, self.tokenizer.n_vocab, bos, eos), None
        if cfg.base_dtype == "mxfp4":
            from formats.mxfp4_experts import check_released

            check_released(cfg.init_from, f"--init-from {cfg.init_from}")
        init_cfg, init_meta, weights = mesh_loader.open_weights(cfg.init_from)
        if init_from_hf.is_gpt_oss_dir(cfg.init_from):
            init_from_hf.check_moe(init_cfg, cfg.init_from)
        self.base_reference = lora_checkpoint.base_reference(cfg.init_from, init_meta)
        model_cfg = init_cfg.replace(max_seq_len=cfg.seq_len, bos_token_id=bos, eos_token_id=eos)
        if {"preset", "model"} & set(explicit):
            wanted = build_model_config(cfg, self.tokenizer.n_vocab, bos, eos)
            checkpoint.check_tensors(checkpoint.model_shapes(model_cfg), checkpoint.model_shapes(wanted),
                                     f"--init-from {cfg.init_from} (against the requested preset/model)")
        self._check_tokenizer(init_meta)
        if cfg.base_dtype == "mxfp4":
            return model_cfg, Mxfp4Base(weights)
        if weights is None:
            say(f"--init-from {cfg.init_from}: its layout needs a conversion of transformers' that is not read slice "
                f"by slice (formats/transformers_conversion.py); loaded whole on the host")
            state, _, _ = checkpoint.load_checkpoint(cfg.init_from, transformers_ok=True)
            return model_cfg, state
        return model_cfg, weights

    def _check_tokenizer(self, init_meta: dict) -> None:
        """The --init-from checkpoint's tokenizer, when it has one, must be the data's."""
        from formats.tokenizer import check_same_tokenizer

        cfg = self.cfg
        enc, line = checkpoint.checkpoint_tokenizer(cfg.init_from, init_meta)
        if init_meta.get("hf_dir"):
            say(f"--init-from {cfg.init_from}: tokenizer {line}")
        if enc is not None:
            check_same_tokenizer(enc, self.tokenizer, f"--init-from {cfg.init_from}", f"data {cfg.data}")

    def _init_where(self, meta: dict | None) -> str:
        return (f"the base {self.base_reference['path']} of {meta['step_dir']}" if meta
                else f"--init-from {self.cfg.init_from}")

    def _report_streamed(self, weights, meta: dict | None, seconds: float) -> None:
        import jax

        total = sum(e.nbytes for e in weights.entries.values())
        what = f"LoRA base {self.base_reference['path']}" if meta else f"initialized from {self.cfg.init_from}"
        print(f"{what}: process {jax.process_index()} read {weights.bytes_requested:,} of {total:,} stored bytes "
              f"onto its devices in {seconds:.1f} s{'' if meta else '; fresh optimizer state'}")

    def _restore_target(self) -> dict:
        """What a resume restores onto: the train state (abstract, or a LoRA run's state over its
        streamed base) and a --freeze run's frozen parameters, each with its sharding."""
        import jax

        from jax_bridge import sharding

        target = self.state._asdict()
        if self.step.frozen_names and not self.cfg.lora:
            target["frozen"] = self.step.abstract_frozen()
        if self.step.mesh is None:      # abstract arrays carry no sharding without a mesh: one device
            one = sharding.one_device()
            target = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else
                                  jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), target)
        return target

    def _open_metrics(self, resume_dir, meta) -> MetricsWriter | None:
        if not self.primary:
            return None
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "train_config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
        writer = MetricsWriter(self.out / "metrics.jsonl", resume_step=self.done if meta else None,
                               tensorboard_dir=self.out / "tensorboard" if self.cfg.tensorboard else None)
        counts = self.model_cfg.param_counts()
        from jax_bridge import distributed, kernel_tiles, registry, sharding
        tables = kernel_tiles.tables_in(self.step.cfg.kernel_options)
        tuned = f" (tuned tiles: {', '.join(tables)})" if tables else ""
        from torch_model.module_lm import ModuleSpec

        unrouted = self.model_cfg.unrouted_ops() if isinstance(self.model_cfg, ModuleSpec) else {}
        kernels = registry.describe(self.step.kernels, self.step.platform, unrouted)
        print(f"model {self.model_name}: {counts['total'] / 1e6:.2f}M parameters ({counts['active'] / 1e6:.2f}M "
              f"active); kernels: {kernels}{tuned}; compute "
              f"{self.step.cfg.compute_dtype}, matmul precision {self.step.cfg.matmul_precision}")
        print(f"devices: {distributed.describe()}; mesh: {sharding.describe(self.mesh) if self.mesh else 'none'}; "
              f"layers {'scanned' if self.step.layer_layout.stacked else 'looped'}, remat {self.cfg.remat}")
        routing = self.model.facts.report(self.step.kernels) if hasattr(self.model, "facts") else None
        for line in routing or ():
            print(line)
        writer.write({"kind": "resume" if meta else "run", "step": self.done, "from": str(resume_dir) if meta else None,
                      "preset": self.cfg.preset, "model_config": self.cfg.model_config, "kernels": self.step.kernels,
                      "kernel_tiles": tables, "params": counts["total"],
                      "active_params": counts["active"], "config": self.cfg.to_dict(), "model": self.model_cfg.to_dict(),
                      "flops_per_token": flops.flops_per_token(self.model_cfg, self.cfg.seq_len),
                      "peak_flops": self.peak, "peak_source": self.peak_source,
                      **({"routing": routing} if routing else {})})
        return writer

    # ---- one step -------------------------------------------------------------------------------
    def next_batch(self) -> np.ndarray:
        """The next step's micro-batches; a data error stops the run after a checkpoint of the
        last good step (with the loader position from before the failed read)."""
        from jax_bridge.step import packed_batch

        self._loader_state = self.train_data.state_dict()
        try:
            batches = [self.train_data.next_batch() for _ in range(self.cfg.micro_batches)]
            self._loader_state = None
            if self.preference is not None:
                return self._packed(batches, "train")
            return packed_batch(batches) if self.train_data.yields_batch else np.stack(batches)
        except UserError as e:
            path = self.save(wait=True)
            raise TrainingStopped(f"{e}; checkpoint of step {self.done} in {path}: fix the data, then continue "
                                  f"with --resume") from None

    def train_step(self, batch: np.ndarray):
        from train.run.schedule import lr_scale

        cfg = self.cfg
        self.scale = lr_scale(self.done, total=cfg.steps, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio)
        self.state, metrics = self.step(self.state, batch, self.scale)
        self.last_batch = batch            # what a profiled run's step program is looked up with
        self.done += 1
        # The timer starts after the first dispatch (compilation is not timed) and before the start
        # report waits for that step: started after the wait, the first lap held a step that had
        # already run, and its tokens/s read hundreds of times too high.
        if not self.timer.started:
            self.timer.start()
        self.timer.count()
        if self._starting:
            self._report_start(metrics)
        # Read the previous step's skip flag while this one runs (no stall of the device queue).
        previous, self._pending_skip = self._pending_skip, (self.done, metrics["skipped"])
        if previous is not None:
            self._count_skip(*previous)
        self.bar.update(1)
        self._stop_if_diverged()
        return metrics

    def _report_start(self, metrics) -> None:
        """The first step has been dispatched: once it has run, where the start went, printed in one
        line and recorded in the metrics (train/startup.py)."""
        import jax

        jax.block_until_ready(metrics["loss"])
        self.startup.mark("first step")
        self._starting = False
        record = self.startup.record()
        self.write_record({"kind": "startup", "step": self.done, **record})
        if self.primary:
            self.bar.write(self.startup.line(self.compile_cache, record=record))

    def _count_skip(self, step: int, flag) -> None:
        c = self.counters
        if int(flag):
            c["skipped_total"] += 1
            c["consecutive_skips"] += 1
            self._skipped_since_log += 1
        else:
            c["consecutive_skips"], c["last_good_step"] = 0, step

    def _stop_if_diverged(self) -> None:
        c = self.counters
        if c["consecutive_skips"] < self.cfg.max_consecutive_skips:
            return
        path = self.save(wait=True)          # counts the current step's flag first
        raise TrainingStopped(f"{c['consecutive_skips']} consecutive steps up to step {self.done} had a non-finite "
                              f"loss or gradient norm and were skipped (max_consecutive_skips="
                              f"{self.cfg.max_consecutive_skips}); stopped. The checkpoint of step {self.done} in "
                              f"{path} holds the parameters of step {c['last_good_step']}, the last good update: "
                              f"lower the learning rate, or resume from an earlier checkpoint")

    def _flush_skips(self) -> None:
        pending, self._pending_skip = self._pending_skip, None
        if pending is not None:
            self._count_skip(*pending)

    # ---- logging, evaluation, checkpoints -----------------------------------------------------
    def is_log_step(self) -> bool:
        return self.done % self.cfg.log_every == 0 or self.done == self.cfg.steps or self.done == 1

    def log(self, metrics) -> None:
        """Write the record of the step just run (waits for it)."""
        self.queue_log(metrics)
        self.write_pending_log()

    def queue_log(self, metrics) -> None:
        """Keep the record of the step just dispatched for write_pending_log, called once the next
        step is queued behind it: fetching its metrics then leaves the device busy, where a fetch
        right away would idle it for the host's whole turn (metrics, data, dispatch) every log
        step (a v5e profile, 2026-12-06: 6.7 ms of a 260 ms step at --log-every 1)."""
        self.write_pending_log()
        self._pending_log = (metrics, self.done, self.scale)

    def write_pending_log(self) -> None:
        """Write the kept record (queue_log), if any; evaluation, checkpoints and the run's end call
        this first, so records stay in step order."""
        import jax

        pending, self._pending_log = self._pending_log, None
        if pending is None:
            return
        metrics, step, scale = pending
        newest = step == self.done           # else the next step, dispatched, already counted its skip
        if newest:
            self._flush_skips()
        values = jax.device_get(metrics)
        per_step = self.timer.lap(running=self.done - step)
        tok_s = self.tokens_per_step / per_step if per_step else None
        record = {"kind": "train", "step": step, "lr_scale": scale, "lr_muon": self.cfg.lr * scale,
                  "lr_adamw": self.cfg.adam_lr * scale, "step_time_s": per_step, "tokens_per_s": tok_s,
                  "mfu": flops.mfu(tok_s, self.model_cfg, self.cfg.seq_len, self.peak) if tok_s else None,
                  "skipped": self._skipped_since_log, "skipped_total": self.counters["skipped_total"],
                  "elapsed_s": time.perf_counter() - self.start_time,
                  **{k: v for k, v in values.items() if k != "skipped"}}
        if "expert_fraction" in values:
            record["expert_load"] = expert_load(values["expert_fraction"])
        self._skipped_since_log = 0
        self.write_record(record)
        self._write_finished_checkpoints()
        self.bar.set_postfix(loss=f"{float(values['loss']):.3f}", tok_s=f"{tok_s or 0:,.0f}")
        if newest:
            self._stop_if_diverged()

    def evaluate(self) -> dict:
        import jax

        self.write_pending_log()
        jax.block_until_ready(self.state.params)          # the steps' time is not evaluation's
        with self.timer.paused():
            result = self.evaluator(self.step.full_params(self.state.params))
            if self.task_evaluator is not None:
                result.update(self._task_scores())
        if self._starting:
            self.startup.mark("first evaluation")
        self.write_record({"kind": "eval", "step": self.done, **result})
        if self.done and self.primary and self.preference is not None:
            self.bar.write(f"step {self.done}: held-out pairs {result['val_pairs']}: DPO loss {result['val_loss']:.4f}, "
                           f"reward accuracy {result['val_rewards/accuracies']:.1%}, margin "
                           f"{result['val_rewards/margins']:.4f}")
        elif self.done and self.primary:
            tasks = "".join(f", {name} {score:.1%}" for name, score in result.get("tasks", {}).items())
            core = f", CORE-6 (BIG-bench JSON) {100 * result['core6']:.2f}" if "core6" in result else ""
            self.bar.write(f"step {self.done}: validation loss {result['val_loss']:.4f}, "
                           f"{result['val_bpb']:.4f} bits/byte{tasks}{core}")
        self.last_eval = result
        return result

    def _task_scores(self) -> dict:
        """The --eval-tasks scores of the parameters where they are: the compiled scorer on the
        run's mesh (a LoRA run's adapters unmerged, as they train), every process taking part."""
        if self.task_scorer is None:
            self.task_scorer = self.task_evaluator.scorer(self.model, mesh=self.mesh,
                                                          compute_dtype=self.step.cfg.compute_dtype,
                                                          scan_layers=self.cfg.scan_layers)
        return self.task_evaluator(self.task_scorer, self.step.full_params(self.state.params))

    def _samples(self) -> list[dict]:
        """The end-of-run samples, generated from the parameters where they are (the compiled
        decoder on the run's mesh; a LoRA run's adapters unmerged), every process taking part."""
        from train.generation.generator import Generator

        generator = Generator(self.model, tokenizer=self.tokenizer, mesh=self.mesh,
                              params=self.step.layer_params(self.step.full_params(self.state.params)))
        return sample_texts(generator, self.tokenizer, self.cfg)

    def save(self, wait: bool = False) -> Path:
        """Checkpoint the state after step `self.done` (once per step); returns its directory."""
        import jax

        self.write_pending_log()
        path = self.checkpoints.root / str(self.done)
        if self.last_saved == self.done:
            if wait:
                self.checkpoints.wait()
            return path
        self._flush_skips()
        jax.block_until_ready(self.state)
        loader = self.train_data.state_dict() if self._loader_state is None else self._loader_state
        meta = {"model": self.model_cfg.to_dict(), "train_config": self.cfg.to_dict(), "kernels": self.step.kernels,
                "layout": self.step.layout, "loader": loader, "counters": dict(self.counters),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "devices": jax.device_count(), "processes": jax.process_count()}
        if self.reference_source is not None:
            meta["dpo_reference"] = self.reference_source
        if self.cfg.lora:
            from torch_model.lora import parse_lora_spec

            meta[lora_checkpoint.LORA_META] = {"spec": str(parse_lora_spec(self.cfg.lora)), "base": self.base_reference}
        with self.timer.paused():
            self.checkpoints.save(self.done, self._saved_state(), meta, self.tokenizer)
            if wait:
                self.checkpoints.wait()
        self.last_saved = self.done
        return path

    def _write_finished_checkpoints(self) -> None:
        for record in [r for r in self.checkpoints.records if r.total_s is not None]:
            self.checkpoints.records.remove(record)
            self.write_record({"kind": "checkpoint", "step": record.step, "blocking_s": record.blocking_s,
                         "write_s": record.total_s, "bytes": record.bytes})

    def profiled(self, record: dict) -> None:
        """The traced steps are done (train/run/profiling.py's record): process 0 writes the
        step's compiled HLO beside the trace and the trace's summary (train/run/profile_summary.py;
        printed at the end of the run), outside the steps' timing; then the record."""
        from train.run import profile_summary

        if self.primary:
            directory = Path(record["directory"])
            with self.timer.paused():
                try:
                    program = profile_summary.save_step_program(directory, self.step, self.state, self.last_batch,
                                                                self.scale, steps=record["steps"])
                    say(f"profile: the step's HLO in {directory / profile_summary.STEP_HLO} ({program['compiled']})")
                    _, path = profile_summary.write_summary(directory)
                    record["summary"] = self.profile_summary = str(path)
                except Exception as e:  # noqa: BLE001 - a diagnostic's failure is said, and the run goes on
                    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                    record["summary_error"] = f"{type(e).__name__}: {first}"
                    say(f"profile: no summary ({record['summary_error']}); the trace stays in {directory}"
                        + ("" if not (directory / profile_summary.STEP_HLO).is_file() else
                           f": `torchlyra profile {self.out}` reads it again"))
        self.write_record(record)

    def write_record(self, record: dict) -> None:
        """One record into metrics.jsonl (process 0)."""
        if self.metrics is not None:
            self.metrics.write(record)

    # ---- the end ------------------------------------------------------------------------------
    def stop(self, reason: str) -> dict:
        path = self.save(wait=True)
        self.write_record({"kind": "stop", "step": self.done, "reason": reason})
        self.bar.close()
        say(f"\n{reason}: stopped after step {self.done} of {self.cfg.steps}; checkpoint in {path}\n"
              f"continue with: torchlyra train --out {self.out} --resume")
        return {"steps": self.done, "stopped": reason, "checkpoint": str(path)}

    def finish(self) -> dict:
        from train.run.plots import plot_run

        path = self.save(wait=True)
        self._write_finished_checkpoints()
        self.bar.close()
        wall = time.perf_counter() - self.start_time
        summary = {"steps": self.done, "train_seconds": wall, "checkpoint": str(path),
                   "val_loss_end": self.last_eval.get("val_loss"), "val_bpb_end": self.last_eval.get("val_bpb"),
                   "skipped_total": self.counters["skipped_total"], "trace_count": self.step.trace_count,
                   "compile_count": self.step.compile_count, "kernel_tiles": self._tile_tables(),
                   "profile_summary": self.profile_summary}
        samples = self._samples() if self.cfg.samples > 0 else []
        if self.primary:
            self.metrics.close()
            self.metrics = None
            summary["plots"] = [str(p) for p in plot_run(self.out)]
            summary["metrics"] = str(self.out / "metrics.jsonl")
            summary["val_loss_start"] = self._first_eval()
            summary["samples"] = samples
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _tile_tables(self) -> dict:
        """The tables of tuned tiles the step took, and the calls whose shapes they lacked (those
        ran their default tiles; each was said on stderr when traced)."""
        from jax_bridge import kernel_tiles

        tables = kernel_tiles.tables_in(self.step.cfg.kernel_options)
        return {"tables": tables, "untuned": kernel_tiles.untuned(tables)}

    def _first_eval(self) -> float | None:
        from train.run.metrics import read_metrics

        evals = [r for r in read_metrics(self.out / "metrics.jsonl") if r.get("kind") == "eval"]
        return evals[0]["val_loss"] if evals else None

    def close(self) -> None:
        """Wait for a checkpoint still being written, then close the writers."""
        self.bar.close()
        self.checkpoints.close()
        if self.metrics is not None:
            self._write_finished_checkpoints()
            self.metrics.close()
            self.metrics = None


def sample_texts(generator, tokenizer, cfg: TrainConfig) -> list[dict]:
    """`cfg.samples` continuations of the default prompts by a Generator."""
    from train.generation.generator import generate

    if cfg.samples <= 0:
        return []
    bos, eos = generator.cfg.bos_token_id, generator.cfg.eos_token_id
    prompts = (DEFAULT_PROMPTS * cfg.samples)[:cfg.samples]
    ids = [[bos] + tokenizer.encode_ordinary(p) for p in prompts]
    # A sample is a preview: it stops where the model's positions end (a small config's may be few).
    positions = generator.cfg.max_position_embeddings
    new_tokens = max(1, min(cfg.sample_tokens, positions - max(map(len, ids)))) if positions else cfg.sample_tokens
    outs = generate(generator, ids, max_new_tokens=new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                    seed=cfg.seed, stop_tokens=(eos,)).tokens
    return [{"prompt": p, "text": p + tokenizer.decode([t for t in ids if t not in (bos, eos)])}
            for p, ids in zip(prompts, outs)]
