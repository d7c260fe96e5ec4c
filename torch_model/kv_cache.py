"""A preallocated, static-shape KV cache for generation, in plain torch.

Full-attention layers keep one slot per position of the whole sequence ([max_len]); sliding
layers keep a ring of min(W, max_len) slots, slot = sequence index mod ring size, so a prompt
longer than W leaves only its last W positions. Writes are `index_copy` at a slot index that may
be a tensor (a traced value once lowered), never a growing cache, so a compiled decode loop can
carry it. Batches are left-padded: every row writes the same slot at each step; each row has its
own token positions (transformers' convention: the cumulative sum of the attention mask, minus
one), and a padding slot holds position -1, which no query ever sees.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


EMPTY = -1   # the position of an empty or padding slot


class KVCache(NamedTuple):
    """Per layer keys/values [B, Hkv, slots, D]; per attention kind the positions [B, slots] of
    the tokens in those slots (all full layers share one positions array, all sliding ones
    another, since they write the same tokens)."""
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    full_positions: torch.Tensor
    sliding_positions: torch.Tensor


def cache_slots(cfg, layer: int, max_len: int) -> int:
    window = cfg.window_of_layer(layer)
    return min(window, max_len) if window else max_len


def init_cache(cfg, batch: int, max_len: int, dtype=torch.float32, device=None) -> KVCache:
    """An empty cache for `batch` rows of at most `max_len` tokens (prompt padding included);
    `cfg`: a model's shape (torch_model/causal_lm.py's DecoderShape fields)."""
    shapes = [(batch, cfg.n_kv_heads, cache_slots(cfg, i, max_len), cfg.head_dim) for i in range(cfg.n_layers)]
    windows = {cfg.window_of_layer(i) for i in range(cfg.n_layers)} - {0}
    if len(windows) > 1:    # every sliding layer shares one positions ring
        raise ValueError(f"init_cache: sliding layers of different windows {sorted(windows)} are not built")
    ring = min(windows.pop(), max_len) if windows else max_len
    return KVCache(
        keys=tuple(torch.zeros(s, dtype=dtype, device=device) for s in shapes),
        values=tuple(torch.zeros(s, dtype=dtype, device=device) for s in shapes),
        full_positions=torch.full((batch, max_len), EMPTY, dtype=torch.int32, device=device),
        sliding_positions=torch.full((batch, ring), EMPTY, dtype=torch.int32, device=device))


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Token positions of left-padded rows: cumsum(mask) - 1 (transformers' convention), and
    EMPTY at padding. attention_mask: [B, T] of 0/1."""
    mask = attention_mask.to(torch.int32)
    return torch.where(mask.bool(), mask.cumsum(-1, dtype=torch.int32) - 1, torch.full_like(mask, EMPTY))


def write_slots(start, num_new: int, num_slots: int, device=None):
    """(first new token kept, slot indices [kept]) for `num_new` tokens at sequence indices
    start..start+num_new-1 in a buffer of `num_slots` slots used as a ring. Only the last
    `num_slots` tokens are kept when more arrive (a ring cannot hold more); `start` may be a
    tensor, the rest are Python ints (static shapes)."""
    first = max(0, num_new - num_slots)
    index = torch.arange(first, num_new, dtype=torch.int64, device=device)
    # The indices are never negative, so no sign fix-up: remainder's is a chain of ~10 small ops in
    # every step of a compiled decode loop, and even fmod's truncated `rem` is ~6 on a TPU. A ring
    # of a power-of-two size (windows, most buckets) takes the low bits instead: one op.
    index = index + start
    if num_slots & (num_slots - 1) == 0:
        return first, torch.bitwise_and(index, num_slots - 1)
    return first, torch.fmod(index, num_slots)


def write(buffer: torch.Tensor, new: torch.Tensor, start, dim: int) -> torch.Tensor:
    """`buffer` with `new` (num_new along `dim`) written at sequence index `start` onward, as a
    ring of buffer.shape[dim] slots. Out of place: returns the updated buffer."""
    first, slots = write_slots(start, new.shape[dim], buffer.shape[dim], buffer.device)
    return buffer.index_copy(dim, slots, new.narrow(dim, first, new.shape[dim] - first))


def write_positions(cache: KVCache, positions: torch.Tensor, start) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, sliding) slot positions after writing T new tokens' positions [B, T] at `start`."""
    positions = positions.to(torch.int32)
    return write(cache.full_positions, positions, start, 1), write(cache.sliding_positions, positions, start, 1)


def attend_keys(keys, values, k, v, start, positions, slot_positions, new_slot_positions, sliding_window: int):
    """One layer's cache step for T new keys/values k, v [B, Hkv, T, D] at sequence index `start`
    onward (token positions [B, T]): returns (keys and values the queries attend over, their
    positions [B, S], the layer's updated keys, values). slot_positions / new_slot_positions: the
    cache's positions before / after this step's write."""
    new_keys, new_values = write(keys, k, start, 2), write(values, v, start, 2)
    if sliding_window and k.shape[2] > 1:
        # Writing first could overwrite ring slots that this chunk's earlier queries still see.
        return (torch.cat([keys, k], 2), torch.cat([values, v], 2), torch.cat([slot_positions, positions], 1),
                new_keys, new_values)
    return new_keys, new_values, new_slot_positions, new_keys, new_values


def left_pad(prompts: list[list[int]], length: int | None = None, pad_id: int = 0):
    """(ids [B, length], positions [B, length]) for token lists of different lengths, padded on
    the left so every row's last token sits in the last column; padding has position EMPTY."""
    length = length or max(len(p) for p in prompts)
    if any(len(p) > length for p in prompts):
        raise ValueError(f"left_pad: a prompt of {max(len(p) for p in prompts)} tokens does not fit {length}")
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.int32)
    for row, p in enumerate(prompts):
        if p:
            ids[row, length - len(p):] = torch.as_tensor(p, dtype=torch.long)
            mask[row, length - len(p):] = 1
    return ids, positions_from_mask(mask)
