"""Peak anonymous memory (RssAnon) per process of torchlyra commands on a synthetic released-layout
gpt-oss directory, one process or several forming a cluster, against the bound the loader holds to: half
(or 1/N) of the parameters' bytes in the compute dtype + 0.5 GiB above the interpreter's baseline.

    python scripts/command_memory.py WORKDIR [--layers 2] [--experts 32] [--vocab 201088] [--processes 2]
        [--train-mesh MESH] [--train-args "--remat full"] [--generate-meshes "fsdp=2;tensor=2"]
        [--base-dtype compute|mxfp4] [--only NAME]

The commands: `train --init-from --lora` (writing WORKDIR/lora), `generate` on each mesh, `eval
--tasks` (a four-question task file; validation loss runs in one process only) on the first of
them, `lm-eval` (the same questions as an lm-eval task; compute dtype only) on it, `generate
--merge` of that LoRA checkpoint, and `export` of it merged (one process: its bound is the whole
model + 0.5 GiB).

Each command runs as its own process(es); this parent samples /proc/<pid>/status of every process
of each one's tree every 10 ms (a multi-process `train` runs under its supervisor: the child counts;
the tree is re-read every 0.1 s: walking /proc took 1.3 ms a time, a fifth of a core at 10 ms).
The baseline is the RssAnon of a process that imported what the commands import (torch, jax,
transformers, peft, orbax, the CLI) and started JAX's CPU backend; safetensors' and tensorstore's
file-backed pages do not count in RssAnon.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_memory import WRITE  # noqa: E402  (the synthetic released directory)

BASELINE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import jax, torch, transformers, peft, orbax.checkpoint  # noqa: F401
import train.cli  # noqa: F401
jax.devices()
for line in open("/proc/self/status"):
    if line.startswith("RssAnon:"):
        print("RSSANON", int(line.split()[1]) * 1024)
"""


def write_released(out: Path, layers: int, overrides: dict) -> None:
    """A released-layout directory (MXFP4 experts, bf16 rest, random values) of gpt-oss-20b's
    shapes with `overrides` (e.g. fewer experts, a smaller vocabulary)."""
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-c", WRITE, str(out), str(layers), str(ROOT), json.dumps(overrides)],
                       check=True)


def param_bytes(hf_dir: Path, dtype_bytes: int = 4) -> int:
    """The model's parameters in a compute dtype of `dtype_bytes` bytes (float32: 4)."""
    from formats.hf_model import open_hf

    _, weights = open_hf(hf_dir)
    return sum(int(__import__("math").prod(e.shape)) for e in weights.entries.values()) * dtype_bytes


def baseline(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", BASELINE, str(ROOT)], env=env, check=True, capture_output=True,
                         text=True).stdout
    return int(next(line for line in out.splitlines() if line.startswith("RSSANON")).split()[1])


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc/*/stat parents)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TREE_EVERY_S = 0.1       # how often `run` re-reads each command's process tree (its RssAnon: every 10 ms)
LOADED = "stored bytes onto its devices"      # what train and generate print once the weights are placed


def run(argvs: list[list[str]], env: dict, log_dir: Path, timeout_s: float = 900) -> list[tuple[int, int, int]]:
    """Run one `torchlyra` process per argv (together: a cluster), each sampled with its tree;
    returns each one's (peak RssAnon while loading: until its log says LOADED, peak of the whole
    run, exit code), its largest process's; the output of a process that fails is printed."""
    logs = [(log_dir / f"process{i}.log").open("w+") for i in range(len(argvs))]
    procs = [subprocess.Popen([sys.executable, "-m", "train.cli", *argv], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, text=True) for argv, log in zip(argvs, logs)]
    peaks, loading = [0] * len(procs), [None] * len(procs)
    deadline = time.monotonic() + timeout_s
    trees, read_at = [], -TREE_EVERY_S
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"commands still running after {timeout_s:.0f} s")
            if time.monotonic() - read_at >= TREE_EVERY_S:
                trees, read_at = [_tree(p.pid) for p in procs], time.monotonic()
            for i, p in enumerate(procs):
                if p.poll() is None:
                    peaks[i] = max([peaks[i], *(_rss_anon(q) for q in trees[i])])
                if loading[i] is None and LOADED in (log_dir / f"process{i}.log").read_text(errors="replace"):
                    loading[i] = peaks[i]
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        if p.returncode != 0:
            print(f"process {i} exited {p.returncode} (137: killed, out of memory):\n{log.read()[-1500:]}",
                  file=sys.stderr)
    return [(load or 0, peak, p.returncode) for load, peak, p in zip(loading, peaks, procs)]


def cluster(argv: list[str], processes: int) -> list[list[str]]:
    """The same command for each of `processes` processes on this host (one CPU device each)."""
    if processes == 1:
        return [argv]
    port = free_port()
    return [[*argv, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i)]
            for i in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--only", default="", help="run only the commands whose names start with this, e.g. generate")
    parser.add_argument("--train-mesh", default="", help="train's --mesh (default: every device on fsdp)")
    parser.add_argument("--train-args", default="", help="more flags for train, e.g. '--remat full'")
    parser.add_argument("--base-dtype", default="compute", choices=("compute", "mxfp4"),
                        help="mxfp4: train and generate with the experts kept as released")
    parser.add_argument("--generate-meshes", default="fsdp=2;tensor=2",
                        help="meshes to generate on, ';'-separated (each must use every device)")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf = work / "hf"
    ids = {} if args.vocab > 200002 else {"bos_token_id": 0, "eos_token_id": 1}
    write_released(hf, args.layers, {"n_experts": args.experts, "vocab_size": args.vocab, **ids})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    if not (work / "data").is_dir():
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import prepare_play_corpus
        prepare_play_corpus(work)
    if not (hf / "tiktoken").is_dir():          # the data's tokenizer, as our exports carry one
        from formats.tokenizer import load_tokenizer, save_tokenizer
        save_tokenizer(load_tokenizer(work / "data"), hf / "tiktoken")
    base, params = baseline(env), param_bytes(hf, 4 if args.compute_dtype == "float32" else 2)
    bound = params / args.processes + 0.5 * 2**30
    commands = {
        "train --init-from --lora": ["train", "--init-from", str(hf), "--lora", "r=4,alpha=8,targets=attention",
                                     "--data", str(work / "data"), "--out", str(work / "lora"), "--steps", "1",
                                     "--batch-size", str(2 * args.processes), "--seq-len", "16", "--samples", "0",
                                     "--eval-batches", "1", "--compute-dtype", args.compute_dtype,
                                     *(["--mesh", args.train_mesh] if args.train_mesh else []),
                                     "--base-dtype", args.base_dtype, *args.train_args.split()],
    }
    for mesh in args.generate_meshes.split(";"):
        commands[f"generate --mesh {mesh}"] = [
            "generate", "--checkpoint", str(hf), "--prompt", "ROMEO:", "--max-tokens", "8", "--temperature", "0",
            "--no-stream", "--mesh", mesh, "--base-dtype", args.base_dtype]
    eval_mesh = args.generate_meshes.split(";")[0]      # eval, lm-eval and --merge run on the first
    tasks = work / "tasks.jsonl"
    questions = [{"context": f"{who}:", "choices": ["But soft", "O Romeo", "To be"], "gold": i % 3}
                 for i, who in enumerate(("ROMEO", "JULIET", "HAMLET", "NURSE"))]
    tasks.write_text("".join(json.dumps(q) + "\n" for q in questions))
    commands[f"eval --tasks FILE.jsonl --mesh {eval_mesh}"] = [
        "eval", "--checkpoint", str(hf), "--tasks", str(tasks), "--mesh", eval_mesh, "--base-dtype", args.base_dtype,
        "--no-progress"]
    lm_tasks = work / "lm_tasks"
    lm_tasks.mkdir(exist_ok=True)
    (lm_tasks / "memory_mc.yaml").write_text(
        f"task: memory_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\nmetric_list:\n  - metric: acc\n')
    if args.base_dtype == "compute":           # the lm-eval backend takes no base dtype
        commands[f"lm-eval --model_args checkpoint=HF,mesh={eval_mesh}"] = [
            "lm-eval", "--model_args", f"checkpoint={hf},mesh={eval_mesh.replace(',', ':')}", "--tasks", "memory_mc",
            "--include_path", str(lm_tasks), "--batch_size", "4"]
    commands[f"generate --merge --mesh {eval_mesh} (the LoRA run's checkpoint)"] = [
        "generate", "--checkpoint", str(work / "lora"), "--merge", "--prompt", "ROMEO:", "--max-tokens", "8",
        "--temperature", "0", "--no-stream", "--mesh", eval_mesh, "--base-dtype", args.base_dtype]
    # One process: export writes one file set, holding at most one output shard (its bound: the whole model + 0.5 GiB).
    commands["export --checkpoint WORK/lora (merged, one process)"] = [
        "export", "--checkpoint", str(work / "lora"), "--out", str(work / "exported")]
    gib = 2**30
    print(f"{args.layers} layers, {args.experts} experts, vocab {args.vocab}: parameters {params / gib:.2f} GiB in "
          f"{args.compute_dtype}; baseline RssAnon {base / gib:.2f} GiB; bound per process {bound / gib:.2f} GiB above it")
    import shutil
    if "train".startswith(args.only):
        shutil.rmtree(work / "lora", ignore_errors=True)
    for name, argv in commands.items():
        if not name.startswith(args.only):
            continue
        if ("--merge" in argv or argv[0] == "export") and not (work / "lora").is_dir():
            print(f"{name}: skipped (no LoRA run in {work}: run without --only first)")
            continue
        if argv[0] == "export":
            shutil.rmtree(work / "exported", ignore_errors=True)
        peaks = run(cluster(argv, 1 if argv[0] == "export" else args.processes), env, work)
        print(f"{name}: " + "; ".join(
            f"process {i} " + (f"{(load - base) / gib:.2f} GiB loading, " if load else "")
            + f"{(peak - base) / gib:.2f} GiB whole run"
            + ("" if code == 0 else f" (exit {code})") for i, (load, peak, code) in enumerate(peaks))
            + " (above the baseline)")


if __name__ == "__main__":
    main()
