"""Stored expert weights to bf16 wgmma register operands on Hopper (sm90), run by run, for the GPU expert kernel
(`gpu`): a compute warpgroup's 64 weight rows, one scale block of each (MXFP8: 32 values; NVFP4: 64, four blocks)
per run, decoded from the words a thread holds in the wgmma register layout.

The values are the oracle's bit for bit: MXFP8 E4M3 bytes become bf16 e4m3 * 2^-120 by moving their bits (inline PTX:
PRMT, a shift, a mask; subnormals included), then a bf16 multiply by 2^(scale - 7), exact (scale bytes up to 134, which
`layouts.for_gpu` checks); NVFP4 codes are looked up (PRMT) in a table of their block's 8 magnitudes in bf16, each
fp32(m * block scale * global scale) rounded once: each warpgroup tabulates them in SMEM for every E4M3 block scale byte
at a work item's start (the global scale is the expert's), and a thread loads its block's 16 bytes once per row and 64 K
values (the activations' K permuted so that a thread's values are one scale block's; tables built by each thread per row
and block would cost 20 instructions for 16 codes: a compute-bound NVFP4 decode). Each pipeline step loads all its
runs' scales (and table entries) up front, so that no shared-memory latency heads a run's dependency chain. Mosaic GPU's
interpreter runs no inline PTX and its XLA:CPU flushes subnormals, so there the values are decoded through float
conversions and the wgmma takes them from SMEM."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import block_formats
from pallas_kernels.moe.layouts import e2m1_value, gpu_run_order, nvfp4_word_codes

LANES = 64  # weight rows per compute warpgroup (the wgmma M tile)


def across(row: jax.Array, cols: int) -> jax.Array:
    """[64] -> [64, cols]: each row's value in every column, in the wgmma register layout."""
    return plgpu.layout_cast(lax.broadcast_in_dim(row, (row.shape[0], cols), (0,)), plgpu.Layout.WGMMA)


def _words(register: ir.Value) -> list[ir.Value]:
    """A vector<2xi32> register -> its two 32-bit words."""
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    both = mgpu.utils.bitcast(register, i64)
    return [arith.trunci(i32, both), arith.trunci(i32, arith.shrui(both, arith.constant(i64, 32)))]


def _pairs(quad: ir.Value) -> list[ir.Value]:
    """An i64 of four bf16 -> two vector<2xbf16> registers (the low half first)."""
    quad = mgpu.utils.bitcast(quad, ir.VectorType.get((4,), ir.BF16Type.get()))
    return [mgpu.utils.vector_slice(quad, slice(i, i + 2)) for i in (0, 2)]


def _from_words(data: mgpu.FragmentedArray, run: int, decode) -> list[np.ndarray]:
    """Words [64, 8R] (R runs of 32 bytes per row) -> the registers of bf16 [64, 32] fragments from run `run`:
    `decode(index, words)` takes the two 32-bit words of data's register `index` (a thread's 8 bytes of a run:
    index[1] is the run) and returns, per fragment, the four vector<2xbf16> registers the thread holds of it:
    columns 2c, 2c + 1, then 2c + 8, 2c + 9, ..., 2c + 25 (c = lane % 4), of the index's rows."""
    columns = plgpu.Layout.WGMMA.to_mgpu().registers_shape((LANES, 32))
    if columns[1] != 4 or data.registers.shape[2:] != tuple(columns[2:]):
        raise RuntimeError(f"the wgmma register layout is not the one decoded for: {data.registers.shape}, {columns}")
    outs = None
    for index, register in np.ndenumerate(data.registers):
        if index[1] != run:
            continue
        fragments = decode(index, _words(register))
        outs = outs or [np.empty(columns, object) for _ in fragments]
        for out, groups in zip(outs, fragments, strict=True):
            for group, value in enumerate(groups):
                out[(index[0], group, *index[2:])] = value
    return outs


MX_WORD_ASM = """{
    .reg .b32 t, lo, hi;
    prmt.b32 t, $1, 0, 0x9180;
    shl.b32 t, t, 4;
    and.b32 lo, t, 0x87F087F0;
    prmt.b32 t, $1, 0, 0xB3A2;
    shl.b32 t, t, 4;
    and.b32 hi, t, 0x87F087F0;
    mov.b64 $0, {lo, hi};
}"""


@functools.cache
def _e4m3_as_bf16_bits(run: int):
    """E4M3 words [64, 8R] -> bf16 e4m3 * 2^-120 [64, 32] of run `run`, exactly, in 3 instructions per two values:
    PRMT puts each byte in the low byte of a bf16 lane and its sign, replicated, in the high byte; a shift by 4 and
    one mask leave the bits sign, 0000, (exponent, mantissa) of the byte, 0000 (Marlin's e4m3 shift; the sign and
    shift in two more instructions ran the decode's ALU pipe 74% busy at 8 tokens)."""

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct((LANES, block_formats.MX_BLOCK), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def decode(_, data: mgpu.FragmentedArray) -> mgpu.FragmentedArray:
        i64 = ir.IntegerType.get_signless(64)

        def word_values(_, words):
            return [[pair for word in words for pair in _pairs(llvm.inline_asm(i64, [word], MX_WORD_ASM, "=l,r"))]]

        (registers,) = _from_words(data, run, word_values)
        return mgpu.FragmentedArray(_registers=registers, _layout=data.layout, _is_signed=None)

    return decode


@functools.cache
def _joined():
    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
        return_type=plgpu.ShapeDtypeStruct((LANES, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def join(_, left: mgpu.FragmentedArray, right: mgpu.FragmentedArray) -> mgpu.FragmentedArray:
        registers = np.concatenate([left.registers, right.registers], axis=1)  # axis 1: 8-column groups
        return mgpu.FragmentedArray(_registers=registers, _layout=left.layout, _is_signed=None)

    return join


def joined(left: jax.Array, right: jax.Array, interpret: bool) -> jax.Array:
    """Two bf16 [64, 32] register operands -> [64, 64]: left's columns, then right's (no data moves: the wgmma
    layout holds a thread's values of each 8-column group in registers of their own)."""
    return jnp.concatenate([left, right], axis=1) if interpret else _joined()(left, right)


def _run_bytes(words: jax.Array, run: int) -> jax.Array:
    """Words [64, 8R] -> run `run`'s bytes [64, 32] in row order (the interpreter's view)."""
    shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
    stored = (words[:, 8 * run : 8 * run + 8, None] >> shifts) & 0xFF
    return gpu_run_order(stored.astype(jnp.uint8).reshape(words.shape[0], 32))


def mx_values(data: jax.Array, run: int, scale: jax.Array, interpret: bool) -> jax.Array:
    """E4M3 words [64, 8R], the run (one scale block of each row) to decode and the rows' E8M0 bytes [64] -> bf16
    values [64, 32]."""
    if interpret:  # the interpreter runs no inline PTX; XLA:CPU's float conversions, for the same values
        values = lax.bitcast_convert_type(_run_bytes(data, run), jnp.float8_e4m3fn).astype(jnp.float32)
        return (values * block_formats.e8m0_value(scale)[:, None]).astype(jnp.bfloat16)
    factor = lax.bitcast_convert_type((scale.astype(jnp.uint16) + 120) << 7, jnp.bfloat16)  # 2^(scale - 7)
    return _e4m3_as_bf16_bits(run)(data) * across(factor, block_formats.MX_BLOCK)


def _nv_lookup(word: str, first: int) -> str:
    """PTX: the 8 codes of `word` looked up in the tables h0, h1 (high bytes) and l0, l1 (low bytes), as bf16 pairs
    into outputs first ... first + 3; codes 0-3 first (their signs in the word's bits 7, 15, 23, 31), then codes
    4-7 (signs in bits 3, 11, 19, 27: where the high bytes want them after a shift by 4)."""

    def four(select: str, sign: str, out: int) -> str:
        return f"""{select}
    prmt.b32 hb, h0, h1, idx;
    prmt.b32 lb, l0, l1, idx;
    lop3.b32 hb, hb, {sign}, 0x80808080, 0xF8;
    prmt.b32 ${out}, lb, hb, 0x5140;
    prmt.b32 ${out + 1}, lb, hb, 0x7362;"""

    low = four(f"and.b32 idx, {word}, 0x77777777;", word, first)
    return low + "\n    " + four(f"shr.b32 idx, idx, 16;\n    shl.b32 sign, {word}, 4;", "sign", first + 2)


NV_ENTRY_ASM = """{
    .reg .b16 byte, unused, half;
    .reg .b32 halves, p, q, r, s, twos, quarters, fours;
    .reg .f32 e4m3, step, step3;
    mov.b32 {byte, unused}, $4;
    cvt.rn.f16x2.e4m3x2 halves, byte;
    mov.b32 {half, unused}, halves;
    cvt.f32.f16 e4m3, half;
    mul.rn.f32 step, e4m3, $5;
    mul.rn.f32 step3, step, 0f3FC00000;
    cvt.rn.bf16x2.f32 p, step3, step;
    mov.b32 quarters, 0x3F003F00;
    mov.b32 twos, 0x40004000;
    mov.b32 fours, 0x40804080;
    mul.rn.bf16x2 q, p, quarters;
    mul.rn.bf16x2 r, p, twos;
    mul.rn.bf16x2 s, p, fours;
    prmt.b32 $0, q, p, 0x751D;
    prmt.b32 $1, r, s, 0x7531;
    prmt.b32 $2, q, p, 0x640D;
    prmt.b32 $3, r, s, 0x6420;
}"""

NV_LOOKUP_ASM = (
    """{
    .reg .b32 h0, h1, l0, l1, idx, hb, lb, sign;
    mov.b32 h0, $10;
    mov.b32 h1, $11;
    mov.b32 l0, $12;
    mov.b32 l1, $13;
    """
    + _nv_lookup("$8", 0)
    + "\n    "
    + _nv_lookup("$9", 4)
    + "\n}"
)
NV_INDEX_ASM = "{\n    prmt.b32 $0, $1, 0, $2;\n    and.b32 $0, $0, 0x7F;\n}"
TABLE_ENTRIES = 128  # the E4M3 block scale bytes a table covers: every one not negative (NaN's entry never read)


def _vec4_i32() -> ir.Type:
    return ir.VectorType.get((4,), ir.IntegerType.get_signless(32))


@functools.cache
def nv_step_table():
    """A warpgroup's table, in SMEM [128, 4] uint32, of the 8 code magnitudes' bf16 values under each E4M3 block
    scale byte b and the expert's global scale g (from the rows' global scales, [64, 8] fp32): entry b holds
    fp32(m * fp32(e4m3(b) * g)) rounded as the oracle rounds them, bf16(step) and bf16(fp32(1.5 step)) times 1/2,
    2 and 4 (exact for steps in [2^-125, 2^125] or 0, which `layouts.check_for_gpu` checks), as the high bytes of
    magnitudes 0-3, 4-7, then their low bytes. Each thread writes the entry of its index in the warpgroup, under its
    own row's global scale: the rows must share one (`layouts.for_gpu` makes an expert's rows NaN where they do
    not)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def build(_, global_scale, table):
        i32 = ir.IntegerType.get_signless(32)
        entry = arith.remui(mgpu.utils.thread_idx(), arith.constant(i32, TABLE_ENTRIES))
        step = _words(global_scale.registers.flat[0])[0]
        words = mgpu.utils.inline_ptx(NV_ENTRY_ASM, entry, step, result_types=[i32] * 4)
        llvm.store(
            vector.from_elements(_vec4_i32(), words),
            mgpu.utils.getelementptr(mgpu.utils.memref_ptr(table), [entry], _vec4_i32()),
            alignment=16,
        )
        mgpu.utils.warpgroup_barrier()

    return build


@functools.cache
def nv_entries():
    """The rows' four block scales of a run ([64, 8] uint32, one value per row) and the warpgroup's
    `nv_step_table` -> each row's entry for the block of this thread (c = lane % 4), as [64, 16] uint32 in the
    wgmma layout: a thread's four values of a row are the entry's four words. Loaded ahead of the runs' lookups,
    so that the shared-memory latency is not in their dependency chains."""
    entries = plgpu.ShapeDtypeStruct((LANES, 16), jnp.uint32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()), return_type=entries)
    def load(_, scales, table):
        i32 = ir.IntegerType.get_signless(32)
        lane = mgpu.utils.thread_idx()  # i32
        byte_of_lane = arith.ori(arith.andi(lane, arith.constant(i32, 3)), arith.constant(i32, 0x4440))
        first = mgpu.utils.memref_ptr(table)
        shape = plgpu.Layout.WGMMA.to_mgpu().registers_shape((LANES, 16))
        registers = np.empty(shape, object)
        for index, register in np.ndenumerate(scales.registers):
            scale = _words(register)[0]
            # the byte as the entry's index; & 0x7F keeps a negative scale (which the load refuses) inside the table
            byte = mgpu.utils.inline_ptx(NV_INDEX_ASM, scale, byte_of_lane, result_types=i32)
            entry = llvm.load(_vec4_i32(), mgpu.utils.getelementptr(first, [byte], _vec4_i32()), alignment=16)
            for half in (0, 1):  # words 0-1, then 2-3, in the row's two registers
                registers[(index[0], half, *index[2:])] = mgpu.utils.vector_slice(entry, slice(2 * half, 2 * half + 2))
        return mgpu.FragmentedArray(_registers=registers, _layout=scales.layout, _is_signed=False)

    return load


@functools.cache
def e2m1_by_table(run: int):
    """NVFP4 words [64, 8R] (`layouts.nvfp4_word`) and the rows' `nv_entries` of run `run` -> the run's two bf16
    [64, 32] fragments, in `layouts.nvfp4_gpu_columns` order: a thread's 16 values of a row are block c = lane %
    4's. 4 codes per PRMT look their bytes up in the entry and the stored signs are ORed into the high bytes."""
    values = plgpu.ShapeDtypeStruct((LANES, 32), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA), return_type=(values, values))
    def decode_run(_, data, entries):
        i32, bf16x2 = ir.IntegerType.get_signless(32), ir.VectorType.get((2,), ir.BF16Type.get())

        def decode(index, words):
            table = [w for half in (0, 1) for w in _words(entries.registers[(index[0], half, *index[2:])])]
            outs = mgpu.utils.inline_ptx(NV_LOOKUP_ASM, *words, *table, result_types=[i32] * 8)
            outs = [mgpu.utils.bitcast(out, bf16x2) for out in outs]
            return [outs[:4], outs[4:]]

        fragments = _from_words(data, run, decode)
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=data.layout, _is_signed=None) for r in fragments)

    return decode_run


def nv_values(data: jax.Array, run: int, scales: jax.Array, global_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The interpreter's NVFP4 decode (it runs no inline PTX): words [64, 8R], the run to decode (64 K indices of
    each row), the rows' four block scales of it ([64] uint32, block b in byte b) and global scales ([64] fp32) ->
    the run's bf16 values, bf16(fp32(code value * step)) as the oracle rounds them, as `e2m1_by_table` gives
    them: two [64, 32] fragments in `layouts.nvfp4_gpu_columns` order."""
    codes = nvfp4_word_codes(data[:, 8 * run : 8 * run + 8]).reshape(LANES, 64)
    scale_bytes = (scales[:, None] >> jnp.arange(0, 32, 8, dtype=jnp.uint32)) & 0xFF
    e4m3 = lax.bitcast_convert_type(scale_bytes.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
    steps = jnp.repeat(e4m3 * global_scale[:, None], block_formats.NV_BLOCK, axis=1)
    values = (e2m1_value(codes) * steps).astype(jnp.bfloat16)  # K index 16c + 8f + 2j + b -> column 32f + 8j + 2c + b
    values = values.reshape(LANES, 4, 2, 4, 2).transpose(0, 2, 3, 1, 4).reshape(LANES, 64)
    return values[:, :32], values[:, 32:]
