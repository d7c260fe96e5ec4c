"""JAX's persistent compilation cache for the inference commands (generate, eval, lm-eval): a
second run of the same command loads its programs instead of compiling them. Also counts what
the cache answered (JAX's monitoring events), so a command can say what a run cost."""
from __future__ import annotations

import os
from pathlib import Path

import jax

DEFAULT_DIR = Path.home() / ".cache" / "torchlyra" / "jax-compile"
HELP = ("persistent compilation cache directory, or 'off' "
        "(default: $TORCHLYRA_COMPILE_CACHE or ~/.cache/torchlyra/jax-compile)")

_EVENTS = {"hits": 0, "misses": 0}


def _count(event: str, **_):
    if event == "/jax/compilation_cache/cache_hits":
        _EVENTS["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _EVENTS["misses"] += 1


jax.monitoring.register_event_listener(_count)


def enable(directory: str | os.PathLike | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache (unless the process already set a directory):
    `directory`, else $TORCHLYRA_COMPILE_CACHE, else ~/.cache/torchlyra/jax-compile; 'off'
    leaves it off. Every program is cached, however fast it compiled."""
    choice = directory or os.environ.get("TORCHLYRA_COMPILE_CACHE") or DEFAULT_DIR
    if str(choice) == "off":
        return None
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    Path(choice).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(choice))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return Path(choice)


def events() -> dict:
    """{"hits": programs loaded from the cache, "misses": programs compiled and stored} so far."""
    return dict(_EVENTS)


def describe(directory: Path | None, before: dict) -> str:
    """One line: what the cache did since `before` (an `events()`)."""
    if directory is None:
        return "compilation cache: off"
    now = events()
    return (f"compilation cache {directory}: {now['hits'] - before['hits']} programs loaded, "
            f"{now['misses'] - before['misses']} compiled")
