"""The parity suite's inputs: the parity run's model (`parity_config`), its weights (`build_model`:
seeded random or a state dict) and its tokens (`parity_inputs`: random ids, some labels ignored).

Defaults that make every part visible: the preset's sliding window cut to PARITY_WINDOW (16) at
sequence PARITY_SEQ_LEN (80), small kernel tiles (PARITY_TILES), one label in ten at the ignore
index and non-zero router balance, router z-loss and LM z-loss coefficients (PARITY_LOSS).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from torch_model.config import ModelConfig
from torch_model.model import IGNORE_INDEX, GptOssForCausalLM
from train.errors import UserError

# The default parity inputs (see the module docstring).
PARITY_SEQ_LEN = 80
PARITY_WINDOW = 16
PARITY_IGNORE_FRACTION = 0.1
PARITY_TILES = ("attention.pallas.block_q=16,attention.pallas.block_kv=32,"
                "cross_entropy.pallas.block_n=32,cross_entropy.pallas.block_v=1024,"
                "moe.pallas.block_m=16,moe.pallas.block_i=128,moe.megablox.block_m=16,moe.xla.block_m=16")
# Large enough that each term's gradient is visible through bf16 noise (a sign error in the LM
# z-loss must fail in bf16), small enough that cross-entropy still dominates the loss. The router
# z-loss at 0.1 (training uses ~1e-4) also gives the router a well-conditioned gradient term: with
# 0.01 the router's gradient is a difference of nearly equal terms through the top-k softmax and
# its bf16 error reached rel 0.61 / norm ratio 0.86 (tiny, seeds 0-2), too noisy to see a 20%
# scaling; with 0.1 the same runs gave rel <= 0.14 / norm ratio 0.99..1.01.
PARITY_LOSS = {"router_aux_loss_coef": 0.1, "router_z_loss_coef": 0.1, "lm_z_loss_coef": 0.05}


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


def parity_inputs(vocab_size: int, batch: int, seq_len: int, seed: int,
                  ignore_fraction: float = PARITY_IGNORE_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels), int64 [batch, seq_len]: uniform random tokens seeded with `seed`,
    labels the next token, a seeded `ignore_fraction` of the labels at the ignore index (at least
    one per row when the fraction is > 0, and never all of them)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)
    return _with_ignored_labels(tokens, seq_len, ignore_fraction, gen)


def text_inputs(data: np.ndarray, batch: int, seq_len: int, seed: int,
                ignore_fraction: float = PARITY_IGNORE_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """As `parity_inputs`, from windows of a token sequence `data` (1-D) at seeded offsets: what
    a trained model sees, so its logits are as sharp and its routing as uneven as in use."""
    gen = torch.Generator().manual_seed(seed)
    if len(data) < seq_len + 1:
        raise ValueError(f"text_inputs: {len(data)} tokens, a window needs {seq_len + 1}")
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
    tokens = torch.stack([torch.as_tensor(np.asarray(data[s:s + seq_len + 1], np.int64)) for s in starts.tolist()])
    return _with_ignored_labels(tokens, seq_len, ignore_fraction, gen)


def _with_ignored_labels(tokens: torch.Tensor, seq_len: int, ignore_fraction: float, gen) -> tuple:
    ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if ignore_fraction > 0:
        n = min(seq_len - 1, max(1, round(ignore_fraction * seq_len)))
        for row in labels:
            row[torch.randperm(seq_len, generator=gen)[:n]] = IGNORE_INDEX
    return ids, labels


def build_model(model_cfg: ModelConfig, state_dict: Mapping | None, seed: int):
    """The eager model: `state_dict`'s weights, or (None) random init seeded with `seed`."""
    model = GptOssForCausalLM(model_cfg)
    if state_dict is None:
        model.reset_parameters(seed)
    else:
        load_state_dict(model, state_dict)
    return model


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
    model.load_state_dict(tensors, strict=True)
