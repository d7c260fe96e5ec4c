"""The packing plan: which token ranges of which documents fill each row, decided from document
lengths alone, so every process computes the same plan and reads only the tokens of its rows.

A document's packed form is its tokens followed by EOS (when the tokenizer has one). It is cut
into pieces of at most seq_len tokens; every piece is led by BOS, so every row starts with BOS
and attention may cross documents inside a row (the kernels have no segment ids). A full piece
is a row by itself; the last, shorter piece of each document is packed best-fit: each row takes
the longest waiting piece that fits the room left (the oldest among equals), and when none fits,
the shortest is cropped to fill the row and its tail dropped. Nothing is padded.

Conversations (chat data) are packed whole instead ("whole" packing): never cut and not led by
BOS (a conversation starts with harmony's `<|start|>`); each row takes the longest waiting
conversation that fits its room, and when none fits the row is closed and padded. One longer than
a row is dropped and counted, or with `truncate` cut to one row (its start kept). The last, partial
row of a block is kept (padded): no conversation is lost to packing.

An epoch is the documents in a (seed, epoch) permutation, cut into blocks of about block_tokens
tokens; each block is packed on its own (a partial last row is dropped) and its rows are shuffled
from (seed, epoch, block), so a long document's rows spread over the block. A position in the
stream is (epoch, block, row): that is the whole loader state.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

BLOCK_TOKENS = 1 << 26   # about 67M tokens: ~16k rows at sequence 4096, planned in well under a second
BUFFER_PIECES = 1000     # best-fit candidates waiting at once


@dataclass
class BlockPlan:
    """Rows of one block. Row i holds segments ptr[k]..ptr[k+1] (k = row_order[i]); a segment is
    BOS followed by `count` tokens of document `doc`'s packed form from `start`."""
    ptr: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    count: np.ndarray
    row_order: np.ndarray
    dropped_tokens: int
    whole: bool = False        # segments are whole documents, not led by BOS; rows padded
    dropped_docs: int = 0      # whole: documents longer than a row, dropped
    truncated_docs: int = 0    # whole: documents longer than a row, cut to one row

    def __len__(self) -> int:
        return len(self.row_order)

    def segments(self, row: int):
        k = self.row_order[row]
        lo, hi = self.ptr[k], self.ptr[k + 1]
        return zip(self.doc[lo:hi].tolist(), self.start[lo:hi].tolist(), self.count[lo:hi].tolist())


def block_starts(packed_lengths: np.ndarray, block_tokens: int) -> np.ndarray:
    """Indices (into the epoch's document order) where each block begins, plus the end."""
    if len(packed_lengths) == 0:
        return np.zeros(1, np.int64)
    before = np.cumsum(packed_lengths) - packed_lengths  # tokens ahead of each document
    bucket = before // block_tokens
    starts = np.concatenate([[0], np.flatnonzero(np.diff(bucket)) + 1, [len(packed_lengths)]])
    return starts.astype(np.int64)


class _Waiting:
    """Pieces waiting to be packed, best-fit: at most `buffer_pieces` at once, drawn in arrival
    order from `pending`, kept sorted by length (key(piece)); ties stay in arrival order."""

    def __init__(self, pending, key, buffer_pieces: int):
        self.pending, self.key, self.buffer_pieces = iter(pending), key, buffer_pieces
        self.lens: list[int] = []
        self.items: list = []
        self.exhausted = False

    def __len__(self) -> int:
        self.refill()
        return len(self.items)

    def refill(self) -> None:
        while not self.exhausted and len(self.items) < self.buffer_pieces:
            piece = next(self.pending, None)
            if piece is None:
                self.exhausted = True
                return
            pos = bisect.bisect_right(self.lens, self.key(piece))
            self.lens.insert(pos, self.key(piece))
            self.items.insert(pos, piece)

    def take_longest_fitting(self, room: int):
        """The longest waiting piece of length <= room (the oldest of that length), or None."""
        self.refill()
        pos = bisect.bisect_right(self.lens, room) - 1
        if pos < 0:
            return None
        pos = bisect.bisect_left(self.lens, self.lens[pos])
        del self.lens[pos]
        return self.items.pop(pos)

    def take_shortest(self):
        self.refill()
        del self.lens[0]
        return self.items.pop(0)


def _best_fit(tails: list[tuple[int, int, int]], row_len: int, buffer_pieces: int):
    """Pack (doc, start, count) tail pieces, in arrival order, into rows of row_len tokens.
    Returns (rows as lists of segments, tokens dropped by crops and by the partial last row)."""
    rows, dropped = [], 0
    waiting = _Waiting(tails, lambda piece: piece[2] + 1, buffer_pieces)   # lengths with their BOS
    while waiting:
        row, room = [], row_len
        while room > 0 and waiting:
            piece = waiting.take_longest_fitting(room)
            if piece is None:  # nothing fits: crop the shortest to fill the row
                doc, start, count = waiting.take_shortest()
                dropped += count - (room - 1)
                piece = (doc, start, room - 1)
            row.append(piece)
            room -= piece[2] + 1
        if room > 0:  # the block ran out: a partial row is dropped, never padded
            dropped += sum(c for _, _, c in row)
            return rows, dropped
        rows.append(row)
    return rows, dropped


def plan_block(docs: np.ndarray, packed_lengths: np.ndarray, seq_len: int, *, shuffle_seed=None,
               buffer_pieces: int = BUFFER_PIECES) -> BlockPlan:
    """Pack the documents `docs` (in this order; packed_lengths[i] tokens each, EOS included) into
    rows of seq_len + 1 tokens. shuffle_seed: the rows' order is permuted from it (None: kept)."""
    docs = np.asarray(docs, np.int64)
    n = np.asarray(packed_lengths, np.int64)
    full = n // seq_len
    # Full pieces: one row each, one segment each.
    full_doc = np.repeat(docs, full)
    first_row = np.cumsum(full) - full
    full_start = (np.arange(len(full_doc)) - np.repeat(first_row, full)) * seq_len
    tail_count = n - full * seq_len
    has_tail = tail_count > 0
    tails = list(zip(docs[has_tail].tolist(), (full * seq_len)[has_tail].tolist(), tail_count[has_tail].tolist()))
    tail_rows, dropped = _best_fit(tails, seq_len + 1, buffer_pieces)

    seg_doc = [full_doc] + [np.asarray([s[0] for r in tail_rows for s in r], np.int64)]
    seg_start = [full_start] + [np.asarray([s[1] for r in tail_rows for s in r], np.int64)]
    seg_count = [np.full(len(full_doc), seq_len, np.int64)] + [np.asarray([s[2] for r in tail_rows for s in r], np.int64)]
    per_row = np.concatenate([np.ones(len(full_doc), np.int64), np.asarray([len(r) for r in tail_rows], np.int64)])
    ptr = np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64)
    rows = len(per_row)
    order = (np.random.default_rng(shuffle_seed).permutation(rows) if shuffle_seed is not None
             else np.arange(rows)).astype(np.int64)
    return BlockPlan(ptr, np.concatenate(seg_doc), np.concatenate(seg_start), np.concatenate(seg_count),
                     order, int(dropped))


def _best_fit_whole(items: list[tuple[int, int]], row_len: int, buffer_pieces: int) -> list[list[tuple[int, int]]]:
    """Pack (doc, count) items, each count <= row_len, in arrival order into rows of at most
    row_len tokens: each row takes the longest waiting item that fits its room (the oldest among
    equals); when none fits, the row closes (to be padded). Nothing is cut or dropped."""
    rows: list[list[tuple[int, int]]] = []
    waiting = _Waiting(items, lambda item: item[1], buffer_pieces)
    while waiting:
        row, room = [], row_len
        while (item := waiting.take_longest_fitting(room)) is not None:
            row.append(item)
            room -= item[1]
        rows.append(row)
    return rows


def plan_block_whole(docs: np.ndarray, lengths: np.ndarray, seq_len: int, *, shuffle_seed=None,
                     buffer_pieces: int = BUFFER_PIECES, truncate: bool = False) -> BlockPlan:
    """Pack whole documents `docs` (lengths[i] tokens each) into rows of seq_len + 1 tokens,
    padded; one longer than a row is dropped, or with `truncate` cut to one row."""
    row_len = seq_len + 1
    docs, n = np.asarray(docs, np.int64), np.asarray(lengths, np.int64)
    too_long = n > row_len
    if truncate:
        n = np.minimum(n, row_len)
    keep = ~too_long | truncate
    items = list(zip(docs[keep].tolist(), n[keep].tolist()))
    rows = _best_fit_whole(items, row_len, buffer_pieces)
    per_row = np.asarray([len(r) for r in rows], np.int64)
    ptr = np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64)
    seg_doc = np.asarray([d for r in rows for d, _ in r], np.int64)
    seg_count = np.asarray([c for r in rows for _, c in r], np.int64)
    order = (np.random.default_rng(shuffle_seed).permutation(len(rows)) if shuffle_seed is not None
             else np.arange(len(rows))).astype(np.int64)
    dropped = int(np.asarray(lengths, np.int64)[too_long].sum()) - (int(too_long.sum()) * row_len if truncate else 0)
    return BlockPlan(ptr, seg_doc, np.zeros(len(seg_doc), np.int64), seg_count, order, dropped, whole=True,
                     dropped_docs=0 if truncate else int(too_long.sum()),
                     truncated_docs=int(too_long.sum()) if truncate else 0)


class EpochPlan:
    """The blocks of one epoch: documents in `order`, cut where block_tokens is crossed; each
    block planned on demand (and the last one kept). `whole`: documents packed whole (chat)."""

    def __init__(self, order: np.ndarray, packed_lengths: np.ndarray, seq_len: int, *, block_tokens: int,
                 shuffle_seed: tuple | None, buffer_pieces: int = BUFFER_PIECES, whole: bool = False,
                 truncate: bool = False):
        self.order, self.seq_len, self.buffer_pieces = order, seq_len, buffer_pieces
        self.whole, self.truncate = whole, truncate
        self.packed = packed_lengths[order]
        self.starts = block_starts(self.packed, block_tokens)
        self.shuffle_seed = shuffle_seed
        self._cached: tuple[int, BlockPlan] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.starts) - 1

    def block(self, b: int) -> BlockPlan:
        if self._cached is None or self._cached[0] != b:
            lo, hi = self.starts[b], self.starts[b + 1]
            seed = None if self.shuffle_seed is None else [*self.shuffle_seed, b]
            if self.whole:
                plan = plan_block_whole(self.order[lo:hi], self.packed[lo:hi], self.seq_len, shuffle_seed=seed,
                                        buffer_pieces=self.buffer_pieces, truncate=self.truncate)
            else:
                plan = plan_block(self.order[lo:hi], self.packed[lo:hi], self.seq_len, shuffle_seed=seed,
                                  buffer_pieces=self.buffer_pieces)
            self._cached = (b, plan)
        return self._cached[1]

    def summary(self) -> dict:
        """Rows, real tokens / row tokens (`efficiency`), and documents dropped or cut, over the
        whole epoch (plans every block)."""
        rows = real = dropped = truncated = 0
        for b in range(self.num_blocks):
            plan = self.block(b)
            rows += len(plan)
            real += int(plan.count.sum()) + (0 if plan.whole else len(plan.doc))  # + the BOS of each piece
            dropped += plan.dropped_docs
            truncated += plan.truncated_docs
        row_tokens = rows * (self.seq_len + 1)
        return {"rows": rows, "real_tokens": real, "row_tokens": row_tokens,
                "efficiency": real / row_tokens if row_tokens else 0.0, "too_long": dropped + truncated,
                "dropped": dropped, "truncated": truncated}
