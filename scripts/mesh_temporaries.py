"""Temporaries of compiled programs on a mesh of simulated CPU devices against one device
(BENCHMARKS "Host memory of each command"): what XLA:CPU holds beside the parameters.

    python scripts/mesh_temporaries.py step [--layers 2] [--dense] [--remat none] [--mesh fsdp=2] \\
        [--default-scheduler] [--run]
    python scripts/mesh_temporaries.py decode [--layers 4] [--mesh fsdp=2]

step: the LoRA train step (r=8, float32, scanned layers, kernels auto) of a model built on `meta`
with the small released directory's shapes (hidden 2880, 4 experts of width 2880, a 32000
vocabulary; --dense: an MLP of the same bytes instead), compiled only: temporaries and arguments
per device (`memory_analysis`) beside the frozen weights' bytes.
decode: greedy generation of a small random model (d_model 512, 4 experts); the decode loop's
temporaries per device and what it all-gathers once per call or per token (`decode_collectives`).
"""
import argparse
import math
import os
import sys

MiB = 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", choices=("step", "decode"))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: step 2, decode 4)")
    parser.add_argument("--dense", action="store_true", help="step: a dense MLP of the experts' bytes")
    parser.add_argument("--remat", default="none", help="step: none | full | save-matmuls")
    parser.add_argument("--mesh", default="fsdp=2", help="the mesh compared against one device")
    parser.add_argument("--run", action="store_true",
                        help="step: also run it twice on constant weights made on the devices, sampling this "
                             "process's RssAnon (the peak while it runs, and what stays held after)")
    parser.add_argument("--default-scheduler", action="store_true",
                        help="step: compile with XLA:CPU's default scheduler instead of the mesh's options "
                             "(jax_bridge.sharding.compiler_options)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jax_bridge import sharding

    for spec in ("none", args.mesh):
        # A mesh smaller than the 8 simulated devices takes the first ones (as tests/mesh_worker.py).
        mesh = None
        if spec != "none":
            size = math.prod(int(part.split("=")[1]) for part in spec.split(","))
            mesh = sharding.make_mesh(spec, devices=jax.devices()[:size])
        line = (step if args.program == "step" else decode)(args, mesh)
        print(f"{args.program}{' (dense)' if args.dense else ''}, remat {args.remat}, "
              f"{args.layers or (2 if args.program == 'step' else 4)} layers, mesh {spec}: {line}", flush=True)


def step(args, mesh) -> str:
    import numpy as np
    import torch

    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.config import get_preset
    from torch_model.lora import apply_lora, parse_lora_spec
    from torch_model.model import GptOssForCausalLM

    mlp = dict(n_experts=0, experts_per_token=0, dense_dim=4 * 2880) if args.dense else \
        dict(n_experts=4, experts_per_token=2, expert_dim=2880)
    cfg = get_preset("tiny").replace(n_layers=args.layers or 2, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64,
                                     vocab_size=32000, sliding_window=128, max_seq_len=256, **mlp)
    with torch.device("meta"):
        model = apply_lora(GptOssForCausalLM(cfg), parse_lora_spec("r=8,alpha=16"))
    train_step = TrainStep(model, step_cfg=StepConfig(scan_layers=True, compute_dtype="float32", remat=args.remat),
                           mesh=mesh)
    state = train_step.abstract_state()
    train_step.frozen = train_step.abstract_frozen()
    options = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_DEFAULT"} if args.default_scheduler else None
    tokens = np.zeros((1, 2, 65), np.int32)
    compiled = train_step.lower(state, tokens).compile(options)
    memory = compiled.memory_analysis()
    frozen = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in train_step.frozen.values())
    line = (f"temporaries {memory.temp_size_in_bytes / MiB:.1f} MiB, arguments "
            f"{memory.argument_size_in_bytes / MiB:.1f} MiB per device; frozen weights {frozen / MiB:.1f} MiB in all")
    return line + (run_step(train_step, compiled, state, tokens) if args.run else "")


def run_step(train_step, compiled, state, tokens) -> str:
    """RssAnon of this process (sampled every 5 ms) while the compiled step runs twice on
    constant weights made on their devices (no host copy), above what it held before."""
    import threading
    import time

    import jax
    import jax.numpy as jnp

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    def filled(a, value):
        return jax.jit(lambda: jnp.full(a.shape, value, a.dtype), out_shardings=a.sharding)()

    train_step.frozen = {n: filled(a, 0.01) for n, a in train_step.frozen.items()}
    state = jax.tree.map(lambda a: filled(a, 0), state)
    tokens = train_step.place_batch(tokens, 1)
    before, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for _ in range(2):
        state, metrics = compiled(state, tokens, jnp.float32(1.0), train_step.frozen)
        jax.block_until_ready(metrics)
    done.set()
    sampler.join()
    return (f"; running (this process, all its devices): peak {(peak[0] - before) / MiB:.0f} MiB above the weights, "
            f"{(rss() - before) / MiB:.0f} MiB still held after")


def decode(args, mesh) -> str:
    import torch

    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    from train.generation.generator import Generator
    from train.generation.sampling import SamplingConfig

    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(vocab_size=4096, d_model=512, n_layers=args.layers or 4, n_heads=8, n_kv_heads=2,
                                     head_dim=64, n_experts=4, expert_dim=1024, sliding_window=8, max_seq_len=64,
                                     bos_token_id=0, eos_token_id=0)
    model = GptOssForCausalLM(cfg).eval()
    generator = Generator(model, mesh=mesh)
    generator.generate([[1, 2, 3, 4, 5], [7, 8, 9]], SamplingConfig(max_new_tokens=8, temperature=0))
    moved = generator.decoder.decode_collectives()
    bucket, program = next(iter(generator.decoder.decode_programs().items()))
    temps = program.memory_analysis().temp_size_in_bytes
    params = sum(p.numel() * 4 for p in model.parameters())
    return (f"decode loop temporaries {temps / MiB:.1f} MiB per device, model {params / MiB:.1f} MiB in float32; "
            f"all-gathered {moved[bucket]['gathered_per_call'] / MiB:.1f} MiB per call, "
            f"{moved[bucket]['gathered_per_token'] / MiB:.1f} MiB per token")


if __name__ == "__main__":
    main()
