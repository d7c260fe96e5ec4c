"""MXFP4 (OCP Microscaling FP4, as gpt-oss is released): blocks of 32 E2M1 values, two per byte
(low nibble first), sharing one power-of-two scale stored as a biased exponent byte. Decoding
and encoding on the host in numpy, along the last axis: decode([..., G, 16], [..., G]) gives
[..., G*32]; never in JAX, which flushes subnormal results to zero.
"""
from __future__ import annotations

import numpy as np

from formats.errors import UserError

BLOCK = 32                      # values per block (one scale each)
SCALE_BIAS = 127
MAX_SCALE_BYTE = 253            # 254 (2**127) overflows float32 for most codes; 255 is E8M0's NaN
E2M1_MAX = 6.0
# The 16 E2M1 codes: bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
MAGNITUDES = FP4_VALUES[:8]
MIDPOINTS = (MAGNITUDES[1:] + MAGNITUDES[:-1]) / 2
# How a frozen base's experts may be held (`--base-dtype`): in the compute dtype, or as released
# (MXFP4 bytes and scales, formats/mxfp4_experts.py).
BASE_DTYPES = ("compute", "mxfp4")


def check_packed(blocks_shape, scales_shape, where: str) -> None:
    """A blocks tensor [..., G, 16] must come with scales [..., G]."""
    blocks_shape, scales_shape = tuple(blocks_shape), tuple(scales_shape)
    if len(blocks_shape) < 2 or blocks_shape[-1] != BLOCK // 2 or blocks_shape[:-1] != scales_shape:
        raise UserError(f"{where}: MXFP4 blocks of shape {list(blocks_shape)} need scales of shape "
                        f"{list(blocks_shape[:-1])} (blocks [..., G, {BLOCK // 2}]), found {list(scales_shape)}")


def dequantize(blocks: np.ndarray, scales: np.ndarray, where: str = "MXFP4 tensor") -> np.ndarray:
    """uint8 blocks [..., G, 16] and scale bytes [..., G] -> float32 values [..., G*32] (exact:
    every value is a 3-bit mantissa times a power of two, subnormals included)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    check_packed(blocks.shape, scales.shape, where)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise UserError(f"{where}: MXFP4 blocks and scales must be uint8, found {blocks.dtype} and {scales.dtype}")
    if scales.size and int(scales.max()) > MAX_SCALE_BYTE:
        raise UserError(f"{where}: scale byte {int(scales.max())} overflows float32 (2**{int(scales.max()) - SCALE_BIAS}); "
                        f"expected at most {MAX_SCALE_BYTE}")
    values = np.empty(blocks.shape[:-1] + (BLOCK,), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = scales.astype(np.int32) - SCALE_BIAS
    with np.errstate(over="ignore"):
        np.ldexp(values, exponents[..., None], out=values)
    if not np.isfinite(values).all():            # scale 253 with codes of magnitude 4 or 6
        at = np.unravel_index(np.argmax(~np.isfinite(values)), values.shape)
        raise UserError(f"{where}: scale byte {int(scales[at[:-1]])} overflows float32 for block {[int(i) for i in at[:-1]]}")
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)


def quantize(values: np.ndarray, where: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """float values [..., K] (K a multiple of 32) -> (uint8 blocks [..., K/32, 16], uint8 scales
    [..., K/32]) per the OCP MX spec: scale = 2**(floor(log2(block amax)) - 2), the largest E2M1
    exponent; each value / scale rounded to the nearest E2M1 value, ties to even, saturating at
    +-6. (The released model's quantizer rounds the scale up instead, which never saturates but
    spends one bit of range; the spec's rule keeps the finer grid, and decodes with the same code.)"""
    values = np.asarray(values, np.float32)
    if values.shape[-1] % BLOCK:
        raise UserError(f"{where}: MXFP4 needs the last dimension to be a multiple of {BLOCK}, found shape "
                        f"{list(values.shape)}")
    if not np.isfinite(values).all():
        raise UserError(f"{where}: cannot quantize non-finite values to MXFP4")
    blocked = values.reshape(*values.shape[:-1], values.shape[-1] // BLOCK, BLOCK)
    amax = np.abs(blocked).max(axis=-1)
    # floor(log2(amax)) exactly, from the float's exponent (frexp: amax = m * 2**e, m in [0.5, 1)).
    _, exp = np.frexp(amax)
    shared = np.where(amax > 0, exp.astype(np.int32) - 1 - 2, -SCALE_BIAS)
    shared = np.clip(shared, -SCALE_BIAS, MAX_SCALE_BYTE - SCALE_BIAS)
    scaled = np.ldexp(blocked, -shared[..., None])          # exact: a power-of-two rescale
    codes = encode_e2m1(scaled)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, (shared + SCALE_BIAS).astype(np.uint8)


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code of each value, ties to the even code (mantissa bit 0), saturating."""
    mag = np.minimum(np.abs(x), E2M1_MAX)
    # Below/at a midpoint between magnitudes i and i+1: 'left' counts it to i, 'right' to i+1;
    # they differ only on an exact tie, which goes to the even one.
    lower = np.searchsorted(MIDPOINTS, mag, side="left")
    upper = np.searchsorted(MIDPOINTS, mag, side="right")
    codes = np.where(lower % 2 == 0, lower, upper).astype(np.uint8)
    return np.where(np.signbit(x) & (codes > 0), codes | 8, codes).astype(np.uint8)
