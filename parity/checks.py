"""The parity suite's checks: every `Row` of one lowered run against the ground truth (logits,
loss, each gradient, each expert's gradient slice, the whole gradient and its norm, each
parameter after one step, each MoE layer's routing), bounded by `parity/tolerances.py`.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from parity import compare, tolerances
from parity.report import FAIL, GRAD_NORM, GRAD_VECTOR, PER_EXPERT_FORMAT, VECTOR, Row
from parity.runs import Run


def _is_stacked_experts(name: str, array) -> bool:
    """An expert weight stack [E, in, out] (checked per expert). Not the biases [E, out]: a bias
    gradient is a plain sum over the expert's tokens, so one token routed differently in bf16
    moves a small expert's slice by up to 7% (measured), while its weights stay within 3%."""
    return ".mlp.experts." in name and np.ndim(array) >= 3 and np.shape(array)[0] > 1


def expert_row_name(name: str, expert: int) -> str:
    """The per-expert row of an expert tensor: 'model.layers.1.mlp.experts.down_proj (expert 6)'."""
    return f"{name}{PER_EXPERT_FORMAT.format(expert)}"


def _router_of(expert_tensor: str) -> str:
    """'model.layers.1.mlp.experts.down_proj' -> 'model.layers.1.mlp.router'."""
    return expert_tensor.split(".mlp.experts.")[0] + ".mlp.router"


def expert_token_counts(ref: Run, router_names: list[str]) -> dict[str, np.ndarray]:
    """Per MoE layer (by router name), how many (token, slot) assignments each expert received in
    the eager run: the number of terms its gradient slice sums, which sets that slice's bf16 noise."""
    if len(ref.routing) != len(router_names):
        return {}
    return {name: np.bincount(np.asarray(experts).ravel(), minlength=np.shape(logits)[-1])
            for name, (logits, experts) in zip(router_names, ref.routing)}


def compare_runs(ref: Run, got: Run, before: Mapping[str, np.ndarray], kernels: str, dtype: str,
                 router_names: list[str]) -> list[Row]:
    """Every check of one run against the ground truth."""
    tol = lambda check: tolerances.bounds(dtype, check)  # noqa: E731
    same_route = None
    if router_names and len(got.routing) == len(ref.routing) == len(router_names):
        same_route = np.logical_and.reduce([compare.same_experts(g[1], e[1]) for g, e in zip(got.routing, ref.routing)])
    rows = [Row(kernels, dtype, "logits", "logits", compare.logits_metrics(got.logits, ref.logits, same_route),
                tol("logits")),
            Row(kernels, dtype, "loss", "loss", compare.tensor_metrics(got.loss, ref.loss), tol("loss"))]
    names = list(ref.grads)
    flat = lambda d: np.concatenate([np.asarray(d[n], np.float64).ravel() for n in names])  # noqa: E731
    for name in names:
        if name in got.grads:
            check = "grad_scalar" if np.size(ref.grads[name]) == 1 else "grad"
            rows.append(Row(kernels, dtype, "grad", name, compare.tensor_metrics(got.grads[name], ref.grads[name]),
                            tol(check)))
        else:
            rows.append(Row(kernels, dtype, "grad", name, bounds=tol("grad"), status=FAIL,
                            message="no gradient in the lowered run"))
    tokens = expert_token_counts(ref, router_names)
    for name in names:        # each expert's slice on its own: one expert wrong is ~1/E of the tensor
        if name in got.grads and _is_stacked_experts(name, ref.grads[name]):
            counts = tokens.get(_router_of(name))
            for expert, (g, e) in enumerate(zip(got.grads[name], ref.grads[name])):
                n = None if counts is None else int(counts[expert])
                metrics = {"slice_cos": compare.cosine(g, e), "slice_norm_ratio": compare.norm_ratio(g, e)}
                if n is not None:
                    metrics["tokens"] = n
                rows.append(Row(kernels, dtype, "grad", expert_row_name(name, expert), metrics,
                                tolerances.expert_bounds(dtype, n)))
    if all(n in got.grads for n in names):
        rows.append(Row(kernels, dtype, "grad", GRAD_VECTOR, compare.tensor_metrics(flat(got.grads), flat(ref.grads)),
                        tol("grad_vector")))
    rows.append(Row(kernels, dtype, "grad", GRAD_NORM, compare.tensor_metrics(got.grad_norm, ref.grad_norm),
                    tol("grad_norm")))
    # Entries the gradient does not decide (rounding zeros, entries inside the two runs' gradient
    # difference: tolerances.decided_entries) are left out of both post-step checks.
    decided = {name: tolerances.decided_entries(ref.grads.get(name), got.grads.get(name) if dtype == "float32" else None)
               for name in names}
    for name in names:
        if name in got.params_after:
            keep = decided[name]
            # float64 once: tensor_metrics and update_metrics both read these
            pick = (lambda a: compare.as_float64(a)) if keep is None else (lambda a: compare.as_float64(a)[keep])
            got_after, ref_after = pick(got.params_after[name]), pick(ref.params_after[name])
            metrics = compare.tensor_metrics(got_after, ref_after)
            metrics.update(compare.update_metrics(got_after, ref_after, pick(before[name])))
            if keep is not None:
                metrics["rounding_zero_entries"] = int((~keep).sum())
            rows.append(Row(kernels, dtype, "param", name, metrics, tol("param")))
        else:
            rows.append(Row(kernels, dtype, "param", name, bounds=tol("param"), status=FAIL,
                            message="no parameter in the lowered run"))
    if all(n in got.params_after for n in names):
        keep_all = np.concatenate([np.ones(np.size(ref.params_after[n]), bool) if decided[n] is None
                                   else decided[n].ravel() for n in names])
        got_all, ref_all, before_all = (flat(d)[keep_all] for d in (got.params_after, ref.params_after, before))
        metrics = compare.tensor_metrics(got_all, ref_all)
        metrics.update(compare.update_metrics(got_all, ref_all, before_all))
        if not keep_all.all():
            metrics["rounding_zero_entries"] = int((~keep_all).sum())
        rows.append(Row(kernels, dtype, "param", VECTOR, metrics, tol("param_vector")))
    if len(got.routing) != len(router_names) or len(ref.routing) != len(router_names):
        rows.append(Row(kernels, dtype, "routing", "routers", bounds=tol("routing"), status=FAIL,
                        message=f"captured {len(got.routing)} lowered / {len(ref.routing)} eager router calls, "
                                f"expected {len(router_names)}"))
    else:
        for name, (g_logits, g_experts), (e_logits, e_experts) in zip(router_names, got.routing, ref.routing):
            rows.append(Row(kernels, dtype, "routing", name,
                            compare.routing_metrics(g_experts, e_experts, g_logits, e_logits), tol("routing")))
    return rows
