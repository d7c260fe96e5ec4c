"""The probe of a plain module's forward: the facts torch_model/module_lm.py builds the model from.

One abstract trace of `forward(tokens)` through torchax (`jax.make_jaxpr` over the parameters'
shapes: no weight is read and nothing computes, so it serves a module on `meta` as `plan` builds
it, at any size), with forward hooks on the module's nn.Linear and nn.Embedding layers and on the
children of every ModuleList / ModuleDict, and the SDPA calls recorded (jax_bridge/module_ops.py).
A forward torchax cannot lower fails here, naming the op. From what was seen:

- the logits: the returned tensor, which must be [B, T, V]; the token embedding: the first
  nn.Embedding the tokens go through; the head: the nn.Linear whose output is returned as the
  logits, unchanged (fused with the cross-entropy op), called once, without a bias;
- the blocks: the container (the one holding the most parameters, if several qualify) whose
  children are structurally identical and are each called once, in order, each on the previous
  one's output, with the same other arguments, returning a tensor of its input's shape;
- roles by structure: expert stacks (3-D parameters [E, ., .]) by where the hidden size lies;
  the nn.Linear [E, hidden] beside them, their router; within blocks, the projections into
  attention (called before an SDPA call, sized for its heads) and out of it, and every other
  nn.Linear that widens the hidden state or narrows back to it;
- the forward's matmul FLOPs, from the trace's dot products (attention's scores are counted
  from the SDPA calls instead, train/run/flops.py).

`check_blocks` then holds the blocks' stand-in to the module's own forward on its weights,
where it has weights: a loop that used a block's output elsewhere would differ.
"""
from __future__ import annotations

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import torch
import torch.nn as nn

from jax_bridge import module_ops
from jax_bridge.lowering import abstract_params, model_function
from torch_model.module_lm import (AttentionCall, ModuleBackbone, ModuleCausalLM, ModuleFacts, output_kind,
                                   output_logits, static_signature, unused_outputs)
from torch_model.transformers_truth import UnsupportedModel, first_line

PROBE_ROWS, PROBE_TOKENS = 2, 16


def probe(module: nn.Module, *, seq_len: int = PROBE_TOKENS) -> ModuleFacts:
    """The facts of `module` (see the module docstring); UnsupportedModel, one line, when its
    forward cannot be lowered or does not return [B, T, V] logits."""
    events: list = []            # (kind, module path or None, data), in call order
    kinds: dict = {}
    paths = {id(m): p for p, m in module.named_modules()}
    hooks = []
    for path, sub in module.named_modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            hooks.append(sub.register_forward_hook(
                lambda m, args, out: events.append(("call", paths[id(m)], (m, args[0] if args else None, out)))))
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            for child in _children(sub):
                hooks.append(child.register_forward_pre_hook(
                    lambda m, args: events.append(("enter", paths[id(m)], None))))
                hooks.append(child.register_forward_hook(
                    lambda m, args, kwargs, out: events.append(("block", paths[id(m)], (args, kwargs, out))),
                    with_kwargs=True))
    tokens_seen = {}

    def call(m, tokens):
        tokens_seen["tokens"] = tokens
        out = m(tokens)
        kinds["output"], kinds["unused"] = output_kind(out), unused_outputs(out)
        logits = output_logits(out)
        kinds["logits"] = logits
        return logits

    fn = model_function(module, call=call)
    tokens = jax.ShapeDtypeStruct((PROBE_ROWS, seq_len), jnp.int32)
    try:
        with module_ops.recording(events):
            jaxpr = jax.make_jaxpr(fn)(abstract_params(module), tokens)
    except UnsupportedModel:
        raise
    except Exception as e:  # noqa: BLE001 - what torchax cannot lower is the answer, in one line
        op = _failing_op(e)
        raise UnsupportedModel(f"the module's forward cannot be lowered through torchax"
                               f"{f' at {op}' if op else ''}: {first_line(e)}") from None
    finally:
        for h in hooks:
            h.remove()
    return _facts(module, events, kinds, tokens_seen["tokens"], jaxpr, seq_len)


def _failing_op(error: Exception) -> str | None:
    """The torch op torchax was lowering when `error` was raised (its dispatch's innermost frame)."""
    op, tb = None, error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "dispatch" and "torchax" in frame.f_code.co_filename and "func" in frame.f_locals:
            op = str(frame.f_locals["func"])
        tb = tb.tb_next
    return op


def _facts(module, events, kinds, tokens, jaxpr, seq_len) -> ModuleFacts:
    logits = kinds["logits"]
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (PROBE_ROWS, seq_len):
        raise UnsupportedModel(f"the module's forward returned logits of shape {list(logits.shape)} for tokens "
                               f"[{PROBE_ROWS}, {seq_len}]; expected [B, T, V] = [{PROBE_ROWS}, {seq_len}, V]")
    vocab = int(logits.shape[-1])
    calls = [(path, data) for kind, path, data in events if kind == "call"]
    embedding = next((path for path, (m, x, _) in calls if isinstance(m, nn.Embedding) and x is not None
                      and tuple(x.shape) == tuple(tokens.shape)), None)
    head, head_reason = _head(calls, logits, vocab)
    d_model = (module.get_submodule(head).in_features if head else
               module.get_submodule(embedding).embedding_dim if embedding else int(logits.shape[-1]))
    blocks, blocks_reason = _blocks(module, events)
    block_types = ()
    if blocks:
        children = _children(module.get_submodule(blocks))
        names = {}
        block_types = tuple(names.setdefault(static_signature(c), f"block{len(names)}") for c in children)
    attention_calls = tuple(AttentionCall(q[1], k[1], q[-1], q[2], k[2], bool(causal), reason or "")
                            for kind, _, (q, k, causal, reason) in (e for e in events if e[0] == "sdpa"))
    return ModuleFacts(vocab_size=vocab, d_model=int(d_model), output=kinds["output"], embedding=embedding, head=head,
                       head_reason=head_reason, blocks=blocks, blocks_reason=blocks_reason, block_types=block_types,
                       attention=attention_calls, roles=_roles(module, events, d_model, embedding, head),
                       unused_outputs=kinds["unused"],
                       **_counts(module, dot_flops(jaxpr.jaxpr) / (PROBE_ROWS * seq_len), embedding, head))


def _counts(module, matmul_flops: float, embedding, head) -> dict:
    """The FLOP and parameter counts: every parameter once; the active ones are the matmuls' a
    token goes through (their FLOPs / 2) and the token embedding's, unless the head reads it."""
    params = sum(p.numel() for p in module.parameters())
    table = module.get_submodule(embedding).weight if embedding else None
    tied = table is not None and head is not None and module.get_submodule(head).weight is table
    lookup = table.numel() if table is not None and not tied else 0
    return {"matmul_flops_per_token": matmul_flops, "params": params, "active_params": int(matmul_flops / 2) + lookup}


def _head(calls, logits, vocab: int) -> tuple[str | None, str]:
    """(the fused head's path, "") or (None, why not)."""
    found = [(path, m, x) for path, (m, x, out) in calls if out is logits]
    if not found:
        last = next((path for path, (m, _, _) in reversed(calls) if isinstance(m, nn.Linear)
                     and m.out_features == vocab), None)
        return None, (f"the forward changes {last}'s output before returning it" if last else
                      "no nn.Linear's output is returned as the logits")
    path, m, x = found[-1]
    if not isinstance(m, nn.Linear):
        return None, f"the logits come from {path}, a {type(m).__name__}"
    if m.bias is not None:
        return None, f"{path} has a bias, which the fused cross-entropy does not take"
    if sum(1 for p, _ in calls if p == path) != 1:
        return None, f"{path} is called more than once"
    if x is None or x.dim() != 3:
        return None, f"{path}'s input is not the hidden state [B, T, H]"
    return path, ""


def _children(container) -> list:
    """A ModuleList's or ModuleDict's modules (a None placeholder, which some libraries keep, left out)."""
    children = container.values() if isinstance(container, nn.ModuleDict) else container
    return [c for c in children if c is not None]


def _blocks(module, events) -> tuple[str | None, str]:
    """(the path of the container run as layers, "") or (None, why none is)."""
    best, reasons = None, []
    for path, container in module.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or not _children(container):
            continue
        reason = _chain_problem(container, path, events)
        size = sum(p.numel() for p in container.parameters())
        if reason is None:
            if best is None or size > best[1]:
                best = (path, size)
        else:
            reasons.append((size, f"{path}: {reason}"))
    if best is not None:
        return best[0], ""
    if not reasons:
        return None, "no ModuleList or ModuleDict of blocks"
    return None, max(reasons)[1]


def _chain_problem(container, path: str, events) -> str | None:
    children = _children(container)
    if len(children) < 2:
        return "fewer than two blocks"
    if isinstance(container, nn.ModuleDict) and list(container.keys()) != [str(i) for i in range(len(container))]:
        return "its keys are not 0, 1, ..., as layers are numbered"
    shapes = [[(n, tuple(p.shape)) for n, p in c.named_parameters()] for c in children]
    if any(type(c) is not type(children[0]) or s != shapes[0] for c, s in zip(children, shapes)):
        return "its children are not structurally identical"
    if not shapes[0]:
        return "its children hold no parameters"
    names = [f"{path}.{k}" if path else k for k in (container.keys() if isinstance(container, nn.ModuleDict)
                                                     else map(str, range(len(children))))]
    calls = [(p, data) for kind, p, data in events if kind == "block" and p in names]
    if [p for p, _ in calls] != names:
        return "its blocks are not each called once, in order"
    first_rest = None
    for i, (_, (args, kwargs, out)) in enumerate(calls):
        if not args or not isinstance(args[0], torch.Tensor):
            return "a block's first argument is not the hidden state"
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(args[0].shape):
            return "a block returns something other than a tensor of its input's shape"
        if i and args[0] is not calls[i - 1][1][2]:
            return "a block's input is not the previous block's output"
        rest = (args[1:], kwargs)
        if first_rest is None:
            first_rest = rest
        elif not _same(rest, first_rest):
            return "its blocks are called with different arguments"
    return None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _roles(module, events, d_model: int, embedding, head) -> dict[str, str]:
    """The module's parameter name -> role (torch_model.module_lm.ROLES) for those found by structure."""
    roles = {}
    owner = {id(p): n for n, p in module.named_parameters()}
    if embedding:
        roles[owner[id(module.get_submodule(embedding).weight)]] = "embedding"
    if head:
        roles.setdefault(owner[id(module.get_submodule(head).weight)], "head")
    for path, sub in module.named_modules():
        stacks = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.dim() == 3]
        for n, p in stacks:
            name = f"{path}.{n}" if path else n
            roles[name] = ("experts_hidden_last" if p.shape[2] == d_model and p.shape[1] != d_model
                           else "experts_hidden_first")
        experts = {p.shape[0] for _, p in stacks}
        for child_path, child in sub.named_children():
            if isinstance(child, nn.Linear) and child.out_features in experts and child.in_features == d_model:
                roles.setdefault(owner[id(child.weight)], "router")
    # Out of attention: the first nn.Linear after an SDPA call that takes its heads back to the hidden size.
    linears = [(i, m) for i, (kind, _, data) in enumerate(events) if kind == "call"
               for m in (data[0],) if isinstance(m, nn.Linear)]
    for j, (kind, _, data) in enumerate(events):
        if kind == "sdpa":
            width = data[0][1] * data[0][3]
            after = next((m for i, m in linears if i > j and m.in_features == width and m.out_features == d_model), None)
            if after is not None:
                roles.setdefault(owner[id(after.weight)], "narrows")
    heads = {q[1] * q[3] for kind, _, (q, *_rest) in (e for e in events if e[0] == "sdpa")}
    for _, m in linears:
        name = owner.get(id(m.weight))
        if name is None or name in roles:
            continue
        if m.in_features == d_model and (m.out_features != d_model or m.out_features in heads):
            roles[name] = "widens"          # into attention's heads (a square one in MHA too), or an MLP's width
        elif m.out_features == d_model and m.in_features != d_model:
            roles[name] = "narrows"
    return roles


def dot_flops(jaxpr) -> float:
    """FLOPs of the dot products (dot_general, ragged_dot) in a jaxpr, sub-jaxprs included
    (a scan's body times its length)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (_, rc), (_, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
            total += 2.0 * math.prod(lhs) * math.prod(free)
        elif name.startswith("ragged_dot"):
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            total += 2.0 * math.prod(lhs) * rhs[-1]
        times = eqn.params.get("length", 1) if name == "scan" else 1
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += times * dot_flops(inner)
    return total


def check_blocks(module: nn.Module, facts: ModuleFacts) -> ModuleFacts:
    """`facts` with the blocks run unrolled when the stand-in (the first block's call runs them
    all, the others pass their input through) does not give the module's own logits on its own
    weights; as they are for a module without weights (on `meta`)."""
    if not facts.blocks or any(p.is_meta for p in module.parameters()):
        return facts
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, facts.vocab_size, (1, 8), generator=generator)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            own = output_logits(module(tokens), facts.output)
            backbone = ModuleBackbone(module, facts)
            with backbone._calls():
                stood_in = output_logits(module(tokens), facts.output)
    finally:
        module.train(was_training)
    if torch.equal(own, stood_in):
        return facts
    return replace(facts, blocks=None, block_types=(),
                   blocks_reason=f"{facts.blocks}: the module's loop uses a block's output besides the next block")




def wrap(module: nn.Module, *, max_seq_len: int = 0, recorded: ModuleFacts | None = None, where: str = "the module",
         bos_token_id=None, eos_token_id=None) -> ModuleCausalLM:
    """`module` behind the model boundary. A new model (`recorded` None) is probed and its blocks
    checked on its weights; a run's model (`recorded`: its record's facts) is probed and must
    still have what the run was built with (a module that changed shape since is refused naming
    the fact), its blocks run as the run ran them."""
    facts = probe(module)
    if recorded is None:
        facts = check_blocks(module, facts)
    else:
        for field in ("vocab_size", "d_model", "output", "embedding", "head", "block_types"):
            now, then = getattr(facts, field), getattr(recorded, field)
            if now != then and not (field == "block_types" and recorded.blocks is None):
                raise UnsupportedModel(f"{where}: the module now has {field} {now!r} where the run recorded {then!r} "
                                       f"(its source or arguments changed)")
        if recorded.blocks is None:
            facts = replace(facts, blocks=None, block_types=(), blocks_reason=recorded.blocks_reason)
    return ModuleCausalLM(module, facts, max_seq_len, bos_token_id, eos_token_id)


def build_record(record, *, meta: bool = False, new_run: bool = False, spec: str | None = None,
                 args: dict | None = None) -> ModuleCausalLM:
    """The model of a module record (torch_model.module_lm.ModuleSpec): its SPEC (or `spec`) called
    with its arguments (or `args`), wrapped; it must still have the facts the record holds, unless
    the record is a new run's (`new_run`: the blocks are then checked on the weights)."""
    from torch_model.module_lm import instantiate

    spec = spec or record.spec
    module = instantiate(spec, record.args if args is None else args, meta=meta)
    return wrap(module, max_seq_len=record.max_seq_len, recorded=None if new_run else record.facts,
                where=f"--module {spec}", bos_token_id=record.bos_token_id, eos_token_id=record.eos_token_id)
