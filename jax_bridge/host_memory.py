"""Hand the heap XLA's compiler freed back to the operating system after each long compile.

XLA:CPU compiles on its own threads, and glibc keeps what they free mapped in their arenas: after
the two-layer LoRA step of the small released shape on fsdp=2 each process held 0.35 GiB more
for the rest of the run, which the per-process memory bound counts (RssAnon,
tests/test_command_memory.py). `malloc_trim` returns it. Only compiles of at least MIN_SECONDS
trim: the many small programs a run compiles free little, a trim walks every arena, and the next
compile faults the pages back in (the test suite compiles hundreds of programs over 0.5 s)."""
from __future__ import annotations

import ctypes
import ctypes.util

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # jax._src.dispatch.BACKEND_COMPILE_EVENT
MIN_SECONDS = 2.0


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def _after_compile(event: str, seconds: float, **_) -> None:
    if event == COMPILE_EVENT and seconds >= MIN_SECONDS and _TRIM is not None:
        _TRIM(0)


def return_compiler_heap() -> None:
    """Trim after every long backend compile from now on (idempotent)."""
    if not getattr(return_compiler_heap, "registered", False):
        jax.monitoring.register_event_duration_secs_listener(_after_compile)
        return_compiler_heap.registered = True
