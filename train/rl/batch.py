"""Packing a rollout batch for the GRPO step: each (prompt, completion) pair becomes one segment
of a packed row, its completion tokens weighted 1 (0 for a truncated completion under
--mask-truncated), with the per-token float32 fields of jax_bridge/policy_gradient.py. The row
count is fixed by the run's budgets (`rows_for`), so every rollout has the same shape and the
step compiles once."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jax_bridge.policy_gradient import ADVANTAGES, LOGP_OLD, REF_LOGPS
from jax_bridge.step import PACKED_FIELDS


@dataclass
class Rollout:
    """One completion of one prompt, with its advantage and (when the objective needs them)
    per-completion-token log-probabilities."""
    prompt: list[int]
    completion: list[int]
    advantage: float = 0.0
    truncated: bool = False
    logp_old: list[float] | None = None
    ref_logps: list[float] | None = None


def per_row(seq_len: int, prompt_budget: int, max_new_tokens: int) -> int:
    """Sequences of the longest allowed length (prompt budget + max_new_tokens) one row holds."""
    longest = prompt_budget + max_new_tokens
    if longest > seq_len + 1:
        raise ValueError(f"rl: a row of {seq_len + 1} tokens cannot hold a {prompt_budget}-token prompt plus "
                         f"{max_new_tokens} new tokens (raise --seq-len or lower --max-prompt-tokens/--max-new-tokens)")
    return (seq_len + 1) // longest


def rows_for(sequences: int, seq_len: int, prompt_budget: int, max_new_tokens: int) -> int:
    return -(-sequences // per_row(seq_len, prompt_budget, max_new_tokens))


def pack_rollouts(rollouts: list[Rollout], rows: int, seq_len: int, fields: tuple[str, ...] = (ADVANTAGES,),
                  mask_truncated: bool = False) -> dict:
    """Rollouts -> {PACKED_FIELDS + fields: [rows, seq_len + 1]}, in order, a row filled until the
    next sequence does not fit. Segment k of a row (from 1) is its k-th sequence; the value of a
    per-token field at index i belongs to token i (a label)."""
    width = seq_len + 1
    out = {k: np.zeros((rows, width), np.int32) for k in PACKED_FIELDS}
    out["weights"] = np.zeros((rows, width), np.float32)
    out.update({k: np.zeros((rows, width), np.float32) for k in fields})
    row, at, seg = 0, 0, 1
    for i, r in enumerate(rollouts):
        n = len(r.prompt) + len(r.completion)
        if not r.prompt or not r.completion:
            raise ValueError(f"rl: rollout {i} has an empty prompt or completion")
        if n > width:
            raise ValueError(f"rl: rollout {i} has {n} tokens, more than a row's {width}")
        if at + n > width:
            row, at, seg = row + 1, 0, 1
        if row >= rows:
            raise ValueError(f"rl: {len(rollouts)} rollouts do not fit in {rows} rows of {width} tokens")
        sl = slice(at, at + n)
        done = slice(at + len(r.prompt), at + n)
        out["tokens"][row, sl] = np.concatenate([r.prompt, r.completion])
        out["segment_ids"][row, sl] = seg
        out["positions"][row, sl] = np.arange(n)
        out["weights"][row, done] = 0.0 if (mask_truncated and r.truncated) else 1.0
        if ADVANTAGES in fields:
            out[ADVANTAGES][row, done] = r.advantage
        for key, values in ((LOGP_OLD, r.logp_old), (REF_LOGPS, r.ref_logps)):
            if key in fields:
                if values is None or len(values) != len(r.completion):
                    raise ValueError(f"rl: rollout {i} needs {key} for its {len(r.completion)} completion tokens")
                out[key][row, done] = values
        at, seg = at + n, seg + 1
    return out


def unpack_tokens(per_token: np.ndarray, rollouts: list[Rollout], seq_len: int) -> list[np.ndarray]:
    """The inverse for label-aligned per-token values [rows, seq_len] (as `TrainStep.token_logps`
    returns: index i is token i + 1): each rollout's completion-token values, in order."""
    width = seq_len + 1
    out, row, at = [], 0, 0
    for r in rollouts:
        n = len(r.prompt) + len(r.completion)
        if at + n > width:
            row, at = row + 1, 0
        start = at + len(r.prompt) - 1
        out.append(np.asarray(per_token[row, start:start + len(r.completion)], np.float32))
        at += n
    return out
