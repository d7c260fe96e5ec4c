"""`torchlyra train`: the training loop around the one-jit step.

Data -> TrainStep (model + optimizer lowered through torchax) -> metrics JSONL, loss plot,
validation, final checkpoint, samples. Ctrl-C writes a checkpoint of the last finished step.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from train.config import TrainConfig, load_config_file
from train.errors import UserError

DEFAULT_PROMPTS = ["ROMEO:", "First Citizen:\nWe are"]


def build_model_config(cfg: TrainConfig, vocab_size: int, bos: int):
    from torch_model.config import ConfigError, get_preset

    try:
        model_cfg = get_preset(cfg.preset).replace(**cfg.model)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if vocab_size > model_cfg.vocab_size:
        raise UserError(f"data vocabulary ({vocab_size}) is larger than the model's vocab_size "
                        f"({model_cfg.vocab_size}); set model.vocab_size >= {vocab_size}")
    return model_cfg.replace(bos_token_id=bos, eos_token_id=bos, max_seq_len=cfg.seq_len)


def evaluate(step, params, batches) -> float:
    losses = [float(step.evaluate(params, b)["ce"]) for b in batches]
    return float(np.mean(losses))


def build_mesh(cfg: TrainConfig):
    """The device mesh of the run (None on a single device with no --mesh)."""
    import jax

    from jax_bridge import sharding

    if not cfg.mesh and jax.device_count() == 1:
        return None
    try:
        return sharding.make_mesh(cfg.mesh or None)
    except ValueError as e:
        raise UserError(str(e)) from None


def run_training(cfg: TrainConfig, *, show_progress: bool = True) -> dict:
    import jax

    from jax_bridge import distributed, registry, sharding
    from jax_bridge.lowering import params_to_torch
    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.model import GptOssForCausalLM
    from torch_model.optim import OptimizerConfig
    from train.checkpoint import save_checkpoint
    from train.loader import TokenLoader
    from train.metrics import MetricsWriter, plot_losses
    from train.schedule import lr_scale
    from train.tokenizer import bos_id, load_tokenizer

    out = Path(cfg.out)
    main = distributed.is_main_process()
    show_progress = show_progress and main
    say = print if main else (lambda *a, **k: None)
    try:
        registry.resolve(cfg.kernels)          # a bad kernel choice fails before any work
    except registry.KernelError as e:
        raise UserError(str(e)) from None
    tokenizer = load_tokenizer(cfg.data)
    bos = bos_id(tokenizer)
    model_cfg = build_model_config(cfg, tokenizer.n_vocab, bos)
    if cfg.batch_size % jax.process_count():
        raise UserError(f"config: batch_size ({cfg.batch_size}, the global batch) must be a multiple of the "
                        f"number of processes ({jax.process_count()})")
    rows = cfg.batch_size // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)   # this process's rows
    train_data = TokenLoader(cfg.data, "train", batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                             vocab_size=model_cfg.vocab_size)
    val_data = TokenLoader(cfg.data, "val", batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                           vocab_size=model_cfg.vocab_size)
    val_batches = [b[mine] for b in val_data.iter_eval_batches(cfg.eval_batches)]

    torch.manual_seed(cfg.seed)
    model = GptOssForCausalLM(model_cfg)
    opt_cfg = OptimizerConfig(lr=cfg.lr, adam_lr=cfg.adam_lr, weight_decay=cfg.weight_decay)
    mesh = build_mesh(cfg)
    try:
        step = TrainStep(model, opt_cfg, StepConfig(kernels=cfg.kernels, compute_dtype=cfg.compute_dtype,
                                                    micro_batches=cfg.micro_batches, scan_layers=cfg.scan_layers,
                                                    remat=cfg.remat), mesh=mesh)
    except (registry.KernelError, ValueError) as e:
        raise UserError(str(e)) from None
    counts = model_cfg.param_counts()
    say(f"model {cfg.preset}: {counts['total'] / 1e6:.2f}M parameters ({counts['active'] / 1e6:.2f}M active); "
        f"kernels: {registry.describe(step.kernels)}")
    say(f"devices: {distributed.describe()}; mesh: {sharding.describe(mesh) if mesh else 'none'}; "
        f"layers {'scanned' if cfg.scan_layers else 'looped'}, remat {cfg.remat}")

    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    if main:
        (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        if metrics_path.exists():
            metrics_path.unlink()
    writer = MetricsWriter(metrics_path) if main else _NoMetrics()
    writer.write({"kind": "run", "preset": cfg.preset, "kernels": step.kernels, "params": counts["total"],
                  "active_params": counts["active"], "config": cfg.to_dict(), "model": model_cfg.to_dict()})
    state = step.init_state()
    tokens_per_step = cfg.micro_batches * cfg.batch_size * cfg.seq_len

    def save(step_number: int, tag: str = "checkpoint") -> Path:
        ckpt = out / tag
        params = params_to_torch(sharding.to_host(step.layer_params(state.params)))   # every process gathers
        if main:
            save_checkpoint(ckpt, params, model_cfg, step=step_number, tokenizer=tokenizer,
                            extra={"kernels": step.kernels, "train_config": cfg.to_dict()})
        return ckpt

    val_start = evaluate(step, state.params, val_batches)
    writer.write({"kind": "eval", "step": 0, "val_loss": val_start})
    val_loss, done, start_time = val_start, 0, time.perf_counter()
    last_log_time, last_log_step = start_time, 0
    bar = tqdm(total=cfg.steps, desc="train", disable=not show_progress, dynamic_ncols=True)
    try:
        for i in range(cfg.steps):
            batch = np.stack([train_data.next_batch()[mine] for _ in range(cfg.micro_batches)])
            scale = lr_scale(i, total=cfg.steps, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio)
            state, metrics = step(state, batch, scale)
            done = i + 1
            if done % cfg.log_every == 0 or done == cfg.steps or i == 0:
                metrics = {k: float(v) for k, v in metrics.items()}   # waits for the queued steps
                now = time.perf_counter()
                tok_s = tokens_per_step * (done - last_log_step) / (now - last_log_time)
                last_log_time, last_log_step = now, done
                writer.write({"kind": "train", "step": done, "lr_scale": scale, "tokens_per_s": tok_s,
                              "elapsed_s": time.perf_counter() - start_time, **metrics})
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{tok_s:,.0f}")
            if done % cfg.eval_every == 0 or done == cfg.steps:
                val_loss = evaluate(step, state.params, val_batches)
                writer.write({"kind": "eval", "step": done, "val_loss": val_loss})
                if main:
                    bar.write(f"step {done}: validation loss {val_loss:.4f}")
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        ckpt = save(done)
        writer.close()
        say(f"interrupted: checkpoint of step {done} written to {ckpt}")
        raise
    bar.close()
    wall = time.perf_counter() - start_time
    ckpt = save(done)
    writer.close()
    if not main:
        return {"steps": done, "train_seconds": wall, "trace_count": step.trace_count}
    plot = plot_losses(metrics_path, out / "loss.png")

    model.load_state_dict(params_to_torch(sharding.to_host(step.layer_params(state.params))))
    samples = sample_texts(model, tokenizer, cfg)
    summary = {"steps": done, "train_seconds": wall, "val_loss_start": val_start, "val_loss_end": val_loss,
               "metrics": str(metrics_path), "plot": str(plot), "checkpoint": str(ckpt), "samples": samples,
               "trace_count": step.trace_count}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class _NoMetrics:
    """What processes other than 0 write: nothing."""

    def write(self, record):
        pass

    def close(self):
        pass


def sample_texts(model, tokenizer, cfg: TrainConfig) -> list[dict]:
    from train.generate import Sampler
    from train.tokenizer import bos_id

    if cfg.samples <= 0:
        return []
    bos = bos_id(tokenizer)
    prompts = (DEFAULT_PROMPTS * cfg.samples)[:cfg.samples]
    outs = Sampler(model, kernels="xla").generate(
        [[bos] + tokenizer.encode_ordinary(p) for p in prompts], max_new_tokens=cfg.sample_tokens,
        temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed, stop_token=bos)
    return [{"prompt": p, "text": p + tokenizer.decode([t for t in ids if t != bos])} for p, ids in zip(prompts, outs)]


# ---- command line -------------------------------------------------------------------------------
_FLAGS = {"preset": str, "data": str, "out": str, "steps": int, "batch_size": int, "seq_len": int,
          "micro_batches": int, "lr": float, "adam_lr": float, "warmup_steps": int, "kernels": str,
          "compute_dtype": str, "seed": int, "eval_every": int, "eval_batches": int, "samples": int,
          "mesh": str, "remat": str, "scan_layers": bool}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="JSON file of training settings (flags override it)")
    for name, kind in _FLAGS.items():
        if kind is bool:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)
    cluster = parser.add_argument_group("multi-host (one command per host; not needed on a TPU pod or under SLURM)")
    cluster.add_argument("--coordinator", help="HOST:PORT of process 0, which every process connects to")
    cluster.add_argument("--num-processes", type=int, help="number of processes (hosts) in the run")
    cluster.add_argument("--process-id", type=int, help="this process's rank, 0 .. num-processes - 1")


def config_from_args(args) -> TrainConfig:
    values = load_config_file(args.config) if args.config else {}
    values.update({k: getattr(args, k) for k in _FLAGS if getattr(args, k, None) is not None})
    try:
        return TrainConfig(**values)
    except TypeError as e:
        raise UserError(f"config: {e}") from None


def run(args) -> int:
    from jax_bridge import distributed
    from torch_model.config import PRESETS

    try:       # before anything touches a device
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except distributed.ClusterError as e:
        raise UserError(str(e)) from None
    cfg = config_from_args(args)
    if cfg.preset not in PRESETS:
        raise UserError(f"unknown preset {cfg.preset!r}; choose one of: {', '.join(PRESETS)}")
    summary = run_training(cfg)
    if not distributed.is_main_process():
        return 0
    print(f"\ntrained {summary['steps']} steps in {summary['train_seconds']:.0f} s; validation loss "
          f"{summary['val_loss_start']:.3f} -> {summary['val_loss_end']:.3f}")
    for s in summary["samples"]:
        print(f"\n--- sample ---\n{s['text']}")
    print(f"\nmetrics:    {summary['metrics']}\nplot:       {summary['plot']}\ncheckpoint: {summary['checkpoint']}")
    return 0
