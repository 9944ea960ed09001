"""The quantized-array pytree: a block-quantized weight kept on device as data + scales.

Kernels take it as a weight operand and dequantize inside the matmul; `dequantize` is their oracle.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import block_formats
from pallas_kernels.numerics import round_to

MXFP8 = "mxfp8"
NVFP4 = "nvfp4"
FORMATS = (MXFP8, NVFP4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A weight [..., N, K] quantized in blocks along K.

    MXFP8: data float8_e4m3fn [..., N, K], scales uint8 E8M0 bytes [..., N, K / 32], global_scale None.
    NVFP4: data uint8 [..., N, K / 2] (two E2M1 codes, low nibble first), scales float8_e4m3fn
    [..., N, K / 16], global_scale float32 broadcastable to [..., N, 1] (one per expert, or per row).
    """

    data: jax.Array
    scales: jax.Array
    global_scale: jax.Array | None
    format: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        packing = 2 if self.format == NVFP4 else 1
        return (*self.data.shape[:-1], self.data.shape[-1] * packing)

    @property
    def nbytes(self) -> int:
        arrays = [self.data, self.scales] + ([] if self.global_scale is None else [self.global_scale])
        return sum(a.size * a.dtype.itemsize for a in arrays)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The weight's values, computed in float32 and rounded once to `dtype`."""
        if self.format == MXFP8:
            values = block_formats.mxfp8_decode(self.data, self.scales)
        else:
            values = block_formats.nvfp4_decode(self.data, self.scales, self.global_scale)
        return round_to(values, dtype)


def quantize(x: jax.Array, format: str) -> QuantizedArray:
    """Quantize x [..., N, K] along K; NVFP4 gets one global scale per [N, K] matrix (per expert)."""
    if format == MXFP8:
        data, scales = block_formats.mxfp8_encode(x)
        return QuantizedArray(data, scales, None, MXFP8)
    if format == NVFP4:
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(-2, -1), keepdims=True)
        global_scale = jnp.where(amax > 0, amax / (block_formats.E2M1_MAX * block_formats.E4M3_MAX), 1.0)
        data, scales, global_scale = block_formats.nvfp4_encode(x, global_scale)
        return QuantizedArray(data, scales, global_scale, NVFP4)
    raise ValueError(f"unknown quantized format {format!r}; expected one of {FORMATS}")
