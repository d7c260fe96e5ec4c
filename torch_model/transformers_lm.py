"""A transformers causal LM behind the model boundary (torch_model/causal_lm.py).

The model is transformers' own modeling code, built from its config (`model_type` picks the
class), with its attention routed to the `torchlyra::attention` op through transformers'
`AttentionInterface` and its experts to the `torchlyra::routed_experts` op through
`ExpertsInterface`: eagerly those ops are the references, under the bridge the kernels the op
registry chose. Nothing here names a family; what is not routed or cannot be expressed is
refused by name (`UnsupportedModel`), never computed another way.

Parameters keep transformers' names. The backbone runs the decoder skeleton that transformers'
decoders share (embed -> rotary -> layers -> norm) so that the bridge can scan the layers;
`check_routing` holds that skeleton, with the head, to the family's own forward on the model's
own weights. `TransformersSpec` is such a model's record in checkpoints, as `ModelConfig` is ours.
"""
from __future__ import annotations

import contextlib
import copy
import json
from typing import NamedTuple

import torch
import torch.nn as nn

from torch_model import kv_cache, ops
from torch_model.ops import NO_SINK
from torch_model.causal_lm import PAD_SEGMENT, CausalLMHead, DecoderShape
from torch_model.transformers_truth import (IGNORED_ATTENTION_KWARGS, Described, UnsupportedModel, attention_module,
                                            check_truth, describe_layers, first_line)

ATTENTION = "torchlyra"


class LayerCall(NamedTuple):
    """What the backbone hands a layer's attention for one call, through the attention module
    itself (`torchlyra_call`), not through the layer's keyword arguments, which some families'
    layers do not pass on (StableLM): the segment ids of packed rows, or the generation cache."""
    segment_ids: torch.Tensor | None = None
    static_cache: "StaticCache | None" = None


@contextlib.contextmanager
def layer_call(layer: nn.Module, call: LayerCall):
    """Inside, the layer's attention module carries `call`; yields the layer's description."""
    module = attention_module(layer)
    module.torchlyra_call = call
    try:
        yield module.torchlyra_attention
    finally:
        module.torchlyra_call = None


def routed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window=None, s_aux=None, softcap=None, **kwargs):
    """transformers' attention-function signature -> the `attention` op (GQA, causal, the
    layer's window, sinks, segment ids), or during generation (the module's call carries a
    `StaticCache`, whose `update` gave k/v) the `cached_attention` op over the cache's slots by
    token position. The window, scale and sinks are the layer's description
    (`module.torchlyra_attention`, read from transformers' own model by `describe_layers`); the
    call's own arguments must still agree with it. q [B, Hq, T, D], k/v [B, Hkv, S, D]; returns
    ([B, T, Hq, D], None)."""
    where = type(module).__name__
    described = getattr(module, "torchlyra_attention", None)
    if described is None:
        raise UnsupportedModel(f"{where}: an attention module not described by transformers_lm.build")
    if attention_mask is not None:
        raise UnsupportedModel(f"{where}: an attention mask reached the routed attention; padding and packed "
                               f"documents are segment ids here")
    if dropout:
        raise UnsupportedModel(f"{where}: attention dropout {dropout} (no kernel applies dropout; set the "
                               f"config's attention_dropout to 0)")
    if softcap:
        raise UnsupportedModel(f"{where}: attention logit softcap {softcap} (no kernel expresses it)")
    unknown = sorted(k for k, v in kwargs.items()
                     if v is not None and k not in IGNORED_ATTENTION_KWARGS and not k.startswith("output_"))
    if unknown:
        raise UnsupportedModel(f"{where}: attention feature(s) {', '.join(unknown)} (no kernel expresses them)")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if (int(sliding_window or 0), scale, s_aux is not None) != (described.window, described.scale, described.sinks):
        raise UnsupportedModel(f"{where}: called with sliding_window={sliding_window}, scaling={scaling}, sinks "
                               f"{'given' if s_aux is not None else 'none'}; described as {described.summary()} when "
                               f"the model was built")
    call = getattr(module, "torchlyra_call", None) or LayerCall()
    sinks = s_aux if s_aux is not None else query.new_full((query.shape[1],), NO_SINK)
    if call.static_cache is not None:
        cache = call.static_cache
        if module.layer_idx not in cache.key_positions:
            raise UnsupportedModel(f"{where} (layer {module.layer_idx}): its keys and values did not reach the "
                                   f"generation cache (its layer does not pass transformers' `cache` argument on)")
        out = ops.OPS["cached_attention"](query, key, value, sinks.to(query.dtype), cache.positions,
                                          cache.key_positions[module.layer_idx], described.window, described.scale)
        return out.transpose(1, 2), None
    segments = () if call.segment_ids is None else (call.segment_ids,)
    out = ops.OPS["attention"](query, key, value, sinks.to(query.dtype), described.window, described.scale, *segments)
    return out.transpose(1, 2), None


class StaticCache:
    """transformers' cache interface (`update`, as its attention modules call it) over our static
    KV cache (torch_model/kv_cache.py) for one `forward_cached` call: each layer's update writes
    the new keys and values out of place at sequence index `start` and records which slots (by
    token position) its queries attend over, which the routed attention reads."""

    def __init__(self, cache: kv_cache.KVCache, positions, start, windows: tuple[int, ...]):
        self.cache, self.positions, self.start, self.windows = cache, positions, start, windows
        self.full, self.sliding = kv_cache.write_positions(cache, positions, start)
        self.keys, self.values = list(cache.keys), list(cache.values)
        self.key_positions: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        window = self.windows[layer_idx]
        before, after = ((self.cache.sliding_positions, self.sliding) if window
                         else (self.cache.full_positions, self.full))
        k_all, v_all, self.key_positions[layer_idx], self.keys[layer_idx], self.values[layer_idx] = kv_cache.attend_keys(
            self.cache.keys[layer_idx], self.cache.values[layer_idx], key_states, value_states, self.start,
            self.positions, before, after, window)
        return k_all, v_all

    def result(self) -> kv_cache.KVCache:
        return kv_cache.KVCache(tuple(self.keys), tuple(self.values), self.full, self.sliding)


# The experts' activations the `moe` op expresses: (alpha, limit, up_shift) of
# (clip(up, +-limit) + up_shift) * g * sigmoid(alpha * g), g = min(gate, limit) (torch_model/ops.py).
SWIGLU = (1.0, float("inf"), 0.0)                 # silu(gate) * up


def is_experts(module) -> bool:
    """A transformers experts module (`@use_experts_implementation`: stacked weights, layout flags)."""
    return hasattr(module, "gate_up_proj") and hasattr(module, "is_transposed")


def expert_activation(module) -> tuple[float, float, float]:
    """The (alpha, limit, up_shift) of the family's own gate (`module._apply_gate`), found by
    behaviour: each candidate is evaluated against the module's function on probe values
    (beyond the clamps, both signs). Experts without a gate or with a post-expert norm, or whose
    gate no candidate reproduces, are refused by name."""
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        raise UnsupportedModel(f"{type(module).__name__}: experts without a gate or with a post-expert norm "
                               f"(no moe kernel computes them)")
    width = module.gate_up_proj.shape[-1] if module.is_transposed else module.gate_up_proj.shape[-2]
    probe = torch.linspace(-12.0, 12.0, 4 * width, dtype=torch.float32, device="cpu").reshape(4, width)
    probe = probe[:, torch.randperm(width, generator=torch.Generator().manual_seed(0), device="cpu")]
    theirs = module._apply_gate(probe)
    interleaved = probe if not module.is_concatenated else _interleave(probe)
    candidates = [SWIGLU]
    if hasattr(module, "alpha") and hasattr(module, "limit"):
        candidates.insert(0, (float(module.alpha), float(module.limit), 1.0))
    for candidate in candidates:
        if torch.allclose(ops.clamped_swiglu(interleaved, *candidate), theirs, rtol=1e-6, atol=1e-6):
            return candidate
    raise UnsupportedModel(f"{type(module).__name__}: its gate (`_apply_gate`) is none of the activations the moe "
                           f"kernels compute (SwiGLU, GPT-OSS's clamped SwiGLU)")


def _interleave(gate_up):
    """[..., gate | up] (concatenated halves) -> [..., g0, u0, g1, u1, ...] (the op's layout)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


def softmax_of_chosen(logits, chosen):
    """Routing weights as ours and gpt-oss's routers make them: softmax over the k chosen logits."""
    return torch.softmax(torch.gather(logits.float(), -1, chosen), dim=-1).to(logits.dtype)


def _softmax_gathered(logits, chosen):
    return torch.gather(torch.softmax(logits.float(), dim=-1), -1, chosen).to(logits.dtype)


def _softmax_gathered_normalized(logits, chosen):
    weights = torch.gather(torch.softmax(logits.float(), dim=-1), -1, chosen)
    return (weights / weights.sum(-1, keepdim=True)).to(logits.dtype)


def router_weighting(router: nn.Module):
    """How a family's router (returning (logits, weights, chosen experts)) weights its k chosen
    experts, found by behaviour on probe inputs: the function (logits, chosen) -> weights among
    softmax over the chosen, softmax over all gathered at the chosen, and that renormalized. The
    parity suite re-weights experts it forces with it; a router none reproduces is refused by name."""
    hidden = router.weight.shape[-1]
    probe = torch.randn(16, hidden, generator=torch.Generator().manual_seed(0), device="cpu") * 3
    with torch.no_grad():
        try:
            logits, weights, chosen = router(probe.to(router.weight.dtype))
        except Exception as e:  # noqa: BLE001 - a router that needs more than the hidden states
            raise UnsupportedModel(f"{type(router).__name__}: its router is not called as (hidden states) -> "
                                   f"(logits, weights, chosen experts) ({first_line(e)})") from e
        for rule in (softmax_of_chosen, _softmax_gathered_normalized, _softmax_gathered):
            if torch.allclose(rule(logits, chosen).float(), weights.float(), rtol=1e-5, atol=1e-6):
                return rule
    raise UnsupportedModel(f"{type(router).__name__}: its routing weights are none of softmax over the chosen "
                           f"experts, or softmax over all experts gathered (renormalized or not)")


def routed_experts(module, hidden_states, top_k_index, top_k_weights):
    """transformers' experts-function signature -> the `moe` op: the family's stacked weights in
    the op's layout (x @ W, gate and up interleaved, biases), its activation's constants.
    hidden_states [N, H], top_k_index / top_k_weights [N, k]; returns [N, H]."""
    activation = getattr(module, "torchlyra_activation", None)
    if activation is None:
        raise UnsupportedModel(f"{type(module).__name__}: experts not prepared by transformers_lm.build")
    gate_up, down = module.gate_up_proj, module.down_proj
    # A train step converts the weights once before its micro-batches (jax_bridge/expert_layout.py).
    converted = getattr(module, "torchlyra_op_layout", False)
    if not module.is_transposed and not converted:   # [E, 2I, H] / [E, H, I] -> x @ W layouts
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate_up_bias = module.gate_up_proj_bias if module.has_bias else gate_up.new_zeros(gate_up.shape[0], gate_up.shape[2])
    down_bias = module.down_proj_bias if module.has_bias else down.new_zeros(down.shape[0], down.shape[2])
    if module.is_concatenated and not converted:
        gate_up, gate_up_bias = _interleave(gate_up), _interleave(gate_up_bias)
    return ops.OPS["moe"](hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), gate_up, gate_up_bias,
                          down, down_bias, *activation)


def register_interfaces() -> None:
    """Register the routed attention and experts under ATTENTION in transformers' interfaces
    (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    AttentionInterface.register(ATTENTION, routed_attention)
    ExpertsInterface.register(ATTENTION, routed_experts)


def build(config, dtype=torch.float32, *, reference: bool = False, meta: bool = False,
          described: Described | None = None) -> "TransformersCausalLM":
    """A transformers config (a `PretrainedConfig`) -> the model, weights initialised as
    transformers initialises them, attention routed. `reference`: the parity suite's ground truth
    instead, the same skeleton over transformers' own `eager` attention and experts (the model
    authors' code), packed rows given to it as attention masks (`reference_mask`). `meta`: the
    parameters on the `meta` device (a loader fills them), the buffers computed on the host.
    `described`: the layers' descriptions to take instead of reading them (`describe_layers`)."""
    from transformers import AutoModelForCausalLM

    register_interfaces()
    dropouts = sorted(k for k, v in config.to_dict().items() if "dropout" in k and isinstance(v, (int, float)) and v > 0)
    if dropouts:
        raise UnsupportedModel(f"config {', '.join(f'{k}={config.to_dict()[k]}' for k in dropouts)}: no kernel applies "
                               f"dropout; set it to 0 to train this model here")
    with torch.device("meta") if meta else contextlib.nullcontext():
        try:
            implementation = "eager" if reference else ATTENTION
            hf = AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                  experts_implementation=implementation, dtype=dtype)
        except KeyError as e:
            if e.args == (implementation,):     # a family that looks its attention class up by name
                raise UnsupportedModel(f"model_type {getattr(config, 'model_type', None)!r}: its modeling code has no "
                                       f"attention for transformers' AttentionInterface (it looks up "
                                       f"{implementation!r} among its own attention classes), so no kernel of the "
                                       f"registry would run it") from e
            raise UnsupportedModel(f"transformers cannot build a causal LM from this config "
                                   f"(model_type {getattr(config, 'model_type', None)!r}): KeyError {e}") from e
        except Exception as e:  # noqa: BLE001 - whatever transformers' modeling code raises is the answer
            raise UnsupportedModel(f"transformers cannot build a causal LM from this config "
                                   f"(model_type {getattr(config, 'model_type', None)!r}): {first_line(e)}") from e
        model = TransformersCausalLM(hf, reference=reference, described=described)
    if meta:
        _fill_buffers(hf)
    return model


def _fill_buffers(hf_model: nn.Module) -> None:
    """A model built on `meta` has no values in its buffers either (a rotary embedding's inv_freq:
    not stored in checkpoints, computed at construction). Each is made on the host and
    initialised again by transformers' own `_init_weights`, which recomputes the buffers it
    owns; one it leaves unset (NaN-filled here) is refused by name rather than run with garbage."""
    init = hf_model._init_weights
    for name, module in hf_model.named_modules():
        metas = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        for n in metas:
            b = module._buffers[n]
            if not b.is_floating_point():
                raise UnsupportedModel(f"{name}.{n}: a buffer of {type(module).__name__} that transformers does not "
                                       "compute again once the model is built without weights")
            module._buffers[n] = torch.full(b.shape, float("nan"), dtype=b.dtype)
        with torch.no_grad():
            init(module)
        unset = [n for n in metas if torch.isnan(module._buffers[n]).any()]
        if unset:
            raise UnsupportedModel(f"{name}.{unset[0]}: a buffer of {type(module).__name__} that transformers' "
                                   "_init_weights does not compute again once the model is built without weights")


def reference_mask(rows: int, length: int, window: int, segment_ids=None, dtype=torch.float32, device=None):
    """The additive attention mask [B, 1, T, T] transformers' eager attention takes: key j visible
    to query i when j <= i, within the window (i - j < W) and, for packed rows, in i's segment
    (padding, segment 0, attends within itself): what the routed kernels compute from segment ids."""
    i = torch.arange(length, device=device)
    visible = (i[None, :] <= i[:, None])[None].expand(rows, length, length)
    if window:
        visible = visible & ((i[:, None] - i[None, :]) < window)[None]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(visible, zero, torch.finfo(dtype).min)[:, None]


class TransformersBackbone(nn.Module):
    """The decoder skeleton of transformers' decoders, over the family's own modules: embed
    tokens, the rotary embedding of the positions (called as the family's forward calls it:
    once per distinct call, e.g. per layer type for Gemma 3), the layers (each called with
    keyword arguments as the family's forward calls it, given the position embeddings its
    description names), final norm. The modules are the transformers model's, so parameter
    names stay `model.embed_tokens.weight`, `model.layers.<i>.*`, `model.norm.weight`.

    The position embeddings travel between the layers stacked over the rotary calls: cos and
    sin [R, B, T, D] for R distinct calls (R = 1 for most families); each layer takes its own."""

    def __init__(self, inner: nn.Module, router=None, reference: bool = False):
        """router: transformers' OutputRecorder of the family's router logits (its
        `_can_record_outputs["router_logits"]`), or None for a dense model. reference: the
        layers run transformers' eager attention, given `reference_mask` instead of segment ids."""
        super().__init__()
        self._router, self.reference = router, reference
        missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if getattr(inner, a, None) is None]
        if missing:
            raise UnsupportedModel(f"{type(inner).__name__}: no {', '.join(missing)}; the decoder skeleton "
                                   f"(embed_tokens -> rotary_emb -> layers -> norm) is what this path runs")
        self.embed_tokens, self.layers, self.norm, self.rotary_emb = (
            inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb)
        self.rope_calls: tuple = (((), ()),)        # (args, kwargs) after x and positions: set by describe

    def position_embeddings(self, x, positions):
        """(cos, sin), each [R, B, T, D]: the rotary module called as the family calls it."""
        outs = [self.rotary_emb(x, positions, *args, **dict(kwargs)) for args, kwargs in self.rope_calls]
        return torch.stack([cos for cos, _ in outs]), torch.stack([sin for _, sin in outs])

    def forward(self, input_ids, start_position: int = 0, positions=None, segment_ids=None):
        x = self.embed_tokens(input_ids)
        if positions is None:
            b, t = input_ids.shape
            positions = torch.arange(start_position, start_position + t, device=input_ids.device).expand(b, t)
        cos, sin = self.position_embeddings(x, positions)
        segments = () if segment_ids is None else (segment_ids,)
        x, stats = self.run_layers(x, cos, sin, *segments)
        return self.norm(x), stats

    def forward_cached(self, input_ids, positions, cache: kv_cache.KVCache, start):
        """Hidden states of T new tokens [B, T] at per-row `positions` [B, T] (EMPTY for padding),
        written into `cache` at sequence index `start` onward; returns (hidden, updated cache).
        Each layer is called as in training, with transformers' `cache` argument: its attention
        hands its keys and values to `StaticCache.update`, then calls the routed attention."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.position_embeddings(x, positions.clamp(min=0))
        static = StaticCache(cache, positions, start, tuple(map(self.cfg.window_of_layer, range(len(self.layers)))))
        for layer in self.layers:
            with layer_call(layer, LayerCall(static_cache=static)) as described:
                out = layer(x, attention_mask=None, position_embeddings=(cos[described.rope], sin[described.rope]),
                            use_cache=False, cache=static)
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x), static.result()

    def run_layers(self, x, cos, sin, *segments):
        stats = []
        for layer in self.layers:
            x, layer_stats = self.call_layer(layer, x, cos, sin, *segments)
            stats.append(layer_stats)
        return x, stats

    def call_layer(self, layer, x, cos, sin, *segments):
        """One transformers decoder layer, called as its family's forward calls it (no mask: the
        routed attention reads the segment ids its module carries). Stats: the router's logits
        [N, E] (recorded as transformers records them) and the real-token mask, or None for a
        dense layer."""
        described = attention_module(layer).torchlyra_attention
        extra = {"attention_mask": None}
        if self.reference:
            extra = {"attention_mask": reference_mask(x.shape[0], x.shape[1], described.window, *segments,
                                                      dtype=x.dtype, device=x.device)}
        logits = []
        hooks = [m.register_forward_hook(lambda _, __, out: logits.append(out[self._router.index] if isinstance(
            out, tuple) else out)) for m in layer.modules() if self._router and isinstance(m, self._router.target_class)]
        try:
            with layer_call(layer, LayerCall(segment_ids=None if self.reference or not segments else segments[0])):
                out = layer(x, position_embeddings=(cos[described.rope], sin[described.rope]), use_cache=False, **extra)
        finally:
            for hook in hooks:
                hook.remove()
        out = out[0] if isinstance(out, tuple) else out
        if not logits:
            return out, None
        return out, {"logits": logits[0], "real": (segments[0] != PAD_SEGMENT) if segments else None}

    def describe(self, described: Described) -> None:
        """Keep each layer's description on its attention module and the rotary calls here."""
        for layer, name, attention in zip(self.layers, described.attention_names, described.layers):
            layer.get_submodule(name).torchlyra_attention = attention
        self.rope_calls = described.rope_calls

    def described(self) -> Described:
        """The descriptions as `describe` takes them (the reference twin takes its model's)."""
        names = tuple(next(n for n, m in layer.named_modules() if m is attention_module(layer)) for layer in self.layers)
        return Described(tuple(attention_module(layer).torchlyra_attention for layer in self.layers), names,
                         self.rope_calls)


class TransformersCausalLM(CausalLMHead, nn.Module):
    """A transformers `*ForCausalLM` behind the boundary: `model` is the skeleton over its own
    modules, `lm_head` its head (the embedding when tied: no `lm_head.weight` parameter then)."""

    def __init__(self, hf_model: nn.Module, reference: bool = False, described: Described | None = None):
        """described: the layers' descriptions to take (the reference twin takes its model's);
        otherwise read from transformers' own model (`describe_layers`)."""
        super().__init__()
        self.config = hf_model.config
        router = getattr(hf_model, "_can_record_outputs", None) or {}
        self.model = TransformersBackbone(hf_model.get_decoder(), router.get("router_logits"), reference)
        self.lm_head = hf_model.get_output_embeddings()
        self.model.describe(described or describe_layers(hf_model, self.model.layers, self.model.rotary_emb))
        self.cfg = self.model.cfg = decoder_shape(self.config, self.model.layers)
        for module in self.modules():          # the experts' activation, found once, outside any trace
            if is_experts(module):
                module.torchlyra_activation = expert_activation(module)
        for _, router in self.routers():       # how it weights its chosen experts (the parity suite forces choices)
            if not isinstance(getattr(router, "weight", None), nn.Parameter):
                raise UnsupportedModel(f"{type(router).__name__}: a router without its own `weight` matrix (how a "
                                       f"router weights its experts is read from its own linear map)")
            if not router.weight.is_meta:
                router.torchlyra_weighting = router_weighting(router)
        check_balance_loss(hf_model, self.cfg)
        if not reference:           # the reference runs transformers' own attention: nothing is routed
            check_routing(hf_model, self)

    def reference_twin(self) -> "TransformersCausalLM":
        """The same model (a copy of its weights) over transformers' own eager attention and
        experts: the parity suite's ground truth."""
        twin = build(copy.deepcopy(self.config), reference=True,     # transformers writes the implementation into it
                     described=self.model.described())
        twin.load_state_dict(self.state_dict())
        return twin

    def routers(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of each MoE layer's router, in layer order: the modules transformers
        records the family's router logits from (`_can_record_outputs["router_logits"]`), each
        returning (logits, weights, chosen experts)."""
        recorder = self.model._router
        if recorder is None:
            return []
        return [(name, module) for name, module in self.named_modules() if isinstance(module, recorder.target_class)]

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def router_terms(self, moe_stats: list) -> dict:
        """transformers' router loss for these families: the Switch load-balancing loss over the
        MoE layers' logits pooled (`load_balancing_loss_func`, padding left out), no z-loss."""
        logits = [s["logits"] for s in moe_stats]
        balance = switch_balance_loss(logits, self.cfg.n_experts, self.cfg.experts_per_token, moe_stats[0]["real"])
        fractions = torch.stack([_fraction(x, self.cfg.n_experts, self.cfg.experts_per_token) for x in logits])
        zero = torch.zeros((), dtype=balance.dtype, device=balance.device)
        return dict(router_balance=balance, router_z=zero, expert_fraction=fractions)


def switch_balance_loss(logits: list, n_experts: int, top_k: int, real=None):
    """transformers' `load_balancing_loss_func` (Mixtral, Qwen-MoE, OLMoE): E * sum_e f_e * P_e with
    f_e the share of top-k assignments and P_e the mean router probability, over the tokens of
    every MoE layer together; real [B, T] (False on padding) weights the tokens. Written with
    one-hot sums, which trace under the bridge where `histc` does not."""
    counts = torch.zeros(n_experts, dtype=torch.float32, device=logits[0].device)
    probs_sum = torch.zeros_like(counts)
    rows = torch.zeros((), dtype=torch.float32, device=logits[0].device)
    w = None if real is None else real.reshape(-1).float()
    for layer_logits in logits:
        probs = torch.softmax(layer_logits.float(), dim=-1)
        chosen = torch.nn.functional.one_hot(torch.topk(probs, top_k, dim=-1).indices, n_experts).sum(1).float()
        if w is None:
            counts, probs_sum, rows = counts + chosen.sum(0), probs_sum + probs.sum(0), rows + probs.shape[0]
        else:
            counts = counts + (chosen * w[:, None]).sum(0)
            probs_sum, rows = probs_sum + (probs * w[:, None]).sum(0), rows + w.sum()
    return (counts / rows * (probs_sum / rows)).sum() * n_experts


def _fraction(logits, n_experts: int, top_k: int):
    """Each expert's share of one layer's top-k assignments (the expert-load metric and plot)."""
    chosen = torch.nn.functional.one_hot(torch.topk(logits.float(), top_k, dim=-1).indices, n_experts).float()
    return chosen.sum((0, 1)) / chosen.sum()


def check_balance_loss(hf_model, shape: DecoderShape) -> None:
    """The family's own load-balancing function, held to `switch_balance_loss` on random logits
    when the config trains with it (output_router_logits and a coefficient); a family whose loss
    is another is refused by name rather than trained with the wrong one."""
    if not shape.is_moe or not shape.router_aux_loss_coef:
        return
    import sys

    theirs = getattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func", None)
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, shape.n_experts, generator=gen, device="cpu") for _ in range(2))
    mask = torch.tensor([[1] * 5 + [0], [1] * 6], dtype=torch.long, device="cpu")
    ours = [switch_balance_loss(list(logits), shape.n_experts, shape.experts_per_token, real)
            for real in (None, mask.bool())]
    if theirs is None or not all(torch.allclose(o, theirs(logits, shape.n_experts, shape.experts_per_token, m))
                                 for o, m in zip(ours, (None, mask))):
        raise UnsupportedModel(f"{type(hf_model).__name__}: its router loss is not the Switch load-balancing loss "
                               f"this path computes; train it with output_router_logits=False")


def decoder_shape(config, layers) -> DecoderShape:
    """What the bridge reads of the model. Layer types are read from the layers themselves
    (their parameters' names and shapes, and their attention's description: window, scale,
    sinks, rotary call), so that any two layers the bridge stacks into one scan have the same
    structure and the same static behaviour."""
    heads = _config_value(config, "num_attention_heads")
    kinds, names, windows = [], {}, []
    for layer in layers:
        described = attention_module(layer).torchlyra_attention
        structure = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
        base = f"{'sliding' if described.window else 'full'}_attention" + (
            "+experts" if any(is_experts(m) for m in layer.modules()) else "")
        if (described, structure) not in names:      # another structure under the same name gets a number
            taken = sum(name.split(".")[0] == base for name in names.values())
            names[(described, structure)] = base if not taken else f"{base}.{taken}"
        kinds.append(names[(described, structure)])
        windows.append(described.window)
    experts = [m for layer in layers for m in layer.modules() if is_experts(m)]
    # transformers adds the router loss only when the config asks for the router logits.
    aux = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if getattr(config, "output_router_logits", False) else 0.0
    return DecoderShape(
        vocab_size=config.vocab_size, d_model=config.hidden_size, n_layers=len(layers), n_heads=heads,
        n_kv_heads=_config_value(config, "num_key_value_heads", None) or heads,
        head_dim=_config_value(config, "head_dim", None) or _config_value(config, "hidden_size") // heads,
        layer_types=tuple(kinds),
        windows=tuple(windows), max_position_embeddings=int(getattr(config, "max_position_embeddings", 0) or 0),
        bos_token_id=_one_id(getattr(config, "bos_token_id", None)),
        eos_token_id=_one_id(getattr(config, "eos_token_id", None)),
        n_experts=experts[0].gate_up_proj.shape[0] if experts else 0,
        experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
        router_aux_loss_coef=aux if experts else 0.0)


def _config_value(config, name: str, *default):
    """config.<name> (or the default), refused by name when the config has no such value: a
    composite config (a vision-language model's, whose decoder is its `text_config`), or one whose
    value differs per layer."""
    try:
        return getattr(config, name, *default)
    except AttributeError:
        raise UnsupportedModel(f"{type(config).__name__}: no {name}; a composite config (a vision-language "
                               f"model's?): this path takes a decoder's own config (its text_config)") from None
    except Exception as e:  # noqa: BLE001 - transformers' error for a value that differs per layer
        raise UnsupportedModel(f"{type(config).__name__}: no single {name} ({first_line(e)}); this path takes a "
                               f"decoder whose layers share one shape") from None


def _one_id(token_id) -> int | None:
    """A config's special id: released configs may list several end ids; the first is the one."""
    if isinstance(token_id, (list, tuple)):
        return int(token_id[0]) if token_id else None
    return None if token_id is None else int(token_id)


def check_routing(hf_model: nn.Module, model: TransformersCausalLM, tokens: int = 8) -> None:
    """Held by behaviour on the model's own weights: the skeleton and head give the family's
    own forward's logits exactly on a few tokens, both routed (a logit softcap or scaled head
    would not), and the routed model on packed documents gives transformers' own eager forward
    on each document alone (`check_truth`: every layer, rows longer than the windows). A model
    on the meta device (no weights: `plan`) is checked when it is built with weights."""
    if any(p.is_meta for p in model.parameters()):
        return
    ids = torch.arange(tokens).remainder(model.cfg.vocab_size)[None]
    try:
        with torch.no_grad():
            theirs = hf_model(input_ids=ids, use_cache=False).logits
            ours = model(ids)
    except UnsupportedModel:
        raise
    except Exception as e:  # noqa: BLE001 - the family's forward failing on its own weights is the answer
        raise UnsupportedModel(f"{type(hf_model).__name__}: its forward fails on {tokens} tokens of its own weights "
                               f"({first_line(e)})") from e
    if not torch.equal(ours, theirs):
        raise UnsupportedModel(f"{type(hf_model).__name__}: its forward does more than embed -> rotary -> layers -> "
                               f"norm -> linear head (logits differ by {(ours - theirs).abs().max().item():.3g}); "
                               f"this path would not compute the family's model")
    check_truth(hf_model, model, model.model.layers)


_STRUCTURES: dict[str, TransformersCausalLM] = {}      # TransformersSpec.structure per config (JSON)


class TransformersSpec:
    """A transformers model as a run records and rebuilds it (the counterpart of our
    `ModelConfig` in checkpoints and metrics): its config as a JSON object with `model_type`,
    the special token ids taken from the run's tokenizer. `to_dict()` is {"transformers": config}."""

    KEY = "transformers"

    def __init__(self, config: dict, where: str = "model config"):
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise UnsupportedModel(f"{where}: a transformers config is a JSON object with a 'model_type' "
                                   f"(as a model's config.json has), found {str(config)[:80]!r}")
        self.config, self.where = dict(config), where
        self._structure = None

    @classmethod
    def from_file(cls, path) -> "TransformersSpec":
        try:
            with open(path) as f:
                config = json.load(f)
        except OSError as e:
            raise UnsupportedModel(f"--model-config {path}: cannot read it ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise UnsupportedModel(f"--model-config {path}: not JSON ({e})") from None
        spec = cls(config, f"--model-config {path}")
        spec.structure()             # transformers must build it, and this path take it, before anything else
        return spec

    @classmethod
    def is_spec_dict(cls, d) -> bool:
        return isinstance(d, dict) and set(d) == {cls.KEY}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "TransformersSpec":
        return cls(d[cls.KEY], where)

    def to_dict(self) -> dict:
        return {self.KEY: dict(self.config)}

    def replace(self, **changes) -> "TransformersSpec":
        """bos_token_id / eos_token_id (into the config, so an export names the tokenizer's) and
        max_seq_len (checked against the config's positions)."""
        seq = changes.pop("max_seq_len", None)
        limit = self.config.get("max_position_embeddings")
        if seq is not None and limit and seq > limit:
            raise UnsupportedModel(f"{self.where}: rows of {seq} tokens exceed the config's max_position_embeddings "
                                   f"({limit})")
        spec = TransformersSpec({**self.config, **changes}, self.where)
        if set(changes) <= {"bos_token_id", "eos_token_id"}:   # the same parameters: keep the structure
            spec._structure = self._structure
        return spec

    def hf_config(self):
        from transformers import AutoConfig

        rest = {k: v for k, v in self.config.items() if k != "model_type"}
        try:
            return AutoConfig.for_model(self.config["model_type"], **rest)
        except Exception as e:  # noqa: BLE001 - whatever transformers' config class raises is the answer
            raise UnsupportedModel(f"{self.where}: transformers cannot build a config of model_type "
                                   f"{self.config['model_type']!r}: {first_line(e)}") from None

    def build(self, meta: bool = False) -> TransformersCausalLM:
        return build(self.hf_config(), meta=meta)

    def structure(self) -> TransformersCausalLM:
        """The model built once on the meta device (no weights): what its shape, parameter counts
        and FLOPs are read from. Read only; one per config in a process (a command reads its
        checkpoint's record in several places, each a spec of its own)."""
        if self._structure is None:
            key = json.dumps(self.config, sort_keys=True, default=str)
            if key not in _STRUCTURES:
                with torch.device("meta"):
                    _STRUCTURES[key] = self.build()
            self._structure = _STRUCTURES[key]
        return self._structure

    @property
    def shape(self) -> DecoderShape:
        return self.structure().cfg

    def __getattr__(self, name):
        # What the bridge and the run's bookkeeping read of a ModelConfig: the DecoderShape fields.
        if name.startswith("_") or name in ("config", "where"):
            raise AttributeError(name)
        return getattr(self.shape, name)

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def bos_token_id(self):
        return self.config.get("bos_token_id")

    @property
    def eos_token_id(self):
        return self.config.get("eos_token_id")

    def param_counts(self) -> dict[str, int]:
        """Total and active (per token: k of the E experts of each MoE layer) parameter counts."""
        model = self.structure()
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for m in model.modules() if is_experts(m) for p in m.parameters(recurse=False))
        shape = model.cfg
        active = total - (experts - experts * shape.experts_per_token // shape.n_experts if shape.is_moe else 0)
        return {"total": total, "active": active}

    def active_matmul_params(self) -> int:
        """Matmul weights one token passes through (train/run/flops.py): every matrix but the
        embedding lookup, the head once (tied or not), k of the E experts."""
        model = self.structure()
        shape, count, seen = model.cfg, 0, set()
        for module in model.modules():
            stack = is_experts(module)
            for p in module.parameters(recurse=False):
                if p.dim() < 2 or module is model.model.embed_tokens or id(p) in seen:
                    continue        # a tied head's weight counts once, as the head
                seen.add(id(p))
                count += p.numel() * shape.experts_per_token // shape.n_experts if stack and p.dim() == 3 else p.numel()
        return count

