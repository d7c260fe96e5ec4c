"""Reading XLA's HLO text as the compiler prints it: instructions (result shape, opcode, operand
shapes and names, attributes), computations, a single instruction as a module of its own, and
array shapes with TPU layouts (memory space, tile padding). Used by jax_bridge/roofline.py.
"""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str          # result shape, with layout
    opcode: str
    operands: list      # operand shapes (with layouts), in order
    operand_names: list
    attrs: str          # everything after the operand list
    line: str


def _closing(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")


def parse_instruction(line: str) -> Instruction | None:
    found = _INSTR.match(line)
    if not found:
        return None
    pos = found.end()
    if line[pos] == "(":
        end = _closing(line, pos)
    else:
        end = line.index(" ", pos)
    shape = line[pos:end]
    rest = line[end + 1:]
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        raise ValueError(f"cannot read the opcode of HLO line {line[:120]!r}")
    close = _closing(rest, op.end() - 1)
    parts = [o.rsplit(" %", 1) for o in _split_top(rest[op.end():close - 1])]
    return Instruction(found.group(1), shape, op.group(1), [p[0] for p in parts], [p[-1] for p in parts],
                       rest[close:], line)


def parse_module(text: str) -> tuple[dict, str]:
    """({computation name: (header, [lines])}, entry name) of an HLO module's text, in order."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        if current is None:
            head = re.match(r"^(ENTRY )?%([\w.\-]+) ", line)
            if head and line.rstrip().endswith("{"):
                current = head.group(2)
                comps[current] = (line, [])
                if head.group(1):
                    entry = current
        elif line.startswith("}"):
            current = None
        else:
            comps[current][1].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


_CALLEE = re.compile(r"%([\w.\-]+)")


def callees(attrs: str, comps: dict) -> list[str]:
    return [n for n in _CALLEE.findall(attrs) if n in comps]


def closure(names: list[str], comps: dict) -> list[str]:
    """The computations `names` call, transitively, in module order (callees first)."""
    seen, stack = set(), list(names)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps[name][1]:
            ins = parse_instruction(line)
            if ins is not None:
                stack.extend(callees(ins.attrs, comps))
    return [n for n in comps if n in seen]


def without_stack_frames(text: str) -> str:
    """Stack frames live in the module's header tables, which a re-parsed piece does not carry."""
    return re.sub(r" stack_frame_id=\d+", "", text)


def single_op_module(ins: Instruction, comps: dict) -> str:
    """HLO text of a module whose entry computes `ins` alone from parameters."""
    attrs = without_stack_frames(re.sub(r", control-predecessors=\{[^}]*\}", "", ins.attrs))
    body = [f"  %p{i} = {shape} parameter({i})" for i, shape in enumerate(ins.operands)]
    args = ", ".join(f"%p{i}" for i in range(len(ins.operands)))
    body.append(f"  ROOT %{ins.name} = {ins.shape} {ins.opcode}({args}){attrs}")
    parts = ["HloModule piece"]
    for name in closure(callees(attrs, comps), comps):
        header, lines = comps[name]
        parts.append(without_stack_frames("\n".join([header, *lines, "}"])))
    parts.append("\n".join(["ENTRY %piece {", *body, "}"]))
    return "\n\n".join(parts)


# ---- shapes: bytes held outside HBM --------------------------------------------------------------

def leaves(shape: str) -> list[str]:
    """Array shapes of a (possibly tuple) shape, flattened in order."""
    shape = shape.strip()
    if shape.startswith("("):
        return [leaf for part in _split_top(shape[1:-1]) for leaf in leaves(part)]
    return [shape]


def sub_shape(shape: str, path: str) -> str | None:
    """The sub-shape at a cost-analysis shape index such as '{}' or '{1}' or '{0,2}'."""
    index = [int(i) for i in path.strip("{}").split(",") if i.strip()]
    for i in index:
        shape = shape.strip()
        if not shape.startswith("("):
            return None
        parts = _split_top(shape[1:-1])
        if i >= len(parts):
            return None
        shape = parts[i]
    return shape


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
             "s4": 0.5, "u4": 0.5}


def array_bytes(leaf: str) -> float:
    found = re.match(r"(\w+)\[([\d,]*)\]", leaf.strip())
    if not found:
        return 0.0
    n = 1
    for dim in filter(None, found.group(2).split(",")):
        n *= int(dim)
    return n * _ITEMSIZE.get(found.group(1), 4)


def in_hbm(leaf: str) -> bool:
    """An array with no memory space, or S(0), is in HBM; S(1) is VMEM, others SMEM/sync flags."""
    space = re.search(r"S\((\d+)\)\}\s*$", leaf.strip())
    return space is None or space.group(1) == "0"


def padding_factor(leaf: str) -> float:
    """Physical / logical size of an array under its TPU tiling: the first tile T(a, b) pads the
    most minor dimensions (e.g. a [.., 64] bf16 array in (8, 128) tiles moves twice its bytes)."""
    found = re.match(r"\w+\[([\d,]*)\]\{([\d,]*):([^}]*)\}", leaf.strip())
    tile = re.search(r"T\(([\d,]+)\)", found.group(3)) if found else None
    if tile is None:
        return 1.0
    dims = [int(x) for x in found.group(1).split(",") if x]
    minor_first = [dims[int(i)] for i in found.group(2).split(",") if i] if dims else []
    padded = list(minor_first)
    for k, size in enumerate(reversed([int(x) for x in tile.group(1).split(",")])):
        if k < len(padded):
            padded[k] = -(-padded[k] // size) * size
        else:
            padded.append(size)
    logical = 1
    for d in dims:
        logical *= d
    physical = 1
    for d in padded:
        physical *= d
    return physical / logical if logical else 1.0


def without_layouts(shape: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", shape)


def computation_opcodes(name: str, comps: dict) -> set:
    ops = set()
    for n in closure([name], comps):
        for line in comps[n][1]:
            ins = parse_instruction(line)
            if ins is not None:
                ops.add(ins.opcode)
    return ops
