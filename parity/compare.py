"""Metrics comparing a lowered tensor (`got`) with its eager ground truth (`expected`).

Everything is computed in float64 numpy, so the metric itself adds no error. Names match the
bounds in `parity/tolerances.py`.
"""
from __future__ import annotations

import numpy as np


def as_float64(x) -> np.ndarray:
    """torch tensor, JAX array (any float dtype, bf16 included) or number -> float64 ndarray (no
    copy when it already is one: the metrics below convert their inputs once)."""
    if hasattr(x, "detach"):                       # torch.Tensor
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _norm(x: np.ndarray) -> float:
    flat = x.ravel()
    return float(np.sqrt(np.dot(flat, flat)))


def _rel(diff_norm: float, expected_norm: float) -> float:
    return diff_norm / expected_norm if expected_norm > 0 else diff_norm


def _cos(a: np.ndarray, b: np.ndarray, na: float, nb: float) -> float:
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a.ravel(), b.ravel()) / (na * nb))


def _ratio(na: float, nb: float) -> float:
    if nb == 0:
        return 1.0 if na == 0 else float("inf")
    return na / nb


def rel_err(got, expected) -> float:
    """||got - expected|| / ||expected|| (||got|| when expected is all zeros)."""
    a, b = as_float64(got), as_float64(expected)
    return _rel(_norm(a - b), _norm(b))


def cosine(got, expected) -> float:
    """Cosine similarity of the flattened tensors; 1 when both are zero, 0 when one is."""
    a, b = as_float64(got), as_float64(expected)
    return _cos(a, b, _norm(a), _norm(b))


def norm_ratio(got, expected) -> float:
    """||got|| / ||expected||: the magnitude check that cosine and a loose rel cannot make (a
    gradient scaled by 0.8 keeps cos 1). 1 when both are zero, inf when only expected is."""
    return _ratio(_norm(as_float64(got)), _norm(as_float64(expected)))


def tensor_metrics(got, expected) -> dict[str, float]:
    """max_abs, rel, norm_ratio and, for a tensor (not a 0-d scalar such as the loss), cos: a
    one-element parameter's cos is the agreement of the two signs (Apertus's activation
    constants), never missing, which a bound on it would read as a failure. Each input is
    converted and each norm taken once (the comparisons were a third of a parity run on CPU)."""
    a, b = as_float64(got), as_float64(expected)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: lowered {a.shape} vs eager {b.shape}")
    diff = a - b
    na, nb = _norm(a), _norm(b)
    out = {"max_abs": float(np.max(np.abs(diff))) if a.size else 0.0, "rel": _rel(_norm(diff), nb),
           "norm_ratio": _ratio(na, nb)}
    if a.ndim > 0 and a.size > 0:
        out["cos"] = _cos(a, b, na, nb)
    return out


def per_slice_metrics(got, expected) -> tuple[dict[str, float], int]:
    """For a stacked tensor (experts [E, ...]): the norm ratio furthest from 1 (in log scale) and
    the lowest cosine over the leading-axis slices, named `slice_norm_ratio` / `slice_cos`, and
    the index of the worst slice (by cosine, then by norm ratio). One expert scaled by 0.9 moves
    the whole tensor's norm by ~1%, its own slice by 10%."""
    a, b = as_float64(got), as_float64(expected)
    norms = [(_norm(x), _norm(y)) for x, y in zip(a, b)]
    ratios = [_ratio(nx, ny) for nx, ny in norms]
    cosines = [_cos(x, y, nx, ny) for x, y, (nx, ny) in zip(a, b, norms)]
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
    nu, ne = _norm(du), _norm(de)
    return {"update_rel": _rel(_norm(du - de), ne), "update_cos": _cos(du, de, nu, ne), "update_ratio": _ratio(nu, ne)}


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
