"""The planted-bug catalogue: known-wrong variants of the kernels and the optimizer that the
parity suite must catch, in float32 and bfloat16, naming the tensors at fault.

Kernel bugs are registered as implementations (`attention=planted`, `cross_entropy=planted`,
`moe=planted`): plain-JAX references with one deliberate error each. Which error is live is a
runtime selector (an int32 argument of the compiled probe, read here at trace time), so ONE
compiled program per compute dtype serves the control run (selector 0: no bug, must pass) and
every kernel bug; compiling once per (bug, dtype) would cost ~7x more. Optimizer bugs change the
lowered optimizer's configuration only (`OptimizerConfig`), applied to the control run's
gradients: a recompiled update, no forward/backward.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from pallas_kernels.attention import attention_reference
from pallas_kernels.cross_entropy import linear_cross_entropy_reference
from pallas_kernels.moe import moe_experts_reference
from torch_model.rope import yarn_inv_freq


@dataclass(frozen=True)
class PlantedBug:
    """One bug. `selector` > 0: a kernel bug of the planted kernel set; `optimizer`: changes of
    the lowered OptimizerConfig (multiplied into its fields). `at_fault`: name fragments of which
    at least one must be among the failing tensors (the report names the tensors at fault)."""
    name: str
    description: str
    at_fault: tuple[str, ...]
    selector: int = 0
    optimizer: dict = field(default_factory=dict)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    why_not: str = ""               # for a dtype left out: the computed reason


SINK_GRAD_X2, WINDOW_OFF_BY_ONE, ROPE_BASE, EXPERT_X09, EXPERTS_SWAPPED, CE_COUNTS_IGNORED, Z_LOSS_SIGN = range(1, 8)
SCALED_EXPERT, SWAPPED = 1, (0, 1)          # which expert is scaled; which two are swapped
WRONG_ROPE_BASE = 10000.0                   # the Llama default, a plausible slip for 150000

CATALOGUE: tuple[PlantedBug, ...] = (
    PlantedBug("sink_grad_x2", "attention: the sinks' gradient doubled in the backward pass",
               ("self_attn.sinks",), selector=SINK_GRAD_X2),
    PlantedBug("window_off_by_one", "attention: sliding window lets each query see W+1 keys",
               ("self_attn", "logits"), selector=WINDOW_OFF_BY_ONE),
    PlantedBug("rope_base_wrong", f"attention: q/k rotated with RoPE base {WRONG_ROPE_BASE:g} instead of the config's",
               ("q_proj", "k_proj", "logits"), selector=ROPE_BASE),
    PlantedBug("expert_output_x0.9", f"moe: expert {SCALED_EXPERT}'s output scaled by 0.9",
               ("mlp.experts",), selector=EXPERT_X09),
    PlantedBug("experts_swapped", f"moe: tokens routed to expert {SWAPPED[0]} run expert {SWAPPED[1]} and back",
               ("mlp.experts",), selector=EXPERTS_SWAPPED),
    PlantedBug("ce_counts_ignored", "cross_entropy: ignored labels get a loss (as if their target were id 0)",
               ("loss", "lm_head"), selector=CE_COUNTS_IGNORED),
    PlantedBug("z_loss_sign", "cross_entropy: the log-sum-exp's gradient has the wrong sign (LM z-loss pushes up)",
               ("lm_head", "norm.weight", "bias"), selector=Z_LOSS_SIGN),   # via the hidden states
    PlantedBug("muon_lr_x2", "optimizer: Muon learning rate doubled", ("proj",), optimizer={"lr": 2.0}),
    PlantedBug("adam_eps_x100", "optimizer: AdamW epsilon x100", ("bias", "sinks", "router", "norm", "embed", "lm_head"),
               optimizer={"eps": 100.0}),
)
BUGS = {b.name: b for b in CATALOGUE}
KERNELS = "attention=planted,cross_entropy=planted,moe=planted"


def not_applicable(bug: PlantedBug, model) -> str:
    """Why `bug` cannot show on `model` ('' when it can): a bug of a part the model does not have
    (sinks, a sliding window, the LM z-loss, our RoPE: a transformers family rotates in its own
    code, which the planted attention does not re-rotate)."""
    cfg, names = model.cfg, [n for n, _ in model.named_parameters()]
    needs = {SINK_GRAD_X2: (any("sinks" in n for n in names), "the model has no attention sinks"),
             WINDOW_OFF_BY_ONE: (any(cfg.window_of_layer(i) for i in range(cfg.n_layers)),
                                 "no layer has a sliding window"),
             ROPE_BASE: (hasattr(cfg, "rope_theta"), "the model's rotary embedding is its family's own code"),
             Z_LOSS_SIGN: (cfg.lm_z_loss_coef > 0, "the model trains without an LM z-loss")}
    ok, why = needs.get(bug.selector, (True, ""))
    return "" if ok else why


# ---- the runtime selector -------------------------------------------------------------------------
_ACTIVE: list = []


@contextlib.contextmanager
def selected(selector):
    """While tracing the planted kernel set: `selector` (a traced int32 scalar) picks the live bug."""
    _ACTIVE.append(selector)
    try:
        yield
    finally:
        _ACTIVE.pop()


def _is(bug: int):
    """Traced bool: is `bug` live? False outside `selected` (the planted set then runs correct)."""
    return jnp.asarray(False) if not _ACTIVE else _ACTIVE[-1] == bug


def _scale_grad(x, factor):
    """x in the forward pass; its gradient multiplied by `factor` (a traced scalar)."""
    frozen = jax.lax.stop_gradient(x)
    return frozen + factor.astype(x.dtype) * (x - frozen)


# ---- planted kernels: each the op's reference plus one selectable error ---------------------------
def _rotate(x, positions, inv_freq, scaling, inverse=False):
    """RoPE as torch_model/rope.py (halves rotated), or its inverse. x [B, H, T, D]; positions
    [T] or per row [B, T]."""
    positions = jnp.broadcast_to(positions, (x.shape[0], x.shape[2]))[:, None, :, None]
    freqs = positions.astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(freqs) * scaling, jnp.sin(freqs) * scaling
    if inverse:                       # R^-1 = R^T / scaling^2
        cos, sin = cos / scaling ** 2, -sin / scaling ** 2
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1).astype(x.dtype)


def rope_frequencies(model_config) -> tuple:
    """(the model's inverse frequencies, the wrong base's, the YaRN scaling), computed once outside
    tracing (rope.py computes them in torch)."""
    right, scaling = yarn_inv_freq(model_config)
    wrong, _ = yarn_inv_freq(model_config.replace(rope_theta=WRONG_ROPE_BASE))
    return tuple(right), tuple(wrong), scaling


def segment_positions(segment_ids):
    """Per-row positions restarting at each run of equal segment ids [B, T] (how packed rows
    number their tokens; the parity inputs' padding, position 0 in the model, differs)."""
    t = jnp.arange(segment_ids.shape[1])
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def attention_planted(q, k, v, sinks, *, sliding_window: int, scale: float, segment_ids=None, rope=None):
    """attention_reference with: sink gradient x2; window W+1; q/k re-rotated with another RoPE base
    (`rope`: `rope_frequencies` of the model; bound by `registered`). Takes segment ids (packed
    rows) as every built-in implementation does; the RoPE bug then re-rotates each segment from
    its own start."""
    ref = functools.partial(attention_reference, scale=scale, segment_ids=segment_ids)
    sinks = _scale_grad(sinks, jnp.where(_is(SINK_GRAD_X2), 2.0, 1.0))
    if rope is not None:
        right, wrong, scaling = rope
        pos = jnp.arange(q.shape[2]) if segment_ids is None else segment_positions(segment_ids)
        fix = lambda x: _rotate(_rotate(x, pos, right, scaling, inverse=True), pos, wrong, scaling)  # noqa: E731
        rope = _is(ROPE_BASE)
        q, k = jnp.where(rope, fix(q), q), jnp.where(rope, fix(k), k)
    out = ref(q, k, v, sinks, sliding_window=sliding_window)
    if sliding_window:
        wide = ref(q, k, v, sinks, sliding_window=sliding_window + 1)
        out = jnp.where(_is(WINDOW_OFF_BY_ONE), wide, out)
    return out


def linear_cross_entropy_planted(hidden, weight, labels, *, ignore_index: int = -100):
    """linear_cross_entropy_reference with: ignored labels counted (target id 0); lse's gradient
    negated (the LM z-loss then pushes the log-sum-exp up)."""
    nll, lse = linear_cross_entropy_reference(hidden, weight, labels, ignore_index=ignore_index)
    counted, _ = linear_cross_entropy_reference(hidden, weight, jnp.where(labels == ignore_index, 0, labels),
                                                ignore_index=ignore_index)
    nll = jnp.where(_is(CE_COUNTS_IGNORED), counted, nll)
    return nll, _scale_grad(lse, jnp.where(_is(Z_LOSS_SIGN), -1.0, 1.0))


def moe_experts_planted(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha: float = 1.702,
                        limit: float = 7.0, up_shift: float = 1.0):
    """moe_experts_reference with: one expert's output x0.9; two experts' weights swapped (rows
    routed to one run the other, so the routing is wrong while the router is right)."""
    a, b = SWAPPED
    perm = jnp.arange(gate_up.shape[0]).at[a].set(b).at[b].set(a)
    swap = _is(EXPERTS_SWAPPED)
    weights = [jnp.where(swap, w[perm], w) for w in (gate_up, gate_up_bias, down, down_bias)]
    out = moe_experts_reference(x, group_sizes, *weights, alpha=alpha, limit=limit, up_shift=up_shift)
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(x.shape[0])
    in_expert = (row >= ends[SCALED_EXPERT] - group_sizes[SCALED_EXPERT]) & (row < ends[SCALED_EXPERT])
    factor = jnp.where(_is(EXPERT_X09) & in_expert, 0.9, 1.0)[:, None]
    return (out * factor).astype(out.dtype)


@contextlib.contextmanager
def registered(model_config):
    """The planted kernel set in the registry (attention needs the model's RoPE), removed after."""
    from jax_bridge import registry

    rope = rope_frequencies(model_config) if hasattr(model_config, "rope_theta") else None   # ours only
    fns = {"attention": functools.partial(attention_planted, rope=rope),
           "cross_entropy": linear_cross_entropy_planted, "moe": moe_experts_planted}
    for op, fn in fns.items():
        registry.register_implementation(op, "planted", fn, description="parity self-test: planted bugs")
    try:
        yield KERNELS
    finally:
        for op in fns:
            registry.unregister_implementation(op, "planted")


# ---- LoRA: bugs of the peft-wrapped model, live while the lowered LoRA run is traced ---------------
# Not kernels: the LoRA path is peft's torch code, traced. A bug changes it for one compile of the
# lowered run (parity/lora_parity.py), so the eager peft run stays the truth.
LORA_SCALING_TWICE = "lora_scaling_twice"
LORA_BUGS = {
    LORA_SCALING_TWICE: PlantedBug(LORA_SCALING_TWICE, "LoRA: the adapter's scaling alpha/r applied twice "
                                   "(B A x * scaling * scaling); seen only where alpha != r",
                                   ("lora_A", "lora_B", "logits"), dtypes=("float32",)),
}


@contextlib.contextmanager
def lora_bug(name: str, peft_model):
    """While tracing: the LoRA bug `name` live in `peft_model` (restored afterwards)."""
    if name not in LORA_BUGS:
        raise ValueError(f"unknown planted LoRA bug {name!r}; known: {', '.join(LORA_BUGS)}")
    layers = [m for m in peft_model.modules() if isinstance(getattr(m, "scaling", None), dict) and m.scaling]
    saved = [dict(m.scaling) for m in layers]
    for layer in layers:
        layer.scaling.update({k: v * v for k, v in layer.scaling.items()})
    try:
        yield
    finally:
        for layer, before in zip(layers, saved):
            layer.scaling.update(before)
