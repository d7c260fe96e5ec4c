"""A nanoGPT-style causal language model in plain PyTorch, written the way a researcher writes one.

Nothing here knows torchlyra: it is the kind of `model.py` that `torchlyra train --module
examples/gpt.py:GPT` trains. Pre-norm blocks of grouped-query attention (rotary positions,
`F.scaled_dot_product_attention` with `is_causal=True`) and a SwiGLU MLP, or, with `n_experts`
> 0, a top-k mixture of SwiGLU experts held as 3-D weight stacks and computed with
`torch._grouped_mm` (as torchtitan's MoE does). `forward(tokens [B, T]) -> logits [B, T, V]`.

    model = GPT(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=2)
    logits = model(torch.randint(0, 4096, (2, 64)))

It also follows the decode cache protocol of docs/own-model.md (`init_cache`, `forward_cached`: a
KV cache per block), which gives `torchlyra generate` the compiled decode loop; without those two
methods it would recompute each row's tokens every step.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_tables(length: int, head_dim: int, base: float = 10000.0):
    """cos and sin [length, head_dim / 2] of the rotary position embedding."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotary embedding of x [B, H, T, D] (halves rotated), tables [T, D / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def _qkv(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(self, x, cos, sin):
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).flatten(2))

    def forward_cached(self, x, cos, sin, slots, k_cache, v_cache, mask):
        """x's keys and values written into the caches [B, kv_heads, L, D] at `slots` [B, T] (L: a
        token not to keep), then attention over the cache under `mask` [B, T, L]."""
        q, k, v = self._qkv(x, cos, sin)
        index = slots[:, None, :, None].expand(-1, self.n_kv_heads, -1, self.head_dim)
        k_cache, v_cache = (torch.cat([c, c[:, :, :1]], 2).scatter(2, index, new)[:, :, :-1]
                            for c, new in ((k_cache, k.to(k_cache.dtype)), (v_cache, v.to(v_cache.dtype))))
        out = F.scaled_dot_product_attention(q, k_cache.to(q.dtype), v_cache.to(q.dtype), attn_mask=mask[:, None],
                                             enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).flatten(2)), k_cache, v_cache


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    """Top-k routing over E SwiGLU experts stored as [E, dim, hidden] and [E, hidden, dim] stacks:
    each token's k copies are sorted by expert and multiplied group by group (`torch._grouped_mm`,
    whose CPU kernel wants every row length a multiple of 16 bytes)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.randn(n_experts, dim, hidden) * dim ** -0.5)
        self.w_up = nn.Parameter(torch.randn(n_experts, dim, hidden) * dim ** -0.5)
        self.w_down = nn.Parameter(torch.randn(n_experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x):
        b, t, dim = x.shape
        rows = x.reshape(-1, dim)
        scores, chosen = torch.topk(self.router(rows).float(), self.top_k, dim=-1)     # [N, k]
        weights = torch.softmax(scores, dim=-1).to(x.dtype)
        experts = chosen.reshape(-1)
        order = torch.argsort(experts, stable=True)
        counts = F.one_hot(experts, self.w_gate.shape[0]).sum(0)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        sorted_rows = rows[order // self.top_k]
        hidden = F.silu(torch._grouped_mm(sorted_rows, self.w_gate, offs=offsets)) * \
            torch._grouped_mm(sorted_rows, self.w_up, offs=offsets)
        out = torch._grouped_mm(hidden, self.w_down, offs=offsets)
        out = out[torch.argsort(order)].view(-1, self.top_k, dim)
        return (out * weights.unsqueeze(-1)).sum(1).view(b, t, dim)


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.attention_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.mlp = MoE(dim, hidden, n_experts, top_k) if n_experts else MLP(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x, cos, sin, slots, k_cache, v_cache, mask):
        out, k_cache, v_cache = self.attention.forward_cached(self.attention_norm(x), cos, sin, slots, k_cache, v_cache,
                                                              mask)
        x = x + out
        return x + self.mlp(self.mlp_norm(x)), k_cache, v_cache


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 4096, dim: int = 256, n_layers: int = 4, n_heads: int = 8,
                 n_kv_heads: int = 2, hidden: int | None = None, max_seq_len: int = 2048, tie_embeddings: bool = False,
                 n_experts: int = 0, top_k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, n_kv_heads, hidden or 4 * dim * 2 // 3 // 16 * 16,
                                          n_experts, top_k) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(max_seq_len, dim // n_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2 and "norm" not in name:
                nn.init.normal_(p, std=0.02 / (2 * n_layers) ** 0.5 if name.endswith(("wo.weight", "w_down.weight"))
                                else 0.02)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.cos[:t], self.sin[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    # ---- the decode cache protocol (docs/own-model.md) ----------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype=torch.float32, device=None):
        """(which slots hold a token [B, L], then each block's keys and values [B, kv_heads, L, D])."""
        attention = self.blocks[0].attention
        shape = (batch, attention.n_kv_heads, max_len, attention.head_dim)
        kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * len(self.blocks))]
        return (torch.zeros((batch, max_len), dtype=torch.bool, device=device), *kv)

    def forward_cached(self, tokens, positions, cache):
        """Logits [B, T, V] of new tokens at `positions` [B, T] (-1: padding, neither kept nor
        attended to), each attending to its row's kept tokens up to its position; the cache with
        them kept."""
        filled, kv = cache[0], list(cache[1:])
        length = filled.shape[1]
        slots = torch.where(positions >= 0, positions, torch.full_like(positions, length)).long()
        filled = torch.cat([filled, filled[:, :1]], 1).scatter(1, slots, torch.ones_like(slots, dtype=torch.bool))
        filled = filled[:, :length]
        at = positions.clamp(min=0).long()
        mask = filled[:, None, :] & (torch.arange(length, device=tokens.device)[None, None, :] <= at[:, :, None])
        mask = mask | ~mask.any(-1, keepdim=True)        # a padding token attends to anything: never NaN
        cos, sin = self.cos[at][:, None], self.sin[at][:, None]             # [B, 1, T, D / 2]
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x, kv[2 * i], kv[2 * i + 1] = block.forward_cached(x, cos, sin, slots, kv[2 * i], kv[2 * i + 1], mask)
        return self.head(self.norm(x)), (filled, *kv)
