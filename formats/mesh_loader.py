"""The one loader: a model's weights, from any format the product reads (ours:
formats/checkpoint_weights.py; gpt-oss as released or unquantized: formats/hf_weights.py;
another transformers family: formats/transformers_conversion.py), placed on the mesh block by
block in the dtype each array is held in. `jax.make_array_from_callback` asks each process for
exactly the blocks its own devices hold; each block is read by slice and cast on the host, so no
process ever holds a tensor it does not own, let alone the model, and the torch model stays on
the `meta` device.

A source is any object with `entries` (per-layer name -> Entry: `.shape`), `read(name, index)`
(the values of a slice, numpy) and `bytes_requested`; optionally `read_into(name, index, out)`
(the same values written into `out`, a block's part, cast to its dtype), `stored_key(name)` (the
stored array a name is read from: `place` reads the arrays made of one stored array one after the
other), `release()` (called once placing is done) and `independent_reads()` (whether reads may run
on several threads at once: `place` then reads READERS arrays at a time). Every parameter of the
model is read from it under the base name it is or wraps, peft's names included
(`...q_proj.base_layer.weight`, a `modules_to_save` copy of the head:
`torch_model.lora.base_parameter_of`), except what no base holds: LoRA adapters (drawn on the
host, or read from a LoRA checkpoint) and a trained head the host model holds, which come from the
host model.
"""
from __future__ import annotations

import concurrent.futures
import mmap
import os

import jax
import jax.numpy as jnp
import numpy as np

from formats.errors import UserError
from jax_bridge.sharding import one_device


class StepWeights:
    """A source read under a model's parameter names: LoRA adapters, and a trained copy of a module
    that the host model holds (a LoRA checkpoint's head), from the host model; every other
    parameter from `weights`, as the base parameter it is or wraps (a copy on `meta`, as a new
    LoRA run makes it, starts from the base)."""

    def __init__(self, weights, model, where: str):
        from torch_model.lora import base_parameter_of, is_trained_copy

        self.weights, self.where = weights, where
        self.host: dict = {}
        self.base_of: dict[str, str] = {}
        for name, p in model.named_parameters():
            base, role = base_parameter_of(name)
            if role is not None or (is_trained_copy(name) and not p.is_meta):
                if p.is_meta:
                    raise UserError(f"{where}: adapter {name} has no values (initialise adapters before loading)")
                self.host[name] = p
                continue
            entry = weights.entries.get(base)
            if entry is None:
                raise UserError(f"{where}: tensor {base} (for {name}) is missing")
            if tuple(entry.shape) != tuple(p.shape):
                raise UserError(f"{where}: tensor {base} has shape {list(entry.shape)}, expected {list(p.shape)}")
            self.base_of[name] = base

    def read(self, name: str, index) -> np.ndarray:
        if name in self.host:
            from jax_bridge.step import host_array
            return host_array(self.host[name])[index]
        return self.weights.read(self.base_of[name], index)

    def read_into(self, name: str, index, out: np.ndarray) -> None:
        into = getattr(self.weights, "read_into", None)
        if name in self.host or into is None:
            out[...] = self.read(name, index)
        else:
            into(self.base_of[name], index, out)

    def independent_reads(self) -> bool:
        """Whether the base's reads may run on several threads at once (see `place`)."""
        independent = getattr(self.weights, "independent_reads", None)
        return independent is not None and independent()

    def stored_key(self, name: str):
        """Where `name` is read from (see `place`): its base's stored array, or the host model."""
        if name in self.host:
            return ("host", name)
        key = getattr(self.weights, "stored_key", None)
        return key(self.base_of[name]) if key is not None else ("base", self.base_of[name])

    def release(self) -> None:
        release = getattr(self.weights, "release", None)
        if release is not None:
            release()


def open_weights(path) -> tuple[object, dict, object | None]:
    """(model record, meta as `checkpoint.load_checkpoint` gives it, weights) of any checkpoint a
    model starts from (ours, a gpt-oss directory, another transformers family's), nothing read but
    metadata and headers. weights None: a transformers directory whose conversion is not a
    slice-by-slice read (formats/transformers_conversion.py); it loads whole on the host
    (`checkpoint.load_checkpoint`)."""
    from formats.checkpoint_weights import open_weights as open_checkpoint
    from formats.hf_model import hf_meta, is_hf_dir, open_hf
    from formats.transformers_import import is_transformers_dir, open_streamed, read_spec

    if is_transformers_dir(path):
        opened = open_streamed(path)
        if opened is None:
            return read_spec(path), hf_meta(path), None
        spec, weights = opened
        return spec, hf_meta(path, weights), weights
    if is_hf_dir(path):
        cfg, weights = open_hf(path)
        # A one-expert gpt-oss directory maps onto the dense preset by a conversion (`import --dense`).
        return cfg, hf_meta(path, weights), (weights if cfg.is_moe else None)
    return open_checkpoint(path)


def is_weights(init) -> bool:
    """Whether `init` is a source this loader reads (see the module docstring)."""
    return hasattr(init, "entries") and hasattr(init, "read")


def source_names(layout, names) -> dict[str, list[str] | str]:
    """Train-state parameter name -> the per-layer name(s) it is made of: a list, one per layer
    along the leading axis, for stacked parameters."""
    return layout.stack({n: n for n in names}, stack=list)


READ_BYTES = 128 << 20       # a read's float32 values at most (an MXFP4 read decodes to float32, then transposes)
# Parameters placed at once from a source whose reads are independent (at most one per core):
# the 0.57 B Llama's 2.3 GB took one reader 1.4-1.5 s on the 2-core CPU host, two 0.8 s
# (BENCHMARKS.md, start-up of `generate`).
READERS = 4


def read_param(weights, source, index, shape, dtype=np.float32, aligned: bool = False) -> np.ndarray:
    """The values of `index` (a tuple of slices) of one train-state parameter of `shape` in
    `dtype`, filled into the block by reads of at most READ_BYTES of float32 along their leading
    axis (a stacked parameter: layer by layer): host memory holds the block and one read,
    whatever its format decodes to on the way. `aligned`: the block starts on a 64-byte boundary,
    which a CPU device takes as its buffer without copying it."""
    stacked = not isinstance(source, str)
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    block = _empty(tuple(s.stop - s.start for s in index), dtype, aligned)
    parts = [(block[k], source[j], index[1:]) for k, j in enumerate(range(index[0].start, index[0].stop))] \
        if stacked else [(block, source, index)]
    into = getattr(weights, "read_into", None)

    def fill(target, name, where):
        if into is not None:        # straight into the block, no read buffer between
            into(name, where, target)
        else:
            target[...] = weights.read(name, where)

    for target, name, rest in parts:
        if not rest:                                    # a scalar
            fill(target, name, rest)
            continue
        row_bytes = 4 * int(np.prod(target.shape[1:]))
        step = max(1, READ_BYTES // max(row_bytes, 1))
        first = rest[0].start
        for lo in range(0, target.shape[0], step):
            hi = min(lo + step, target.shape[0])
            fill(target[lo:hi], name, (slice(first + lo, first + hi), *rest[1:]))
    return block


def _empty(shape, dtype, aligned: bool) -> np.ndarray:
    """An uninitialized block. `aligned`: an anonymous mapping of its own, page-aligned (so on a
    64-byte boundary) and in small pages: numpy advises large arrays into transparent huge pages,
    whose first touch cost ~4x the system time here (BENCHMARKS.md, checkpoint reads), and a block
    a device takes as its buffer is written once, by the read."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not aligned or nbytes == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


def place(weights, abstract: dict, sources: dict, mesh, *, alias: bool = False) -> dict:
    """{name: jax.Array} for every `abstract` array (shape, dtype and, with a mesh, sharding),
    each device's block read from `weights` through `sources[name]` (see source_names).
    alias: CPU devices take the blocks' memory as their buffers instead of a copy (a process
    then holds each block once, not twice while it is placed); for arrays no program donates
    (inference parameters, a frozen base): a donated buffer that a device cannot reuse is copied."""
    single = one_device()

    def make(name, a):
        sharding = a.sharding if mesh is not None else single
        read: dict[tuple, np.ndarray] = {}      # devices of this process holding the same block read it once

        def block(index):
            key = tuple(s.indices(n)[:2] for s, n in zip(index, a.shape))
            if key not in read:
                read[key] = read_param(weights, sources[name], index, a.shape, a.dtype, aligned=alias)
            return read[key]

        return jax.make_array_from_callback(a.shape, sharding, block)

    # Arrays made of the same stored array are read one after the other (a source may keep what
    # one read decoded for the next: formats/checkpoint_weights.py); the source lets go of it after.
    # A source whose reads are independent has READERS arrays read and placed at once: host
    # memory holds at most that many blocks.
    key = getattr(weights, "stored_key", None)
    order = sorted(abstract, key=lambda n: _first_key(key, sources[n])) if key is not None else list(abstract)
    independent = getattr(weights, "independent_reads", None)
    readers = min(READERS, os.cpu_count() or 1) if independent is not None and independent() else 1
    try:
        if readers > 1:
            with concurrent.futures.ThreadPoolExecutor(readers, thread_name_prefix="torchlyra-read") as pool:
                placed = dict(zip(order, pool.map(lambda name: make(name, abstract[name]), order)))
        else:
            placed = {name: make(name, abstract[name]) for name in order}
    finally:
        if hasattr(weights, "release"):
            weights.release()
    return {name: placed[name] for name in abstract}


def _first_key(stored_key, source) -> tuple:
    """The sort key of a train-state parameter: the stored array its first part is read from."""
    return tuple(map(str, stored_key(source if isinstance(source, str) else source[0])))


def place_model(model, weights, abstract: dict, mesh, *, layout=None, where: str = "--checkpoint") -> dict:
    """A model's parameters as an inference program takes them (`abstract`: names, possibly
    stacked by `layout`, with dtypes and shardings), the ones on `meta` read from `weights`."""
    names = [n for n, _ in model.named_parameters()]
    sources = source_names(layout, names) if layout is not None else {n: n for n in names}
    return place(StepWeights(weights, model, where), abstract, sources, mesh, alias=True)


def zero_optimizer_state(step):
    """The optimizer state at zeros (what a fresh run starts from), created on its devices."""
    abstract = step.abstract_state().opt_state
    shardings = jax.tree.map(lambda a: one_device() if step.mesh is None else a.sharding, abstract)
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=shardings)()


def place_params(step, weights, where: str = "--init-from") -> dict:
    """The trainable parameters of `step` (float32; an adapter from the host model) read from
    `weights` onto the mesh; the frozen ones placed as `step.frozen` (compute dtype, routers
    float32). Nothing else is made (no optimizer state): what evaluating a checkpoint needs."""
    view = StepWeights(weights, step.model, where)
    sources = source_names(step.layer_layout, [n for n, _ in step.model.named_parameters()])
    step.frozen = place(view, step.abstract_frozen(), sources, step.mesh, alias=True)     # never donated
    return place(view, step.abstract_state().params, sources, step.mesh)


def init_state(step, weights, where: str = "--init-from"):
    """A fresh TrainState whose parameters come from `weights` (`place_params`), optimizer state
    at zeros: the train state without the host ever holding the model."""
    from jax_bridge.step import TrainState

    return TrainState(place_params(step, weights, where), zero_optimizer_state(step))
