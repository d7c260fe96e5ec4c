"""`torchlyra plot RUN_DIR`: PNG plots of a run's metrics.jsonl (also written when training ends).

An `rl` run: rewards.png (rollout and held-out reward), rl_terms.png (clip fractions, KL,
entropy, completion lengths, zero-std groups), grad_norm.png. A `train` run:
plots/loss.png (train and validation loss), lr.png (learning rate per group), grad_norm.png
(before and after clipping), throughput.png (tokens/s and MFU), expert_load.png (per MoE layer,
a heat map of each expert's load over the logged steps).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from formats.errors import UserError
from train.run.metrics import read_metrics


def _series(records, kind: str, key: str):
    points = [(r["step"], r[key]) for r in records if r.get("kind") == kind and r.get(key) is not None]
    return tuple(zip(*points)) if points else ((), ())


def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, ax, path: Path, legend: bool = True) -> Path:
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_loss(records, path: Path) -> Path:
    dpo = any(r.get("kind") == "train" and "dpo_loss" in r for r in records)
    plt, fig, ax = _figure("loss", "DPO loss (per pair)" if dpo else "cross-entropy (nats/token)")
    ax.plot(*_series(records, "train", "dpo_loss" if dpo else "ce"), label="train", lw=1)
    steps, val = _series(records, "eval", "val_loss")
    ax.plot(steps, val, "o-", label="validation", lw=1.5)
    bpb_steps, bpb = _series(records, "eval", "val_bpb")
    if bpb:
        right = ax.twinx()
        right.plot(bpb_steps, bpb, "s--", color="tab:green", lw=1, label="validation bits/byte")
        right.set_ylabel("bits per byte")
        right.legend(loc="upper center")
    return _save(plt, fig, ax, path)


def plot_lr(records, path: Path) -> Path:
    plt, fig, ax = _figure("learning rate", "learning rate")
    ax.plot(*_series(records, "train", "lr_muon"), label="Muon", lw=1)
    ax.plot(*_series(records, "train", "lr_adamw"), label="AdamW", lw=1)
    return _save(plt, fig, ax, path)


def plot_grad_norm(records, path: Path) -> Path:
    plt, fig, ax = _figure("gradient norm", "global L2 norm")
    ax.plot(*_series(records, "train", "grad_norm"), label="before clipping", lw=1)
    ax.plot(*_series(records, "train", "grad_norm_clipped"), label="after clipping", lw=1)
    ax.set_yscale("log")
    return _save(plt, fig, ax, path)


def plot_throughput(records, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), dpi=120, sharex=True, layout="constrained")
    top.set_title("throughput (training steps only: no compilation, evaluation or checkpoint pauses)", fontsize=10)
    top.plot(*_series(records, "train", "tokens_per_s"), lw=1)
    top.set_ylabel("tokens / s")
    steps, mfu = _series(records, "train", "mfu")
    bottom.plot(steps, 100 * np.asarray(mfu), color="tab:orange", lw=1)
    peak = next((r for r in records if r.get("kind") in ("run", "resume") and r.get("peak_source")), None)
    bottom.set_ylabel("MFU (%)")
    bottom.set_xlabel("step" + (f"   (peak: {peak['peak_source']}, {peak['peak_flops'] / 1e12:.3g} TFLOP/s)"
                                if peak else ""))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_expert_load(records, path: Path) -> Path | None:
    rows = [(r["step"], r["expert_fraction"]) for r in records
            if r.get("kind") == "train" and r.get("expert_fraction") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _ in rows]
    load = np.asarray([f for _, f in rows], dtype=np.float64)       # [logs, layers, experts]
    load = load * load.shape[-1]                                      # 1.0 = an even share
    layers = load.shape[1]
    cols = min(layers, 4)
    rows = (layers + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1, 2.4 * rows + 0.6), dpi=120, squeeze=False,
                             layout="constrained")
    vmax = max(2.0, float(load.max()))
    for layer, ax in enumerate(axes.flat):
        if layer >= layers:
            ax.axis("off")
            continue
        image = ax.imshow(load[:, layer, :].T, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=vmax,
                          extent=(steps[0], steps[-1], -0.5, load.shape[-1] - 0.5), interpolation="nearest")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle("expert load (share of routed tokens x experts; 1 = even)", fontsize=10)
    fig.colorbar(image, ax=axes, shrink=0.9, label="load")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_preferences(records, path: Path) -> Path | None:
    """A DPO run's rewards (beta x log-ratio to the reference) and reward accuracy, train and held-out."""
    if not any(r.get("kind") == "train" and "rewards/margins" in r for r in records):
        return None
    plt, fig, ax = _figure("preference rewards", "reward (beta x log-ratio)")
    for key, color in (("rewards/chosen", "tab:green"), ("rewards/rejected", "tab:red"), ("rewards/margins", "tab:blue")):
        ax.plot(*_series(records, "train", key), color=color, label=key, lw=1)
        steps, val = _series(records, "eval", "val_" + key)
        if val:
            ax.plot(steps, val, "o--", color=color, label="held-out " + key.split("/")[1], lw=1)
    right = ax.twinx()
    right.plot(*_series(records, "train", "rewards/accuracies"), color="tab:gray", lw=1, label="accuracy")
    steps, val = _series(records, "eval", "val_rewards/accuracies")
    right.plot(steps, val, "s-", color="black", lw=1, label="held-out accuracy")
    right.set_ylabel("reward accuracy")
    right.set_ylim(0, 1.05)
    right.legend(loc="lower right")
    return _save(plt, fig, ax, path)


def plot_rewards(records, path: Path) -> Path:
    """An `rl` run's reward curve: the rollouts' mean reward (and std band), the held-out reward."""
    plt, fig, ax = _figure("reward", "mean reward")
    steps, mean = _series(records, "train", "reward")
    _, std = _series(records, "train", "reward_std")
    ax.plot(steps, mean, lw=1, label="rollouts")
    if std:
        ax.fill_between(steps, np.asarray(mean) - np.asarray(std), np.asarray(mean) + np.asarray(std), alpha=0.2)
    ax.plot(*_series(records, "eval", "eval_reward"), "o-", lw=1.5, label="held-out (greedy)")
    return _save(plt, fig, ax, path)


def plot_rl_terms(records, path: Path) -> Path:
    """An `rl` run's objective terms: clip fractions, KL, entropy, completion length, zero-std groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 6), dpi=120, sharex=True, layout="constrained")
    panels = ((axes[0, 0], "clip fractions", ("clip_ratio/low", "clip_ratio/high")),
              (axes[0, 1], "KL (k3) and entropy", ("kl", "entropy")),
              (axes[1, 0], "completion length", ("completion_length", "completion_length_max")),
              (axes[1, 1], "groups with equal rewards / truncated", ("frac_reward_zero_std", "truncated_share")))
    for ax, title, keys in panels:
        for key in keys:
            steps, values = _series(records, "train", key)
            if values:
                ax.plot(steps, values, lw=1, label=key)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write every plot of the run into RUN_DIR/plots; returns the files written."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{run_dir}: expected metrics.jsonl (a run directory of `torchlyra train`), found none")
    records = read_metrics(metrics)
    if not any(r.get("kind") == "train" for r in records):
        raise UserError(f"{metrics}: holds no training step yet")
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    if any(r.get("kind") == "train" and "reward" in r for r in records):       # an `rl` run
        return [plot_rewards(records, out / "rewards.png"), plot_rl_terms(records, out / "rl_terms.png"),
                plot_grad_norm(records, out / "grad_norm.png")]
    written = [plot_loss(records, out / "loss.png"), plot_lr(records, out / "lr.png"),
               plot_grad_norm(records, out / "grad_norm.png"), plot_throughput(records, out / "throughput.png"),
               plot_expert_load(records, out / "expert_load.png"), plot_preferences(records, out / "preferences.png")]
    return [p for p in written if p is not None]


def plot_rl(run_dir: str | Path) -> list[Path]:
    """The plots of an `rl` run (plot_run recognises one by its reward records)."""
    return plot_run(run_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory written by `torchlyra train` (holds metrics.jsonl)")


def run(args) -> int:
    for path in plot_run(args.run_dir):
        print(path)
    return 0
