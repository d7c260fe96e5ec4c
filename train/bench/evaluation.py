"""`torchlyra bench eval`: multiple-choice scoring speed, our lm-eval backend (the compiled scorer)
against lm-eval's own `hf` backend, side by side in one run on the same exported model, the
same task requests and the same batch size.

Both answer the same lm-eval `Instance`s (a local multiple-choice task, built by lm-eval from a
JSON file) through `LM.loglikelihood`; examples per second = task documents over the median time
of interleaved repetitions. Our programs are compiled in an untimed first call (compile time is
reported apart); the per-request log-likelihoods of the two are compared as well.
"""
from __future__ import annotations

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

GOAL = 3.0          # our examples/s vs the hf backend's
WORDS = ("the king queen night light love death sword crown blood heart soul fair foul sweet sorrow honour "
         "grace tomorrow yesterday speak hear see come go stay fly fall rise weep laugh dream sleep wake "
         "lord lady good noble gentle cruel false true old young what where when why how thou thee thy "
         "my mine our your his her their is was be not no yes").split()


def add_arguments(parser) -> None:
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint with a tokenizer (default: --preset, random weights, a BPE trained on "
                             "the task's text)")
    parser.add_argument("--preset", default="tiny", help="preset when no --checkpoint (default tiny)")
    parser.add_argument("--examples", type=int, default=100, help="multiple-choice documents (default 100)")
    parser.add_argument("--choices", type=int, default=4, help="choices per document (default 4)")
    parser.add_argument("--shots", type=int, default=0,
                        help="solved examples before each question, from a separate split, as few-shot tasks "
                             "(CORE: 10) run (default 0)")
    parser.add_argument("--batch-sizes", default="1,16",
                        help="comma-separated rows per forward, the same for both backends (default 1,16)")
    parser.add_argument("--max-length", type=int, default=None, help="window (default: the model's max_seq_len)")
    parser.add_argument("--kernels", default="auto", help="our kernels, as for `train --kernels` (default auto)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per backend (median; default 3)")
    parser.add_argument("--hf-threads", type=int, default=None,
                        help="torch threads for the hf backend (default: the faster of 1 and torch's default, "
                             "timed on the first requests)")


def faster_thread_count(lm, instances, log, default: int) -> int:
    """The faster torch thread count (1 or `default`, torch's own) for the hf backend on the first requests
    (after an untimed call): on a machine whose cores are shared, extra threads can make torch
    much slower."""
    import torch

    seconds = {}
    lm.loglikelihood(instances, disable_tqdm=True)      # untimed: first-call costs
    for threads in sorted({1, default}, reverse=True):
        torch.set_num_threads(threads)
        t = time.perf_counter()
        lm.loglikelihood(instances, disable_tqdm=True)
        seconds[threads] = time.perf_counter() - t
    best = min(seconds, key=seconds.get)
    torch.set_num_threads(best)
    log("hf threads: " + ", ".join(f"{t}: {s:.2f} s" for t, s in seconds.items()) + f" -> {best}")
    return best


def synthetic_task(directory: Path, examples: int, choices: int, shots: int = 0, seed: int = 0) -> str:
    """A local lm-eval multiple-choice task (JSON data, YAML config) of random sentences:
    questions of 12-40 words, answers of 3-15; with `shots`, each question follows that many
    solved ones (lm-eval's few-shot prompt, drawn from a split of its own). Returns the task name."""
    rng = np.random.default_rng(seed)
    sentence = lambda lo, hi: " ".join(rng.choice(WORDS, rng.integers(lo, hi + 1)))
    doc = lambda: {"question": sentence(12, 40).capitalize() + ".", "choices": [sentence(3, 15) for _ in range(choices)],
                   "gold": int(rng.integers(choices))}
    splits = {"test": [doc() for _ in range(examples)], "train": [doc() for _ in range(max(shots, 1) * 4)]}
    files = ""
    for split, docs in splits.items():
        (directory / f"bench_mc_{split}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        files += f"    {split}: {directory / f'bench_mc_{split}.jsonl'}\n"
    (directory / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{files}test_split: test\n"
        f"fewshot_split: train\nnum_fewshot: {shots}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n")
    return "bench_mc"


def task_instances(task_dir: Path, name: str) -> list:
    """The task's loglikelihood requests as lm-eval builds them."""
    from lm_eval.tasks import TaskManager, get_task_dict

    task = get_task_dict([name], TaskManager(include_path=str(task_dir), include_defaults=False))[name]
    task.build_all_requests(rank=0, world_size=1)
    return list(task.instances)


def exported_model(args, workdir: Path, task_dir: Path) -> tuple[Path, str]:
    """(Hugging Face directory both backends load, description of the weights)."""
    import torch

    from formats.hf_export import export_checkpoint
    from torch_model.config import ConfigError, get_preset
    from torch_model.model import GptOssForCausalLM
    from formats.checkpoint import save_checkpoint
    from formats.tokenizer import train_bpe

    if args.checkpoint:
        checkpoint, source = Path(args.checkpoint), f"checkpoint {args.checkpoint}"
        from formats.checkpoint import find_checkpoint, read_meta

        if hasattr(read_meta(find_checkpoint(checkpoint))[1], "facts"):
            raise UserError(f"--checkpoint {checkpoint}: a module model (train --module); bench eval scores our "
                            f"backend beside lm-eval's hf backend on the same transformers GptOss weights, which a "
                            f"module has not: score it with `torchlyra eval --tasks` or `torchlyra lm-eval`")
    else:
        try:
            cfg = get_preset(args.preset)
        except ConfigError as e:
            raise UserError(str(e)) from None
        text = [json.loads(line)["question"] for line in (task_dir / "bench_mc_test.jsonl").open()]
        enc = train_bpe(text, min(cfg.vocab_size, 1024))
        bos = enc._special_tokens["<|bos|>"]
        cfg = cfg.replace(bos_token_id=bos, eos_token_id=bos)
        torch.manual_seed(0)
        checkpoint, source = workdir / "checkpoint", f"preset {args.preset}, random weights (seed 0)"
        save_checkpoint(checkpoint, GptOssForCausalLM(cfg).state_dict(), cfg, tokenizer=enc)
    export_checkpoint(checkpoint, workdir / "hf")
    return workdir / "hf", source


def measure(instances, hf_dir: Path, batch_size: int, args, log) -> dict:
    """Both backends at one batch size: median seconds over interleaved repeats, compile time,
    the two sets of answers and the torch threads hf ran on."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from train.evaluation.lm_eval_backend import TorchlyraLM

    ours = TorchlyraLM(checkpoint=str(hf_dir), kernels=args.kernels, batch_size=batch_size, max_length=args.max_length)
    ours.scorer.progress = False
    hf = HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=batch_size, device="cpu", max_length=ours.max_length)
    if args.hf_threads is not None:
        torch.set_num_threads(args.hf_threads)
    else:
        faster_thread_count(hf, instances[:2 * batch_size], log, args.torch_default_threads)
    backends = {"torchlyra": ours, "hf": hf}
    answers, seconds = {}, {n: [] for n in backends}
    for name, lm in backends.items():       # untimed: our compilation, first-call costs
        answers[name] = lm.loglikelihood(instances, disable_tqdm=True)
    for rep in range(args.repeats):
        for name in list(backends) if rep % 2 == 0 else list(backends)[::-1]:
            t = time.perf_counter()
            backends[name].loglikelihood(instances, disable_tqdm=True)
            seconds[name].append(time.perf_counter() - t)
        log(f"batch {batch_size}, repeat {rep + 1}/{args.repeats}: "
            + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()))
    lengths = [(len(ours.tok_encode(i.args[0])), len(ours.tok_encode(i.args[1]))) for i in instances]
    return {"seconds": seconds, "answers": answers, "compilations": ours.scorer.compilations, "lengths": lengths,
            "hf_threads": torch.get_num_threads(), "window": ours.max_length, "kernels": dict(ours.scorer.kernels),
            "cfg": ours.cfg}


def run(args) -> int:
    import torch

    from train.bench.machine import machine_info

    if args.shots < 0:
        raise UserError(f"--shots must be >= 0, found {args.shots}")
    for name in ("examples", "choices", "repeats", "hf_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, found {getattr(args, name)}")
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        batch_sizes = []
    if not batch_sizes or min(batch_sizes) < 1:
        raise UserError(f"--batch-sizes: expected comma-separated positive integers, found {args.batch_sizes!r}")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    args.torch_default_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        workdir = Path(tmp)
        (workdir / "tasks").mkdir()
        name = synthetic_task(workdir / "tasks", args.examples, args.choices, args.shots)
        hf_dir, source = exported_model(args, workdir, workdir / "tasks")
        instances = task_instances(workdir / "tasks", name)
        results = {b: measure(instances, hf_dir, b, args, log) for b in batch_sizes}
    docs = len({i.doc_id for i in instances})
    rows = []
    for batch, r in results.items():
        median = {n: statistics.median(s) for n, s in r["seconds"].items()}
        ours, hf = r["answers"]["torchlyra"], r["answers"]["hf"]
        rows.append({"batch": batch, "torchlyra_examples_per_s": docs / median["torchlyra"],
                     "hf_examples_per_s": docs / median["hf"], "ratio": median["hf"] / median["torchlyra"],
                     "seconds_each": r["seconds"], "hf_threads": r["hf_threads"],
                     "compile_s": sum(c.seconds for c in r["compilations"]), "buckets": len(r["compilations"]),
                     "max_rel_difference": max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(ours, hf)),
                     "same_greedy": sum(a[1] == b[1] for a, b in zip(ours, hf)) / len(instances)})
    last = results[batch_sizes[-1]]
    elapsed, load = time.perf_counter() - started, [round(load_before, 1), round(os.getloadavg()[0], 1)]
    met = all(r["ratio"] >= GOAL for r in rows)

    print(format_table(rows))
    print(f"goal: torchlyra >= {GOAL:.0f}x hf's examples/s at every batch size: {'met' if met else 'NOT met'}")
    context_tokens, answer_tokens = (statistics.mean(n) for n in zip(*last["lengths"]))
    print(f"{docs} documents x {args.choices} choices = {len(instances)} loglikelihood requests "
          f"({args.shots}-shot; on average {context_tokens:.0f} context and {answer_tokens:.1f} answer tokens); window "
          f"{last['window']}; {source}; float32; our kernels: "
          + ", ".join(f"{op}={impl}" for op, impl in last["kernels"].items())
          + f"; {elapsed:.0f} s in all; load average {load[0]} -> {load[1]} on {os.cpu_count()} cores; "
          f"medians of {args.repeats} interleaved repeats; compile time (ours, untimed) apart")
    if args.json:
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        report = dict(date=date, machine=machine_info(), weights=source, model=last["cfg"].to_dict(), documents=docs,
                      shots=args.shots, mean_context_tokens=context_tokens, mean_answer_tokens=answer_tokens,
                      requests=len(instances), window=last["window"], kernels=last["kernels"], goal=GOAL, met=met,
                      load_average_start_end=load, rows=rows)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def format_table(rows: list[dict]) -> str:
    header = ["batch", "torchlyra examples/s", "hf examples/s", "ratio", "hf threads", "our compile s (buckets)",
              "max rel. diff", "same greedy"]
    body = [[str(r["batch"]), f"{r['torchlyra_examples_per_s']:.1f}", f"{r['hf_examples_per_s']:.1f}",
             f"{r['ratio']:.2f}x", str(r["hf_threads"]), f"{r['compile_s']:.1f} ({r['buckets']})",
             f"{r['max_rel_difference']:.1e}", f"{100 * r['same_greedy']:.0f}%"] for r in rows]
    return markdown_table(header, body)
