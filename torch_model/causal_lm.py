"""The model boundary: what the bridge, checkpoints, parity, evaluation and export take from a model.

Two models sit behind it: our GPT-OSS decoder (`torch_model/model.py`, the reference authored
here) and a transformers causal LM built from its config (`torch_model/transformers_lm.py`).
Nothing below this line names a family. A model is a `torch.nn.Module` with:

- `cfg`: its shape, with at least the fields of `DecoderShape` (`ModelConfig` has them all).
  `layer_types[i]` is any string; layers with equal strings have the same parameters and the
  same static behaviour (attention window, MoE or dense), which is what lets the bridge scan them.
- `model`: the backbone, `model(input_ids, positions=None, segment_ids=None) -> (hidden, stats)`
  (hidden: after the final norm), with `model.layers` (the decoder layers, named
  `model.layers.<i>.*`) run by `model.run_layers(x, cos, sin, *segments) -> (x, [stats per layer])`
  and each layer called as `model.call_layer(layer, x, cos, sin, *segments) -> (x, stats)`: the
  bridge replaces `run_layers` with its scan and calls `call_layer` on each layer's parameters;
  for generation and scoring, `model.forward_cached(input_ids, positions, cache, start) ->
  (hidden, cache)` runs new tokens over a static KV cache (torch_model/kv_cache.py).
- `lm_head`: the output projection (`weight` [vocab, hidden]; the embedding's when tied).
- the loss, log-probability and logit methods of `CausalLMHead`, which it inherits.

Parameters keep transformers' names (`model.embed_tokens.weight`, `lm_head.weight`, ...), which
is what the sharding and optimizer rules read by role.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from torch_model import kv_cache, ops

IGNORE_INDEX = -100
PAD_SEGMENT = 0     # the segment id of padding in packed rows (train/data/loader.py uses the same)

# Parameters that stay float32 when the model computes in bf16 (jax_bridge.step.cast_params; the
# eager float32 model is unchanged): the router, so that its logits, top-k and softmax run in
# float32 as careful MoE stacks do (Megatron-Core's moe_router_dtype=fp32): in bf16 a near-tie
# between two experts flips a token's choice, and a trained router's logits differ by less than
# bf16 resolves. Ours and gpt-oss name it `mlp.router`; transformers' other MoE families (Qwen-MoE,
# OLMoE, ...) name it `mlp.gate` (a dense MLP's `gate_proj` does not match). With the weight in
# float32, JAX promotes only the router's matmuls (forward, dW, dX) to float32: the expert combine
# and the residual stream stay bf16 (tests/test_transformers_models.py).
FLOAT32_PARAMETERS = (".mlp.router.", ".mlp.gate.")


def keeps_float32(name: str) -> bool:
    """Does the parameter `name` (per-layer or stacked) stay float32 under bf16 compute?"""
    return any(fragment in name for fragment in FLOAT32_PARAMETERS)


# Roles a model declares for parameters by structure rather than by name (jax_bridge/sharding.py
# places them; torch_model/optim.py groups a module model's): the token embedding and the head
# [V, H]; a router [E, H]; a module model's expert stack by where its hidden (model) dimension
# lies, first [E, H, N] or last [E, N, H]; a transformers expert stack stored one nn.Linear weight
# per expert, [E, out, in], where its name's rule assumes [E, in, out]; an nn.Linear [out, in] of
# a block that widens the hidden state (into attention's heads or an MLP's width) or narrows back.
ROLES = ("embedding", "head", "router", "experts_hidden_first", "experts_hidden_last", "experts_out_in", "widens",
         "narrows")
LAYER_NAME = re.compile(r"model\.layers\.(?:\d+|stack\d+)\.")


def layer_relative(name: str) -> str:
    """A layer's parameter name without its layer (`model.layers.3.mlp.x` -> `mlp.x`, stacked too)."""
    return LAYER_NAME.sub("", name, count=1) if LAYER_NAME.match(name) else name


def parameter_roles(model) -> dict[str, str]:
    """Parameter name -> role (ROLES) for what a model declares beyond its names: the expert stacks
    that transformers stores one nn.Linear weight per expert ([E, out, in]: `is_transposed` False,
    Qwen3-MoE and Mixtral; the name rules assume [E, in, out]), and a module model's roles found by
    structure (`roles()`, torch_model/module_lm.py). A layer's parameters are keyed relative to
    their layer (`mlp.experts.gate_up_proj`): every layer shares them, per-layer or stacked."""
    roles = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        if getattr(module, "is_transposed", True) is False:
            for p in module.parameters(recurse=False):
                if p.dim() == 3 and id(p) in names:
                    roles[layer_relative(names[id(p)])] = "experts_out_in"
    if hasattr(model, "roles"):
        roles.update({layer_relative(name): role for name, role in model.roles().items()})
    return roles


def declared_role(roles: dict, name: str) -> str | None:
    """The role `roles` (parameter_roles) gives parameter `name` (per-layer, stacked or not in a layer)."""
    return roles.get(layer_relative(name))


def mean_attended(seq_len: int, window: int) -> float:
    """Mean number of keys a query attends to over positions 0..T-1: causal full attention
    (window 0) sees i + 1 keys, (T + 1) / 2 on average; a sliding layer at most `window`."""
    t = seq_len
    if window <= 0 or window >= t:
        return (t + 1) / 2
    return (window * (window + 1) / 2 + (t - window) * window) / t


@dataclass(frozen=True)
class DecoderShape:
    """The fields of a model's `cfg` that the bridge reads (see the module docstring)."""
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    windows: tuple[int, ...] = ()          # each layer's sliding window (0: full attention)
    max_position_embeddings: int = 0       # the longest sequence its positions are made for (0: unstated)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    n_experts: int = 0
    experts_per_token: int = 0
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    lm_z_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def window_of_layer(self, i: int) -> int:
        return self.windows[i] if self.windows else 0

    @property
    def max_seq_len(self) -> int:
        """The default window of scoring and generation: the model's positions (ours records the
        training length instead)."""
        return self.max_position_embeddings


class CausalLMHead:
    """Loss, per-token log-probabilities and logits on top of a backbone (`self.model`) and an
    output projection (`self.lm_head`), through the fused linear cross-entropy op: no
    [tokens, vocab] logits are formed in training. Mixed into a `torch.nn.Module`."""

    def forward(self, input_ids, labels=None, positions=None, segment_ids=None, loss_weights=None,
                loss_denominator=None, router_loss_scale: float = 1.0):
        """`forward(ids)` returns logits; `forward(ids, labels)` the training loss and its parts.
        Packed rows (SFT, document masking) pass per-row `positions` and `segment_ids` [B, T]
        and `loss_weights` [B, T] (see `weighted_loss`)."""
        hidden, stats = self.model(input_ids, positions=positions, segment_ids=segment_ids)
        if labels is None:
            return self.lm_head(hidden)
        if loss_weights is None:
            return self.loss(hidden, labels, stats)
        return self.weighted_loss(hidden, labels, stats, loss_weights, loss_denominator, router_loss_scale)

    def new_cache(self, batch: int, max_len: int, dtype=torch.float32, device=None):
        """An empty generation cache for `batch` rows of at most `max_len` tokens: the static KV
        cache (torch_model/kv_cache.py) of the model's shape."""
        return kv_cache.init_cache(self.cfg, batch, max_len, dtype=dtype, device=device)

    def forward_cached(self, input_ids, positions, cache, start):
        """Generation step: T new tokens through the backbone's `forward_cached` (a static KV
        cache, torch_model/kv_cache.py); returns (logits of the last position [B, V], cache). Only
        that position's logits are formed: with left padding it is every row's newest token."""
        hidden, cache = self.model.forward_cached(input_ids, positions, cache, start)
        return self.lm_head(hidden[:, -1]), cache

    def token_logps(self, input_ids, labels, positions, segment_ids, weights, router_loss_scale: float = 1.0,
                    temperature: float = 1.0):
        """Reinforcement learning (torch_model/policy_gradient.py): each weighted label token's
        log-probability under softmax(z / temperature), the fused cross-entropy's per-token value
        negated (no [tokens, vocab] logits: z / T = (h / T) W, so the hidden state is scaled), 0
        where the weight is 0. Returns {"logps"} [B, T] float32 and "aux": the router losses as in
        the training loss (0 for a dense model), times router_loss_scale."""
        hidden, stats = self.model(input_ids, positions=positions, segment_ids=segment_ids)
        if temperature != 1.0:
            hidden = hidden / temperature
        b, t = labels.shape
        trained = weights > 0
        flat_labels = torch.where(trained, labels, torch.full_like(labels, IGNORE_INDEX)).reshape(-1)
        nll, _ = self._cross_entropy(hidden, flat_labels)
        logp = torch.where(trained, -nll.float().view(b, t), torch.zeros((), dtype=torch.float32, device=nll.device))
        aux = self._total({"ce": torch.zeros((), dtype=logp.dtype, device=logp.device)}, stats, router_loss_scale)
        return {"logps": logp, "aux": aux["loss"]}

    def answer_logps(self, input_ids, labels, positions, segment_ids, weights, label_segments,
                     router_loss_scale: float = 1.0):
        """Preference optimization (torch_model/preference.py): the log-probabilities of the
        weighted label tokens (`token_logps`) summed per segment. Returns {"sums"} [B, T + 1],
        indexed by the label's segment id (label_segments [B, T]; 0 = padding), and "aux": the
        router losses as in the training loss, times router_loss_scale."""
        out = self.token_logps(input_ids, labels, positions, segment_ids, weights, router_loss_scale)
        b, t = labels.shape
        logp = out["logps"] * weights.float()
        sums = torch.zeros(b, t + 1, dtype=logp.dtype, device=logp.device).scatter_add(1, label_segments.long(), logp)
        return {"sums": sums, "aux": out["aux"]}

    def _cross_entropy(self, hidden, flat_labels):
        return ops.OPS["cross_entropy"](hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight.to(hidden.dtype),
                                        flat_labels, IGNORE_INDEX)

    def loss(self, hidden, labels, stats):
        flat_labels = labels.reshape(-1)
        nll, lse = self._cross_entropy(hidden, flat_labels)
        n_valid = (flat_labels != IGNORE_INDEX).sum().clamp(min=1).float()
        out = {"ce": nll.sum() / n_valid}
        if self.cfg.lm_z_loss_coef:
            out["lm_z"] = lse.pow(2).sum() / n_valid
        return self._total(out, stats, 1.0)

    def weighted_loss(self, hidden, labels, stats, weights, denominator=None, router_loss_scale: float = 1.0):
        """Cross-entropy sum(w * nll) / denominator over the tokens (w: loss weights [B, T], 0 on
        what is not trained; denominator default sum(w)). A step that splits one batch into
        micro-batches passes the whole batch's sum(w) as the denominator and sums the micro-batch
        losses, so it equals the big batch exactly; router losses (batch statistics of each
        micro-batch) are scaled by router_loss_scale (1 / micro-batches: their mean)."""
        w = weights.reshape(-1).float()
        flat_labels = torch.where(w > 0, labels.reshape(-1), torch.full_like(labels.reshape(-1), IGNORE_INDEX))
        nll, lse = self._cross_entropy(hidden, flat_labels)
        denom = w.sum().clamp(min=1) if denominator is None else denominator
        out = {"ce": (nll * w).sum() / denom}
        if self.cfg.lm_z_loss_coef:
            out["lm_z"] = (lse.pow(2) * w).sum() / denom
        return self._total(out, stats, router_loss_scale)

    def _total(self, out: dict, stats, router_loss_scale: float) -> dict:
        """The loss from its parts: ce, lm_z (when on) and the router's balance and z losses
        (mean over MoE layers, times router_loss_scale)."""
        cfg = self.cfg
        loss = out["ce"]
        if "lm_z" in out:
            loss = loss + cfg.lm_z_loss_coef * out["lm_z"]
        if cfg.is_moe:
            terms = self.router_terms([s for s in stats if s is not None])    # dense layers mixed in have none
            out.update(terms)
            if cfg.router_aux_loss_coef:
                loss = loss + (cfg.router_aux_loss_coef * router_loss_scale) * terms["router_balance"]
            if cfg.router_z_loss_coef:
                loss = loss + (cfg.router_z_loss_coef * router_loss_scale) * terms["router_z"]
        out["loss"] = loss
        return out

    def router_terms(self, moe_stats: list) -> dict:
        """The router's losses and metrics from the MoE layers' stats: router_balance and
        router_z (the losses the coefficients multiply), their per-layer values and the experts'
        token fractions [MoE layers, E]. Here: the mean over layers of each layer's own terms."""
        balances = torch.stack([s["balance"] for s in moe_stats])      # [MoE layers]
        router_zs = torch.stack([s["z"] for s in moe_stats])
        return dict(router_balance=balances.mean(), router_z=router_zs.mean(),
                    router_balance_per_layer=balances.detach(), router_z_per_layer=router_zs.detach(),
                    expert_fraction=torch.stack([s["fraction"] for s in moe_stats]))
