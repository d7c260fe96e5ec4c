#!/usr/bin/env python3
"""Kernel and train-step speed on a GPU machine: each op's GPU kernel against its XLA reference, then
the whole train step against eager PyTorch CUDA and torch.compile on the same GPU.

This process imports only jax, pallas_kernels/* and parity/compare.py (the GPU image has no torchax, no
array_record). The train-step part needs torch and torchax: it runs `torchlyra bench step --device gpu`
(train/bench/step.py) in child processes, so the torchax and array_record wheels (the CLI's parser
imports the data modules) must be on the GPU machine and on PYTHONPATH. One run of about 6 minutes
on one H200:

    python scripts/gpu_bench.py                  # kernels at Lyra Small shapes + step (small-o200k), bf16
                                                 #   -> gpu_bench.json in the folder OUT names, else here
    python scripts/gpu_bench.py /path/out.json   # or a path of your choice
    python scripts/gpu_bench.py --smoke          # CPU: tiny shapes, kernels interpreted, a micro step
                                                 #   (float32) against the torch peers (is it broken?)
    python scripts/gpu_bench.py --parts step     # only one part (kernels, step)

First, at a small float32 shape, every kernel's outputs and gradients are checked against the
reference. Then, at Lyra Small shapes (bf16), forward and forward+backward (value_and_grad of the
sum of all outputs w.r.t. all float inputs) are compiled once and timed: median of --repeats calls
after --warmup calls. Rows (ratios are impl time / xla time):
  attention     xla (plain JAX, [T, T] scores)  vs  pallas (Triton flash attention); window 128 and full
  cross_entropy xla (plain JAX, [N, V] logits)  vs  pallas (Triton, vocab-tiled)
  moe           xla (tiled grouped GEMM in XLA) vs  ragged_dot (jax.lax.ragged_dot); no GPU Pallas kernel
Each row also records the compiled program's temporary memory (memory_analysis) on this device.
A row that fails records its error and the run goes on; the JSON is rewritten after every row.
Train step (--parts step): the lowered step (bf16 compute, float32 master weights, `auto` kernels) vs
our eager model + Muon+AdamW on CUDA under bf16 autocast, torch.compile of it, and transformers' GptOss
eager and compiled with AdamW: forward+backward and full step, interleaved rounds, tokens/s and MFU
against the GPU's published dense bf16 peak (train/run/flops.py); its report goes under "step" in the JSON.
Exit status: 0 when every check passed and no row failed, else 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import attention as attn_k  # noqa: E402
from pallas_kernels import cross_entropy as ce_k  # noqa: E402
from pallas_kernels import moe as moe_k  # noqa: E402
from parity.compare import rel_err  # noqa: E402  (numpy only: no torch needed on the GPU image)

# ---- shapes -------------------------------------------------------------------------------------
# name -> dims. "check": small float32 problems for the correctness pass; "bench": timed.
SHAPES = {
    "full": {
        "check": dict(attention=dict(B=2, Hq=4, Hkv=2, T=256, D=64, windows=(64, 0)),
                      cross_entropy=dict(N=512, H=128, V=1000),
                      moe=dict(M=512, H=128, I=128, E=4)),
        "bench": dict(attention=dict(B=4, Hq=16, Hkv=4, T=4096, D=128, windows=(128, 0)),
                      cross_entropy=dict(N=16384, H=2048, V=201088),
                      moe=dict(M=32768, H=2048, I=384, E=16)),
        "dtype": "bfloat16",
    },
    "smoke": {
        "check": dict(attention=dict(B=1, Hq=2, Hkv=1, T=64, D=32, windows=(16,)),
                      cross_entropy=dict(N=64, H=32, V=200),
                      moe=dict(M=64, H=32, I=32, E=4)),
        "bench": dict(attention=dict(B=1, Hq=2, Hkv=1, T=128, D=32, windows=(0,)),
                      cross_entropy=dict(N=128, H=64, V=512),
                      moe=dict(M=256, H=64, I=64, E=4)),
        "dtype": "bfloat16",
    },
}
OPS = ("attention", "cross_entropy", "moe")


def _kernel_mode(smoke: bool) -> dict:
    # The Triton kernels; in a smoke run on CPU, interpreted (pallas_kernels/platform.py).
    return dict(platform="gpu", interpret="generic" if smoke else None)


def _impls(op: str, smoke: bool) -> dict:
    """name -> (fn(*inputs) with static kwargs bound)."""
    km = _kernel_mode(smoke)
    if op == "attention":
        return {"xla": lambda w, s: (lambda q, k, v, sk: attn_k.attention_reference(q, k, v, sk, sliding_window=w, scale=s)),
                "pallas": lambda w, s: (lambda q, k, v, sk: attn_k.attention_pallas(
                    q, k, v, sk, sliding_window=w, scale=s, **km))}
    if op == "cross_entropy":
        return {"xla": lambda: (lambda h, w, y: ce_k.linear_cross_entropy_reference(h, w, y)),
                "pallas": lambda: (lambda h, w, y: ce_k.linear_cross_entropy_pallas(h, w, y, **km))}
    if op == "moe":
        kw = dict(alpha=1.702, limit=7.0)
        return {"xla": lambda: (lambda x, a, b, c, d, g: moe_k.moe_experts_xla(x, g, a, b, c, d, **kw)),
                "ragged_dot": lambda: (lambda x, a, b, c, d, g: moe_k.moe_experts_reference(x, g, a, b, c, d, **kw))}
    raise ValueError(op)


# ---- inputs -------------------------------------------------------------------------------------
def _group_sizes(m: int, e: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).dirichlet(np.ones(e) * 2.0)
    sizes = np.floor(w * m).astype(np.int32)
    sizes[0] += m - sizes.sum()
    return sizes


def _problems(op: str, dims: dict, dtype, seed: int = 0):
    """[(case label, static args for the impl factory, inputs, number of leading float inputs)]."""
    key = jax.random.PRNGKey(seed)
    ks = list(jax.random.split(key, 8))
    rnd = lambda k, shape, scale=1.0: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)
    if op == "attention":
        b, hq, hkv, t, d = (dims[x] for x in ("B", "Hq", "Hkv", "T", "D"))
        q, k, v = rnd(ks[0], (b, hq, t, d)), rnd(ks[1], (b, hkv, t, d)), rnd(ks[2], (b, hkv, t, d))
        sinks = jax.random.normal(ks[3], (hq,), jnp.float32)
        out = []
        for w in dims["windows"]:
            label = f"B{b} H{hq}/{hkv} T{t} D{d} " + (f"win{w}" if w else "full")
            out.append((label, (w, d ** -0.5), (q, k, v, sinks), 4))
        return out
    if op == "cross_entropy":
        n, h, v = dims["N"], dims["H"], dims["V"]
        hid, w = rnd(ks[0], (n, h)), rnd(ks[1], (v, h), 0.05)
        labels = jax.random.randint(ks[2], (n,), 0, v, jnp.int32)
        labels = labels.at[:: max(1, n // 16)].set(-100)   # a few ignored tokens
        return [(f"N{n} H{h} V{v}", (), (hid, w, labels), 2)]
    if op == "moe":
        m, h, i, e = dims["M"], dims["H"], dims["I"], dims["E"]
        x = rnd(ks[0], (m, h))
        gate_up, gate_up_b = rnd(ks[1], (e, h, 2 * i), h ** -0.5), rnd(ks[2], (e, 2 * i), 0.1)
        down, down_b = rnd(ks[3], (e, i, h), i ** -0.5), rnd(ks[4], (e, h), 0.1)
        gs = jnp.asarray(_group_sizes(m, e, seed), jnp.int32)
        return [(f"M{m} H{h} I{i} E{e}", (), (x, gate_up, gate_up_b, down, down_b, gs), 5)]
    raise ValueError(op)


def _fwd_bwd(fn, n_float: int):
    """value_and_grad of sum(outputs) w.r.t. the leading float inputs."""
    def f(*args):
        def loss(*fl):
            out = fn(*fl, *args[n_float:])
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return sum(jnp.sum(o.astype(jnp.float32)) for o in outs)
        return jax.value_and_grad(loss, argnums=tuple(range(n_float)))(*args[:n_float])
    return f


# ---- correctness pass ---------------------------------------------------------------------------
def _out_and_grads(fn, n_float: int):
    """(cotangents, *inputs) -> (outputs as a list, grads of the leading float inputs): one program."""
    def f(cts, *args):
        out, pullback = jax.vjp(lambda *fl: fn(*fl, *args[n_float:]), *args[:n_float])
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        return outs, pullback(type(out)(cts) if isinstance(out, (tuple, list)) else cts[0])
    return f


def check(ops, shapes, smoke: bool, tol: float) -> list[dict]:
    rows = []
    for op in ops:
        for label, static, inputs, n_float in _problems(op, shapes["check"][op], jnp.float32, seed=1):
            impls = _impls(op, smoke)
            ref = impls["xla"](*static) if op != "moe" else impls["ragged_dot"](*static)
            ref_name = "xla" if op != "moe" else "ragged_dot"
            for name, factory in impls.items():
                if name == ref_name:
                    continue
                fn = factory(*static)
                row = dict(op=op, case=label, impl=name, against=ref_name, dtype="float32", ok=False)
                try:
                    shapes_out = jax.tree_util.tree_leaves(jax.eval_shape(ref, *inputs))
                    cts = [jax.random.normal(jax.random.PRNGKey(7 + i), o.shape, jnp.float32).astype(o.dtype)
                           for i, o in enumerate(shapes_out)]
                    outs, g_ref = jax.jit(_out_and_grads(ref, n_float))(cts, *inputs)
                    out_t, g = jax.jit(_out_and_grads(fn, n_float))(cts, *inputs)
                    errs = {f"out{i}": rel_err(a, b) for i, (a, b) in enumerate(zip(out_t, outs))}
                    errs.update({f"grad{i}": rel_err(a, b) for i, (a, b) in enumerate(zip(g, g_ref))})
                    row["rel_err"] = errs
                    row["ok"] = all(e <= tol for e in errs.values()) and all(np.isfinite(list(errs.values())))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    traceback.print_exc()
                rows.append(row)
                worst = max(row.get("rel_err", {}).values(), default=float("nan"))
                print(f"check {op:13s} {label:28s} {name:10s} vs {ref_name:10s} "
                      f"{'ok' if row['ok'] else 'FAIL'}  worst rel err {worst:.2e}"
                      + (f"  {row['error']}" if "error" in row else ""), flush=True)
    return rows


# ---- timing pass --------------------------------------------------------------------------------
def _time(compiled, inputs, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(compiled(*inputs))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench(ops, shapes, smoke: bool, args, report, save) -> list[dict]:
    dtype = jnp.dtype(shapes["dtype"])
    rows = report["rows"]
    deadline = time.perf_counter() + args.budget
    for op in ops:
        for label, static, inputs, n_float in _problems(op, shapes["bench"][op], dtype):
            for direction in ("fwd", "fwd+bwd"):
                base = None
                for name, factory in _impls(op, smoke).items():
                    fn = factory(*static)
                    f = fn if direction == "fwd" else _fwd_bwd(fn, n_float)
                    row = dict(op=op, case=label, impl=name, direction=direction, dtype=str(dtype),
                               time_s=None, ratio_to_xla=None, temp_bytes=None, compile_s=None, error=None)
                    if time.perf_counter() > deadline:
                        row["error"] = f"skipped: past the {args.budget:g} s budget"
                    else:
                        try:
                            t0 = time.perf_counter()
                            compiled = jax.jit(f).lower(*inputs).compile()
                            row["compile_s"] = round(time.perf_counter() - t0, 2)
                            mem = compiled.memory_analysis()
                            row["temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
                            row["time_s"] = _time(compiled, inputs, args.warmup, args.repeats)
                            del compiled
                        except Exception as e:  # noqa: BLE001
                            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                            traceback.print_exc()
                    if name == "xla":
                        base = row
                    elif base and base["time_s"] and row["time_s"]:
                        row["ratio_to_xla"] = row["time_s"] / base["time_s"]
                    rows.append(row)
                    print(_fmt(row), flush=True)
                    save()
        del inputs
    return rows


def _fmt(row) -> str:
    t = f"{row['time_s'] * 1e3:10.3f} ms" if row["time_s"] is not None else f"{'-':>13s}"
    r = f"{row['ratio_to_xla']:7.3f}" if row["ratio_to_xla"] is not None else ("   base" if row["impl"] == "xla" else "      -")
    mem = f"{row['temp_bytes'] / 2**20:10.1f} MiB" if row["temp_bytes"] is not None else f"{'-':>14s}"
    return (f"{row['op']:13s} {row['case']:28s} {row['impl']:10s} {row['direction']:8s} {t} {r} {mem}"
            + (f"  ERROR {row['error']}" if row["error"] else ""))


# ---- train step (child processes: torch + torchax) -------------------------------------------------
STEP_RUNS = {
    # the o200k preset at seq 1024, 8 rows; every peer; MFU against the bf16 data-sheet peak
    "full": ["--preset", "small-o200k", "--batch-size", "8", "--device", "gpu", "--rounds", "5"],
    # CPU, float32: a micro model against eager torch, a quickly compiled copy and transformers
    "smoke": ["--preset", "tiny", "--model", "d_model=32,n_layers=1,n_heads=2,n_kv_heads=1,head_dim=16,"
              "n_experts=2,expert_dim=32,vocab_size=128", "--batch-size", "2", "--seq-len", "16",
              "--rounds", "1", "--peers", "eager,compiled,hf", "--compile-backend", "aot_eager"],
}


def step_part(smoke: bool, budget: float, report: dict, save) -> bool:
    """Run `torchlyra bench step` in a child process (within `budget` seconds) and keep its report
    under report["step"]. Returns whether it succeeded."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.json")
        cmd = [sys.executable, "-m", "train.cli", "bench", "step", *STEP_RUNS["smoke" if smoke else "full"],
               "--json", path]
        # JAX takes 75% of the GPU's memory at its first use unless told not to; the torch peers share
        # the process (an H100 run: "CUDA out of memory" in the eager peer's first forward).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
        print("step: " + " ".join(cmd[1:]), flush=True)
        step = dict(command=" ".join(cmd[1:]), error=None)
        # its own process group, so that a timeout also ends its child of torch peers
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, process_group=0)
        try:
            printed, _ = proc.communicate(timeout=budget)
            print(printed, flush=True)
            if proc.returncode != 0:
                step["error"] = f"exit status {proc.returncode} (its error is printed above)"
            else:
                with open(path) as fh:
                    step.update(json.load(fh))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            step["error"] = f"over the {budget:g} s budget of the step part"
    report["step"] = step
    save()
    if step["error"]:
        print(f"step: ERROR {step['error']}", flush=True)
    return step["error"] is None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="JSON path (default gpu_bench.json in the folder the OUT variable names, else ./gpu_bench.json)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels (runs on CPU)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; smoke 1)")
    p.add_argument("--budget", type=float, default=200.0,
                   help="seconds after which the remaining kernel rows are skipped (default 200)")
    p.add_argument("--parts", default="kernels,step", help="comma-separated parts to run: kernels, step (default both)")
    p.add_argument("--step-budget", type=float, default=240.0,
                   help="seconds the train-step part may take before it is stopped (default 240)")
    p.add_argument("--tol", type=float, default=2e-2, help="max relative error of the float32 check")
    p.add_argument("--skip-check", action="store_true")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (2 if args.smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or any(o not in OPS for o in ops):
        p.error(f"--ops: expected a subset of {','.join(OPS)}; got {args.ops!r}")
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or any(x not in ("kernels", "step") for x in parts):
        p.error(f"--parts: expected a subset of kernels,step; got {args.parts!r}")
    out = args.out or os.path.join(os.environ.get("OUT") or ".", "gpu_bench.json")
    shapes = SHAPES["smoke" if args.smoke else "full"]

    started = time.perf_counter()
    report = dict(script="scripts/gpu_bench.py", argv=sys.argv[1:] if argv is None else list(argv),
                  date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  smoke=args.smoke, jax=jax.__version__, backend=jax.default_backend(),
                  devices=[str(d) for d in jax.devices()], python=platform.python_version(),
                  shapes=shapes, repeats=args.repeats, warmup=args.warmup, checks=[], rows=[])
    if not args.smoke and jax.default_backend() != "gpu":
        print(f"warning: jax backend is {jax.default_backend()!r}, not gpu; the Triton kernels will fail "
              "(use --smoke on CPU)", file=sys.stderr)

    def save():
        report["elapsed_s"] = round(time.perf_counter() - started, 1)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(report, fh, indent=1, default=str)

    print(f"jax {jax.__version__} on {report['devices']}", flush=True)
    if "kernels" in parts:
        if not args.skip_check:
            report["checks"] = check(ops, shapes, args.smoke, args.tol)
            save()
        bench(ops, shapes, args.smoke, args, report, save)
        save()
    step_ok = step_part(args.smoke, args.step_budget, report, save) if "step" in parts else True

    print("\nop            case                         impl       dir         time/call   vs xla    temp mem")
    for row in report["rows"]:
        print(_fmt(row))
    bad_checks = [c for c in report["checks"] if not c["ok"]]
    bad_rows = [r for r in report["rows"] if r["error"]]
    print(f"\n{len(report['checks']) - len(bad_checks)}/{len(report['checks'])} checks passed; "
          f"{len(bad_rows)} rows failed; {report['elapsed_s']} s; wrote {out}")
    return 0 if not bad_checks and not bad_rows and step_ok else 1


if __name__ == "__main__":
    sys.exit(main())
