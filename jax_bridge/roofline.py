"""Roofline of a compiled TPU program: how fast could one chip run it at its published peaks?

The optimized HLO of a (deviceless) TPU compile is split into single-instruction modules; XLA's
generic cost analysis prices each one (FLOPs, transcendentals, bytes per operand) and our Pallas
kernels' `pl.CostEstimate` prices theirs. Each op's roofline time is max(FLOPs / peak, HBM bytes /
bandwidth), plus one op's fixed cost where the chip measured it (OP_COST_S); ops are grouped by
category (XLA matmuls, each kernel, elementwise, copies and layout, collectives, the optimizer's
Newton-Schulz and the rest of its update). Private XLA bindings (`HloModule.to_string`,
`hlo_module_from_text`, `hlo_module_cost_analysis`) are used: see tests/test_roofline.py, which
fails loudly if they change.
"""
from __future__ import annotations

import dataclasses
import json
import re

from jax_bridge import hlo_text as hlo

# Published per-chip figures: dense bf16 peak FLOP/s and HBM bandwidth (bytes/s).
#   v4:  275 TFLOP/s, 1200 GB/s  https://cloud.google.com/tpu/docs/v4
#   v5e: 197 TFLOP/s,  819 GB/s  https://cloud.google.com/tpu/docs/v5e
#   v5p: 459 TFLOP/s, 2765 GB/s  https://cloud.google.com/tpu/docs/v5p
#   v6e: 918 TFLOP/s, 1638 GB/s  https://cloud.google.com/tpu/docs/v6e
# v4's compile-only devices are single TensorCores (half a chip: jax_bridge/tpu_compile.py), so a
# v4 device gets half of each figure.
CHIPS = {"v4": (275e12, 1200e9, 0.5), "v5e": (197e12, 819e9, 1.0), "v5p": (459e12, 2765e9, 1.0),
         "v6e": (918e12, 1638e9, 1.0)}
# The fixed cost of one op on the chip, beyond its FLOPs and bytes: the median measured time of the
# ops the roofline prices at ~0 in a profiled decode loop (BENCHMARKS, 2026-12-06: v5e, 225 of the
# loop's 313 ops, median 0.28 us). Without it `small-o200k`'s decode step (289 ops deviceless) was
# predicted at 0.290 ms against the chip's 0.397 ms of ops; with it, 0.371 ms. A generation not
# measured has none.
OP_COST_S = {"v5e": 0.28e-6}
CATEGORIES = ("matmul (XLA)", "kernel", "elementwise / fusions", "copies / layout", "collectives",
              "optimizer: Newton-Schulz", "optimizer: other")
OPTIMIZER_SCOPE = "optimizer_update"     # the jax.named_scope of the step's update (jax_bridge/step.py)

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier"}
CONTROL = {"while", "call", "conditional"}      # ops that span their bodies' ops
_MOVEMENT = {"copy", "copy-start", "copy-done", "transpose", "reshape", "slice", "dynamic-slice",
             "dynamic-update-slice", "concatenate", "pad", "reverse", "gather"}
_COLLECTIVE = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "send", "recv", "ragged-all-to-all")


def device_peaks(generation: str) -> tuple[float, float]:
    """(peak bf16 FLOP/s, HBM bytes/s) of one compile-only device of a TPU generation."""
    if generation not in CHIPS:
        raise ValueError(f"no published peaks for TPU generation {generation!r}; known: {', '.join(CHIPS)}")
    flops, bandwidth, share = CHIPS[generation]
    return flops * share, bandwidth * share


def op_cost(generation: str) -> float:
    """The fixed seconds of one op on a TPU generation (OP_COST_S; 0 where not measured)."""
    return OP_COST_S.get(generation, 0.0)


def _hbm_share(shape: str | None) -> float:
    """HBM bytes per logical byte of a (tuple) shape: the leaves outside HBM count zero, those in
    HBM their tile padding."""
    if shape is None:
        return 1.0
    leaves = hlo.leaves(shape)
    total = sum(hlo.array_bytes(leaf) for leaf in leaves)
    if total == 0:
        return 1.0 if all(hlo.in_hbm(leaf) for leaf in leaves) else 0.0
    return sum(hlo.array_bytes(leaf) * hlo.padding_factor(leaf) for leaf in leaves if hlo.in_hbm(leaf)) / total


_BYTES_KEY = re.compile(r"^bytes accessed(out|\d+)(\{[\d,]*\})$")


def in_place(ins: hlo.Instruction, comps: dict) -> tuple[set[str], float]:
    """(cost-analysis byte keys of a fusion that move nothing, HBM bytes to add instead).
    Nothing moves for outputs that return a parameter unchanged or a collective's result (aliased
    buffers of an async collective fusion; the collective is priced apart), nor for parameters
    used only to be returned so. An output made by dynamic-update-slice into a parameter (a scan
    writing one step's slice of a stacked buffer, in place) moves its update, not the buffer."""
    called = re.search(r"calls=%([\w.\-]+)", ins.attrs) if ins.opcode == "fusion" else None
    if called is None or called.group(1) not in comps:
        return set(), 0.0
    body = [i for i in (hlo.parse_instruction(line) for line in comps[called.group(1)][1]) if i is not None]
    root = next((i for i in body if re.match(r"^\s*ROOT ", i.line)), None)
    if root is None:
        return set(), 0.0
    by_name = {i.name: i for i in body}
    params = {i.name: int(re.search(r"parameter\((\d+)\)", i.line).group(1)) for i in body if i.opcode == "parameter"}
    collectives = {i.name for i in body if i.opcode.startswith(_COLLECTIVE)}
    uses = {}
    for i in body:
        for name in i.operand_names:
            uses[name] = uses.get(name, 0) + 1
    outputs = list(enumerate(root.operand_names)) if root.opcode == "tuple" else [(None, root.name)]
    keys, added = set(), 0.0
    for k, name in outputs:
        out_key = "bytes accessedout{}" if k is None else f"bytes accessedout{{{k}}}"
        source = by_name.get(name)
        while source is not None and source.opcode == "bitcast" and source.operand_names[0] in by_name:
            source = by_name[source.operand_names[0]]
        if name in params or name in collectives:
            keys.add(out_key)
            buffer = name
        elif source is not None and source.opcode == "dynamic-update-slice" and source.operand_names[0] in params:
            keys.add(out_key)
            update = source.operands[1]
            added += hlo.array_bytes(update) * hlo.padding_factor(update) if hlo.in_hbm(source.shape) else 0.0
            buffer = source.operand_names[0]
        else:
            continue
        if buffer in params and uses.get(buffer, 0) == 1:
            keys.add(f"bytes accessed{params[buffer]}{{}}")
    return keys, added


def hbm_bytes(ins: hlo.Instruction, cost: dict, skip: set = frozenset()) -> float:
    """Bytes the op moves to or from HBM: the cost analysis' per-operand and per-output bytes,
    less the share of operands and outputs the compiler placed in VMEM (or SMEM), padded to the
    arrays' TPU tiles. An asynchronous copy (copy-start) moves its array once between its source
    and destination (the output tuple repeats the source), an asynchronous slice its slice; their
    -done halves only wait."""
    if ins.opcode == "copy-start":
        dest, source = hlo.leaves(ins.shape)[:2]
        return sum(hlo.array_bytes(leaf) * hlo.padding_factor(leaf) for leaf in (dest, source) if hlo.in_hbm(leaf))
    if ins.opcode in ("slice-start", "dynamic-slice-start"):
        # An asynchronous slice (the TPU compiler's prefetch of a weight's rows into VMEM): its
        # output tuple repeats the whole source; the slice is read once from the source and
        # written once to its destination, each counted where it lies in HBM.
        source, dest = hlo.leaves(ins.shape)[:2]
        moved = hlo.array_bytes(dest) * hlo.padding_factor(dest)
        return moved * (hlo.in_hbm(source) + hlo.in_hbm(dest))
    total = 0.0
    # A tuple operand or output has a key per element ('bytes accessedout{1}') and one for the
    # whole ('bytes accessedout{}', their sum): the elements are counted, the whole is not.
    split = {m.group(1) for m in map(_BYTES_KEY.match, cost) if m and m.group(2) != "{}"}
    for key, value in cost.items():
        found = _BYTES_KEY.match(key)
        if not found or key in skip or (found.group(2) == "{}" and found.group(1) in split):
            continue
        which, path = found.groups()
        known = which == "out" or int(which) < len(ins.operands)
        shape = (ins.shape if which == "out" else ins.operands[int(which)]) if known else None
        total += value * _hbm_share(hlo.sub_shape(shape, path) if shape is not None else None)
    return total


# ---- costing and categorising ops --------------------------------------------------------------

@dataclasses.dataclass
class Op:
    name: str
    opcode: str
    category: str
    kernel: str            # the Pallas kernel's name for custom calls, else ""
    shape: str             # result shape without layouts
    operands: list
    trips: int             # times the op runs per step (enclosing while loops' trip counts)
    flops: float           # per run
    transcendentals: float
    bytes: float           # the generic cost analysis' bytes accessed (what the compiler sums)
    hbm_bytes: float       # of which to or from HBM
    estimated: bool = True  # False: a custom call without a cost estimate (counted as zero)
    mxu_passes: int = 1     # float32 matmuls at precision "high" / "highest" run 3 / 6 bf16 passes


def mxu_passes(piece: str) -> int:
    """bf16 passes of the slowest float32 matmul in a piece's text: libtpu's cost analysis counts
    float32 at "highest" as the same FLOPs (and time) as bf16, so the roofline adds the passes."""
    passes = 1
    for line in piece.splitlines():
        found = re.search(r"\b(convolution|dot)\(", line)
        if found and "f32[" in line.split(found.group(0), 1)[1].split(")", 1)[0]:
            precision = re.search(r"operand_precision=\{(\w+)", line)
            if precision:
                passes = max(passes, {"highest": 6, "high": 3}.get(precision.group(1).lower(), 1))
    return passes


def _trip_count(ins: hlo.Instruction, comps: dict) -> int | None:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%([\w.\-]+)", ins.attrs)
    if cond is None:
        return None
    lines = comps[cond.group(1)][1]
    consts = {}
    for line in lines:
        c = hlo.parse_instruction(line)
        if c is not None and c.opcode == "constant":
            value = re.search(r"constant\((-?\d+)\)", line)
            if value:
                consts[c.name] = int(value.group(1))
    for line in lines:
        c = hlo.parse_instruction(line)
        if c is not None and c.opcode == "compare" and "direction=LT" in c.attrs:
            if len(c.operand_names) == 2 and c.operand_names[1] in consts:
                return consts[c.operand_names[1]]       # jax's loops count from 0 in steps of 1
    return None


def _inner_collectives(ins: hlo.Instruction, comps: dict) -> list[hlo.Instruction]:
    """The collectives inside a fusion's computations (none for other ops)."""
    if ins.opcode != "fusion":
        return []
    called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
    found = []
    for name in hlo.closure([called.group(1)], comps) if called else []:
        for line in comps[name][1]:
            inner = hlo.parse_instruction(line)
            if inner is not None and inner.opcode.startswith(_COLLECTIVE) and \
                    not inner.opcode.endswith(("-done", "-update")):
                found.append(inner)
    return found


def _kernel_cost(ins: hlo.Instruction):
    """(flops, transcendentals, bytes) of a Mosaic kernel from its backend config, or None."""
    found = re.search(r'"cost_estimate":\{([^}]*)\}', ins.attrs)
    if not found:
        return None
    fields = {k: float(v) for k, v in re.findall(r'"(\w+)":"?(\d+)"?', found.group(1))}
    return fields.get("flops", 0.0), fields.get("transcendentals", 0.0), fields.get("bytes_accessed", 0.0)


def categorize(ins: hlo.Instruction, comps: dict) -> str:
    in_optimizer = OPTIMIZER_SCOPE in ins.attrs.split('op_name="', 1)[-1].split('"', 1)[0] \
        if 'op_name="' in ins.attrs else False
    op = ins.opcode
    if op.startswith(_COLLECTIVE):
        return "collectives"
    if op == "custom-call" and "tpu_custom_call" in ins.attrs:
        return "kernel"
    if op == "fusion":
        called = re.search(r"calls=%([\w.\-]+)", ins.attrs)
        inner = hlo.computation_opcodes(called.group(1), comps) if called else set()
        if inner & {"convolution", "dot"}:
            return "optimizer: Newton-Schulz" if in_optimizer else "matmul (XLA)"
        if in_optimizer:
            return "optimizer: other"
        moved = inner - _FREE - {"broadcast"}
        return "copies / layout" if moved and moved <= _MOVEMENT else "elementwise / fusions"
    if op in ("convolution", "dot"):
        return "optimizer: Newton-Schulz" if in_optimizer else "matmul (XLA)"
    if in_optimizer:
        return "optimizer: other"
    if op in _MOVEMENT or op.removesuffix("-start").removesuffix("-done") in _MOVEMENT:
        return "copies / layout"         # also asynchronous slices and copies (slice-start, ...)
    return "elementwise / fusions"


def kernel_name(ins: hlo.Instruction) -> str:
    """A Pallas kernel's name: its custom call's instruction name without the numbering."""
    return re.sub(r"\.\d+$", "", ins.name)


def row_name(category: str, kernel: str = "") -> str:
    """The roofline row an op is counted in: its category, each kernel a row of its own."""
    return f"kernel: {kernel}" if category == "kernel" else category


def collect_ops(text: str, cost_fn) -> tuple[list[Op], list[str], list[str]]:
    """Every costed op of the module text, with its trip count; the while loops whose trip count
    could not be read (counted once); the ops the generic analysis could not price (counted as
    zero). cost_fn(module_text) -> XLA cost-analysis dict."""
    comps, entry = hlo.parse_module(text)
    ops, unknown, unpriced = [], [], []

    def walk(name: str, trips: int):
        for line in comps[name][1]:
            ins = hlo.parse_instruction(line)
            if ins is None or ins.opcode in _FREE:
                continue
            if ins.opcode == "while":
                count = _trip_count(ins, comps)
                if count is None:
                    unknown.append(ins.name)
                for key in ("condition", "body"):
                    walk(re.search(key + r"=%([\w.\-]+)", ins.attrs).group(1), trips * (count or 1))
                continue
            if ins.opcode.endswith(("-done", "-update")):
                # The second half of an asynchronous pair (copy, collective, async call): its
                # start carries the work; a piece holding only the wait cannot be parsed.
                # Bytes as the generic analysis counts a wait (its result); none to HBM.
                waited = sum(hlo.array_bytes(leaf) for leaf in hlo.leaves(ins.shape))
                ops.append(Op(ins.name, ins.opcode, categorize(ins, comps), "", hlo.without_layouts(ins.shape),
                              [hlo.without_layouts(o) for o in ins.operands], trips, 0.0, 0.0, waited, 0.0))
                continue
            if ins.opcode in CONTROL:
                for callee in hlo.callees(ins.attrs, comps):
                    walk(callee, trips)
                continue
            category = categorize(ins, comps)
            kernel, estimated = "", True
            if category == "kernel":
                kernel = kernel_name(ins)
                est = _kernel_cost(ins)
                estimated = est is not None
                flops, trans, nbytes = est or (0.0, 0.0, 0.0)
                hbm = nbytes
                passes = 1
            else:
                piece = hlo.single_op_module(ins, comps)
                try:
                    cost = cost_fn(piece)
                except Exception as e:  # noqa: BLE001 - reported as unpriced, and the totals check shows it
                    unpriced.append(f"{ins.name} ({ins.opcode}: {str(e).strip().splitlines()[0][:120]})")
                    cost = {}
                flops, trans = cost.get("flops", 0.0), cost.get("transcendentals", 0.0)
                skip, added = in_place(ins, comps)
                nbytes, hbm = cost.get("bytes accessed", 0.0), hbm_bytes(ins, cost, skip) + added
                passes = mxu_passes(piece) if category in ("matmul (XLA)", "optimizer: Newton-Schulz") else 1
                for inner in _inner_collectives(ins, comps):
                    # An async collective fusion (a weight all-gather the TPU compiler fused into a
                    # matmul to overlap them): its collective is priced apart, as a collective.
                    try:
                        moved = cost_fn(hlo.single_op_module(inner, comps))
                    except Exception as e:  # noqa: BLE001
                        first = str(e).strip().splitlines()[0][:120]
                        unpriced.append(f"{ins.name}/{inner.name} ({inner.opcode}: {first})")
                        continue
                    # Priced alone, a collective can move more than its fusion reads and writes (an
                    # all-reduce-scatter fusion: the whole all-reduce's output); it is given at most
                    # what the fusion has left, so the pieces still sum to the fusion.
                    inner_bytes = min(moved.get("bytes accessed", 0.0), max(nbytes, 0.0))
                    inner_hbm = min(hbm_bytes(inner, moved), max(hbm, 0.0))
                    inner_flops = min(moved.get("flops", 0.0), max(flops, 0.0))
                    nbytes, hbm, flops = nbytes - inner_bytes, hbm - inner_hbm, flops - inner_flops
                    ops.append(Op(f"{ins.name}/{inner.name}", inner.opcode, "collectives", "",
                                  hlo.without_layouts(inner.shape), [hlo.without_layouts(o) for o in inner.operands],
                                  trips, max(inner_flops, 0.0), 0.0, max(inner_bytes, 0.0), max(inner_hbm, 0.0)))
            ops.append(Op(ins.name, ins.opcode, category, kernel, hlo.without_layouts(ins.shape),
                          [hlo.without_layouts(o) for o in ins.operands], trips, max(flops, 0.0), max(trans, 0.0),
                          max(nbytes, 0.0), max(hbm, 0.0), estimated, passes))

    walk(entry, 1)
    return ops, unknown, unpriced


def loop_ops(ops: list[Op], text: str) -> list[Op]:
    """The ops of `ops` (collect_ops of `text`) that run inside the program's loops: all but the
    entry computation's own. A decode program's per-token work; the rest, its prologue, runs once
    per call."""
    comps, entry = hlo.parse_module(text)
    prologue = {ins.name for ins in map(hlo.parse_instruction, comps[entry][1]) if ins is not None}
    return [op for op in ops if op.name not in prologue]


def xla_cost_fn():
    """The generic (platform-independent) HLO cost analysis, through the CPU client."""
    import jax
    from jaxlib import _hlo, _jax

    client = jax.devices("cpu")[0].client
    return lambda text: _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(text))


def module_text(compiled) -> str:
    """The compiled program's optimized HLO with operand shapes and backend configs printed."""
    from jaxlib import _hlo

    modules = compiled.runtime_executable().hlo_modules()
    if len(modules) != 1:
        raise ValueError(f"expected one HLO module in the compiled program, found {len(modules)}")
    options = _hlo.HloPrintOptions()
    options.print_operand_shape = True
    options.print_metadata = True
    options.print_backend_config = True
    return modules[0].to_string(options)


# ---- the roofline ------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    category: str
    ops: int
    flops: float            # per step (trip counts applied)
    transcendentals: float
    hbm_bytes: float
    seconds: float          # sum of the ops' roofline times
    memory_bound_seconds: float
    note: str = ""


@dataclasses.dataclass
class Roofline:
    generation: str
    peak_flops: float
    hbm_bandwidth: float
    op_cost: float               # seconds added to each op (OP_COST_S)
    rows: list
    flops: float
    hbm_bytes: float
    seconds: float               # the step: every row but the collectives (assumed overlapped)
    memory_bound_share: float
    compiler_flops: float        # compiled.cost_analysis() (libtpu): loop bodies once, kernels by estimate
    compiler_transcendentals: float
    compiler_bytes: float        # libtpu's own byte count (its accounting differs from the generic one)
    compiler_optimal_seconds: float | None
    generic_bytes: float         # the generic analysis of the whole module + the kernels' estimates
    once_flops: float            # the same totals summed over the per-op pieces, loop bodies once
    once_transcendentals: float
    once_bytes: float
    top_memory_bound: list       # [{name, category, shape, operands, trips, hbm_bytes, seconds}]
    unknown_trip_counts: list
    unpriced_ops: list           # ops the generic analysis could not parse or price (counted as zero)
    kernels_without_estimate: list
    model_flops: float | None = None
    optimizer_seconds: float = 0.0
    mfu_ceiling: float | None = None
    model_mfu_ceiling: float | None = None
    tiles: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def totals_mismatch(self, tolerance: float = 0.01) -> list[str]:
        """The program totals the per-op pieces fail to reproduce within `tolerance` (loop
        bodies once, as the compilers count): FLOPs and transcendentals against libtpu's
        totals, bytes against the generic analysis of the whole program. Empty: all agree."""
        pairs = {"flops": (self.once_flops, self.compiler_flops),
                 "transcendentals": (self.once_transcendentals, self.compiler_transcendentals),
                 "bytes": (self.once_bytes, self.generic_bytes)}
        return [f"{name}: per-op sum {ours:.6g} vs program {total:.6g}" for name, (ours, total) in pairs.items()
                if abs(ours - total) > tolerance * max(abs(total), 1.0)]

    def set_model_flops(self, model_flops: float) -> None:
        """The model's FLOPs per step on this device (train/run/flops.py) and the MFU ceilings they
        give: model FLOPs / (roofline time x peak), for the whole step and without the optimizer."""
        self.model_flops = model_flops
        if self.seconds:
            self.mfu_ceiling = model_flops / (self.seconds * self.peak_flops)
            model_part = self.seconds - self.optimizer_seconds
            self.model_mfu_ceiling = model_flops / (model_part * self.peak_flops) if model_part > 0 else None


def op_seconds(op: Op, peak_flops: float, bandwidth: float, fixed: float) -> tuple[float, bool]:
    """(roofline seconds of one run, memory-bound?); `fixed`: the generation's op_cost."""
    compute, memory = op.flops * op.mxu_passes / peak_flops, op.hbm_bytes / bandwidth
    return max(compute, memory) + fixed, memory > compute


def roofline(compiled, generation: str, *, tiles: dict | None = None, top: int = 5) -> Roofline:
    """The roofline of a compiled TPU program on one device of `generation` (set_model_flops
    then adds the MFU ceilings)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return roofline_of_text(module_text(compiled), dict(cost), generation, tiles=tiles, top=top)


def roofline_of_text(text: str, cost: dict, generation: str, *, cost_fn=None, tiles: dict | None = None,
                     top: int = 5) -> Roofline:
    """The same from the module's text (module_text) and libtpu's cost_analysis() dict."""
    cost_fn = cost_fn or xla_cost_fn()
    return roofline_of_ops(collect_ops(text, cost_fn), text, cost, generation, cost_fn=cost_fn, tiles=tiles, top=top)


def roofline_of_ops(collected: tuple, text: str, cost: dict, generation: str, *, cost_fn=None,
                    tiles: dict | None = None, top: int = 5) -> Roofline:
    """The same from collect_ops' result for that text (a caller that also needs each op's time)."""
    peak, bandwidth = device_peaks(generation)
    fixed = op_cost(generation)
    cost_fn = cost_fn or xla_cost_fn()
    ops, unknown, unpriced = collected
    rows, timed = {}, []
    for op in ops:
        seconds, memory_bound = op_seconds(op, peak, bandwidth, fixed)
        key = row_name(op.category, op.kernel)
        row = rows.setdefault(key, Row(key, 0, 0.0, 0.0, 0.0, 0.0, 0.0))
        row.ops += 1
        row.flops += op.flops * op.trips
        row.transcendentals += op.transcendentals * op.trips
        row.hbm_bytes += op.hbm_bytes * op.trips
        row.seconds += seconds * op.trips
        row.memory_bound_seconds += seconds * op.trips if memory_bound else 0.0
        if not op.estimated:
            row.note = "no cost estimate: not counted"
        if memory_bound and op.category != "collectives":
            timed.append((seconds * op.trips, op))
    rank = {c: i for i, c in enumerate(CATEGORIES)}
    ordered = sorted(rows.values(), key=lambda r: (rank.get(r.category.split(":")[0] if r.category.startswith(
        "kernel") else r.category, 99), r.category))
    # Collectives run asynchronously beside the compute (XLA's async collectives and collective
    # fusions); their time is shown but not added to the step's: an upper bound on overlap.
    for r in ordered:
        if r.category == "collectives":
            r.note = "assumed overlapped with compute: not in the step time; priced at HBM bandwidth, ICI not modelled"
    total = sum(r.seconds for r in ordered if r.category != "collectives")
    whole = cost_fn(hlo.without_stack_frames(text))
    kernel_bytes = sum(op.hbm_bytes for op in ops if op.category == "kernel")
    timed.sort(key=lambda t: -t[0])
    result = Roofline(
        generation=generation, peak_flops=peak, hbm_bandwidth=bandwidth, op_cost=fixed, rows=ordered,
        flops=sum(r.flops for r in ordered), hbm_bytes=sum(r.hbm_bytes for r in ordered), seconds=total,
        memory_bound_share=sum(r.memory_bound_seconds for r in ordered if r.category != "collectives") / total
        if total else 0.0,
        compiler_flops=float(cost.get("flops", 0.0)),
        compiler_transcendentals=float(cost.get("transcendentals", 0.0)),
        compiler_bytes=float(cost.get("bytes accessed", 0.0)), compiler_optimal_seconds=cost.get("optimal_seconds"),
        generic_bytes=float(whole.get("bytes accessed", 0.0)) + kernel_bytes,
        once_flops=sum(op.flops for op in ops), once_transcendentals=sum(op.transcendentals for op in ops),
        once_bytes=sum(op.hbm_bytes if op.category == "kernel" else op.bytes for op in ops),
        top_memory_bound=[dict(name=op.name, category=op.category, shape=op.shape, operands=op.operands,
                               trips=op.trips, hbm_bytes=op.hbm_bytes * op.trips, seconds=s)
                          for s, op in timed[:top]],
        unknown_trip_counts=unknown, unpriced_ops=unpriced,
        kernels_without_estimate=sorted({op.kernel for op in ops if not op.estimated}), tiles=dict(tiles or {}))
    result.optimizer_seconds = sum(r.seconds for r in ordered if r.category.startswith("optimizer"))
    return result


def _si(x: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def format_roofline(r: Roofline) -> str:
    lines = [f"roofline on one {r.generation} device: {r.peak_flops / 1e12:.1f} TFLOP/s bf16, "
             f"{r.hbm_bandwidth / 1e9:.0f} GB/s HBM (published peaks); per op max(FLOPs/peak, HBM bytes/bandwidth)"
             + (f" + {r.op_cost * 1e6:.2f} us (one op's fixed cost, measured on a {r.generation})" if r.op_cost else
                " (no fixed cost per op measured for this generation)"),
             f"  {'category':36} {'ops':>5} {'FLOPs':>12} {'HBM bytes':>12} {'time':>10} {'share':>6} {'mem-bound':>9}"]
    for row in r.rows:
        share = row.seconds / r.seconds if r.seconds else 0.0
        mem = row.memory_bound_seconds / row.seconds if row.seconds else 0.0
        shown = "     -" if row.category == "collectives" else f"{share:6.1%}"
        lines.append(f"  {row.category[:36]:36} {row.ops:5d} {_si(row.flops, 'FLOP'):>12} "
                     f"{_si(row.hbm_bytes, 'B'):>12} {row.seconds * 1e3:8.2f} ms {shown} {mem:9.0%}"
                     + (f"  ({row.note})" if row.note else ""))
    opt = r.compiler_optimal_seconds
    lines.append(f"  {'step (without collectives)':36} {sum(x.ops for x in r.rows):5d} {_si(r.flops, 'FLOP'):>12} "
                 f"{_si(r.hbm_bytes, 'B'):>12} {r.seconds * 1e3:8.2f} ms; memory-bound share "
                 f"{r.memory_bound_share:.1%}")
    mismatch = r.totals_mismatch()
    lines.append(f"  libtpu's optimal_seconds: {'-' if opt is None else f'{opt * 1e3:.2f} ms'} (its own per-op model; "
                 f"loop bodies once)")
    lines.append(f"  program totals, loop bodies once: libtpu {_si(r.compiler_flops, 'FLOP')}, "
                 f"{_si(r.compiler_bytes, 'B')} (its byte count); generic analysis + kernel estimates "
                 f"{_si(r.generic_bytes, 'B')}; per-op sums {_si(r.once_flops, 'FLOP')}, {_si(r.once_bytes, 'B')}: "
                 + ("agree within 1%" if not mismatch else "DISAGREE: " + "; ".join(mismatch)))
    if r.model_flops:
        lines.append(f"  model FLOPs (train/run/flops.py) {_si(r.model_flops, 'FLOP')} per device: MFU ceiling "
                     f"{r.mfu_ceiling:.1%} for the step, {r.model_mfu_ceiling:.1%} for the model part alone "
                     f"(without the optimizer's {r.optimizer_seconds * 1e3:.2f} ms)")
    if r.top_memory_bound:
        lines.append("  most expensive memory-bound ops:")
        for t in r.top_memory_bound:
            lines.append(f"    {t['seconds'] * 1e3:8.3f} ms  {t['category']:24} {t['name']} -> {t['shape']} "
                         f"from {', '.join(t['operands'][:4])}" + (f" (x{t['trips']})" if t["trips"] > 1 else ""))
    if r.kernels_without_estimate:
        lines.append(f"  kernels without a cost estimate (invisible to cost analysis, counted as zero): "
                     f"{', '.join(r.kernels_without_estimate)}")
    if r.unpriced_ops:
        lines.append(f"  ops the generic cost analysis could not price (counted as zero): {len(r.unpriced_ops)}: "
                     + "; ".join(r.unpriced_ops[:5]))
    if r.unknown_trip_counts:
        lines.append(f"  loops whose trip count was not read (counted once): {', '.join(r.unknown_trip_counts)}")
    if r.tiles:
        lines.append("  tiles: " + json.dumps(r.tiles, sort_keys=True))
    return "\n".join(lines)
