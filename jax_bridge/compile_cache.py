"""JAX's persistent compilation cache for the commands that compile a model (train and its
--resume, parity, generate, eval, lm-eval): a second run of the same command loads its programs
instead of compiling them. Also counts what the cache answered and sums the seconds JAX spent
tracing, lowering and compiling (its monitoring events), so a command can say what its start cost.
A cache directory that cannot be written, or an entry that cannot be read, is said in one line
and the command runs on (programs are then compiled)."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

DEFAULT_DIR = Path.home() / ".cache" / "torchlyra" / "jax-compile"
HELP = ("persistent compilation cache directory, or 'off' "
        "(default: $TORCHLYRA_COMPILE_CACHE or ~/.cache/torchlyra/jax-compile)")

_EVENTS = {"hits": 0, "misses": 0, "trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0}
# JAX's timed events: tracing a function to a jaxpr, lowering it to a module, compiling it (or, with
# the persistent cache, loading it: a hit is timed as a compile).
_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "compile_s"}
_UNREADABLE = "Error reading persistent compilation cache entry"
_said: set[str] = set()


def _count(event: str, **_):
    if event == "/jax/compilation_cache/cache_hits":
        _EVENTS["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _EVENTS["misses"] += 1


def _time(event: str, seconds: float, **_):
    if event in _DURATIONS:
        _EVENTS[_DURATIONS[event]] += seconds


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_time)


def _say_once(key: str, line: str) -> None:
    if key not in _said:
        _said.add(key)
        from jax_bridge.distributed import say

        say(line)


def _show_warning(message, category, filename, lineno, file=None, line=None, _shown=warnings.showwarning):
    """JAX warns, several lines each, for every cache entry it cannot read (then compiles the
    program): one line for the command instead."""
    if _UNREADABLE in str(message):
        directory = jax.config.jax_compilation_cache_dir
        _say_once("unreadable", f"compilation cache {directory}: an entry could not be read (damaged?); its "
                                f"program is compiled again (and stored anew)")
        return
    _shown(message, category, filename, lineno, file, line)


def enable(directory: str | os.PathLike | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache (unless the process already set a directory):
    `directory`, else $TORCHLYRA_COMPILE_CACHE, else ~/.cache/torchlyra/jax-compile; 'off'
    leaves it off. Every program is cached, however fast it compiled."""
    choice = directory or os.environ.get("TORCHLYRA_COMPILE_CACHE") or DEFAULT_DIR
    if str(choice) == "off":
        return None
    warnings.showwarning = _show_warning
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    try:
        Path(choice).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _say_once("unusable", f"compilation cache {choice}: cannot be made ({e.strerror}); programs are compiled, "
                              f"not cached")
        return None
    if not os.access(choice, os.W_OK):
        _say_once("read-only", f"compilation cache {choice}: not writable; programs found there are loaded, new "
                               f"ones compiled and not stored")
    jax.config.update("jax_compilation_cache_dir", str(choice))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return Path(choice)


def events() -> dict:
    """{"hits": programs loaded from the cache, "misses": programs compiled and stored, "trace_s",
    "lower_s", "compile_s": seconds JAX spent so far} of this process."""
    return dict(_EVENTS)


def describe(directory: Path | None, before: dict) -> str:
    """One line: what the cache did since `before` (an `events()`)."""
    if directory is None:
        return "compilation cache: off"
    now = events()
    return (f"compilation cache {directory}: {now['hits'] - before['hits']} programs loaded, "
            f"{now['misses'] - before['misses']} compiled")
