"""Supervised fine-tuning's step: packed rows train exactly like their conversations
one by one, weight-0 labels never reach a gradient, and accumulation equals one big batch.

Float32 on CPU; router loss coefficients 0 where whole batches are compared with their parts
(the router's balance and z losses are batch statistics). One tiny model (two layers: sliding
window and full), one packed batch, the kernel sets of the parity matrix.
"""
import functools

import jax
import numpy as np
import pytest
import torch

from helpers import rel_err
from jax_bridge.lowering import params_to_jax
from jax_bridge.step import StepConfig, TrainStep, packed_inputs
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM

LENGTHS = (9, 14, 11)          # three conversations, then padding: a row of 41 = seq_len + 1
ROW = 41
KERNEL_SETS = {"xla": "xla", "splash": "attention=splash"}    # segments touch attention; CE/MoE see weights only


@functools.lru_cache(maxsize=None)
def tiny_model():
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(vocab_size=96, d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2,
                                     n_experts=4, expert_dim=16, sliding_window=6, router_aux_loss_coef=0.0,
                                     max_seq_len=ROW - 1)
    model = GptOssForCausalLM(cfg)
    model.reset_parameters(seed=1)
    return model


def conversations(seed=0):
    """Three random conversations: (tokens, weights) with weight 0 on each first token and on a
    random prompt part, as the chat data has."""
    rng = np.random.default_rng(seed)
    out = []
    for n in LENGTHS:
        tokens = rng.integers(1, 96, n).astype(np.int32)
        weights = (rng.random(n) < 0.6).astype(np.float32)
        weights[0] = 0
        out.append((tokens, weights))
    return out


def packed_row(convs, pad_id=0):
    row = {"tokens": np.full((1, ROW), pad_id, np.int32), "weights": np.zeros((1, ROW), np.float32),
           "segment_ids": np.zeros((1, ROW), np.int32), "positions": np.zeros((1, ROW), np.int32)}
    at = 0
    for k, (tokens, weights) in enumerate(convs, 1):
        n = len(tokens)
        row["tokens"][0, at:at + n], row["weights"][0, at:at + n] = tokens, weights
        row["segment_ids"][0, at:at + n], row["positions"][0, at:at + n] = k, np.arange(n)
        at += n
    return row


def torch_logits_and_grads(model, row, denominator=None):
    """Eager: logits [1, T, V] and the weighted cross-entropy's parameter gradients of one row."""
    t = {k: torch.tensor(v) for k, v in row.items()}
    model.zero_grad()
    args = (t["tokens"][:, :-1], t["tokens"][:, 1:], t["positions"][:, :-1], t["segment_ids"][:, :-1],
            t["weights"][:, 1:], denominator)
    out = model(*args)
    out["loss"].backward()
    with torch.no_grad():
        logits = model(t["tokens"][:, :-1], None, t["positions"][:, :-1], t["segment_ids"][:, :-1])
    return logits.numpy(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def separate_reference():
    """Each conversation alone (no segment ids, positions 0..n-1), its loss normalised by all
    three's trained tokens, gradients summed: what the packed row must equal."""
    model = tiny_model()
    convs = conversations()
    total = float(sum(w[1:].sum() for _, w in convs))
    logits, grads = [], None
    for tokens, weights in convs:
        n = len(tokens)
        row = {"tokens": tokens[None], "weights": weights[None], "segment_ids": np.ones((1, n), np.int32),
               "positions": np.arange(n, dtype=np.int32)[None]}
        t = {k: torch.tensor(v) for k, v in row.items()}
        model.zero_grad()
        model(t["tokens"][:, :-1], t["tokens"][:, 1:], None, None, t["weights"][:, 1:],
              torch.tensor(total))["loss"].backward()
        with torch.no_grad():
            logits.append(model(t["tokens"])[0].numpy())       # all n inputs' logits
        g = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
        grads = g if grads is None else {k: grads[k] + g[k] for k in grads}
    return logits, grads


def check_packed(logits, grads):
    separate_logits, separate_grads = separate_reference()
    at = 0
    for part in separate_logits:
        n = part.shape[0]
        got = logits[0, at:at + n] if at + n <= logits.shape[1] else logits[0, at:]
        assert rel_err(got, part[:got.shape[0]]) <= 1e-5
        at += n
    for name, g in separate_grads.items():
        assert rel_err(grads[name], g) <= 1e-4, (name, rel_err(grads[name], g))


def test_packed_row_equals_conversations_alone_eager():
    logits, grads = torch_logits_and_grads(tiny_model(), packed_row(conversations()))
    check_packed(logits, grads)
    # Without segment ids the same row is NOT the same: the check can fail.
    row = packed_row(conversations())
    unmasked = torch_logits_and_grads(tiny_model(), {**row, "segment_ids": (row["segment_ids"] > 0).astype(np.int32)})
    with pytest.raises(AssertionError):
        check_packed(*unmasked)


@functools.lru_cache(maxsize=None)
def step_for(kernels, scan_layers=True):
    return TrainStep(tiny_model(), step_cfg=StepConfig(kernels=kernels, compute_dtype="float32",
                                                      scan_layers=scan_layers))


# The lowered step at xla; each other kernel's packed rows equal eager torch's in the parity suite
# (packed rows, every kernel set), and eager's equal the conversations alone (above).
def test_packed_row_equals_conversations_alone_lowered():
    step = step_for(KERNEL_SETS["xla"])
    params = params_to_jax(tiny_model())
    state_params = step.layer_layout.stack(params)
    row = step.place_batch(packed_row(conversations()), 0)

    def logits_and_grads(p, r):           # one compile for both
        inputs, _, packed = packed_inputs(r, None, 1.0)
        with step.routing():
            logits = step.forward(p, inputs, None, packed[0], packed[1])
        return logits, step._grads(p, r)[1]

    logits, grads = jax.jit(logits_and_grads)(state_params, row)
    check_packed(np.asarray(logits), {k: np.asarray(v) for k, v in step.layer_params(grads).items()})


@pytest.mark.parametrize("segments", [True, False], ids=["segment ids", "no segment ids"])
def test_splash_under_scanned_layers_equals_the_layer_loop(segments):
    """Splash built inside the scan body's trace once leaked its mask arrays into the scan's
    backward (UnexpectedTracerError); scanned, it gives the layer loop's loss and gradients."""
    row = packed_row(conversations())
    batch = row if segments else row["tokens"]       # bare tokens: no segment ids reach attention
    results = []
    for scan in (True, False):
        step = step_for(KERNEL_SETS["splash"], scan)
        params = step.layer_layout.stack(params_to_jax(tiny_model()))
        (loss, _), grads = jax.jit(step._grads)(params, step.place_batch(batch, 0))
        results.append((float(loss), {k: np.asarray(v) for k, v in step.layer_params(grads).items()}))
    (scanned_loss, scanned), (loop_loss, loop) = results
    assert abs(scanned_loss - loop_loss) <= 1e-6 * abs(loop_loss)
    assert scanned.keys() == loop.keys()
    for name in loop:
        assert rel_err(scanned[name], loop[name]) <= 1e-5, (name, rel_err(scanned[name], loop[name]))


def test_labels_at_weight_zero_reach_no_gradient():
    model = tiny_model()
    row = packed_row(conversations(1))
    t = {k: torch.tensor(v) for k, v in row.items()}
    labels = t["tokens"][:, 1:].clone()
    weights = t["weights"][:, 1:]

    def grads(labels):
        model.zero_grad()
        model(t["tokens"][:, :-1], labels, t["positions"][:, :-1], t["segment_ids"][:, :-1], weights)["loss"].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    before = grads(labels)
    untrained = weights == 0
    changed = torch.where(untrained, (labels + 1 + torch.randint(0, 90, labels.shape)) % 96, labels)
    assert (changed != labels)[untrained].all()
    after = grads(changed)
    assert all(torch.equal(before[n], after[n]) for n in before)
    trained_changed = torch.where(~untrained, (labels + 1) % 96, labels)     # a trained label does count
    assert not torch.equal(grads(trained_changed)["lm_head.weight"], before["lm_head.weight"])


def test_accumulation_equals_one_big_batch():
    """Two micro-batches with different trained-token counts (11 and 3) give the step of the one
    batch holding both rows: the loss is normalised by the step's trained tokens, not averaged
    over micro-batch means (which would weight the 3 tokens' loss like the 11's)."""
    convs = conversations(2)
    first = packed_row(convs)
    second = packed_row(conversations(3)[:1])
    second["weights"][0, 4:] = 0
    assert first["weights"][0, 1:].sum() != second["weights"][0, 1:].sum()
    both = {k: np.concatenate([first[k], second[k]])[None] for k in first}           # [1, 2, T+1]
    split = {k: np.stack([first[k], second[k]]) for k in first}                      # [2, 1, T+1]
    results = []
    torch.manual_seed(0)
    model = GptOssForCausalLM(get_preset("dense").replace(vocab_size=96, d_model=32, n_heads=2, n_kv_heads=1,
                                                          head_dim=16, n_layers=1, dense_dim=32))
    for micro, batch in ((1, both), (2, split)):       # a one-layer dense model: two quick compiles
        step = TrainStep(model, step_cfg=StepConfig(kernels="xla", compute_dtype="float32", micro_batches=micro))
        state = step.init_state()
        before = {k: np.asarray(v) for k, v in state.params.items()}
        state, metrics = step(state, batch)
        results.append(({k: np.asarray(v) - before[k] for k, v in state.params.items()}, metrics))
    (big, big_metrics), (acc, acc_metrics) = results
    assert abs(float(big_metrics["ce"]) - float(acc_metrics["ce"])) <= 1e-5 * abs(float(big_metrics["ce"]))
    assert float(acc_metrics["trained_tokens"]) == both["weights"][..., 1:].sum()
    for name in big:
        assert rel_err(acc[name], big[name]) <= 1e-4, (name, rel_err(acc[name], big[name]))
    # What averaging micro-batch means would have given differs: the test can tell.
    ce_each = []
    for i in range(2):
        t = {k: torch.tensor(v[i]) for k, v in split.items()}
        with torch.no_grad():
            ce_each.append(float(model(t["tokens"][:, :-1], t["tokens"][:, 1:], t["positions"][:, :-1],
                                       t["segment_ids"][:, :-1], t["weights"][:, 1:])["ce"]))
    assert abs(np.mean(ce_each) - float(big_metrics["ce"])) > 1e-3
