"""The hot operations as named PyTorch custom ops, each with an eager reference.

The model calls only these ops for attention, the LM-head cross-entropy and the expert MLPs.
Eagerly on CPU they run the references below (the ground truth); under torchax the bridge
overrides each op with the JAX implementation chosen in the op registry
(`jax_bridge/registry.py`), so fast paths enter the model only through these names.

Backward passes of the references recompute the forward under autograd: simple and exact, and
only ever used by eager PyTorch.
"""
from __future__ import annotations

import torch

NAMESPACE = "torchlyra"
# A sink logit that adds exactly nothing (attention without sinks): exp(NO_SINK - max) underflows to 0
# in float32 and bf16, without the inf - inf of a -inf sink.
NO_SINK = -1e30


# ---------------------------------------------------------------------------------------------
# Reference math (plain torch, differentiable)
# ---------------------------------------------------------------------------------------------
def attention_reference(q, k, v, sinks, sliding_window: int, scale: float, segment_ids=None):
    """Causal GQA attention with one learned sink logit per query head.

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, Tk, D] with Tk >= Tq (queries are the last Tq positions);
    sinks: [Hq]. sliding_window W > 0 lets query i see keys i-W+1..i; 0 means all keys <= i.
    segment_ids: None, or integer [B, T] (Tq == Tk): query i sees key j only when their ids are
    equal (conversations packed into one row stay apart; padding is one more id).
    The sink joins each score row before the softmax and is dropped after (GPT-OSS).
    """
    tq, tk = q.shape[2], k.shape[2]
    qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    visible = _visible(qpos, kpos, sliding_window)
    if segment_ids is not None:
        if tq != tk or tuple(segment_ids.shape) != (q.shape[0], tq):
            raise ValueError(f"attention: segment_ids must be [B, T] = [{q.shape[0]}, {tq}] with Tq == Tk; "
                             f"got {tuple(segment_ids.shape)} (Tk={tk})")
        visible = visible & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return _attend_with_sinks(q, k, v, sinks, visible, scale)


def cached_attention_reference(q, k, v, sinks, q_positions, k_positions, sliding_window: int, scale: float):
    """Attention of new queries over a KV cache, each row with its own positions.

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, S, D] (cache slots, in any order); q_positions: [B, Tq] and
    k_positions: [B, S] integer token positions, -1 for an empty slot or padding (never seen).
    Key j is visible to query i when 0 <= k_pos[j] <= q_pos[i] and, with W > 0,
    k_pos[j] > q_pos[i] - W: the causal/sliding rule of `attention_reference`, by position.
    """
    qpos, kpos = q_positions[:, None, :, None], k_positions[:, None, None, :]
    visible = _visible(qpos, kpos, sliding_window) & (kpos >= 0)
    return _attend_with_sinks(q, k, v, sinks, visible, scale)


def _visible(qpos, kpos, sliding_window: int):
    visible = kpos <= qpos
    if sliding_window > 0:
        visible = visible & (kpos > qpos - sliding_window)
    return visible


def _attend_with_sinks(q, k, v, sinks, visible, scale: float):
    """softmax([q.k * scale masked by `visible`, sink]) @ v, dropping the sink column."""
    b, hq, tq, _ = q.shape
    hkv = k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink_col = sinks.float().view(1, hq, 1, 1).expand(b, hq, tq, 1)
    combined = torch.cat([scores, sink_col], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def linear_cross_entropy_reference(hidden, weight, labels, ignore_index: int):
    """Per-token negative log-likelihood and log-sum-exp of `hidden @ weight.T`.

    hidden: [N, H]; weight: [V, H]; labels: [N] (ignore_index marks tokens without a target).
    Returns (nll [N], lse [N]) in float32, both 0 at ignored tokens. The z-loss is a function
    of lse, so the op never has to hand logits back.
    """
    logits = torch.matmul(hidden.float(), weight.float().t())
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    target = logits.gather(1, safe[:, None])[:, 0]
    zero = torch.zeros_like(lse)
    return torch.where(valid, lse - target, zero), torch.where(valid, lse, zero)


def clamped_swiglu(gate_up, alpha: float, limit: float, up_shift: float = 1.0):
    """The experts' activation, gate/up interleaved in the last dim, both clamped:
    (clip(up, +-limit) + up_shift) * g * sigmoid(alpha * g), g = min(gate, limit). GPT-OSS:
    alpha 1.702, limit 7, up_shift 1; SwiGLU (silu(gate) * up): alpha 1, limit inf, up_shift 0."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + up_shift) * (gate * torch.sigmoid(alpha * gate))


def moe_experts_reference(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha: float, limit: float,
                          up_shift: float = 1.0):
    """Grouped expert MLP: rows of x are sorted by expert, group_sizes[e] rows go to expert e.

    x: [M, H]; group_sizes: [E] (sum == M); gate_up: [E, H, 2I]; gate_up_bias: [E, 2I];
    down: [E, I, H]; down_bias: [E, H]. Each expert computes only its own rows.
    """
    outputs = []
    start = 0
    for e, n in enumerate(group_sizes.tolist()):
        if n:
            rows = x[start:start + n]
            h = clamped_swiglu(rows @ gate_up[e] + gate_up_bias[e], alpha, limit, up_shift)
            outputs.append(h @ down[e] + down_bias[e])
        start += n
    if start != x.shape[0]:
        raise ValueError(f"moe_experts: group sizes sum to {start}, but x has {x.shape[0]} rows")
    return torch.cat(outputs) if outputs else x.new_zeros(x.shape)


def routed_experts_reference(x, experts, weights, gate_up, gate_up_bias, down, down_bias, alpha: float, limit: float,
                             up_shift: float = 1.0):
    """Dropless top-k expert MLP of token rows: out[n] = sum_j weights[n, j] * expert_{experts[n, j]}(x[n]).

    x: [N, H]; experts: [N, k] chosen expert ids; weights: [N, k] mixing weights. The k copies
    of each row are grouped by expert (a stable sort), each expert computes only its own rows
    (`moe_experts_reference`), and the results return to token order (a gather) to be mixed.
    Keeping the grouping inside the op lets the bridge do it per device under sharding.
    """
    n, k = experts.shape
    chosen = experts.reshape(-1)                                 # [N*k], token-major
    order = torch.argsort(chosen, stable=True)                   # rows grouped by expert
    group_sizes = torch.bincount(chosen, minlength=gate_up.shape[0])
    out_sorted = moe_experts_reference(x[order // k], group_sizes, gate_up, gate_up_bias, down, down_bias,
                                       alpha, limit, up_shift)
    out = out_sorted[torch.argsort(order)].view(n, k, -1)        # back to token order
    return (out * weights.unsqueeze(-1)).sum(1)


# E2M1 values of the 16 MXFP4 codes (bit 3 the sign), as formats/mxfp4.py's host codec has them.
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_decode(blocks, scales):
    """MXFP4 bytes [..., K/2] (two E2M1 codes per byte, low nibble first) and scale bytes
    [..., K/32] (2**(byte - 127) per 32 values) -> float32 [..., K], exactly (torch on CPU keeps
    the subnormals that scale bytes 0-1 give)."""
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()                # [..., K/2, 2]
    values = table[codes].reshape(*blocks.shape[:-1], -1, 32)                       # [..., K/32, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(*blocks.shape[:-1], -1)


def routed_experts_mxfp4_reference(x, experts, weights, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks,
                                   down_scales, down_bias, alpha: float, limit: float, up_shift: float = 1.0):
    """routed_experts_reference with frozen MXFP4 expert stacks in the released orientation:
    gate_up_blocks [E, 2I, H/2] and scales [E, 2I, H/32] (gate_up transposed, gate/up
    interleaved along 2I), down_blocks [E, H, I/2] and scales [E, H, I/32]; biases [E, 2I] and
    [E, H]. Decoded to x's dtype (exact in bf16 and float32), then the same computation."""
    gate_up = mxfp4_decode(gate_up_blocks, gate_up_scales).transpose(1, 2).to(x.dtype)
    down = mxfp4_decode(down_blocks, down_scales).transpose(1, 2).to(x.dtype)
    return routed_experts_reference(x, experts, weights, gate_up, gate_up_bias.detach(), down, down_bias.detach(),
                                    alpha, limit, up_shift)


# ---------------------------------------------------------------------------------------------
# Custom ops: forward = reference, backward = autograd through the recomputed reference
# ---------------------------------------------------------------------------------------------
def _register_recompute_backward(op, reference, n_tensor_inputs: int, differentiable: tuple[int, ...]):
    """Autograd formula for a custom op whose first n inputs are tensors: re-run the reference
    with grad enabled and take the vector-Jacobian product for the differentiable inputs."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n_tensor_inputs])
        ctx.static = inputs[n_tensor_inputs:]

    def backward(ctx, *grad_outputs):
        saved = list(ctx.saved_tensors)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(i in differentiable) for i, t in enumerate(saved)]
            out = reference(*leaves, *ctx.static)
            outs = out if isinstance(out, tuple) else (out,)
            wrt = [leaves[i] for i in differentiable]
            pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
            grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        result = [None] * (n_tensor_inputs + len(ctx.static))
        for i, g in zip(differentiable, grads):
            result[i] = g if g is not None else torch.zeros_like(saved[i])
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)


@torch.library.custom_op(f"{NAMESPACE}::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
              sliding_window: int, scale: float, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    return attention_reference(q, k, v, sinks, sliding_window, scale, segment_ids)


@attention.register_fake
def _(q, k, v, sinks, sliding_window, scale, segment_ids=None):
    return torch.empty_like(q)


_register_recompute_backward(attention, attention_reference, 4, (0, 1, 2, 3))


@torch.library.custom_op(f"{NAMESPACE}::cached_attention", mutates_args=())
def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                     q_positions: torch.Tensor, k_positions: torch.Tensor, sliding_window: int,
                     scale: float) -> torch.Tensor:
    return cached_attention_reference(q, k, v, sinks, q_positions, k_positions, sliding_window, scale)


@cached_attention.register_fake
def _(q, k, v, sinks, q_positions, k_positions, sliding_window, scale):
    return torch.empty_like(q)


@torch.library.custom_op(f"{NAMESPACE}::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_cross_entropy_reference(hidden, weight, labels, ignore_index)


@linear_cross_entropy.register_fake
def _(hidden, weight, labels, ignore_index):
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)


_register_recompute_backward(linear_cross_entropy, linear_cross_entropy_reference, 3, (0, 1))


@torch.library.custom_op(f"{NAMESPACE}::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                   limit: float, up_shift: float = 1.0) -> torch.Tensor:
    return routed_experts_reference(x, experts, weights, gate_up, gate_up_bias, down, down_bias, alpha, limit,
                                    up_shift)


@routed_experts.register_fake
def _(x, experts, weights, gate_up, gate_up_bias, down, down_bias, alpha, limit, up_shift=1.0):
    return torch.empty_like(x)


_register_recompute_backward(routed_experts, routed_experts_reference, 7, (0, 2, 3, 4, 5, 6))

@torch.library.custom_op(f"{NAMESPACE}::routed_experts_mxfp4", mutates_args=())
def routed_experts_mxfp4(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_blocks: torch.Tensor,
                         gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor, down_blocks: torch.Tensor,
                         down_scales: torch.Tensor, down_bias: torch.Tensor, alpha: float, limit: float,
                         up_shift: float = 1.0) -> torch.Tensor:
    return routed_experts_mxfp4_reference(x, experts, weights, gate_up_blocks, gate_up_scales, gate_up_bias,
                                          down_blocks, down_scales, down_bias, alpha, limit, up_shift)


@routed_experts_mxfp4.register_fake
def _(x, experts, weights, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias, alpha,
      limit, up_shift=1.0):
    return torch.empty_like(x)


# The MXFP4 stacks are a frozen base: gradients reach the rows and the routing weights only.
_register_recompute_backward(routed_experts_mxfp4, routed_experts_mxfp4_reference, 9, (0, 2))

# The op objects the model calls (torch.ops.torchlyra.<name>): one name per hot operation.
OPS = {
    "attention": torch.ops.torchlyra.attention,
    "cross_entropy": torch.ops.torchlyra.linear_cross_entropy,
    "moe": torch.ops.torchlyra.routed_experts,
    "moe_mxfp4": torch.ops.torchlyra.routed_experts_mxfp4,   # experts held as MXFP4 (a frozen base)
    "cached_attention": torch.ops.torchlyra.cached_attention,   # generation with a KV cache
}
