#!/usr/bin/env python3
"""Where a decode step's time goes on the chip: `torchlyra generate`'s decode program (one model,
random weights, bf16) timed at several batch sizes and sampling modes, then traced once per batch
by `generate --profile`'s DecodeProfiler (train/generation/cli.py), whose profile summary
(train/run/profile_summary.py) sums the device ops by the roofline's categories, measured beside
predicted, per decode step. The ops' times overlap (asynchronous weight prefetches run beside the
compute): their sum exceeds the step's wall time; read the shares.

    python scripts/decode_profile.py [MODEL ...]    MODEL: a preset (tiny, small-o200k, ...) or a
                                                    transformers config JSON (docs/models/*.json)
    DECODE_BATCHES=1,8,64 DECODE_NEW=128 DECODE_KERNELS=auto  (environment, defaults shown)

Writes $OUT/decode_profile_<model>.json (OUT defaults to /tmp) and prints a table per model.
On a CPU host the timings run and the profile is skipped (no device ops to read).
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(*a):
    print(*a, flush=True)


def build(name):
    import torch

    torch.manual_seed(0)
    if name.endswith(".json"):
        from torch_model.transformers_lm import TransformersSpec
        return TransformersSpec.from_file(name).build().eval()
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    return GptOssForCausalLM(get_preset(name)).eval()


def prompts_for(cfg, batch, length=32):
    import numpy as np
    return np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, length)).tolist()


def timed(gen, cfg, batch, new, sampling, stream=None, repeats=3):
    from train.generation.sampling import SamplingConfig
    s = SamplingConfig(max_new_tokens=new, **sampling)
    kw = dict(on_tokens=lambda n: None, stream_every=stream) if stream else {}
    prompts = prompts_for(cfg, batch)
    first = gen.generate(prompts, s, **kw)
    runs = [gen.generate(prompts, s, **kw) for _ in range(repeats)]
    ms = statistics.median(r.decode_seconds / r.decode_steps * 1e3 for r in runs)
    return dict(batch=batch, new=new, sampling=sampling, stream=stream, ms_per_step=round(ms, 4),
                tokens_per_s=round(batch * 1e3 / ms, 1), ttft_ms=round(statistics.median(r.prefill_seconds * 1e3
                                                                                        for r in runs), 2),
                compile_s=[(c.program, round(c.seconds, 1)) for c in first.compilations], bucket=list(first.bucket))


def profile(gen, cfg, batch, new):
    """The decode program's device time per roofline category, per step, measured beside
    predicted: `generate --profile`'s DecodeProfiler (train/generation/cli.py) and the profile
    summary (train/run/profile_summary.py)."""
    from train.generation.cli import DecodeProfiler
    from train.generation.sampling import SamplingConfig

    s = SamplingConfig(max_new_tokens=new, temperature=0)
    prompts = prompts_for(cfg, batch)
    gen.generate(prompts, s)
    profiler = DecodeProfiler(f"/tmp/decode_trace_{os.getpid()}_{batch}")
    result = gen.generate(prompts, s)
    summary = profiler.finish(gen, result, s)
    return dict(steps=result.decode_steps, wall_ms_per_step=result.decode_seconds / result.decode_steps * 1e3,
                device_ops_us_per_step=summary["per_step_ms"]["ops"] * 1e3,
                other_programs=summary["other_programs"],
                categories={r["row"]: dict(measured_us=round(r["measured_ms"] * 1e3, 2), events=r["events_per_step"],
                                           predicted_us=None if r["predicted_ms"] is None
                                           else round(r["predicted_ms"] * 1e3, 2)) for r in summary["rows"]},
                top_ops=[dict(us_per_step=round(o["measured_ms"] * 1e3, 2), per_step=o["events_per_step"],
                              name=o["name"], category=o["row"]) for o in summary["top"]])


def main(names):
    import jax

    from train.generation.generator import Generator

    out_dir = os.environ.get("OUT", "/tmp")
    batches = [int(b) for b in os.environ.get("DECODE_BATCHES", "1,8,64").split(",")]
    new = int(os.environ.get("DECODE_NEW", "128"))
    kernels = os.environ.get("DECODE_KERNELS", "auto")
    on_tpu = jax.devices()[0].platform == "tpu"
    for name in names:
        started = time.time()
        model = build(name)
        log(f"== {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, built in "
            f"{time.time() - started:.1f} s; kernels {kernels}")
        gen = Generator(model, kernels=kernels)
        weight_bytes = sum(a.nbytes for a in gen.decoder.params.values())
        rows = []
        cases = [(b, dict(temperature=0), None) for b in batches]
        cases[1:1] = [(1, dict(temperature=0), 8), (1, dict(temperature=0.8, top_k=40), 8)]
        for batch, sampling, stream in cases:
            try:
                row = timed(gen, model.cfg, batch, new, sampling, stream)
            except Exception as e:  # noqa: BLE001 - a failed case is a result
                row = dict(batch=batch, sampling=sampling, stream=stream, error=str(e).splitlines()[0][:300])
            log("  ", json.dumps(row))
            rows.append(row)
        report = dict(model=name, kernels=dict(gen.decoder.decode_kernels), weight_bytes=weight_bytes,
                      platform=jax.devices()[0].platform, rows=rows, profiles={})
        if on_tpu:
            for batch in batches:
                try:
                    p = profile(gen, model.cfg, batch, new)
                except Exception as e:  # noqa: BLE001
                    p = dict(error=repr(e)[:300])
                report["profiles"][batch] = p
                log(f"  profile batch {batch}: " + json.dumps({k: v for k, v in (p or {}).items() if k != 'top_ops'}))
                for t in (p or {}).get("top_ops", [])[:25]:
                    log(f"     {t['us_per_step']:9.2f} us x{t['per_step']:5.1f}  {t['category']:24} {t['name']}")
        tag = Path(name).stem
        with open(f"{out_dir}/decode_profile_{tag}.json", "w") as f:
            json.dump(report, f, indent=1)
        del gen, model


if __name__ == "__main__":
    main(sys.argv[1:] or ["docs/models/llama-570m.json"])
