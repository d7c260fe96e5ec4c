"""Hybrid Muon + AdamW optimizer in PyTorch.

The math is one pure function, `muon_adamw_update(params, grads, state, ...)`, of dicts of
tensors: the eager `torch.optim.Optimizer` below calls it in place, and the JAX bridge lowers
the very same function through torchax into the jitted train step.

Muon (momentum orthogonalized by a Newton-Schulz quintic) updates the weight matrices of the
blocks, each expert's matrix and each part of a fused projection on its own; AdamW updates
embeddings, LM head, routers and every vector (norms, biases, sinks, scalars). Which is which is
decided by each parameter's role and shape, for any model behind the model boundary
(`plan_parameters`). The Muon math follows `optax.contrib.muon` (EMA momentum with bias
correction, Nesterov, Frobenius pre-normalization, sqrt(max(1, fan_out/fan_in)) scaling,
decoupled weight decay), which a test cross-checks. For wide float32 matrices (n/m >= 2.7, such as
expert up-projections) the same Newton-Schulz iterate is computed on the m x m Gram matrix, with
30-45% fewer FLOPs (`gram_form_is_cheaper`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from torch_model.config import ConfigError
from torch_model.lora import base_parameter_of, is_expert_adapter, unwrap

MUON, ADAMW = "muon", "adamw"
ADAPTER_OPTIMIZERS = (MUON, ADAMW)      # what LoRA adapters of linear layers may take
OPTIMIZERS = (MUON, ADAMW)              # muon: Muon + AdamW by role; adamw: AdamW for every parameter
NS_DTYPES = ("float32", "bfloat16")     # Newton-Schulz dtypes: bfloat16 is faster on TPU


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 0.02                    # Muon learning rate
    adam_lr: float = 3e-3               # AdamW learning rate
    weight_decay: float = 0.0           # Muon decoupled weight decay
    adam_weight_decay: float = 0.0
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coeffs: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    ns_dtype: str = "float32"           # "bfloat16" is faster on TPU; parity runs need float32
    adam_betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float = 1.0          # global-norm clipping; 0 disables
    adapter_optimizer: str = MUON       # LoRA adapters of linear layers: muon | adamw (experts': adamw)
    optimizer: str = MUON               # adamw: AdamW (at adam_lr) for every parameter, Muon for none

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"OptimizerConfig.optimizer must be 'muon' or 'adamw', found {self.optimizer!r}")
        if self.adapter_optimizer not in ADAPTER_OPTIMIZERS:
            raise ValueError(f"OptimizerConfig.adapter_optimizer must be 'muon' or 'adamw', "
                             f"found {self.adapter_optimizer!r}")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"OptimizerConfig.ns_dtype must be {' or '.join(NS_DTYPES)}, found {self.ns_dtype!r}")
        for name in ("lr", "adam_lr", "eps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"OptimizerConfig.{name} must be > 0, found {getattr(self, name)}")

    def replace(self, **changes) -> "OptimizerConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ParamPlan:
    """How one parameter is optimized. For Muon: which axes are the matrix's input (fan-in) and
    output (fan-out); any leading axes are a batch of matrices (experts); `parts`: the matrices
    a fused projection holds along its output, each orthogonalized on its own."""
    kind: str
    in_axis: int = -1
    out_axis: int = -2
    parts: tuple[int, ...] = ()         # a fused projection: the sizes of its parts along out_axis


_LINEAR = ParamPlan(MUON, in_axis=-1, out_axis=-2)      # nn.Linear weight [out, in]
_X_AT_W = ParamPlan(MUON, in_axis=-2, out_axis=-1)      # x @ W weight [..., in, out]
_ADAMW = ParamPlan(ADAMW)
# nn.Linear projections that transformers' families store fused, by their role's name, and the
# parts along the output each is split into (`fused_parts`): Muon orthogonalizes each part as the
# matrix it is in the unfused families (Phi-3's qkv_proj is Llama's q, k and v projections).
FUSED_QKV, FUSED_GATE_UP = "qkv_proj", "gate_up_proj"


class UnplacedParameter(ConfigError):
    """A parameter that no rule of the optimizer's groups places (the message names it)."""


def plan_parameters(model, adapters: str = MUON, optimizer: str = MUON) -> dict[str, ParamPlan]:
    """How each trainable parameter of `model` (any model behind the model boundary, wrapped by
    peft or not) is optimized, decided by its role (the module holding it, the boundary's
    embedding, head and routers, a module model's roles found by structure) and its shape; no
    family is named (a fused projection is known by transformers' name for its role). With
    `optimizer` "adamw", every parameter takes AdamW. Otherwise:

    - AdamW: the token embedding and the head (the boundary's `model.embed_tokens` and
      `lm_head`, peft's trained copies included, and any nn.Embedding); the routers (the
      boundary's `routers()`: each MoE layer's router, whose [E, hidden] rows are the experts'
      logit directions); every vector: a tensor with fewer than two axes longer than 1 (norms,
      biases, sinks, scalars such as an activation's learned constants, a [1, hidden] gate), and an
      experts module's [E, n] per-expert biases.
    - Muon, each matrix on its own: an nn.Linear weight [out, in] (a fused `qkv_proj` or
      `gate_up_proj` split into its parts along `out`: `fused_parts`); an experts module's stack
      [E, ., .], one matrix per expert, [E, out, in] when its `is_transposed` is False
      (transformers' flag) else [E, in, out], as a module model's expert stacks (x @ W[e], as
      `torch._grouped_mm` multiplies); a 2-D weight of another module that declares how it is
      applied by the same flag (our dense MLP's x @ W).
    - LoRA adapters (peft's lora_A [r, in] / lora_B [out, r]) take `adapters`; expert adapters,
      stored by peft as one [r*E, in] / [out, r*E] matrix, always take AdamW: orthogonalizing the
      stack whole would mix the experts.

    A parameter none of these places is refused by name (`UnplacedParameter`, one line)."""
    if adapters not in ADAPTER_OPTIMIZERS:
        raise ValueError(f"optimizer: adapters must be one of {ADAPTER_OPTIMIZERS}, found {adapters!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: must be one of {OPTIMIZERS}, found {optimizer!r}")
    if optimizer == ADAMW:
        return {name: _ADAMW for name, p in model.named_parameters() if p.requires_grad}
    inner = unwrap(model)
    roles, shape = _roles(inner), getattr(inner, "cfg", None)
    plan = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue                     # frozen: no optimizer state
        base, adapter = base_parameter_of(name)
        if adapter is not None:
            plan[name] = _ADAMW if is_expert_adapter(name) or adapters == ADAMW else _LINEAR
            continue
        role, module = roles.get(base, ("unknown", None))
        plan[name] = _plan_of(name, tuple(p.shape), role, module, shape)
    return plan


def _roles(model) -> dict[str, tuple[str, object]]:
    """base parameter name -> (role, the module holding it); roles: "embedding", "router", or the
    module's own kind ("experts", "linear", "declared", "other")."""
    paths = {id(m): path for path, m in model.named_modules()}
    special = {}
    boundary = [("embedding", getattr(getattr(model, "model", None), "embed_tokens", None)),
                ("embedding", getattr(model, "lm_head", None))]
    for role, module in boundary + [("router", m) for m in _routers(model)]:
        if module is not None and id(module) in paths:
            prefix = paths[id(module)]
            for n, _ in module.named_parameters():
                special[base_parameter_of(f"{prefix}.{n}" if prefix else n)[0]] = (role, module)
    declared = {"embedding": "embedding", "head": "embedding", "router": "router",
                "experts_hidden_first": "stack", "experts_hidden_last": "stack"}
    for name, role in (model.roles() if hasattr(model, "roles") else {}).items():
        if role in declared:
            special[name] = (declared[role], None)
    roles = {}
    for path, module in model.named_modules():
        kind = ("embedding" if isinstance(module, nn.Embedding) else "experts" if _is_experts(module)
                else "linear" if isinstance(module, nn.Linear) else "declared" if hasattr(module, "is_transposed")
                else "other")
        for n, _ in module.named_parameters(recurse=False):
            base = base_parameter_of(f"{path}.{n}" if path else n)[0]
            roles.setdefault(base, special.get(base, (kind, module)))
    return roles


def _routers(model) -> list:
    """The MoE layers' router modules: the boundary's `routers()`, or for a transformers
    *ForCausalLM itself (an eager reference) the modules it records router logits from."""
    if hasattr(model, "routers"):
        return [module for _, module in model.routers()]
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    return [] if recorder is None else [m for m in model.modules() if isinstance(m, recorder.target_class)]


def _is_experts(module) -> bool:
    """A module holding stacks of expert matrices [E, ., .] (ours, transformers' experts)."""
    return hasattr(module, "is_transposed") and any(p.dim() == 3 for p in module.parameters(recurse=False))


def _plan_of(name: str, shape: tuple, role: str, module, model_shape) -> ParamPlan:
    def refuse(why: str):
        raise UnplacedParameter(f"optimizer: no rule places parameter {name} {shape} "
                                f"({type(module).__name__ if module is not None else 'no module'}): {why}")

    long_axes = sum(n > 1 for n in shape)
    if role in ("embedding", "router") or long_axes < 2:
        return _ADAMW
    if role == "stack":
        if len(shape) != 3:
            refuse("a module model's expert stack is [E, ., .]")
        return _X_AT_W                      # [E, in, out]: x @ W[e]
    if role == "experts":
        if len(shape) == 2:
            return _ADAMW                   # [E, n]: a vector per expert (biases)
        if len(shape) != 3:
            refuse("an experts module's tensors are [E, n] vectors or [E, ., .] matrices per expert")
        return _X_AT_W if module.is_transposed else _LINEAR
    if len(shape) != 2:
        refuse(f"a {len(shape)}-D tensor outside an experts module (Muon takes matrices, AdamW vectors)")
    if role == "linear":
        parts = fused_parts(name, shape, model_shape)
        return dataclasses.replace(_LINEAR, parts=parts) if parts else _LINEAR
    if role == "declared":
        return _X_AT_W if module.is_transposed else _LINEAR
    refuse("a matrix of a module that is neither nn.Linear nor declares its layout (is_transposed)")


def fused_parts(name: str, shape: tuple, model_shape) -> tuple[int, ...]:
    """The parts of a fused nn.Linear projection [out, in] along `out`, or () for an unfused one:
    a `qkv_proj` is [q; k; v] (heads x head_dim, then twice kv_heads x head_dim, from the model's
    shape), a `gate_up_proj` [gate; up], two halves (as transformers' Phi-3 and GLM split them)."""
    module = base_parameter_of(name)[0].rsplit(".", 1)[0]
    if module.endswith("." + FUSED_QKV):
        if model_shape is None:
            raise UnplacedParameter(f"optimizer: {name} {shape}: a fused {FUSED_QKV} of a model without a shape "
                                    f"(cfg: heads, kv heads, head_dim) cannot be split into q, k and v")
        q, kv = model_shape.n_heads * model_shape.head_dim, model_shape.n_kv_heads * model_shape.head_dim
        if q + 2 * kv != shape[0]:
            raise UnplacedParameter(f"optimizer: {name} {shape}: a fused {FUSED_QKV} of {shape[0]} rows is not "
                                    f"q, k and v of this model ({q} + 2 x {kv} rows)")
        return (q, kv, kv)
    if module.endswith("." + FUSED_GATE_UP):
        if shape[0] % 2:
            raise UnplacedParameter(f"optimizer: {name} {shape}: a fused {FUSED_GATE_UP} of an odd number of rows "
                                    f"is not gate and up halves")
        return (shape[0] // 2, shape[0] // 2)
    return ()


def init_state(params: dict[str, torch.Tensor], plan: dict[str, ParamPlan]) -> dict:
    """Optimizer state as a pytree of tensors (what the jitted step carries)."""
    muon = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items() if plan[n].kind == MUON}
    adam = [n for n, p in params.items() if plan[n].kind == ADAMW]
    return {
        "step": torch.zeros((), dtype=torch.float32),
        "momentum": muon,
        "exp_avg": {n: torch.zeros_like(params[n], dtype=torch.float32) for n in adam},
        "exp_avg_sq": {n: torch.zeros_like(params[n], dtype=torch.float32) for n in adam},
    }


def newton_schulz(g: torch.Tensor, steps: int, coeffs, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Approximate orthogonal polar factor of each matrix in the last two axes (quintic)."""
    a, b, c = coeffs
    x = g.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:                      # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)
    if dtype == torch.float32 and gram_form_is_cheaper(x.shape[-2], x.shape[-1], steps):
        x = _newton_schulz_on_gram(x, steps, a, b, c)
    else:
        eye = torch.eye(x.shape[-2], dtype=x.dtype, device=x.device)
        for _ in range(steps):
            gram = x @ x.mT
            # a x + (b A + c A^2) x as one product: a separate a x + ... is a pass over x of its
            # own (XLA does not fuse it into the matmul: three reads and writes of x per step).
            x = (b * gram + c * gram @ gram + a * eye) @ x
    if transposed:
        x = x.mT
    return x.to(g.dtype)


def gram_form_is_cheaper(m: int, n: int, steps: int) -> bool:
    """Whether `_newton_schulz_on_gram` costs at most 0.7x the plain iteration for an [m, n]
    matrix (m <= n): n / m >= 2.7 at 5 steps, such as expert up-projections [d_model,
    2 x expert_dim]. In FLOPs (x 2 m^3): the plain form costs steps x (2 n/m + 1), the Gram form
    2 n/m + 4 steps - 3. Nearer-square matrices keep the plain form: their saving is small, and
    the Gram form's float32 rounding is 1.3-1.5x the plain form's (`scripts/step_experiments.py
    ns_accuracy`), enough to move tiny's lowered update 2e-5 from the eager one on a [128, 256]
    matrix, where the plain form stays within the 1e-5 that tests/test_lowering.py asks."""
    r = n / m
    return 4 * r + 8 * steps - 6 <= 0.7 * steps * (4 * r + 2)


def _newton_schulz_on_gram(x: torch.Tensor, steps: int, a: float, b: float, c: float) -> torch.Tensor:
    """The same quintic iteration carried out on the m x m Gram matrix only. Every iterate is
    x_k = Q_k x_0 with Q_k a polynomial in A_0 = x_0 x_0^T, so with B_k = b A_k + c A_k^2:
    Q_{k+1} = (a I + B_k) Q_k and A_{k+1} = (a I + B_k)^2 A_k (the factors commute); x_0 is
    multiplied once at the end. Equal to the plain form in exact arithmetic; in float32 its error
    against a float64 run is 1.3-1.5x the plain form's (BENCHMARKS.md, the train step)."""
    gram = x @ x.mT
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    q = None
    for k in range(steps):
        factor = b * gram + c * gram @ gram + a * eye            # a I + B_k
        q = factor if q is None else factor @ q
        if k + 1 < steps:
            gram = factor @ (factor @ gram)
    return q @ x


def global_grad_norm(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum(g.float().pow(2).sum() for g in grads.values()))


def muon_adamw_update(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], state: dict,
                      plan: dict[str, ParamPlan], cfg: OptimizerConfig, lr_scale=1.0, orthogonalize=None):
    """One optimizer step as a pure function: returns (new_params, new_state, stats).

    `lr_scale` multiplies both learning rates (the schedule); it may be a tensor. Parameters may
    carry leading axes (stacked layers, experts): Muon treats each matrix in the last two axes
    on its own. `orthogonalize(name, u, steps, coeffs, eps, dtype)` replaces
    `newton_schulz(u, steps, coeffs, eps, dtype)` if given (the JAX bridge passes one that
    places whole matrices on devices first).
    """
    step = state["step"] + 1
    grad_norm = global_grad_norm(grads)
    clip = torch.ones((), dtype=torch.float32)
    if cfg.max_grad_norm > 0:
        clip = torch.clamp(cfg.max_grad_norm / (grad_norm + 1e-6), max=1.0)
    ns_dtype = torch.bfloat16 if cfg.ns_dtype == "bfloat16" else torch.float32
    beta = cfg.momentum
    b1, b2 = cfg.adam_betas
    new_params, momentum, exp_avg, exp_avg_sq = {}, {}, {}, {}
    for name, p in params.items():
        g = grads[name].float() * clip
        rule = plan[name]
        if rule.kind == MUON:
            m = beta * state["momentum"][name] + (1 - beta) * g
            if cfg.nesterov:
                u = beta * m / (1 - beta ** (step + 1)) + (1 - beta) * g / (1 - beta ** step)
            else:
                u = m / (1 - beta ** step)
            settings = (cfg.ns_steps, cfg.ns_coeffs, cfg.eps, ns_dtype)
            fan_in = p.shape[rule.in_axis]
            if rule.parts:          # a fused projection: each part is its own matrix (GSPMD places the parts)
                ortho = torch.cat([newton_schulz(part, *settings) * math.sqrt(max(1.0, part.shape[rule.out_axis] / fan_in))
                                   for part in u.split(rule.parts, dim=rule.out_axis)], dim=rule.out_axis)
            else:
                ortho = orthogonalize(name, u, *settings) if orthogonalize else newton_schulz(u, *settings)
                ortho = ortho * math.sqrt(max(1.0, p.shape[rule.out_axis] / fan_in))
            update = ortho + cfg.weight_decay * p.float()
            new_params[name] = (p.float() - cfg.lr * lr_scale * update).to(p.dtype)
            momentum[name] = m
        else:
            m = b1 * state["exp_avg"][name] + (1 - b1) * g
            v = b2 * state["exp_avg_sq"][name] + (1 - b2) * g * g
            m_hat = m / (1 - b1 ** step)
            v_hat = v / (1 - b2 ** step)
            update = m_hat / (torch.sqrt(v_hat) + cfg.eps) + cfg.adam_weight_decay * p.float()
            new_params[name] = (p.float() - cfg.adam_lr * lr_scale * update).to(p.dtype)
            exp_avg[name], exp_avg_sq[name] = m, v
    new_state = {"step": step, "momentum": momentum, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return new_params, new_state, {"grad_norm": grad_norm, "grad_norm_clipped": grad_norm * clip}


class MuonAdamW(torch.optim.Optimizer):
    """Eager wrapper: parameter groups built explicitly (one Muon, one AdamW), each parameter in
    exactly one; `step()` applies `muon_adamw_update` in place."""

    def __init__(self, model: nn.Module, cfg: OptimizerConfig = OptimizerConfig()):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]   # frozen: no state
        self.plan = plan_parameters(model, cfg.adapter_optimizer, cfg.optimizer)
        self.cfg = cfg
        self.names = {id(p): n for n, p in named}
        groups = [{"params": [p for n, p in named if self.plan[n].kind == kind], "kind": kind}
                  for kind in (MUON, ADAMW)]
        groups = [g for g in groups if g["params"]]
        super().__init__(groups, defaults={})
        covered = [id(p) for g in self.param_groups for p in g["params"]]
        assert sorted(covered) == sorted(id(p) for _, p in named) and len(set(covered)) == len(covered), \
            "every parameter must land in exactly one group"
        self.pure_state = init_state({n: p.detach() for n, p in named}, self.plan)
        self.lr_scale = 1.0

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        params, grads = {}, {}
        for group in self.param_groups:
            for p in group["params"]:
                name = self.names[id(p)]
                params[name] = p.detach()
                grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
        new_params, self.pure_state, self.last_stats = muon_adamw_update(
            params, grads, self.pure_state, self.plan, self.cfg, self.lr_scale)
        for group in self.param_groups:
            for p in group["params"]:
                p.copy_(new_params[self.names[id(p)]])
        return loss
