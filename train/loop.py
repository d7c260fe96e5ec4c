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


def build_model_config(cfg: TrainConfig, vocab_size: int, bos: int, eos: int):
    from torch_model.config import ConfigError, get_preset

    try:
        model_cfg = get_preset(cfg.preset).replace(**cfg.model)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if vocab_size > model_cfg.vocab_size:
        raise UserError(f"data vocabulary ({vocab_size}) is larger than the model's vocab_size "
                        f"({model_cfg.vocab_size}); set model.vocab_size >= {vocab_size}")
    return model_cfg.replace(bos_token_id=bos, eos_token_id=eos, max_seq_len=cfg.seq_len)


def evaluate(step, params, batches) -> float:
    losses = [float(step.evaluate(params, b)["ce"]) for b in batches]
    return float(np.mean(losses))


def run_training(cfg: TrainConfig, *, show_progress: bool = True) -> dict:
    from jax_bridge import registry
    from jax_bridge.lowering import params_to_torch
    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.model import GptOssForCausalLM
    from torch_model.optim import OptimizerConfig
    from train.checkpoint import save_checkpoint
    from train.data.loader import TokenLoader
    from train.data.tokenizer import bos_id, end_id, load_tokenizer
    from train.metrics import MetricsWriter, plot_losses
    from train.schedule import lr_scale

    out = Path(cfg.out)
    try:
        registry.resolve(cfg.kernels)          # a bad kernel choice fails before any work
    except registry.KernelError as e:
        raise UserError(str(e)) from None
    tokenizer = load_tokenizer(cfg.data)  # the data's: its special ids become the model's
    model_cfg = build_model_config(cfg, tokenizer.n_vocab, bos_id(tokenizer), end_id(tokenizer))
    train_data = TokenLoader(cfg.data, "train", global_batch=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                             vocab_size=model_cfg.vocab_size)
    val_data = TokenLoader(cfg.data, "val", global_batch=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                           vocab_size=model_cfg.vocab_size)
    val_batches = list(val_data.iter_eval_batches(cfg.eval_batches))

    torch.manual_seed(cfg.seed)
    model = GptOssForCausalLM(model_cfg)
    opt_cfg = OptimizerConfig(lr=cfg.lr, adam_lr=cfg.adam_lr, weight_decay=cfg.weight_decay)
    try:
        step = TrainStep(model, opt_cfg, StepConfig(kernels=cfg.kernels, compute_dtype=cfg.compute_dtype,
                                                    micro_batches=cfg.micro_batches))
    except registry.KernelError as e:
        raise UserError(str(e)) from None
    counts = model_cfg.param_counts()
    print(f"model {cfg.preset}: {counts['total'] / 1e6:.2f}M parameters ({counts['active'] / 1e6:.2f}M active); "
          f"kernels: {registry.describe(step.kernels)}")

    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()
    writer = MetricsWriter(metrics_path)
    writer.write({"kind": "run", "preset": cfg.preset, "kernels": step.kernels, "params": counts["total"],
                  "active_params": counts["active"], "config": cfg.to_dict(), "model": model_cfg.to_dict()})
    state = step.init_state()
    tokens_per_step = cfg.micro_batches * cfg.batch_size * cfg.seq_len

    def save(step_number: int, tag: str = "checkpoint") -> Path:
        ckpt = out / tag
        save_checkpoint(ckpt, params_to_torch(state.params), model_cfg, step=step_number, tokenizer=tokenizer,
                        extra={"kernels": step.kernels, "train_config": cfg.to_dict()})
        return ckpt

    val_start = evaluate(step, state.params, val_batches)
    writer.write({"kind": "eval", "step": 0, "val_loss": val_start})
    val_loss, done, start_time = val_start, 0, time.perf_counter()
    last_log_time, last_log_step = start_time, 0
    bar = tqdm(total=cfg.steps, desc="train", disable=not show_progress, dynamic_ncols=True)
    try:
        for i in range(cfg.steps):
            batch = np.stack([train_data.next_batch() for _ in range(cfg.micro_batches)])
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
                bar.write(f"step {done}: validation loss {val_loss:.4f}")
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        ckpt = save(done)
        writer.close()
        print(f"interrupted: checkpoint of step {done} written to {ckpt}")
        raise
    bar.close()
    wall = time.perf_counter() - start_time
    ckpt = save(done)
    writer.close()
    plot = plot_losses(metrics_path, out / "loss.png")

    model.load_state_dict(params_to_torch(state.params))
    samples = sample_texts(model, tokenizer, cfg)
    summary = {"steps": done, "train_seconds": wall, "val_loss_start": val_start, "val_loss_end": val_loss,
               "metrics": str(metrics_path), "plot": str(plot), "checkpoint": str(ckpt), "samples": samples,
               "trace_count": step.trace_count}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def sample_texts(model, tokenizer, cfg: TrainConfig) -> list[dict]:
    from train.data.tokenizer import bos_id, end_id
    from train.generate import Sampler

    if cfg.samples <= 0:
        return []
    bos, end = bos_id(tokenizer), end_id(tokenizer)
    prompts = (DEFAULT_PROMPTS * cfg.samples)[:cfg.samples]
    outs = Sampler(model, kernels="xla").generate(
        [[bos] + tokenizer.encode_ordinary(p) for p in prompts], max_new_tokens=cfg.sample_tokens,
        temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed, stop_token=end)
    return [{"prompt": p, "text": p + tokenizer.decode([t for t in ids if t not in (bos, end)])}
            for p, ids in zip(prompts, outs)]


# ---- command line -------------------------------------------------------------------------------
_FLAGS = {"preset": str, "data": str, "out": str, "steps": int, "batch_size": int, "seq_len": int,
          "micro_batches": int, "lr": float, "adam_lr": float, "warmup_steps": int, "kernels": str,
          "compute_dtype": str, "seed": int, "eval_every": int, "eval_batches": int, "samples": int}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="JSON file of training settings (flags override it)")
    for name, kind in _FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)


def config_from_args(args) -> TrainConfig:
    values = load_config_file(args.config) if args.config else {}
    values.update({k: getattr(args, k) for k in _FLAGS if getattr(args, k, None) is not None})
    try:
        return TrainConfig(**values)
    except TypeError as e:
        raise UserError(f"config: {e}") from None


def run(args) -> int:
    from torch_model.config import PRESETS

    cfg = config_from_args(args)
    if cfg.preset not in PRESETS:
        raise UserError(f"unknown preset {cfg.preset!r}; choose one of: {', '.join(PRESETS)}")
    summary = run_training(cfg)
    print(f"\ntrained {summary['steps']} steps in {summary['train_seconds']:.0f} s; validation loss "
          f"{summary['val_loss_start']:.3f} -> {summary['val_loss_end']:.3f}")
    for s in summary["samples"]:
        print(f"\n--- sample ---\n{s['text']}")
    print(f"\nmetrics:    {summary['metrics']}\nplot:       {summary['plot']}\ncheckpoint: {summary['checkpoint']}")
    return 0
