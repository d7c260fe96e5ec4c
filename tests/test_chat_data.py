"""Chat data for supervised fine-tuning: conversations rendered in harmony with per-token loss
weights (against a rule scanned from the tokens, and against openai-harmony token for token),
malformed records skipped, named and counted (--strict: fatal), the weights stream in the shards
(version-2 data still reads), whole-conversation packing, and the loader's Batch (segments,
positions, padding, fresh buffers, exact resume); document masking for plain text."""

import argparse
import gzip
import json

import numpy as np
import pytest

from train.data import conversations, packing, prepare, shards
from formats import tokenizer
from train.data.loader import PAD_SEGMENT, Batch, TokenLoader
from formats.errors import UserError

START, MESSAGE, END, CHANNEL, RETURN = "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"
WORDS = "to be or not that is the question whether tis nobler in the mind to suffer slings and arrows".split()


def run_prepare(*argv):
    """`torchlyra prepare ARGV` in this process (one worker unless told), without the CLI's imports."""
    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    return prepare.run(parser.parse_args([str(a) for a in argv] + ([] if "--workers" in argv else ["--workers", "1"])))


def say(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.integers(lo, hi)))


def random_conversation(rng, turns=None):
    """OpenAI-shaped messages: an optional system or developer message, then user / assistant turns,
    some assistants thinking, sometimes a trailing user message."""
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": str(rng.choice(["system", "developer"])), "content": say(rng, 1, 6)})
    for _ in range(turns or int(rng.integers(1, 4))):
        msgs.append({"role": "user", "content": say(rng, 1, 12)})
        reply = {"role": "assistant", "content": say(rng, 1, 14)}
        if rng.random() < 0.5:
            reply["thinking"] = say(rng, 1, 8)
        msgs.append(reply)
    if rng.random() < 0.2:
        msgs.append({"role": "user", "content": say(rng, 1, 5)})
    return msgs


@pytest.fixture(scope="module")
def bpe():
    """A small bpe:N tokenizer: it reserves harmony's chat tokens."""
    return tokenizer.train_bpe([" ".join(WORDS)] * 20, 300)


def weights_by_scanning(enc, ids):
    """The rule, read off the tokens: after each <|start|>, the role's tokens up to <|channel|> or
    <|message|>; for the assistant, everything after its role up to and including the closing
    <|end|> / <|return|> is trained."""
    sp = enc._special_tokens
    out, i = np.zeros(len(ids), np.uint8), 0
    while i < len(ids):
        assert ids[i] == sp[START]
        j = i + 1
        while ids[j] not in (sp[CHANNEL], sp[MESSAGE]):
            j += 1
        k = j
        while ids[k] not in (sp[END], sp[RETURN]):
            k += 1
        if enc.decode(ids[i + 1:j]) == "assistant":
            out[j:k + 1] = 1
        i = k + 1
    return out


def test_loss_weights_are_one_exactly_on_what_the_assistant_writes(bpe):
    rng = np.random.default_rng(0)
    for _ in range(40):
        msgs = conversations.parse_record({"messages": random_conversation(rng)})
        ids, weights = conversations.render_weighted(bpe, msgs)
        assert ids.dtype == np.int32 and weights.dtype == np.uint8 and len(ids) == len(weights)
        np.testing.assert_array_equal(weights, weights_by_scanning(bpe, ids.tolist()))
        rendered = conversations.harmony_messages(msgs)
        last = rendered[-1]
        ends_with_answer = last[0] == "assistant" and last[2] == "final"
        assert ids[-1] == bpe._special_tokens[RETURN if ends_with_answer else END]
        assert (ids == bpe._special_tokens[RETURN]).sum() == ends_with_answer


def test_earlier_thinking_is_dropped_once_a_later_answer_exists_the_last_turn_keeps_it():
    msgs = conversations.parse_record({"messages": [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "thinking": "t1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "thinking": "t2"},
        {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3", "thinking": "t3"}]})
    assert conversations.harmony_messages(msgs) == [
        ("user", "q1", None), ("assistant", "a1", "final"), ("user", "q2", None), ("assistant", "a2", "final"),
        ("user", "q3", None), ("assistant", "t3", "analysis"), ("assistant", "a3", "final")]
    # Content as a list of text parts reads as their text; a last assistant message that only
    # thinks has no later answer, so it keeps its thinking.
    parts = [{"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "text", "text": "3"}]},
             {"role": "assistant", "content": "a3"}]
    assert conversations.parse_record({"messages": parts})[0]["content"] == "q3"
    msgs[-1] = {"role": "assistant", "content": "", "thinking": "t3"}
    assert conversations.harmony_messages(msgs)[-1] == ("assistant", "t3", "analysis")


@pytest.fixture(scope="module")
def harmony_reference(tmp_path_factory):
    from tests.helpers import openai_harmony_encoding
    return openai_harmony_encoding(tmp_path_factory.mktemp("o200k"))


def test_rendering_equals_openai_harmony_for_training_token_for_token(harmony_reference):
    harmony = pytest.importorskip("openai_harmony")
    enc = tokenizer.o200k_harmony()

    def reference(rendered, auto_drop):
        conv = harmony.Conversation.from_messages([
            harmony.Message.from_role_and_content(harmony.Role(role), content).with_channel(channel) if channel
            else harmony.Message.from_role_and_content(harmony.Role(role), content)
            for role, content, channel in rendered])
        config = harmony.RenderConversationConfig(auto_drop_analysis=auto_drop)
        return harmony_reference.render_conversation_for_training(conv, config)

    rng = np.random.default_rng(1)
    for n in range(12):
        msgs = conversations.parse_record({"messages": random_conversation(rng)})
        if n == 0:
            msgs[-1]["content"] += " naïve café — 日本語 😀\n\t x"
        ids, _ = conversations.render_weighted(enc, msgs)
        assert ids.tolist() == reference(conversations.harmony_messages(msgs), auto_drop=False)
    # Two turns, both thinking: harmony's own dropping (of analysis before the first final
    # answer) gives the same tokens.
    two = [{"role": "user", "content": "q1", "thinking": None},
           {"role": "assistant", "content": "a1", "thinking": "t1"},
           {"role": "user", "content": "q2", "thinking": None},
           {"role": "assistant", "content": "a2", "thinking": "t2"}]
    undropped = [("user", "q1", None), ("assistant", "t1", "analysis"), ("assistant", "a1", "final"),
                 ("user", "q2", None), ("assistant", "t2", "analysis"), ("assistant", "a2", "final")]
    assert conversations.render_weighted(enc, two)[0].tolist() == reference(undropped, auto_drop=True)
    # One turn: harmony drops the only turn's thinking too; our rule keeps it.
    one = [{"role": "user", "content": "q", "thinking": None}, {"role": "assistant", "content": "a", "thinking": "t"}]
    ours = conversations.render_weighted(enc, one)[0].tolist()
    assert ours == reference(conversations.harmony_messages(one), auto_drop=False)
    assert ours != reference(conversations.harmony_messages(one), auto_drop=True)


def test_an_old_bpe_vocabulary_without_chat_tokens_is_refused_by_name(bpe):
    import tiktoken
    plain = tiktoken.Encoding("bpe-old", pat_str=bpe._pat_str, mergeable_ranks=bpe._mergeable_ranks,
                              special_tokens={tokenizer.BOS: len(bpe._mergeable_ranks)})  # as bpe:N was
    with pytest.raises(UserError, match="tokenizer 'bpe-old' lacks harmony's chat tokens .*<\\|start\\|>.*made again"):
        conversations.check_chat_tokenizer(plain, "--tokenizer x")
    conversations.check_chat_tokenizer(bpe, "--tokenizer bpe:300")
    assert bpe.n_vocab == 300 and tokenizer.bos_id(bpe) == 299
    assert [bpe._special_tokens[t] for t in tokenizer.HARMONY_CHAT_TOKENS] == list(range(292, 299))


# ---------------------------------------------------------------- prepare --chat

GOOD, VAL = 24, 4
BAD = [({"messages": []}, "no messages"), ({"text": "hi"}, "no messages"),
       ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown role"),
       ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "y"}]},
        "non-text content"),
       ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn")]


def write_chats(root, fmt="jsonl"):
    """GOOD random conversations with the BAD records among them; returns (path, line of each bad one)."""
    rng = np.random.default_rng(3)
    records, bad_lines = [], []
    for i in range(GOOD):
        records.append({"messages": random_conversation(rng), "id": i})
        if i % 5 == 2 and len(bad_lines) < len(BAD):
            records.append(BAD[len(bad_lines)][0])
            bad_lines.append(len(records))
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        good = [r for r in records if "id" in r]
        path = root / "chats.parquet"
        pq.write_table(pa.table({"conv": [r["messages"] for r in good]}), path, row_group_size=7)  # --messages-field
        return path, []
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    path = root / f"chats.{fmt}"
    path.write_bytes(gzip.compress(lines) if fmt.endswith("gz") else lines)
    return path, bad_lines


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    path, bad_lines = write_chats(root / "src")
    rng = np.random.default_rng(9)
    (root / "val").mkdir()
    (root / "val" / "val.jsonl").write_text("".join(json.dumps({"messages": random_conversation(rng)}) + "\n"
                                                    for _ in range(VAL)))
    out = root / "data"
    assert run_prepare("--chat", "--input", path, "--val-input", root / "val", "--out", out,
                       "--tokenizer", "bpe:300") == 0
    return out, path, bad_lines


def test_prepare_chat_counts_conversations_tokens_trained_tokens_and_names_each_malformed_record(chat_data, capsys):
    out, path, bad_lines = chat_data
    m = json.loads((out / "manifest.json").read_text())
    assert (m["format_version"], m["kind"], m["streams"]) == (3, "chat", ["tokens", "weights"])
    assert m["conversations"] == {"train": GOOD, "val": VAL} and m["stats"]["malformed"] == len(BAD)
    assert m["skipped"]["malformed"] == len(BAD)
    for name, line, (_, why) in zip(m["skipped"]["records"], bad_lines, BAD):
        assert name.startswith(f"{path}:{line}: ") and why in name
    enc = tokenizer.load_tokenizer(out)
    for split in ("train", "val"):
        with shards.open_dataset(out, split) as ds:
            docs = [ds.doc(d) for d in range(len(ds))]
            weights = ds.read_segments([(d, 0, int(ds.lengths[d])) for d in range(len(ds))], "weights")
        assert m["splits"][split]["tokens"] == sum(map(len, docs))
        assert m["trained_tokens"][split] == m["splits"][split]["trained_tokens"] == sum(int(w.sum()) for w in weights)
        for ids, w in zip(docs, weights):
            np.testing.assert_array_equal(w, weights_by_scanning(enc, ids.tolist()))
    assert set(m["packing"]) == {"256", "1024", "4096"} and 0 < m["packing"]["256"]["efficiency"] <= 1
    assert run_prepare("--verify", out) == 0


def test_chat_reads_jsonl_gz_and_parquet_alike_with_any_number_of_workers(chat_data, tmp_path, monkeypatch):
    from train.data import inputs

    out, _, _ = chat_data
    monkeypatch.setattr(inputs, "UNIT_BYTES", 2048)  # several units for two workers

    def all_tokens(data):
        with shards.open_dataset(data, "train") as ds:
            return [ds.doc(d).tolist() for d in range(len(ds))]

    expected = all_tokens(out)
    for fmt in ("jsonl.gz", "parquet"):
        path, _ = write_chats(tmp_path / fmt, fmt)
        data = tmp_path / f"data-{fmt}"
        field = ["--messages-field", "conv"] if fmt == "parquet" else ["--workers", 2]
        assert run_prepare("--chat", "--input", path, "--out", data, "--tokenizer", out, "--val-fraction", 0,
                           *field) == 0
        assert all_tokens(data) == expected, fmt


def test_interrupted_chat_prepare_resumes_to_the_same_shards_counts_and_names(chat_data, tmp_path, monkeypatch,
                                                                             capsys):
    import argparse
    from train.data import inputs

    data, path, _ = chat_data
    monkeypatch.setattr(inputs, "UNIT_BYTES", 1024)  # several units, malformed records in several
    args = ["--chat", "--input", path, "--tokenizer", data, "--tokens-per-shard", 300, "--val-fraction", 0]
    assert run_prepare(*args, "--out", tmp_path / "reference") == 0
    closes, real_close = [], shards.ShardWriter.close

    def crash_on_fourth_close(self):
        closes.append(self.path.name)
        if len(closes) == 4:
            raise KeyboardInterrupt
        return real_close(self)

    monkeypatch.setattr(shards.ShardWriter, "close", crash_on_fourth_close)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(*args, "--out", tmp_path / "out")
    monkeypatch.setattr(shards.ShardWriter, "close", real_close)
    capsys.readouterr()
    assert run_prepare(*args, "--out", tmp_path / "out") == 0
    assert "resuming an interrupted preparation (3 finished shard(s) kept" in capsys.readouterr().err
    assert not (tmp_path / "out" / "progress.json").exists()
    got, want = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("out", "reference"))
    for key in ("splits", "stats", "skipped", "conversations", "trained_tokens", "packing"):
        assert got[key] == want[key], key
    assert len(want["skipped"]["records"]) == len(BAD) and len(want["splits"]["train"]["shards"]) > 4


def test_strict_makes_the_first_malformed_record_fatal(chat_data, tmp_path):
    data, path, bad_lines = chat_data
    with pytest.raises(UserError, match=f"^{path}:{bad_lines[0]}: malformed conversation: no messages"):
        run_prepare("--chat", "--strict", "--input", path, "--out", tmp_path / "d", "--tokenizer", data)
    with pytest.raises(UserError, match="--strict and --messages-field apply to --chat data"):
        run_prepare("--strict", "--input", path, "--out", tmp_path / "e")
    with pytest.raises(UserError, match="with --chat use --messages-field"):
        run_prepare("--chat", "--text-field", "conv", "--input", path, "--out", tmp_path / "e")
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(record) + "\n" for record, _ in BAD))
    with pytest.raises(UserError, match=f"no training conversations: 0 kept, {len(BAD)} malformed record\\(s\\) "
                                        f"skipped \\(the first: {tmp_path / 'bad.jsonl'}:1: no messages"):
        run_prepare("--chat", "--input", tmp_path / "bad.jsonl", "--out", tmp_path / "g", "--tokenizer", data)
    (tmp_path / "notes.txt").write_text("plain text")
    with pytest.raises(UserError, match="notes.txt: --chat reads conversations from JSONL .* or Parquet"):
        run_prepare("--chat", "--input", tmp_path / "notes.txt", "--out", tmp_path / "f")


# ---------------------------------------------------------------- shards

def test_version_2_data_still_reads(tmp_path):
    docs = [np.arange(5, dtype=np.uint16) + i for i in range(6)]
    w = shards.ShardWriter(tmp_path / shards.shard_name("train", 0), "uint16")
    for d in docs:
        w.add(d)
    entry = w.close()
    shards.write_manifest(tmp_path, {  # as version 2 wrote it: no "streams"
        "format": shards.FORMAT, "format_version": 2, "tokenizer": {}, "vocab_size": 100, "bos_id": 99,
        "eos_id": None, "dtype": "uint16", "record_tokens": shards.RECORD_TOKENS,
        "splits": {"train": {"docs": 6, "tokens": 30, "shards": [entry]}}})
    with shards.open_dataset(tmp_path, "train") as ds:
        assert not ds.weighted and [ds.doc(i).tolist() for i in range(6)] == [d.tolist() for d in docs]
        with pytest.raises(UserError, match="no 'weights' stream"):
            ds.read_segments([(0, 0, 2)], "weights")
    loader = TokenLoader(tmp_path, "train", global_batch=2, seq_len=7)
    state = {k: v for k, v in loader.state_dict().items() if k not in ("packing", "truncate")}  # an older state
    loader.load_state_dict(state)
    assert loader.next_batch().shape == (2, 8)
    loader.close()


def test_weights_stream_round_trips_across_record_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "RECORD_TOKENS", 7)
    rng = np.random.default_rng(4)
    docs = [rng.integers(0, 1000, n).astype(np.int32) for n in (1, 7, 8, 20, 3)]
    weights = [rng.integers(0, 2, len(d)).astype(np.uint8) for d in docs]
    w = shards.ShardWriter(tmp_path / shards.shard_name("train", 0), "uint16", weighted=True)
    for d, wt in zip(docs, weights):
        w.add(d, wt)
    entry = w.close()
    assert entry["trained_tokens"] == sum(int(x.sum()) for x in weights)
    manifest = {"format": shards.FORMAT, "format_version": 3, "streams": ["tokens", "weights"], "tokenizer": {},
                "vocab_size": 1000, "bos_id": 999, "eos_id": None, "dtype": "uint16", "record_tokens": 7,
                "splits": {"train": {"docs": len(docs), "tokens": entry["tokens"], "shards": [entry]}}}
    with shards.Dataset(tmp_path, "train", manifest) as ds:
        segs = [(3, 5, 10), (1, 0, 7), (4, 1, 2), (0, 0, 1), (3, 13, 7)]
        for (d, s, n), ids, wt in zip(segs, ds.read_segments(segs), ds.read_segments(segs, "weights")):
            assert ids.tolist() == docs[d][s:s + n].tolist() and wt.tolist() == weights[d][s:s + n].tolist()
    # --verify reads the weights as weights: a 2 is damage, token ids are checked apart.
    w = shards.ShardWriter(tmp_path / shards.shard_name("train", 0), "uint16", weighted=True)
    w.add(docs[1], np.asarray([0, 1, 2, 0, 0, 1, 1], np.uint8))
    entry = w.close()
    shards.write_manifest(tmp_path, {**manifest, "splits": {"train": {"docs": 1, "tokens": 7, "shards": [entry]}}})
    from train.data.verify import verify_dataset
    with pytest.raises(shards.DataIntegrityError, match="train-00000.array_record: loss weight 2, expected 0 or 1"):
        verify_dataset(tmp_path)
    with pytest.raises(ValueError, match="weights expected one per token"):
        shards.ShardWriter(tmp_path / "x.array_record", "uint16", weighted=True).add(docs[0])


# ---------------------------------------------------------------- packing

@pytest.mark.parametrize("seq_len", [7, 16, 33])
def test_whole_packing_never_cuts_a_conversation(seq_len):
    rng = np.random.default_rng(seq_len)
    lengths = rng.integers(1, 2 * seq_len, 300)
    docs = rng.permutation(300)
    for truncate in (False, True):
        plan = packing.plan_block_whole(docs, lengths[docs], seq_len, shuffle_seed=[1], buffer_pieces=50,
                                        truncate=truncate)
        seen = []
        for r in range(len(plan)):
            segs = list(plan.segments(r))
            assert sum(c for _, _, c in segs) <= seq_len + 1 and segs
            for d, start, count in segs:
                assert start == 0 and count == min(lengths[d], seq_len + 1)
                seen.append(d)
        too_long = set(np.flatnonzero(lengths > seq_len + 1).tolist())
        assert sorted(seen) == sorted(set(range(300)) - (set() if truncate else too_long))  # each once
        assert (plan.dropped_docs, plan.truncated_docs) == ((0, len(too_long)) if truncate else (len(too_long), 0))


# ---------------------------------------------------------------- the loader's Batch

def check_batch(batch, ds, row_len):
    """Segments, positions, padding and weights of every row against the stored conversations."""
    assert isinstance(batch, Batch)
    for arr, dtype in ((batch.tokens, np.int32), (batch.weights, np.float32), (batch.segment_ids, np.int32),
                       (batch.positions, np.int32)):
        assert arr.dtype == dtype and arr.shape == batch.tokens.shape and arr.shape[1] == row_len
    stored = {tuple(ds.doc(d).tolist()): d for d in range(len(ds))}
    for tok, w, seg, pos in zip(batch.tokens, batch.weights, batch.segment_ids, batch.positions):
        real = seg != PAD_SEGMENT
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any()  # padding only at the end
        assert (w[~real] == 0).all() and (pos[~real] == 0).all()
        for k in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == k)
            assert (np.diff(where) == 1).all() and pos[where].tolist() == list(range(len(where)))
            d = stored[tuple(tok[where].tolist())]  # a whole stored conversation
            expected = ds.read_segments([(d, 0, len(where))], "weights")[0].astype(np.float32)
            expected[0] = 0
            np.testing.assert_array_equal(w[where], expected)
        # A trained target and the input before it are always in the same segment.
        trained = np.flatnonzero(w[1:]) + 1
        assert (seg[trained] == seg[trained - 1]).all() and (seg[trained] != PAD_SEGMENT).all()


def test_loader_batches_whole_conversations_with_segments_positions_and_padding(chat_data):
    out, _, _ = chat_data
    loader = TokenLoader(out, "train", global_batch=3, seq_len=95, seed=2, accepts_batch=True)
    with pytest.raises(UserError, match="chat data .* needs a train step that takes loss weights"):
        TokenLoader(out, "train", global_batch=3, seq_len=95)  # today's trainer: refused by name
    with pytest.raises(UserError, match="4 of its 4 conversations are longer than a row"):
        TokenLoader(out, "val", global_batch=2, seq_len=8, accepts_batch=True).next_batch()
    summary, lengths = loader.packing_summary(), loader.ds.lengths
    assert summary["real_tokens"] == lengths[lengths <= 96].sum() and summary["too_long"] == (lengths > 96).sum()
    assert summary["efficiency"] == summary["real_tokens"] / (96 * summary["rows"]) and 0 < summary["efficiency"] <= 1
    first = loader.next_batch()
    second = loader.next_batch()
    for a, b in zip(vars(first).values(), vars(second).values()):
        assert not np.shares_memory(a, b)
    for batch in (first, second, *loader.iter_eval_batches(2)):
        check_batch(batch, loader.ds, 96)
    assert first.real_tokens > 0 and 0 < first.trained_tokens < first.real_tokens
    loader.close()
    # Without document masking: the same rows, one segment of running positions per row.
    plain = TokenLoader(out, "train", global_batch=3, seq_len=95, seed=2, accepts_batch=True, document_masking=False)
    unmasked = plain.next_batch()
    plain.close()
    np.testing.assert_array_equal(unmasked.tokens, first.tokens)
    np.testing.assert_array_equal(unmasked.weights, first.weights)
    real = first.segment_ids != PAD_SEGMENT
    np.testing.assert_array_equal(unmasked.segment_ids, real.astype(np.int32))
    np.testing.assert_array_equal(unmasked.positions, np.where(real, np.arange(96), 0))
    # Two processes: each reads its half of the rows of every step.
    halves = [TokenLoader(out, "train", global_batch=4, seq_len=95, seed=2, process_index=p, process_count=2,
                          accepts_batch=True) for p in range(2)]
    whole = TokenLoader(out, "train", global_batch=4, seq_len=95, seed=2, accepts_batch=True)
    for _ in range(2):
        parts, want = [h.next_batch() for h in halves], whole.next_batch()
        for key in ("tokens", "weights", "segment_ids", "positions"):
            np.testing.assert_array_equal(np.concatenate([getattr(p, key) for p in parts]), getattr(want, key))
    for each in (*halves, whole):
        each.close()


def test_chat_loader_resumes_exactly(chat_data):
    out, _, _ = chat_data
    kwargs = dict(global_batch=2, seq_len=63, seed=5, block_tokens=400, truncate=True, accepts_batch=True)
    a = TokenLoader(out, "train", **kwargs)
    for _ in range(4):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    expected = [a.next_batch() for _ in range(16)]
    assert a.state_dict()["epoch"] >= 1 and state["block"] >= 1  # crossed blocks and an epoch
    b = TokenLoader(out, "train", **kwargs)
    b.load_state_dict(state)
    for want in expected:
        got = b.next_batch()
        for key in ("tokens", "weights", "segment_ids", "positions"):
            np.testing.assert_array_equal(getattr(got, key), getattr(want, key))
    with pytest.raises(UserError, match="field 'truncate' expected False"):
        TokenLoader(out, "train", **{**kwargs, "truncate": False}).load_state_dict(state)
    a.close()
    b.close()


@pytest.mark.parametrize("eos", [None, 998])
def test_document_masking_for_text_gives_each_bos_piece_its_own_segment(tmp_path, eos):
    rng = np.random.default_rng(6)
    docs = [rng.integers(0, 990, rng.integers(3, 120)) for _ in range(40)]  # some longer than a row: cut
    w = shards.ShardWriter(tmp_path / shards.shard_name("train", 0), "uint16")
    for d in docs:
        w.add(d)
    entry = w.close()
    shards.write_manifest(tmp_path, {
        "format": shards.FORMAT, "format_version": 3, "streams": ["tokens"], "tokenizer": {}, "vocab_size": 1000,
        "bos_id": 999, "eos_id": eos, "dtype": "uint16", "record_tokens": shards.RECORD_TOKENS,
        "splits": {"train": {"docs": len(docs), "tokens": entry["tokens"], "shards": [entry]}}})
    data = tmp_path
    plain = TokenLoader(data, "train", global_batch=2, seq_len=50, seed=3, block_tokens=300)
    masked = TokenLoader(data, "train", global_batch=2, seq_len=50, seed=3, block_tokens=300, document_masking=True,
                         accepts_batch=True)
    bos = plain.ds.bos_id
    for _ in range(3):
        tokens, batch = plain.next_batch(), masked.next_batch()
        np.testing.assert_array_equal(batch.tokens, tokens)  # the same rows as without masking
        starts = batch.positions == 0
        np.testing.assert_array_equal(starts, tokens == bos)  # a segment begins at each BOS
        np.testing.assert_array_equal(batch.segment_ids, np.cumsum(starts, axis=1))
        np.testing.assert_array_equal(batch.weights, (~starts).astype(np.float32))
    assert masked.state_dict() == plain.state_dict()
    plain.close()
    masked.close()
