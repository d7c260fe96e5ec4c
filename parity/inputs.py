"""The parity suite's inputs: the parity run's model (`parity_config`), its weights (`build_model`:
seeded random or a state dict) and its tokens (`parity_inputs`, `text_inputs`: a `ParityBatch`).

Defaults that make every part visible: the preset's sliding window cut to PARITY_WINDOW (16), a
sequence and kernel tiles that give every kernel several tiles on the platform the suite compiles
for (`parity_shape`: 80 tokens and small tiles on CPU, PARITY_SEQ_LEN / PARITY_TILES; 320 tokens
and the 128-row tiles Mosaic accepts on TPU, TPU_PARITY_SEQ_LEN / TPU_PARITY_TILES), one label in
ten at the ignore index, non-zero router balance, router z-loss and LM z-loss coefficients
(PARITY_LOSS), and packed rows: each row holds segments of different lengths (3 in even
rows; 2 and a padded tail in odd rows; `SEGMENT_CUTS`) with positions restarting at each, as the
SFT / document-masking loader packs.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pallas_kernels.platform import host_platform
from torch_model.causal_lm import IGNORE_INDEX, PAD_SEGMENT
from torch_model.config import ModelConfig
from torch_model.model import GptOssForCausalLM
from torch_model.module_lm import ModuleSpec
from torch_model.transformers_lm import TransformersCausalLM, TransformersSpec
from formats.errors import UserError

# The default parity inputs (see the module docstring).
PARITY_BATCH = 2
PARITY_WINDOW = 16
PARITY_IGNORE_FRACTION = 0.1
# CPU (and GPU): 80 tokens in tiles far below the kernels' defaults, so a tiny sequence spans
# several blocks (attention 6 x 3 with a partial last block, 5 token tiles of cross-entropy).
PARITY_SEQ_LEN = 80
PARITY_TILES = ("attention.pallas.block_q=16,attention.pallas.block_kv=32,"
                "cross_entropy.pallas.block_n=32,cross_entropy.pallas.block_v=1024,"
                "moe.pallas.block_m=16,moe.pallas.block_i=128,moe.megablox.block_m=16,moe.xla.block_m=16")
# TPU: Mosaic takes a block's last two dims in multiples of (8, 128) or whole, and our kernels put
# attention's kv blocks and cross-entropy's token tiles on lanes: tiles of 128. At 320 tokens
# (padded to 384: a partial last block) attention runs 3 x 3 tiles, of which the window (16) skips
# one and causality three; the even rows' 0.8 cut (SEGMENT_CUTS) falls on token 256, a tile
# boundary, so segments skip band tiles in the sliding and the full layers; cross-entropy runs
# 5 x 4 tiles, the MoE 10 row tiles (batch 2, top-2). Splash's tiles (128) skip blocks here too.
TPU_PARITY_SEQ_LEN = 320
TPU_PARITY_TILES = ("attention.pallas.block_q=128,attention.pallas.block_kv=128,"
                    "cross_entropy.pallas.block_n=128,cross_entropy.pallas.block_v=1024,"
                    "moe.pallas.block_m=128,moe.pallas.block_i=128,moe.megablox.block_m=128,moe.xla.block_m=16")

# Large enough that each term's gradient is visible through bf16 noise (a sign error in the LM
# z-loss must fail in bf16), small enough that cross-entropy still dominates the loss. The router
# z-loss at 0.1 (training uses ~1e-4) also gives the router a well-conditioned gradient term: with
# 0.01 the router's gradient is a difference of nearly equal terms through the top-k softmax and
# its bf16 error reached rel 0.61 / norm ratio 0.86 (tiny, seeds 0-2), too noisy to see a 20%
# scaling; with 0.1 the same runs gave rel <= 0.14 / norm ratio 0.99..1.01.
PARITY_LOSS = {"router_aux_loss_coef": 0.1, "router_z_loss_coef": 0.1, "lm_z_loss_coef": 0.05}


class ParityShape(NamedTuple):
    """A parity run's sequence length and kernel options (registry syntax)."""
    seq_len: int
    kernel_options: str


PARITY_SHAPES = {"cpu": ParityShape(PARITY_SEQ_LEN, PARITY_TILES), "gpu": ParityShape(PARITY_SEQ_LEN, PARITY_TILES),
                 "tpu": ParityShape(TPU_PARITY_SEQ_LEN, TPU_PARITY_TILES)}


def parity_shape(platform: str | None = None, seq_len: int | None = None, kernel_options=None) -> ParityShape:
    """The sequence length and kernel tiles of a parity run compiled for `platform` (None: this
    host's, pallas_kernels.platform.host_platform): PARITY_SHAPES, each overridden by a value given
    (`seq_len`; `kernel_options`, "" for none: the kernels' own defaults). The one place the suite's
    inputs depend on the platform."""
    platform = platform or host_platform()
    if platform not in PARITY_SHAPES:
        raise ValueError(f"parity_shape: unknown platform {platform!r}; expected one of {', '.join(PARITY_SHAPES)}")
    default = PARITY_SHAPES[platform]
    return ParityShape(default.seq_len if seq_len is None else seq_len,
                       default.kernel_options if kernel_options is None else kernel_options)


def parity_config(cfg: ModelConfig, window: int | None = PARITY_WINDOW, loss: Mapping | None = None) -> ModelConfig:
    """The parity run's model: the sliding window cut to `window` (None: unchanged) and the loss
    coefficients of PARITY_LOSS (or `loss`). The weights' shapes do not change."""
    changes = dict(PARITY_LOSS if loss is None else loss)
    if not cfg.is_moe:
        changes = {k: v for k, v in changes.items() if not k.startswith("router")}
    if window is not None and cfg.sliding_window:
        changes["sliding_window"] = window
        changes["layer_types"] = cfg.layer_types
    return cfg.replace(**changes)


# Packed rows: even rows hold 3 segments cut at 15% and 80% of the row, odd rows 2 cut at 55% and a
# padded tail of 1/6 of the row (its own segment id PAD_SEGMENT, position 0, weight 0, as
# train/data/loader.py pads). At each platform's parity shape (CPU: 80 tokens, tiles 16 x 32; TPU:
# 320 tokens, tiles 128 x 128) these cuts let the pallas kernel skip tiles on segment bounds in the
# sliding and the full layers (the coverage lines count them). A row too short for segments of
# MIN_SEGMENT tokens holds one.
SEGMENT_CUTS = ((0.15, 0.8), (0.55,))
PAD_SHARE = (0.0, 1 / 6)
MIN_SEGMENT = 4
PAD_ID = 0


@dataclass(frozen=True)
class ParityBatch:
    """The parity run's batch as the train step sees it: `tokens` int64 [B, seq_len + 1] and
    `weights` float32 [B, seq_len + 1] (weights[:, 1:] is 1 where label tokens[:, 1:] is trained),
    plus `segment_ids` / `positions` [B, seq_len + 1] for packed rows (None: unsegmented rows,
    positions 0, 1, ...). Inputs are tokens[:, :-1], labels tokens[:, 1:] (ignored where weight 0)."""
    tokens: torch.Tensor
    weights: torch.Tensor
    segment_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def segmented(self) -> bool:
        return self.segment_ids is not None

    @property
    def ids(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def labels(self) -> torch.Tensor:
        targets = self.tokens[:, 1:]
        return torch.where(self.weights[:, 1:] > 0, targets, torch.full_like(targets, IGNORE_INDEX))

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The model's per-row `positions` and `segment_ids` [B, seq_len] (empty: unsegmented)."""
        if not self.segmented:
            return {}
        return {"positions": self.positions[:, :-1], "segment_ids": self.segment_ids[:, :-1]}

    def step_tokens(self):
        """One step's batch for `TrainStep.__call__` (one micro-batch): the packed dict (tokens,
        weights, segment ids, positions; its cross-entropy divides by the trained tokens, as the
        eager loss divides by the labels not ignored) or, unsegmented, the bare tokens (which
        have no ignored labels: the caller ignores none)."""
        if not self.segmented:
            return self.tokens.numpy()[None]
        return {"tokens": self.tokens.numpy()[None], "weights": self.weights.numpy()[None],
                "segment_ids": self.segment_ids.numpy()[None], "positions": self.positions.numpy()[None]}

    @classmethod
    def from_pairs(cls, ids, labels) -> ParityBatch:
        """Unsegmented rows from (input ids, labels) int64 [B, seq_len], labels the next token
        or IGNORE_INDEX."""
        ids, labels = (torch.as_tensor(np.asarray(x), dtype=torch.int64) for x in (ids, labels))
        last = labels[:, -1:].clamp(min=0)
        tokens = torch.cat([ids, last], 1)
        tokens[:, 1:] = torch.where(labels == IGNORE_INDEX, tokens[:, 1:], labels)
        weights = torch.cat([torch.zeros_like(ids[:, :1]), (labels != IGNORE_INDEX).long()], 1).float()
        return cls(tokens, weights)


def parity_inputs(vocab_size: int, batch: int, seq_len: int, seed: int,
                  ignore_fraction: float = PARITY_IGNORE_FRACTION, segments: bool = True) -> ParityBatch:
    """Uniform random tokens seeded with `seed`, a seeded `ignore_fraction` of the labels at the
    ignore index (at least one per row when the fraction is > 0, and never all of them); packed
    rows (`pack_rows`) unless `segments` is False."""
    gen = torch.Generator().manual_seed(seed)
    if segments:
        return pack_rows(lambda n: torch.randint(0, vocab_size, (n,), generator=gen), batch, seq_len,
                         ignore_fraction, gen)
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)
    return ParityBatch.from_pairs(*_with_ignored_labels(tokens, seq_len, ignore_fraction, gen))


def text_inputs(data: np.ndarray, batch: int, seq_len: int, seed: int,
                ignore_fraction: float = PARITY_IGNORE_FRACTION, segments: bool = True) -> ParityBatch:
    """As `parity_inputs`, from windows of a token sequence `data` (1-D) at seeded offsets (one
    per segment): what a trained model sees, so its logits are as sharp and its routing as uneven
    as in use."""
    gen = torch.Generator().manual_seed(seed)
    if len(data) < seq_len + 1:
        raise ValueError(f"text_inputs: {len(data)} tokens, a window needs {seq_len + 1}")

    def window(n: int) -> torch.Tensor:
        s = int(torch.randint(0, len(data) - n + 1, (1,), generator=gen))
        return torch.as_tensor(np.asarray(data[s:s + n], np.int64))

    if segments:
        return pack_rows(window, batch, seq_len, ignore_fraction, gen)
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
    tokens = torch.stack([torch.as_tensor(np.asarray(data[s:s + seq_len + 1], np.int64)) for s in starts.tolist()])
    return ParityBatch.from_pairs(*_with_ignored_labels(tokens, seq_len, ignore_fraction, gen))


def segment_lengths(row: int, row_len: int) -> tuple[list[int], int]:
    """(lengths of the real segments, padded tail) of packed row `row` of `row_len` tokens
    (SEGMENT_CUTS, PAD_SHARE; one segment when a cut would leave one under MIN_SEGMENT)."""
    pad = int(PAD_SHARE[row % len(PAD_SHARE)] * row_len)
    if row_len - pad < 2 * MIN_SEGMENT:
        pad = 0
    real = row_len - pad
    cuts = [round(f * (row_len - 1)) for f in SEGMENT_CUTS[row % len(SEGMENT_CUTS)]]
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, real])]
    return (lengths if min(lengths) >= MIN_SEGMENT else [real]), pad


def pack_rows(take: Callable[[int], torch.Tensor], batch: int, seq_len: int, ignore_fraction: float,
              gen) -> ParityBatch:
    """Packed rows of seq_len + 1 tokens: segments of `take(length)` tokens (ids 1, 2, ...,
    positions restarting at 0), then the padded tail. A label is trained only inside a segment
    (never across a boundary, never on padding); a seeded `ignore_fraction` of the labels is
    ignored on top (at least one per row; never all of the row's trained ones)."""
    row_len = seq_len + 1
    tokens = torch.full((batch, row_len), PAD_ID, dtype=torch.int64)
    segments = torch.full((batch, row_len), PAD_SEGMENT, dtype=torch.int64)
    positions = torch.zeros((batch, row_len), dtype=torch.int64)
    for r in range(batch):
        lengths, _ = segment_lengths(r, row_len)
        start = 0
        for s, n in enumerate(lengths, start=1):
            tokens[r, start:start + n] = take(n)
            segments[r, start:start + n] = s
            positions[r, start:start + n] = torch.arange(n)
            start += n
    trained = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != PAD_SEGMENT)
    if ignore_fraction > 0:
        n = max(1, round(ignore_fraction * seq_len))
        for row in trained:
            keep = row.nonzero().flatten()
            row[keep[torch.randperm(len(keep), generator=gen)[:min(n, len(keep) - 1)]]] = False
    weights = torch.cat([torch.zeros((batch, 1), dtype=torch.bool), trained], 1).float()
    return ParityBatch(tokens, weights, segments, positions)


def _with_ignored_labels(tokens: torch.Tensor, seq_len: int, ignore_fraction: float, gen) -> tuple:
    ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if ignore_fraction > 0:
        n = min(seq_len - 1, max(1, round(ignore_fraction * seq_len)))
        for row in labels:
            row[torch.randperm(seq_len, generator=gen)[:n]] = IGNORE_INDEX
    return ids, labels


def build_model(model_cfg, state_dict: Mapping | None, seed: int):
    """The model the lowered runs take: `state_dict`'s weights, or (None) random init seeded with
    `seed` (a transformers model's record, `TransformersSpec`: transformers' own init). Its eager
    ground truth is `reference_model`."""
    if isinstance(model_cfg, TransformersSpec):
        torch.manual_seed(seed)
        model = model_cfg.build()
    elif isinstance(model_cfg, ModuleSpec):      # the module's own init, seeded
        from formats.model_checks import build_module_model

        torch.manual_seed(seed)
        model = build_module_model(model_cfg, new_run=state_dict is None)
    else:
        model = GptOssForCausalLM(model_cfg)
        if state_dict is None:
            model.reset_parameters(seed)
    if state_dict is not None:
        load_state_dict(model, state_dict)
    return model


def reference_model(model):
    """The eager ground truth of `model`: itself (ours: eager PyTorch with the ops' references),
    or the same weights run by the model authors' code: for a transformers model over
    transformers' own eager attention and experts (torch_model.transformers_lm.build(reference=True)),
    for a module its own forward and its logits' cross-entropy (ModuleCausalLM.reference_twin)."""
    return model.reference_twin() if hasattr(model, "reference_twin") else model


def load_state_dict(model, state_dict: Mapping) -> None:
    """Load float32 copies of `state_dict` (torch or numpy) into `model`; a missing, unexpected
    or misshapen tensor is a UserError naming it."""
    tensors = {k: (v.detach() if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v, np.float32)))
               .to(torch.float32) for k, v in state_dict.items()}
    expected = dict(model.named_parameters())
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise UserError(f"state dict does not fit the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                        f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, p in expected.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise UserError(f"state dict: {name} has shape {tuple(tensors[name].shape)}, "
                            f"the model expects {tuple(p.shape)}")
    from formats.model_checks import load_weights

    load_weights(model, tensors)        # strict; a tied or aliased tensor's other names filled
