"""Batches of packed token rows for training and validation.

Each row holds seq_len + 1 tokens (inputs row[:-1], targets row[1:]) and starts at a BOS: every
document is prefixed with BOS and rows are packed from whole documents, best fit first.

What is dropped (by design, to keep every row BOS-aligned and free of padding):
- when no buffered document fits the room left in a row, the shortest one is cropped to fill it
  and its tail is discarded;
- a document longer than a row is first cut into row-sized pieces, each given its own BOS, so
  nothing of it is lost, but the pieces after the first lack their preceding context.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterator

import numpy as np

from train.errors import UserError
from train.shards import Dataset, open_dataset

STATE_VERSION = 1


class _Packer:
    """Best-fit packing over a buffer of document pieces kept sorted by length.

    A piece is (doc, start): BOS followed by at most row_len - 1 tokens of doc from start.
    pull() returns the next document index, or None when the stream is exhausted."""

    def __init__(self, ds: Dataset, row_len: int, pull: Callable[[], int | None], buffer_docs: int):
        self.ds, self.row_len, self.pull, self.buffer_docs = ds, row_len, pull, buffer_docs
        # Parallel lists sorted by piece length, ties oldest first. A document may sit in the
        # buffer twice (pulled again in the next epoch before its first copy was used).
        self.items: list[tuple[int, int]] = []
        self.lens: list[int] = []
        self.pieces: list[np.ndarray] = []
        self.exhausted = False

    def _insert(self, doc: int, start: int, ids: np.ndarray) -> None:
        piece = np.concatenate([[self.ds.bos_id], ids[start:start + self.row_len - 1]]).astype(np.int32)
        pos = bisect.bisect_right(self.lens, len(piece))
        self.lens.insert(pos, len(piece))
        self.items.insert(pos, (doc, start))
        self.pieces.insert(pos, piece)

    def add_document(self, doc: int) -> None:
        ids = self.ds.doc(doc)
        for start in range(0, max(len(ids), 1), self.row_len - 1):
            self._insert(doc, start, ids)

    def restore(self, items: list) -> None:
        """Rebuild the buffer from state: same pieces, same order."""
        docs: dict[int, np.ndarray] = {}
        for doc, start in items:
            doc, start = int(doc), int(start)
            if doc not in docs:
                docs[doc] = self.ds.doc(doc)
            self._insert(doc, start, docs[doc])

    def _refill(self) -> None:
        while not self.exhausted and len(self.items) < self.buffer_docs:
            doc = self.pull()
            if doc is None:
                self.exhausted = True
            else:
                self.add_document(doc)

    def _take(self, pos: int) -> np.ndarray:
        del self.lens[pos], self.items[pos]
        return self.pieces.pop(pos)

    def fill_row(self, row: np.ndarray) -> bool:
        """Fill row in place; False if the stream ran out first (row contents then undefined)."""
        filled = 0
        while filled < len(row):
            self._refill()
            if not self.items:
                return False
            room = len(row) - filled
            pos = bisect.bisect_right(self.lens, room) - 1  # the longest piece that fits...
            if pos >= 0:  # ...the oldest of that length (a long document's full pieces in order)
                piece = self._take(bisect.bisect_left(self.lens, self.lens[pos]))
            else:  # nothing fits: crop the shortest
                piece = self._take(0)[:room]
            row[filled:filled + len(piece)] = piece
            filled += len(piece)
        return True


class TokenLoader:
    """Endless, shuffled, resumable batches [batch_size, seq_len + 1] int32 from one split.

    Documents are shuffled per epoch from (seed, epoch); process process_index of process_count
    reads only every process_count-th document of that order (its share, disjoint from the other
    processes'), so batch_size is per process. Epochs follow one another forever; the packing
    buffer (up to buffer_docs pieces) carries over an epoch boundary. state_dict() records epoch,
    position and the buffer: loading it continues the identical stream of rows (also under a
    different batch_size, since rows are packed one by one)."""

    def __init__(self, data_dir, split: str, *, batch_size: int, seq_len: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, buffer_docs: int = 1000,
                 vocab_size: int | None = None):
        if seq_len < 2:
            raise UserError(f"seq_len: expected at least 2, found {seq_len}")
        if batch_size < 1:
            raise UserError(f"batch_size: expected at least 1, found {batch_size}")
        if seed < 0:
            raise UserError(f"seed: expected a non-negative integer, found {seed}")
        if not 0 <= process_index < process_count:
            raise UserError(f"process_index: expected 0 <= process_index < process_count={process_count}, "
                            f"found {process_index}")
        self.ds = open_dataset(data_dir, split, vocab_size=vocab_size)
        share = len(range(process_index, len(self.ds), process_count))
        if share == 0:
            raise UserError(f"{data_dir}: split {split!r} holds {len(self.ds)} documents, too few for "
                            f"process {process_index} of {process_count} to get any")
        self.split, self.batch_size, self.seq_len, self.seed = split, batch_size, seq_len, seed
        self.process_index, self.process_count = process_index, process_count
        # No more pieces than the share has documents: a small split must not buffer many epochs.
        self.buffer_docs = max(1, min(buffer_docs, share))
        self.epoch, self.position = 0, 0
        self._order: tuple[int, np.ndarray] | None = None
        self._packer = _Packer(self.ds, seq_len + 1, self._pull, self.buffer_docs)

    def documents(self, epoch: int) -> np.ndarray:
        """The indices of the documents this process reads in epoch, in reading order."""
        if self._order is None or self._order[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.ds))
            self._order = (epoch, perm[self.process_index::self.process_count])
        return self._order[1]

    def _pull(self) -> int:
        share = self.documents(self.epoch)
        doc = int(share[self.position])
        self.position += 1
        if self.position == len(share):
            self.epoch, self.position = self.epoch + 1, 0
        return doc

    def next_batch(self) -> np.ndarray:
        """A newly allocated [batch_size, seq_len + 1] int32 array: never a view of a reused
        buffer, so micro-batches collected in a list stay distinct."""
        batch = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int32)
        for row in batch:
            self._packer.fill_row(row)  # the training stream is endless: always fills
        return batch

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            yield self.next_batch()

    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator[np.ndarray]:
        """Validation batches: one pass reading this process's share in stored order (no shuffle),
        packed as in training, the same every call; up to max_batches full batches (a trailing partial batch is dropped).
        Independent of the training stream's state."""
        docs = iter(range(self.process_index, len(self.ds), self.process_count))
        packer = _Packer(self.ds, self.seq_len + 1, lambda: next(docs, None), self.buffer_docs)
        made = 0
        while max_batches is None or made < max_batches:
            batch = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int32)
            if not all(packer.fill_row(row) for row in batch):
                break
            made += 1
            yield batch
        if made == 0 and max_batches != 0:
            raise UserError(f"split {self.split!r} ({self.ds.num_tokens} tokens for all processes) is "
                            f"too small for one batch of {self.batch_size} x {self.seq_len + 1} tokens")

    def state_dict(self) -> dict:
        """Plain ints and lists (JSON-friendly): where the stream stands."""
        return {"version": STATE_VERSION, "split": self.split, "seed": self.seed,
                "seq_len": self.seq_len, "process_index": self.process_index,
                "process_count": self.process_count, "num_docs": len(self.ds),
                "buffer_docs": self.buffer_docs,
                "epoch": self.epoch, "position": self.position,
                "buffer": [list(item) for item in self._packer.items]}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("version", "split", "seed", "seq_len", "process_index", "process_count", "num_docs",
                    "buffer_docs"):
            if state.get(key) != mine[key]:
                raise UserError(f"loader state: field {key!r} expected {mine[key]!r} (this loader), "
                                f"found {state.get(key)!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._packer = _Packer(self.ds, self.seq_len + 1, self._pull, self.buffer_docs)
        self._packer.restore(state["buffer"])

    def close(self) -> None:
        self.ds.close()
