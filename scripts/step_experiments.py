#!/usr/bin/env python3
"""Where the lowered train step spends its time: the experiments behind BENCHMARKS.md's "What
was tried on the CPU step". Each prints medians of interleaved rounds and per-round ratios.

    python scripts/step_experiments.py cost PRESET            # XLA's FLOPs/bytes per program vs model FLOPs
    python scripts/step_experiments.py step PRESET [ROUNDS]   # step vs fwd+bwd + update; no-scan / no-select variants
    python scripts/step_experiments.py ns PRESET [ROUNDS]     # Newton-Schulz: per matrix / stacked / experts unbatched
    python scripts/step_experiments.py block_m PRESET [ROUNDS] # MoE xla tile rows (moe.xla.block_m)
    python scripts/step_experiments.py compile PRESET [REPEATS] # the step's trace+lower and compile, wall and CPU s
    python scripts/step_experiments.py kernels PRESET ROUNDS "SET;SET;..."  # fwd+bwd per kernel set
    python scripts/step_experiments.py ns_accuracy              # Newton-Schulz plain vs Gram form vs float64
    python scripts/step_experiments.py profile PRESET [CALLS] [KERNELS]   # fwd+bwd thunk time per model op

`profile` writes a jax.profiler trace of CALLS fwd+bwd calls and the compiled HLO under
/tmp/step_profile/PRESET; `scripts/xla_profile_summary.py` (reads the trace with jax.profiler's own
reader, nothing beyond the lock) sums XLA:CPU's per-thunk events by the model op that emitted them.

A kernel SET is a spec with optional options after ':' ("moe=loop:moe.loop.block_m=128"); besides the
registered implementations it may name this script's stand-ins, which only bound where time goes:
moe=ideal (every row through expert 0: a grouped GEMM with no overhead), attention=none,
cross_entropy=none (no [N, V] logits), attention=noconcat / attention=vjp (the sink folded into the
softmax without a concatenated column; the same with a written-out backward).

Batch 8 x 256, float32, on this host's CPU. Not a test and not the benchmark (that is
`torchlyra bench step`): a variant here is a monkeypatch, never a code path of the library.
"""
from __future__ import annotations

import functools
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
from train.run import flops  # noqa: E402
from train.bench.torch_peers import bench_tokens  # noqa: E402

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
    print(f"model FLOPs of fwd+bwd (train/run/flops.py): {flops.flops_per_token(cfg, SEQ) * BATCH * SEQ / 1e9:.1f} G")
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
    return new, {}, metrics


def step(preset: str, rounds: int):
    cfg, model, tokens = setup(preset)
    runs = {}
    for variant in ("step", "step_no_scan", "step_no_scan_no_select"):
        ts = TrainStep(model, step_cfg=StepConfig())
        if variant != "step":
            select = variant == "step_no_scan"
            # float32 steps: the compute copy is empty and passes through
            ts._jitted = jax.jit(lambda s, c, t, l, f, ts=ts, select=select: _step_without_scan(ts, s, t, l, select),
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
        ts = TrainStep(model, step_cfg=StepConfig(kernels="moe=xla", kernel_options=opts))
        state = ts.init_state()
        jax.block_until_ready(ts.grads(state.params, tokens[0]))
        runs[opts or "default"] = (ts, state)
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, (ts, state) in runs.items():
            times[k].append(timed(lambda: ts.grads(state.params, tokens[0])))
    report(times, "default")


# ---- stand-ins for `kernels` (bounds and variants, never library code paths) -------------------
def _moe_ideal(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha=1.702, limit=7.0):
    """Every row through expert 0: the FLOPs of a perfect grouped GEMM, with none of its overhead."""
    from pallas_kernels.moe import clamped_swiglu

    h = clamped_swiglu(jnp.dot(x, gate_up[0], precision="highest") + gate_up_bias[0], alpha=alpha, limit=limit)
    return jnp.dot(h, down[0], precision="highest") + down_bias[0]


def _attention_none(q, k, v, sinks, *, sliding_window, scale):
    """No attention: the values, repeated over the query group (keeps every input in the graph)."""
    g = q.shape[1] // k.shape[1]
    return (jnp.repeat(v, g, axis=1) + q * 0.01) * jnp.tanh(sinks)[None, :, None, None]


def _cross_entropy_none(hidden, weight, labels, *, ignore_index=-100):
    """No [N, V] logits: -(hidden . weight[label]) stands in for the loss."""
    nll = -(hidden * weight[jnp.clip(labels, 0)]).sum(-1).astype(jnp.float32)
    return nll, nll * 0


def _sink_softmax_probs(qg, k, sinks, window, scale):
    b, hkv, g, tq, _ = qg.shape
    tk = k.shape[2]
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k, precision="highest", preferred_element_type=jnp.float32) * scale
    qpos, kpos = jnp.arange(tk - tq, tk)[:, None], jnp.arange(tk)[None, :]
    visible = (kpos <= qpos) & ((kpos > qpos - window) if window > 0 else True)
    s = jnp.where(visible, s, -jnp.inf)
    sink = sinks.astype(jnp.float32).reshape(1, hkv, g, 1, 1)
    m = jnp.maximum(s.max(-1, keepdims=True), sink)
    p, p_sink = jnp.exp(s - m), jnp.exp(sink - m)
    denom = p.sum(-1, keepdims=True) + p_sink
    return p / denom, p_sink / denom


def _attention_noconcat(q, k, v, sinks, *, sliding_window, scale):
    b, hq, tq, d = q.shape
    qg = q.reshape(b, k.shape[1], hq // k.shape[1], tq, d)
    p, _ = _sink_softmax_probs(qg, k, sinks, sliding_window, scale)
    return jnp.einsum("bhgqk,bhkd->bhgqd", p, v, precision="highest").reshape(q.shape).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention_vjp_core(q, k, v, sinks, window, scale):
    return _attention_vjp_fwd(q, k, v, sinks, window, scale)[0]


def _attention_vjp_fwd(q, k, v, sinks, window, scale):
    b, hq, tq, d = q.shape
    qg = q.reshape(b, k.shape[1], hq // k.shape[1], tq, d)
    p, p_sink = _sink_softmax_probs(qg, k, sinks, window, scale)
    out = jnp.einsum("bhgqk,bhkd->bhgqd", p, v, precision="highest")
    return out.reshape(q.shape), (q, k, v, p, p_sink, out)


def _attention_vjp_bwd(window, scale, res, do):
    q, k, v, p, p_sink, out = res
    hq = q.shape[1]
    dog = do.reshape(out.shape)
    delta = (dog * out).sum(-1, keepdims=True)
    dv = jnp.einsum("bhgqk,bhgqd->bhkd", p, dog, precision="highest")
    ds = p * (jnp.einsum("bhgqd,bhkd->bhgqk", dog, v, precision="highest") - delta) * scale
    dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds, k, precision="highest").reshape(q.shape)
    dk = jnp.einsum("bhgqk,bhgqd->bhkd", ds, q.reshape(out.shape), precision="highest")
    return dq, dk, dv, -(p_sink * delta).sum((0, 3, 4)).reshape(hq)


_attention_vjp_core.defvjp(_attention_vjp_fwd, _attention_vjp_bwd)


def _attention_vjp(q, k, v, sinks, *, sliding_window, scale):
    return _attention_vjp_core(q, k, v, sinks, int(sliding_window), float(scale))


def kernels(preset: str, rounds: int, sets: str):
    """fwd+bwd for each kernel set, interleaved; gradients compared with the first set's."""
    from jax_bridge import registry

    for op, name, fn in (("moe", "ideal", _moe_ideal), ("attention", "none", _attention_none),
                         ("cross_entropy", "none", _cross_entropy_none),
                         ("attention", "noconcat", _attention_noconcat), ("attention", "vjp", _attention_vjp)):
        # Written before segment_ids and up_shift: unpacked rows and GPT-OSS's activation only.
        registry.register_implementation(op, name, fn, platforms=("cpu",), contract_version=1)
    _, model, tokens = setup(preset)
    runs = {}
    for spec in [s.strip() for s in sets.split(";") if s.strip()]:
        kern, _, opts = spec.partition(":")
        ts = TrainStep(model, step_cfg=StepConfig(kernels=kern, kernel_options=opts or None))
        params = ts.init_state().params
        runs[spec] = (ts, params, ts.grads(params, tokens[0]))
    base = next(iter(runs))
    for spec, (_, _, ((loss, _), grads)) in runs.items():
        ref = runs[base][2][1]
        diff = max(float(jnp.max(jnp.abs(grads[n] - ref[n])) / (jnp.max(jnp.abs(ref[n])) + 1e-30)) for n in ref)
        print(f"{spec}: loss {float(loss):.6f}, largest relative gradient difference from {base}: {diff:.1e}")
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for spec, (ts, params, _) in runs.items():
            time.sleep(0.1)
            times[spec].append(timed(lambda: ts.grads(params, tokens[0])))
    report(times, base)


def ns_accuracy():
    """Newton-Schulz (5 steps) in float32, plain iteration and Gram form, against the plain
    iteration in float64: relative Frobenius error, per shape (m x n, n/m the aspect ratio)."""
    a, b, c = optim.OptimizerConfig().ns_coeffs
    torch.manual_seed(0)

    def plain(x):
        for _ in range(5):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x

    for spread in (False, True):
        for shape in ((256, 512), (512, 1024), (256, 1024), (512, 2048), (8, 512, 2048)):
            g = torch.randn(*shape, dtype=torch.float64)
            if spread:              # three directions 50x the rest: a wide spread of singular values
                g[..., :3, :] *= 50
            x = g / torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)
            want = plain(x)
            err = lambda y: float((y.double() - want).norm() / want.norm())
            print(f"{shape}{' spread' if spread else ''}: plain float32 {err(plain(x.float())):.2e}, Gram form "
                  f"float32 {err(optim._newton_schulz_on_gram(x.float(), 5, a, b, c)):.2e}, chosen: "
                  f"{'Gram' if optim.gram_form_is_cheaper(shape[-2], shape[-1], 5) else 'plain'}")


def profile(preset: str, calls: int, kern: str | None):
    _, model, tokens = setup(preset)
    ts = TrainStep(model, step_cfg=StepConfig(kernels=kern))
    params = ts.init_state().params
    jax.block_until_ready(ts.grads(params, tokens[0]))
    out = f"/tmp/step_profile/{preset}"
    with jax.profiler.trace(out):
        for _ in range(calls):
            jax.block_until_ready(ts.grads(params, tokens[0]))
    hlo = f"{out}/fwdbwd.hlo.txt"
    with open(hlo, "w") as f:
        f.write(ts._jitted_grads.lower(params, tokens[0]).compile().as_text())
    summary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_profile_summary.py")
    print(f"trace and compiled HLO in {out}; per model op:\n  python {summary} {out} {hlo}")


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "profile":
        profile(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3, sys.argv[4] if len(sys.argv) > 4 else None)
        sys.exit()
    preset = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    {"cost": lambda: cost(preset), "step": lambda: step(preset, n), "ns": lambda: ns(preset, n),
     "block_m": lambda: block_m(preset, n), "compile": lambda: compile_time(preset, n),
     "kernels": lambda: kernels(preset, n, sys.argv[4]), "ns_accuracy": ns_accuracy}[what]()
