"""The one mapping between our model and Hugging Face transformers' GptOss: config fields,
tensor names and shapes, both directions.

Tensor names and layouts are already the same for MoE models (torch_model/model.py was written
with transformers' names), so the MoE mapping is the identity. The layouts this relies on:
  * experts compute `x @ W[e] + b[e]` (W is [in, out], NOT nn.Linear's [out, in]):
    gate_up_proj [E, H, 2I], down_proj [E, I, H];
  * gate and up are INTERLEAVED in the last dim of gate_up_proj: gate = [..., ::2], up = [..., 1::2];
  * nn.Linear weights (q/k/v/o, router, lm_head) are [out, in] in both.
The `dense` preset (n_experts == 0) has mlp.{gate_up_proj [H,2I], ...} with the same x @ W
orientation and interleave. It is exported as a ONE-expert GptOss layer: expert tensors gain a
leading dim of 1, the router is zeros [1, H] / [1], top-1. Softmax over one logit is exactly 1.0,
so the HF model computes the same function bit for bit in the MLP. A one-expert HF checkpoint
comes back as dense only on request (and only if its router is all zeros, so nothing is lost).
"""
from __future__ import annotations

import torch

from formats.hf_weights import check_quantization
from formats.mxfp4 import BLOCK as MXFP4_BLOCK
from torch_model.config import ModelConfig
from formats.model_checks import config_from_dict, model_shapes
from formats.errors import UserError

# ModelConfig fields exported under config.json "torchlyra" so an import restores them
# (transformers keeps unknown config keys as attributes): training settings, which a foreign
# checkpoint's values (gpt-oss ships router_aux_loss_coef 0.9) must not set, and both MLP widths.
OURS_ONLY = ("max_seq_len", "router_aux_loss_coef", "router_z_loss_coef", "lm_z_loss_coef", "dense_dim", "expert_dim")
DENSE_MLP = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


# ---- config ---------------------------------------------------------------------------------
def check_exportable(cfg: ModelConfig) -> None:
    """Reject what ModelConfig allows but transformers would compute differently or reject."""
    def need(ok: bool, field: str, what: str):
        if not ok:
            raise UserError(f"ModelConfig.{field}: {what}, found {getattr(cfg, field)!r}")

    # transformers' YaRN replaces a falsy beta by its default (`beta or 32`): 0 would silently differ.
    for field in ("rope_beta_fast", "rope_beta_slow", "rope_scaling_factor", "rope_theta", "rms_norm_eps"):
        need(getattr(cfg, field) > 0, field, "expected > 0 for transformers' GptOss")
    need(cfg.rope_original_max_position > 0, "rope_original_max_position", "expected > 0")
    need(cfg.max_position_embeddings > 0, "max_position_embeddings", "expected > 0")
    for field in ("bos_token_id", "eos_token_id"):
        need(0 <= getattr(cfg, field) < cfg.vocab_size, field, f"expected a token id in 0..{cfg.vocab_size - 1}")


def hf_layer_types(cfg: ModelConfig) -> list[str]:
    # Our sliding_window == 0 makes "sliding" layers full; transformers needs them said full.
    return [kind if cfg.window_of_layer(i) else "full_attention" for i, kind in enumerate(cfg.layer_types)]


def hf_config_kwargs(cfg: ModelConfig) -> dict:
    """GptOssConfig keyword arguments for our config (validated by check_exportable)."""
    check_exportable(cfg)
    layer_types = hf_layer_types(cfg)
    experts, top_k, width = ((cfg.n_experts, cfg.experts_per_token, cfg.expert_dim) if cfg.is_moe
                             else (1, 1, cfg.dense_dim))
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window if "sliding_attention" in layer_types else None,
        layer_types=layer_types,
        num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=width,
        swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
        rms_norm_eps=cfg.rms_norm_eps, initializer_range=cfg.initializer_range,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
                         "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow, "truncate": False,
                         "original_max_position_embeddings": cfg.rope_original_max_position},
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=None,
        tie_word_embeddings=False, attention_bias=True,
        torchlyra={k: getattr(cfg, k) for k in OURS_ONLY},
    )


def build_hf_config(cfg: ModelConfig, *, dtype: str = "float32", **extra):
    """A transformers GptOssConfig for our config; its own validation errors become UserError."""
    from transformers import GptOssConfig

    try:
        hf = GptOssConfig(**hf_config_kwargs(cfg), dtype=dtype, **extra)
    except (TypeError, ValueError) as e:   # huggingface_hub strict-dataclass errors are ValueErrors
        raise UserError(f"transformers rejected the exported config: {str(e).strip()}") from None
    if getattr(hf, "swiglu_alpha", 1.702) != cfg.swiglu_alpha:
        raise UserError(f"ModelConfig.swiglu_alpha: this transformers' GptOss fixes it at 1.702, found {cfg.swiglu_alpha}")
    return hf


def _hf_defaults() -> dict:
    from transformers import GptOssConfig

    return GptOssConfig().to_dict()


def model_config_from_hf(hf: dict, *, dense: bool = False, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from a GptOss config.json dict. Anything our model cannot reproduce
    exactly (other RoPE variants, tied embeddings, no attention bias...) is refused by field."""
    defaults = _hf_defaults()

    def get(field, default=None):   # absent fields take transformers' GptOssConfig defaults
        return hf[field] if field in hf else defaults.get(field, default)

    def refuse(field, expected):
        raise UserError(f"{where}: field {field!r} expected {expected}, found {get(field)!r}")

    if hf.get("model_type") != "gpt_oss":   # checked before defaults apply
        hint = " (a torchlyra checkpoint? it needs no import)" if hf.get("format") == "torchlyra-checkpoint" else ""
        raise UserError(f"{where}: field 'model_type' expected 'gpt_oss', found {hf.get('model_type')!r}{hint}")
    if check_quantization(hf, where) is not None:
        # MXFP4 packs 32 values of an expert's input dim per block: both widths must divide.
        for field in ("hidden_size", "intermediate_size"):
            if not isinstance(get(field), int) or get(field) % MXFP4_BLOCK:
                refuse(field, f"a multiple of {MXFP4_BLOCK} for MXFP4 expert weights")
    if get("tie_word_embeddings", False):
        refuse("tie_word_embeddings", "false")
    if not get("attention_bias", True):
        refuse("attention_bias", "true")

    # Legacy files carry "rope_scaling" (+ top-level "rope_theta") instead of "rope_parameters".
    # A null/absent rope_parameters means GptOss's default YaRN, as transformers reads it.
    legacy = hf.get("rope_scaling") if not hf.get("rope_parameters") else None
    rope = dict(legacy or hf.get("rope_parameters") or defaults["rope_parameters"])
    rope.setdefault("rope_theta", get("rope_theta", 150000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":      # plain RoPE == YaRN with factor 1 (no interpolation, no scaling)
        rope = {"factor": 1.0, "rope_theta": rope["rope_theta"]}
    elif kind != "yarn":
        raise UserError(f"{where}: field 'rope_parameters.rope_type' expected 'yarn' or 'default', found {kind!r}")
    elif rope.get("truncate", True):
        raise UserError(f"{where}: field 'rope_parameters.truncate' expected false (GptOss YaRN), "
                        f"found {rope.get('truncate', 'absent (transformers defaults to true)')!r}")
    for unsupported in ("attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor"):
        if rope.get(unsupported) is not None:
            raise UserError(f"{where}: field 'rope_parameters.{unsupported}' is not supported, found {rope[unsupported]!r}")

    # As transformers: no original length means max_position_embeddings; no factor, their ratio.
    original = rope.get("original_max_position_embeddings") or get("max_position_embeddings")
    factor = rope.get("factor") or get("max_position_embeddings") / original

    n_layers = get("num_hidden_layers")
    window = get("sliding_window") or 0
    layer_types = get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers or 0)]
    if "sliding_attention" in layer_types and not window:
        refuse("sliding_window", "a positive window for the layer_types 'sliding_attention' layers")
    experts = get("num_local_experts")
    if dense and experts != 1:
        refuse("num_local_experts", "1 to import as dense (--dense)")
    eos = get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    head_dim = get("head_dim") or (get("hidden_size") // get("num_attention_heads"))
    ours = dict(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"), n_layers=n_layers,
        n_heads=get("num_attention_heads"), n_kv_heads=get("num_key_value_heads") or get("num_attention_heads"),
        head_dim=head_dim, sliding_window=window, layer_types=list(layer_types),
        n_experts=0 if dense else experts, experts_per_token=0 if dense else get("num_experts_per_tok"),
        swiglu_alpha=get("swiglu_alpha", 1.702), swiglu_limit=get("swiglu_limit", 7.0),
        rms_norm_eps=get("rms_norm_eps", 1e-5),
        rope_theta=float(rope["rope_theta"]), rope_scaling_factor=float(factor),
        rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
        rope_original_max_position=original,
        max_position_embeddings=get("max_position_embeddings"), initializer_range=get("initializer_range", 0.02),
        bos_token_id=get("bos_token_id") or 0, eos_token_id=eos or 0,
    )
    extra = {k: v for k, v in (get("torchlyra") or {}).items() if k in OURS_ONLY}
    ours.update(extra)
    width_field = "dense_dim" if dense else "expert_dim"
    ours[width_field] = get("intermediate_size")
    return config_from_dict(ours, f"{where} (as ModelConfig)")


# ---- tensors --------------------------------------------------------------------------------
def _dense_layer_prefixes(cfg: ModelConfig) -> list[str]:
    return [f"model.layers.{i}.mlp." for i in range(cfg.n_layers)] if not cfg.is_moe else []


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor transformers' GptOssForCausalLM expects for our config."""
    shapes = {}
    dense = set(_dense_layer_prefixes(cfg))
    for name, shape in model_shapes(cfg).items():
        prefix, _, leaf = name.rpartition(".")
        if prefix + "." in dense and leaf in DENSE_MLP:
            shapes[f"{prefix}.experts.{leaf}"] = (1, *shape)
            if leaf == "gate_up_proj":
                shapes[f"{prefix}.router.weight"] = (1, cfg.d_model)
                shapes[f"{prefix}.router.bias"] = (1,)
        else:
            shapes[name] = shape
    return shapes


def to_hf_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state_dict -> transformers GptOss names/layouts (identity unless dense)."""
    out = {}
    dense = set(_dense_layer_prefixes(cfg))
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix + "." in dense and leaf in DENSE_MLP:
            out[f"{prefix}.experts.{leaf}"] = t.unsqueeze(0)
            if leaf == "gate_up_proj":
                out[f"{prefix}.router.weight"] = torch.zeros(1, cfg.d_model, dtype=t.dtype)
                out[f"{prefix}.router.bias"] = torch.zeros(1, dtype=t.dtype)
        else:
            out[name] = t
    return out


def from_hf_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig, where: str = "") -> dict[str, torch.Tensor]:
    """transformers GptOss tensors (already checked against hf_shapes(cfg)) -> our state_dict."""
    out = {}
    dense = set(_dense_layer_prefixes(cfg))
    for name, t in hf_state.items():
        prefix, _, leaf = name.rpartition(".")
        layer = prefix.rpartition(".")[0] + "."
        if layer in dense and prefix.endswith(".router"):
            if torch.count_nonzero(t):
                raise UserError(f"{where}: tensor {name} is not all zeros; importing as dense would drop "
                                f"it (import without --dense to keep a one-expert MoE)")
        elif layer in dense and prefix.endswith(".experts"):
            out[f"{layer}{leaf}"] = t[0]
        else:
            out[name] = t
    return out
