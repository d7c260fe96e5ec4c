#!/usr/bin/env python3
"""Where a decode step's time goes on the chip: `torchlyra generate`'s decode program (one model,
random weights, bf16) timed at several batch sizes and sampling modes, then traced once with
jax.profiler and its device ops summed by the roofline's categories (jax_bridge/roofline.py),
measured beside predicted. Reads the trace with jax's own ProfileData: no xprof needed. The ops'
times overlap (asynchronous weight prefetches run beside the compute): their sum exceeds the
step's wall time; read the shares.

    python scripts/decode_profile.py [MODEL ...]    MODEL: a preset (tiny, small-o200k, ...) or a
                                                    transformers config JSON (docs/models/*.json)
    DECODE_BATCHES=1,8,64 DECODE_NEW=128 DECODE_KERNELS=auto  (environment, defaults shown)

Writes $OUT/decode_profile_<model>.json (OUT defaults to /tmp) and prints a table per model.
On a CPU host the timings run and the profile is skipped (no device ops to read).
"""
import glob
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


def device_ops(trace_dir):
    """{op name: [total ns, count]} of the traced programs' device ops (control ops, which span
    their bodies' ops, left out), and each program run's (module, ns): the trace read by
    train/run/profile_summary.py's reader."""
    from jax_bridge import roofline
    from train.run.profile_summary import read_trace

    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    _, _, runs, _ = read_trace(Path(path))
    ops = {}
    for run in runs:
        for e in run.ops:
            if e.signature and e.signature[0] in roofline.CONTROL:
                continue
            t = ops.setdefault(e.name, [0, 0])
            t[0] += e.duration_ns
            t[1] += 1
    return ops, [(run.module, run.duration_ns) for run in runs]


def profile(gen, cfg, batch, new, generation):
    """Measured device time per roofline category of the decode program, per step."""
    import jax

    from jax_bridge import roofline
    from train.generation.sampling import SamplingConfig

    s = SamplingConfig(max_new_tokens=new, temperature=0)
    prompts = prompts_for(cfg, batch)
    gen.generate(prompts, s)
    trace = f"/tmp/decode_trace_{os.getpid()}_{batch}"
    jax.profiler.start_trace(trace)
    result = gen.generate(prompts, s)
    jax.profiler.stop_trace()
    ops, modules = device_ops(trace)
    if not ops:
        return None
    (bucket, program), = [(b, p) for b, p in gen.decoder.decode_programs().items() if b[0] == result.bucket[0]
                          and b[1] == result.bucket[2] and not b[2].top_k][:1]
    text = roofline.module_text(program)
    hlo_ops, _, _ = roofline.collect_ops(text, roofline.xla_cost_fn())
    by_name = {o.name: o for o in hlo_ops}
    peak, bandwidth = roofline.device_peaks(generation)
    steps = result.decode_steps
    rows = {}
    for name, (ns, count) in ops.items():
        op = by_name.get(name)
        category = op.category if op else "not in the decode program"
        row = rows.setdefault(category, dict(measured_us=0.0, events=0, predicted_us=0.0))
        row["measured_us"] += ns / 1e3 / steps
        row["events"] += count / steps
    for op in hlo_ops:
        if op.name in ops:
            seconds, _ = roofline.op_seconds(op, peak, bandwidth)
            rows[op.category]["predicted_us"] += seconds * 1e6 * op.trips
    top = sorted(((ns / steps / 1e3, count / steps, name, by_name[name].category if name in by_name else "-")
                  for name, (ns, count) in ops.items()), reverse=True)[:40]
    return dict(steps=steps, wall_ms_per_step=result.decode_seconds / steps * 1e3,
                device_ops_us_per_step=sum(ns for ns, _ in ops.values()) / steps / 1e3,
                modules_ms=[(name, round(ns / 1e6, 3)) for name, ns in modules][:20],
                categories={k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in rows.items()},
                top_ops=[dict(us_per_step=round(a, 2), per_step=round(b, 2), name=c, category=d) for a, b, c, d in top])


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
                    p = profile(gen, model.cfg, batch, new, "v5e")
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
