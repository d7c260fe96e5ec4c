"""DPO through the commands: `prepare --preferences` (TRL's conversational records,
malformed ones named in one line each), `train --dpo` with LoRA (rewards metrics, held-out pairs,
plots; the adapter exported for peft loads onto the exported base with our logits) and with
full fine-tuning (the reference log-probabilities stored beside the data; a stale file refused
in one line)."""
import json

import numpy as np
import pytest
import torch

from formats import checkpoint, tokenizer
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from train.cli import main
from train.data import preferences, shards

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

WORDS = "the king queen sword crown night day fair foul love hate war peace ghost witch storm sea".split()
PAIRS, VAL = 24, 6
MODEL = dict(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=2, expert_dim=32,
             sliding_window=8)
BAD = [({"prompt": [{"role": "user", "content": "hi"}], "rejected": [{"role": "assistant", "content": "no"}]},
        "no 'chosen'"),
       ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "same"}],
         "rejected": [{"role": "assistant", "content": "same"}]}, "chosen and rejected are identical")]


def record(rng):
    say = lambda n: " ".join(rng.choice(WORDS, n))       # noqa: E731
    return {"prompt": [{"role": "user", "content": say(4)}], "chosen": [{"role": "assistant", "content": say(3)}],
            "rejected": [{"role": "assistant", "content": say(2)}]}


@pytest.fixture(scope="module")
def dpo_data(tmp_path_factory):
    """Preference data (with two malformed records) and a base checkpoint of its tokenizer."""
    root = tmp_path_factory.mktemp("dpo")
    rng = np.random.default_rng(0)
    lines = [json.dumps(record(rng)) for _ in range(PAIRS)]
    lines[5:5] = [json.dumps(r) for r, _ in BAD]
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    (root / "val").mkdir()
    (root / "val" / "val.jsonl").write_text("".join(json.dumps(record(rng)) + "\n" for _ in range(VAL)))
    assert main(["prepare", "--preferences", "--input", str(root / "pairs.jsonl"), "--val-input", str(root / "val"),
                 "--out", str(root / "data"), "--tokenizer", "bpe:300", "--workers", "1"]) == 0
    enc = tokenizer.load_tokenizer(root / "data")
    cfg = get_preset("tiny").replace(vocab_size=enc.n_vocab, bos_token_id=tokenizer.bos_id(enc),
                                     eos_token_id=tokenizer.end_id(enc), max_seq_len=96, **MODEL)
    torch.manual_seed(0)
    checkpoint.save_checkpoint(root / "base", GptOssForCausalLM(cfg).state_dict(), cfg, tokenizer=enc)
    return root


def test_prepare_preferences_renders_pairs_and_names_each_malformed_record(dpo_data, capsys):
    root = dpo_data
    m = json.loads((root / "data" / "manifest.json").read_text())
    assert m["kind"] == "preferences" and m["pairs"] == {"train": PAIRS, "val": VAL}
    names = m["skipped"]["records"]
    assert len(names) == 2 and all(f"pairs.jsonl:{6 + i}: {why}" in names[i] for i, (_, why) in enumerate(BAD))
    enc = tokenizer.load_tokenizer(root / "data")
    with shards.open_dataset(root / "data", "train") as ds:
        ids, codes = ds.doc(0), ds.read_segments([(0, 0, int(ds.lengths[0]))], "weights")[0]
    side = preferences.side_of(codes)
    assert (np.diff(side) >= 0).all() and side[0] == 0 and side[-1] == 1        # chosen side, then rejected
    first = json.loads((root / "pairs.jsonl").read_text().splitlines()[0])
    for s, key in ((0, "chosen"), (1, "rejected")):
        trained = ids[(side == s) & (preferences.trained(codes) == 1)]
        assert key and first[key][0]["content"] in enc.decode(trained.tolist())
        prompt = ids[(side == s) & (preferences.trained(codes) == 0)]
        assert first["prompt"][0]["content"] in enc.decode(prompt.tolist())     # the prompt on each side


def test_bad_preference_input_is_refused_in_one_line(dpo_data, tmp_path, capsys):
    root = dpo_data
    (tmp_path / "one.jsonl").write_text(json.dumps(BAD[0][0]) + "\n" + json.dumps(BAD[1][0]) + "\n")
    assert main(["prepare", "--preferences", "--input", str(tmp_path / "one.jsonl"), "--out", str(tmp_path / "d"),
                 "--tokenizer", str(root / "data"), "--strict", "--workers", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]   # (and a progress bar)
    assert len(errors) == 1 and "one.jsonl:1: malformed conversation: no 'chosen'" in errors[0]
    # --dpo on data without pairs, and pairs without --dpo: named.
    assert main(["train", "--init-from", str(root / "base"), "--data", str(root / "data"), "--out",
                 str(tmp_path / "x"), "--steps", "1", "--seq-len", "64"]) == 2
    assert "holds preference pairs (prepare --preferences): train on them with --dpo" in capsys.readouterr().err



def test_a_pair_longer_than_a_row_is_dropped_and_counted_or_cut_to_the_start_of_each_side(dpo_data):
    """Rows as long as the shortest pair: without truncate the longer pairs are dropped and counted
    (the packing line at train start); with it each side keeps its start (prompt first), in one
    row as segments 2k+1 and 2k+2 (a side cut before its answer leaves that pair out of the loss)."""
    from train.data.loader import TokenLoader

    data = dpo_data / "data"
    with shards.open_dataset(data, "train") as ds:
        lengths = np.asarray(ds.lengths)
    seq_len = int(lengths.min()) - 1                 # the shortest pairs fill a row of seq_len + 1
    too_long = int((lengths > seq_len + 1).sum())
    assert 0 < too_long < len(lengths)
    kwargs = dict(global_batch=4, seq_len=seq_len, seed=1, accepts_batch=True)
    loader = TokenLoader(data, "train", **kwargs)
    summary = loader.packing_summary()
    assert (summary["dropped"], summary["truncated"]) == (too_long, 0)
    cut = TokenLoader(data, "train", truncate=True, **kwargs)
    assert (cut.packing_summary()["dropped"], cut.packing_summary()["truncated"]) == (0, too_long)
    batch, both_trained = cut.next_batch(), 0
    with shards.open_dataset(data, "train") as ds:
        for row in range(len(batch.tokens)):
            for k, doc in enumerate(batch.pair_docs[row]):
                if doc < 0:
                    continue
                ids, codes = ds.doc(int(doc)), ds.read_segments([(int(doc), 0, int(ds.lengths[doc]))], "weights")[0]
                trained_sides = 0
                for side in (0, 1):
                    here = batch.segment_ids[row] == 2 * k + 1 + side
                    full, kept = ids[preferences.side_of(codes) == side], batch.tokens[row][here]
                    assert 0 < len(kept) <= len(full) and (kept == full[:len(kept)]).all()   # that side's start
                    trained_sides += batch.weights[row][here].sum() > 0
                both_trained += trained_sides == 2
    assert both_trained > 0
    cut.close()
    loader.close()


def dpo_run(root, out, *extra):
    (root / "run.json").write_text(json.dumps({"eval_batches": 1, "samples": 0}))
    return main(["train", "--config", str(root / "run.json"), "--init-from", str(root / "base"), "--data",
                 str(root / "data"), "--out", str(out), "--steps", "2", "--batch-size", "2", "--seq-len", "128",
                 "--log-every", "1", "--eval-every", "2", "--lr", "0.02", "--adam-lr", "0.01", *extra])


def test_lora_dpo_run_logs_rewards_and_its_adapter_loads_in_peft_with_our_logits(dpo_data, tmp_path, capsys):
    from train.generation.generator import load_for_generation

    root = dpo_data
    out = tmp_path / "lora"
    assert dpo_run(root, out, "--dpo", "beta=0.1", "--lora", "r=2,alpha=4,targets=all-linear",
                   "--micro-batches", "2") == 0
    assert json.loads((out / "summary.json").read_text())["compile_count"] == 1    # one program: sharding.one_device
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    first_eval, last_eval = evals[0], evals[-1]
    assert abs(train[0]["dpo_loss"] - np.log(2)) <= 1e-5          # policy = reference at the first step
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected"):
        assert key in train[-1] and "val_" + key in last_eval
    assert first_eval["val_pairs"] == last_eval["val_pairs"] > 0 and abs(first_eval["val_loss"] - np.log(2)) <= 1e-5
    assert (out / "plots" / "preferences.png").is_file()
    assert main(["export", "--checkpoint", str(root / "base"), "--out", str(tmp_path / "hf_base")]) == 0
    assert main(["export", "--checkpoint", str(out), "--adapter", "--out", str(tmp_path / "adapter"),
                 "--base-model", str(tmp_path / "hf_base")]) == 0
    ours, enc = load_for_generation(out)
    ids = torch.tensor([[ours.cfg.bos_token_id] + enc.encode_ordinary("the king and the queen")])
    load = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base", **load)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits.double()
        mine = ours.eval()(ids).double()
    assert float((theirs - mine).norm() / mine.norm()) <= 1e-5


def test_full_dpo_stores_the_reference_beside_the_data_and_refuses_a_stale_one(dpo_data, tmp_path, capsys):
    from train.run.reference import ARRAYS, META

    root = dpo_data
    assert dpo_run(root, tmp_path / "full", "--dpo", "beta=0.1,loss=ipo", "--steps", "1", "--eval-every", "1") == 0
    assert "DPO reference: log-probabilities of" in capsys.readouterr().out
    meta = json.loads((root / "data" / META).read_text())
    with np.load(root / "data" / ARRAYS) as arrays:
        assert arrays["train"].shape == (PAIRS, 2) and (arrays["train"] < 0).all()   # every pair fits a row of 129
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "train")
    assert abs(first["dpo_loss"] - 1 / (4 * 0.1 ** 2)) <= 1e-3      # stored vs recomputed reference: float noise
    # Resumed, the run reads the same file (the checkpoint names its reference) and goes on.
    assert main(["train", "--out", str(tmp_path / "full"), "--resume", "--steps", "2"]) == 0
    assert "read from" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"][-1] == 2
    meta["checkpoint"]["sha256"] = "0" * 64
    (root / "data" / META).write_text(json.dumps(meta))
    try:
        assert dpo_run(root, tmp_path / "again", "--dpo", "beta=0.1") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "stale reference log-probabilities" in err and META in err
    finally:
        (root / "data" / META).unlink()
        (root / "data" / ARRAYS).unlink()
