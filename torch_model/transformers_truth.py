"""What each layer of a transformers decoder computes, read from transformers' own model, and the
check that holds our routed forward to transformers' own eager forward.

`describe_layers` runs the family's own forward once, with probes in transformers' interfaces
(on the model's weights, or on the `meta` device when it has none, as `plan` builds it):

- the mask interface (`AttentionMaskInterface`) receives the mask function transformers composes
  for each layer type; the layer's window is read from it (causal, or a sliding window W);
  a mask that is neither (bidirectional, chunked) is refused;
- the attention interface receives each layer's attention call: its scaling and sinks (`s_aux`)
  are the description; a `sliding_window` argument that disagrees with the layer's mask, a
  softcap, dropout or any other argument the routed op does not honour is refused;
- the rotary module's calls (the arguments each layer's position embeddings were made with,
  e.g. Gemma 3's `layer_type`) are recorded, so the backbone calls it as transformers does.

The result, one `LayerAttention` per layer (kept on the layer's attention module), is the one
description the routed kernel, the eager reference, the KV cache, `plan`, the FLOP count and
parity's report read. `check_truth` holds it, with the model's weights, against transformers'
own eager forward on two packed documents longer than the window (each run alone through
transformers). Nothing here names a family.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from torch_model.config import ConfigError

DESCRIBE = "torchlyra_describe"       # the implementation name of the probes in transformers' interfaces
# Keywords of transformers' attention calls that change nothing the routed op computes:
# positions enter through the rotary embedding; cache flags; `output_*` recording flags.
IGNORED_ATTENTION_KWARGS = ("position_ids", "use_cache", "cache_position")
# The relative error (||ours - theirs|| / ||theirs||) beyond which a layer's output on the packed
# documents is not transformers' own, float32: a correct layer differs by ~1e-7 (summation
# order), a wrong window or a lost segment by 1e-2 and more.
TRUTH_TOLERANCE = 1e-4
# What the load-time check may spend on a model with weights (about a second of CPU): tokens x
# parameters, and at most CHECK_TOKENS tokens per document. A window longer than the documents
# (a released model's 4096) is then held on shorter documents: its value is still transformers'
# own (its mask function), the kernels' long windows are the kernel tests' to hold.
CHECK_BUDGET = 2e9
CHECK_TOKENS = 128
_active = None                         # the _Recorder of the describe forward that is running


class UnsupportedModel(ConfigError):
    """A model or feature this path cannot run as asked (the message names what and why); a
    ConfigError, so the command line reports it in one line."""


def first_line(e: Exception) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes, as transformers' own model computes it."""
    window: int          # 0: every earlier token; W > 0: the last W tokens, itself included
    scale: float         # the factor on q.k
    sinks: bool          # learned sink logits handed over as `s_aux` (gpt-oss)
    rope: int            # which of the backbone's rotary calls makes this layer's position embeddings

    def summary(self) -> str:
        window = f"window {self.window}" if self.window else "causal"
        return f"{window}, scale {self.scale:.4g}" + (", sinks" if self.sinks else "")


@dataclass(frozen=True)
class Described:
    """`describe_layers`' answer: per layer its attention description and the attention module's
    name inside the layer; the rotary module's calls ((args, kwargs) after x and positions)."""
    layers: tuple[LayerAttention, ...]
    attention_names: tuple[str, ...]
    rope_calls: tuple[tuple[tuple, tuple], ...]


def mask_window(mask_function) -> int:
    """The window of a transformers mask function (batch, head, q, kv) -> visible: 0 for causal
    attention (every earlier token and itself), W for a sliding window (kv > q - W). Read by
    probing indices far past any window, and checked at several offsets; ValueError naming the
    pattern when it is neither (later tokens visible, chunks, a token blind to itself)."""
    def visible(q: int, kv: int) -> bool:
        with torch.device("cpu"):
            return bool(mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(kv)))

    far = 1 << 40
    if visible(far, far + 1):
        raise ValueError("later tokens are visible (bidirectional attention)")
    if not visible(far, far):
        raise ValueError("a token does not see itself")
    if visible(far, 0):
        window = 0
    else:                                       # the smallest distance not seen
        lo, hi = 0, far                         # visible at lo, not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if visible(far, far - mid) else (lo, mid)
        window = hi
    for q in (far + 1, far + 7, far + max(window // 2, 1) + 3, far + window + 11):
        for d in {0, 1, 2, window - 2, window - 1, window, window + 1, 2 * window + 5, q // 3, q}:
            if 0 <= d <= q and visible(q, q - d) != (not window or d < window):
                raise ValueError("neither causal nor a sliding window (chunked attention?)")
    return window


class _MaskProbe:
    """What the probe mask interface hands a layer instead of a mask: the window its mask
    function describes, or why it describes none. A layer that uses the mask itself (slices it,
    reads its dtype) rather than handing it to its attention is told so."""

    def __getattr__(self, name):
        raise TypeError(f"its layer uses the attention mask itself (.{name}), not only through its attention "
                        f"function, and this path builds no mask")

    def __getitem__(self, index):
        raise TypeError("its layer uses the attention mask itself (slices it), not only through its attention "
                        "function, and this path builds no mask")

    def __add__(self, other):
        raise TypeError("its attention adds the mask to its scores itself: it does not call the function "
                        "transformers' AttentionInterface names, so no kernel of the registry would run it")

    __radd__ = __add__

    def __init__(self, mask_function):
        try:
            self.window, self.problem = mask_window(mask_function), None
        except (ValueError, RuntimeError, TypeError, NotImplementedError) as e:
            self.window, self.problem = None, str(e)


def _probe_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                **kwargs):
    return _MaskProbe(mask_function)


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    _active.attention(module, attention_mask, kwargs, query)
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def _probe_experts(module, hidden_states, top_k_index, top_k_weights):
    return torch.zeros_like(hidden_states)


def register_probes() -> None:
    """Register the probes under DESCRIBE in transformers' interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DESCRIBE, _probe_attention)
    AttentionMaskInterface.register(DESCRIBE, _probe_mask)
    ExpertsInterface.register(DESCRIBE, _probe_experts)


@contextlib.contextmanager
def implementation(hf_model, name: str):
    """The model's attention and experts run transformers' implementation `name` inside."""
    attention, experts = hf_model.config._attn_implementation, hf_model.config._experts_implementation
    hf_model.set_attn_implementation(name)
    hf_model.set_experts_implementation(name)
    try:
        yield
    finally:
        hf_model.set_attn_implementation(attention)
        hf_model.set_experts_implementation(experts)


class _Recorder:
    """The describe forward's notes: which layer runs, its attention calls, the rotary calls."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.current: int | None = None
        self.calls: dict[int, list] = {i: [] for i in range(len(self.layers))}
        self.rope_calls: list[tuple[tuple, tuple, object]] = []      # (args, kwargs, output)
        self.position_embeddings: dict[int, object] = {}

    def attention(self, module, mask, kwargs, query):
        if self.current is not None:
            self.calls[self.current].append((module, mask, dict(kwargs), query.shape[-1]))

    def rotary(self, module, args, kwargs, output):
        extra_kwargs = tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("position_ids", "x")))
        self.rope_calls.append((tuple(args[2:]), extra_kwargs, output))

    def layer_starts(self, index, args, kwargs):
        self.current = index
        self.position_embeddings[index] = kwargs.get("position_embeddings",
                                                     next((a for a in args if isinstance(a, tuple)), None))

    def layer_ends(self):
        self.current = None


@contextlib.contextmanager
def _buffers_on_meta(model: nn.Module):
    """Inside, a model whose parameters are on `meta` has its host buffers there too (a
    rotary inv_freq or a router's bias computed on the host), so that one forward of shapes runs."""
    moved = []
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and not b.is_meta:
                moved.append((module, name, b))
                module._buffers[name] = b.to("meta")
    try:
        yield
    finally:
        for module, name, b in moved:
            module._buffers[name] = b


def describe_layers(hf_model, layers, rotary_emb) -> Described:
    """Run the family's own forward once through the probes (see the module docstring) and
    return each layer's attention description, refusing in one line (model type, layer,
    argument, value) what the routed op does not compute."""
    global _active
    register_probes()
    model_type = getattr(hf_model.config, "model_type", type(hf_model).__name__)
    meta = any(p.is_meta for p in hf_model.parameters())
    device = torch.device("meta") if meta else next(hf_model.parameters()).device
    rec = _Recorder(layers)
    hooks = [rotary_emb.register_forward_hook(rec.rotary, with_kwargs=True)]
    for i, layer in enumerate(rec.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, k, i=i: rec.layer_starts(i, a, k), with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda *_: rec.layer_ends()))
    _active = rec
    try:
        from transformers import DynamicCache

        with torch.no_grad(), implementation(hf_model, DESCRIBE), \
                _buffers_on_meta(hf_model) if meta else contextlib.nullcontext():
            ids = torch.zeros(1, 4, dtype=torch.long, device=device)
            # A cache, so that transformers builds the masks of a first forward without looking
            # for packed sequences in the positions (which reads values a meta tensor has not).
            hf_model.get_decoder()(input_ids=ids, cache=DynamicCache(config=hf_model.config), use_cache=True)
    except UnsupportedModel:
        raise
    except Exception as e:  # noqa: BLE001 - the family's own forward failing is the answer
        where = "" if rec.current is None else f" layer {rec.current} ({type(rec.layers[rec.current]).__name__})"
        raise UnsupportedModel(f"{model_type}{where}: transformers' own forward fails when run to read its layers "
                               f"({first_line(e)})") from e
    finally:
        _active = None
        for hook in hooks:
            hook.remove()

    rope_keys: list = []            # the distinct rotary calls the layers' position embeddings come from
    described, names = [], []
    for i, layer in enumerate(rec.layers):
        where = f"{model_type} layer {i} ({type(layer).__name__})"
        calls = rec.calls[i]
        if len(calls) != 1:
            raise UnsupportedModel(f"{where}: its attention does not call transformers' AttentionInterface once per "
                                   f"forward ({len(calls)} calls), so no kernel of the registry would run it")
        module, mask, kwargs, head_dim = calls[0]
        name = next((n for n, m in layer.named_modules() if m is module), None)
        if name is None:
            raise UnsupportedModel(f"{where}: its attention module {type(module).__name__} is not inside the layer")
        rope = _rope_of(rec, rope_keys, i, where)
        described.append(_layer_attention(where, type(module).__name__, mask, kwargs, head_dim, rope))
        names.append(name)
    return Described(tuple(described), tuple(names), tuple(rope_keys))


def _rope_of(rec: _Recorder, rope_keys: list, i: int, where: str) -> int:
    """The index in `rope_keys` (appended to) of the rotary call whose output layer i was given."""
    given = rec.position_embeddings.get(i)
    for args, kwargs, output in rec.rope_calls:
        if given is output or (isinstance(given, tuple) and isinstance(output, tuple) and given
                               and given[0] is output[0]):
            if not (isinstance(output, tuple) and len(output) == 2):
                raise UnsupportedModel(f"{where}: its rotary embedding returns {type(output).__name__}, not the "
                                       f"(cos, sin) pair this path hands every layer")
            if not all(isinstance(v, (str, int, float, bool, type(None))) for v in (*args, *(v for _, v in kwargs))):
                raise UnsupportedModel(f"{where}: its rotary embedding is called with more than x, the positions "
                                       f"and plain values (a layer type)")
            if (args, kwargs) not in rope_keys:
                rope_keys.append((args, kwargs))
            return rope_keys.index((args, kwargs))
    raise UnsupportedModel(f"{where}: its position embeddings are not its model's rotary_emb output, which is "
                           f"what this path hands each layer")


def _layer_attention(where: str, attention: str, mask, kwargs: dict, head_dim: int, rope: int) -> LayerAttention:
    where = f"{where} {attention}"
    if not isinstance(mask, _MaskProbe):
        raise UnsupportedModel(f"{where}: no attention mask reaches its attention call (transformers' eager "
                               f"attention would then attend every token, later ones too)")
    if mask.problem:
        raise UnsupportedModel(f"{where}: its attention mask is {mask.problem}; no kernel computes it")
    window = mask.window
    passed = kwargs.pop("sliding_window", None)
    if int(passed or 0) != window:
        said = f"a window of {window}" if window else "no window"
        raise UnsupportedModel(f"{where}: sliding_window={passed} in its attention call, but transformers' own mask "
                               f"for the layer has {said} (transformers' implementations disagree on this config); "
                               f"remove the config's sliding_window or make the two agree")
    dropout = kwargs.pop("dropout", 0.0)
    if dropout:
        raise UnsupportedModel(f"{where}: dropout={dropout} (no kernel applies dropout; set the config's "
                               f"attention_dropout to 0)")
    softcap = kwargs.pop("softcap", None)
    if softcap:
        raise UnsupportedModel(f"{where}: softcap={softcap}, an attention logit softcap (no kernel expresses it)")
    scaling = kwargs.pop("scaling", None)
    sinks = kwargs.pop("s_aux", None)
    unknown = sorted(k for k, v in kwargs.items()
                     if v is not None and k not in IGNORED_ATTENTION_KWARGS and not k.startswith("output_"))
    if unknown:
        k = unknown[0]
        value = kwargs[k]
        shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:60]
        raise UnsupportedModel(f"{where}: {k}={shown} in its attention call (no kernel expresses it)")
    return LayerAttention(window=int(window), scale=head_dim ** -0.5 if scaling is None else float(scaling),
                          sinks=sinks is not None, rope=rope)


def attention_module(layer: nn.Module) -> nn.Module:
    """The module of a described layer whose attention call the description is."""
    for module in layer.modules():
        if getattr(module, "torchlyra_attention", None) is not None:
            return module
    raise UnsupportedModel(f"{type(layer).__name__}: a layer this path has not described (built outside "
                           f"transformers_lm.build)")


def check_truth(hf_model, model, layers) -> None:
    """Hold our routed forward, on one row of two packed documents and padding (segment ids,
    positions restarting), to transformers' own eager forward (its eager attention and experts,
    the masks its forward builds) run on each document alone: every layer's output and the
    logits, within TRUTH_TOLERANCE. The documents are longer than the largest window when the
    model is small enough (CHECK_BUDGET). The first layer that differs is refused by name with
    its description."""
    model_type = getattr(hf_model.config, "model_type", type(hf_model).__name__)
    described = [attention_module(layer).torchlyra_attention for layer in layers]
    params = sum(p.numel() for p in model.parameters())
    longest = max(8, min(CHECK_TOKENS, int(CHECK_BUDGET // max(params, 1))))
    n = min(max(max(d.window for d in described) + 3, 8), longest)
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    docs = [torch.randint(0, vocab, (n,), generator=gen, device="cpu"),
            torch.randint(0, vocab, (n - 1,), generator=gen, device="cpu")]
    pad = 2
    row = torch.cat([*docs, torch.zeros(pad, dtype=torch.long, device="cpu")])[None]
    segments = torch.cat([torch.full((len(d),), k + 1, device="cpu") for k, d in enumerate(docs)]
                         + [torch.zeros(pad, dtype=torch.long, device="cpu")])[None]
    positions = torch.cat([torch.arange(len(d), device="cpu") for d in docs]
                          + [torch.zeros(pad, dtype=torch.long, device="cpu")])[None]
    device = next(model.parameters()).device
    row, segments, positions = row.to(device), segments.to(device), positions.to(device)

    def outputs_of(run):
        seen = [[] for _ in layers]
        hooks = [layer.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[0] if isinstance(out, tuple)
                                                                                    else out))
                 for i, layer in enumerate(layers)]
        try:
            logits = run()
        finally:
            for hook in hooks:
                hook.remove()
        return [s[-1] for s in seen], logits

    try:
        with torch.no_grad():
            ours_layers, ours_logits = outputs_of(lambda: model(row, positions=positions, segment_ids=segments))
            theirs = []
            with implementation(hf_model, "eager"):
                for doc in docs:
                    theirs.append(outputs_of(lambda doc=doc: hf_model(input_ids=doc[None].to(device),
                                                                       use_cache=False).logits))
    except UnsupportedModel:
        raise
    except Exception as e:  # noqa: BLE001 - a forward failing on the packed documents is the answer
        raise UnsupportedModel(f"{model_type}: a forward on two packed documents fails ({first_line(e)})") from e
    tolerance = TRUTH_TOLERANCE if ours_logits.dtype == torch.float32 else 2e-2
    starts = [0, n]

    def error(ours, k, theirs_k):
        piece = ours[:, starts[k]:starts[k] + len(docs[k])].double()
        return ((piece - theirs_k.double()).norm() / theirs_k.double().norm().clamp(min=1e-30)).item()

    for i, layer in enumerate(layers):
        worst = max(error(ours_layers[i], k, theirs[k][0][i]) for k in range(len(docs)))
        if not worst <= tolerance:
            raise UnsupportedModel(
                f"{model_type} layer {i} ({type(layer).__name__}): on two packed documents of {n} and {n - 1} tokens "
                f"our routed layer ({described[i].summary()}) differs from transformers' own eager forward run on "
                f"each document alone by {worst:.3g} (relative); this path would not compute the family's model")
    worst = max(error(ours_logits, k, theirs[k][1]) for k in range(len(docs)))
    if not worst <= tolerance:
        raise UnsupportedModel(f"{model_type}: on two packed documents our logits differ from transformers' own eager "
                               f"forward run on each document alone by {worst:.3g} (relative) after the final norm "
                               f"and head")
