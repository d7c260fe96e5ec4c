"""MXFP4 (gpt-oss's released expert format) decoded on the device: uint8 blocks [..., G, 16] (two
E2M1 codes per byte, low nibble first) and uint8 scale bytes [..., G] (E8M0: 2**(byte - 127))
-> bfloat16 values [..., G * 32].

Built from integer operations on the bfloat16 bit pattern, never float arithmetic: XLA flushes
subnormal float results to zero, and scale bytes 0-1 give subnormal values (0.5 * 2**-127 is
2**-128), so a float multiply would lose them. Every MXFP4 value is a 1- or 2-bit mantissa times a
power of two, so each is exact in bfloat16; for every scale byte the host codec accepts
(formats/mxfp4.py: at most 253) the bits equal the host's float32 values rounded to bfloat16.
Byte 253 with magnitude 4 or 6 overflows (the host refuses it; here it is inf).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

BLOCK = 32          # values per scale
# Per E2M1 magnitude code 0-7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) as 1.f x 2**e: e, and f's top bit
# (0.5 of the mantissa: 1.5 = 1.1b); code 0 (zero) is handled apart.
_EXPONENT = (0, -1, 0, 0, 1, 1, 2, 2)
_HALF = (0, 0, 0, 1, 0, 1, 0, 1)


def _table(values, codes):
    """values[codes] for a 8-entry Python table, as selects (no gather: usable in a kernel)."""
    out = jnp.zeros(codes.shape, jnp.int32)
    for code, value in enumerate(values):
        if value:
            out = jnp.where(codes == code, value, out)
    return out


def e2m1_bf16_bits(codes, scales):
    """uint16 bfloat16 bit patterns of E2M1 `codes` (int, 0-15, bit 3 the sign) scaled by
    2**(scales - 127) (scale bytes broadcast against the codes)."""
    codes = codes.astype(jnp.int32)
    magnitude = codes & 7
    sign = (codes >> 3) << 15
    half = _table(_HALF, magnitude)
    biased = _table(_EXPONENT, magnitude) + scales.astype(jnp.int32)      # bf16's biased exponent
    normal = (jnp.minimum(biased, 255) << 7) | jnp.where(biased >= 255, 0, half << 6)
    # Below the normal range (biased 0 or -1: 1.f x 2**-127 or 2**-128) the value is a multiple of
    # bf16's subnormal step 2**-133: (2 + half) x 2**(biased + 5) of them.
    subnormal = (2 + half) << jnp.clip(biased + 5, 0, 5)
    bits = jnp.where(magnitude == 0, 0, jnp.where(biased >= 1, normal, subnormal))
    return (sign | bits).astype(jnp.uint16)


# Scale bytes for which every E2M1 value is a normal bfloat16 (no subnormal at the bottom, no
# overflow at the top): e2m1_bf16_bits_normal's domain.
NORMAL_SCALES = (2, 252)


def normal_base(scales):
    """int32 bfloat16 bits of 0.5 x 2**(byte - 127) per scale byte in NORMAL_SCALES: what
    e2m1_bf16_bits_normal adds a code to (computed once per block, not per value)."""
    return (scales.astype(jnp.int32) - 1) << 7


def e2m1_bf16_bits_normal(codes, base):
    """e2m1_bf16_bits for scale bytes in NORMAL_SCALES given as normal_base(scales), in a few
    integer operations (a kernel decodes every weight it reads): a magnitude code m >= 2 is
    1.f x 2**((m >> 1) - 1), whose bf16 exponent and top mantissa bit are m's bits 1-2 and 0, so
    m << 6 added to the base gives its bits; m = 1 (0.5) is the base itself, m = 0 is 0."""
    codes = codes.astype(jnp.int32)
    magnitude = codes & 7
    bits = jnp.where(magnitude >= 2, (magnitude << 6) + base, jnp.where(magnitude == 1, base, 0))
    return (((codes & 8) << 12) | bits).astype(jnp.uint16)


def dequantize_mxfp4(blocks, scales):
    """uint8 blocks [..., G, 16] and scale bytes [..., G] -> bfloat16 [..., G * 32], exact."""
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4: blocks [..., G, {BLOCK // 2}] need scales [..., G]; found {blocks.shape} "
                         f"and {scales.shape}")
    packed = blocks.astype(jnp.int32)
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)              # low nibble first
    bits = e2m1_bf16_bits(codes, scales[..., None, None])
    values = lax.bitcast_convert_type(bits, jnp.bfloat16)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
