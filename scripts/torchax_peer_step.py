#!/usr/bin/env python3
"""Our train step beside the torchax-documented peer, one transformers decoder or one module of your
own, one batch, one run.

    python scripts/torchax_peer_step.py --model-config docs/models/llama-570m.json --batch-size 2 \
        --seq-len 2048 [--steps 12] [--remat none|full|save-matmuls] [--micro-batches 1] [--kernels auto] [--ns-dtype float32] [--json OUT]
    python scripts/torchax_peer_step.py --module examples/gpt.py:GPT --module-args '{"dim": 2048, ...}' ...

  A --module is taken as `train --module` takes it (ours) and as a user's own torchax step would
  (peer: `torchax.extract_jax` of the module itself, its SDPA calls through torchax's own lowering).

  ours  `train --model-config`'s step (jax_bridge.step.TrainStep): float32 master weights, bf16
        compute on an accelerator, Muon + AdamW, the op registry's kernels, scanned layers, remat.
  peer  what torchax's documentation does: `torchax.extract_jax(model)` of transformers' own
        module (attention `sdpa`, which torchax lowers to XLA), parameters and compute in bf16 on an
        accelerator (float32 on CPU), `optax.adamw`, loss and update in ONE `jax.jit` (state donated).
Both take the same token batch (random ids, next-token loss over every position) per optimizer
step; ours may split it into `--micro-batches` (gradient accumulation, as `train --micro-batches`),
the peer takes it whole. Each is timed
over `--steps` calls after two warm-up calls (median seconds per step, after block_until_ready);
tokens/s and the ratio ours / peer are printed, with the compile (first call) seconds apart, and
our optimizer's update timed alone (Muon's Newton-Schulz costs the same at any batch). A
contender that does not fit the device is reported as such, the other still timed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(call, steps: int) -> tuple[float, float]:
    """(first call's seconds: compile + run, median seconds of `steps` later calls)."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(call())
    first = time.perf_counter() - start
    jax.block_until_ready(call())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def ours(spec, tokens, args):
    import jax.numpy as jnp

    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.optim import OptimizerConfig

    if hasattr(spec, "facts"):
        from formats.model_checks import build_module_model

        model = build_module_model(spec, new_run=True)
    else:
        model = spec.build()
    step = TrainStep(model, OptimizerConfig(ns_dtype=args.ns_dtype), StepConfig(kernels=args.kernels, remat=args.remat,
                                                            micro_batches=args.micro_batches))
    box = {"state": step.init_state()}
    if len(tokens) % args.micro_batches:
        raise SystemExit(f"--batch-size {len(tokens)} is not a multiple of --micro-batches {args.micro_batches}")
    batch = tokens.reshape(args.micro_batches, len(tokens) // args.micro_batches, tokens.shape[1])

    def call():
        box["state"], metrics = step(box["state"], batch)
        return metrics["loss"]
    timing = timed(call, args.steps)

    # The optimizer's update alone (Muon + AdamW, as jitted inside the step), on gradients of the
    # parameters' shapes: its cost per step does not depend on the batch, the peer's AdamW is small.
    import jax

    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), box["state"].params)
    live = {"params": box["state"].params, "opt": box["state"].opt_state}

    def update():
        live["params"], live["opt"], _ = step.apply_update(live["params"], grads, live["opt"])
        return live["params"]
    return timing, timed(update, args.steps)[1], jnp.dtype(step.compute_dtype).name


def peer(spec, tokens, args, dtype):
    import jax
    import jax.numpy as jnp
    import optax
    import torch
    from transformers import AutoModelForCausalLM

    from jax_bridge.torchax_compat import import_torchax

    torchax = import_torchax()      # the project's torch 2.13 shim first (a bare `import torchax` fails)

    if hasattr(spec, "facts"):      # a module of your own, as it is
        from jax_bridge import module_ops
        from jax_bridge.env import get_env
        from torch_model.module_lm import instantiate

        with module_ops.torchax_own_sdpa(get_env()):
            return _module_peer(torchax, instantiate(spec.spec, spec.args), tokens, args, dtype)
    config = spec.hf_config()
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if dtype == jnp.bfloat16
                                             else torch.float32)
    model.config.use_cache = False
    return _step(torchax, model, lambda out: out.logits, tokens, args)


def _module_peer(torchax, module, tokens, args, dtype):
    import jax.numpy as jnp
    import torch

    module = module.to(torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32)
    return _step(torchax, module, _logits_array, tokens, args)


def _logits_array(out):
    """The logits of an extracted forward's output (JAX arrays): the output itself, its first
    element, or its `.logits`."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _step(torchax, model, logits_of, tokens, args):
    """torchax's documented train step of `model`: its forward extracted as a JAX function, optax
    AdamW, loss and update in one jit, the state donated; timed."""
    import jax
    import jax.numpy as jnp
    import optax

    states, forward = torchax.extract_jax(model)
    params = {n: p for n, p in states.items() if n in dict(model.named_parameters())}
    buffers = {n: b for n, b in states.items() if n not in params}
    optimizer = optax.adamw(3e-4, weight_decay=0.0)
    ids, labels = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])

    def loss_fn(params):
        logits = logits_of(forward({**params, **buffers}, (ids,)))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    @jax.jit
    def train_step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(train_step.__wrapped__, donate_argnums=(0, 1))
    box = {"params": params, "opt": optimizer.init(params)}

    def call():
        box["params"], box["opt"], loss = train_step(box["params"], box["opt"])
        return loss
    return timed(call, args.steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-config", help="a transformers config.json")
    source.add_argument("--module", metavar="SPEC", help="your own nn.Module, as `train --module` takes it")
    parser.add_argument("--module-args", default="{}", help="with --module: its keyword arguments, a JSON object")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--micro-batches", type=int, default=1, help="ours only: the batch in this many parts")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--ns-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="ours only: Muon's Newton-Schulz dtype (as `train --ns-dtype`)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from torch_model.transformers_lm import TransformersSpec

    if args.module:
        from formats.model_checks import module_record

        spec = module_record(args.module, json.loads(args.module_args), args.seq_len)
    else:
        spec = TransformersSpec.from_file(args.model_config)
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, (args.batch_size, args.seq_len + 1),
                                               dtype=np.int32)
    n_tokens = args.batch_size * args.seq_len
    rows = {}
    try:
        (first, seconds), update_s, compute = ours(spec, tokens, args)
        rows["ours"] = dict(compile_s=first, step_s=seconds, tokens_per_s=n_tokens / seconds, compute=compute,
                            update_s=update_s)
        print(f"ours: {seconds * 1e3:.1f} ms/step (first call {first:.1f} s), of which the optimizer's update alone "
              f"{update_s * 1e3:.1f} ms; the peer next", flush=True)
    except Exception as e:  # noqa: BLE001 - a contender that does not fit is reported, the other still timed
        rows["ours"] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        compute = "bfloat16" if jax.default_backend() != "cpu" else "float32"
    jax.clear_caches()
    try:
        first, seconds = peer(spec, tokens, args, jnp.bfloat16 if compute == "bfloat16" else jnp.float32)
        rows["peer"] = dict(compile_s=first, step_s=seconds, tokens_per_s=n_tokens / seconds, compute=compute)
    except Exception as e:  # noqa: BLE001
        rows["peer"] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    print(f"{args.model_config or args.module}, batch {args.batch_size} x {args.seq_len}, remat {args.remat} and "
          f"{args.micro_batches} micro-batches (ours), "
          f"kernels {args.kernels} (ours), on {jax.devices()[0].device_kind}")
    for name, row in rows.items():
        if "error" in row:
            print(f"  {name:5s} ERROR {row['error']}")
        else:
            print(f"  {name:5s} {row['step_s'] * 1e3:9.1f} ms/step  {row['tokens_per_s']:10,.0f} tokens/s  "
                  f"(first call {row['compile_s']:.1f} s, {row['compute']})")
            if "update_s" in row:
                print(f"        of which the optimizer's update alone {row['update_s'] * 1e3:.1f} ms "
                      f"(Muon, Newton-Schulz in {args.ns_dtype}, and AdamW)")
    if all("step_s" in r for r in rows.values()):
        rows["ours_over_peer"] = rows["peer"]["step_s"] / rows["ours"]["step_s"]
        print(f"  ours / peer tokens/s: {rows['ours_over_peer']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), device=jax.devices()[0].device_kind, **rows),
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
