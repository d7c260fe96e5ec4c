"""`torchlyra bench generate`: decode throughput and time to first token, side by side in one run.

The paths generate greedily from the same weights and the same random prompts, exactly
`--new-tokens` tokens per row (stop tokens off), at each batch size:
  ours      : `train.generate` (prefill, KV cache, one compiled decode loop);
  ours-streaming : the same, handing tokens to the host every 8 steps (the decode loop runs in
              chunks, as `torchlyra generate` does for one prompt): the cost of streaming;
  hf        : transformers' `generate` on the checkpoint exported by `torchlyra export` and loaded
              with `from_pretrained` (float32, its default attention/experts implementations, its
              own KV cache), at its better torch thread setting (1 or the default); a streamer
              notes when its first token arrives;
  no-cache  : what generation did before the cache: the lowered forward over a padded
              [batch, max_seq_len] window for every token, logits to the host, argmax there.
Time to first token: the prompt's prefill plus the first token. Decode tokens/s: the other
tokens of all rows over the time after the first token. Our paths also report the bytes a decode
step must read at the least (jax_bridge/decoding.py: Decoder.step_bytes) and, on a TPU, the HBM
floor they set (those bytes over the chip's bandwidth) in tokens/s and the share of it achieved. Repetitions are interleaved across the
paths in a rotating order (the machine's load hits them alike), each timed call right after an
untimed one of the same path (its weights as warm in the caches as they get), and the median
is kept; process CPU time is reported
too, since on a shared machine wall time also counts waiting for a core. Compilation is done
before timing and reported apart, per bucket.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from formats.errors import UserError
from train.bench.table import markdown_table

GOAL = 3.0          # decode throughput vs transformers, at every batch size
PATHS = ("ours", "ours-streaming", "hf", "no-cache")
STREAM_EVERY = 8


def add_arguments(parser) -> None:
    """Flags of `bench generate`."""
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per path (median; default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before timing (default 2)")
    parser.add_argument("--checkpoint", default=None,
                        help="generate: checkpoint to measure (default: --preset with random weights)")
    parser.add_argument("--preset", default="tiny", help="generate: preset when no --checkpoint (default tiny)")
    parser.add_argument("--batches", default="1,8", help="generate: comma-separated batch sizes (default 1,8)")
    parser.add_argument("--prompt-len", type=int, default=32, help="generate: prompt tokens per row (default 32)")
    parser.add_argument("--new-tokens", type=int, default=64, help="generate: new tokens per row (default 64)")
    parser.add_argument("--hf-threads", default="auto",
                        help="generate: torch threads for transformers, or auto (the faster of 1 and torch's default)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"generate: comma-separated subset of {','.join(PATHS)} (default: all)")
    parser.add_argument("--kernels", default="auto",
                        help="generate: our paths' kernels, as `torchlyra generate --kernels` (e.g. cached_attention=xla)")
    parser.add_argument("--kernel-options", default=None,
                        help="generate: our paths' kernel options, as `torchlyra generate --kernel-options`")


# ---- the paths ----------------------------------------------------------------------------------
class Ours:
    name = "ours"

    def __init__(self, model=None, *, generator=None, stream_every: int | None = None, kernels="auto",
                 kernel_options=None):
        from train.generation.generator import Generator
        self.generator = generator or Generator(model, kernels=kernels, kernel_options=kernel_options)
        self.stream_every = stream_every
        self.last = None            # the last Generation: its HBM floor (the same every repetition)

    def run(self, prompts, new_tokens):
        from train.generation.sampling import SamplingConfig
        cpu = time.process_time()
        streaming = dict(on_tokens=lambda new: None, stream_every=self.stream_every) if self.stream_every else {}
        result = self.generator.generate(prompts, SamplingConfig(max_new_tokens=new_tokens, temperature=0), **streaming)
        self.last = result
        return result.tokens, result.prefill_seconds, result.decode_seconds, time.process_time() - cpu

    def compilations(self):
        return [{"program": c.program, "bucket": list(c.bucket[:3]) if c.program == "prefill" else list(c.bucket[:2]),
                 "seconds": round(c.seconds, 2), "from_persistent_cache": c.from_cache}
                for c in self.generator.decoder.compilations]


class Transformers:
    name = "hf"

    def __init__(self, hf_dir):
        from parity.generation import load_transformers
        self.model = load_transformers(hf_dir)
        self.implementation = {"attention": self.model.config._attn_implementation,
                               "experts": getattr(self.model.config, "_experts_implementation", None)}
        self.threads = None

    def run(self, prompts, new_tokens):
        import torch

        from parity.generation import transformers_greedy
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        clock = _FirstTokenClock()
        started, cpu = time.perf_counter(), time.process_time()
        tokens = transformers_greedy(self.model, prompts, new_tokens, streamer=clock)
        ended = time.perf_counter()
        return tokens, clock.first - started, ended - clock.first, time.process_time() - cpu


class _FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives (generate hands it the
    prompt first, then each step's tokens), so one call gives time to first token and decode time."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


class NoCache:
    """The pre-cache generation path, kept here as the baseline: every token re-runs the lowered
    forward over the padded [batch, window] buffer and takes one row of its logits to the host."""
    name = "no-cache"

    def __init__(self, model, window: int):
        import jax
        import jax.numpy as jnp

        from jax_bridge import registry
        from jax_bridge.env import get_env
        from jax_bridge.lowering import model_function, params_to_jax
        from pallas_kernels.platform import host_platform

        self.window, self.params = window, params_to_jax(model)
        env, kernels, forward = get_env(), registry.resolve("xla"), model_function(model)

        def next_logits(params, ids, positions):
            with registry.routed(env, kernels, platform=host_platform()), jax.default_matmul_precision("highest"):
                logits = forward(params, ids)
            return jnp.take_along_axis(logits, positions[:, None, None], axis=1)[:, 0]

        self._next_logits = jax.jit(next_logits)

    def run(self, prompts, new_tokens):
        seqs, first, started, cpu = [list(p) for p in prompts], None, time.perf_counter(), time.process_time()
        for step in range(new_tokens):
            ids = np.zeros((len(seqs), self.window), np.int32)
            pos = np.zeros(len(seqs), np.int32)
            for i, s in enumerate(seqs):
                tail = s[-self.window:]
                ids[i, :len(tail)], pos[i] = tail, len(tail) - 1
            logits = np.asarray(self._next_logits(self.params, ids, pos))
            for s, row in zip(seqs, logits):
                s.append(int(np.argmax(row)))
            if step == 0:
                first = time.perf_counter() - started
                started = time.perf_counter()
        tokens = [s[len(p):] for s, p in zip(seqs, prompts)]
        return tokens, first, time.perf_counter() - started, time.process_time() - cpu


# ---- measuring ------------------------------------------------------------------------------------
def _choose_hf_threads(hf, prompts, new_tokens, log) -> int:
    """transformers at its better torch thread count (1 or the default) for this batch: on a
    machine whose cores are shared, extra threads can make torch much slower. Each count gets a
    warm-up call, then the better of two timed ones."""
    import torch

    default = torch.get_num_threads()
    seconds = {}
    for threads in sorted({1, default}):
        hf.threads = threads
        hf.run(prompts, 2)
        seconds[threads] = min(sum(hf.run(prompts, min(new_tokens, 16))[1:3]) for _ in range(2))
    hf.threads = min(seconds, key=seconds.get)
    log(f"  transformers threads: {hf.threads} (seconds for 16 tokens: "
        + ", ".join(f"{t} thread(s) {s:.3f}" for t, s in seconds.items()) + ")")
    return hf.threads


def measure(paths: dict, prompts, new_tokens: int, repeats: int, warmup: int, log) -> dict:
    """Per path: medians over interleaved repetitions, and the tokens of the last one."""
    samples = {name: [] for name in paths}
    for name, path in paths.items():
        for _ in range(warmup):
            path.run(prompts, new_tokens)       # compilation, first-call costs
    names = list(paths)
    for rep in range(repeats):
        # Each timed call right after an untimed one of the same path: every path meets its own
        # weights as warm in the caches as they get (a path that ran after another one on the
        # same weights measured up to 1.5x faster than the same code cold). Rotated order.
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            paths[name].run(prompts, new_tokens)
            samples[name].append(paths[name].run(prompts, new_tokens))
        log(f"  repeat {rep + 1}/{repeats}: " + ", ".join(
            f"{n} {len(prompts) * (new_tokens - 1) / s[-1][2]:.0f} tok/s" for n, s in samples.items()))
    rows = len(prompts)
    out = {}
    for name, runs in samples.items():
        tokens = runs[-1][0]
        out[name] = {
            "decode_tokens_per_s": rows * (new_tokens - 1) / statistics.median(r[2] for r in runs),
            "time_to_first_token_ms": 1e3 * statistics.median(r[1] for r in runs),
            "cpu_ms_per_token": 1e3 * statistics.median(r[3] / (rows * new_tokens) for r in runs),
            "decode_tokens_per_s_each": [rows * (new_tokens - 1) / r[2] for r in runs],
            "tokens": tokens,
        }
    return out


def floor_row(generation, tokens_per_s: float) -> dict:
    """The decode's bytes per step and, on a TPU, its HBM floor in tokens/s and the share of it
    achieved at the measured (median) tokens/s (train/generation/generator.py: Generation.floor_seconds)."""
    steps = generation.decode_steps
    out = {"decode_bytes_per_step": (generation.decode_weight_bytes + generation.decode_kv_bytes) / max(steps, 1),
           "floor_tokens_per_s": None, "share_of_floor": None}
    floor = generation.floor_seconds
    if floor:
        out["floor_tokens_per_s"] = generation.rows * steps / floor
        out["share_of_floor"] = tokens_per_s / out["floor_tokens_per_s"]
    return out


def _agreement(a, b) -> float:
    """Fraction of rows whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


# ---- report -----------------------------------------------------------------------------------------
HEADER = ["batch", "path", "decode tok/s", "vs hf", "TTFT ms", "vs hf", "CPU ms/token", "same tokens as hf",
          "floor tok/s", "of floor"]


def format_table(rows: list[dict]) -> str:
    body = [[str(r["batch"]), r["path"], f"{r['decode_tokens_per_s']:.0f}", _ratio(r.get("decode_vs_hf")),
             f"{r['time_to_first_token_ms']:.1f}", _ratio(r.get("ttft_vs_hf"), inverse=True),
             f"{r['cpu_ms_per_token']:.3f}",
             "-" if r.get("same_tokens_as_hf") is None else f"{100 * r['same_tokens_as_hf']:.0f}% of rows",
             "-" if r.get("floor_tokens_per_s") is None else f"{r['floor_tokens_per_s']:.0f}",
             "-" if r.get("share_of_floor") is None else f"{100 * r['share_of_floor']:.0f}%"]
            for r in rows]
    return markdown_table(HEADER, body)


def _ratio(value, inverse=False) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" + (" faster" if inverse and value > 1 else "")


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UserError(f"--{what}: expected comma-separated positive integers, found {text!r}")
    return values


def _load(args, workdir: Path, export: bool):
    """(torch model, exported transformers directory (None unless `export`), description of the weights)."""
    import torch

    from formats.hf_export import export_checkpoint
    from torch_model.config import ConfigError, get_preset
    from torch_model.model import GptOssForCausalLM
    from formats.checkpoint import save_checkpoint
    from train.generation.generator import load_model

    if args.checkpoint:
        checkpoint, source = Path(args.checkpoint), f"checkpoint {args.checkpoint}"
        model = load_model(checkpoint)
    else:
        try:
            cfg = get_preset(args.preset)
        except ConfigError as e:
            raise UserError(str(e)) from None
        torch.manual_seed(0)
        model = GptOssForCausalLM(cfg).eval()
        checkpoint, source = workdir / "checkpoint", f"preset {args.preset}, random weights (seed 0)"
        save_checkpoint(checkpoint, model.state_dict(), cfg)
    if not export:
        return model, None, source
    export_checkpoint(checkpoint, workdir / "hf")
    return model, workdir / "hf", source


def run(args) -> int:
    from train.bench.machine import machine_info

    batches = _parse_ints(args.batches, "batches")
    prompt_len = _parse_ints(str(args.prompt_len), "prompt-len")[0]
    new_tokens = _parse_ints(str(args.new_tokens), "new-tokens")[0]
    names = [s.strip() for s in args.paths.split(",") if s.strip()]
    if not names or any(n not in PATHS for n in names):
        raise UserError(f"--paths: expected a comma-separated subset of {','.join(PATHS)}, found {args.paths!r}")
    if new_tokens < 2:
        raise UserError(f"--new-tokens: decode speed needs at least 2 tokens, found {new_tokens}")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    if "hf" in names and args.checkpoint:
        from formats import checkpoint as checkpoints

        if not isinstance(checkpoints.read_meta(checkpoints.find_checkpoint(args.checkpoint))[1],
                          checkpoints.ModelConfig):
            if args.paths != ",".join(PATHS):
                raise UserError(f"--paths hf: transformers' GptOss generates our GPT-OSS checkpoints only; "
                                f"{args.checkpoint} holds another model: --paths ours,ours-streaming,no-cache")
            names = [n for n in names if n != "hf"]
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        model, hf_dir, source = _load(args, Path(tmp), export="hf" in names)
        cfg = model.cfg
        if prompt_len + new_tokens > cfg.max_position_embeddings:
            raise UserError(f"--prompt-len + --new-tokens ({prompt_len + new_tokens}) exceed the model's "
                            f"max_position_embeddings ({cfg.max_position_embeddings})")
        paths = {}
        if "ours" in names or "ours-streaming" in names:
            ours = Ours(model, kernels=args.kernels, kernel_options=args.kernel_options)
            if "ours" in names:
                paths["ours"] = ours
            if "ours-streaming" in names:
                paths["ours-streaming"] = Ours(generator=ours.generator, stream_every=STREAM_EVERY)
        if "hf" in names:
            paths["hf"] = Transformers(hf_dir)
        if "no-cache" in names:
            paths["no-cache"] = NoCache(model, window=max(cfg.max_seq_len, prompt_len + new_tokens))
        rng = np.random.default_rng(0)
        rows, results = [], {}
        for batch in batches:
            prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
            log(f"batch {batch}: {prompt_len}-token prompts, {new_tokens} new tokens")
            if "hf" in paths:
                if args.hf_threads == "auto":
                    _choose_hf_threads(paths["hf"], prompts, new_tokens, log)
                else:
                    paths["hf"].threads = _parse_ints(args.hf_threads, "hf-threads")[0]
            result = measure(paths, prompts, new_tokens, args.repeats, max(args.warmup, 1), log)
            results[batch] = result
            hf = result.get("hf")
            for name in paths:
                r = result[name]
                row = {"batch": batch, "path": name, **{k: v for k, v in r.items() if k != "tokens"}}
                if hf is not None:
                    row["decode_vs_hf"] = r["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
                    row["ttft_vs_hf"] = hf["time_to_first_token_ms"] / r["time_to_first_token_ms"]
                    row["same_tokens_as_hf"] = _agreement(r["tokens"], hf["tokens"])
                if name == "hf":
                    row["torch_threads"] = paths["hf"].threads
                if isinstance(paths[name], Ours):
                    row.update(floor_row(paths[name].last, r["decode_tokens_per_s"]))
                rows.append(row)
    elapsed = time.perf_counter() - started
    load = [round(load_before, 1), round(os.getloadavg()[0], 1)]

    print(format_table(rows))
    compiled = ours.compilations() if "ours" in names or "ours-streaming" in names else []
    if compiled:
        print("\nours, compiled once per bucket before timing: " + "; ".join(
            f"{c['program']} {c['bucket']} {c['seconds']:.1f} s"
            + (" (persistent cache)" if c["from_persistent_cache"] else "")
            for c in compiled))
    goal = None
    if "ours" in paths and "hf" in paths:
        ratios = {r["batch"]: r["decode_vs_hf"] for r in rows if r["path"] == "ours"}
        goal = all(v >= GOAL for v in ratios.values())
        print(f"goal: ours >= {GOAL:.0f}x transformers' decode tokens/s at every batch: "
              f"{'met' if goal else 'NOT met'} ({', '.join(f'batch {b}: {v:.2f}x' for b, v in ratios.items())})")
    dtype = ours.generator.decoder.compute_dtype if "ours" in names or "ours-streaming" in names else "float32"
    print(f"{source}; {dtype}; greedy; {elapsed:.0f} s in all; load average {load[0]} -> {load[1]} on "
          f"{os.cpu_count()} cores. TTFT: prefill + first token. "
          f"Medians of {args.repeats} interleaved repeats; CPU ms/token: process CPU time of a whole generation "
          f"(all threads) per generated token. Floor: the bytes a decode step must read at the least over "
          f"the TPU's HBM bandwidth (TPU only; docs/generate.md).")
    if args.json:
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        report = dict(command=_command_line(args), date=date, machine=machine_info(), weights=source,
                      model=cfg.to_dict() if hasattr(cfg, "to_dict") else dataclasses.asdict(cfg),   # a transformers model's shape
                      elapsed_s=round(elapsed, 1), load_average_start_end=load,
                      settings=dict(batches=batches, prompt_len=prompt_len, new_tokens=new_tokens, repeats=args.repeats,
                                    warmup=max(args.warmup, 1), dtype=dtype, sampling="greedy"),
                      transformers=paths["hf"].implementation if "hf" in paths else None,
                      kernels=dict(ours.generator.decoder.decode_kernels) if "ours" in names or
                      "ours-streaming" in names else None,
                      compilations=compiled, goal=dict(ratio=GOAL, met=goal), rows=rows)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


def _command_line(args) -> str:
    parts = ["torchlyra", "bench", "generate"]
    parts += ["--checkpoint", args.checkpoint] if args.checkpoint else ["--preset", args.preset]
    parts += ["--batches", args.batches, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
              "--repeats", str(args.repeats)]
    if args.paths != ",".join(PATHS):
        parts += ["--paths", args.paths]
    if args.kernels != "auto":
        parts += ["--kernels", args.kernels]
    if args.kernel_options:
        parts += ["--kernel-options", args.kernel_options]
    if args.hf_threads != "auto":
        parts += ["--hf-threads", args.hf_threads]
    if args.json:
        parts += ["--json", args.json]
    return " ".join(parts)
