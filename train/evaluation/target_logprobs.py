"""Per-position target log-probabilities on device, shared by the scorer's programs: logits formed
a slice of positions at a time (never all at once, never leaving the device), and the record of
one program's compilation; the model's hidden states under its own parameter names, the head
left to the programs."""
from __future__ import annotations

from typing import NamedTuple

import torch

LOGITS_BUDGET = 1 << 27          # float32 logits formed at once per device (512 MiB)


class Compilation(NamedTuple):
    bucket: tuple                # the one-forward program: (rows, positions, scored per row); the shared-
                                 # context ones: ("prefill" | "continue", shapes...)
    seconds: float               # tracing + lowering + compiling


class HiddenStates(torch.nn.Module):
    """The model's final (normed) hidden states [B, T, H] under the model's own parameter names
    (its children are this module's): the scoring programs apply the head themselves, a slice of
    positions at a time; a module model whose head is not fused gives its logits instead (its
    `head_name` is None). `forward`: one full forward; `forward_cached`: `Backbone.forward_cached`
    (hidden states, updated cache)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.cfg = model.cfg
        for name, child in model.named_children():
            setattr(self, name, child)

    def forward(self, input_ids):
        return self.model(input_ids)[0]

    def forward_cached(self, input_ids, positions, cache, start):
        return self.model.forward_cached(input_ids, positions, cache, start)


def positions_tile(rows: int, positions: int, vocab: int, shards: int) -> int:
    """The largest divisor of `positions` whose [rows / shards, tile, vocab] float32 logits stay
    within LOGITS_BUDGET (at least 1)."""
    local_rows = max(1, rows // shards)
    fitting = [d for d in range(1, positions + 1) if positions % d == 0 and local_rows * d * vocab <= LOGITS_BUDGET]
    return max(fitting, default=1)


def head_name(model) -> str | None:
    """The parameter the scoring programs form logits with: the head's weight (a head trained
    whole by peft's modules_to_save under its own name), or None when the model's forward gives
    the logits itself (a module model whose head is not fused)."""
    from torch_model.lora import trained_copy_name

    if getattr(model, "fused_head", True) is False:
        return None
    trained_head = trained_copy_name("lm_head", "weight")
    return trained_head if trained_head in dict(model.named_parameters()) else "lm_head.weight"


def target_scores(hidden, head, targets, tile: int, precision: str):
    """(log p(target) [B, T] float32, target is the argmax [B, T]) from hidden states [B, T, H]
    and the head [V, H] (None: `hidden` are the logits [B, T, V]), forming logits for `tile`
    positions of every row at a time; the head's
    matmul at `precision` (the program's matmul precision, "default" | "high" | "highest"): given
    here, not left to the caller's scope, which the program's model forward alone may hold."""
    import jax
    import jax.numpy as jnp

    b, t, h = hidden.shape
    slices = (hidden.reshape(b, t // tile, tile, h).swapaxes(0, 1), targets.reshape(b, t // tile, tile).swapaxes(0, 1))

    def one(args):
        states, labels = args
        logits = (states.astype(jnp.float32) if head is None else
                  jnp.einsum("bth,vh->btv", states, head, preferred_element_type=jnp.float32, precision=precision))
        picked = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
        return picked - jax.nn.logsumexp(logits, -1), jnp.argmax(logits, -1) == labels

    logprobs, best = jax.lax.map(one, slices)
    return logprobs.swapaxes(0, 1).reshape(b, t), best.swapaxes(0, 1).reshape(b, t)


def request_scores(hidden, head, targets, scored, tile: int, precision: str):
    """Per row: (summed log p(target) over the `scored` positions [B] float32, every scored
    target is the argmax [B]); `target_scores` of the positions (at `precision`), padding left out."""
    import jax.numpy as jnp

    logprobs, best = target_scores(hidden, head, targets, tile, precision)
    return jnp.where(scored, logprobs, 0.0).sum(1), jnp.all(best | ~scored, axis=1)
