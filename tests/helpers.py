"""Shared test utilities."""
import numpy as np

from parity.compare import rel_err  # noqa: F401  (the project's one relative-error metric)


def to_numpy(t):
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().float().numpy()
    return np.asarray(t, dtype=np.float32)
