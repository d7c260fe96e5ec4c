"""The KV-cache forward in eager torch (the ground truth of generation): it reproduces the full
forward for left-padded rows of different lengths, across the sliding-window ring's wrap, for
prefills in one or several chunks; and the cached-attention op against a naive loop."""
import numpy as np
import pytest
import torch

from helpers import rel_err
from torch_model import kv_cache, ops
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM

WINDOW = 4
CFG = get_preset("tiny").replace(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                                 n_experts=4, expert_dim=16, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GptOssForCausalLM(CFG).eval()
    with torch.no_grad():      # every parameter random (sinks, biases too) so no path can hide
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0, -1]


@torch.no_grad()
def test_cached_decoding_matches_full_forward_for_mixed_lengths_across_the_ring_wrap(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 11, 1)]   # around W = 4
    ids, positions = kv_cache.left_pad(prompts)
    steps, width = 9, ids.shape[1]
    cache = kv_cache.init_cache(CFG, len(prompts), width + steps)
    logits, cache = model.forward_cached(ids, positions, cache, 0)
    seqs = [list(p) for p in prompts]
    for step in range(steps):
        for row, seq in enumerate(seqs):
            assert rel_err(logits[row], full_logits(model, seq)) < 1e-5, (step, row)
        nxt = logits.argmax(-1)
        for row, seq in enumerate(seqs):
            seq.append(int(nxt[row]))
        positions = positions[:, -1:] + 1
        logits, cache = model.forward_cached(nxt[:, None], positions, cache, width + step)


@torch.no_grad()
@pytest.mark.parametrize("chunks", [(5, 6), (2, 3, 6), (7, 1, 3)])
def test_prefill_in_chunks_matches_one_prefill(model, chunks):
    """A chunk of several tokens arriving on a cache whose ring already wrapped."""
    tokens = torch.randint(0, 97, (2, sum(chunks)), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(sum(chunks)).expand(2, -1).to(torch.int32)
    cache = kv_cache.init_cache(CFG, 2, sum(chunks))
    start = 0
    for n in chunks:
        logits, cache = model.forward_cached(tokens[:, start:start + n], positions[:, start:start + n], cache, start)
        start += n
    expected = model(tokens)[:, -1]
    assert rel_err(logits, expected) < 1e-5


@torch.no_grad()
def test_a_prompt_longer_than_the_window_leaves_its_last_positions_at_pos_mod_w(model):
    prompt = list(range(10, 21))                         # 11 tokens, W = 4
    ids, positions = kv_cache.left_pad([prompt, prompt[:2]])
    _, cache = model.forward_cached(ids, positions, kv_cache.init_cache(CFG, 2, 16), 0)
    ring = cache.sliding_positions
    assert ring.shape == (2, WINDOW)
    assert ring[0].tolist() == [8, 9, 10, 7]            # slot = sequence index mod 4; positions 7..10
    assert ring[1].tolist() == [-1, 0, 1, -1]           # indices 9, 10 (slots 1, 2) hold positions 0, 1
    assert cache.full_positions[1, :11].tolist() == [-1] * 9 + [0, 1]
    sliding = [i for i, kind in enumerate(CFG.layer_types) if kind == "sliding_attention"]
    full = [i for i in range(CFG.n_layers) if i not in sliding]
    assert all(cache.keys[i].shape[2] == WINDOW for i in sliding) and all(cache.keys[i].shape[2] == 16 for i in full)


@pytest.mark.parametrize("slots", [4, 6, 16, 1])
def test_write_slots_are_the_sequence_indices_mod_the_ring_and_keep_the_last_ones(slots):
    """A ring of a power-of-two size takes the index's low bits, any other its remainder: the
    same slots; a chunk longer than the ring keeps its last `slots` tokens."""
    for start in (0, 3, 17, torch.tensor(29, dtype=torch.int32)):
        for num_new in (1, 5, 9):
            first, got = kv_cache.write_slots(start, num_new, slots)
            assert first == max(0, num_new - slots)
            assert got.tolist() == [(int(start) + i) % slots for i in range(first, num_new)]


def test_left_padding_positions_follow_transformers_cumulative_mask():
    ids, positions = kv_cache.left_pad([[5, 6, 7], [9]], length=4, pad_id=0)
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 9]]
    assert positions.tolist() == [[-1, 0, 1, 2], [-1, -1, -1, 0]]
    mask = torch.tensor([[0, 1, 1, 0, 1]])            # transformers: cumsum(mask) - 1 where mask is 1
    assert kv_cache.positions_from_mask(mask).tolist() == [[-1, 0, 1, -1, 2]]


def naive_cached_attention(q, k, v, sinks, qpos, kpos, window, scale):
    b, hq, tq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros(q.shape)
    for bi in range(b):
        for h in range(hq):
            for i in range(tq):
                p = int(qpos[bi, i])
                keys = [j for j in range(k.shape[2])
                        if 0 <= kpos[bi, j] <= p and (window == 0 or kpos[bi, j] > p - window)]
                s = [float(q[bi, h, i] @ k[bi, h // group, j]) * scale for j in keys] + [float(sinks[h])]
                e = np.exp(np.array(s) - max(s))
                e /= e.sum()
                out[bi, h, i] = sum(e[n] * v[bi, h // group, j].numpy() for n, j in enumerate(keys))
    return out


def random_cache_inputs(seed, b=2, hq=4, hkv=2, tq=3, slots=7, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g)
    k, v = torch.randn(b, hkv, slots, d, generator=g), torch.randn(b, hkv, slots, d, generator=g)
    sinks = torch.randn(hq, generator=g)
    kpos = torch.randperm(slots, generator=g).expand(b, -1).clone().to(torch.int32)   # slots in any order
    kpos[0, :2] = -1                                                                  # empty / padding
    qpos = torch.tensor([[4, 5, 6], [2, 3, 6]], dtype=torch.int32)[:b, :tq]
    return q, k, v, sinks, qpos, kpos


@pytest.mark.parametrize("window", [0, 1, 3])
def test_cached_attention_op_equals_naive_masked_softmax_by_position(window):
    q, k, v, sinks, qpos, kpos = random_cache_inputs(window)
    got = ops.OPS["cached_attention"](q, k, v, sinks, qpos, kpos, window, 0.4)
    assert rel_err(got, naive_cached_attention(q, k, v, sinks, qpos, kpos, window, 0.4)) < 1e-6


def test_cached_attention_of_a_query_without_visible_keys_is_zero_not_nan():
    q, k, v, sinks, qpos, kpos = random_cache_inputs(0)
    qpos = torch.full_like(qpos, -1)                  # a padding query sees nothing but the sink
    out = ops.OPS["cached_attention"](q, k, v, sinks, qpos, kpos, 0, 0.4)
    assert torch.equal(out, torch.zeros_like(out))


def test_the_training_forward_equals_cached_prefill(model):
    """Both paths run the same torch code up to the attention op: one prefill of a full row
    equals the training forward's last logits."""
    tokens = torch.randint(0, 97, (3, 13), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(13).expand(3, -1).to(torch.int32)
    with torch.no_grad():
        logits, _ = model.forward_cached(tokens, positions, kv_cache.init_cache(CFG, 3, 13), 0)
        assert rel_err(logits, model(tokens)[:, -1]) < 1e-6
