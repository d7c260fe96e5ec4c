"""A user's own causal LM, a plain `torch.nn.Module`, behind the model boundary (causal_lm.py).

The module is the researcher's code, untouched: `forward(tokens [B, T] int64)` returns the
logits [B, T, V] (a tensor, the first item of a tuple or list, or `.logits`). What the bridge
needs of it is read from a probe of its forward (jax_bridge/module_probe.py fills `ModuleFacts`),
never from names:

- the token embedding: the nn.Embedding the tokens go through;
- the head: the nn.Linear whose output the forward returns as the logits. The loss then takes
  that Linear's input (the final hidden state) through the fused cross-entropy op and no
  [B, T, V] logits are formed; otherwise the plain loss runs on the module's logits;
- the blocks: a ModuleList or ModuleDict of structurally identical blocks, each called once, in
  order, on the previous one's output (the other arguments the same). The bridge then runs them
  as it runs ours (stacked and scanned, remat per block): the first block's call runs the whole
  stack, the others pass their input through. Anything else runs unrolled, as the module does;
- every `F.scaled_dot_product_attention` call (torch_model/sdpa.py decides which reach the
  `attention` op), and each parameter's role for sharding and the optimizer.

Parameters get the boundary's names where they have a role: `model.embed_tokens.weight`,
`model.layers.<i>.<the block's own names>`, `lm_head.weight`; every other one keeps its own path
under `module.`. `own_names` maps them back: exports and `state_dict()` speak the module's names.
`ModuleSpec` is such a model's record in checkpoints (how to build it again, and its facts).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn

from torch_model.causal_lm import IGNORE_INDEX, CausalLMHead, DecoderShape, mean_attended
from torch_model.transformers_truth import UnsupportedModel, first_line

# ---- the record ---------------------------------------------------------------------------------
def import_factory(spec: str):
    """The class or function SPEC names: `path/to/file.py:NAME` or `package.module:NAME`."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UnsupportedModel(f"--module {spec!r}: expected path/to/file.py:NAME or package.module:NAME")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UnsupportedModel(f"--module {spec}: no file {path}")
        module_name = "torchlyra_module_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        loader = importlib.util.spec_from_file_location(module_name, path)
        imported = importlib.util.module_from_spec(loader)
        folder = str(path.resolve().parent)
        sys.path.insert(0, folder)        # the file's own imports of its neighbours
        try:
            sys.modules[module_name] = imported
            loader.loader.exec_module(imported)
        except Exception as e:  # noqa: BLE001 - whatever the user's file raises is the answer
            sys.modules.pop(module_name, None)
            raise UnsupportedModel(f"--module {spec}: importing {path} failed: {first_line(e)}") from None
        finally:
            sys.path.remove(folder)
    else:
        try:
            imported = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001
            raise UnsupportedModel(f"--module {spec}: importing {where} failed: {first_line(e)}") from None
    factory = getattr(imported, name, None)
    if factory is None or not callable(factory):
        raise UnsupportedModel(f"--module {spec}: {where} has no class or function named {name}")
    return factory


def source_files(spec: str) -> list[Path]:
    """The files whose contents the run records: the file, or the package's (or module's) files."""
    where = spec.rpartition(":")[0]
    if where.endswith(".py"):
        return [Path(where).resolve()]
    top = importlib.util.find_spec(where.split(".")[0])
    if top is None or top.origin is None:
        return []
    if top.submodule_search_locations:
        root = Path(next(iter(top.submodule_search_locations)))
        return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    return [Path(top.origin)]


def source_hash(spec: str) -> str:
    digest = hashlib.sha256()
    for path in source_files(spec):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def instantiate(spec: str, args: dict, *, meta: bool = False) -> nn.Module:
    """The module SPEC's factory makes from the keyword arguments `args`. `meta`: its parameters on
    the `meta` device (no weights: a loader or a plan fills them), its buffers computed as the
    module computes them (a rotary table), which checkpoints do not hold (accelerate's
    init_empty_weights, buffers kept)."""
    factory = import_factory(spec)
    try:
        with _parameters_on_meta() if meta else contextlib.nullcontext():
            module = factory(**args)
    except Exception as e:  # noqa: BLE001
        raise UnsupportedModel(f"--module {spec}: {getattr(factory, '__name__', spec)}(**{json.dumps(args)}) "
                               f"raised {first_line(e)}") from None
    if not isinstance(module, nn.Module):
        raise UnsupportedModel(f"--module {spec}: the factory returned a {type(module).__name__}, expected a "
                               f"torch.nn.Module")
    return module


def _parameters_on_meta():
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


@dataclass(frozen=True)
class AttentionCall:
    """One SDPA call the probe saw: its heads and sizes, and why the `attention` op cannot take it
    ("" when it does)."""
    heads: int
    kv_heads: int
    head_dim: int
    queries: int
    keys: int
    causal: bool
    unroutable: str = ""


@dataclass(frozen=True)
class ModuleFacts:
    """What the probe of a module's forward found (see the module docstring)."""
    vocab_size: int
    d_model: int
    output: str                          # how the forward returns the logits: tensor | first | logits
    embedding: str | None                # the token nn.Embedding's path in the module
    head: str | None                     # the nn.Linear whose output is the logits (None: not fused)
    head_reason: str                     # why the head is not fused ("" when it is)
    blocks: str | None                   # the ModuleList / ModuleDict run as the layers (None: unrolled)
    blocks_reason: str                   # why the blocks run unrolled ("" when they do not)
    block_types: tuple[str, ...]         # per block, a name for its static behaviour (equal: scanned together)
    attention: tuple[AttentionCall, ...]
    roles: dict                          # the module's parameter name -> one of causal_lm.ROLES
    matmul_flops_per_token: float        # forward matmul FLOPs per token, attention's scores aside
    params: int                          # parameters, a tied one once
    active_params: int                   # those a token goes through: the matmuls' (FLOPs / 2) and the embedding
    unused_outputs: tuple[str, ...] = ()  # what the forward returns beside the logits (not in the loss)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["block_types"], d["attention"] = list(self.block_types), [dataclasses.asdict(a) for a in self.attention]
        d["unused_outputs"] = list(self.unused_outputs)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModuleFacts":
        return cls(**{**d, "block_types": tuple(d["block_types"]),
                      "attention": tuple(AttentionCall(**a) for a in d["attention"]),
                      "unused_outputs": tuple(d.get("unused_outputs", ()))})

    @property
    def n_layers(self) -> int:
        return len(self.block_types)

    def shape(self, max_seq_len: int = 0, bos_token_id=None, eos_token_id=None) -> DecoderShape:
        """The DecoderShape the bridge reads: heads from the first attention call (all of them
        when they agree), the blocks as layers."""
        first = self.attention[0] if self.attention else AttentionCall(1, 1, self.d_model, 0, 0, True)
        return DecoderShape(vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
                            n_heads=first.heads, n_kv_heads=first.kv_heads, head_dim=first.head_dim,
                            layer_types=self.block_types, max_position_embeddings=max_seq_len,
                            bos_token_id=bos_token_id, eos_token_id=eos_token_id)

    def report(self, kernels: dict | None = None) -> list[str]:
        """What went where, one line each: attention calls per implementation, the head, the blocks."""
        routed = [a for a in self.attention if not a.unroutable]
        plain = [a for a in self.attention if a.unroutable]
        impl = f"attention={kernels['attention']}" if kernels else "the attention op"
        lines = [f"attention: {len(routed)} of {len(self.attention)} SDPA calls -> {impl}"
                 + (f"; {len(plain)} plain ({plain[0].unroutable})" if plain else "")]
        lines.append(f"head: {self.head} fused with the cross-entropy op" if self.head else
                     f"head: not fused, the plain loss on the logits ({self.head_reason})")
        lines.append(f"blocks: {self.blocks} ({self.n_layers} blocks) run as the layers" if self.blocks else
                     f"blocks: unrolled as the module runs them ({self.blocks_reason})")
        if self.unused_outputs:     # an auxiliary loss the module returns is not trained on: said, not hidden
            lines.append(f"outputs: the loss is the logits' cross-entropy alone; not added to it: "
                         f"{', '.join(self.unused_outputs)}")
        return lines


class ModuleSpec:
    """A module model's record in checkpoints and metrics (the counterpart of ModelConfig): the
    SPEC and arguments that build it again, a hash of its source, its facts and the training
    length (the default window of scoring and generation). `to_dict()` is {"module": {...}}."""

    KEY = "module"

    def __init__(self, spec: str | None, args: dict, source: str | None, facts: ModuleFacts, max_seq_len: int = 0,
                 bos_token_id=None, eos_token_id=None):
        self.spec, self.args, self.source, self.facts = spec, dict(args), source, facts
        self.max_seq_len, self.bos_token_id, self.eos_token_id = max_seq_len, bos_token_id, eos_token_id

    @classmethod
    def is_spec_dict(cls, d) -> bool:
        return isinstance(d, dict) and set(d) == {cls.KEY}

    def to_dict(self) -> dict:
        return {self.KEY: {"spec": self.spec, "args": self.args, "source": self.source, "facts": self.facts.to_dict(),
                           "max_seq_len": self.max_seq_len, "bos_token_id": self.bos_token_id,
                           "eos_token_id": self.eos_token_id}}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "ModuleSpec":
        body = d[cls.KEY]
        try:
            return cls(body["spec"], body["args"], body["source"], ModuleFacts.from_dict(body["facts"]),
                       body.get("max_seq_len", 0), body.get("bos_token_id"), body.get("eos_token_id"))
        except (KeyError, TypeError) as e:
            raise UnsupportedModel(f"{where}: a module record with a missing or bad field ({e})") from None

    def replace(self, **changes) -> "ModuleSpec":
        fields = {"max_seq_len": self.max_seq_len, "bos_token_id": self.bos_token_id,
                  "eos_token_id": self.eos_token_id, "facts": self.facts}
        unknown = set(changes) - set(fields)
        if unknown:
            raise UnsupportedModel(f"module record: {', '.join(sorted(unknown))} cannot change (the module's own "
                                   f"arguments shape it: --module-args)")
        fields.update(changes)
        return ModuleSpec(self.spec, self.args, self.source, **fields)

    @property
    def shape(self) -> DecoderShape:
        return self.facts.shape(self.max_seq_len, self.bos_token_id, self.eos_token_id)

    def __getattr__(self, name):
        # What the bridge and the run's bookkeeping read of a ModelConfig: the DecoderShape fields.
        if name.startswith("_") or name in ("spec", "args", "source", "facts", "max_seq_len"):
            raise AttributeError(name)
        return getattr(self.shape, name)

    @property
    def model_type(self) -> str:
        return self.spec or "module"

    def param_counts(self) -> dict[str, int]:
        return {"total": self.facts.params, "active": self.facts.active_params}

    def training_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward (3 x forward) FLOPs per token at `seq_len`: the probe's matmuls, and
        each SDPA call's scores and weighted values (4 x heads x head_dim x mean attended keys)."""
        attention = sum(4.0 * a.heads * a.head_dim * (mean_attended(seq_len, 0) if a.causal else seq_len)
                        for a in self.facts.attention)
        return 3.0 * (self.facts.matmul_flops_per_token + attention)

    def describe(self) -> str:
        return f"{self.spec} {json.dumps(self.args)}" if self.spec else "a module given from Python"

    def unrouted_ops(self) -> dict[str, str]:
        """The registry's ops this module never calls, each with why: its kernels would run nothing."""
        out = {"moe": "a module's experts are its own code (3-D stacks through torch._grouped_mm, lowered to "
                      "jax.lax.ragged_dot)"}
        if not any(not a.unroutable for a in self.facts.attention):
            out["attention"] = (f"none of its {len(self.facts.attention)} SDPA calls can take the op"
                                if self.facts.attention else "it makes no SDPA call")
        if not self.facts.head:
            out["cross_entropy"] = f"its head is not fused ({self.facts.head_reason})"
        return out


# ---- the model behind the boundary ----------------------------------------------------------------
def output_logits(out, how: str | None = None):
    """The logits in what a module's forward returned: a tensor, the first item of a tuple or list,
    or `.logits`; `how` names which (the probe's `output`), None: whichever it is."""
    if how in (None, "tensor") and isinstance(out, torch.Tensor):
        return out
    if how in (None, "first") and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if how in (None, "logits") and isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    raise UnsupportedModel(f"the module's forward returned {type(out).__name__}; expected the logits [B, T, V] "
                           f"as a tensor, the first item of a tuple or list, or `.logits`")


def output_kind(out) -> str:
    output_logits(out)
    return "tensor" if isinstance(out, torch.Tensor) else "first" if isinstance(out, (tuple, list)) else "logits"


def unused_outputs(out) -> tuple[str, ...]:
    """What a module's forward returns beside the logits, which the loss does not take (an MoE
    balance loss, a cache, hidden states): the other items of a tuple or list, the other set
    fields of an output object, each as `name (shape)`."""
    def described(name, value):
        shape = f"[{', '.join(map(str, value.shape))}]" if isinstance(value, torch.Tensor) else type(value).__name__
        return f"{name} ({'a scalar' if shape == '[]' else shape})"

    if isinstance(out, (tuple, list)):
        return tuple(described(f"item {i}", v) for i, v in enumerate(out) if i and v is not None)
    if isinstance(out, torch.Tensor):
        return ()
    fields = out.items() if hasattr(out, "items") else getattr(out, "__dict__", {}).items()
    return tuple(described(k, v) for k, v in fields if k != "logits" and v is not None and not k.startswith("_"))


class ModuleCache(NamedTuple):
    """Generation's state for a module without a KV cache: each row's tokens so far, left-aligned
    at their positions ([B, max_len] int32); every step runs the module over all of them."""
    tokens: torch.Tensor


class ModuleBackbone(nn.Module):
    """The module run as the bridge needs it: `forward(input_ids) -> (hidden or logits, stats)`,
    with the blocks' loop reachable as `run_layers(x, args, kwargs)` and each block called by
    `call_layer(block, x, args, kwargs)`. `layers` (the module's own block container, registered
    here only when the blocks run as layers) and `embed_tokens` give the boundary's names."""

    def __init__(self, module: nn.Module, facts: ModuleFacts):
        super().__init__()
        self.facts = facts
        if facts.embedding:
            self.embed_tokens = module.get_submodule(facts.embedding)
        if facts.blocks:
            self.layers = module.get_submodule(facts.blocks)
        object.__setattr__(self, "_module", module)        # not registered here: ModuleCausalLM holds it
        self._direct = False
        self.truth = False          # ModuleCausalLM.reference_twin: the module's own forward, nothing stood in

    def _blocks(self) -> list[nn.Module]:
        layers = self.layers
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)

    def forward(self, input_ids, positions=None, segment_ids=None):
        """(the final hidden state [B, T, H] when the head is fused, else the logits, stats)."""
        if self.truth:
            return output_logits(self._module(input_ids), self.facts.output), [None] * self.facts.n_layers
        if positions is not None or segment_ids is not None:
            raise UnsupportedModel("a module model takes tokens only: packed rows (positions, segment ids) are "
                                   "refused (train with --no-document-masking on text data)")
        with self._calls() as seen:
            logits = output_logits(self._module(input_ids), self.facts.output)
        return (seen["hidden"] if self.facts.head else logits), [None] * self.facts.n_layers

    @contextlib.contextmanager
    def _calls(self):
        """While the module runs: the head hands its input over (`hidden`), and the first block's
        call runs `run_layers` (the others pass their input through)."""
        seen: dict = {}
        saved = []

        def capture(head):
            original = head.forward

            def forward(x, *args, **kwargs):
                seen["hidden"] = x
                return original(x, *args, **kwargs)
            return forward

        def stand_in(i, block):
            original = block.forward

            def forward(*args, **kwargs):
                if self._direct:
                    return original(*args, **kwargs)
                if i == 0:
                    out, _ = self.run_layers(args[0], tuple(args[1:]), dict(kwargs))
                    return out
                return args[0]
            return forward

        targets = [(self._module.get_submodule(self.facts.head), capture)] if self.facts.head else []
        if self.facts.blocks:
            targets += [(block, lambda b, i=i: stand_in(i, b)) for i, block in enumerate(self._blocks())]
        for module, make in targets:
            saved.append((module, module.__dict__.get("forward")))
            module.forward = make(module)
        try:
            yield seen
        finally:
            for module, previous in reversed(saved):
                del module.forward
                if previous is not None:
                    module.forward = previous

    def run_layers(self, x, args=(), kwargs=None):
        for block in self._blocks():
            x, _ = self.call_layer(block, x, args, kwargs)
        return x, [None] * self.facts.n_layers

    def call_layer(self, layer, x, args=(), kwargs=None):
        """One block, called as the module's loop calls it."""
        self._direct, before = True, self._direct
        try:
            return layer(x, *args, **(kwargs or {})), None
        finally:
            self._direct = before

    def forward_cached(self, input_ids, positions, cache: ModuleCache, start):
        """New tokens [B, T] at per-row `positions` (-1: padding) written into each row's tokens,
        then the whole of them through the module; returns (the hidden state or logits of each
        row's newest token [B, 1, .], cache). The causal module sees no token past a position, so
        the slots not written yet change nothing."""
        del start
        tokens = cache.tokens
        length = tokens.shape[1]
        index = torch.where(positions >= 0, positions, torch.full_like(positions, length)).long()
        wide = torch.cat([tokens, tokens[:, :1]], dim=1)             # one spare slot takes the padding
        tokens = wide.scatter(1, index, input_ids.to(tokens.dtype))[:, :length]
        out, _ = self.forward(tokens)
        last = positions[:, -1].clamp(min=0).long()
        picked = torch.gather(out, 1, last.view(-1, 1, 1).expand(-1, 1, out.shape[-1]))
        return picked, ModuleCache(tokens)


class ModuleCausalLM(CausalLMHead, nn.Module):
    """A plain module behind the boundary (see the module docstring)."""

    kv_cache = False        # the scorer shares no context: a module's cache holds whatever it keeps

    def __init__(self, module: nn.Module, facts: ModuleFacts, max_seq_len: int = 0, bos_token_id=None,
                 eos_token_id=None, truth: bool = False):
        """truth: run the module as its author wrote it (see `reference_twin`)."""
        super().__init__()
        self.model = ModuleBackbone(module, facts)
        self.truth = self.model.truth = truth
        if facts.head:
            self.lm_head = module.get_submodule(facts.head)
        self.module = module
        self.facts = facts
        self.cfg = self.model.cfg = facts.shape(max_seq_len, bos_token_id, eos_token_id)

    @property
    def fused_head(self) -> bool:
        return self.facts.head is not None and not self.truth

    def reference_twin(self) -> "ModuleCausalLM":
        """The same module and weights, run as its author wrote it: its own forward, its logits'
        plain cross-entropy (no stand-in for the blocks, no fused op): the parity suite's ground truth."""
        twin = copy.deepcopy(self)
        twin.truth = twin.model.truth = True
        return twin

    def forward(self, input_ids, labels=None, positions=None, segment_ids=None, loss_weights=None,
                loss_denominator=None, router_loss_scale: float = 1.0):
        if self.truth and labels is None:
            return output_logits(self.module(input_ids), self.facts.output)
        if labels is None and not self.fused_head:
            return self.model(input_ids, positions, segment_ids)[0]
        return super().forward(input_ids, labels, positions, segment_ids, loss_weights, loss_denominator,
                               router_loss_scale)

    @property
    def follows_cache_protocol(self) -> bool:
        """Whether the module brings its own decode cache (docs/own-model.md): `init_cache(batch,
        max_len, dtype, device)` and `forward_cached(tokens, positions, cache) -> (logits, cache)`."""
        return all(callable(getattr(self.module, name, None)) for name in ("init_cache", "forward_cached"))

    def forward_cached(self, input_ids, positions, cache, start):
        if self.follows_cache_protocol:
            out, cache = self.module.forward_cached(input_ids, positions, cache)
            return output_logits(out)[:, -1], cache
        out, cache = self.model.forward_cached(input_ids, positions, cache, start)
        return (self.lm_head(out[:, -1]) if self.fused_head else out[:, -1]), cache

    def routers(self) -> list:
        """The boundary's routers, which return (logits, weights, chosen experts): a module's own
        router is its code's, with no such protocol (see `logit_routers`); the routing checks of
        the parity suite do not apply."""
        return []

    def logit_routers(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of each module whose weight the probe found to be a router [E, H], in the
        order the module runs its blocks: each returns router logits, its code taking the top-k
        (the parity suite runs the lowered model on the eager run's logits, parity/runs.py)."""
        owners = {name.rsplit(".", 1)[0] for name, role in self.roles().items() if role == "router"}
        return [(name, m) for name, m in self.named_modules() if name in owners]

    def new_cache(self, batch: int, max_len: int, dtype=torch.float32, device=None):
        """The module's own cache (the protocol), else each row's tokens (ModuleCache)."""
        if self.follows_cache_protocol:
            return self.module.init_cache(batch, max_len, dtype, device)
        return ModuleCache(torch.zeros((batch, max_len), dtype=torch.int32, device=device))

    def _cross_entropy(self, hidden, flat_labels):
        if self.fused_head:
            return super()._cross_entropy(hidden, flat_labels)
        return plain_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), flat_labels)

    def own_names(self) -> dict[str, str]:
        """Boundary parameter and buffer name -> the module's own `state_dict()` name (every
        name the module gives a tensor; a tied tensor under each of its names)."""
        boundary: dict[int, str] = {}
        for n, t in [*self.named_parameters(), *self.named_buffers()]:
            boundary.setdefault(id(t), n)
        out: dict[str, list[str]] = {}
        for own, tensor in self.module.state_dict(keep_vars=True).items():
            out.setdefault(boundary[id(tensor)], []).append(own)
        return {n: owns[0] for n, owns in out.items()}

    def own_module_path(self, path: str) -> str:
        """A submodule's path under the boundary's names -> its path in the module
        (`model.layers.0.attention.wq` -> `blocks.0.attention.wq`), for files keyed by module path
        (peft's adapters)."""
        target = self.get_submodule(path)
        return next(own for own, m in self.module.named_modules(remove_duplicate=False) if m is target)

    def roles(self) -> dict[str, str]:
        """Boundary parameter name -> its role (causal_lm.ROLES), for the parameters the probe gave one."""
        own = {o: b for b, o in self.own_names().items()}
        return {own[name]: role for name, role in self.facts.roles.items() if name in own}


def plain_cross_entropy(logits, labels):
    """(nll [N], lse [N]) float32 of logits [N, V], 0 at IGNORE_INDEX: the fused op's values,
    from logits the module formed itself."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != IGNORE_INDEX
    target = torch.gather(logits, 1, torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1))[:, 0]
    zero = torch.zeros_like(lse)
    return torch.where(valid, lse - target, zero), torch.where(valid, lse, zero)


def static_signature(module: nn.Module) -> str:
    """A name for what a block computes beyond its parameters' values: its classes, parameter and
    buffer shapes, and plain attributes (a window, a flag), so blocks that differ only in
    values share it and blocks that would trace differently do not."""
    parts = []
    for path, sub in module.named_modules():
        attrs = {k: v for k, v in vars(sub).items() if not k.startswith("_") and k != "training"
                 and isinstance(v, (int, float, str, bool, tuple, type(None)))}
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in sub.named_parameters(recurse=False)]
        buffers = [(n, tuple(b.shape)) for n, b in sub.named_buffers(recurse=False)]
        parts.append((path, type(sub).__qualname__, sorted(attrs.items(), key=lambda kv: kv[0]), params, buffers))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:10]

