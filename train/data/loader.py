"""Batches of packed token rows for training and validation, for one process of a run.

The stream of rows is global: it depends on the data, seq_len and seed only (packing.py). A step
takes the next global_batch rows of it; process p of P gets rows [p*G/P, (p+1)*G/P) of each
step, reading only their tokens. So row r of step s is the same whatever the number of processes,
and the state (epoch, block, row) is the same on every process: a run resumed on a different
number of processes continues the same data. A background thread prepares the next batches
(reads and assembles rows) while the step runs.

Chat data (and plain text with `document_masking`) comes as a Batch: tokens, loss weights,
segment ids and positions, each [rows, seq_len + 1]; plain text without masking stays a bare
token array, as before. Preference data (prepare --preferences) packs whole pairs: pair k of a
row is segments 2k + 1 (prompt + chosen) and 2k + 2 (prompt + rejected), and the Batch also names
each slot's pair (its document index) for the stored reference log-probabilities.

Errors from damaged shards surface from next_batch() as shards.DataIntegrityError (a UserError
naming the shard) when the damaged batch is due, never earlier, so the trainer can checkpoint
the last good step.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator, Union

import numpy as np

from train.data import packing
from train.data.shards import Dataset, open_dataset
from formats.errors import UserError

STATE_VERSION = 2
PAD_SEGMENT = 0  # the segment id of padding; documents in a row are numbered 1, 2, ...


@dataclass(frozen=True)
class Batch:
    """Rows of packed documents, every array [rows, seq_len + 1] and newly allocated. The step
    feeds tokens[:, :-1] at positions[:, :-1] with segment_ids[:, :-1] (attention only within a
    segment) and predicts tokens[:, 1:], the loss weighted by weights[:, 1:]. A segment is one
    document (a conversation, or a BOS-led piece of a text document); positions restart at 0 with
    each; padding has segment id PAD_SEGMENT, weight 0, position 0 and the pad id. A token that
    starts a segment is never trained (weight 0): nothing predicts across documents."""
    tokens: np.ndarray       # int32
    weights: np.ndarray      # float32, 0 or 1
    segment_ids: np.ndarray  # int32
    positions: np.ndarray    # int32
    pair_docs: np.ndarray | None = None   # preferences: [rows, seq_len // 2] int32, -1 for no pair

    @property
    def trained_tokens(self) -> int:
        return int(self.weights[:, 1:].sum())

    @property
    def real_tokens(self) -> int:
        return int((self.segment_ids != PAD_SEGMENT).sum())


class RowReader:
    """Materializes rows of a plan: BOS, then each segment's tokens (EOS where a document ends)."""

    def __init__(self, ds: Dataset, seq_len: int):
        self.ds, self.row_len = ds, seq_len + 1
        self.bos = ds.bos_id
        self.eos = ds.eos_id  # None: BOS doubles as the end marker, nothing is appended

    def fill(self, out: np.ndarray, rows: list) -> None:
        """out[i] = row rows[i] = (plan, row index); out must be [len(rows), seq_len + 1] int32."""
        wanted, places = [], []
        for i, (plan, r) in enumerate(rows):
            pos = 0
            for doc, start, count in plan.segments(r):
                out[i, pos] = self.bos
                real = max(0, min(count, int(self.ds.lengths[doc]) - start))
                wanted.append((doc, start, real))
                places.append((i, pos + 1, real, count - real))
                pos += 1 + count
        for (i, at, real, extra), ids in zip(places, self.ds.read_segments(wanted)):
            out[i, at:at + real] = ids
            if extra:
                out[i, at + real] = self.eos

    def pair_batch(self, rows: list, pad_id: int) -> Batch:
        """A Batch of rows of whole preference pairs: each pair's two sides as two segments; a pair
        cut to fit a row (truncate) keeps the start of each side, at most half the room for the
        rejected one when both are longer."""
        from train.data.preferences import side_of, trained

        shape = (len(rows), self.row_len)
        tokens, weights = np.full(shape, pad_id, np.int32), np.zeros(shape, np.float32)
        segments, positions = np.full(shape, PAD_SEGMENT, np.int32), np.zeros(shape, np.int32)
        pair_docs = np.full((len(rows), (self.row_len - 1) // 2), -1, np.int32)
        wanted, places = [], []
        for i, (plan, r) in enumerate(rows):
            pos = 0
            for k, (doc, _, count) in enumerate(plan.segments(r)):
                wanted.append((doc, 0, int(self.ds.lengths[doc])))
                places.append((i, pos, count, k, doc))
                pos += count
        for (i, at, count, k, doc), ids, codes in zip(places, self.ds.read_segments(wanted),
                                                 self.ds.read_segments(wanted, "weights")):
            if k >= pair_docs.shape[1]:
                raise UserError(f"{self.ds.data_dir}: a row of {self.row_len} tokens holds more than "
                                f"{pair_docs.shape[1]} pairs (pairs of under 2 tokens a side?)")
            n_c = int((side_of(codes) == 0).sum())
            n_r = len(ids) - n_c
            keep_c, keep_r = n_c, n_r
            if n_c + n_r > count:       # truncated to one row
                keep_r = min(n_r, count // 2)
                keep_c = min(n_c, count - keep_r)
                keep_r = min(n_r, count - keep_c)
            for side, (lo, n) in enumerate(((0, keep_c), (n_c, keep_r))):
                tokens[i, at:at + n] = ids[lo:lo + n]
                weights[i, at:at + n] = trained(codes[lo:lo + n])
                weights[i, at] = 0          # a segment's first token: never predicted across segments
                segments[i, at:at + n] = 2 * k + 1 + side
                positions[i, at:at + n] = np.arange(n)
                at += n
            pair_docs[i, k] = doc
        return Batch(tokens, weights, segments, positions, pair_docs)

    def batch(self, rows: list, document_masking: bool, pad_id: int) -> Batch:
        """A Batch of rows (plan, row index): text rows as fill() makes them, one segment per
        BOS-led piece (weight 1 but on each piece's BOS); whole-document rows (chat) with their
        stored weights, padded. Without document_masking, a row's real tokens form one segment
        with positions 0, 1, 2, ... (attention crosses documents, as in plain pretraining)."""
        shape = (len(rows), self.row_len)
        tokens, weights = np.full(shape, pad_id, np.int32), np.zeros(shape, np.float32)
        segments, positions = np.full(shape, PAD_SEGMENT, np.int32), np.zeros(shape, np.int32)
        if rows and not rows[0][0].whole:
            self.fill(tokens, rows)
        wanted, places = [], []
        for i, (plan, r) in enumerate(rows):
            pos = 0
            for k, (doc, start, count) in enumerate(plan.segments(r), 1):
                n = count if plan.whole else count + 1  # a text piece is led by BOS
                if plan.whole:
                    wanted.append((doc, start, count))
                    places.append((i, pos, count))
                else:
                    weights[i, pos + 1:pos + n] = 1
                segments[i, pos:pos + n] = k
                positions[i, pos:pos + n] = np.arange(n)
                pos += n
        if wanted:
            for (i, at, count), ids, w in zip(places, self.ds.read_segments(wanted),
                                              self.ds.read_segments(wanted, "weights")):
                tokens[i, at:at + count] = ids
                weights[i, at:at + count] = w
                weights[i, at] = 0  # a segment's first token: never predicted across documents
        if not document_masking:
            real = segments != PAD_SEGMENT
            segments[real] = 1
            positions[:] = np.where(real, np.arange(self.row_len, dtype=np.int32), 0)
        return Batch(tokens, weights, segments, positions)


class TokenLoader:
    """Endless, shuffled, resumable batches [global_batch / process_count, seq_len + 1] int32, or
    Batch objects of that shape for chat data and for document_masking.

    Built with the data directory, split, GLOBAL batch (rows per micro-step over all processes),
    seq_len, seed and this process's index and count. `vocab_size` (the model's) refuses data
    whose ids would not fit; `check` is the integrity check at start (shards.check_shards).
    `document_masking` (None: on for chat data, off for text) gives each document its own segment
    ids and positions; `truncate` cuts a conversation longer than a row instead of dropping it.
    `accepts_batch`: the caller consumes Batch objects; without it, data that needs them (chat,
    or document masking) is refused by name rather than handed to code that would drop the
    weights and segments."""

    def __init__(self, data_dir, split: str, *, global_batch: int, seq_len: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, vocab_size: int | None = None,
                 check: str = "auto", prefetch: int = 4,
                 block_tokens: int = packing.BLOCK_TOKENS, buffer_pieces: int = packing.BUFFER_PIECES,
                 document_masking: bool | None = None, truncate: bool = False, accepts_batch: bool = False):
        if seq_len < 2:
            raise UserError(f"seq_len: expected at least 2, found {seq_len}")
        if global_batch < 1:
            raise UserError(f"batch_size: expected at least 1, found {global_batch}")
        if seed < 0:
            raise UserError(f"seed: expected a non-negative integer, found {seed}")
        if not 0 <= process_index < process_count:
            raise UserError(f"process_index: expected 0 <= process_index < process_count={process_count}, "
                            f"found {process_index}")
        if global_batch % process_count:
            raise UserError(f"batch_size (the global batch) {global_batch} is not divisible by the "
                            f"{process_count} processes")
        self.ds = open_dataset(data_dir, split, vocab_size=vocab_size, check=check)
        if len(self.ds) == 0:
            raise UserError(f"{data_dir}: split {split!r} holds 0 documents")
        self.data_dir, self.split, self.seq_len, self.seed = data_dir, split, seq_len, seed
        self.global_batch, self.process_index, self.process_count = global_batch, process_index, process_count
        self.local_batch = global_batch // process_count
        self.block_tokens, self.buffer_pieces, self.prefetch = block_tokens, buffer_pieces, max(1, prefetch)
        self.chat = self.ds.weighted  # conversations with loss weights: packed whole
        self.pairs = self.ds.manifest.get("kind") == "preferences"   # whole preference pairs
        self.truncate = truncate
        self.document_masking = self.chat if document_masking is None else bool(document_masking)
        self.yields_batch = self.chat or self.document_masking
        problem = None
        if truncate and not self.chat:
            problem = f"{data_dir}: truncate applies to chat data (text documents are cut into rows anyway)"
        elif self.yields_batch and not accepts_batch:
            what = "chat data (loss weights per token)" if self.chat else "document masking"
            problem = (f"{data_dir}: {what} needs a train step that takes loss weights, segment ids and "
                       f"positions; this one trains on plain token rows only (see the README's "
                       f"\"Fine-tune on conversations\")")
        if problem:
            self.ds.close()
            raise UserError(problem)
        self.pad_id = self.ds.bos_id if self.ds.eos_id is None else int(self.ds.eos_id)
        # A text document's packed form ends with EOS (when there is one); a conversation is as stored.
        self.packed_lengths = self.ds.lengths + (0 if self.chat else self.ds.eos_id is not None)
        self.rows = RowReader(self.ds, seq_len)
        self.epoch = self.block = self.row = 0
        self._epoch_plan: tuple[int, packing.EpochPlan] | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._failed: BaseException | None = None

    # ---- the global row stream -----------------------------------------------------------------
    def epoch_plan(self, epoch: int) -> packing.EpochPlan:
        if self._epoch_plan is None or self._epoch_plan[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.ds))
            self._epoch_plan = (epoch, self._plan(order, (self.seed, epoch)))
        return self._epoch_plan[1]

    def _plan(self, order: np.ndarray, shuffle_seed) -> packing.EpochPlan:
        return packing.EpochPlan(order, self.packed_lengths, self.seq_len, block_tokens=self.block_tokens,
                                 shuffle_seed=shuffle_seed, buffer_pieces=self.buffer_pieces, whole=self.chat,
                                 truncate=self.truncate)

    def packing_summary(self) -> dict:
        """Epoch 0's rows, packing efficiency (real tokens / row tokens) and documents too long for
        a row (dropped or truncated): what a run reports at start. Plans the whole epoch."""
        return self._plan(np.random.default_rng([self.seed, 0]).permutation(len(self.ds)), (self.seed, 0)).summary()

    def _assemble(self, rows: list):
        """The rows' tokens as a new [len(rows), seq_len + 1] int32 array, or a Batch."""
        if self.pairs:
            return self.rows.pair_batch(rows, self.pad_id)
        if self.yields_batch:
            return self.rows.batch(rows, self.document_masking, self.pad_id)
        batch = np.empty((len(rows), self.seq_len + 1), np.int32)  # fresh: never a reused buffer
        self.rows.fill(batch, rows)
        return batch

    def _take_rows(self, position: tuple[int, int, int], count: int):
        """The next `count` rows of the stream from `position`: ([(plan, row)], new position)."""
        epoch, block, row = position
        out, barren = [], 0  # barren: blocks passed in a row that gave no row at all
        while len(out) < count:
            plan = self.epoch_plan(epoch)
            if block >= plan.num_blocks:
                epoch, block, row = epoch + 1, 0, 0
                continue
            rows = plan.block(block)
            barren = barren + 1 if len(rows) == 0 else 0
            if barren > plan.num_blocks:
                raise UserError(f"{self.data_dir}: split {self.split!r} ({self.ds.num_tokens} tokens) packs into "
                                f"no {'row' if self.chat else 'full row'} of {self.seq_len + 1} tokens"
                                + self._too_long_note())
            take = min(count - len(out), len(rows) - row)
            out += [(rows, r) for r in range(row, row + take)]
            row += take
            if row == len(rows):
                block, row = block + 1, 0
        return out, (epoch, block, row)

    def _next_local(self, position):
        """This process's rows of the next global batch, as a new array, and the position after."""
        before = self.process_index * self.local_batch
        _, position = self._take_rows(position, before) if before else (None, position)
        mine, position = self._take_rows(position, self.local_batch)
        after = self.global_batch - before - self.local_batch
        if after:
            _, position = self._take_rows(position, after)
        return self._assemble(mine), position

    # ---- prefetching -------------------------------------------------------------------------
    @staticmethod
    def _produce(loader_ref, position, q: queue.Queue, stop: threading.Event) -> None:
        """The prefetch thread. It holds the loader only while making a batch, so a loader that
        is dropped without close() is collected and its thread ends."""
        def gone() -> bool:
            return stop.is_set() or loader_ref() is None

        def put(item) -> bool:
            while not gone():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            while not gone():
                loader = loader_ref()
                if loader is None:
                    return
                batch, position = loader._next_local(position)
                del loader
                if not put((batch, position)):
                    return
        except BaseException as e:  # handed to the consumer, raised by next_batch()
            put((e, None))

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=TokenLoader._produce, name="token-loader", daemon=True,
                                        args=(weakref.ref(self), (self.epoch, self.block, self.row),
                                              self._queue, self._stop))
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = self._queue = None

    def next_batch(self) -> Union[np.ndarray, Batch]:
        """A newly allocated [global_batch / process_count, seq_len + 1] int32 array (a Batch of
        such arrays for chat data or document_masking): never a view of a reused buffer, so
        micro-batches collected in a list stay distinct."""
        if self._failed is not None:
            raise self._failed
        if self._thread is None:
            self._start()
        batch, position = self._queue.get()
        if isinstance(batch, BaseException):
            self._failed = batch
            self._halt()
            raise batch
        self.epoch, self.block, self.row = position
        return batch

    def __iter__(self) -> Iterator[Union[np.ndarray, Batch]]:
        while True:
            yield self.next_batch()

    # ---- evaluation --------------------------------------------------------------------------
    def iter_eval_batches(self, max_batches: int | None = None, pad_last: bool = False) -> Iterator[Union[np.ndarray, Batch]]:
        """Validation batches: one pass over the split in stored order (no shuffle), packed as in
        training, the same at every call and whatever the number of processes; up to max_batches
        global batches (a trailing partial one is dropped, or with pad_last (one process, Batch
        data) padded with empty rows: every document seen). Independent of the training stream."""
        plan = self._plan(np.arange(len(self.ds)), None)
        rows = ((plan.block(b), r) for b in range(plan.num_blocks) for r in range(len(plan.block(b))))
        lo = self.process_index * self.local_batch
        made = 0
        while max_batches is None or made < max_batches:
            step = [row for _, row in zip(range(self.global_batch), rows)]
            if step and len(step) < self.global_batch and pad_last and self.process_count == 1 and self.yields_batch:
                made += 1
                yield _padded(self._assemble(step), self.global_batch, self.pad_id)
                break
            if len(step) < self.global_batch:
                break
            made += 1
            yield self._assemble(step[lo:lo + self.local_batch])
        if made == 0 and max_batches != 0:
            raise UserError(f"split {self.split!r} ({self.ds.num_tokens} tokens) is too small for one batch of "
                            f"{self.global_batch} x {self.seq_len + 1} tokens" + self._too_long_note())

    def _too_long_note(self) -> str:
        if not self.chat or self.truncate:
            return ""
        too_long = int((self.packed_lengths > self.seq_len + 1).sum())
        what = "preference pairs" if self.pairs else "conversations"
        return (f" ({too_long} of its {len(self.ds)} {what} are longer than a row and dropped: "
                "raise seq_len or truncate them)") if too_long else ""

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Small and JSON-serializable: the position in the global row stream (the same on every
        process) and what must match for it to mean the same rows."""
        return {"version": STATE_VERSION, "split": self.split, "seed": self.seed, "seq_len": self.seq_len,
                "block_tokens": self.block_tokens, "buffer_pieces": self.buffer_pieces,
                "num_docs": len(self.ds), "num_tokens": self.ds.num_tokens,
                "packing": "whole" if self.chat else "cut", "truncate": self.truncate,
                "epoch": self.epoch, "block": self.block, "row": self.row}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        # "packing" and "truncate" came later: a state without them is of text data, cut.
        state = {"packing": "cut", "truncate": False, **state}
        for key in ("version", "split", "seed", "seq_len", "block_tokens", "buffer_pieces", "num_docs",
                    "num_tokens", "packing", "truncate"):
            if state.get(key) != mine[key]:
                raise UserError(f"loader state: field {key!r} expected {mine[key]!r} (this loader), "
                                f"found {state.get(key)!r}")
        self._halt()
        self._failed = None
        self.epoch, self.block, self.row = int(state["epoch"]), int(state["block"]), int(state["row"])

    def close(self) -> None:
        self._halt()
        self.ds.close()


def _padded(batch: Batch, rows: int, pad_id: int) -> Batch:
    """The batch with empty rows (padding: segment PAD_SEGMENT, weight 0, no pair) up to `rows`."""
    extra = rows - len(batch.tokens)
    pad = lambda a, value: np.concatenate([a, np.full((extra, *a.shape[1:]), value, a.dtype)])  # noqa: E731
    return Batch(pad(batch.tokens, pad_id), pad(batch.weights, 0),
                 pad(batch.segment_ids, PAD_SEGMENT), pad(batch.positions, 0),
                 None if batch.pair_docs is None else pad(batch.pair_docs, -1))
