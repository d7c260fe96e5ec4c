"""Where arrays live on a device mesh: the one place that decides sharding.

The mesh has four named axes: `data` (pure data parallelism), `fsdp` (data parallelism whose
devices also split the weights and optimizer state), `tensor` (attention heads, expert hidden
width and the vocabulary split across devices) and `expert` (experts placed on different devices;
for everything else the axis works like `fsdp`). As in MaxText, every array dimension has a
logical name (`embed`, `heads`, `mlp`, `exp`, `vocab`, `batch`, ...): `PARAM_AXES` names the
dimensions of each parameter by its name, `LOGICAL_RULES` maps logical names to mesh axes. A
stacked (scanned) parameter has one more leading dimension, `layers`, never split.
"""
from __future__ import annotations

import math
import re
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from torch_model.config import ConfigError
from torch_model.causal_lm import declared_role
from torch_model.lora import base_parameter_of

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical dimensions of each parameter (per layer), by name; first full match wins. A parameter no
# name matches is placed by its shape (`_shape_axes`): a vector whole, a matrix [out, in] as
# nn.Linear stores it split along its input over `fsdp`; an unnamed 3-D tensor is refused (an
# expert stack must be known to the MoE dispatch). Placement never changes the arithmetic, only
# what each device stores and gathers.
PARAM_AXES: list[tuple[str, tuple]] = [
    (r"model\.embed_tokens\.weight|lm_head\.weight", ("vocab", "embed")),
    (r".*self_attn\.q_proj\.weight", ("heads", "embed")),
    (r".*self_attn\.[kv]_proj\.weight", ("kv_heads", "embed")),
    (r".*self_attn\.q_proj\.bias", ("heads",)),
    (r".*self_attn\.[kv]_proj\.bias", ("kv_heads",)),
    (r".*self_attn\.qkv_proj\.weight", (None, "embed")),   # fused q, k, v (Phi-3): no head split
    (r".*self_attn\.o_proj\.weight", ("embed", "heads")),
    (r".*self_attn\.o_proj\.bias", (None,)),
    (r".*self_attn\.sinks", ("heads",)),
    (r".*\.router\.weight", (None, "embed")),           # ours, GraniteMoE's
    (r".*\.router\.bias", (None,)),
    (r".*mlp\.gate\.weight", (None, "embed")),         # transformers' MoE routers
    # MXFP4 stacks ([E, out, in/2] bytes, [E, out, in/32] scales): stored split over their experts
    # (`tensor` too: blocked along their input, they have no width to split the tensor way), else
    # (an fsdp size that does not divide them) over their output rows; never along the blocked
    # input (32 values per scale byte). The dispatch gathers them over `fsdp` per expert.
    (r".*\.experts\.(gate_up|down)_proj_(blocks|scales)", ("exp_q", "embed_moe", None)),
    (r".*\.experts\.gate_up_proj", ("exp", "embed_moe", "mlp")),      # mlp.experts, block_sparse_moe.experts
    (r".*\.experts\.gate_up_proj_bias", ("exp", "mlp")),
    (r".*\.experts\.down_proj", ("exp", "mlp", "embed_moe")),
    (r".*\.experts\.down_proj_bias", ("exp", None)),
    (r".*mlp\.gate_up_proj", ("embed", "mlp")),          # the dense preset's MLP
    (r".*mlp\.gate_up_proj_bias", ("mlp",)),
    (r".*mlp\.down_proj", ("mlp", "embed")),
    (r".*mlp\.down_proj_bias", (None,)),
    # transformers' MLPs (nn.Linear [out, in]), shared experts (Qwen2-MoE) included; fused gate_up
    # (Phi-3, GLM-4) and StarCoder2's c_fc / c_proj
    (r".*\.(gate|up|gate_up)_proj\.weight|.*mlp\.c_fc\.weight", ("mlp", "embed")),
    (r".*mlp\.c_fc\.bias", ("mlp",)),
    (r".*\.down_proj\.weight|.*mlp\.c_proj\.weight", ("embed", "mlp")),
    (r".*norm\.weight", (None,)),
]


# What each role a model declares (torch_model.causal_lm.ROLES) names its dimensions; an expert stack
# stored [E, out, in] takes its name's rule with the last two swapped.
ROLE_AXES = {
    "embedding": ("vocab", "embed"), "head": ("vocab", "embed"), "router": (None, "embed"),
    "experts_hidden_first": ("exp", "embed_moe", "mlp"), "experts_hidden_last": ("exp", "mlp", "embed_moe"),
    "widens": ("mlp", "embed"), "narrows": ("embed", "mlp"),
}


def _shape_axes(name: str, ndim: int) -> tuple:
    """The placement of a parameter no name rule covers (see PARAM_AXES)."""
    if ndim <= 1:
        return (None,) * ndim
    if ndim == 2:
        return (None, "embed")
    raise ConfigError(f"sharding: no rule for parameter {name!r} ({ndim} dims): a mesh places a tensor of more "
                      f"than two dims only by name (jax_bridge/sharding.py PARAM_AXES: expert stacks as "
                      f"`*.experts.gate_up_proj` / `down_proj`): this model trains on one device only")


# Logical name -> candidate groups of mesh axes, best first (MaxText's logical_axis_rules). A
# dimension takes the first candidate whose axes no earlier dimension of the array uses and
# whose size divides it; with none it is not split. Axes of size 1 are dropped.
LOGICAL_RULES: dict[str, list[tuple[str, ...]]] = {
    "batch": [("data", "fsdp", "expert")],
    "batch_but_fsdp": [("data", "expert")],   # rows gathered over `fsdp` (fsdp_gathers_rows)
    "embed": [("fsdp", "expert"), ("fsdp",), ("expert",)],
    "embed_moe": [("fsdp",)],             # the expert weights' own dims: `expert` (or `fsdp`) holds `exp`
    "vocab": [("tensor",)],
    "heads": [("tensor",)],
    "kv_heads": [("tensor",)],
    "mlp": [("tensor",)],
    # Stored expert stacks split over their experts: on `expert`, else on `fsdp` when it divides
    # them, so gathering a stack for use (FSDP) joins its major dimension; gathered over the
    # hidden dimension instead, the TPU compiler rewrote every gathered stack into its layout
    # (a copy of each [E, H, 2I] stack per layer and pass). The MoE dispatch places experts on
    # devices over `expert` (`exp_parallel`), and over `fsdp` where it gathers rows instead of
    # stacks (`fsdp_gathers_rows`: the stacks as stored).
    "exp": [("expert",), ("fsdp",)],
    "exp_parallel": [("expert",)],
    # MXFP4 stacks: experts over `expert` and `tensor` (the dispatch runs each device's experts on
    # the rows of its `tensor` group and sums), else as `exp`.
    "exp_q": [("expert", "tensor"), ("expert",), ("tensor",), ("fsdp",)],
    "exp_parallel_q": [("expert", "tensor"), ("expert",), ("tensor",)],
    "layers": [],
}


# ---- the mesh -----------------------------------------------------------------------------------
def one_device() -> jax.sharding.SingleDeviceSharding:
    """Where a run without a mesh places its arrays: committed to the first device. A compiled
    program is keyed by whether each argument is committed, and what a step returns is committed
    once any input is: a state placed uncommitted beside committed weights compiled the step again
    at its second call (every `--init-from --lora` and `--freeze` run)."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def parse_mesh(spec: str | dict | None, n_devices: int) -> dict[str, int]:
    """'data=2,fsdp=4' (or a dict) -> the size of every mesh axis; -1 means "the rest of the
    devices" (at most one axis); axes not named have size 1; nothing named: all on `fsdp`."""
    if isinstance(spec, str):
        items = {}
        for part in (p for p in spec.split(",") if p.strip()):
            if "=" not in part:
                raise ValueError(f"--mesh: expected axis=size, found {part!r} (axes: {', '.join(MESH_AXES)})")
            name, size = (s.strip() for s in part.split("=", 1))
            try:
                items[name] = int(size)
            except ValueError:
                raise ValueError(f"--mesh: size of {name!r} must be an integer, found {size!r}") from None
        spec = items
    sizes = dict(spec or {"fsdp": -1})
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"--mesh: unknown axis {sorted(unknown)[0]!r}; axes are: {', '.join(MESH_AXES)}")
    rest = [a for a, s in sizes.items() if s == -1]
    if len(rest) > 1:
        raise ValueError(f"--mesh: only one axis may be -1, found {', '.join(rest)}")
    if any(s == 0 or s < -1 for s in sizes.values()):
        raise ValueError(f"--mesh: sizes must be positive (or -1), found {sizes}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if rest:
        if n_devices % known:
            raise ValueError(f"--mesh: {n_devices} devices cannot be split as {spec} (not a multiple of {known})")
        sizes[rest[0]] = n_devices // known
    full = {a: sizes.get(a, 1) for a in MESH_AXES}
    if math.prod(full.values()) != n_devices:
        raise ValueError(f"--mesh: {describe_sizes(full)} uses {math.prod(full.values())} devices, "
                         f"but {n_devices} are available (use -1 for one axis to take the rest)")
    return full


def make_mesh(spec: str | dict | None = None, devices=None) -> Mesh:
    """The device mesh with axes MESH_AXES. On TPU the device order follows the physical
    topology (jax's mesh_utils), so `tensor` and `expert`, the innermost axes, stay on near chips."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.array(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)


def requested_mesh(spec: str | dict | None) -> Mesh | None:
    """The mesh a `--mesh` option asks for, as `train` reads it: nothing named puts every device on
    `fsdp`, and on a single device there is no mesh (None)."""
    if not spec and jax.device_count() == 1:
        return None
    return make_mesh(spec or None)


def describe_sizes(sizes: dict[str, int]) -> str:
    named = [f"{a}={s}" for a, s in sizes.items() if s > 1]
    return ",".join(named) or "one device"


def describe(mesh: Mesh) -> str:
    return describe_sizes(dict(mesh.shape))


def check_model_fits(cfg, mesh: Mesh) -> None:
    """Splits the kernels rely on must be exact: heads over `tensor`, experts over `expert`."""
    tensor, expert = mesh.shape.get("tensor", 1), mesh.shape.get("expert", 1)
    if tensor > 1 and (cfg.n_heads % tensor or cfg.n_kv_heads % tensor):
        raise ValueError(f"mesh tensor={tensor} must divide the attention heads "
                         f"({cfg.n_heads} query, {cfg.n_kv_heads} key/value heads)")
    if expert > 1 and cfg.is_moe and cfg.n_experts % expert:
        raise ValueError(f"mesh expert={expert} must divide the number of experts ({cfg.n_experts})")


def inference_mesh(mesh: Mesh | None, cfg, params: dict, roles: dict | None = None) -> Mesh | None:
    """The mesh a command that only runs a model (generate, eval, lm-eval) places it on: `mesh`'s
    devices with `fsdp` folded into `tensor` as far as the attention heads divide, unless the
    weights (`params`: name -> shape and dtype) would then hold more bytes per device than fsdp
    holds while it gathers its largest one. Under fsdp every use of a weight gathers it (each
    decoded token moves the whole model between devices and holds a layer of it gathered on
    each); split the tensor way no weight moves, the activations are all-reduced instead (MXFP4
    expert stacks, which have no width to split, split over their experts)."""
    if mesh is None or mesh.shape.get("fsdp", 1) == 1:
        return mesh
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    fold = max(k for k in range(1, fsdp + 1)
               if fsdp % k == 0 and cfg.n_heads % (tensor * k) == 0 and cfg.n_kv_heads % (tensor * k) == 0)
    if fold == 1:
        return mesh
    data, expert = mesh.shape["data"], mesh.shape["expert"]
    folded = Mesh(mesh.devices.reshape(data, fsdp // fold, fold * tensor, expert), MESH_AXES)
    held, gathered = param_bytes_per_device(params, mesh, roles)
    return folded if param_bytes_per_device(params, folded, roles)[0] <= held + gathered else mesh


def param_bytes_per_device(params: dict, mesh: Mesh, roles: dict | None = None) -> tuple[int, int]:
    """Bytes of `params` (name -> shape and dtype) each device holds under the rules (the largest
    shard; `roles`: what the model declares, causal_lm.parameter_roles), and the most that
    gathering one of them whole adds."""
    placed = state_shardings(params, mesh, roles)
    size = {n: math.prod(a.shape) * np.dtype(a.dtype).itemsize for n, a in params.items()}
    held = {n: held_bytes(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed[n])) for n, a in params.items()}
    return sum(held.values()), max((size[n] - held[n] for n in params), default=0)


def held_bytes(leaf) -> int:
    """Bytes one device holds of an array or ShapeDtypeStruct: its shard under its sharding (the
    whole array without one). Shards are equal in size (the rules split only exact divisors)."""
    placement = getattr(leaf, "sharding", None)
    shape = placement.shard_shape(leaf.shape) if placement is not None else leaf.shape
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def shard_bytes(tree) -> int:
    """held_bytes summed over a pytree's leaves: what one device holds of them."""
    return sum(held_bytes(leaf) for leaf in jax.tree.leaves(tree))


def rows_along_fsdp(mesh: Mesh, rows: int) -> int:
    """Of a batch of `rows` split over the batch axes, the rows the devices along `fsdp` hold
    together (what gathering over `fsdp` gives each of them)."""
    return rows // (mesh.shape["data"] * mesh.shape["expert"])


def fsdp_gathers_rows(mesh: Mesh | None, rows_bytes: int, weight_bytes: int) -> bool:
    """Whether an op under `fsdp` leaves its weight where it lies and gathers the rows of the
    devices along `fsdp` instead of gathering the weight (FSDP): the expert stacks then run
    expert-parallel over `fsdp`, the output head vocabulary-parallel. `rows_bytes`: what the
    gathered rows and their intermediates hold per device; `weight_bytes`: what gathering the
    weight holds. The fewer bytes win, so small batches on a large model (LoRA fine-tuning, RL
    scoring, samples) move their rows, and large ones (pretraining) their weights; the bytes
    moved between devices follow the same sizes."""
    return mesh is not None and mesh.shape.get("fsdp", 1) > 1 and rows_bytes < weight_bytes


def compiler_options(mesh: Mesh | None) -> dict:
    """XLA options for the programs that run over `mesh`. Simulated CPU devices share the host's
    memory, and XLA:CPU's default scheduler orders for concurrency: under fsdp it started every
    layer's weight all-gathers early and held them at once (a 2-layer LoRA step's temporaries
    2802 MiB per device on fsdp=2 against 1136 MiB with the memory-optimized scheduler;
    `scripts/mesh_temporaries.py step`). One device keeps the default: no gathers to order, and
    the demo's training ran ~10% slower with it."""
    if not _cpu_mesh(mesh):
        return {}
    return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def loop_compiler_options(mesh: Mesh | None) -> dict:
    """What a program that loops over the whole model (the decode loop) adds to compiler_options:
    on a CPU mesh, no XLA loop-invariant code motion, which hoisted every weight's all-gather out
    of the loop, so each device held the whole model while decoding (temporaries 138.3 MiB per
    device for a 122.2 MiB model on fsdp=2, 39.1 MiB with the gathers per token;
    `scripts/mesh_temporaries.py decode`). A mesh that splits the weights is there to hold less."""
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"} if _cpu_mesh(mesh) else {}


def _cpu_mesh(mesh: Mesh | None) -> bool:
    return mesh is not None and mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


# ---- logical names -> PartitionSpec ----------------------------------------------------------------
def logical_spec(mesh: Mesh, axes: Iterable, shape: Iterable[int] | None = None) -> P:
    """PartitionSpec of an array whose dimensions have these logical names (None: not split)."""
    axes = tuple(axes)
    shape = tuple(shape) if shape is not None else (None,) * len(axes)
    used: set[str] = set()
    out = []
    for name, size in zip(axes, shape):
        chosen = None
        for candidate in LOGICAL_RULES.get(name, []) if name else []:
            live = tuple(a for a in candidate if mesh.shape.get(a, 1) > 1)
            n = math.prod(mesh.shape[a] for a in live)
            if not live or used & set(live) or (size is not None and size % n):
                continue
            chosen = live
            break
        if chosen:
            used |= set(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_axes(name: str, ndim: int, roles: dict | None = None) -> tuple:
    """Logical dimension names of a parameter; a stacked one gets a leading `layers`. The role the
    model declares for it (`roles`: torch_model.causal_lm.parameter_roles) decides first, then its
    name (PARAM_AXES), then its shape. peft's names map to the base model's
    (torch_model.lora.base_parameter_of); a LoRA adapter takes its base weight's axes: A [r, in]
    shares `in`'s, B [out, r] `out`'s. Expert adapters ([r*E, in], [out, r*E]) leave the r*E axis
    whole: peft orders B's columns rank-major, so no split of it follows the experts'."""
    base, role = base_parameter_of(name)
    declared = declared_role(roles or {}, base)
    axes = ROLE_AXES.get(declared) or _rule_axes(base, name)
    if declared == "experts_out_in" and axes is not None and len(axes) == 3:   # [E, out, in]: the rule names [E, in, out]
        axes = (axes[0], axes[2], axes[1])
    if axes is None:              # by shape: an adapter's base is a Linear; a scanned stack adds `layers`
        # (named `model.layers.stack{k}.` by jax_bridge/layer_stack.py, which imports this module)
        stacked = re.search(r"\.stack\d+\.", name) is not None
        axes = _shape_axes(name, 2 if role is not None else ndim - stacked)
    if role is not None:
        if len(axes) == 3:                   # experts, x @ W[e]: [E, in, out]
            in_axis, out_axis = axes[1], axes[2]
        elif len(axes) == 2:                 # nn.Linear weight: [out, in]
            out_axis, in_axis = axes
        else:
            raise ValueError(f"sharding: adapter {name!r} adapts {base!r}, which is not a matrix")
        axes = (None, in_axis) if role == "A" else (out_axis, None)
    if ndim == len(axes) + 1:
        return ("layers",) + axes
    if ndim != len(axes):
        raise ValueError(f"sharding: parameter {name!r} has {ndim} dims; its rule names {len(axes)}")
    return axes


def _rule_axes(base: str, name: str) -> tuple | None:
    """The axes PARAM_AXES names for `base`; None when no rule does."""
    for pattern, axes in PARAM_AXES:
        if re.fullmatch(pattern, base):
            return axes
    return None


def param_spec(name: str, shape, mesh: Mesh, roles: dict | None = None) -> P:
    return logical_spec(mesh, param_axes(name, len(shape), roles), shape)


def _leaf_name(path) -> str | None:
    """The parameter name a train-state leaf belongs to: the last dict key that looks like one."""
    keys = [getattr(k, "key", None) for k in path]
    return next((k for k in reversed(keys) if isinstance(k, str) and "." in k), None)


def state_shardings(state, mesh: Mesh, roles: dict | None = None):
    """NamedSharding of every leaf of a train state (params, and optimizer state mirroring them
    by name; anything not named after a parameter, like the step count, is replicated).
    roles: what the model declares (torch_model.causal_lm.parameter_roles)."""

    def spec(path, leaf):
        name = _leaf_name(path)
        return NamedSharding(mesh, param_spec(name, leaf.shape, mesh, roles) if name else P())

    return jax.tree_util.tree_map_with_path(spec, state)


def place(tree, shardings):
    """Host arrays (numpy, or arrays every process holds alike) onto their shardings; each
    process transfers only the shards its own devices hold."""

    def put(value, sharding):
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def start_host_copies(tree) -> None:
    """Start copying the arrays this process holds whole to the host, without waiting: a later
    to_host finds them there or on their way, while the devices run what was queued since."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            x.copy_to_host_async()


def to_host(tree):
    """numpy copies of (possibly sharded, possibly multi-process) arrays; every process must
    call this together when an array spans processes."""
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(tree)
    spanning = [isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves]
    # The local arrays in one device_get: their copies start together, one wait rather than one each.
    local = iter(jax.device_get([x for x, s in zip(leaves, spanning) if not s]))
    out = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) if s else np.asarray(next(local))
           for x, s in zip(leaves, spanning)]
    return jax.tree.unflatten(treedef, out)


def whole_matrices_spec(mesh: Mesh, shape) -> P | None:
    """Split a batch of matrices [..., m, n] over its leading axes only (stacked layers,
    experts), so each device holds whole matrices: Muon's Newton-Schulz then runs without
    communication. None when no mesh axis divides a leading axis."""
    lead = list(shape[:-2])
    parts: list[list[str]] = [[] for _ in lead]
    for axis in ("fsdp", "expert", "data", "tensor"):
        size = mesh.shape.get(axis, 1)
        if size == 1:
            continue
        for i, dim in enumerate(lead):
            if dim % (math.prod(mesh.shape[a] for a in parts[i]) * size) == 0:
                parts[i].append(axis)
                break
    if not any(parts):
        return None
    return P(*[None if not p else p[0] if len(p) == 1 else tuple(p) for p in parts], None, None)


# ---- activations and the batch -----------------------------------------------------------------
def batch_axes(mesh: Mesh) -> tuple[str, ...] | None:
    """The mesh axes the batch is split over (None when it is not split)."""
    spec = logical_spec(mesh, ("batch",))
    return (spec[0] if isinstance(spec[0], tuple) else (spec[0],)) if len(spec) else None


def batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in batch_axes(mesh) or ())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Tokens [micro_batches, batch, seq_len + 1]: the batch is split over data x fsdp x expert."""
    return NamedSharding(mesh, P(None, batch_axes(mesh), None))


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """Inference inputs whose first axis is rows (requests, prompts): rows split over the batch axes."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def constrain(x, mesh: Mesh | None, axes: Iterable):
    """A sharding constraint by logical names (GSPMD needs these where it cannot infer well)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(mesh, axes, x.shape)))


def bytes_per_device(arrays) -> dict:
    """Bytes actually held by each device, summed over the addressable shards of `arrays`."""
    held: dict = {}
    for leaf in jax.tree.leaves(arrays):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held
