"""A transformers causal LM behind the model boundary (torch_model/causal_lm.py).

The model is transformers' own modeling code, built from its config (`model_type` picks the
class), with its attention routed to the `torchlyra::attention` op through transformers'
`AttentionInterface`: eagerly that op is the reference, under the bridge the kernel the op
registry chose. Nothing here names a family; what is not routed or cannot be expressed is
refused by name (`UnsupportedModel`), never computed another way.

Parameters keep transformers' names. The backbone runs the decoder skeleton that transformers'
decoders share (embed -> rotary -> layers -> norm) so that the bridge can scan the layers;
`check_skeleton` holds that skeleton to the family's own forward on a small copy of the config.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from torch_model import ops
from torch_model.causal_lm import CausalLMHead, DecoderShape

ATTENTION = "torchlyra"
# A sink logit that adds exactly nothing: exp(NO_SINK - max) underflows to 0 in float32 and bf16,
# without the inf - inf of a -inf sink.
NO_SINK = -1e30
# Keywords transformers' layers hand the attention function that change nothing here: positions
# enter through the rotary embedding, there is no cache in training.
_IGNORED_ATTENTION_KWARGS = ("position_ids", "use_cache", "cache_position")
_routed_calls: list | None = None       # while `check_routing` runs: the modules that called the routed attention


class UnsupportedModel(ValueError):
    """A model or feature this path cannot run as asked (the message names what and why)."""


def routed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window=None, s_aux=None, segment_ids=None, softcap=None, **kwargs):
    """transformers' attention-function signature -> the `attention` op (GQA, causal, sliding
    window, sinks, segment ids). q [B, Hq, T, D], k/v [B, Hkv, S, D]; returns ([B, T, Hq, D], None)."""
    where = type(module).__name__
    if _routed_calls is not None:
        _routed_calls.append(module)
    if attention_mask is not None:
        raise UnsupportedModel(f"{where}: an attention mask reached the routed attention; padding and packed "
                               f"documents are segment ids here")
    if dropout:
        raise UnsupportedModel(f"{where}: attention dropout {dropout} (no kernel applies dropout; set the "
                               f"config's attention_dropout to 0)")
    if softcap:
        raise UnsupportedModel(f"{where}: attention logit softcap {softcap} (no kernel expresses it)")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _IGNORED_ATTENTION_KWARGS)
    if unknown:
        raise UnsupportedModel(f"{where}: attention feature(s) {', '.join(unknown)} (no kernel expresses them)")
    sinks = s_aux if s_aux is not None else query.new_full((query.shape[1],), NO_SINK)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    segments = () if segment_ids is None else (segment_ids,)
    out = ops.OPS["attention"](query, key, value, sinks.to(query.dtype), int(sliding_window or 0), scale, *segments)
    return out.transpose(1, 2), None


def register_interfaces() -> None:
    """Register the routed attention under ATTENTION in transformers' interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, routed_attention)


def build(config, dtype=torch.float32) -> "TransformersCausalLM":
    """A transformers config (a `PretrainedConfig`) -> the model, weights initialised as
    transformers initialises them, attention routed."""
    from transformers import AutoModelForCausalLM

    register_interfaces()
    dropouts = sorted(k for k, v in config.to_dict().items() if "dropout" in k and isinstance(v, (int, float)) and v > 0)
    if dropouts:
        raise UnsupportedModel(f"config {', '.join(f'{k}={config.to_dict()[k]}' for k in dropouts)}: no kernel applies "
                               f"dropout; set it to 0 to train this model here")
    try:
        hf = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION, dtype=dtype)
    except (ValueError, KeyError, TypeError) as e:
        raise UnsupportedModel(f"transformers cannot build a causal LM from this config "
                               f"(model_type {getattr(config, 'model_type', None)!r}): {e}") from e
    return TransformersCausalLM(hf)


class TransformersBackbone(nn.Module):
    """The decoder skeleton of transformers' decoders, over the family's own modules: embed
    tokens, rotary embedding of the positions, the layers (each called with keyword arguments
    as the family's forward calls it), final norm. The modules are the transformers model's,
    so parameter names stay `model.embed_tokens.weight`, `model.layers.<i>.*`, `model.norm.weight`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, a)]
        if missing:
            raise UnsupportedModel(f"{type(inner).__name__}: no {', '.join(missing)}; the decoder skeleton "
                                   f"(embed_tokens -> rotary_emb -> layers -> norm) is what this path runs")
        self.embed_tokens, self.layers, self.norm, self.rotary_emb = (
            inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb)

    def forward(self, input_ids, start_position: int = 0, positions=None, segment_ids=None):
        x = self.embed_tokens(input_ids)
        if positions is None:
            b, t = input_ids.shape
            positions = torch.arange(start_position, start_position + t, device=input_ids.device).expand(b, t)
        cos, sin = self.rotary_emb(x, positions)
        segments = () if segment_ids is None else (segment_ids,)
        x, stats = self.run_layers(x, cos, sin, *segments)
        return self.norm(x), stats

    def run_layers(self, x, cos, sin, *segments):
        stats = []
        for layer in self.layers:
            x, layer_stats = self.call_layer(layer, x, cos, sin, *segments)
            stats.append(layer_stats)
        return x, stats

    @staticmethod
    def call_layer(layer, x, cos, sin, *segments):
        """One transformers decoder layer, called as its family's forward calls it (no mask: the
        routed attention reads segment ids). Dense layers have no router stats (None)."""
        extra = {"segment_ids": segments[0]} if segments else {}
        out = layer(x, attention_mask=None, position_embeddings=(cos, sin), use_cache=False, **extra)
        return (out[0] if isinstance(out, tuple) else out), None


class TransformersCausalLM(CausalLMHead, nn.Module):
    """A transformers `*ForCausalLM` behind the boundary: `model` is the skeleton over its own
    modules, `lm_head` its head (the embedding when tied: no `lm_head.weight` parameter then)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.config = hf_model.config
        self.model = TransformersBackbone(hf_model.get_decoder())
        self.lm_head = hf_model.get_output_embeddings()
        self.cfg = decoder_shape(self.config, self.model.layers)
        check_routing(hf_model, self)

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight


def decoder_shape(config, layers) -> DecoderShape:
    """What the bridge reads of the model. Layer types are read from the layers themselves
    (their parameters' names and shapes, and their attention window), so that any two layers the
    bridge stacks into one scan have the same structure."""
    heads = config.num_attention_heads
    kinds, names = [], {}
    for layer in layers:
        window = getattr(getattr(layer, "self_attn", None), "sliding_window", None) or 0
        structure = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
        key = (window, structure)
        names.setdefault(key, f"{'sliding' if window else 'full'}_attention"
                              f"{'' if not any(k[0] == window for k in names) else f'.{len(names)}'}")
        kinds.append(names[key])
    return DecoderShape(
        vocab_size=config.vocab_size, d_model=config.hidden_size, n_layers=len(layers), n_heads=heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, layer_types=tuple(kinds))


def check_routing(hf_model: nn.Module, model: TransformersCausalLM, tokens: int = 8) -> None:
    """Held by behaviour, on a few tokens of the model's own weights: every layer's attention
    calls the routed function (once per layer), and the skeleton and head give the family's own
    forward's logits exactly (a logit softcap or scaled head would not). A model on the meta device (no weights: `plan`) is checked when it is
    built with weights."""
    global _routed_calls
    if any(p.is_meta for p in model.parameters()):
        return
    ids = torch.arange(tokens).remainder(model.cfg.vocab_size)[None]
    _routed_calls = []
    try:
        with torch.no_grad():
            theirs = hf_model(input_ids=ids, use_cache=False).logits
            called = list(_routed_calls)
            ours = model(ids)
    finally:
        _routed_calls = None
    for i, layer in enumerate(model.model.layers):
        attn = [m for m in layer.modules() if any(m is c for c in called)]
        if len(attn) != 1 or sum(c is attn[0] for c in called) != 1:
            raise UnsupportedModel(f"layer {i} ({type(layer).__name__}): its attention does not call transformers' "
                                   f"AttentionInterface once per forward, so no kernel of the registry would run it")
    if not torch.equal(ours, theirs):
        raise UnsupportedModel(f"{type(hf_model).__name__}: its forward does more than embed -> rotary -> layers -> "
                               f"norm -> linear head (logits differ by {(ours - theirs).abs().max().item():.3g}); "
                               f"this path would not compute the family's model")
