"""The problems `torchlyra bench kernels` measures (each op at the shape sets of Lyra's benchmark:
tiny, Lyra Small, gpt-oss-20b), the programs built from them (forward; forward+backward) and
their inputs, and timing a compiled program; shared by the memory benchmark (kernels.py) and the
tile sweep (tune.py)."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from formats.errors import UserError


@dataclass
class Case:
    """One benchmark problem: an op at a shape set, with input specs and static kwargs."""
    op: str
    shape: str              # a key of SHAPES
    label: str              # human-readable variant (window, dims)
    dtype: str
    specs: list             # [(shape tuple, dtype name, kind)]; kind: float | labels | groups | mxfp4 | scales
    kwargs: dict = field(default_factory=dict)
    dims: dict = field(default_factory=dict)


# Per shape set: attention (B, Hq, Hkv, T, D, window), cross-entropy (N tokens, H, V), MoE
# (M = tokens x experts per token, H, I, E; moe_mxfp4 at the same dims). Lyra Small and gpt-oss-20b
# at 16,384 tokens per step.
SHAPES = {
    "tiny": dict(attention=(8, 4, 2, 256, 64, 64), cross_entropy=(2048, 256, 4096), moe=(4096, 256, 256, 8)),
    "lyra-small": dict(attention=(4, 16, 4, 4096, 128, 128), cross_entropy=(16384, 2048, 201088),
                       moe=(32768, 2048, 384, 16)),
    "gpt-oss-20b": dict(attention=(4, 64, 8, 4096, 64, 128), cross_entropy=(16384, 2880, 201088),
                        moe=(65536, 2880, 2880, 32)),
}


def kernel_cases(op: str, shape: str, windows: bool = True, dtype: str | None = None) -> list[Case]:
    """The benchmark problems of `op` at shape set `shape` (tiny in float32, the CPU training
    dtype; the big presets in bf16; `dtype` overrides). windows=False: attention's
    sliding-window case only."""
    dt = dtype or ("float32" if shape == "tiny" else "bfloat16")
    dims = SHAPES[shape]["moe" if op == "moe_mxfp4" else op]
    if op == "attention":
        b, hq, hkv, t, d, w = dims
        out = []
        for window in ((w, 0) if windows else (w,)):
            out.append(Case(op, shape, f"B{b} H{hq}/{hkv} T{t} D{d} " + (f"win{window}" if window else "full"), dt,
                            [((b, hq, t, d), dt, "float"), ((b, hkv, t, d), dt, "float"),
                             ((b, hkv, t, d), dt, "float"), ((hq,), "float32", "float")],
                            dict(sliding_window=window, scale=d ** -0.5),
                            dict(B=b, Hq=hq, Hkv=hkv, T=t, D=d, window=window)))
        return out
    if op == "cross_entropy":
        n, h, v = dims
        return [Case(op, shape, f"N{n} H{h} V{v}", dt,
                     [((n, h), dt, "float"), ((v, h), dt, "float"), ((n,), "int32", "labels")],
                     dict(ignore_index=-100), dict(N=n, H=h, V=v))]
    if op == "moe":
        m, h, i, e = dims
        return [Case(op, shape, f"M{m} H{h} I{i} E{e}", dt,
                     [((m, h), dt, "float"), ((e,), "int32", "groups"), ((e, h, 2 * i), dt, "float"),
                      ((e, 2 * i), dt, "float"), ((e, i, h), dt, "float"), ((e, h), dt, "float")],
                     dict(alpha=1.702, limit=7.0), dict(M=m, H=h, I=i, E=e))]
    if op == "moe_mxfp4":       # the released stacks: bytes [E, out, in/2], scale bytes [E, out, in/32]
        m, h, i, e = dims
        return [Case(op, shape, f"M{m} H{h} I{i} E{e} MXFP4", dt,
                     [((m, h), dt, "float"), ((e,), "int32", "groups"), ((e, 2 * i, h // 2), "uint8", "mxfp4"),
                      ((e, 2 * i, h // 32), "uint8", "scales"), ((e, 2 * i), dt, "float"),
                      ((e, h, i // 2), "uint8", "mxfp4"), ((e, h, i // 32), "uint8", "scales"), ((e, h), dt, "float")],
                     dict(alpha=1.702, limit=7.0), dict(M=m, H=h, I=i, E=e))]
    raise UserError(f"unknown op {op!r}")


def case_for_key(op: str, key: str) -> Case:
    """The problem of one call key (jax_bridge.kernel_tiles.call_key) of a run's traced step: its
    shapes and dtype, so a tile timed on it is the tile that call looks up (shape 'run')."""
    from jax_bridge.kernel_tiles import TileTableError, key_dims, key_fields

    try:
        f = key_fields(key)
        dt = f["dtype"]
        if op == "attention":
            b, hq, t, d = key_dims(f["q"])
            hkv, window = int(f["kv_heads"]), int(f["window"])
            return Case(op, "run", f"B{b} H{hq}/{hkv} T{t} D{d} " + (f"win{window}" if window else "full"), dt,
                        [((b, hq, t, d), dt, "float"), ((b, hkv, t, d), dt, "float"), ((b, hkv, t, d), dt, "float"),
                         ((hq,), "float32", "float")],
                        dict(sliding_window=window, scale=d ** -0.5),
                        dict(B=b, Hq=hq, Hkv=hkv, T=t, D=d, window=window))
        if op == "cross_entropy":
            *rows, h = key_dims(f["hidden"])
            v = int(f["vocab"])
            n = math.prod(rows)
            return Case(op, "run", f"N{n} H{h} V{v}", dt,
                        [((*rows, h), dt, "float"), ((v, h), dt, "float"), (tuple(rows), "int32", "labels")],
                        dict(ignore_index=-100), dict(N=n, H=h, V=v))
        if op == "moe":
            m, h = key_dims(f["rows"])
            e, i = int(f["experts"]), int(f["inner"])
            return Case(op, "run", f"M{m} H{h} I{i} E{e}", dt,
                        [((m, h), dt, "float"), ((e,), "int32", "groups"), ((e, h, 2 * i), dt, "float"),
                         ((e, 2 * i), dt, "float"), ((e, i, h), dt, "float"), ((e, h), dt, "float")],
                        dict(alpha=1.702, limit=7.0), dict(M=m, H=h, I=i, E=e))
    except (KeyError, ValueError) as e:
        raise TileTableError(f"kernel tiles: cannot read {op} call key {key!r} ({e})") from None
    raise UserError(f"op {op!r} takes no tuned tiles")


# ---- building the functions ---------------------------------------------------------------------
def float_positions(case: Case) -> tuple[int, ...]:
    return tuple(i for i, (_, _, kind) in enumerate(case.specs) if kind == "float")


def make_fn(fn, case: Case, direction: str, kernel_kwargs: dict, vjp: bool = False):
    """f(*inputs) for the direction: the op itself, or value_and_grad of the sum of its outputs.
    vjp=True: forward+backward as f(*inputs, *cotangents) -> (outputs, input grads) instead, so
    the op's outputs and incoming gradients are the program's outputs / arguments, not temps."""
    import jax
    import jax.numpy as jnp

    kwargs = {**case.kwargs, **kernel_kwargs}

    def fwd(*args):
        return fn(*args, **kwargs)

    if direction == "fwd":
        return fwd
    floats = float_positions(case)

    if vjp:
        from pallas_kernels.memory import vjp_program
        return vjp_program(fwd, floats, n_inputs=len(case.specs))

    def fwd_bwd(*args):
        def loss(*fl):
            full = list(args)
            for pos, x in zip(floats, fl):
                full[pos] = x
            out = fwd(*full)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return sum(jnp.sum(o.astype(jnp.float32)) for o in outs)
        return jax.value_and_grad(loss, argnums=tuple(range(len(floats))))(*(args[p] for p in floats))

    return fwd_bwd


def abstract_inputs(case: Case, fn=None, kernel_kwargs=None, vjp: bool = False):
    """ShapeDtypeStructs of the inputs; with vjp, followed by the cotangents of fn's outputs."""
    import jax
    import jax.numpy as jnp
    specs = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d, _ in case.specs]
    if vjp:
        out = jax.eval_shape(lambda *a: fn(*a, **case.kwargs, **(kernel_kwargs or {})), *specs)
        specs += [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in jax.tree_util.tree_leaves(out)]
    return specs


def concrete_inputs(case: Case, seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    key = jax.random.PRNGKey(seed)
    out = []
    for s, d, kind in case.specs:
        key, sub = jax.random.split(key)
        if kind == "float":
            out.append((jax.random.normal(sub, s, jnp.float32) * 0.5).astype(d))
        elif kind in ("mxfp4", "scales"):   # any codes; scale bytes giving values of ~1 / sqrt(fan-in)
            low, high = (0, 256) if kind == "mxfp4" else (118, 123)
            out.append(jax.random.randint(sub, s, low, high, jnp.int32).astype(jnp.uint8))
        elif kind == "labels":
            out.append(jax.random.randint(sub, s, 0, case.dims["V"], jnp.int32))
        elif kind == "groups":  # uneven but deterministic expert loads summing to M
            e, m = s[0], case.dims["M"]
            w = np.random.default_rng(seed).dirichlet(np.ones(e) * 2.0)
            sizes = np.floor(w * m).astype(np.int32)
            sizes[0] += m - sizes.sum()
            out.append(jnp.asarray(sizes, jnp.int32))
        else:
            raise AssertionError(kind)
    return out


def time_calls(compiled, inputs, warmup: int, repeats: int) -> float:
    import jax
    for _ in range(warmup):
        jax.block_until_ready(compiled(*inputs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def short_error(e: BaseException) -> str:
    """A measurement's failure in one line: the exception's type and first line, at most 240 characters."""
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:240]
