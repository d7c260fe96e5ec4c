"""Where a train step's compile time goes: the 2-layer `tiny` step (batch 2 x 64), traced, lowered
and compiled by its first call, with JAX's own compile events summed (jax.monitoring), then its
run time per step. Settings come from the environment, to compare the test suite's
(tests/conftest.py) against others:

    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" \\
      python scripts/compile_time.py --kernels pallas [--optimizer adamw] [--gc-threshold 50000,50,100]

`--compare-walks N`: instead, lower the step (trace + lower, no compile) N times with torchax's
argument walks as jax_bridge/torchax_pytree.py does them and N times with torch's pytree,
interleaved, and print the medians side by side.
"""
import argparse
import collections
import gc
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "tracing", "/jax/core/compile/jaxpr_to_mlir_module_duration":
          "lowering", "/jax/core/compile/backend_compile_duration": "XLA compile"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="xla", help="a kernel set, e.g. xla or pallas")
    parser.add_argument("--optimizer", default="muon", choices=("muon", "adamw"),
                        help="the step's optimizer (default: muon; adamw: AdamW for every parameter)")
    parser.add_argument("--gc-threshold", default="", help="gc.set_threshold values, e.g. 50000,50,100")
    parser.add_argument("--compare-walks", type=int, default=0, metavar="N",
                        help="lower N times with each of torchax's argument walks (ours, torch's) instead")
    args = parser.parse_args()
    if args.gc_threshold:
        gc.set_threshold(*map(int, args.gc_threshold.split(",")))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    import torch

    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    from torch_model.optim import OptimizerConfig

    seconds = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: seconds.update({EVENTS[event]: duration}) if event in EVENTS else None)
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(n_layers=2, sliding_window=16, max_seq_len=64)
    step = TrainStep(GptOssForCausalLM(cfg), OptimizerConfig(optimizer=args.optimizer),
                     StepConfig(kernels=args.kernels))
    state = step.init_state()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 2, 65)).astype(np.int32)
    if args.compare_walks:
        compare_walks(lambda: TrainStep(step.model, step.opt_cfg, step.cfg), state, tokens, args.compare_walks)
        return
    start = time.perf_counter()
    state, metrics = step(state, tokens, 1.0)
    float(metrics["loss"])
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(3):
        state, metrics = step(state, tokens, 1.0)
    loss = float(metrics["loss"])
    per_step = (time.perf_counter() - start) / 3
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"kernels {args.kernels}, optimizer {args.optimizer}, XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r}, gc {gc.get_threshold()}: "
          f"first step {first:.1f} s (" + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items())
          + f"), then {per_step * 1e3:.0f} ms/step, loss {loss:.6f}; process CPU {usage.ru_utime + usage.ru_stime:.1f} s")


def compare_walks(make_step, state, tokens, rounds: int) -> None:
    """Median seconds to lower the step with each of torchax's argument walks, interleaved (a new
    TrainStep each time: a step lowers once, then its jit caches the trace)."""
    import statistics

    import torch.utils._pytree as torch_pytree
    import torchax.tensor

    walks = {"ours": torchax.tensor.torch_pytree, "torch's": torch_pytree}
    make_step().lower(state, tokens)        # the first lowering pays one-time costs (imports, caches)
    times = {name: [] for name in walks}
    for _ in range(rounds):
        for name, module in walks.items():
            torchax.tensor.torch_pytree = module
            step = make_step()
            start = time.perf_counter()
            step.lower(state, tokens)
            times[name].append(time.perf_counter() - start)
    torchax.tensor.torch_pytree = walks["ours"]
    ours, torchs = (statistics.median(times[name]) for name in walks)
    print(f"lowering the step, median of {rounds}: ours {ours:.3f} s, torch's pytree {torchs:.3f} s, "
          f"ratio {torchs / ours:.2f}x")


if __name__ == "__main__":
    main()
