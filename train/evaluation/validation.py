"""Validation loss and bits per byte; `torchlyra eval --checkpoint DIR [--data DIR] [--json OUT]`.

Bits per byte divide the model's cross-entropy by the UTF-8 bytes of the text the predicted
tokens stand for (each token's byte length from the tokenizer; special tokens such as BOS count
0 bytes and their predictions are left out), so runs with different tokenizers compare. Packed
rows (chat data, document masking) count only trained tokens (loss weight 1): the loss is their
mean, bits per byte their nats over the UTF-8 bytes of the trained ordinary tokens.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from formats.errors import UserError
from formats.lora_inference import add_merge_argument


def token_byte_lengths(tokenizer, vocab_size: int) -> np.ndarray:
    """[vocab_size] int32: UTF-8 bytes of each token id; 0 for special tokens, unassigned and
    padding ids (the tokenizer's own table, cut or padded to the model's vocabulary)."""
    from formats.tokenizer import token_byte_lengths as tokenizer_byte_lengths

    table = tokenizer_byte_lengths(tokenizer)
    lengths = np.zeros(vocab_size, np.int32)
    n = min(len(table), vocab_size)
    lengths[:n] = table[:n]
    return lengths


class Evaluator:
    """Validation loss (mean cross-entropy over every target, as the training loss) and bits per
    byte over a fixed list of batches [batch, seq_len + 1], with the train step's kernels."""

    def __init__(self, step, batches: list[np.ndarray], byte_lengths: np.ndarray):
        import jax.numpy as jnp

        from torch_model.causal_lm import IGNORE_INDEX

        if not batches:
            raise UserError("evaluation: the validation split gave no batch")
        self.step = step
        if hasattr(batches[0], "weights"):              # loader Batches: packed rows
            from jax_bridge.step import packed_batch

            self.batches = [packed_batch(b) for b in batches]
            self.packed = True
            self._losses = self._packed_losses(step, jnp.asarray(byte_lengths))
            self.byte_lengths = byte_lengths
            return
        self.packed = False
        self.batches = [np.asarray(b, np.int32) for b in batches]
        self.byte_lengths = byte_lengths
        lengths = jnp.asarray(byte_lengths)

        def losses(params, tokens):
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            _, every = step.loss_and_metrics(params, inputs, labels)
            text_labels = jnp.where(lengths[labels] > 0, labels, IGNORE_INDEX)
            _, text = step.loss_and_metrics(params, inputs, text_labels)   # XLA shares the forward
            return every["ce"], text["ce"]

        self._losses = step.jit(losses)

    @staticmethod
    def _packed_losses(step, lengths):
        """jit(params, batch) -> (nats over trained tokens, nats over trained ordinary tokens):
        sums, from the model's weighted loss with denominator 1."""
        import jax.numpy as jnp

        from jax_bridge.step import packed_inputs

        def losses(params, batch):
            inputs, labels, packed = packed_inputs(batch, jnp.float32(1.0), 1.0)
            _, every = step.loss_and_metrics(params, inputs, labels, packed)
            text_weights = packed[2] * (lengths[labels] > 0)
            _, text = step.loss_and_metrics(params, inputs, labels, (*packed[:2], text_weights, *packed[3:]))
            return every["ce"], text["ce"]

        return step.jit(losses)

    def _packed_call(self, params) -> dict:
        from jax_bridge.distributed import sum_over_processes

        nats, text_nats, counts = 0.0, 0.0, []
        for batch in self.batches:      # this process's rows; the sums are over the global batch
            every, text = self._losses(params, self.step.place_batch(batch, 0))
            nats, text_nats = nats + float(every), text_nats + float(text)
            trained = batch["weights"][:, 1:] > 0
            lengths = self.byte_lengths[batch["tokens"][:, 1:]] * trained
            counts.append([int(trained.sum()), int(lengths.sum()), int((batch["segment_ids"] != 0).sum())])
        trained, text_bytes, real = sum_over_processes(np.array(counts, np.int64)).sum(0)
        return {"val_loss": nats / max(int(trained), 1), "val_bpb": text_nats / (math.log(2) * max(int(text_bytes), 1)),
                "val_tokens": int(real), "val_trained_tokens": int(trained), "val_bytes": int(text_bytes)}

    def lower(self, params, batch):
        """The validation program's `jax.stages.Lowered` for these parameters (arrays or
        ShapeDtypeStructs) and one batch of this process's rows: `.compile()` it for its memory."""
        return self._losses.lower(params, self.step.place_batch(batch, 0))

    def __call__(self, params) -> dict:
        from jax_bridge.distributed import sum_over_processes

        if self.packed:
            return self._packed_call(params)
        ce, text_ce, counts = [], [], []
        for batch in self.batches:      # this process's rows of each batch
            every, text = self._losses(params, self.step.place_batch(batch, 0))
            lengths = self.byte_lengths[batch[:, 1:]]
            ce.append(float(every))
            text_ce.append(float(text))
            counts.append([int((lengths > 0).sum()), int(lengths.sum()), batch[:, 1:].size])
        text_tokens, text_bytes, tokens = sum_over_processes(np.array(counts, np.int64)).T   # per batch
        nats = float(np.dot(text_ce, text_tokens))
        return {"val_loss": float(np.mean(ce)), "val_bpb": nats / (math.log(2) * max(int(text_bytes.sum()), 1)),
                "val_tokens": int(tokens.sum()), "val_bytes": int(text_bytes.sum())}


# ---- command line ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="run directory, checkpoints directory or step directory, or a Hugging Face GptOss "
                             "directory (gpt-oss as released: MXFP4 or bf16; give --data)")
    parser.add_argument("--data", help="prepared data directory (default: the one the run trained on)")
    parser.add_argument("--batches", type=int, default=None, help="validation batches (default: the run's eval_batches)")
    parser.add_argument("--kernels", default="auto", help="kernel choice, as for `train --kernels` (default: auto)")
    add_merge_argument(parser, base_dtype=True)
    parser.add_argument("--json", dest="json_out", help="also write the results to this JSON file")


def evaluate_checkpoint(checkpoint: str, *, data: str | None = None, batches: int | None = None,
                        kernels: str = "xla", merge: bool = False, base_dtype: str = "compute") -> dict:
    from jax_bridge import registry
    from jax_bridge.lowering import params_to_jax
    from jax_bridge.step import StepConfig, TrainStep
    from train.run.config import TrainConfig
    from train.data.loader import TokenLoader
    from formats.tokenizer import check_same_tokenizer, load_tokenizer
    from formats import mesh_loader
    from formats.lora_inference import inference_tokenizer, open_inference_model

    model, meta, weights = open_inference_model(checkpoint, merge=merge, base_dtype=base_dtype)
    model_cfg = model.cfg
    run_cfg = TrainConfig(**{k: v for k, v in (meta.get("train_config") or {}).items()
                             if k in TrainConfig.__dataclass_fields__})
    data = data or (meta.get("train_config") or {}).get("data")
    if not data:
        raise UserError(f"checkpoint {meta['step_dir']} names no data directory: pass --data DIR")
    data_tokenizer = load_tokenizer(data)
    model_tokenizer, _ = inference_tokenizer(checkpoint, meta)
    if model_tokenizer is not None:
        check_same_tokenizer(model_tokenizer, data_tokenizer, f"checkpoint {meta['step_dir']}", f"data {data}")
    n_batches = batches if batches is not None else run_cfg.eval_batches
    if n_batches <= 0:
        raise UserError(f"--batches must be > 0, found {n_batches}")
    loader = TokenLoader(data, "val", global_batch=run_cfg.batch_size, seq_len=run_cfg.seq_len, seed=run_cfg.seed,
                         vocab_size=model_cfg.vocab_size, document_masking=run_cfg.document_masking,
                         truncate=run_cfg.truncate, accepts_batch=True)
    try:
        step = TrainStep(model, step_cfg=StepConfig(kernels=kernels, compute_dtype=run_cfg.compute_dtype))
    except registry.KernelError as e:
        raise UserError(str(e)) from None
    evaluator = Evaluator(step, list(loader.iter_eval_batches(n_batches)),
                          token_byte_lengths(data_tokenizer, model_cfg.vocab_size))
    # The checkpoint's weights read onto the device (the model on `meta`), or the host model's.
    params = mesh_loader.place_params(step, weights, f"checkpoint {checkpoint}") if weights is not None \
        else params_to_jax(model)
    result = evaluator(step.full_params(params))
    return {"checkpoint": meta["step_dir"], "step": meta["step"], "data": str(data), "split": "val",
            "batches": len(evaluator.batches), **result}


def run(args) -> int:
    result = evaluate_checkpoint(args.checkpoint, data=args.data, batches=args.batches, kernels=args.kernels,
                                 merge=args.merge, base_dtype=args.base_dtype)
    print(f"checkpoint {result['checkpoint']} (step {result['step']}) on {result['data']} ({result['split']}, "
          f"{result['val_tokens']:,} tokens, {result['val_bytes']:,} bytes):")
    print(f"  validation loss  {result['val_loss']:.4f} nats/token")
    print(f"  bits per byte    {result['val_bpb']:.4f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"  written to {args.json_out}")
    return 0
