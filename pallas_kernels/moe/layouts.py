"""Expert weights laid out for the TPU kernel: K in sublanes, N in lanes, packed once at load.

The checkpoint (and `QuantizedArray`) keeps each expert matrix [E, N, K], quantized in blocks along K: the
layout a GPU's K-major matmul operand wants. A TPU kernel wants N in the 128 lanes so that a block's one
scale per column broadcasts down the sublanes of its K rows for free. `for_tpu` transposes once:

- plain: [E, K, N] in its own dtype.
- MXFP8: E4M3 data [E, K, N], E8M0 scale bytes [E, K / 32, N].
- NVFP4: data [E, 2, K / 16, N] uint32 words, 8 codes each, one code in each of two bit slots of each byte (slot
  0: the code's sign, exponent and mantissa bits in the byte's bits 7, 4, 3, 2; slot 1: in bits 5, 6, 1, 0), so
  that one AND (slot 0) or five operations (slot 1) leave each byte an E4M3 value 2^-6 times the code's
  (`nvfp4_e4m3`: E2M1's subnormal 0.5 lands on E4M3's subnormal 2^-7), which the kernel bitcasts to fp8 [4 rows
  per word row]; E4M3 block scales [E, K / 16, N]; the fp32 global scale as [E, 1, N]. In each chunk of 256 K
  rows (16 scale blocks b), plane p's word row 4i + q holds in byte a, slot h the code of row 16b + 8p + 4h + i
  with b = 4q + a: the bitcast rows of a (plane, slot) are [4 i, 16 b], aligned with the scale rows. The kernel
  contracts them against the activations' K axis permuted the same way (`nvfp4_order`). An NVFP4 gate_up laid
  out `in_down_order` takes its gate and up columns in that order of down's K, so that the SwiGLU's output
  comes as down contracts it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import block_formats
from pallas_kernels.numerics import round_to
from pallas_kernels.quantized import MXFP8, NVFP4, QuantizedArray

PLAIN = "plain"
TPU_CHUNK = 256  # K rows the TPU kernels dequantize per matmul: 8 MXFP8 scale rows, 16 NVFP4 (whole (8, 128) tiles)
NVFP4_E4M3_SCALE = 2.0**6  # what `nvfp4_e4m3`'s values are multiplied by to give the codes' values


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TpuWeight:
    """An expert weight [E, N, K] stored as `for_tpu` lays it out (see the module docstring)."""

    data: jax.Array
    scales: jax.Array | None
    global_scale: jax.Array | None
    format: str = dataclasses.field(metadata={"static": True})
    in_down_order: bool = dataclasses.field(default=False, metadata={"static": True})  # an NVFP4 gate_up's N
    # columns, gate and up alike, in the order the kernel takes down's K (`down_order_columns`)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [E, N, K] of the weight before the transpose."""
        if self.format == NVFP4:
            experts, _, blocks, n = self.data.shape
            return (experts, n, blocks * block_formats.NV_BLOCK)
        experts, k, n = self.data.shape
        return (experts, n, k)

    def checkpoint_layout(self) -> jax.Array | QuantizedArray:
        """The weight as `for_tpu` took it ([E, N, K], plain or quantized; an NVFP4 global scale comes back
        broadcast to [E, N, 1]): its inverse."""
        if self.in_down_order:
            natural = np.argsort(down_order_columns(self.shape[1]))
            return _columns(self, natural, False).checkpoint_layout()
        if self.format == PLAIN:
            return jnp.swapaxes(self.data, 1, 2)
        scales = jnp.swapaxes(self.scales, 1, 2)
        if self.format == MXFP8:
            return QuantizedArray(jnp.swapaxes(self.data, 1, 2), scales, None, MXFP8)
        experts, _, blocks, n = self.data.shape
        k = blocks * block_formats.NV_BLOCK
        words = self.data.reshape(experts, 2, k // TPU_CHUNK, 4, 4, n)  # [E, p, chunk, i, q, N]
        e4m3 = jnp.stack([nvfp4_e4m3(words, slot) for slot in (0, 1)], axis=-1)[..., None]  # [..., N, h, 1]
        e4m3 = (e4m3 >> jnp.arange(0, 32, 8, dtype=jnp.uint32)) & 0xFF  # [E, p, chunk, i, q, N, h, a]
        codes = ((e4m3 >> 4) & 8) | ((e4m3 >> 2) & 7)
        codes = jnp.transpose(codes, (0, 5, 2, 4, 7, 1, 6, 3)).reshape(experts, n, k // 2, 2)  # [E, N, K / 2, 2]
        packed = (codes[..., 0] | codes[..., 1] << 4).astype(jnp.uint8)
        return QuantizedArray(packed, scales, jnp.swapaxes(self.global_scale, 1, 2), NVFP4)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """[E, K, N] values, computed as `QuantizedArray.dequantize` computes them."""
        weight = self.checkpoint_layout()
        values = weight.dequantize(dtype) if isinstance(weight, QuantizedArray) else round_to(weight, dtype)
        return jnp.swapaxes(values, 1, 2)


def nvfp4_e4m3(words: jax.Array, slot: int) -> jax.Array:
    """uint32 words laid out as `for_tpu` packs NVFP4 -> the codes of slot `slot` (0 or 1) of each byte as the
    bytes of E4M3 values 2^-6 times the codes' values (sign to bit 7, exponent and mantissa to bits 4 ... 2)."""
    if slot == 0:
        return words & np.uint32(0x9C9C9C9C)
    return ((words << 2) & np.uint32(0x8C8C8C8C)) | ((words >> 2) & np.uint32(0x10101010))


def _in_slot(codes: jax.Array, slot: int) -> jax.Array:
    """E2M1 codes (uint32) -> their bits where slot `slot` of a byte keeps them: `nvfp4_e4m3`'s inverse."""
    if slot == 0:
        return (codes & 8) << 4 | (codes & 7) << 2
    return (codes & 8) << 2 | (codes & 4) << 4 | (codes & 3)


def e2m1_value(codes: jax.Array) -> jax.Array:
    """fp32 values of E2M1 codes (uint32), from their bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    magnitude, sign = codes & 7, codes >> 3
    mantissa = jnp.where(magnitude >= 2, magnitude & 1, 0)
    bits = jnp.where(magnitude == 0, 0, ((magnitude >> 1) + 126) << 23 | mantissa << 22) | sign << 31
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def nvfp4_order(k: int) -> np.ndarray:
    """The permutation of a K axis that the NVFP4 kernel contracts over: within each chunk of 256 rows, position
    16j + b holds row 16b + j of the chunk (j < 16: a code's place in its scale block b)."""
    blocks = TPU_CHUNK // block_formats.NV_BLOCK
    local = np.arange(TPU_CHUNK).reshape(blocks, block_formats.NV_BLOCK).T.reshape(-1)
    return (np.arange(0, k, TPU_CHUNK)[:, None] + local[None, :]).reshape(-1)


def down_order_columns(two_i: int) -> np.ndarray:
    """gate_up's columns [2I] in down's NVFP4 K order: gate units, then up units, each in `nvfp4_order`."""
    order = nvfp4_order(two_i // 2)
    return np.concatenate([order, two_i // 2 + order])


def _columns(weight: TpuWeight, columns: np.ndarray, in_down_order: bool) -> TpuWeight:
    """The weight's N columns taken in the order `columns`."""
    arrays = [
        None if a is None else jnp.take(a, columns, axis=-1) for a in (weight.data, weight.scales, weight.global_scale)
    ]
    return TpuWeight(*arrays, weight.format, in_down_order)


def for_tpu(weight: jax.Array | QuantizedArray, in_down_order: bool = False) -> TpuWeight:
    """An expert weight [E, N, K] (plain or quantized) in the TPU kernel's layout; `in_down_order` for an NVFP4
    gate_up [E, 2I, H] (its columns in the order the kernel takes down's K: no permutation between the two
    kernels). Run once, at load."""
    if in_down_order:
        if not isinstance(weight, QuantizedArray) or weight.format != NVFP4:
            raise ValueError("only an NVFP4 gate_up is laid out in down's K order (other formats take K as it is)")
        return _columns(for_tpu(weight), down_order_columns(weight.shape[1]), True)
    if not isinstance(weight, QuantizedArray):
        return TpuWeight(jnp.swapaxes(weight, 1, 2), None, None, PLAIN)
    if weight.format == MXFP8:
        return TpuWeight(jnp.swapaxes(weight.data, 1, 2), jnp.swapaxes(weight.scales, 1, 2), None, MXFP8)
    experts, n, half = weight.data.shape
    if (2 * half) % TPU_CHUNK:
        raise ValueError(f"NVFP4 experts for the TPU take K in chunks of {TPU_CHUNK} rows, got K = {2 * half}")
    packed = jnp.swapaxes(weight.data, 1, 2).astype(jnp.uint32)  # [E, K / 2, N]: byte i holds rows 2i, 2i + 1
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=2)  # [E, K / 2, 2, N]
    # K row 256 chunk + 64q + 16a + 8p + 4h + i -> plane p, word row 16 chunk + 4i + q, byte a, slot h
    codes = codes.reshape(experts, 2 * half // TPU_CHUNK, 4, 4, 2, 2, 4, n).transpose(0, 4, 1, 6, 2, 3, 5, 7)
    in_bytes = _in_slot(codes[..., 0, :], 0) | _in_slot(codes[..., 1, :], 1)  # [E, p, chunk, i, q, a, N]
    words = sum(in_bytes[..., a, :] << (8 * a) for a in range(4)).astype(jnp.uint32)
    global_scale = jnp.broadcast_to(jnp.asarray(weight.global_scale, jnp.float32), (experts, n, 1))
    planes = words.reshape(experts, 2, 2 * half // block_formats.NV_BLOCK, n)
    return TpuWeight(planes, jnp.swapaxes(weight.scales, 1, 2), jnp.swapaxes(global_scale, 1, 2), NVFP4)


_FOR_TPU = jax.jit(for_tpu, static_argnames="in_down_order")  # one jitted function for every layer


def for_tpu_experts(
    gate_up: jax.Array | QuantizedArray, down: jax.Array | QuantizedArray
) -> tuple[TpuWeight, TpuWeight]:
    """gate_up [E, 2I, H] and down [E, H, I] in the TPU kernels' layout, laid out one at a time (one's temporaries
    freed before the other's); an NVFP4 gate_up in down's K order."""
    nvfp4 = isinstance(gate_up, QuantizedArray) and gate_up.format == NVFP4
    return _FOR_TPU(gate_up, in_down_order=nvfp4), _FOR_TPU(down)


def gpu_run_order(run: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """Bytes [..., 32] in row order -> in `GpuWeight`'s storage order, or back (the same swap: an involution).
    Row byte 8a + 2c + b (a, c < 4, b < 2) goes to position 8c + 2a + b: a wgmma register thread c's bytes."""
    lead = run.shape[:-1]
    return run.reshape(*lead, 4, 4, 2).swapaxes(-3, -2).reshape(*lead, 32)


def run_words(data: jax.Array) -> jax.Array:
    """uint8 [E, N, B] (B a multiple of 32) -> uint32 [E, N, B / 4]: each 32-byte run in `gpu_run_order`, read as
    little-endian words."""
    experts, n, size = data.shape
    runs = gpu_run_order(data.reshape(experts, n, size // 32, 32))
    return jax.lax.bitcast_convert_type(runs.reshape(experts, n, size // 4, 4), jnp.uint32)


def run_bytes(words: jax.Array) -> jax.Array:
    """`run_words`' inverse: uint32 [E, N, W] -> uint8 [E, N, 4W] in row order."""
    experts, n, size = words.shape
    runs = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(experts, n, size // 8, 32)
    return gpu_run_order(runs).reshape(experts, n, 4 * size)


MX_SCALE_MAX_GPU = 134  # the GPU kernel's bf16 factor 2^(byte - 7) needs byte - 7 <= 127
PAIR_UNITS = 32  # hidden units per block of a paired gate_up's rows (a compute warpgroup's 64 rows: gate, then up)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GpuWeight:
    """An expert weight [E, N, K] as `for_gpu` lays it out: the data in the checkpoint's [E, N, K] rows (K-major,
    as wgmma's operands want), the block scales transposed to K-block rows (a TMA box of 128 rows' scales is
    then one contiguous run), an NVFP4 global scale as [E, 1, N].

    plain: data [E, N, K]. MXFP8: the E4M3 bytes of each row in runs of 32 (one scale block), each run stored in
    `gpu_run_order` (the 8 bytes one thread of a wgmma register operand holds of a row, columns 2c, 2c + 1,
    2c + 8, 2c + 9, 2c + 16, ..., 2c + 25 for c = lane % 4, are adjacent), as uint32 words [E, N, K / 4]; E8M0
    bytes [E, K / 32, N]. NVFP4: word m of a row holds the codes of K indices 8m ... 8m + 7 (`nvfp4_word`), so a
    thread's two words of a 64-index run are one scale block's 16 codes, as uint32 [E, N, K / 8]; each 64-index run's
    four E4M3 block scale bytes as one uint32 (block b in byte b), [E, K / 64, N]; fp32 global scale (one per expert,
    broadcast) [E, 1, N]. The kernel contracts against the activations' K axis in `gpu_k_order`.

    `paired` (gate_up [E, 2I, H] only): the rows in `paired_rows` order, so that a compute warpgroup's 64 rows
    are the gate and up rows of the same 32 hidden units, whose SwiGLU the kernel applies before writing them.
    """

    data: jax.Array
    scales: jax.Array | None
    global_scale: jax.Array | None
    format: str = dataclasses.field(metadata={"static": True})
    paired: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [E, N, K]."""
        experts, n, k = self.data.shape
        return (experts, n, k * {PLAIN: 1, MXFP8: 4, NVFP4: 8}[self.format])

    def checkpoint_layout(self) -> jax.Array | QuantizedArray:
        """The weight as `for_gpu` took it (an NVFP4 global scale comes back broadcast to [E, N, 1])."""
        if self.paired:
            return _permute_rows(self, np.argsort(paired_rows(self.shape[1], self.format))).checkpoint_layout()
        if self.format == PLAIN:
            return self.data
        if self.format == MXFP8:
            data = jax.lax.bitcast_convert_type(run_bytes(self.data), jnp.float8_e4m3fn)
            return QuantizedArray(data, jnp.swapaxes(self.scales, 1, 2), None, MXFP8)
        experts, n, words = self.data.shape
        codes = nvfp4_word_codes(self.data).reshape(experts, n, 4 * words, 2)
        packed = (codes[..., 0] | codes[..., 1] << 4).astype(jnp.uint8)
        scale_bytes = jax.lax.bitcast_convert_type(jnp.swapaxes(self.scales, 1, 2), jnp.uint8).reshape(experts, n, -1)
        e4m3 = jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn)
        return QuantizedArray(packed, e4m3, jnp.swapaxes(self.global_scale, 1, 2), NVFP4)


def _sign_bit(i: int) -> int:
    """Where `nvfp4_word` keeps code i's sign."""
    return 8 * i + 7 if i < 4 else 8 * (i - 4) + 3


def nvfp4_word(codes: jax.Array) -> jax.Array:
    """E2M1 codes [..., 8] (uint32) -> the GPU kernel's uint32 word of them: code i's magnitude in bits 4i ...
    4i + 2; the signs of codes 0-3 in bits 7, 15, 23, 31 and of codes 4-7 in bits 3, 11, 19, 27 (where the
    decode's looked-up high bytes of codes 0-3, and 4-7 shifted by 4, want them)."""
    parts = [(codes[..., i] & 7) << (4 * i) | (codes[..., i] >> 3) << _sign_bit(i) for i in range(8)]
    return functools.reduce(jnp.bitwise_or, parts).astype(jnp.uint32)


def nvfp4_word_codes(words: jax.Array) -> jax.Array:
    """`nvfp4_word`'s inverse: uint32 words [...] -> codes [..., 8]."""
    return jnp.stack([(words >> (4 * i)) & 7 | ((words >> _sign_bit(i)) & 1) << 3 for i in range(8)], axis=-1)


def _pairs_in_nvfp4_runs_order(pairs: np.ndarray | jax.Array, tail: int = 0) -> np.ndarray | jax.Array:
    """pairs [..., K / 2, *T] (K's values in pairs 2i, 2i + 1; `tail` trailing axes T) with each run of 32 pairs
    permuted as `nvfp4_gpu_columns` moves them: pair 8c + 4f + j to 16f + 4j + c (value 16c + 8f + 2j + b to
    column 32f + 8j + 2c + b)."""
    shape = pairs.shape
    n = len(shape) - tail  # the runs' axis, then c, f, j, then T
    runs = pairs.reshape(*shape[: n - 1], shape[n - 1] // 32, 4, 2, 4, *shape[n:])
    return runs.transpose(*range(n), n + 1, n + 2, n, *range(n + 3, n + 3 + tail)).reshape(shape)


def _in_nvfp4_runs_order(a: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """a [..., K] with each run of 64 along K permuted as `nvfp4_gpu_columns` says (its pairs moved together)."""
    *lead, k = a.shape
    return _pairs_in_nvfp4_runs_order(a.reshape(*lead, k // 2, 2), tail=1).reshape(*lead, k)


def nvfp4_gpu_columns(k: int) -> np.ndarray:
    """The order of a K axis the GPU's NVFP4 kernel contracts over: in each run of 64, the two bf16 [64, 32]
    wgmma operands' columns (32f + p, where a register thread c = (p % 8) // 2 holds p = 8j + 2c + b) take the
    index 16c + 8f + 2j + b: each thread's 16 values are its one scale block's."""
    return _in_nvfp4_runs_order(np.arange(k))


@jax.jit
def _holds_e4m3_nan(values: jax.Array) -> jax.Array:
    """Whether E4M3 values hold a NaN (bits S.1111.111), read from their bits in one fused pass (an fp32 copy of a
    layer's experts would not fit in memory)."""
    return jnp.any((jax.lax.bitcast_convert_type(values, jnp.uint8) & 0x7F) == 0x7F)


@jax.jit
def _nvfp4_steps_outside(scales: jax.Array, global_scale: jax.Array, global_zero: jax.Array) -> jax.Array:
    """Whether any NVFP4 block scale is negative (a sign bit set, -0 included) or NaN, or any step (fp32 block scale
    * normal global scale) nonzero outside [2^-125, 2^125], in one fused pass. Zeros are read from the bits (and
    the global scale's from the host): XLA:CPU flushes subnormals, so a tiny step computes as 0 and must not pass
    for one."""
    scale_bits = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    step = scales.astype(jnp.float32) * global_scale
    in_range = ((scale_bits & 0x7F) == 0) | global_zero | ((step >= 2.0**-125) & (step <= 2.0**125))
    return jnp.any((scale_bits >= 0x80) | ((scale_bits & 0x7F) == 0x7F) | ~in_range)


def check_for_gpu(weight: jax.Array | QuantizedArray) -> None:
    """Raise on what the GPU kernel cannot decode as the oracle does: an MXFP8 scale byte above
    MX_SCALE_MAX_GPU (NaN included) or a NaN element; an NVFP4 global scale that is negative (-0 included), subnormal or
    not finite, or not one per expert, a block scale that is negative or NaN, or a step (block scale * global scale)
    nonzero outside [2^-125, 2^125] (where the kernel's table of the step's multiples stays exact). Concrete arrays only
    (traced ones cannot be inspected): call it before any jit that lays the weight out."""
    if not isinstance(weight, QuantizedArray) or isinstance(weight.scales, jax.core.Tracer):
        return
    if weight.format == MXFP8:
        largest = int(jnp.max(weight.scales))
        if largest > MX_SCALE_MAX_GPU:
            raise ValueError(
                f"MXFP8 scale byte {largest} (2^{largest - 127}) is above what the GPU expert kernel takes"
                f" ({MX_SCALE_MAX_GPU}: blocks whose largest value is below 2^16)"
            )
        if bool(_holds_e4m3_nan(weight.data)):
            raise ValueError("mxfp8 weight holds a NaN element, which the GPU expert kernel does not decode")
        return
    global_bits = np.asarray(weight.global_scale, np.float32).view(np.uint32)  # one per expert: classified here
    exponent, zero = (global_bits >> 23) & 0xFF, (global_bits & 0x7FFFFFFF) == 0
    if np.any((global_bits >> 31 == 1) | (exponent == 0xFF) | ((exponent == 0) & ~zero)):
        raise ValueError(
            "nvfp4 global scale is negative, subnormal or not finite, which the GPU expert kernel does not decode"
        )
    if global_bits.ndim >= 2 and np.any(global_bits != global_bits[..., :1, :]):
        raise ValueError(
            "nvfp4 weight has global scales that differ between rows of one expert; the GPU expert kernel takes one"
            " per expert (its decode tables are per expert)"
        )
    if bool(_nvfp4_steps_outside(weight.scales, jnp.asarray(weight.global_scale, jnp.float32), jnp.asarray(zero))):
        raise ValueError(
            "nvfp4 weight has a block scale that is negative or NaN, or a block scale * global scale nonzero outside"
            " [2^-125, 2^125], which the GPU expert kernel does not decode"
        )


def gpu_k_order(fmt: str, k: int) -> np.ndarray | None:
    """The order in which the GPU kernel takes a K axis of the activations (None: as it is): NVFP4's
    `nvfp4_gpu_columns`."""
    return nvfp4_gpu_columns(k) if fmt == NVFP4 else None


def in_gpu_k_order(x: jax.Array, fmt: str) -> jax.Array:
    """x [..., K] with its last axis in `gpu_k_order`, as the GPU kernel contracts it against `fmt` weights (NVFP4's
    runs transposed: a copy, cheaper than XLA's gather by `nvfp4_gpu_columns`)."""
    return _in_nvfp4_runs_order(x) if fmt == NVFP4 else x


def rows_in_gpu_k_order(x: jax.Array, rows: jax.Array, fmt: str) -> jax.Array:
    """x [N, K] (16-bit) -> in_gpu_k_order(x, fmt)[rows], gathered as 32-bit words: the K order moves values in
    pairs, and XLA gathers long rows faster as 32-bit words than as 16-bit values."""
    if x.dtype.itemsize != 2:
        raise ValueError(f"rows_in_gpu_k_order gathers 16-bit activations as pairs, got {x.dtype}")
    n, k = x.shape
    words = jax.lax.bitcast_convert_type(x.reshape(n, k // 2, 2), jnp.uint32)  # [N, K / 2]
    if fmt == NVFP4:
        words = _pairs_in_nvfp4_runs_order(words)
    return jax.lax.bitcast_convert_type(words[rows], x.dtype).reshape(rows.shape[0], k)


def paired_rows(two_i: int, fmt: str) -> np.ndarray:
    """A paired gate_up's row order: for each PAIR_UNITS hidden units in turn, their gate rows then their up rows;
    the units in down's `gpu_k_order`, so that the SwiGLU's output comes in the order down takes."""
    inter = two_i // 2
    units = gpu_k_order(fmt, inter)
    blocks = (np.arange(inter) if units is None else units).reshape(-1, PAIR_UNITS)
    return np.concatenate([blocks, blocks + inter], axis=1).reshape(-1)


def _permute_rows(weight: GpuWeight, rows: np.ndarray) -> GpuWeight:
    """The weight's rows (N) taken in the order `rows`, flipping `paired`."""
    fields = [
        None if a is None else jnp.take(a, rows, axis=1 if a is weight.data else 2)
        for a in (weight.data, weight.scales, weight.global_scale)
    ]
    return GpuWeight(*fields, weight.format, not weight.paired)


def for_gpu(weight: jax.Array | QuantizedArray, paired: bool = False) -> GpuWeight:
    """An expert weight [E, N, K] (plain or quantized) in the GPU kernel's layout; `paired` for gate_up [E, 2I, H]
    (see `GpuWeight`). Run once, at load (`check_for_gpu` runs here on concrete arrays only)."""
    check_for_gpu(weight)
    unit = 64 if isinstance(weight, QuantizedArray) and weight.format == NVFP4 else PAIR_UNITS  # NVFP4: K runs
    if paired and weight.shape[1] % (2 * unit):
        raise ValueError(f"a paired gate_up needs I ({weight.shape[1] // 2}) to be a multiple of {unit}")
    if not isinstance(weight, QuantizedArray):
        laid = GpuWeight(weight, None, None, PLAIN)
    elif weight.format == MXFP8:
        scale_bytes = jax.lax.bitcast_convert_type(weight.scales, jnp.uint8)
        data = run_words(jax.lax.bitcast_convert_type(weight.data, jnp.uint8))
        laid = GpuWeight(data, jnp.swapaxes(scale_bytes, 1, 2), None, MXFP8)
    else:
        experts, n, half = weight.data.shape
        codes = jnp.stack([weight.data & 0xF, weight.data >> 4], axis=-1).astype(jnp.uint32)
        data = nvfp4_word(codes.reshape(experts, n, half // 4, 8))
        scale_bytes = jax.lax.bitcast_convert_type(weight.scales, jnp.uint8)
        scales = jax.lax.bitcast_convert_type(scale_bytes.reshape(experts, n, half // 32, 4), jnp.uint32)
        global_scale = jnp.broadcast_to(jnp.asarray(weight.global_scale, jnp.float32), (experts, n, 1))
        # one per expert (the kernel's decode tables): where traced arrays passed unchecked, an expert whose rows
        # differ gets NaN, so that its products are NaN rather than silently wrong
        one_each = jnp.all(global_scale == global_scale[:, :1], axis=1, keepdims=True)
        global_scale = jnp.where(one_each, global_scale, jnp.nan)
        laid = GpuWeight(data, jnp.swapaxes(scales, 1, 2), jnp.swapaxes(global_scale, 1, 2), NVFP4)
    return _permute_rows(laid, paired_rows(weight.shape[1], laid.format)) if paired else laid


_GATE_UP_FOR_GPU = jax.jit(functools.partial(for_gpu, paired=True))  # compiled once per shape, not per layer
_DOWN_FOR_GPU = jax.jit(for_gpu)


def for_gpu_experts(
    gate_up: jax.Array | QuantizedArray, down: jax.Array | QuantizedArray
) -> tuple[GpuWeight, GpuWeight]:
    """gate_up [E, 2I, H] (paired) and down [E, H, I] in the GPU kernels' layouts, checked (`check_for_gpu`) and
    laid out one at a time (one's temporaries freed before the other's)."""
    check_for_gpu(gate_up)
    check_for_gpu(down)
    return _GATE_UP_FOR_GPU(gate_up), _DOWN_FOR_GPU(down)


def layers_as_one(
    gate_up: TpuWeight | GpuWeight, down: TpuWeight | GpuWeight, layer: jax.Array | int | None
) -> tuple[TpuWeight | GpuWeight, TpuWeight | GpuWeight, int, jax.Array | int]:
    """Laid-out weights of several layers stacked [L, E, ...] (every array's first two axes) as one weight of L * E
    experts (a free reshape), with E and where layer `layer`'s experts start in it: a kernel shifts its visits'
    expert ids by that start and reads the layer in place, where indexing the layer out of the stack would copy
    its weights first (inside a scan over layers, every step). With `layer` None the weights are one layer's."""
    if layer is None:
        return gate_up, down, gate_up.data.shape[0], 0
    experts = gate_up.data.shape[1]
    one = [jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), w) for w in (gate_up, down)]
    return one[0], one[1], experts, layer * experts


def check_experts(x: jax.Array, gate_up: TpuWeight | GpuWeight, down: TpuWeight | GpuWeight) -> None:
    """Raise unless x [..., H], gate_up [E, 2I, H] and down [E, H, I] fit together in one format."""
    experts, two_i, hidden = gate_up.shape
    if down.shape != (experts, hidden, two_i // 2) or x.shape[-1] != hidden:
        raise ValueError(
            f"expert shapes do not match: x [..., {x.shape[-1]}], gate_up {gate_up.shape}, down {down.shape}"
            " (want [E, 2I, H] and [E, H, I])"
        )
    if gate_up.format != down.format:
        raise ValueError(f"gate_up is {gate_up.format} but down is {down.format}")
