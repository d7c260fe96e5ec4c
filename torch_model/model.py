"""GPT-OSS decoder in plain torch.nn, with Hugging Face `GptOssForCausalLM` names and layouts.

Read it like the paper: RMSNorm -> GQA attention with sinks (sliding or full) -> residual ->
RMSNorm -> top-k MoE of clamped-SwiGLU experts -> residual. The three hot operations are
called through `torch.ops.torchlyra.*` (see ops.py), the only door for fast paths.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_model import kv_cache, ops
from torch_model.causal_lm import PAD_SEGMENT, CausalLMHead
from torch_model.config import ModelConfig
from torch_model.rope import apply_rope, rope_cos_sin

class RMSNorm(nn.Module):
    """Normalizes in float32 and returns the input dtype (as GptOssRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.sliding_window = cfg.window_of_layer(layer)
        self.q_proj = nn.Linear(d, cfg.n_heads * hd)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads))

    def forward(self, x, cos, sin, segment_ids=None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Segment ids only when given: an implementation without them still serves unpacked runs.
        segments = () if segment_ids is None else (segment_ids,)
        out = ops.OPS["attention"](q, k, v, self.sinks.to(q.dtype), self.sliding_window, self.head_dim ** -0.5,
                                   *segments)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward_cached(self, x, cos, sin, keys, values, positions, slot_positions, new_slot_positions, start):
        """Attention of T new tokens (positions [B, T]) over this layer's cache; `start` is the
        sequence index of the first new token. Returns (out, keys, values) with the new keys and
        values written; slot_positions / new_slot_positions: the cache's positions before / after."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_all, v_all, k_pos, new_keys, new_values = kv_cache.attend_keys(
            keys, values, k, v, start, positions, slot_positions, new_slot_positions, self.sliding_window)
        out = ops.OPS["cached_attention"](q, k_all, v_all, self.sinks.to(q.dtype), positions, k_pos,
                                          self.sliding_window, self.head_dim ** -0.5)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        return out, new_keys, new_values


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.weight = nn.Parameter(torch.zeros(cfg.n_experts, cfg.d_model))
        self.bias = nn.Parameter(torch.zeros(cfg.n_experts))

    def forward(self, x):
        # float32 whatever the compute dtype (causal_lm.FLOAT32_PARAMETERS); the caller casts the weights back.
        logits = F.linear(x.float(), self.weight.float(), self.bias.float())     # [N, E]
        top_logits, experts = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1)               # softmax over the k chosen
        return logits, weights, experts


class Experts(nn.Module):
    """E expert MLPs stored as HF does: x @ W (not W @ x), gate/up interleaved in the last dim."""

    is_transposed = True    # as transformers' GptOssExperts: peft shapes expert adapters [in, out] from it

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, i = cfg.n_experts, cfg.d_model, cfg.expert_dim
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, d, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, d))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, d))

    def forward(self, x, experts, weights):
        """x [N, H]; experts, weights [N, k]: each row through its k experts, mixed by weight."""
        return ops.OPS["moe"](x, experts, weights, self.gate_up_proj, self.gate_up_proj_bias,
                              self.down_proj, self.down_proj_bias, self.alpha, self.limit)


class Mxfp4Experts(nn.Module):
    """The experts of a frozen base kept as gpt-oss releases them, MXFP4 (4.25 bits per weight),
    for LoRA and inference: the released `*_blocks` bytes viewed as [E, out, in/2] uint8 and
    `*_scales` [E, out, in/32] uint8 (transformers' [E, in, out] stacks transposed, gate/up
    interleaved along 2I), the biases as in `Experts`. Every tensor is frozen (`requires_grad`
    False): the op decodes them (exactly) and gives gradients to the rows and routing weights
    only. `Experts.to_mxfp4`-style conversion lives with the codec (formats/mxfp4.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, i = cfg.n_experts, cfg.d_model, cfg.expert_dim
        if d % 32 or i % 32:
            raise ValueError(f"MXFP4 experts need d_model and expert_dim to be multiples of 32 (blocks of 32 "
                             f"values); found {d} and {i}")
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        frozen = lambda *shape, dtype=torch.uint8: nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)
        self.gate_up_proj_blocks = frozen(e, 2 * i, d // 2)
        self.gate_up_proj_scales = frozen(e, 2 * i, d // 32)
        self.gate_up_proj_bias = frozen(e, 2 * i, dtype=torch.float32)
        self.down_proj_blocks = frozen(e, d, i // 2)
        self.down_proj_scales = frozen(e, d, i // 32)
        self.down_proj_bias = frozen(e, d, dtype=torch.float32)

    def forward(self, x, experts, weights):
        return ops.OPS["moe_mxfp4"](x, experts, weights, self.gate_up_proj_blocks, self.gate_up_proj_scales,
                                    self.gate_up_proj_bias.to(x.dtype), self.down_proj_blocks, self.down_proj_scales,
                                    self.down_proj_bias.to(x.dtype), self.alpha, self.limit)


def replace_modules(model: nn.Module, kind: type, build) -> int:
    """Every submodule of type `kind` replaced in place by build(module, its dotted name);
    returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, child_name, build(child, f"{name}.{child_name}" if name else child_name))
                count += 1
    return count


def mxfp4_expert_modules(model: nn.Module) -> int:
    """Every `Experts` of the model replaced by an empty `Mxfp4Experts` of its shape (on the
    current device: `meta` for plans and loaders, which fill or only trace them); returns how many."""
    return replace_modules(model, Experts, lambda experts, where: Mxfp4Experts(model.cfg))


def has_mxfp4_experts(model: nn.Module) -> bool:
    """Whether the model's programs call the `moe_mxfp4` op (its experts are an MXFP4 base)."""
    return any(isinstance(m, Mxfp4Experts) for m in model.modules())


class MoE(nn.Module):
    """Dropless top-k MoE: the router picks k experts per token, the expert op runs each token
    through its experts only (grouped by expert inside the op) and mixes them by the weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x, real=None):
        """real: None, or [B, T] bool, False on padding (left out of the router statistics)."""
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        logits, weights, experts = self.router(flat)
        out = self.experts(flat, experts, weights.to(x.dtype))
        if real is None:
            group_sizes = F.one_hot(experts.reshape(-1), self.n_experts).sum(0)      # [E], static shape
            stats = router_stats(logits, group_sizes, self.n_experts, self.top_k)
        else:
            mask = real.reshape(-1)
            chosen = F.one_hot(experts, self.n_experts).sum(1) * mask[:, None]     # [N, E], padding rows 0
            stats = router_stats(logits, chosen.sum(0), self.n_experts, self.top_k, mask)
        return out.view(b, t, d), stats


def router_stats(logits, group_sizes, n_experts: int, top_k: int, real=None):
    """Switch-style load-balancing loss E * sum_e f_e * P_e, router z-loss, and the per-expert
    token fractions f_e (for metrics). real: None, or [N] bool: the statistics (means over
    tokens) are over the real tokens only; group_sizes must then count real tokens only."""
    probs = torch.softmax(logits.float(), dim=-1)
    fraction = group_sizes.float() / group_sizes.sum().clamp(min=1)
    lse_sq = torch.logsumexp(logits.float(), dim=-1).pow(2)
    if real is None:
        mean_probs, z = probs.mean(0), lse_sq.mean()
    else:
        w = real.float()
        n = w.sum().clamp(min=1)
        mean_probs, z = (probs * w[:, None]).sum(0) / n, (lse_sq * w).sum() / n
    balance = n_experts * (fraction * mean_probs).sum()
    return {"balance": balance, "z": z, "fraction": fraction}


class DenseMLP(nn.Module):
    """The `dense` preset's MLP: one clamped-SwiGLU expert applied to every token (exported to
    Hugging Face as a one-expert GptOss layer)."""

    is_transposed = True    # weights applied as x @ W ([in, out]), in transformers' flag (the optimizer reads it)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, i = cfg.d_model, cfg.dense_dim
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(d, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(2 * i))
        self.down_proj = nn.Parameter(torch.zeros(i, d))
        self.down_proj_bias = nn.Parameter(torch.zeros(d))

    def forward(self, x, real=None):
        h = ops.clamped_swiglu(x @ self.gate_up_proj + self.gate_up_proj_bias, self.alpha, self.limit)
        return h @ self.down_proj + self.down_proj_bias, None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe else DenseMLP(cfg)

    def forward(self, x, cos, sin, segment_ids=None):
        """segment_ids [B, T] (packed rows): attention within equal ids; id PAD_SEGMENT (0) marks
        padding, left out of the router's statistics."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids)
        real = None if segment_ids is None else segment_ids != PAD_SEGMENT
        out, stats = self.mlp(self.post_attention_layernorm(x), real)
        return x + out, stats

    def forward_cached(self, x, cos, sin, *cache_args):
        attn, keys, values = self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, *cache_args)
        x = x + attn
        out, _ = self.mlp(self.post_attention_layernorm(x))
        return x + out, keys, values


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)

    def forward(self, input_ids, start_position: int = 0, positions=None, segment_ids=None):
        """positions: None (0.. per row, from start_position) or [B, T] per-row RoPE positions
        (packed rows restart them at each conversation); segment_ids [B, T]: attention stays
        within equal ids."""
        x = self.embed_tokens(input_ids)
        if positions is None:
            positions = torch.arange(start_position, start_position + input_ids.shape[1], device=input_ids.device)
            cos, sin = rope_cos_sin(self.cfg, positions, x.dtype)
        else:
            b, t = input_ids.shape
            cos, sin = rope_cos_sin(self.cfg, positions.reshape(-1), x.dtype)
            cos, sin = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)
        x, stats = self.run_layers(x, cos, sin) if segment_ids is None else self.run_layers(x, cos, sin, segment_ids)
        return self.norm(x), stats

    def run_layers(self, x, cos, sin, segment_ids=None):
        """The decoder stack, one layer after another; returns (x, per-layer router stats).
        (The JAX bridge may run this same stack as one scan over stacked layer weights.)"""
        stats = []
        segments = () if segment_ids is None else (segment_ids,)
        for layer in self.layers:
            x, layer_stats = self.call_layer(layer, x, cos, sin, *segments)
            stats.append(layer_stats)
        return x, stats

    @staticmethod
    def call_layer(layer, x, cos, sin, *segments):
        """One decoder layer: (x, router stats). The bridge calls it on each layer's parameters."""
        return layer(x, cos, sin, *segments)

    def forward_cached(self, input_ids, positions, cache: kv_cache.KVCache, start):
        """Hidden states of T new tokens [B, T] at per-row `positions` [B, T] (EMPTY for padding),
        written into `cache` at sequence index `start` onward; returns (hidden, updated cache)."""
        b, t = input_ids.shape
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.cfg, positions.clamp(min=0).reshape(-1), x.dtype)
        cos, sin = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)
        full, sliding = kv_cache.write_positions(cache, positions, start)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            before, after = (cache.sliding_positions, sliding) if layer.self_attn.sliding_window else (
                cache.full_positions, full)
            x, k, v = layer.forward_cached(x, cos, sin, cache.keys[i], cache.values[i], positions, before, after, start)
            keys.append(k)
            values.append(v)
        return self.norm(x), kv_cache.KVCache(tuple(keys), tuple(values), full, sliding)


class GptOssForCausalLM(CausalLMHead, nn.Module):
    """The language model. `forward(ids)` returns logits; `forward(ids, labels)` returns the
    training loss and its parts without ever forming [tokens, vocab] logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def routers(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of each MoE layer's router, in layer order; each returns (logits,
        weights, chosen experts)."""
        return [(f"model.layers.{i}.mlp.router", layer.mlp.router)
                for i, layer in enumerate(self.model.layers) if hasattr(layer.mlp, "router")]

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None):
        """Initialization as transformers' GptOss: normal(0, initializer_range) for matrices,
        embeddings, sinks and router; zeros for biases; ones for norms."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias") and "router" not in name:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
