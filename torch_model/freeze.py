"""`--freeze PATTERN`: parameters left out of training by name, without LoRA (the router, the
embeddings, ...). Patterns are shell-style (fnmatch: `*`, `?`, `[...]`) over the torch model's
parameter names, e.g. `*.mlp.router.*` or `model.embed_tokens.weight`."""
from __future__ import annotations

from fnmatch import fnmatchcase

from torch_model.config import ConfigError


def freeze_parameters(model, patterns) -> list[str]:
    """Set requires_grad False on every parameter whose name matches one of `patterns`; returns
    their names. A pattern matching no parameter is an error (a typo would freeze nothing)."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in names):
            example = next((n for n in names if ".layers.0." in n), names[0])
            raise ConfigError(f"--freeze: pattern {pattern!r} matches no parameter (shell-style patterns over "
                              f"names such as {example!r}; e.g. '*.mlp.router.*')")
    frozen = []
    for name, p in model.named_parameters():
        if any(fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    if len(frozen) == len(names):
        raise ConfigError(f"--freeze: patterns {list(patterns)} freeze every parameter; nothing would train")
    return frozen
