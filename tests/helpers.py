"""Shared test utilities."""
import numpy as np


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are 0)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / denom) if denom > 0 else float(np.linalg.norm(a))


def to_numpy(t):
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().float().numpy()
    return np.asarray(t, dtype=np.float32)
