"""Greedy generation by the references, to hold the compiled generator against: eager PyTorch
step by step without a cache (the whole sequence re-run for every token) and transformers'
`generate` on an exported checkpoint. A comparison tolerates a divergence only where the
reference's top-1 margin was within `tie` (an argmax that float rounding may flip).
"""
from __future__ import annotations

import torch

NEAR_TIE = 1e-4


@torch.no_grad()
def eager_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """(tokens, margins): each prompt alone, the full forward re-run for every new token;
    margins[i][t] = top-1 minus top-2 logit at step t."""
    tokens, margins = [], []
    for prompt in prompts:
        seq, gaps = list(prompt), []
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq]))[0, -1].double()
            top = logits.topk(2).values
            gaps.append(float(top[0] - top[1]))
            seq.append(int(logits.argmax()))
        tokens.append(seq[len(prompt):])
        margins.append(gaps)
    return tokens, margins


def load_transformers(hf_dir):
    """transformers' GptOssForCausalLM from an exported directory, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def transformers_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0,
                        streamer=None) -> list[list[int]]:
    """transformers' `generate` (greedy, its own KV cache) on a left-padded batch; exactly
    max_new_tokens per row (no early stop). `streamer` is handed to `generate`."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=None,
                            temperature=None, top_p=None, top_k=None, streamer=streamer)
    return out[:, width:].tolist()


def compare_greedy(got: list[list[int]], expected: list[list[int]], margins: list[list[float]],
                   tie: float = NEAR_TIE) -> list[dict]:
    """Per row: the first step where `got` leaves `expected` (None if never) and the reference's
    margin there; `ok` unless they part while that margin exceeds `tie` (after a legitimate
    split at a near-tie the sequences differ and are not compared further)."""
    report = []
    for row, (a, b, gaps) in enumerate(zip(got, expected, margins)):
        split = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if split is None and len(a) != len(b):
            split = min(len(a), len(b))
        margin = gaps[split] if split is not None and split < len(gaps) else None
        ok = split is None or (margin is not None and margin <= tie)
        report.append({"row": row, "first_difference": split, "margin_there": margin, "ok": ok,
                       "min_margin": min(gaps[:split] if split is not None else gaps, default=None)})
    return report
