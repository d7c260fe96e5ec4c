"""Comparisons only: eager PyTorch against the lowered JAX run per kernel set, ours against
transformers, LoRA against eager peft. Every file format they read or write lives in `formats`."""
