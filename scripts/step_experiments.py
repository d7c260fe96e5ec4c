#!/usr/bin/env python3
"""Where the lowered train step spends its time: the experiments behind BENCHMARKS.md's log of
attempts (issue 12). Each prints medians of interleaved rounds and per-round ratios.

    python scripts/step_experiments.py cost PRESET            # XLA's FLOPs/bytes per program vs model FLOPs
    python scripts/step_experiments.py step PRESET [ROUNDS]   # step vs fwd+bwd + update; no-scan / no-select variants
    python scripts/step_experiments.py ns PRESET [ROUNDS]     # Newton-Schulz: per matrix / stacked / experts unbatched
    python scripts/step_experiments.py block_m PRESET [ROUNDS] # MoE xla tile rows (moe.xla.block_m)
    python scripts/step_experiments.py compile PRESET [REPEATS] # the step's trace+lower and compile, wall and CPU s

Batch 8 x 256, float32, on this host's CPU. Not a test and not the benchmark (that is
`torchlyra bench step`): a variant here is a monkeypatch, never a code path of the library.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import torch_model.optim as optim  # noqa: E402
from jax_bridge.step import StepConfig, TrainStep, TrainState, _scalar_metrics  # noqa: E402
from torch_model.config import get_preset  # noqa: E402
from torch_model.model import GptOssForCausalLM  # noqa: E402
from train import flops  # noqa: E402
from train.bench_torch import bench_tokens  # noqa: E402

BATCH, SEQ = 8, 256


def setup(preset: str):
    cfg = get_preset(preset)
    model = GptOssForCausalLM(cfg)
    model.reset_parameters(0)
    return cfg, model, jnp.asarray(bench_tokens(cfg.vocab_size, BATCH, SEQ, 0)[None])


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def report(times: dict, base: str):
    print({k: f"{statistics.median(v) * 1e3:.1f} ms" for k, v in times.items()}, "load", os.getloadavg())
    for k, v in times.items():
        if k != base:
            print(f"  {k} / {base}: {statistics.median(a / b for a, b in zip(v, times[base])):.3f} (per-round median)")


def cost(preset: str):
    cfg, model, tokens = setup(preset)
    ts = TrainStep(model, step_cfg=StepConfig())
    state = ts.init_state()
    programs = {"fwdbwd": ts._jitted_grads.lower(state.params, tokens[0]),
                "update": ts._jitted_update.lower(state.params, state.params, state.opt_state, jnp.float32(1)),
                "step": ts.lower(state, tokens)}
    print(f"model FLOPs of fwd+bwd (train/flops.py): {flops.flops_per_token(cfg, SEQ) * BATCH * SEQ / 1e9:.1f} G")
    for name, lowered in programs.items():
        analysis = lowered.compile().cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        print(f"{name}: XLA FLOPs {analysis.get('flops', 0) / 1e9:.1f} G, bytes accessed "
              f"{analysis.get('bytes accessed', 0) / 1e9:.2f} GB")


def _step_without_scan(ts, state, tokens, lr_scale, select=True):
    (_, out), grads = ts._grads(state.params, tokens[0])
    params, opt_state, stats = ts._update(state.params, grads, state.opt_state, lr_scale)
    metrics = _scalar_metrics(out)
    new = TrainState(params, opt_state)
    if select:
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(stats["grad_norm"])
        new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
    return new, metrics


def step(preset: str, rounds: int):
    cfg, model, tokens = setup(preset)
    runs = {}
    for variant in ("step", "step_no_scan", "step_no_scan_no_select"):
        ts = TrainStep(model, step_cfg=StepConfig())
        if variant != "step":
            select = variant == "step_no_scan"
            ts._jitted = jax.jit(lambda s, t, l, ts=ts, select=select: _step_without_scan(ts, s, t, l, select),
                                 donate_argnums=(0,))
        runs[variant] = [ts, ts.init_state()]
        runs[variant][1], _ = ts(runs[variant][1], tokens)
    ts = runs["step"][0]
    params, update_state = ts.init_state().params, ts.init_state()
    _, grads = ts.grads(params, tokens[0])
    times = {k: [] for k in ("fwdbwd", "update", *runs)}
    for _ in range(rounds):
        times["fwdbwd"].append(timed(lambda: ts.grads(params, tokens[0])))
        start = time.perf_counter()
        p, o, _ = ts.apply_update(update_state.params, grads, update_state.opt_state)
        jax.block_until_ready((p, o))
        times["update"].append(time.perf_counter() - start)
        update_state = TrainState(p, o)
        for name, run in runs.items():
            start = time.perf_counter()
            run[1], metrics = run[0](run[1], tokens)
            jax.block_until_ready((run[1], metrics))
            times[name].append(time.perf_counter() - start)
    report(times, "fwdbwd")
    for k in runs:
        ratios = [s / (f + u) for s, f, u in zip(times[k], times["fwdbwd"], times["update"])]
        print(f"  {k} / (fwd+bwd + update): {statistics.median(ratios):.3f}")


NEWTON_SCHULZ = optim.newton_schulz     # the library's, kept before any patching


def _per_matrix(updates, steps, coeffs, eps, dtype):
    return {n: NEWTON_SCHULZ(u, steps, coeffs, eps, dtype) for n, u in updates.items()}


def _stacked(updates, steps, coeffs, eps, dtype):
    """Same-shaped matrices (a projection over all layers) stacked into one batch."""
    groups = {}
    for n, u in updates.items():
        groups.setdefault(tuple(u.shape), []).append(n)
    out = {}
    for names in groups.values():
        ortho = NEWTON_SCHULZ(torch.stack([updates[n] for n in names]), steps, coeffs, eps, dtype)
        out.update(zip(names, ortho.unbind(0)))
    return out


def _experts_unbatched(updates, steps, coeffs, eps, dtype):
    """Each expert's matrix as its own 2-D problem instead of one [E, ...] batch."""
    return {n: NEWTON_SCHULZ(u, steps, coeffs, eps, dtype) if u.dim() == 2 else
            torch.stack([NEWTON_SCHULZ(x, steps, coeffs, eps, dtype) for x in u.unbind(0)])
            for n, u in updates.items()}


def _update_with(ts, orthogonalize):
    """ts.update with Newton-Schulz done by `orthogonalize` over all Muon updates at once: a first
    trace of muon_adamw_update records its newton_schulz inputs (that pass is dead code to XLA), a
    second one takes their orthogonalized values in the same order."""
    from jax_bridge.env import get_env

    env, plan, cfg = get_env(), ts.plan, ts.opt_cfg

    def update(params, grads, state, lr_scale):
        args = env.j2t_iso((params, grads, state, lr_scale))
        recorded = []
        try:
            with env:
                optim.newton_schulz = lambda u, *rest: recorded.append((u, rest)) or torch.zeros_like(u)
                optim.muon_adamw_update(*args[:3], plan, cfg, args[3])
                names = [n for n in args[0] if plan[n].kind == optim.MUON]
                ortho = orthogonalize({n: u for n, (u, _) in zip(names, recorded)}, *recorded[0][1])
                queue = [ortho[n] for n in names]
                optim.newton_schulz = lambda u, *rest: queue.pop(0)
                out = optim.muon_adamw_update(*args[:3], plan, cfg, args[3])
        finally:
            optim.newton_schulz = NEWTON_SCHULZ
        return env.t2j_iso(out)

    return update


def ns(preset: str, rounds: int):
    """The update alone with Newton-Schulz batched three ways."""
    cfg, model, tokens = setup(preset)
    runs, grads = {}, None
    for name, fn in (("per_matrix", _per_matrix), ("stacked", _stacked), ("experts_unbatched", _experts_unbatched)):
        ts = TrainStep(model, step_cfg=StepConfig())
        state = ts.init_state()
        if grads is None:
            _, grads = ts.grads(state.params, tokens[0])
        ts.update = _update_with(ts, fn)
        start = time.perf_counter()
        p, o, _ = ts.apply_update(state.params, grads, state.opt_state)
        jax.block_until_ready(p)
        print(f"{name}: first update call (trace + compile) {time.perf_counter() - start:.1f} s", flush=True)
        runs[name] = [ts, TrainState(p, o)]
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            start = time.perf_counter()
            p, o, _ = run[0].apply_update(run[1].params, grads, run[1].opt_state)
            jax.block_until_ready((p, o))
            times[k].append(time.perf_counter() - start)
            run[1] = TrainState(p, o)
    report(times, "per_matrix")
    first = runs["per_matrix"][1].params
    for k in ("stacked", "experts_unbatched"):
        diff = max(float(jnp.max(jnp.abs(first[n] - runs[k][1].params[n])) / (jnp.max(jnp.abs(first[n])) + 1e-30))
                   for n in first)
        print(f"  {k}: largest relative difference of the parameters from per_matrix: {diff:.1e}")


def compile_time(preset: str, repeats: int):
    """Trace+lower and XLA compile of the full step, wall and CPU seconds of this process (the
    compile runs mostly on one thread, so on a loaded host its CPU time is what a quiet host's wall
    time would be, roughly)."""
    _, model, tokens = setup(preset)
    for _ in range(repeats):
        jax.clear_caches()
        ts = TrainStep(model, step_cfg=StepConfig())
        state = ts.init_state()
        wall, cpu = time.perf_counter(), time.process_time()
        lowered = ts.lower(state, tokens)
        wall_l, cpu_l = time.perf_counter() - wall, time.process_time() - cpu
        wall, cpu = time.perf_counter(), time.process_time()
        lowered.compile()
        wall_c, cpu_c = time.perf_counter() - wall, time.process_time() - cpu
        print(f"lower {wall_l:.1f} s wall / {cpu_l:.1f} s CPU; compile {wall_c:.1f} s wall / {cpu_c:.1f} s CPU; "
              f"total {wall_l + wall_c:.1f} s wall / {cpu_l + cpu_c:.1f} s CPU; load {os.getloadavg()}", flush=True)


def block_m(preset: str, rounds: int):
    cfg, model, tokens = setup(preset)
    runs = {}
    for opts in (None, "moe.xla.block_m=64", "moe.xla.block_m=256", "moe.xla.block_m=512"):
        ts = TrainStep(model, step_cfg=StepConfig(kernel_options=opts))
        state = ts.init_state()
        jax.block_until_ready(ts.grads(state.params, tokens[0]))
        runs[opts or "default"] = (ts, state)
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, (ts, state) in runs.items():
            times[k].append(timed(lambda: ts.grads(state.params, tokens[0])))
    report(times, "default")


if __name__ == "__main__":
    what, preset = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    {"cost": lambda: cost(preset), "step": lambda: step(preset, n), "ns": lambda: ns(preset, n),
     "block_m": lambda: block_m(preset, n), "compile": lambda: compile_time(preset, n)}[what]()
