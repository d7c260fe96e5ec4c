"""Model FLOPs per token and MFU: the one count used by the trainer and the step benchmark.

FLOPs per token (training: forward + backward = 3 x forward) =
    6 x active matmul weights + 12 x heads x head_dim x mean attended positions, summed over layers
(Lyra's and PaLM's count). Model FLOPs only: remat recompute, norms, softmax and the optimizer
are not counted. The peak is the accelerator's published dense figure, or on CPU the float32
matmul rate measured on this host.
"""
from __future__ import annotations

import functools
import time

from torch_model.causal_lm import mean_attended
from torch_model.config import ModelConfig

# Published dense peak per chip, FLOP/s: (bfloat16, float32). TPUs publish no float32 figure
# (float32 matmuls run as several bf16 passes), so their MFU is reported against the bf16 peak.
# Keys are matched as substrings of jax's `device_kind`, longest first.
TPU_PEAKS = {
    "TPU v2": (45e12, None), "TPU v3": (123e12, None), "TPU v4": (275e12, None),
    "TPU v5 lite": (197e12, None), "TPU v5e": (197e12, None), "TPU v5p": (459e12, None),
    "TPU v5": (459e12, None), "TPU v6 lite": (918e12, None), "TPU v6e": (918e12, None),
}
# NVIDIA data sheets (SXM parts; PCIe cards are slower): dense tensor-core bf16, and the
# non-tensor-core float32 rate (what float32 at "highest" precision runs at).
GPU_PEAKS = {
    "A100": (312e12, 19.5e12), "H100": (989e12, 67e12), "H200": (989e12, 67e12),
    "B200": (2250e12, 80e12), "L4": (121e12, 30.3e12), "L40S": (362e12, 91.6e12),
}


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights of the matmuls one token goes through: q, k, v, o, the router, its top-k experts'
    (or the dense MLP's) up and down projections, the LM head. Embedding lookups, biases, norms and
    sinks are not matmuls."""
    if hasattr(cfg, "active_matmul_params"):       # a transformers model counts its own (torch_model/transformers_lm.py)
        return cfg.active_matmul_params()
    d, hd = cfg.d_model, cfg.head_dim
    attention = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2      # q, o; k, v
    if cfg.is_moe:
        mlp = d * cfg.n_experts + cfg.experts_per_token * 3 * d * cfg.expert_dim
    else:
        mlp = 3 * d * cfg.dense_dim
    return cfg.n_layers * (attention + mlp) + cfg.vocab_size * d


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len` (a module
    model counts its own, from the probe of its forward: torch_model/module_lm.py)."""
    if hasattr(cfg, "training_flops_per_token"):
        return cfg.training_flops_per_token(seq_len)
    attended = sum(mean_attended(seq_len, cfg.window_of_layer(i)) for i in range(cfg.n_layers))
    return 6.0 * active_matmul_params(cfg) + 12.0 * cfg.n_heads * cfg.head_dim * attended


def published_peak(device_kind: str, dtype: str) -> tuple[float, str] | None:
    """(peak FLOP/s per chip, where it comes from) for a known accelerator, else None."""
    for table, vendor in ((TPU_PEAKS, "TPU"), (GPU_PEAKS, "GPU")):
        for key in sorted(table, key=len, reverse=True):
            if key.lower() in device_kind.lower():
                bf16, fp32 = table[key]
                if dtype == "float32" and fp32 is not None:
                    return fp32, f"published float32 peak of {key}"
                return bf16, f"published bfloat16 peak of {key}"
    return None


def measure_matmul_peak(dtype: str = "float32", n: int = 1024, repeats: int = 8) -> float:
    """FLOP/s of a jitted n x n x n matmul on the default device (best of `repeats`)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.dtype(dtype))
    mm = jax.jit(lambda x, y: jnp.dot(x, y, precision="highest"))
    mm(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mm(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


@functools.cache
def peak_flops(dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of all devices in use, its source): the published per-chip figure times the
    number of chips for a known TPU/GPU, else this host's measured matmul rate."""
    import jax

    devices = jax.devices()
    if devices[0].platform != "cpu":
        known = published_peak(devices[0].device_kind, dtype)
        if known is not None:
            return known[0] * len(devices), f"{known[1]} x {len(devices)} chips"
    return measure_matmul_peak(dtype), f"measured {dtype} matmul rate of this {devices[0].platform} host"


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the peak (of all devices used)."""
    return tokens_per_second * flops_per_token(cfg, seq_len) / peak_flops
