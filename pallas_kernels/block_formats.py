"""MXFP8 and NVFP4 block-scaled formats: encode and decode, in numpy (loading) or jnp (kernel oracles).

Both scale blocks of consecutive values along the last (input, K) axis:
- MXFP8 (OCP MX v1.0): E4M3 elements, one E8M0 scale (stored as its biased-exponent byte, value
  2^(byte - 127)) per 32 values. Encoding uses the spec's rule: scale exponent
  floor(log2(block amax)) - 8, elements rounded to nearest even and saturated at +-448.
- NVFP4: E2M1 codes packed two per byte (low nibble = even index), one E4M3 scale per 16 values and an
  fp32 second-level (per-tensor) scale. Encoding follows NVIDIA's recipe: global = amax / (6 * 448),
  block scale = block amax / (6 * global) clamped to [2^-9, 448] (1 for all-zero blocks), codes
  rounded to nearest even and saturated at +-6.
Every function takes numpy or jax arrays and returns the same kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

MX_BLOCK = 32
NV_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_EMAX = 8  # exponent of E4M3's largest power of two
E8M0_BIAS = 127
E8M0_NAN = 255

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
# The 16 E2M1 code values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (bit 3 is the sign).
E2M1_VALUES = np.arange(16, dtype=np.uint8).view(E2M1).astype(np.float32)


class QuantFormatError(ValueError):
    """Values or shapes that a block format cannot represent; the message says which."""


def _xp(x: np.ndarray | jax.Array):
    return jnp if isinstance(x, jax.Array) else np


def _blocks(x: np.ndarray | jax.Array, block: int, what: str) -> np.ndarray | jax.Array:
    """[..., K] -> [..., K / block, block]."""
    if x.shape[-1] % block:
        raise QuantFormatError(f"{what}: last axis {x.shape[-1]} is not a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _require_finite(x: np.ndarray | jax.Array, what: str) -> None:
    """Reject NaN and inf (checked when the values are concrete; traced values cannot be inspected)."""
    if isinstance(x, jax.core.Tracer):
        return
    if not bool(_xp(x).isfinite(x).all()):
        raise QuantFormatError(f"{what}: input holds NaN or inf, which the format cannot encode")


def mxfp8_encode(x: np.ndarray | jax.Array) -> tuple[np.ndarray | jax.Array, np.ndarray | jax.Array]:
    """x [..., K] -> (E4M3 elements [..., K], E8M0 scale bytes uint8 [..., K / 32])."""
    xp = _xp(x)
    _require_finite(x, "mxfp8_encode")
    blocks = _blocks(x.astype(np.float32), MX_BLOCK, "mxfp8_encode")
    amax = xp.max(xp.abs(blocks), axis=-1)
    _, exponent = xp.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    shared = xp.where(amax > 0, exponent - 1 - E4M3_EMAX, -E8M0_BIAS)
    shared = xp.clip(shared, -E8M0_BIAS, E8M0_BIAS).astype(np.int32)
    scaled = xp.ldexp(blocks, -shared[..., None])
    elements = xp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return elements.reshape(x.shape), (shared + E8M0_BIAS).astype(np.uint8)


def e8m0_value(scale_bytes: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """float32 value of E8M0 scale bytes: 2^(byte - 127); byte 255 is NaN.

    Built from bits (the byte is the float32 exponent field; 2^-127 is the subnormal 0x00400000), so
    no arithmetic can flush the smallest scale to zero.
    """
    xp = _xp(scale_bytes)
    byte = scale_bytes.astype(np.uint32)
    bits = xp.where(byte == 0, np.uint32(0x00400000), byte << 23)
    bits = xp.where(byte == E8M0_NAN, np.uint32(0x7FC00000), bits)
    return bits.view(np.float32) if xp is np else jax.lax.bitcast_convert_type(bits, jnp.float32)


def mxfp8_decode(elements: np.ndarray | jax.Array, scale_bytes: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """(E4M3 [..., K], E8M0 bytes [..., K / 32]) -> float32 [..., K]."""
    xp = _xp(elements)
    blocks = _blocks(elements.astype(np.float32), MX_BLOCK, "mxfp8_decode")
    # ldexp, not a multiply by the scale: the scale 2^-127 is subnormal and would read as 0 under DAZ
    decoded = xp.ldexp(blocks, (scale_bytes.astype(np.int32) - E8M0_BIAS)[..., None])
    decoded = xp.where((scale_bytes == E8M0_NAN)[..., None], np.float32(np.nan), decoded)
    return decoded.reshape(elements.shape)


def nvfp4_global_scale(x: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """The per-tensor scale NVIDIA's recipe picks: amax / (6 * 448) (1 for an all-zero tensor)."""
    xp = _xp(x)
    amax = xp.max(xp.abs(x.astype(np.float32)))
    return xp.where(amax > 0, amax / np.float32(E2M1_MAX * E4M3_MAX), np.float32(1.0)).astype(np.float32)


def _e2m1_codes(values: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """E2M1-representable float32 values -> their 4-bit codes (uint8)."""
    xp = _xp(values)
    magnitude = xp.searchsorted(xp.asarray(E2M1_VALUES[:8]), xp.abs(values)).astype(np.uint8)
    return magnitude | (xp.signbit(values).astype(np.uint8) << 3)


def nvfp4_encode(
    x: np.ndarray | jax.Array, global_scale: np.ndarray | jax.Array | None = None
) -> tuple[np.ndarray | jax.Array, np.ndarray | jax.Array, np.ndarray | jax.Array]:
    """x [..., K] -> (packed codes uint8 [..., K / 2], E4M3 block scales [..., K / 16], fp32 global scale).

    global_scale defaults to `nvfp4_global_scale(x)`; pass one broadcastable to [..., 1] to share it
    across several tensors (or to give each expert its own).
    """
    xp = _xp(x)
    _require_finite(x, "nvfp4_encode")
    x = x.astype(np.float32)
    if global_scale is None:
        global_scale = nvfp4_global_scale(x)
    global_scale = xp.asarray(global_scale, np.float32)
    blocks = _blocks(x, NV_BLOCK, "nvfp4_encode")
    amax = xp.max(xp.abs(blocks), axis=-1)
    block_scale = xp.where(amax > 0, amax / (np.float32(E2M1_MAX) * global_scale), np.float32(1.0))
    block_scale = xp.clip(block_scale, np.float32(2.0**-9), np.float32(E4M3_MAX)).astype(E4M3)
    step = block_scale.astype(np.float32) * global_scale
    values = xp.clip(blocks / step[..., None], -E2M1_MAX, E2M1_MAX).astype(E2M1).astype(np.float32)
    codes = _e2m1_codes(values).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.astype(np.uint8), block_scale, global_scale


def nvfp4_unpack(packed: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """uint8 [..., K / 2] -> float32 E2M1 values [..., K] (low nibble first)."""
    xp = _xp(packed)
    codes = xp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return xp.asarray(E2M1_VALUES)[codes.astype(np.int32)]


def nvfp4_decode(
    packed: np.ndarray | jax.Array, block_scales: np.ndarray | jax.Array, global_scale: np.ndarray | jax.Array
) -> np.ndarray | jax.Array:
    """(packed codes [..., K / 2], E4M3 scales [..., K / 16], fp32 global) -> float32 [..., K]."""
    values = nvfp4_unpack(packed)
    blocks = _blocks(values, NV_BLOCK, "nvfp4_decode")
    scales = block_scales.astype(np.float32) * _xp(packed).asarray(global_scale, np.float32)
    return (blocks * scales[..., None]).reshape(values.shape)
