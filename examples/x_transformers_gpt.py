"""x-transformers' decoder-only language model (lucidrains/x-transformers, a published pure-PyTorch
implementation) as `torchlyra train --module` takes it: a function of JSON arguments that builds
the `TransformerWrapper`, whose forward(tokens) returns the logits. `attn_flash=True` makes its
attention call `F.scaled_dot_product_attention` (the default writes it out with einsums)."""
from x_transformers import Decoder, TransformerWrapper


def gpt(vocab_size: int = 4096, dim: int = 256, depth: int = 4, heads: int = 8, kv_heads: int = 2,
        max_seq_len: int = 2048):
    return TransformerWrapper(num_tokens=vocab_size, max_seq_len=max_seq_len, attn_layers=Decoder(
        dim=dim, depth=depth, heads=heads, attn_kv_heads=kv_heads, attn_dim_head=dim // heads, attn_flash=True,
        rotary_pos_emb=True, use_rmsnorm=True, ff_glu=True, ff_swish=True))
