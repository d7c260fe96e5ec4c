"""Where a train step's compile time goes: the 2-layer `tiny` step (batch 2 x 64), traced, lowered
and compiled by its first call, with JAX's own compile events summed (jax.monitoring), then its
run time per step. Settings come from the environment, to compare the test suite's
(tests/conftest.py) against others:

    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" \\
      python scripts/compile_time.py --kernels pallas [--gc-threshold 50000,50,100]
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
    parser.add_argument("--gc-threshold", default="", help="gc.set_threshold values, e.g. 50000,50,100")
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

    seconds = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: seconds.update({EVENTS[event]: duration}) if event in EVENTS else None)
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(n_layers=2, sliding_window=16, max_seq_len=64)
    step = TrainStep(GptOssForCausalLM(cfg), step_cfg=StepConfig(kernels=args.kernels))
    state = step.init_state()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 2, 65)).astype(np.int32)
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
    print(f"kernels {args.kernels}, XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r}, gc {gc.get_threshold()}: "
          f"first step {first:.1f} s (" + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items())
          + f"), then {per_step * 1e3:.0f} ms/step, loss {loss:.6f}; process CPU {usage.ru_utime + usage.ru_stime:.1f} s")


if __name__ == "__main__":
    main()
