"""Model configuration: one typed dataclass and the named presets.

The fields mirror Hugging Face's `GptOssConfig` so every preset can be exported as-is; the
mapping of names lives in `formats/hf_mapping.py`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    # Sliding-window layers alternate with full causal ones, starting with sliding (as GPT-OSS).
    sliding_window: int = 64
    layer_types: tuple[str, ...] | None = None
    # Mixture of experts. n_experts == 0 means a dense SwiGLU MLP (the `dense` preset).
    n_experts: int = 8
    experts_per_token: int = 2
    expert_dim: int = 256          # GptOssConfig.intermediate_size
    dense_dim: int = 1024          # hidden size of the dense MLP when n_experts == 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.0   # load-balancing loss (Switch style); Lyra uses 1e-2
    router_z_loss_coef: float = 0.0     # router logit z-loss; Lyra uses 1e-4
    lm_z_loss_coef: float = 0.0         # z-loss on the LM head's log-sum-exp
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    # YaRN, as GptOssConfig defaults (factor 32 over an original context of 4096).
    rope_scaling_factor: float = 32.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_original_max_position: int = 4096
    max_position_embeddings: int = 131072
    max_seq_len: int = 256          # default training sequence length for this preset
    initializer_range: float = 0.02
    bos_token_id: int = 0
    eos_token_id: int = 0

    def __post_init__(self):
        positive = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, found {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE, found {self.head_dim}")
        if self.sliding_window < 0:
            raise ConfigError(f"ModelConfig.sliding_window must be >= 0, found {self.sliding_window}")
        if self.n_experts < 0 or (self.n_experts and not 0 < self.experts_per_token <= self.n_experts):
            raise ConfigError(f"ModelConfig.experts_per_token must be in 1..n_experts ({self.n_experts}), "
                              f"found {self.experts_per_token}")
        if self.layer_types is None:
            kinds = tuple("sliding_attention" if i % 2 == 0 and self.sliding_window else "full_attention"
                          for i in range(self.n_layers))
            object.__setattr__(self, "layer_types", kinds)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.n_layers:
            raise ConfigError(f"ModelConfig.layer_types has {len(self.layer_types)} entries, expected n_layers={self.n_layers}")
        for kind in self.layer_types:
            if kind not in ("sliding_attention", "full_attention"):
                raise ConfigError(f"ModelConfig.layer_types: unknown layer type {kind!r}")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def window_of_layer(self, i: int) -> int:
        """Keys visible to a query in layer i: 0 means all previous (full causal)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else 0

    def replace(self, **changes) -> "ModelConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        if "layer_types" not in changes and {"n_layers", "sliding_window"} & set(changes):
            changes["layer_types"] = None      # re-derive the alternating pattern
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    # ---- parameter counts -------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Total and active (per token) parameter counts, biases and norms included."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.n_heads * hd + self.n_heads * hd          # q
        attn += 2 * (d * self.n_kv_heads * hd + self.n_kv_heads * hd)  # k, v
        attn += self.n_heads * hd * d + d + self.n_heads          # o + sinks
        norms = 2 * d
        if self.is_moe:
            one_expert = d * 2 * self.expert_dim + 2 * self.expert_dim + self.expert_dim * d + d
            router = self.n_experts * d + self.n_experts
            mlp_total = router + self.n_experts * one_expert
            mlp_active = router + self.experts_per_token * one_expert
        else:
            mlp_total = mlp_active = d * 2 * self.dense_dim + 2 * self.dense_dim + self.dense_dim * d + d
        embed = self.vocab_size * d
        head = self.vocab_size * d
        total = embed + head + d + self.n_layers * (attn + norms + mlp_total)
        active = embed + head + d + self.n_layers * (attn + norms + mlp_active)
        return {"total": total, "active": active,
                "active_matmul": head + self.n_layers * (attn + mlp_active - (router if self.is_moe else 0))}


PRESETS: dict[str, ModelConfig] = {
    # CPU default: ~9M parameters with MoE, trains in minutes on two cores. A small load-balancing
    # loss keeps its routing from collapsing onto a few experts.
    "tiny": ModelConfig(router_aux_loss_coef=1e-2),
    # Same shape, dense MLP of the same active width (2 experts x 256), for like-for-like runs.
    "dense": ModelConfig(n_experts=0, experts_per_token=0, dense_dim=512),
    # The step benchmark's d_model >= 512 MoE preset (`bench step`), big enough for the matmuls to
    # matter: ~55M parameters (~21M active), the bundled 4,096-token vocabulary so the embedding does
    # not dominate on CPU. `small-o200k` is the same body with the o200k_harmony vocabulary, for
    # accelerators (scripts/gpu_bench.py).
    "small": ModelConfig(d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64, sliding_window=128,
                         n_experts=8, experts_per_token=2, expert_dim=1024, router_aux_loss_coef=1e-2),
    "small-o200k": ModelConfig(vocab_size=201088, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64,
                               sliding_window=128, n_experts=8, experts_per_token=2, expert_dim=1024,
                               max_seq_len=1024, bos_token_id=200006, eos_token_id=200007,
                               router_aux_loss_coef=1e-2),
    # Lyra Small: seq 4096, d 2048, 16 layers, 16/4 heads of 128, window 128 on alternate layers,
    # o200k_harmony vocabulary; 16 experts top-2 of width 384 -> ~1.6B total / ~1.07B active.
    # Documents are marked <|startoftext|> 199998 ... <|endoftext|> 199999 (formats/tokenizer.py);
    # at train time the ids follow the data's manifest anyway.
    "lyra-small": ModelConfig(vocab_size=201088, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=4,
                              head_dim=128, sliding_window=128, n_experts=16, experts_per_token=2,
                              expert_dim=384, max_seq_len=4096, bos_token_id=199998, eos_token_id=199999,
                              router_aux_loss_coef=1e-2, router_z_loss_coef=1e-4),   # Lyra's coefficients
    # The released gpt-oss-20b shape.
    "gpt-oss-20b": ModelConfig(vocab_size=201088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8,
                               head_dim=64, sliding_window=128, n_experts=32, experts_per_token=4,
                               expert_dim=2880, max_seq_len=4096, bos_token_id=199998, eos_token_id=200002),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
