"""`torchlyra bench step`: the lowered train step side by side with its PyTorch peers.

Contenders, all with the same preset, batch, sequence length, precision and initial weights:
  ours         the lowered step (jax_bridge.step.TrainStep): forward+backward, the full step with
               Muon+AdamW, and the optimizer update alone (jitted as inside the step)
  eager        our torch model, eager, + the same Muon+AdamW       (this process AND the child)
  compiled     torch.compile of `eager`, model and optimizer step  (child)
  hf           transformers' GptOss, eager, + torch.optim.AdamW    (child)
  hf_compiled  torch.compile of `hf`                               (child)
torch.compile cannot run in a process that imported torchax, so the torch peers but `eager` run in
a child process (train/bench/torch_peers.py). Rounds alternate between the processes; each round times
every contender's forward+backward and full step once, and the matmul peak. `eager` runs in both
processes, so a child peer's ratio to ours is paired through it, round by round:
    peer / ours = (peer / eager)[child] x (eager[parent] / ours)
Times are medians over rounds; compile (first-call) times are reported apart. MFU uses the one
FLOPs count (train/run/flops.py) against the matmul rate measured in the same rounds (on a GPU: its published
peak, the measured rate kept beside it).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from train.bench.table import markdown_table
from train.bench.torch_peers import KINDS, TORCH_PEERS, bench_tokens
from formats.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_PEERS = ("compiled", "hf", "hf_compiled")
# The step's speed goals (ratios are "ours is N x faster"): checked on every run and printed.
GOALS = {
    "fwdbwd_vs_hf": ("forward+backward >= 2x transformers eager", 2.0),
    "fwdbwd_vs_hf_compiled": ("forward+backward >= 1.5x torch.compile (transformers)", 1.5),
    "fwdbwd_vs_compiled": ("forward+backward >= 1.5x torch.compile (our model)", 1.5),
    "fwdbwd_mfu": ("forward+backward >= 60% of the measured matmul peak (judged at d_model >= 512)", 0.60),
    "step_over_parts": ("full step <= (forward+backward + update alone) x 1.10", 1.10),
    "step_vs_eager": ("full step >= 2x our eager model + the same optimizer", 2.0),
}


# ---- ours ---------------------------------------------------------------------------------------
class OursContender:
    """The lowered step. `run(kind)` times one call of: "fwdbwd" (jitted value_and_grad),
    "step" (TrainStep.__call__, state donated and carried on) or "update" (the optimizer update
    alone on fixed gradients, its own copy of params and optimizer state donated and carried on)."""

    def __init__(self, cfg, tokens, *, opt_cfg, kernels, kernel_options, compute_dtype, seed: int):
        import jax
        import jax.numpy as jnp

        from jax_bridge.step import StepConfig, TrainStep
        from torch_model.model import GptOssForCausalLM

        if hasattr(cfg, "facts"):          # a module (train --module): its own init at `seed`, as the peers'
            from formats.model_checks import build_module_model

            torch.manual_seed(seed)
            model = build_module_model(cfg, new_run=True)
        else:
            model = GptOssForCausalLM(cfg)
            model.reset_parameters(seed)
        self.jax = jax
        self.step = TrainStep(model, opt_cfg, StepConfig(kernels=kernels, compute_dtype=compute_dtype,
                                                         kernel_options=kernel_options))
        self.tokens = jnp.asarray(tokens[None], jnp.int32)         # [1 micro-batch, B, T + 1]
        self.state = self.step.init_state()
        self.update_state = self.step.init_state()                  # the update-alone copy
        self.grads = None
        self.compile_info = {}

    def warm_up(self) -> dict:
        """Compile times: the step's trace+lower and XLA compile (AOT), then each kind's first call."""
        jax = self.jax
        start = time.perf_counter()
        lowered = self.step.lower(self.state, self.tokens)
        lowered_at = time.perf_counter()
        lowered.compile()
        info = {"step_lower_s": lowered_at - start, "step_compile_s": time.perf_counter() - lowered_at}
        start = time.perf_counter()
        _, self.grads = self.step.grads(self.state.params, self.tokens[0])
        jax.block_until_ready(self.grads)
        info["first_fwdbwd_s"] = time.perf_counter() - start
        for kind in ("step", "update"):
            info[f"first_{kind}_s"] = self.run(kind)
        for kind in ("fwdbwd", "step", "update"):
            self.run(kind)
        self.compile_info = info
        return info

    def run(self, kind: str) -> float:
        jax = self.jax
        start = time.perf_counter()
        if kind == "fwdbwd":
            out = self.step.grads(self.state.params, self.tokens[0])
        elif kind == "step":
            self.state, out = self.step(self.state, self.tokens)
            out = (self.state, out)
        elif kind == "update":
            params, opt_state = self.update_state
            params, opt_state, out = self.step.apply_update(params, self.grads, opt_state)
            self.update_state = type(self.update_state)(params, opt_state)
            out = (self.update_state, out)
        else:
            raise ValueError(kind)
        jax.block_until_ready(out)
        return time.perf_counter() - start


# ---- the child process ------------------------------------------------------------------------
class ChildPeers:
    """The torch peers that need a torchax-free process, driven round by round over pipes."""

    def __init__(self, spec: dict):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "train.bench.torch_peers"], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._send(json.dumps(spec))
        ready = self._receive()
        if "error" in ready:
            self.close()
            raise UserError(f"bench step: a torch peer failed to start in the child process: {ready['error']}")
        self.compile_info, self.threads, self.torch_version = ready["ready"], ready["threads"], ready["torch"]

    def _send(self, line: str):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise UserError(f"bench step: the child process of torch peers exited (status {code}) without an "
                            f"answer; its error is printed above")
        return json.loads(line)

    def round(self) -> dict:
        self._send("round")
        return self._receive()["times"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self._send("quit")
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ---- the run ------------------------------------------------------------------------------------
@dataclasses.dataclass
class BenchSettings:
    preset: str
    cfg: object                  # ModelConfig
    batch_size: int = 8
    seq_len: int = 256
    rounds: int = 5
    peers: tuple = ("eager", "compiled", "hf", "hf_compiled")
    kernels: str = "auto"
    kernel_options: str | None = None
    compute_dtype: str | None = None
    compile_backend: str = "inductor"
    seed: int = 0
    peak_n: int = 1024
    device: str = "cpu"          # "cpu": float32 everywhere; "gpu": bf16 compute (torch: autocast), CUDA


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run_bench(s: BenchSettings, log=lambda text: None) -> dict:
    """Measure everything; returns the report (rows, ratios, goals) without printing it."""
    from jax_bridge.step import StepConfig
    from torch_model.optim import OptimizerConfig
    from train.run import flops
    from train.bench.torch_peers import build_torch_contender, settled, time_round, warm_up

    opt_cfg = OptimizerConfig()
    step_cfg = StepConfig(kernels=s.kernels, compute_dtype=s.compute_dtype, kernel_options=s.kernel_options)
    if step_cfg.platform != s.device:
        raise UserError(f"--device {s.device}: this host's JAX platform is {step_cfg.platform!r}")
    if s.device not in ("cpu", "gpu"):
        raise UserError(f"--device must be cpu or gpu, found {s.device!r}")
    # The torch peers compute as ours does: float32, or bf16 autocast over float32 master weights.
    autocast = None if step_cfg.compute_dtype == "float32" else step_cfg.compute_dtype
    torch_device = "cuda" if s.device == "gpu" else "cpu"
    tokens = bench_tokens(s.cfg.vocab_size, s.batch_size, s.seq_len, s.seed)
    load = {"start": _loadavg()}

    log(f"bench step: compiling ours ({s.preset}, batch {s.batch_size} x {s.seq_len})")
    ours = OursContender(s.cfg, tokens, opt_cfg=opt_cfg, kernels=s.kernels, kernel_options=s.kernel_options,
                         compute_dtype=s.compute_dtype, seed=s.seed)
    compile_info = {"ours": ours.warm_up()}
    local = {}
    if "eager" in s.peers or any(p in CHILD_PEERS for p in s.peers):
        log("bench step: warming up eager (this process)")
        import torch
        local["eager"] = build_torch_contender("eager", s.cfg, tokens, opt_cfg=opt_cfg, seed=s.seed, device=torch_device,
                                               autocast_dtype=getattr(torch, autocast) if autocast else None)
        compile_info["eager"] = warm_up(local["eager"])
    child = None
    child_peers = [p for p in s.peers if p in CHILD_PEERS]
    try:
        if child_peers:
            log(f"bench step: starting the child process for {', '.join(child_peers)} (compiles first)")
            spec = dict(model=s.cfg.to_dict(), batch_size=s.batch_size, seq_len=s.seq_len, seed=s.seed,
                        peers=["eager", *child_peers], optimizer=dataclasses.asdict(opt_cfg), device=torch_device,
                        autocast_dtype=autocast, compile_backend=s.compile_backend, threads=None)
            child = ChildPeers(spec)
            compile_info.update({f"{k}@child" if k == "eager" else k: v for k, v in child.compile_info.items()})
        rounds, peaks, load["rounds"] = [], [], []
        for r in range(s.rounds):
            times = {}
            parent_first = r % 2 == 0     # alternate which process goes first, against drift

            def parent_round():
                times["ours"] = {kind: settled(ours.run, kind) for kind in (*KINDS, "update")}
                times.update(time_round(local))

            def child_round():
                if child is not None:
                    got = child.round()
                    times["eager@child"] = got.pop("eager")
                    times.update(got)

            for part in ((parent_round, child_round) if parent_first else (child_round, parent_round)):
                part()
            peaks.append(flops.measure_matmul_peak(step_cfg.compute_dtype, n=s.peak_n, repeats=4))
            load["rounds"].append(_loadavg())
            rounds.append(times)
            ms = lambda name, kind: f"{times[name][kind] * 1e3:.0f}" if name in times else "-"   # noqa: E731
            log(f"bench step: round {r + 1}/{s.rounds}: ours fwd+bwd {ms('ours', 'fwdbwd')} ms, step "
                f"{ms('ours', 'step')} ms; eager step {ms('eager', 'step')} ms; load {load['rounds'][-1]}")
    finally:
        if child is not None:
            child.close()
    load["end"] = _loadavg()
    report = summarize(s, rounds, peaks, compile_info, load, child, step_cfg.compute_dtype)
    if s.device == "gpu":     # MFU against the data sheet's dense peak; the measured matmul is kept beside it
        import jax
        published = flops.published_peak(jax.devices()[0].device_kind, step_cfg.compute_dtype)
        if published is None:
            raise UserError(f"bench step --device gpu: no published peak for {jax.devices()[0].device_kind!r} "
                            f"in train/run/flops.py GPU_PEAKS")
        report = summarize(s, rounds, [published[0]], compile_info, load, child, step_cfg.compute_dtype,
                           peak_source=published[1])
        report["measured_matmul_peak_rounds"] = peaks
    return report


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(s: BenchSettings, rounds: list[dict], peaks: list[float], compile_info: dict, load: dict, child,
              compute_dtype: str = "float32", peak_source: str | None = None) -> dict:
    """Medians, paired ratios, MFU and goals from the per-round times."""
    from train.run import flops

    peak = _median(peaks)
    tokens = s.batch_size * s.seq_len
    per_token = flops.flops_per_token(s.cfg, s.seq_len)

    def series(name, kind):
        return [r[name][kind] for r in rounds if name in r]

    def paired(peer, kind):
        """Per round: peer time / ours time, a child peer paired through eager."""
        out = []
        for r in rounds:
            if peer not in r:
                continue
            t = r[peer][kind]
            if peer in CHILD_PEERS:
                t = t / r["eager@child"][kind] * r["eager"][kind]
            out.append(t / r["ours"][kind])
        return out

    rows = []
    names = ["ours", *[p for p in ("eager", *CHILD_PEERS) if rounds and p in rounds[0]]]
    if rounds and "eager@child" in rounds[0]:
        names.append("eager@child")
    for name in names:
        row = {"contender": name, "process": "child" if name in CHILD_PEERS or name == "eager@child" else "parent",
               "what": "lowered JAX step (TrainStep), Muon+AdamW" if name == "ours" else TORCH_PEERS[name.split("@")[0]],
               "compile": compile_info.get(name, {})}
        for kind in (*KINDS, "update"):
            t = _median(series(name, kind)) if name == "ours" or kind != "update" else None
            row[f"{kind}_s"] = t
            row[f"{kind}_rounds_s"] = series(name, kind) if t is not None else None
            if t is not None and kind != "update":
                row[f"{kind}_tokens_per_s"] = tokens / t
                row[f"{kind}_mfu"] = flops.mfu(tokens / t, s.cfg, s.seq_len, peak) if peak else None
        if name not in ("ours", "eager@child"):
            for kind in KINDS:
                ratios = paired(name, kind)
                row[f"{kind}_ours_speedup"] = _median(ratios)
                row[f"{kind}_ours_speedup_rounds"] = ratios
        rows.append(row)

    by = {r["contender"]: r for r in rows}
    parts = [r["ours"]["step"] / (r["ours"]["fwdbwd"] + r["ours"]["update"]) for r in rounds]
    measured = {
        "fwdbwd_vs_hf": by.get("hf", {}).get("fwdbwd_ours_speedup"),
        "fwdbwd_vs_hf_compiled": by.get("hf_compiled", {}).get("fwdbwd_ours_speedup"),
        "fwdbwd_vs_compiled": by.get("compiled", {}).get("fwdbwd_ours_speedup"),
        "fwdbwd_mfu": by["ours"].get("fwdbwd_mfu"),
        "step_over_parts": _median(parts),
        "step_vs_eager": by.get("eager", {}).get("step_ours_speedup"),
    }
    goals = {}
    for key, (text, target) in GOALS.items():
        value = measured[key]
        met = None if value is None else (value <= target if key == "step_over_parts" else value >= target)
        goals[key] = {"goal": text, "target": target, "measured": value, "met": met}
    return dict(
        preset=s.preset, model=s.cfg.to_dict(), shape={k: getattr(s.cfg, k) for k in ("d_model", "n_layers", "n_experts",
                                                                                    "vocab_size")},
        batch_size=s.batch_size, seq_len=s.seq_len, rounds=s.rounds,
        tokens_per_step=tokens, flops_per_token=per_token, peak_flops=peak, peak_rounds=peaks,
        compute_dtype=compute_dtype, device=s.device,
        peak_source=peak_source or f"median over rounds of the best of 4 jitted {s.peak_n}^3 {compute_dtype} matmuls "
                                   "(train/run/flops.py measure_matmul_peak), measured between the rounds",
        kernels=s.kernels, kernel_options=s.kernel_options, compile_backend=s.compile_backend, load_average=load,
        torch_threads_child=getattr(child, "threads", None), step_over_parts_rounds=parts,
        rows=rows, goals=goals)


# ---- output -------------------------------------------------------------------------------------
def _fmt(value, scale=1.0, digits=0, suffix=""):
    return "-" if value is None else f"{value * scale:,.{digits}f}{suffix}"


def _first_call(row) -> str:
    c = row["compile"]
    if not c:
        return "-"
    if "step_compile_s" in c:
        return (f"lower {c['step_lower_s']:.1f} + compile {c['step_compile_s']:.1f} s; first fwd+bwd "
                f"{c['first_fwdbwd_s']:.1f} s")
    return f"first fwd+bwd {c['first_fwdbwd_s']:.1f} s, step {c['first_step_s']:.1f} s"


def format_report(rep: dict) -> str:
    header = ["contender", "fwd+bwd ms", "step ms", "update ms", "tokens/s (step)", "MFU fwd+bwd", "MFU step",
              "ours faster: fwd+bwd", "ours faster: step", "compile / first calls"]
    body = []
    for row in rep["rows"]:
        body.append([row["contender"], _fmt(row["fwdbwd_s"], 1e3), _fmt(row["step_s"], 1e3),
                     _fmt(row.get("update_s"), 1e3), _fmt(row.get("step_tokens_per_s")),
                     _fmt(row.get("fwdbwd_mfu"), 100, 1, "%"), _fmt(row.get("step_mfu"), 100, 1, "%"),
                     _fmt(row.get("fwdbwd_ours_speedup"), 1, 2, "x"), _fmt(row.get("step_ours_speedup"), 1, 2, "x"),
                     _first_call(row)])
    shape = rep["shape"]
    out = [f"bench step: {rep['preset']} (d_model {shape['d_model']}, {shape['n_layers']} layers, "
           f"{shape['n_experts']} experts, vocab {shape['vocab_size']}), batch {rep['batch_size']} x "
           f"{rep['seq_len']}, {rep['compute_dtype']} on {rep['device']}, {rep['rounds']} interleaved rounds (medians); "
           f"peak {rep['peak_flops'] / 1e9:,.1f} GFLOP/s ({rep['peak_source'].split(' (')[0]}); load average "
           f"{rep['load_average']['start']} -> "
           f"{rep['load_average']['end']}",
           markdown_table(header, body), ""]
    out.append(f"ours step / (fwd+bwd + update alone) = {_fmt(rep['goals']['step_over_parts']['measured'], 1, 3)} "
               "(median of per-round ratios). 'ours faster' = peer time / ours time, paired per round "
               "(child peers through eager).")
    for g in rep["goals"].values():
        value = g["measured"]
        shown = "-" if value is None else (f"{value * 100:.1f}%" if "peak" in g["goal"] else f"{value:.2f}")
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        out.append(f"  goal: {g['goal']}: {shown} -> {verdict}")
    return "\n".join(out)


# ---- CLI ----------------------------------------------------------------------------------------
def parse_model_overrides(text: str | None) -> dict:
    """`d_model=64,n_layers=2` -> typed ModelConfig field values (typed like each field's default)."""
    from torch_model.config import ModelConfig

    if not text:
        return {}
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    out = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in defaults or isinstance(defaults[key], tuple) or defaults[key] is None:
            raise UserError(f"--model: expected FIELD=VALUE items of ModelConfig number fields; found {item!r}")
        try:
            out[key] = type(defaults[key])(value)
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(type(defaults[key]), type(defaults[key]).__name__)
            raise UserError(f"--model: {key} must be {kind}, found {value!r}") from None
    return out


def add_arguments(parser) -> None:
    from formats.model_checks import add_module_arguments

    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    add_module_arguments(parser, "time your own nn.Module instead (as train --module: path/to/file.py:NAME or "
                                 "package.module:NAME); its torch peers run the module's own forward and loss "
                                 "(eager, compiled), the transformers peers do not apply", args_default="none")
    parser.add_argument("--model", default=None, metavar="FIELD=VALUE,...",
                        help="override ModelConfig fields of the preset, e.g. d_model=64,n_layers=2")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step (default: 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the preset's)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (default: 5)")
    parser.add_argument("--peers", default=",".join(TORCH_PEERS),
                        help=f"comma-separated torch peers of {','.join(TORCH_PEERS)} (default: all)")
    parser.add_argument("--kernels", default="auto", help="kernel choice for ours, as for train (default: auto)")
    parser.add_argument("--kernel-options", default=None,
                        help="per-implementation options for ours, as for train, e.g. moe.xla.block_m=64")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled peers (default: inductor; aot_eager is quick)")
    parser.add_argument("--seed", type=int, default=0, help="weights and tokens seed (default: 0)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="cpu: float32 (default); gpu: bf16 compute with float32 master weights, torch peers "
                             "on CUDA under autocast, MFU against the GPU's published dense bf16 peak")
    parser.add_argument("--peak-n", type=int, default=None,
                        help="side of the square matmul whose rate is measured each round (default: 1024; gpu 8192)")
    parser.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")


def settings_from_args(args) -> BenchSettings:
    from torch_model.config import ConfigError, get_preset

    for name in ("batch_size", "seq_len", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, found {value}")
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip()) if args.peers else ()
    bad = [p for p in peers if p not in TORCH_PEERS]
    if bad:
        raise UserError(f"--peers: unknown peer(s) {', '.join(bad)}; choose from {', '.join(TORCH_PEERS)}")
    if args.module_args and not args.module:
        raise UserError("--module-args: the keyword arguments of --module; give --module")
    if args.module:
        if args.model:
            raise UserError("--module: --model overrides a preset's fields; a module's shape is its --module-args")
        given_peers = args.peers != ",".join(TORCH_PEERS)
        hf = [p for p in peers if p.startswith("hf")]
        if hf and given_peers:
            raise UserError(f"--peers {','.join(hf)}: transformers' GptOss is a peer of our preset, not of a module")
        peers = tuple(p for p in peers if not p.startswith("hf"))
        from formats.model_checks import module_record

        seq_len = args.seq_len or 256
        cfg = module_record(args.module, args.module_args or {}, seq_len)
        return BenchSettings(preset=args.module, cfg=cfg, batch_size=args.batch_size, seq_len=seq_len,
                             rounds=args.rounds, peers=peers, kernels=args.kernels, kernel_options=args.kernel_options,
                             compile_backend=args.compile_backend, seed=args.seed, device=args.device,
                             peak_n=args.peak_n or (8192 if args.device == "gpu" else 1024))
    try:
        cfg = get_preset(args.preset)
        seq_len = args.seq_len or cfg.max_seq_len
        cfg = cfg.replace(**parse_model_overrides(args.model), max_seq_len=max(seq_len, cfg.max_seq_len))
    except ConfigError as e:
        raise UserError(str(e)) from None
    return BenchSettings(preset=args.preset + (f" ({args.model})" if args.model else ""), cfg=cfg,
                         batch_size=args.batch_size, seq_len=seq_len, rounds=args.rounds, peers=peers,
                         kernels=args.kernels, kernel_options=args.kernel_options,
                         compile_backend=args.compile_backend, seed=args.seed,
                         device=args.device, peak_n=args.peak_n or (8192 if args.device == "gpu" else 1024))


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run(args) -> int:
    from train.bench.machine import machine_info

    settings = settings_from_args(args)
    started, commit = time.perf_counter(), _commit()       # the code that runs: HEAD at the start
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    report = run_bench(settings, log=lambda text: print(text, file=sys.stderr, flush=True))
    report.update(command="torchlyra bench step " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "step"] else []),
                  date=date, machine=machine_info(), commit=commit, elapsed_s=round(time.perf_counter() - started, 1))
    print(format_report(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}")
    return 0
