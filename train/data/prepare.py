"""`torchlyra prepare`: inputs -> tokenizer -> ArrayRecord shards + manifest, in parallel, resumable.

    torchlyra prepare                                   # Shakespeare, bpe:4096, into data/shakespeare
    torchlyra prepare --input corpus/*.jsonl.gz --tokenizer o200k_harmony --out data/web \\
        --tokens-per-shard 300000000 --workers 32
    torchlyra prepare --verify data/web                 # check a whole dataset against its manifest
    torchlyra prepare --chat --input chats.jsonl --tokenizer o200k_harmony --out data/chats
    torchlyra prepare --preferences --input pairs.jsonl --tokenizer o200k_harmony --out data/pairs

Worker processes read and tokenize work units (inputs.py); the main process merges their results
in unit order (so the output depends only on the inputs and settings, never on worker timing),
routes each document to the train or validation split, and cuts each split into shards of about
--tokens-per-shard tokens at document boundaries. At most 2 x workers units are in flight, so
memory stays bounded whatever the corpus size.

Interrupted (Ctrl-C, kill, crash), a re-run with the same inputs and settings resumes: progress.json
lists the finished shards and where each split's next shard begins; a shard is written under a
temporary name and renamed only when complete, and manifest.json is written last.

With --chat, each record's `messages` are rendered in harmony with a loss weight per token
(conversations.py), stored as a second stream of the same shards; malformed records are skipped,
named and counted (--strict: the first one is an error). With --preferences, each record is a
preference pair (TRL's prompt / chosen / rejected), one document per pair (preferences.py).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from formats.atomic import sha256_file, write_atomic
from train.data import conversations, inputs, packing, preferences, shards
from formats import tokenizer, tokenizer_json
from formats.errors import UserError
from formats.jsonfile import read_json

# Bump when reading, splitting or tokenization changes what a run produces (3: bpe:N reserves
# harmony's chat tokens).
PREPARE_VERSION = 3
DEFAULT_OUT = "data/shakespeare"
PROGRESS = "progress.json"
SPLITS = ("train", "val")
# Shards and temporary files of an earlier or interrupted run.
_SHARD = re.compile(r"^(train|val)-(\d{5})\.array_record$")
_TEMP = re.compile(r"^\..+\.tmp-\d+$")
MALFORMED_NAMED = 1000  # malformed records named in the manifest (all are counted and printed)
PACKING_SEQ_LENS = (256, 1024, 4096)  # the manifest's packing efficiency table (chat)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--input", nargs="+", action="extend", default=None, metavar="PATH",
                        help="files, directories or globs of .txt, .jsonl, .jsonl.gz, .parquet "
                             "(default: the bundled Shakespeare corpus)")
    parser.add_argument("--val-input", nargs="+", action="extend", default=None, metavar="PATH",
                        help="inputs whose documents form the validation split (instead of --val-fraction)")
    parser.add_argument("--format", choices=["auto", *inputs.FORMATS], default="auto",
                        help="input format (default: from each file name)")
    parser.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    parser.add_argument("--chat", action="store_true",
                        help="conversations (OpenAI chat records) rendered in harmony, with per-token loss weights")
    parser.add_argument("--preferences", action="store_true",
                        help="preference pairs (TRL's prompt / chosen / rejected records) for DPO, rendered in "
                             "harmony, both answers of a pair in one document")
    parser.add_argument("--messages-field", default="messages",
                        help="with --chat: JSONL field / Parquet column holding the messages list")
    parser.add_argument("--strict", action="store_true",
                        help="with --chat: the first malformed record is an error (default: skipped and counted)")
    parser.add_argument("--tokenizer", default="bpe:4096", help=f"{tokenizer.SPEC_HELP} (default bpe:4096)")
    parser.add_argument("--bpe-train-bytes", type=int, default=256 << 20,
                        help="bpe:N trains on at most this many bytes of training text (default 256 MiB)")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="share of documents for validation (default 0.05; 0 with --val-input)")
    parser.add_argument("--tokens-per-shard", type=int, default=100_000_000,
                        help="a shard closes before it would exceed this many tokens (default 100M)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes (default: one per core)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    parser.add_argument("--force", action="store_true", help="start over even when --out is complete or resumable")
    parser.add_argument("--verify", metavar="DIR", default=None,
                        help="check every shard of a prepared dataset against its manifest, then exit")


def _check_args(args) -> None:
    if args.preferences:
        if args.chat:
            raise UserError("--chat and --preferences are two kinds of data; pass one")
        if args.messages_field != "messages" or args.text_field != "text":
            raise UserError("--preferences reads the fields prompt, chosen and rejected; drop --messages-field / --text-field")
        if not args.input:
            raise UserError("--preferences needs --input (JSONL or Parquet files of preference records)")
        args.chat = True           # the chat path's rendering, weights stream and packing, with pairs
    if (args.strict or args.messages_field != "messages") and not args.chat:
        raise UserError("--strict and --messages-field apply to --chat data (--strict also to --preferences); add --chat")
    if args.chat and args.text_field != "text":
        raise UserError("--text-field names the text of plain documents; with --chat use --messages-field")
    if args.chat and not args.input:
        raise UserError("--chat needs --input (JSONL or Parquet files of conversations)")
    if args.val_fraction is None:
        args.val_fraction = 0.0 if args.val_input else 0.05
    if not 0.0 <= args.val_fraction < 1.0:
        raise UserError(f"--val-fraction: expected a number in [0, 1), found {args.val_fraction}")
    if args.val_input and args.val_fraction:
        raise UserError("--val-input and --val-fraction both choose the validation split; pass one")
    for flag, value, least in (("--tokens-per-shard", args.tokens_per_shard, 1), ("--workers", args.workers, 1),
                               ("--bpe-train-bytes", args.bpe_train_bytes, 1), ("--seed", args.seed, 0)):
        if value < least:
            raise UserError(f"{flag}: expected at least {least}, found {value}")


# ---- which split ------------------------------------------------------------------------------
def unit_hash(doc_id: str, seed: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def is_val(doc_id: str, from_val_input: bool, seed: int, fraction: float) -> bool:
    """Per document and deterministic: the same document lands on the same side in every run."""
    return from_val_input or (fraction > 0 and unit_hash(doc_id, seed) < fraction)


# ---- workers ------------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, text_field: str, seed: int, fraction: float, dtype: str,
                 chat: bool = False, strict: bool = False, pairs: bool = False, in_process: bool = False) -> None:
    if not in_process:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    init = (tokenizer_dir, text_field, seed, fraction, dtype, chat, strict, pairs)
    if _WORKER.get("init") != init:  # not inherited by fork
        enc = tokenizer.load_tokenizer(tokenizer_dir)
        _WORKER.update(enc=enc, text_field=text_field, seed=seed, fraction=fraction, dtype=shards.DTYPES[dtype],
                       chat=chat, strict=strict, pairs=pairs, init=init,
                       byte_lengths=tokenizer.token_byte_lengths(enc) if chat else None)


def tokenize_unit(unit: inputs.Unit) -> dict:
    """Read and tokenize one unit: flat token ids, per-document lengths, bytes and split; for chat
    also the flat loss weights (bytes: of the trained ordinary tokens) and the malformed records."""
    w = _WORKER
    docs = inputs.read_unit(unit, w["text_field"], w["chat"], w["strict"], w["pairs"])
    enc = w["enc"]
    weights = None
    if w["chat"]:
        render = (lambda pair: preferences.render_pair(enc, *pair)) if w["pairs"] else \
            (lambda m: conversations.render_weighted(enc, m))
        rendered = [render(m) for m in docs.conversations]
        ids = [r[0] for r in rendered]
        weights = np.concatenate([r[1] for r in rendered]) if rendered else np.zeros(0, np.uint8)
        docs.nbytes = [int(w["byte_lengths"][i[(wt & 1).astype(bool)]].sum()) for i, wt in rendered]
    else:
        ids = [enc.encode_to_numpy(text, disallowed_special=()) for text in docs.texts]  # = encode_ordinary
    lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
    flat = np.concatenate(ids).astype(w["dtype"]) if ids else np.zeros(0, w["dtype"])
    val = np.fromiter((is_val(i, v, w["seed"], w["fraction"]) for i, v in zip(docs.ids, docs.val)), bool, len(ids))
    return {"unit": unit.index, "input_bytes": unit.nbytes, "tokens": flat, "lengths": lengths, "val": val,
            "nbytes": np.asarray(docs.nbytes, np.int64), "stats": asdict(docs.stats), "weights": weights,
            "malformed": docs.malformed}


def _pool_context():
    """fork when this process runs no other thread, Python's or JAX's runtime's (workers then
    inherit the tokenizer already built: no import or vocabulary parse per worker); spawn
    otherwise, fork being unsafe there."""
    xla = sys.modules.get("jax._src.xla_bridge")  # imported is fine; initialized backends run threads
    jax_running = xla is not None and getattr(xla, "backends_are_initialized", lambda: True)()
    if sys.platform == "linux" and threading.active_count() == 1 and not jax_running:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


class Tokenized:
    """Tokenized units in unit order, from `workers` processes (in-process for one worker); at most
    2 x workers units in flight, so memory stays bounded. Start it before any other thread."""

    def __init__(self, units, workers: int, init_args: tuple):
        self.todo, self.pending, self.pool = iter(units), deque(), None
        _init_worker(*init_args, in_process=True)  # forked workers inherit this; one worker uses it
        if workers > 1:
            self.pool = ProcessPoolExecutor(workers, mp_context=_pool_context(), initializer=_init_worker,
                                            initargs=init_args)
            for unit in self.todo:
                self.pending.append(self.pool.submit(tokenize_unit, unit))
                if len(self.pending) >= 2 * workers:
                    break

    def __iter__(self):
        if self.pool is None:
            yield from map(tokenize_unit, self.todo)
            return
        while self.pending:
            try:
                result = self.pending.popleft().result()
            except BrokenProcessPool:
                raise UserError("prepare: a worker process died (out of memory? killed?); "
                                "re-run the same command to resume") from None
            unit = next(self.todo, None)
            if unit is not None:
                self.pending.append(self.pool.submit(tokenize_unit, unit))
            yield result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


# ---- the output directory -------------------------------------------------------------------------
def _settings(args, sources: list[inputs.Source]) -> dict:
    """Everything that decides the output: an output made with the same dict is the same."""
    spec = tokenizer.parse_spec(args.tokenizer)
    if spec["kind"] == "file":
        spec["sha256"] = sha256_file(spec["path"])
    elif spec["kind"] == "dir":
        spec["sha256"] = tokenizer.read_description(spec["path"])["tiktoken_sha256"]
    elif spec["kind"] == "hf":
        spec["sha256"] = tokenizer_json.fingerprint(spec["path"])
    return {"prepare_version": PREPARE_VERSION, "inputs": inputs.fingerprint(sources), "format": args.format,
            "text_field": args.text_field, "chat": args.chat, "preferences": args.preferences,
            "messages_field": args.messages_field,
            "strict": args.strict, "tokenizer": spec, "bpe_train_bytes": args.bpe_train_bytes,
            "val_fraction": args.val_fraction, "seed": args.seed, "tokens_per_shard": args.tokens_per_shard,
            "record_tokens": shards.RECORD_TOKENS, "writer_options": shards.WRITER_OPTIONS,
            "unit_bytes": inputs.UNIT_BYTES}


def _complete(out: Path, settings: dict) -> bool:
    try:
        manifest = shards.read_manifest(out)
        if manifest.get("settings") != settings:
            return False
        for split in manifest["splits"]:
            shards.check_shards(out, manifest, split, "size")
        tok = out / tokenizer.RANKS_FILE
        return tok.is_file() and sha256_file(tok) == manifest["tokenizer"]["tiktoken_sha256"]
    except (UserError, KeyError, TypeError):
        return False


def _check_not_foreign(out: Path, force: bool) -> None:
    """Never overwrite a manifest.json that some other tool wrote, unless told to."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: expected a directory, found a file")
    if (out / shards.MANIFEST).exists() and not force:
        try:
            shards.read_manifest(out)
        except UserError as e:
            raise UserError(f"--out {out}: refusing to overwrite ({e}); choose another --out, "
                            "or pass --force") from None


def _clean(out: Path, keep: set[str]) -> None:
    """Remove shards not in keep and temporary files left by an interrupted run."""
    for p in out.iterdir():
        if p.is_file() and (_TEMP.match(p.name) or (_SHARD.match(p.name) and p.name not in keep)):
            p.unlink()


def _resumable(out: Path, settings: dict) -> dict | None:
    path = out / PROGRESS
    if not path.is_file():
        return None
    progress = read_json(path)
    if not isinstance(progress, dict) or progress.get("settings") != settings:
        return None
    try:
        for split in progress["splits"].values():
            for shard in split["shards"]:
                p = out / shard["file"]
                if not p.is_file() or p.stat().st_size != shard["bytes"]:
                    return None
        if sha256_file(out / tokenizer.RANKS_FILE) != progress["tokenizer"]["tiktoken_sha256"]:
            return None
    except (OSError, KeyError, TypeError):
        return None
    return progress


# ---- the tokenizer --------------------------------------------------------------------------------
def _training_texts(units, args, limit: int):
    """Training-split texts in source order, up to `limit` UTF-8 bytes (for bpe:N)."""
    seen = 0
    field = _field(args)
    for unit in units:
        docs = inputs.read_unit(unit, field, args.chat, pairs=args.preferences)
        for doc_id, text, val, n in zip(docs.ids, docs.texts, docs.val, docs.nbytes):
            if not is_val(doc_id, val, args.seed, args.val_fraction):
                yield text
                seen += n
                if seen >= limit:
                    return


def _make_tokenizer(out: Path, units, args) -> dict:
    spec = tokenizer.parse_spec(args.tokenizer)
    if spec["kind"] == "bpe":
        print(f"training a {spec['vocab_size']}-id BPE on up to {args.bpe_train_bytes:,} bytes of training text",
              file=sys.stderr)
    enc = tokenizer.build_tokenizer(spec, _training_texts(units, args, args.bpe_train_bytes))
    if args.chat:
        conversations.check_chat_tokenizer(enc, f"--tokenizer {args.tokenizer}")
    return tokenizer.save_tokenizer(enc, out)


def _field(args) -> str:
    """The field that names each record's text: a pair's units are cut by its prompt column."""
    return preferences.FIELDS[0] if args.preferences else args.messages_field if args.chat else args.text_field


# ---- the ordered merge ---------------------------------------------------------------------------
class SplitWriter:
    """One split's shards: documents arrive in source order; a shard closes before it would exceed
    tokens_per_shard tokens (a longer document gets a shard of its own)."""

    def __init__(self, out: Path, name: str, dtype: str, tokens_per_shard: int, done: list[dict],
                 weighted: bool = False):
        self.out, self.name, self.dtype, self.limit, self.weighted = out, name, dtype, tokens_per_shard, weighted
        self.shards = list(done)
        self.writer: shards.ShardWriter | None = None
        self.text_bytes = 0

    def add(self, ids: np.ndarray, nbytes: int, weights: np.ndarray | None = None) -> bool:
        """Write one document; True when a shard was closed to make room for it."""
        closed = False
        if self.writer is not None and self.writer.tokens + len(ids) > self.limit:
            self.close()
            closed = True
        if self.writer is None:
            self.writer = shards.ShardWriter(self.out / shards.shard_name(self.name, len(self.shards)), self.dtype,
                                             self.weighted)
        self.writer.add(ids, weights)
        self.text_bytes += nbytes
        return closed

    def close(self) -> None:
        if self.writer is not None:
            entry = self.writer.close()
            entry["text_bytes"] = self.text_bytes
            self.shards.append(entry)
            self.writer, self.text_bytes = None, 0

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None

    def summary(self) -> dict:
        out = {"docs": sum(s["docs"] for s in self.shards), "tokens": sum(s["tokens"] for s in self.shards),
               "text_bytes": sum(s["text_bytes"] for s in self.shards), "shards": self.shards}
        if self.weighted:
            out["trained_tokens"] = sum(s["trained_tokens"] for s in self.shards)
        return out


def _merge(out: Path, results, writers: dict, progress: dict, bar) -> inputs.ReadStats:
    """Write every document of every result to its split, recording progress after each shard.
    progress["splits"][s]["resume"] = [unit, doc]: documents of split s before it are written."""
    stats = inputs.ReadStats(**progress["stats"])
    resume = {s: tuple(progress["splits"][s]["resume"]) for s in SPLITS}
    start_time, tokens_done = time.perf_counter(), 0
    for result in results:
        u = result["unit"]
        offsets = np.concatenate([[0], np.cumsum(result["lengths"])])
        weights = result["weights"]
        for k, (val, nbytes) in enumerate(zip(result["val"].tolist(), result["nbytes"].tolist())):
            split = "val" if val else "train"
            if (u, k) < resume[split]:
                continue  # already in a finished shard
            lo, hi = offsets[k], offsets[k + 1]
            if writers[split].add(result["tokens"][lo:hi], nbytes, None if weights is None else weights[lo:hi]):
                # The shard just closed ends before (u, k); a restart re-reads unit u.
                _record(out, progress, writers, split, (u, k), stats)
        progress["malformed"] += [[u, name] for name in result["malformed"]]  # named once, at the end
        stats.add(inputs.ReadStats(**result["stats"]))
        tokens_done += int(offsets[-1])
        bar.update(result["input_bytes"])
        bar.set_postfix(tok_s=f"{tokens_done / max(time.perf_counter() - start_time, 1e-9):,.0f}", refresh=False)
    return stats


def _record(out: Path, progress: dict, writers: dict, split: str, position: tuple, stats: inputs.ReadStats) -> None:
    entry = progress["splits"][split]
    entry["shards"] = writers[split].shards
    entry["resume"] = list(position)
    entry["stats"] = asdict(stats)  # of the units before position's unit
    first = min(SPLITS, key=lambda s: tuple(progress["splits"][s]["resume"]))
    progress["stats"] = progress["splits"][first]["stats"]
    progress["restart_unit"] = progress["splits"][first]["resume"][0]
    # Malformed records of the units a restart re-reads are named again then: keep only the others.
    kept = [m for m in progress["malformed"] if m[0] < progress["restart_unit"]]
    write_atomic(out / PROGRESS, (json.dumps({**progress, "malformed": kept}) + "\n").encode())


def packing_table(out: Path, manifest: dict) -> dict:
    """For chat data: how the training split packs at a few sequence lengths (the loader's
    planner, epoch 0 of seed 0): rows, real tokens / row tokens, conversations too long for a row."""
    with shards.Dataset(out, "train", manifest) as ds:
        lengths = ds.lengths
    order = np.random.default_rng([0, 0]).permutation(len(lengths))
    table = {}
    for seq_len in PACKING_SEQ_LENS:
        plan = packing.EpochPlan(order, lengths, seq_len, block_tokens=packing.BLOCK_TOKENS, shuffle_seed=None,
                                 whole=True)
        summary = plan.summary()
        table[str(seq_len)] = {"rows": summary["rows"], "efficiency": round(summary["efficiency"], 4),
                               "too_long": summary["too_long"]}
    return table


# ---- run ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if args.verify is not None:
        from train.data.verify import verify_dataset
        print(verify_dataset(args.verify))
        return 0
    start = time.perf_counter()
    _check_args(args)
    out = Path(args.out)
    sources = inputs.find_sources(args.input, args.val_input, None if args.format == "auto" else args.format)
    settings = _settings(args, sources)
    if not args.force and _complete(out, settings):
        (out / PROGRESS).unlink(missing_ok=True)
        print(f"{out}: already prepared from the same inputs and settings; nothing to do (--force rebuilds)")
        return 0
    _check_not_foreign(out, args.force)
    field = _field(args)
    inputs.check_sources(sources, field, args.chat, args.preferences)
    progress = None if args.force else _resumable(out, settings)
    out.mkdir(parents=True, exist_ok=True)
    (out / shards.MANIFEST).unlink(missing_ok=True)  # the new one is written last
    if progress is None:
        _clean(out, keep=set())
        (out / PROGRESS).unlink(missing_ok=True)
        desc = _make_tokenizer(out, inputs.iter_units(sources, field), args)
        empty = asdict(inputs.ReadStats())
        progress = {"settings": settings, "tokenizer": desc, "stats": empty, "restart_unit": 0, "malformed": [],
                    "splits": {s: {"shards": [], "resume": [0, 0], "stats": empty} for s in SPLITS}}
        write_atomic(out / PROGRESS, (json.dumps(progress) + "\n").encode())
    else:
        done = sum(len(s["shards"]) for s in progress["splits"].values())
        print(f"{out}: resuming an interrupted preparation ({done} finished shard(s) kept, "
              f"restarting at work unit {progress['restart_unit']})", file=sys.stderr)
        _clean(out, keep={s["file"] for split in progress["splits"].values() for s in split["shards"]})
    desc = progress["tokenizer"]
    dtype = shards.token_dtype(desc["vocab_size"])
    writers = {s: SplitWriter(out, s, dtype, args.tokens_per_shard, progress["splits"][s]["shards"], args.chat)
               for s in SPLITS}
    units = inputs.iter_units(sources, field)
    done_bytes = sum(u.nbytes for u in itertools.islice(units, progress["restart_unit"]))  # finished before
    init = (str(out), field, args.seed, args.val_fraction, dtype, args.chat, args.strict, args.preferences)
    results = Tokenized(units, args.workers, init)  # before the progress bar starts its thread
    bar = tqdm(total=sum(s.size for s in sources), initial=done_bytes, unit="B", unit_scale=True,
               desc="prepare", file=sys.stderr, dynamic_ncols=True)
    try:
        stats = _merge(out, results, writers, progress, bar)
        for w in writers.values():
            w.close()
    finally:
        results.close()
        bar.close()
        for w in writers.values():
            w.abort()
    malformed = [name for _, name in progress["malformed"]]
    return _finish(out, args, sources, settings, desc, dtype, writers, stats, malformed, time.perf_counter() - start)


def _finish(out, args, sources, settings, desc, dtype, writers, stats, malformed, seconds) -> int:
    splits = {s: w.summary() for s, w in writers.items()}
    what = "preference pairs" if args.preferences else "conversations"
    if splits["train"]["docs"] == 0 and args.chat:
        raise UserError(f"no training {what}: {stats.documents} kept, {stats.malformed} malformed record(s) "
                        "skipped" + (f" (the first: {malformed[0]})" if malformed else ""))
    if splits["train"]["docs"] == 0:
        raise UserError(f"no training documents: all {stats.documents} documents went to validation "
                        f"(--val-fraction {args.val_fraction}); lower it")
    if splits["val"]["docs"] == 0 and (args.val_fraction > 0 or args.val_input):
        raise UserError(f"no document of the {stats.documents} fell in the validation split "
                        f"(--val-fraction {args.val_fraction}); raise it or pass --val-input")
    manifest = {"format": shards.FORMAT, "format_version": shards.FORMAT_VERSION, "tokenizer": desc,
                "vocab_size": desc["vocab_size"], "model_vocab_size": desc["model_vocab_size"],
                "bos_id": desc["bos_id"], "eos_id": desc["eos_id"], "dtype": dtype,
                "record_tokens": shards.RECORD_TOKENS, "block_bytes": shards.BLOCK_BYTES,
                "settings": settings, "stats": asdict(stats), "kind": "preferences" if args.preferences else "chat" if args.chat else "text",
                "streams": ["tokens", "weights"] if args.chat else ["tokens"],
                "sources": [{"name": s.name, "format": s.format, "bytes": s.size, "split": "val" if s.val else None}
                            for s in sources],
                "splits": splits}
    if args.chat:
        manifest["pairs" if args.preferences else "conversations"] = {s: v["docs"] for s, v in splits.items()}
        manifest["trained_tokens"] = {s: v["trained_tokens"] for s, v in splits.items()}
        manifest["skipped"] = {"malformed": stats.malformed, "records": malformed[:MALFORMED_NAMED]}
        manifest["packing"] = packing_table(out, manifest)
    shards.write_manifest(out, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    parts = "; ".join(f"{k} {v['docs']:,} docs / {v['tokens']:,} tokens in {len(v['shards'])} shard(s)"
                      for k, v in splits.items())
    tokens = sum(v["tokens"] for v in splits.values())
    print(f"prepared {out}: {parts}; tokenizer {desc['name']} ({desc['vocab_size']} ids, bos {desc['bos_id']}, "
          f"eos {desc['eos_id']}), {dtype}; {seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s")
    if args.chat:
        trained = sum(v["trained_tokens"] for v in splits.values())
        print(f"{'preferences' if args.preferences else 'chat'}: {stats.documents:,} "
              f"{'pair' if args.preferences else 'conversation'}(s), {tokens:,} tokens of which {trained:,} trained "
              f"({trained / max(tokens, 1):.1%}); skipped {stats.malformed:,} malformed record(s)"
              + "".join(f"\n  {name}" for name in malformed))
        print(f"packing (seq_len: real tokens / row tokens, {what} too long for a row): " + ", ".join(
            f"{k}: {v['efficiency']:.1%}, {v['too_long']}" for k, v in manifest["packing"].items()))
    if stats.empty or stats.replaced:
        print(f"input: skipped {stats.empty:,} empty document(s); replaced {stats.replaced:,} invalid UTF-8 "
              f"sequence(s) in {stats.replaced_docs:,} document(s) with U+FFFD")
    return 0
