"""LoRA through peft: the user's `--lora` spec, checked, and the torch model wrapped by peft's own
`LoraConfig` (no second LoRA is written here).

Targets name what peft adapts. `attention` (= `all-linear`): the q/k/v/o projections, the only
`nn.Linear` layers transformers' GptOss has besides `lm_head`; `lm_head` is left out because the
fused cross-entropy reads its weight directly, so an adapter there would never get a gradient (and
peft excludes the output layer on transformers models too). `experts`: peft's LoRA on the 3-D
expert tensors (`target_parameters`), rank r per expert, in transformers' orientation
(`Experts.is_transposed`). A module name (`q_proj`, `v_proj`, ...) picks single projections.
`modules_to_save` (e.g. `embed_tokens+lm_head`) trains those modules whole beside the adapters, as
peft's own `modules_to_save` (needed when fine-tuning teaches tokens the base never learned).
`base_parameter_of` maps peft's parameter names back to the base model's, for the optimizer's
groups and the sharding rules.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

from torch_model.config import ConfigError

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
TARGET_GROUPS = {"all-linear": ATTENTION_PROJECTIONS, "attention": ATTENTION_PROJECTIONS}
ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."         # what PeftModel puts before the wrapped model's names
_ADAPTER = re.compile(r"(?P<module>.+)\.lora_(?P<role>[AB])\." + ADAPTER_NAME + r"\.weight")
# peft's trained copy of a `modules_to_save` module, and the frozen original it keeps beside it.
TRAINED_COPY = f".modules_to_save.{ADAPTER_NAME}"
ORIGINAL_COPY = ".original_module"


@dataclass(frozen=True)
class LoraSpec:
    """`r=16,alpha=32,dropout=0,targets=all-linear+experts` as a value."""
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all-linear",)
    modules_to_save: tuple[str, ...] = ()    # trained whole beside the adapters (peft's modules_to_save)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @property
    def target_modules(self) -> tuple[str, ...]:
        names: list[str] = []
        for target in self.targets:
            if target == "experts":
                continue
            for name in TARGET_GROUPS.get(target, (target,)):
                if name not in names:
                    names.append(name)
        return tuple(names)

    @property
    def target_parameters(self) -> tuple[str, ...]:
        return EXPERT_PARAMETERS if "experts" in self.targets else ()

    def __str__(self) -> str:
        save = f",modules_to_save={'+'.join(self.modules_to_save)}" if self.modules_to_save else ""
        return f"r={self.r},alpha={self.alpha:g},dropout={self.dropout:g},targets={'+'.join(self.targets)}{save}"


def parse_lora_spec(text: str) -> LoraSpec:
    """Parse `key=value,...` (keys r, alpha, dropout, targets, modules_to_save; lists joined by '+')."""
    fields: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("r", "alpha", "dropout", "targets", "modules_to_save"):
            raise ConfigError(f"--lora: expected key=value with keys r, alpha, dropout, targets, modules_to_save; "
                              f"found {part!r}")
        try:
            fields[key] = (tuple(filter(None, value.split("+"))) if key in ("targets", "modules_to_save")
                           else int(value) if key == "r" else float(value))
        except ValueError:
            raise ConfigError(f"--lora: {key} must be a number, found {value!r}") from None
    spec = LoraSpec(**fields)
    check_lora_spec(spec)
    return spec


def check_lora_spec(spec: LoraSpec) -> None:
    if spec.r < 1:
        raise ConfigError(f"--lora: r must be an integer >= 1, found {spec.r}")
    if spec.alpha <= 0:
        raise ConfigError(f"--lora: alpha must be > 0, found {spec.alpha:g}")
    if not 0 <= spec.dropout < 1:
        raise ConfigError(f"--lora: dropout must be in [0, 1), found {spec.dropout:g}")
    if not spec.targets:
        raise ConfigError("--lora: targets is empty (e.g. targets=all-linear+experts)")
    if "lm_head" in spec.targets:
        raise ConfigError("--lora: lm_head cannot be adapted: the fused cross-entropy reads its weight directly, so "
                          "its adapter would get no gradient (freeze or train it whole instead)")
    if spec.dropout > 0 and "experts" in spec.targets:
        raise ConfigError(f"--lora: dropout={spec.dropout:g} with targets including experts: peft's LoRA on expert "
                          "parameters cannot apply dropout (it adapts the weight, not the input); use dropout=0 "
                          "or leave experts out")


def lora_config(spec: LoraSpec):
    """peft's LoraConfig for the spec."""
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                      target_modules=list(spec.target_modules) or None,
                      modules_to_save=list(spec.modules_to_save) or None,
                      target_parameters=list(spec.target_parameters) or None)


def apply_lora(model, spec: LoraSpec):
    """The model wrapped by peft (`PeftModel`): base parameters frozen (requires_grad False), the
    adapters trainable; parameter names gain `base_model.model.` and `.base_layer.`/`lora_A.default.`
    as peft names them. A target matching no module is an error (peft's, reworded)."""
    from peft import get_peft_model

    check_lora_spec(spec)
    from torch_model.model import has_mxfp4_experts
    if "experts" in spec.targets and has_mxfp4_experts(model):
        raise ConfigError("--lora: targets=experts on an MXFP4 expert base: peft adapts an expert stack by adding "
                          "B A to its dense weights, which an MXFP4 base does not hold; adapt attention "
                          "(targets=attention) or load the base in bf16")
    unknown = [t for t in (*spec.target_modules, *spec.modules_to_save)
               if not any(module_named(name, t) for name, _ in model.named_modules())]
    if unknown:
        raise ConfigError(f"--lora: targets {', '.join(unknown)} match no module of the model "
                          f"(choose from all-linear, attention, experts, {', '.join(ATTENTION_PROJECTIONS)})")
    with _host_shells(model, spec.modules_to_save):
        wrapped = get_peft_model(model, lora_config(spec))
    check_adapter_names(wrapped)
    return wrapped


@contextlib.contextmanager
def _host_shells(model, modules_to_save: tuple[str, ...]):
    """A base on the `meta` device (formats/mesh_loader.py places its weights on the mesh later)
    is adapted as a host one is: peft creates each adapter on the host, draws it, then moves it to
    its base layer's device, which would leave `meta` adapters with no values. So while peft wraps,
    every meta parameter becomes a host shell holding no memory (one zero, expanded to its shape),
    and afterwards a meta tensor again: the adapters keep exactly the draws a host base gives them,
    and any later read of the base's values fails loudly. A `modules_to_save` module stays on meta
    (peft copies it whole; the loader fills the copy from the base)."""
    import torch

    kept = {id(p) for name, module in model.named_modules()
            if any(module_named(name, m) for m in modules_to_save) for p in module.parameters()}
    shells, places = {}, []            # id(meta parameter) -> its shell (a tied one shared); where
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta or id(p) in kept:
                continue
            if id(p) not in shells:
                shells[id(p)] = torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                   requires_grad=p.requires_grad)
            module._parameters[name] = shells[id(p)]
            places.append((module, name))
    try:
        yield
    finally:
        metas = {}
        for module, name in places:
            p = module._parameters[name]
            if id(p) not in metas:
                metas[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                  requires_grad=p.requires_grad)
            module._parameters[name] = metas[id(p)]


def base_parameter_of(name: str) -> tuple[str, str | None]:
    """(the base model's name of the parameter, None) for a base parameter under peft's names
    (`base_model.model.` and `.base_layer` dropped), or (the name of the parameter an adapter
    adapts, "A" or "B") for `...lora_A.default.weight` / `lora_B`. peft nests one ParamWrapper
    per expert tensor in the order of `target_parameters` (the last one outermost), so
    `mlp.experts.lora_*` adapts down_proj and `mlp.experts.base_layer.lora_*` gate_up_proj
    (`check_adapter_names` holds peft to that)."""
    name = name.removeprefix(PEFT_PREFIX)
    found = _ADAPTER.fullmatch(name)
    if found is None:
        for wrapper in (".base_layer", TRAINED_COPY, ORIGINAL_COPY):
            name = name.replace(wrapper, "")
        return name, None
    module = found["module"]
    gate_up, down = (p.rsplit(".", 1)[1] for p in EXPERT_PARAMETERS)
    if module.endswith(".mlp.experts"):
        base = f"{module}.{down}"
    elif module.endswith(".mlp.experts.base_layer"):
        base = f"{module.removesuffix('.base_layer')}.{gate_up}"
    else:
        base = module.replace(".base_layer", "") + ".weight"
    return base, found["role"]


def is_expert_adapter(name: str) -> bool:
    base, role = base_parameter_of(name)
    return role is not None and base.endswith(EXPERT_PARAMETERS)


def check_adapter_names(model) -> None:
    """Every adapter's `base_parameter_of` names the tensor peft really adapts (for expert
    tensors, the ParamWrapper's `parameter_name`): the rules built on those names hold."""
    for path, module in model.named_modules():
        if not hasattr(module, "lora_A") or ADAPTER_NAME not in getattr(module, "lora_A", {}):
            continue
        owner = path.removeprefix(PEFT_PREFIX).replace(".base_layer", "")
        expected = f"{owner}.{getattr(module, 'parameter_name', 'weight')}"
        found, _ = base_parameter_of(f"{path}.lora_A.{ADAPTER_NAME}.weight")
        if found != expected:
            raise ConfigError(f"--lora: peft adapts {expected} with the adapter at {path}, but the names map it "
                              f"to {found} (peft's nesting of expert wrappers changed?)")


def unwrap(model):
    """The torch model inside a PeftModel (peft injects its layers in place), else the model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def is_adapter_parameter(name: str) -> bool:
    """Whether `name` is a LoRA A or B matrix of peft's adapter (`...lora_A.default.weight`)."""
    return _ADAPTER.fullmatch(name) is not None


def is_trained_copy(name: str) -> bool:
    """Whether `name` is a parameter of peft's trained copy of a `modules_to_save` module."""
    return TRAINED_COPY + "." in name


def trained_copy_name(module: str, parameter: str) -> str:
    """peft's name of `module.parameter` in the trained copy (e.g. the head's)."""
    return f"{module}{TRAINED_COPY}.{parameter}"


def original_of(name: str) -> str:
    """The frozen original's name of a trained copy's parameter (the base's values)."""
    return name.replace(TRAINED_COPY + ".", ORIGINAL_COPY + ".")


def module_named(path: str, wanted: str) -> bool:
    """Whether the module at `path` is one a spec names `wanted` (the whole path or its tail), as
    peft matches target_modules and modules_to_save."""
    return path == wanted or path.endswith("." + wanted)


def is_adapted(model) -> bool:
    return any(is_adapter_parameter(name) or is_trained_copy(name) for name, _ in model.named_parameters())


@contextlib.contextmanager
def swapping_parametrized_tensors(model=None):
    """peft's expert LoRA registers a torch parametrization on each forward; parametrize then
    calls `Tensor.set_`, which torchax cannot lower. With this torch flag it swaps tensors
    instead. The flag is process-global, so it is set only for the duration of a trace.
    With `model`: every module's registered parameters are put back afterwards. Under
    `functional_call` (how the bridge traces), removing the parametrization re-registers the
    traced tensor as a buffer and drops the expert Parameter (seen with peft 0.21.2, torch
    2.13): the model would come out of its first trace broken for the next one."""
    import torch

    modules = list(model.modules()) if model is not None else []
    saved = [(module, dict(module._parameters), dict(module._buffers)) for module in modules]
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
        for module, params, buffers in saved:
            for registry, before_trace in ((module._parameters, params), (module._buffers, buffers)):
                if list(registry.items()) != list(before_trace.items()):
                    for name in {*params, *buffers}:
                        module.__dict__.pop(name, None)
                    registry.clear()
                    registry.update(before_trace)


def tracing_scope(model):
    """The scope to trace `model` in: `swapping_parametrized_tensors(model)` for a model holding
    peft's layers (the train step, the scorer and the decoder trace through it), else none."""
    return swapping_parametrized_tensors(model) if is_adapted(model) else contextlib.nullcontext()


def merged_state_dict(wrapped, params: dict) -> dict:
    """The plain model's state_dict for `params` (the wrapped model's own names: base, adapters),
    the adapters merged into their base weights by peft. `wrapped` is left as it was: peft's
    merge works on a copy."""
    import copy

    import torch

    clone = copy.deepcopy(wrapped)
    with torch.no_grad():       # assign: the wrapped model's base may be on `meta` (never loaded on the host)
        unwrap(clone).load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in params.items()},
                                    assign=True)
    return {n: t.detach() for n, t in clone.merge_and_unload().state_dict().items()}
