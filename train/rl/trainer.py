"""What an `rl` run does, one method per job: setup (new run from --init-from, or --resume),
a rollout (G completions per prompt from the compiled decode loop with the policy's current
parameters, rewards, advantages, packing), the update (mu steps of the one-jit GRPO step on the
same batch), logging, held-out evaluation, checkpoints and the end (plots, summary).
`train/rl/cli.py` strings them together.

Exact resume: the prompt order (a seeded permutation per epoch and the position in it) is in the
checkpoint, and each rollout's sampling seed is a function of the run's seed and the step.
"""
from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import numpy as np
import torch

from formats import checkpoint, lora_checkpoint, mesh_loader
from formats.errors import UserError
from jax_bridge.distributed import say
from train.rl.config import RLConfig


class PromptOrder:
    """The prompts in a seeded order, epoch after epoch; its position is part of the checkpoint."""

    def __init__(self, n: int, seed: int, epoch: int = 0, index: int = 0):
        self.n, self.seed, self.epoch, self.index = n, seed, epoch, index

    def _order(self):
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
            order = self._order()
            take = min(k - len(out), self.n - self.index)
            out += [int(i) for i in order[self.index:self.index + take]]
            self.index += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "prompts": self.n}


def sampling_seed(seed: int, step: int, attempt: int = 0) -> int:
    return int(np.random.default_rng([seed, step, attempt]).integers(0, 2 ** 31 - 1))


def newest_checkpoint(out: Path):
    root = out / "checkpoints"
    dirs = checkpoint.step_dirs(root) if root.is_dir() else []
    if not dirs:
        return None
    return checkpoint.find_checkpoint(root, resume=True)


class RLTrainer:
    def __init__(self, cfg: RLConfig, resume_dir: Path | None = None, meta: dict | None = None, startup=None):
        """`startup` (train.startup.Startup), when given, is marked as the run's parts are built."""
        mark = startup.mark if startup is not None else (lambda name: None)
        from jax_bridge import registry
        from jax_bridge.step import StepConfig, TrainState, TrainStep
        from torch_model.config import ConfigError
        from torch_model.lora import apply_lora, parse_lora_spec, unwrap
        from formats.model_checks import build_model
        from torch_model.optim import OptimizerConfig
        from train.generation.generator import Generator
        from train.rl.prompts import read_prompts
        from train.rl.rewards import parse_rewards
        from train.run.trainer import build_mesh

        self.cfg, self.out = cfg, Path(cfg.out)
        self.objective = cfg.objective()
        self.rewards = parse_rewards(cfg.reward, cfg.reward_weights, isolation=cfg.isolation)
        from formats.lora_inference import lora_meta

        if lora_meta(cfg.init_from) is not None:
            raise UserError(f"--init-from {cfg.init_from}: a LoRA checkpoint; start from its base, or export it merged")
        # The weights go from their files onto the mesh (formats/mesh_loader.py): nothing whole on the host.
        model_cfg, init_meta, weights = mesh_loader.open_weights(cfg.init_from)
        if hasattr(model_cfg, "facts"):
            raise UserError(f"--init-from {cfg.init_from}: a module model (train --module); rl trains on packed "
                            f"rollouts (segment ids, per-row positions), which a module's forward (tokens only) "
                            f"does not take")
        if weights is None:
            raise UserError(f"--init-from {cfg.init_from}: its layout needs a conversion that is not read slice by "
                            f"slice; `torchlyra import` it first")
        self.base_reference = lora_checkpoint.base_reference(cfg.init_from, init_meta)
        if meta and lora_checkpoint.is_lora_meta(meta) and \
                meta[lora_checkpoint.LORA_META]["base"]["sha256"] != self.base_reference["sha256"]:
            raise UserError(f"--resume: the base {cfg.init_from} changed since {resume_dir} was written (its hash "
                            "differs); a LoRA run resumes on the base it started from")
        self.tokenizer, line = checkpoint.checkpoint_tokenizer(cfg.init_from, init_meta)
        if self.tokenizer is None:
            raise UserError(f"--init-from {cfg.init_from}: no tokenizer to render the prompts with ({line})")
        if cfg.seq_len + 1 > model_cfg.max_position_embeddings:
            raise UserError(f"rl: max_prompt_tokens + max_new_tokens = {cfg.seq_len + 1} exceeds the model's "
                            f"max_position_embeddings ({model_cfg.max_position_embeddings})")
        self.model_cfg = model_cfg.replace(max_seq_len=cfg.seq_len)
        self.prompts = read_prompts(cfg.prompts, self.tokenizer, cfg.max_prompt_tokens)
        self.eval_prompts = read_prompts(cfg.eval_prompts, self.tokenizer, cfg.max_prompt_tokens) if cfg.eval_prompts else []
        if cfg.prompts_per_step > len(self.prompts):
            raise UserError(f"rl: prompts_per_step {cfg.prompts_per_step} is more than the {len(self.prompts)} "
                            f"prompts in {cfg.prompts}")
        cut = sum(p.cut for p in self.prompts)
        if cut:
            say(f"rl: {cut} of {len(self.prompts)} prompts longer than max_prompt_tokens ({cfg.max_prompt_tokens}) "
                "were cut from the left")
        self.prompts_cut = cut
        mark("opening the checkpoint and prompts")

        torch.manual_seed(cfg.seed)
        self.model = build_model(self.model_cfg, meta=True)
        try:
            self.peft_model = apply_lora(self.model, parse_lora_spec(cfg.lora)) if cfg.lora else None
        except (ConfigError, ValueError) as e:
            raise UserError(f"--lora {cfg.lora}: {e}") from None
        self.mesh = build_mesh(cfg)
        try:
            registry.resolve(cfg.kernels)
            self.step = TrainStep(self.model, OptimizerConfig(lr=cfg.lr, adam_lr=cfg.adam_lr,
                                                              adapter_optimizer=cfg.adapter_optimizer),
                                  StepConfig(kernels=cfg.kernels, compute_dtype=cfg.compute_dtype,
                                             micro_batches=cfg.micro_batches, policy_gradient=self.objective),
                                  mesh=self.mesh)
            registry.check_segments(self.step.kernels)
        except (registry.KernelError, ValueError) as e:
            raise UserError(str(e)) from None
        mark("model and train step")
        self.state = mesh_loader.init_state(self.step, weights, f"--init-from {cfg.init_from}")
        mark("parameters")
        try:
            self.generator = Generator(unwrap(self.peft_model) if self.peft_model is not None else self.model,
                                       kernels=cfg.kernels, tokenizer=self.tokenizer, mesh=self.mesh,
                                       params=self.policy_params())
        except (registry.KernelError, ValueError) as e:
            raise UserError(str(e)) from None
        # The KL reference: LoRA, the same parameters with the adapters off (no copy); full
        # fine-tuning, the starting parameters frozen in the compute dtype (only when beta > 0).
        self.frozen_reference = None
        if self.objective.beta and self.peft_model is None:
            import jax
            import jax.numpy as jnp

            from jax_bridge.step import cast_params

            # A copy: the train state is donated to each step, the reference must outlive it.
            self.frozen_reference = jax.tree.map(lambda x: jnp.array(x, copy=True), cast_params(
                self.step.full_params(self.state.params), self.step.compute_dtype))
        self.order = PromptOrder(len(self.prompts), cfg.seed)
        self.done = 0
        if meta:
            restored = checkpoint.restore_train_state(resume_dir, self.state._asdict(), layout=self.step.layout)
            self.state = TrainState(**restored)
            saved = meta["rl_order"]
            if saved["prompts"] != len(self.prompts):
                raise UserError(f"--resume: {cfg.prompts} holds {len(self.prompts)} prompts, the run had {saved['prompts']}")
            self.order = PromptOrder(len(self.prompts), saved["seed"], saved["epoch"], saved["index"])
            self.done = meta["step"]
            say(f"resuming from {resume_dir} (step {self.done})")
        mark("generator, reference and resumed state")
        self.checkpoints = checkpoint.CheckpointWriter(self.out / "checkpoints", keep=cfg.keep_checkpoints)
        self.last_saved = self.done if meta else None
        self.metrics = self._open_metrics(meta)
        self.start_time = time.perf_counter()
        self.all_none_total = 0
        self._collectives_reported = False

    def _open_metrics(self, meta):
        from train.run.metrics import MetricsWriter

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "rl_config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
        writer = MetricsWriter(self.out / "metrics.jsonl", resume_step=self.done if meta else None,
                               tensorboard_dir=self.out / "tensorboard" if self.cfg.tensorboard else None)
        writer.write({"kind": "resume" if meta else "run", "step": self.done, "config": self.cfg.to_dict(),
                      "model": self.model_cfg.to_dict(), "prompts": len(self.prompts),
                      "prompts_cut": self.prompts_cut, "kernels": self.step.kernels})
        return writer

    # ---- rollout ----------------------------------------------------------------------------
    def policy_params(self) -> dict:
        """Every parameter of the policy under the model's per-layer names (what the decoder takes)."""
        return self.step.layer_params(self.step.full_params(self.state.params))

    def _sampling(self, seed: int, greedy: bool = False):
        from train.generation.sampling import SamplingConfig

        cfg = self.cfg
        return SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0 if greedy else cfg.temperature,
                              top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)

    def _score(self, samples):
        from train.rl.rewards import score

        return [score(self.rewards, s.prompt.text, s.text, s.prompt.record, s.prompt.where) for s in samples]

    def rollout(self) -> tuple[dict, dict]:
        """(the packed batch for the step, rollout metrics)."""
        from torch_model.policy_gradient import group_advantages
        from train.rl.rollout import sample_groups

        cfg, g = self.cfg, self.cfg.group_size
        started = time.perf_counter()
        self.generator.set_params(self.policy_params())
        groups, spare, zero_groups, sampled, attempt = [], [], 0, 0, 0
        while len(groups) < cfg.prompts_per_step:
            wanted = cfg.prompts_per_step - len(groups)
            prompts = [self.prompts[i] for i in self.order.take(wanted)]
            samples, _ = sample_groups(self.generator, prompts, g, self._sampling(sampling_seed(cfg.seed, self.done, attempt)),
                                       self.tokenizer)
            scored = self._score(samples)
            totals = torch.tensor([s.total for s in scored])
            _, zero = group_advantages(totals, g, "group")
            sampled += len(prompts)
            for k in range(len(prompts)):
                group = list(zip(samples[k * g:(k + 1) * g], scored[k * g:(k + 1) * g]))
                if bool(zero[k * g]):
                    zero_groups += 1
                    if cfg.drop_zero_std:
                        spare.append(group)
                        continue
                groups.append(group)
            attempt += 1
            if cfg.drop_zero_std and attempt >= 4 and len(groups) < cfg.prompts_per_step:
                groups += spare[:cfg.prompts_per_step - len(groups)]      # refills exhausted: keep some
        flat = [pair for group in groups for pair in group]
        samples, scored = [s for s, _ in flat], [r for _, r in flat]
        totals = torch.tensor([r.total for r in scored])
        advantages, _ = group_advantages(totals, g, cfg.scale_rewards)
        rollout_s = time.perf_counter() - started
        batch, rollouts = self._pack(samples, advantages)
        lengths = np.array([len(s.tokens) for s in samples])
        all_none = sum(r.all_none for r in scored)
        if all_none:
            self.all_none_total += all_none
            say(f"rl step {self.done + 1}: warning: {all_none} completions had no reward (every reward gave None): "
                "reward 0")
        entropy = np.concatenate([np.asarray(s.entropy) for s in samples])
        metrics = {"reward": float(totals.mean()), "reward_std": float(totals.std()),
                   "frac_reward_zero_std": zero_groups / sampled, "zero_std_groups": zero_groups,
                   "sampled_groups": sampled,
                   "rewards_all_none": all_none, "completion_length": float(lengths.mean()),
                   "completion_length_min": int(lengths.min()), "completion_length_max": int(lengths.max()),
                   "truncated_share": float(np.mean([s.truncated for s in samples])),
                   "entropy": float(entropy.mean()), "rollout_s": rollout_s, "completions": len(samples)}
        for i, r in enumerate(self.rewards):
            values = [s.values[i] for s in scored if s.values[i] is not None]
            metrics[f"reward/{r.name}"] = float(np.mean(values)) if values else None
        batch, diff = self._log_probabilities(batch, samples, rollouts)
        metrics.update(diff)
        if self.mesh is not None and not self._collectives_reported:
            moved = max(self.generator.decoder.decode_collectives().values(), key=lambda c: c["gathered_per_call"])
            metrics.update({f"decode/{k}_bytes": v for k, v in moved.items()})
            say(f"rl: the decode loop under mesh {self.cfg.mesh or 'fsdp'}, per device: all-gathers "
                f"{moved['gathered_per_call'] / 2 ** 20:.2f} MiB once per rollout (outside the loop), "
                f"{moved['gathered_per_token'] / 1024:.2f} KiB per generated token, other collectives "
                f"{moved['other_per_token'] / 1024:.2f} KiB per token")
            self._collectives_reported = True
        return batch, metrics

    def _pack(self, samples, advantages) -> tuple[dict, list]:
        from jax_bridge import sharding
        from jax_bridge.decoding import round_up
        from jax_bridge.policy_gradient import ADVANTAGES
        from train.rl.batch import Rollout, pack_rollouts, rows_for

        cfg = self.cfg
        rollouts = [Rollout(s.prompt.tokens, s.tokens, float(a), s.truncated) for s, a in zip(samples, advantages)]
        # Whole micro-batches with whole rows per batch shard: padding rows (no segment, weight 0)
        # add nothing to the loss or its normalisers.
        multiple = cfg.micro_batches * (1 if self.mesh is None else sharding.batch_shards(self.mesh))
        rows = round_up(rows_for(len(rollouts), cfg.seq_len, cfg.max_prompt_tokens, cfg.max_new_tokens), multiple)
        # logp_old and ref_logps are added by _log_probabilities, from the step's own forward
        return pack_rollouts(rollouts, rows, cfg.seq_len, (ADVANTAGES,), cfg.mask_truncated), rollouts

    def _log_probabilities(self, batch: dict, samples, rollouts) -> tuple[dict, dict]:
        """logp_old (the policy now; the sampler-vs-trainer metric) and the reference's, per token."""
        from jax_bridge.policy_gradient import LOGP_OLD, REF_LOGPS
        from jax_bridge.preference import reference_params
        from train.rl.batch import unpack_tokens

        full = self.step.full_params(self.state.params)
        trainer = np.asarray(self.step.token_logps(full, batch))
        pad = lambda x: np.concatenate([np.zeros((x.shape[0], 1), np.float32), x], axis=1)   # noqa: E731
        if self.objective.needs_logp_old:
            batch[LOGP_OLD] = pad(trainer)
        if self.objective.beta:
            ref = reference_params(full) if self.peft_model is not None else self.frozen_reference
            batch[REF_LOGPS] = pad(np.asarray(self.step.token_logps(ref, batch)))
        per_rollout = unpack_tokens(trainer, rollouts, self.cfg.seq_len)
        diffs = np.concatenate([np.abs(np.asarray(s.logps) - t) for s, t in zip(samples, per_rollout)])
        return batch, {"logp_diff/sampler_vs_trainer_mean": float(diffs.mean()),
                       "logp_diff/sampler_vs_trainer_max": float(diffs.max())}

    # ---- update -----------------------------------------------------------------------------
    def update(self, batch: dict) -> dict:
        import jax

        started = time.perf_counter()
        micro = self.cfg.micro_batches       # the rows were padded to a multiple of it (_pack)
        stacked = {k: v.reshape(micro, v.shape[0] // micro, *v.shape[1:]) for k, v in batch.items()}
        per_iteration = []
        for _ in range(self.cfg.iterations):
            self.state, m = self.step(self.state, stacked, 1.0)
            per_iteration.append(m)
        values = jax.device_get(per_iteration)
        self.done += 1
        keys = ("loss", "pg_loss", "kl", "clip_ratio/low", "clip_ratio/high", "grad_norm", "skipped")
        out = {k: float(np.mean([v[k] for v in values])) for k in keys if k in values[0]}
        out["update_s"] = time.perf_counter() - started
        return out

    # ---- logging, evaluation, checkpoints -----------------------------------------------------
    def report_start(self, startup, cache_dir) -> None:
        """Where the start went, up to the first update: one line, and a {"kind": "startup"} record."""
        record = startup.record()
        self.metrics.write({"kind": "startup", "step": self.done, **record})
        say(startup.line(cache_dir, record=record))

    def log(self, record: dict) -> None:
        record = {"kind": "train", "step": self.done, "elapsed_s": time.perf_counter() - self.start_time, **record}
        record["rollout_share"] = record["rollout_s"] / max(1e-9, record["rollout_s"] + record["update_s"])
        self.metrics.write(record)
        say(f"step {self.done}: reward {record['reward']:.3f} (std {record['reward_std']:.3f}, zero-std groups "
            f"{record['zero_std_groups']}), length {record['completion_length']:.1f}, loss {record['loss']:.4f}, "
            f"rollout {record['rollout_s']:.1f} s, update {record['update_s']:.1f} s")

    def evaluate(self) -> dict | None:
        """Held-out prompts, one greedy completion each: the mean reward and each reward's."""
        from train.rl.rollout import sample_groups

        if not self.eval_prompts:
            return None
        self.generator.set_params(self.policy_params())
        started = time.perf_counter()
        samples = []
        for i in range(0, len(self.eval_prompts), 64):
            chunk, _ = sample_groups(self.generator, self.eval_prompts[i:i + 64], 1, self._sampling(0, greedy=True),
                                     self.tokenizer)
            samples += chunk
        scored = self._score(samples)
        record = {"kind": "eval", "step": self.done, "eval_reward": float(np.mean([s.total for s in scored])),
                  "eval_prompts": len(samples), "eval_s": time.perf_counter() - started}
        for i, r in enumerate(self.rewards):
            values = [s.values[i] for s in scored if s.values[i] is not None]
            record[f"eval_reward/{r.name}"] = float(np.mean(values)) if values else None
        self.metrics.write(record)
        say(f"step {self.done}: held-out reward {record['eval_reward']:.4f} over {len(samples)} prompts")
        return record

    def save(self) -> Path:
        import jax

        path = self.checkpoints.root / str(self.done)
        if self.last_saved == self.done:
            return path
        jax.block_until_ready(self.state)
        meta = {"model": self.model_cfg.to_dict(), "rl_config": self.cfg.to_dict(), "kernels": self.step.kernels,
                "layout": self.step.layout, "rl_order": self.order.state_dict(),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "devices": jax.device_count(), "processes": jax.process_count()}
        if self.cfg.lora:
            from torch_model.lora import parse_lora_spec

            meta[lora_checkpoint.LORA_META] = {"spec": str(parse_lora_spec(self.cfg.lora)), "base": self.base_reference}
        self.checkpoints.save(self.done, self.state._asdict(), meta, self.tokenizer)
        self.checkpoints.wait()
        self.last_saved = self.done
        return path

    def finish(self) -> dict:
        from train.run.plots import plot_rl

        path = self.save()
        self.metrics.close()
        self.metrics = None
        plots = [str(p) for p in plot_rl(self.out)]
        summary = {"steps": self.done, "seconds": time.perf_counter() - self.start_time, "checkpoint": str(path),
                   "plots": plots, "metrics": str(self.out / "metrics.jsonl"), "rewards_all_none": self.all_none_total,
                   "trace_count": self.step.trace_count, "compile_count": self.step.compile_count,
                   "decoder_compilations": len(self.generator.decoder.compilations)}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def close(self) -> None:
        self.checkpoints.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
