"""Tiny transformers configs of the families the suite trains (tests/test_transformers_models.py,
tests/mesh_worker.py)."""
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

VOCAB = 128
# Tiny copies of the families: Llama with llama3 rope scaling and a tied head; Qwen3 with head_dim
# not hidden / heads, an untied head and sliding layers after full ones (layers from
# max_window_layers on slide; the window is shorter than the rows the tests use); Qwen3-MoE with a
# dense layer between MoE ones (mlp_only_layers), normalised top-k weights and its router loss.
CONFIGS = {
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}),
    "qwen3": lambda: Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5,
        max_window_layers=1, max_position_embeddings=64),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.01,
        tie_word_embeddings=False, max_position_embeddings=64),
}
