"""Muon's Newton-Schulz in float32 against bfloat16, side by side in one run:

1. parity: the lowered step against eager PyTorch (the `xla` kernel set, float32 compute) with the
   same Newton-Schulz dtype on both sides: the verdict and the worst parameter after one step;
2. a short CPU training run of each (`torchlyra train`, same data, seed and steps): the losses.

    PYTHONPATH=$PWD python scripts/ns_dtype_compare.py --data data/shakespeare --steps 60 --out runs/ns
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def parity_rows() -> dict:
    from parity.inputs import parity_config
    from parity.runs import FAST_COMPILE
    from parity.suite import run_parity
    from torch_model import config
    from torch_model.optim import OptimizerConfig

    model_cfg = parity_config(config.get_preset("tiny").replace(n_layers=2))
    out = {}
    for dtype in DTYPES:
        report = run_parity(model_cfg, kernel_sets=["xla"], dtypes=("float32",), batch=2,
                            opt_cfg=OptimizerConfig(ns_dtype=dtype), compiler_options=FAST_COMPILE)
        params = [r for r in report.rows if r.category == "param"]
        worst = max(params, key=lambda r: r.metrics.get("rel", 0.0))
        out[dtype] = {"passed": report.passed, "worst_param": worst.name, "worst_param_rel": worst.metrics.get("rel"),
                      "all_parameters_rel": next(r.metrics.get("rel") for r in params if r.name == "<all parameters>")}
    return out


def training_losses(data: str, steps: int, out: Path) -> dict:
    from train.run.metrics import read_metrics

    losses = {}
    for dtype in DTYPES:
        run = out / f"ns-{dtype}"
        cmd = [sys.executable, "-m", "train.cli", "train", "--preset", "tiny", "--data", data, "--out", str(run),
               "--steps", str(steps), "--ns-dtype", dtype, "--eval-every", str(steps), "--samples", "0"]
        subprocess.run(cmd, check=True)
        records = read_metrics(run / "metrics.jsonl")
        losses[dtype] = {"train": [r["loss"] for r in records if r["kind"] == "train"],
                         "val": [r["val_loss"] for r in records if r["kind"] == "eval"],
                         "step_time_s": [r["step_time_s"] for r in records if r["kind"] == "train"][-1]}
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/ns")
    args = parser.parse_args()
    rows = parity_rows()
    losses = training_losses(args.data, args.steps, Path(args.out))
    print("\nparity (xla set, float32 compute), eager and lowered with the same Newton-Schulz dtype:")
    for dtype, r in rows.items():
        print(f"  {dtype:9s} {'PASS' if r['passed'] else 'FAIL'}; worst parameter after one step: {r['worst_param']} "
              f"rel {r['worst_param_rel']:.2e}; all parameters rel {r['all_parameters_rel']:.2e}")
    print(f"\ntraining `tiny`, {args.steps} steps (train loss at the log steps, validation at the start and end):")
    for dtype, r in losses.items():
        print(f"  {dtype:9s} train {' '.join(f'{x:.4f}' for x in r['train'])}; val {' -> '.join(f'{x:.4f}' for x in r['val'])}; "
              f"last logged step {r['step_time_s'] * 1e3:.0f} ms")
    f32, bf16 = losses["float32"], losses["bfloat16"]
    print(f"  final validation loss bfloat16 - float32: {bf16['val'][-1] - f32['val'][-1]:+.4f} nats/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
