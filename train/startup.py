"""Where a command's start goes: the seconds from the process's start to its first step or token,
phase by phase (imports, data, the model, hashing and placing the parameters, the first program
runs), with what JAX spent tracing, lowering and compiling (or loading from the persistent
compilation cache) inside them. Printed in one line and, for a training or rl run, recorded in its
metrics ({"kind": "startup"}); eval and parity, whose work is mostly compiling at these sizes,
print the same line for the whole command."""
from __future__ import annotations

import os
import sys
import time


def process_age() -> float:
    """Seconds since this process started (its imports, argument parsing, ...)."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process(os.getpid()).create_time())
    except (ImportError, OSError):
        return 0.0


def modules_without_bytecode() -> int:
    """Modules this process compiled from source and will compile again in the next one: counted
    only where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, -B) and finds none cached; 0
    elsewhere. A TPU host that sets the variable over packages installed without bytecode compiled
    3,186 modules from source in every `generate` (6.9 s by cProfile)."""
    if not sys.dont_write_bytecode:
        return 0
    count = 0
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        cached, origin = getattr(spec, "cached", None), getattr(spec, "origin", None) or ""
        count += bool(cached and origin.endswith(".py") and not os.path.exists(cached))
    return count


_ACTIVE: "Startup | None" = None


def mark(name: str) -> None:
    """Mark `name` in the command's Startup (the newest one made in this process), if any: for
    code a command hands control to, as lm-eval builds our backend."""
    if _ACTIVE is not None:
        _ACTIVE.mark(name)


class Startup:
    """Phases in the order they run: `mark(name)` gives the time since the previous mark (or since
    this Startup was made) to `name`; the process's age when it is made counts as "imports"."""

    def __init__(self):
        global _ACTIVE
        _ACTIVE = self
        from formats.checkpoint_integrity import HASHING
        from jax_bridge import compile_cache

        self.phases: dict[str, float] = {"imports": process_age()}
        self._jax, self._hashing = compile_cache.events(), dict(HASHING)
        self._cache = compile_cache
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def start_devices(self) -> None:
        """Start JAX's backend (the accelerator's runtime) as a phase of its own, once the cluster
        is joined: on one TPU v5e host it took 10 s, hidden in whichever phase first asked for a
        device."""
        import jax

        jax.devices()
        self.mark("starting the devices")

    def record(self) -> dict:
        """The phases' seconds, then hashing's and JAX's (trace, lower, compile) inside them, and the
        programs the persistent cache loaded and compiled, since this Startup was made."""
        from formats.checkpoint_integrity import HASHING

        now = self._cache.events()
        out = {f"{name.replace(' ', '_')}_s": round(seconds, 3) for name, seconds in self.phases.items()}
        out.update(total_s=round(sum(self.phases.values()), 3),
                   hashing_s=round(HASHING["seconds"] - self._hashing["seconds"], 3),
                   hashed_bytes=HASHING["bytes"] - self._hashing["bytes"],
                   **{k: round(now[k] - self._jax[k], 3) for k in ("trace_s", "lower_s", "compile_s")},
                   programs_loaded=now["hits"] - self._jax["hits"], programs_compiled=now["misses"] - self._jax["misses"],
                   modules_without_bytecode=modules_without_bytecode())
        return out

    def line(self, cache_dir=None, label: str = "start", record: dict | None = None) -> str:
        """One line: `label` (a command that runs to its end, as eval and parity, says "time"), the
        total and each phase, then what hashing and JAX took inside them and what the cache did."""
        r = record or self.record()
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        cache = ("; compilation cache off" if cache_dir is None else
                 f"; compilation cache {cache_dir}: {r['programs_loaded']} programs loaded, "
                 f"{r['programs_compiled']} compiled")
        return (f"{label} {r['total_s']:.1f} s: {phases}; inside them hashing {r['hashing_s']:.1f} s "
                f"({r['hashed_bytes'] / 1e6:,.0f} MB), trace {r['trace_s']:.1f} s, lower {r['lower_s']:.1f} s, "
                f"compile {r['compile_s']:.1f} s" + cache + _bytecode_note(r["modules_without_bytecode"]))


def _bytecode_note(count: int) -> str:
    if not count:
        return ""
    return (f"; {count} modules compiled from source, as in every start: this Python writes no bytecode "
            f"(PYTHONDONTWRITEBYTECODE or -B); `python -m compileall` over the installed packages once saves it")
