"""Metrics comparing a lowered tensor (`got`) with its eager ground truth (`expected`).

Everything is computed in float64 numpy, so the metric itself adds no error. Names match the
bounds in `parity/tolerances.py`.
"""
from __future__ import annotations

import numpy as np


def as_float64(x) -> np.ndarray:
    """torch tensor, JAX array (any float dtype, bf16 included) or number -> float64 ndarray."""
    if hasattr(x, "detach"):                       # torch.Tensor
        x = x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float64)


def rel_err(got, expected) -> float:
    """||got - expected|| / ||expected|| (||got|| when expected is all zeros)."""
    a, b = as_float64(got), as_float64(expected)
    denom = np.linalg.norm(b)
    diff = np.linalg.norm(a - b)
    return float(diff / denom) if denom > 0 else float(diff)


def cosine(got, expected) -> float:
    """Cosine similarity of the flattened tensors; 1 when both are zero, 0 when one is."""
    a, b = as_float64(got).ravel(), as_float64(expected).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def norm_ratio(got, expected) -> float:
    """||got|| / ||expected||: the magnitude check that cosine and a loose rel cannot make (a
    gradient scaled by 0.8 keeps cos 1). 1 when both are zero, inf when only expected is."""
    na, nb = np.linalg.norm(as_float64(got)), np.linalg.norm(as_float64(expected))
    if nb == 0:
        return 1.0 if na == 0 else float("inf")
    return float(na / nb)


def tensor_metrics(got, expected) -> dict[str, float]:
    """max_abs, rel, norm_ratio and, for a tensor (not a 0-d scalar such as the loss), cos: a
    one-element parameter's cos is the agreement of the two signs (Apertus's activation
    constants), never missing, which a bound on it would read as a failure."""
    a, b = as_float64(got), as_float64(expected)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: lowered {a.shape} vs eager {b.shape}")
    out = {"max_abs": float(np.max(np.abs(a - b))) if a.size else 0.0, "rel": rel_err(a, b),
           "norm_ratio": norm_ratio(a, b)}
    if a.ndim > 0 and a.size > 0:
        out["cos"] = cosine(a, b)
    return out


def per_slice_metrics(got, expected) -> tuple[dict[str, float], int]:
    """For a stacked tensor (experts [E, ...]): the norm ratio furthest from 1 (in log scale) and
    the lowest cosine over the leading-axis slices, named `slice_norm_ratio` / `slice_cos`, and
    the index of the worst slice (by cosine, then by norm ratio). One expert scaled by 0.9 moves
    the whole tensor's norm by ~1%, its own slice by 10%."""
    a, b = as_float64(got), as_float64(expected)
    ratios = [norm_ratio(x, y) for x, y in zip(a, b)]
    cosines = [cosine(x, y) for x, y in zip(a, b)]
    off = [abs(np.log(r)) if r > 0 and np.isfinite(r) else np.inf for r in ratios]
    worst_ratio, worst_cos = int(np.argmax(off)), int(np.argmin(cosines))
    worst = worst_cos if cosines[worst_cos] < 1 - off[worst_ratio] else worst_ratio
    return {"slice_norm_ratio": ratios[worst_ratio], "slice_cos": cosines[worst_cos]}, worst


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def resolution(dtype) -> float:
    """Machine epsilon of a float dtype (bfloat16 included): the spacing of numbers in [1, 2)."""
    try:
        return float(np.finfo(dtype).eps)
    except ValueError:
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)


def logits_metrics(got, expected, tokens=None) -> dict[str, float]:
    """tensor_metrics over all tokens, plus

    top1  fraction of tokens whose argmax agrees, where a token also agrees when the eager logit
          of the lowered argmax is within one unit in the last place (in the LOWERED logits'
          dtype) of the eager maximum: logits closer than the resolution they are produced in
          cannot be ordered (in float32 that is a ~1e-7 relative near-tie; in bfloat16 2^-7, and
          a random-init model has many such near-ties);
    kl    mean over tokens of KL(P_eager || P_lowered), P = softmax(logits);
    kl_floor   the same for the eager logits merely rounded to the lowered logits' dtype: what the
          output's own resolution costs (0 in float32; in bf16 it grows with the logits' size, so
          a trained model's sharp logits have a floor that a random-init model's do not);
    kl_excess  kl - kl_floor.

    `tokens` (bool [tokens], optional) restricts top1 and kl to those tokens; top1_all and kl_all
    are then reported over all tokens (top1_exact: plain argmax agreement over all tokens)."""
    eps = resolution(np.asarray(got).dtype)
    a, b = as_float64(got), as_float64(expected)
    out = tensor_metrics(a, b)
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    eager_max = b2.max(-1)
    ulp = eps * np.exp2(np.floor(np.log2(np.maximum(np.abs(eager_max), np.finfo(np.float64).tiny))))
    agree = b2[np.arange(len(b2)), a2.argmax(-1)] >= eager_max - ulp
    logp, logq = _log_softmax(b2), _log_softmax(a2)
    kl = np.sum(np.exp(logp) * (logp - logq), axis=-1)
    # The KL that rounding the eager logits to the lowered dtype alone gives: logits produced in
    # bf16 cannot be closer than their own resolution, which grows with their size.
    rounded = as_float64(np.asarray(expected, np.float32).astype(np.asarray(got).dtype)).reshape(b2.shape)
    kl_floor = np.sum(np.exp(logp) * (logp - _log_softmax(rounded)), axis=-1)
    keep = np.ones(len(b2), bool) if tokens is None else np.asarray(tokens, bool).reshape(-1)
    out["top1"] = float(np.mean(agree[keep])) if keep.any() else float("nan")
    out["kl"] = float(np.mean(kl[keep])) if keep.any() else float("nan")
    out["kl_floor"] = float(np.mean(kl_floor[keep])) if keep.any() else float("nan")
    out["kl_excess"] = out["kl"] - out["kl_floor"]
    if tokens is not None:
        out["top1_all"], out["kl_all"] = float(np.mean(agree)), float(np.mean(kl))
    out["top1_exact"] = float(np.mean(a2.argmax(-1) == b2.argmax(-1)))
    return out


def update_metrics(got_after, expected_after, before) -> dict[str, float]:
    """Compare the parameter updates (after - before) of the two paths: update_rel, update_cos
    and update_ratio (||update_lowered|| / ||update_eager||: a zero update gives 0, a doubled
    learning rate 2, whatever the update's direction)."""
    before = as_float64(before)
    du, de = as_float64(got_after) - before, as_float64(expected_after) - before
    return {"update_rel": rel_err(du, de), "update_cos": cosine(du, de), "update_ratio": norm_ratio(du, de)}


def same_experts(got_experts, expected_experts) -> np.ndarray:
    """bool [tokens]: the two paths chose the same SET of experts (order within the k ignored)."""
    g, e = np.asarray(got_experts), np.asarray(expected_experts)
    g, e = np.sort(g.reshape(-1, g.shape[-1]), -1), np.sort(e.reshape(-1, e.shape[-1]), -1)
    if g.shape != e.shape:
        raise ValueError(f"routing shape mismatch: lowered {g.shape} vs eager {e.shape}")
    return np.all(g == e, axis=-1)


def routing_metrics(got_experts, expected_experts, got_router_logits, expected_router_logits) -> dict[str, float]:
    """mismatch: fraction of tokens whose set of chosen experts differs between the paths (each
    path's own top-k choice); plus the router logits' max_abs, rel and cos (prefixed `logits_`)."""
    out = {"mismatch": float(np.mean(~same_experts(got_experts, expected_experts)))}
    out.update({f"logits_{k}": v for k, v in tensor_metrics(got_router_logits, expected_router_logits).items()})
    return out
