"""Greedy generation for generative tasks (train/evaluation/greedy.py) on a small random model
with a 320-id BPE: tokens equal eager PyTorch's greedy continuation (no cache), stop strings end a
row early and cut its text exactly where decoding everything and cutting would, per-request token
limits, left truncation of long prompts, and bad requests. One generator: its buckets compile once."""
import numpy as np
import pytest
import torch

from parity.generation import compare_greedy, eager_greedy
from tests.helpers import PLAY_LINES
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from formats.tokenizer import train_bpe
from formats.errors import UserError
from train.evaluation.greedy import GreedyGenerator, cut_at_stop
from train.evaluation.requests import GenerationRequest

NEW, WINDOW = 24, 64


@pytest.fixture(scope="module")
def setup():
    tokenizer = train_bpe(PLAY_LINES * 10, 320)
    cfg = get_preset("tiny").replace(vocab_size=tokenizer.n_vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                     head_dim=16, n_experts=4, expert_dim=32, sliding_window=8, max_seq_len=WINDOW,
                                     bos_token_id=319, eos_token_id=319)
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()
    return model, tokenizer, GreedyGenerator(model, tokenizer, batch_size=4, chunk_tokens=4)


def fresh_prompts(tokenizer, seed):
    """Random play text of odd lengths 5..33 tokens, after the document start."""
    rng = np.random.default_rng(seed)
    ids = tokenizer.encode_ordinary(" ".join(PLAY_LINES))
    return [[319] + ids[s:s + n] for s, n in zip(rng.integers(0, len(ids) - 40, 4), (5, 17, 33, 10))]


def test_cut_at_stop_takes_the_earliest_stop_string():
    assert cut_at_stop("ab\ndef x\nclass", ("\nclass", "\ndef")) == ("ab", True)
    assert cut_at_stop("abc", ("\n#", "")) == ("abc", False)


def test_greedy_equals_eager_and_stop_strings_cut_where_full_decoding_would(setup, monkeypatch):
    model, tokenizer, greedy = setup
    # Fresh prompts whose free texts are long enough to take a stop string from their middle (the
    # random model sometimes hits its stop token within a few tokens: draw again).
    for _ in range(20):
        prompts = fresh_prompts(tokenizer, seed=int(np.random.SeedSequence().entropy % 1000))
        free = greedy.generate([GenerationRequest(tuple(p), NEW) for p in prompts])
        if all(len(r.text) >= 8 for r in free):
            break
    eager, margins = eager_greedy(model, prompts, NEW)
    # A stop token (319) ends a row; compare up to it.
    report = compare_greedy([list(r.tokens) for r in free], [e[:len(r.tokens)] for e, r in zip(eager, free)],
                            margins)
    assert all(r["ok"] for r in report), report
    assert all(r.truncated == 0 and r.text == greedy.decode(r.tokens) for r in free)

    # Stop strings taken from the middle of each free text: the row ends early, its text is the
    # free text cut before the stop string's first occurrence.
    stops = []
    for r in free:
        text = r.text
        assert len(text) >= 8, text
        stops.append(text[len(text) // 3:len(text) // 3 + 2])
    requests = [GenerationRequest(tuple(p), NEW, stop=(s, "\u2603")) for p, s in zip(prompts, stops)]
    requests[3] = GenerationRequest(tuple(prompts[3]), 7)          # its own, shorter limit
    runs = []
    generate = greedy.generator.generate
    monkeypatch.setattr(greedy.generator, "generate", lambda *a, **k: runs.append(generate(*a, **k)) or runs[-1])
    cut = greedy.generate(requests)
    assert runs[-1].decode_steps + 1 < NEW, "the stop strings did not end the decode loop early"
    for i, (r, c, s) in enumerate(zip(free, cut, stops)):
        if i == 3:
            assert c.tokens == r.tokens[:7] and c.text == greedy.decode(r.tokens[:7])
            continue
        assert c.text == r.text[:r.text.find(s)]
        # The tokens run through the one that completed the stop string, whatever the chunk size.
        assert c.tokens == r.tokens[:len(c.tokens)] and s in greedy.decode(c.tokens)
        assert s not in greedy.decode(c.tokens[:-1])


def test_long_prompts_are_cut_from_the_left_and_the_count_reported(setup):
    _, tokenizer, greedy = setup
    long = [319] + tokenizer.encode_ordinary(" ".join(PLAY_LINES))[:WINDOW]
    room = WINDOW - NEW
    # Four requests: the bucket of the test above (its programs are reused).
    others = [GenerationRequest(tuple(p), NEW) for p in fresh_prompts(tokenizer, seed=1)[:2]]
    got = greedy.generate([GenerationRequest(tuple(long), NEW), GenerationRequest(tuple(long[-room:]), NEW), *others])
    assert got[0].truncated == len(long) - room and got[1].truncated == 0
    assert got[0].tokens == got[1].tokens and got[0].text == got[1].text


@pytest.mark.parametrize("request_, message", [
    (GenerationRequest((1, 2), WINDOW), "max_new_tokens must be in"),
    (GenerationRequest((), 4), "empty prompt"),
])
def test_bad_requests_are_one_line_errors(setup, request_, message):
    with pytest.raises(UserError, match=message):
        setup[2].generate([request_])
