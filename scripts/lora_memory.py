"""Train-state bytes of LoRA vs full fine-tuning on a preset: trainable parameters (float32 master
weights), their gradients, the optimizer state and the frozen base, summed over the step's own
state trees (abstract: no weights; the gradients are the traced step's `jax.eval_shape`).

    PYTHONPATH=$PWD python scripts/lora_memory.py --preset small --lora r=16,alpha=32,targets=all-linear+experts
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def tree_bytes(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def measure(preset: str, lora: str, compute_dtype: str, seq_len: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.config import get_preset
    from torch_model.lora import apply_lora, parse_lora_spec
    from torch_model.model import GptOssForCausalLM
    from torch_model.optim import OptimizerConfig

    with torch.device("meta"):
        model = GptOssForCausalLM(get_preset(preset).replace(max_seq_len=seq_len))
        if lora:
            model = apply_lora(model, parse_lora_spec(lora))
    step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype=compute_dtype, platform="cpu"))
    state, frozen = step.abstract_state(), step.abstract_frozen()
    tokens = jax.ShapeDtypeStruct((1, seq_len + 1), jnp.int32)
    _, grads = jax.eval_shape(lambda p, t, f: step._grads(p, t, frozen=f), state.params, tokens, frozen)
    return {"preset": preset, "lora": lora or "full fine-tuning", "compute_dtype": compute_dtype,
            "trainable_parameters": sum(int(a.size) for a in jax.tree.leaves(state.params)),
            "frozen_parameters": sum(int(a.size) for a in jax.tree.leaves(frozen)),
            "trainable_bytes": tree_bytes(state.params), "gradient_bytes": tree_bytes(grads),
            "optimizer_bytes": tree_bytes(state.opt_state), "frozen_bytes": tree_bytes(frozen)}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--lora", action="append", default=None, help="LoRA spec(s) to compare (repeatable)")
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [measure(args.preset, spec, args.compute_dtype, args.seq_len)
            for spec in ["", *(args.lora or ["r=16,alpha=32,targets=all-linear+experts"])]]
    mib = lambda b: f"{b / 2**20:,.2f}"
    print("| run | trainable | frozen | params (f32) MiB | gradients MiB | optimizer MiB | frozen MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lora']} | {r['trainable_parameters']:,} | {r['frozen_parameters']:,} | {mib(r['trainable_bytes'])} "
              f"| {mib(r['gradient_bytes'])} | {mib(r['optimizer_bytes'])} | {mib(r['frozen_bytes'])} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
