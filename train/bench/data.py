"""`torchlyra bench data`: data preparation and loading throughput, each beside its reference,
measured in one run on the same cores.

- prepare: the same text (the bundled plays repeated to --data-mb MB, written as JSONL) tokenized
  by raw tiktoken `encode_ordinary_batch` (texts already in memory, --data-workers threads: the
  reference) and by `torchlyra prepare --workers W` end to end (process start, reading, JSON,
  tokenizing, ordered merge, writing shards + manifest). Runs alternate; the ratio is the median
  over pairs, in wall time and in CPU time (all threads and processes; on a shared machine the
  CPU ratio is the steadier one). Goal: prepare >= 80% of raw tiktoken. The bpe:4096 tokenizer is trained once beforehand
  and handed over as a directory, so its training is not timed.
- loader: tokens/s of TokenLoader.next_batch (prefetch on, after warm-up) at tiny's shape (seq 256)
  and Lyra Small's (seq 4096), against what `tiny` trains at here (--train-tokens-per-s, default
  2,300: `make demo` on a quiet machine, BENCHMARKS.md). Goals: >= 20x that rate
  and >= 1M tokens/s per process. Beside it, for the record, a grain pipeline over the same
  tokens (one ArrayRecord record per document, shuffle, concat-then-split packing, batch).
- start check: sha256 throughput over the shards, which sets the full-vs-sampled choice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from formats.errors import UserError

TRAIN_RATE = 2300.0  # tokens/s of `tiny` on this 2-core machine (BENCHMARKS.md, make demo)
GOALS = {"prepare_vs_raw": 0.8, "loader_x_train": 20.0, "loader_tokens_per_s": 1e6}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--data-mb", type=float, default=100.0, help="bench data: MB of text to prepare (default 100)")
    parser.add_argument("--data-workers", type=int, default=os.cpu_count() or 1,
                        help="bench data: prepare workers = raw tiktoken threads (default: one per core)")
    parser.add_argument("--data-repeats", type=int, default=3, help="bench data: runs of each side (median kept)")
    parser.add_argument("--data-seconds", type=float, default=3.0, help="bench data: seconds per loader measurement")
    parser.add_argument("--train-tokens-per-s", type=float, default=TRAIN_RATE,
                        help="bench data: what training consumes (default 2300: `tiny` here, BENCHMARKS.md)")


def _texts(megabytes: float) -> list[str]:
    from train.data import corpus

    plays = [path.read_text() for _, path in corpus.extract_plays()]
    texts, size, i = [], 0, 0
    while size < megabytes * 1e6:
        texts.append(plays[i % len(plays)])
        size += len(texts[-1].encode())
        i += 1
    return texts


def _prepare(src: Path, out: Path, tok: str, workers: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of all its processes) for `torchlyra prepare` end to end, in a
    fresh process as a user runs it."""
    cmd = [sys.executable, "-c", "import sys; from train.data.prepare import add_arguments, run; import argparse; "
           "p = argparse.ArgumentParser(); add_arguments(p); sys.exit(run(p.parse_args(sys.argv[1:])))",
           "--input", str(src), "--out", str(out), "--tokenizer", tok, "--workers", str(workers),
           "--val-fraction", "0", "--force"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes its worker processes
    if proc.returncode != 0:
        raise UserError(f"bench data: prepare failed: {proc.stderr.strip().splitlines()[-1:]}")
    return seconds, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def _raw(enc, texts: list[str], threads: int) -> tuple[float, float, int]:
    cpu, start = time.process_time(), time.perf_counter()
    ids = enc.encode_ordinary_batch(texts, num_threads=threads)
    return time.perf_counter() - start, time.process_time() - cpu, sum(len(x) for x in ids)


def bench_prepare(texts, work: Path, workers: int, repeats: int, log) -> list[dict]:
    """Raw and prepare runs alternate, so each pair meets the same load on a shared machine; the
    ratio is the median over pairs. CPU seconds (all threads and processes) are load-independent."""
    from formats import tokenizer

    src = work / "text.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    bpe_dir = work / "bpe4096"
    bpe_dir.mkdir()
    tokenizer.save_tokenizer(tokenizer.train_bpe(texts[:42], 4096), bpe_dir)  # once, untimed
    rows = []
    for name, spec in (("o200k_harmony", "o200k_harmony"), ("bpe:4096", str(bpe_dir))):
        enc = tokenizer.build_tokenizer(tokenizer.parse_spec(spec))
        raw, ours, tokens = [], [], 0
        for _ in range(repeats):
            *timing, tokens = _raw(enc, texts, workers)
            raw.append(timing)
            ours.append(_prepare(src, work / "out", spec, workers))
            log(f"prepare {name}: raw {tokens / raw[-1][0]:,.0f} tok/s ({raw[-1][1]:.1f} CPU s), "
                f"ours {tokens / ours[-1][0]:,.0f} tok/s ({ours[-1][1]:.1f} CPU s)")
        stored = json.loads((work / "out" / "manifest.json").read_text())["splits"]["train"]["tokens"]
        if stored != tokens:
            raise UserError(f"bench data: prepare stored {stored} tokens, raw tiktoken made {tokens}")
        ratio = statistics.median(r[0] / o[0] for r, o in zip(raw, ours))
        cpu_ratio = statistics.median(r[1] / o[1] for r, o in zip(raw, ours))
        rows.append({"tokenizer": name, "bytes": src.stat().st_size, "tokens": tokens, "workers": workers,
                     "raw_tokens_per_s": tokens / statistics.median(r[0] for r in raw),
                     "prepare_tokens_per_s": tokens / statistics.median(o[0] for o in ours),
                     "ratio": ratio, "cpu_ratio": cpu_ratio,
                     "raw_seconds": [r[0] for r in raw], "raw_cpu_seconds": [r[1] for r in raw],
                     "prepare_seconds": [o[0] for o in ours], "prepare_cpu_seconds": [o[1] for o in ours],
                     "goal": GOALS["prepare_vs_raw"], "meets_goal": ratio >= GOALS["prepare_vs_raw"]})
    return rows


def _rate(next_batch, seconds: float) -> float:
    for _ in range(3):
        next_batch()  # warm-up: threads started, first block planned
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += next_batch().size
    return tokens / (time.perf_counter() - start)


def _grain_rate(data_dir: Path, seq_len: int, batch: int, seconds: float) -> float:
    """A grain pipeline over the same tokens, laid out as grain expects (one record per document)."""
    import grain
    from array_record.python import array_record_module as arm
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    from train.data.shards import open_dataset

    path = data_dir / "grain-docs.array_record"
    if not path.exists():
        with open_dataset(data_dir, "train", check="size") as ds:
            writer = arm.ArrayRecordWriter(str(path), "group_size:1")
            for d in range(len(ds)):
                writer.write(ds.doc(d).astype("<i4").tobytes())
            writer.close()
    packed = (grain.MapDataset.source(ArrayRecordDataSource([str(path)])).shuffle(seed=0).repeat()
              .map(lambda raw: {"tokens": np.frombuffer(raw, "<i4")})
              .to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=64)))
    packed = grain.experimental.ConcatThenSplitIterDataset(packed, length_struct={"tokens": seq_len + 1})
    it = iter(packed.batch(batch))
    return _rate(lambda: next(it)["tokens"], seconds)


def bench_loader(data_dir: Path, train_rate: float, seconds: float, log) -> list[dict]:
    from train.data.loader import TokenLoader

    rows = []
    for label, seq_len, batch in (("tiny", 256, 8), ("lyra-small", 4096, 8)):
        loader = TokenLoader(data_dir, "train", global_batch=batch, seq_len=seq_len, check="size")
        ours = _rate(loader.next_batch, seconds)
        loader.close()
        try:
            grain_rate = _grain_rate(data_dir, seq_len, batch, seconds)
        except Exception as e:  # grain is the reference only: report its failure, do not fail the bench
            grain_rate = None
            log(f"grain pipeline failed: {type(e).__name__}: {e}")
        log(f"loader seq {seq_len}: {ours:,.0f} tok/s (grain {grain_rate or 0:,.0f})")
        rows.append({"shape": label, "seq_len": seq_len, "global_batch": batch, "processes": 1,
                     "tokens_per_s": ours, "x_train_rate": ours / train_rate, "train_tokens_per_s": train_rate,
                     "grain_tokens_per_s": grain_rate,
                     "meets_goal": ours / train_rate >= GOALS["loader_x_train"] and ours >= GOALS["loader_tokens_per_s"]})
    return rows


def bench_check(data_dir: Path) -> dict:
    from train.data import shards

    manifest = shards.read_manifest(data_dir)
    start = time.perf_counter()
    size = 0
    for entry in manifest["splits"]["train"]["shards"]:
        shards.hash_blocks(data_dir / entry["file"])
        size += entry["bytes"]
    rate = size / (time.perf_counter() - start)
    return {"sha256_bytes_per_s": rate, "bytes": size, "full_check_seconds_per_100GB": 100e9 / rate,
            "full_check_limit_bytes": shards.FULL_CHECK_BYTES, "sample_bytes": shards.SAMPLE_CHECK_BYTES,
            "sample_seconds": shards.SAMPLE_CHECK_BYTES / rate}


def format_table(result: dict) -> str:
    lines = ["| prepare | tokens | raw tiktoken tok/s | prepare tok/s | ratio (wall) | ratio (CPU) | goal >= 0.8 |",
             "|---|---|---|---|---|---|---|"]
    for r in result["prepare"]:
        lines.append(f"| {r['tokenizer']} ({r['workers']} workers) | {r['tokens']:,} | {r['raw_tokens_per_s']:,.0f} | "
                     f"{r['prepare_tokens_per_s']:,.0f} | {r['ratio']:.2f} | {r['cpu_ratio']:.2f} | "
                     f"{'yes' if r['meets_goal'] else 'NO'} |")
    lines += ["", "| loader | seq x batch | tok/s (1 process) | x tiny's training rate | grain tok/s | goal >= 20x and >= 1M |",
              "|---|---|---|---|---|---|"]
    for r in result["loader"]:
        grain = f"{r['grain_tokens_per_s']:,.0f}" if r["grain_tokens_per_s"] else "failed"
        lines.append(f"| {r['shape']} | {r['seq_len']} x {r['global_batch']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['x_train_rate']:,.0f} x tiny | {grain} | {'yes' if r['meets_goal'] else 'NO'} |")
    c = result["start_check"]
    lines += ["", f"start check: sha256 at {c['sha256_bytes_per_s'] / 1e9:.2f} GB/s -> a full check costs "
                  f"{c['full_check_seconds_per_100GB']:.0f} s per 100 GB; chosen: full up to "
                  f"{c['full_check_limit_bytes'] >> 20} MiB, else a {c['sample_bytes'] >> 20} MiB random sample "
                  f"({c['sample_seconds']:.2f} s)"]
    return "\n".join(lines)


def run(args) -> int:
    from train.bench.machine import machine_info

    if args.data_mb <= 0 or args.data_workers < 1 or args.data_repeats < 1 or args.data_seconds <= 0:
        raise UserError("bench data: --data-mb, --data-seconds must be > 0 and --data-workers, --data-repeats >= 1")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    train_rate = args.train_tokens_per_s
    started = time.perf_counter()
    texts = _texts(args.data_mb)
    with tempfile.TemporaryDirectory(prefix="torchlyra-bench-data-") as tmp:
        work = Path(tmp)
        prepare_rows = bench_prepare(texts, work, args.data_workers, args.data_repeats, log)
        # The o200k shards are the loader's input (prepare last ran bpe: redo o200k, untimed).
        _prepare(work / "text.jsonl", work / "out", "o200k_harmony", args.data_workers)
        loader_rows = bench_loader(work / "out", train_rate, args.data_seconds, log)
        check = bench_check(work / "out")
    result = {"command": "torchlyra bench data " + " ".join(sys.argv[3:]),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_info(), "elapsed_s": round(time.perf_counter() - started, 1),
              "train_tokens_per_s": train_rate, "goals": GOALS,
              "prepare": prepare_rows, "loader": loader_rows, "start_check": check}
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
