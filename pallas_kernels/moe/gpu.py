"""Routed experts on Hopper (sm90) through Mosaic GPU: two grouped matmuls over the token copies sorted by expert, each
weight decoded in registers right before the wgmma that takes it (never in HBM or SMEM).

The copies are walked in visits of TM rows each (`Tiles`), every visit one expert's. A work item is one visit's
product for one tile of 128 or 192 weight rows (N) and one share of K ("swap AB": the weight rows are wgmma's M
side, in registers; the visit's copies its N side, from SMEM). One CTA per multiprocessor walks its items (cta,
cta + CTAs, ...) through one software pipeline: the next item's first stages stream in under the last steps and
the epilogue of the one before (a CTA per item drained its pipeline at every item's end: 8-15% of the decode's
bandwidth). One warpgroup issues the TMA copies of each K step (the weight tile's bytes, its block scales, the
tile's activations) into a ring of SMEM stages; three compute (two where N is no multiple of 192), 64 weight rows
each, decoding each run of their rows (32 MXFP8 values, one scale block, or 64 NVFP4, four) to bf16 and
multiplying it with the activations' matching columns while the next block decodes. The epilogue stores the
accumulator transposed into SMEM and copies only the visit's own rows out (a log ladder of TMA boxes, as in jax's
ragged_dot_mgpu), so visits that share rows never write each other's.

Decode (a few tokens): the copies share tiles of TM rows (TM twice the mean group, 8 ... 64: about one tile per
chosen expert, so each wgmma's N side is no wider than the groups need), each chosen expert's bytes read once per
column tile; K is split into shares when the (visit, column tile) pairs fall unevenly on the CTAs, each share
written as fp32 partial sums that XLA adds. Prefill: each expert's copies are visited in windows of 96 rows of
their own (no row multiplied twice). The gate_up kernel applies the softcapped SwiGLU in its epilogue (its rows
laid out in pairs, `layouts.paired_rows`: a warpgroup's 64 rows are 32 hidden units' gate and up rows), except
where K is split: there XLA adds the shares, then applies the SwiGLU. After the matmuls XLA combines the copies
(`routing.combine`).

The values are the oracle's bit for bit: MXFP8 E4M3 bytes become bf16 e4m3 * 2^-120 by moving their bits (inline PTX:
PRMT, shifts; subnormals included), then a bf16 multiply by 2^(scale - 7), exact (scale bytes up to 134, which
`layouts.for_gpu` checks); NVFP4 codes are looked up (PRMT) in a table of their block's 8 magnitudes in bf16, each
fp32(m * block scale * global scale) rounded once: each warpgroup tabulates them in SMEM for every E4M3 block scale byte
at a work item's start (the global scale is the expert's), and a thread loads its block's 16 bytes once per row and 64 K
values (the activations' K permuted so that a thread's values are one scale block's; tables built by each thread per row
and block, 20 instructions for 16 codes, ran the NVFP4 decode at 57% of the copy rate). Each pipeline step loads all its
runs' scales (and table entries) up front, so that no shared-memory latency heads a run's dependency chain. Mosaic GPU's
interpreter runs no inline PTX and its XLA:CPU flushes subnormals, so there the values are decoded through float
conversions and the wgmma takes them from SMEM."""

import dataclasses
import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import block_formats
from pallas_kernels.moe.layouts import (
    PAIR_UNITS,
    PLAIN,
    GpuWeight,
    check_experts,
    e2m1_value,
    gpu_k_order,
    gpu_run_order,
    nvfp4_word_codes,
)
from pallas_kernels.moe.reference import capped_swiglu, capped_swiglu_f32
from pallas_kernels.moe.routing import Routing, combine, group_of, group_offsets, prefix_sum, route, visits
from pallas_kernels.numerics import round_to
from pallas_kernels.quantized import MXFP8, NVFP4

COMPUTE_WGS = (3, 2)  # compute warpgroups per CTA, the most that divide N's tiles of 64 rows (3: 8% faster than 2 at
# 8 tokens on the H200, more warps hiding the decode's latencies; a CTA of 4 compute warpgroups hung there)
LANES = 64
SHARED_TM = (8, 64)  # decode: the fewest and most rows of a shared tile (a multiple of 8 between: twice the mean group)
OWN_TM = 96  # prefill: rows per window of an expert's own (96: 9% faster than 128 at 4096 tokens on the H200, where
# the groups average 85 copies)
OWN_TILES_FROM = 32  # copies per expert (on average) from which the groups get windows of their own
SMS = 132  # H200 multiprocessors (the interpreter's CTAs)
SMEM_BYTES = 232448  # per-block shared memory on sm90
MIN_SHARE_STEPS = 3  # pipeline steps in a share of K, at least (a ring of three stages inside each item)
SPLIT_GAIN = Fraction(1, 8)  # how much sooner more shares of K must end the work (64 tokens split in two for a 0.6%
# better balance ran 6% slower on the H200)
BLOCK = {PLAIN: 32, MXFP8: block_formats.MX_BLOCK, NVFP4: 64}  # K values per decode (quantized: 32 bytes a row)
VALUES_PER_ITEM = {PLAIN: 1, MXFP8: 4, NVFP4: 8}  # K values per item of GpuWeight.data (bf16, or uint32 words)


def _multiprocessors() -> int:
    """The GPU's multiprocessors (SMS off the GPU: the interpreter's)."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else SMS


def _item_rows(n: int) -> int:
    """Weight rows per work item for N rows: 64 per compute warpgroup (the wgmma M tile), as many warpgroups of
    COMPUTE_WGS as divide N."""
    return next(wgs * LANES for wgs in COMPUTE_WGS if n % (wgs * LANES) == 0)


def _step_k(fmt: str, k: int, tm: int) -> int:
    """K values per pipeline step: 256 for quantized weights in shared tiles, else 128 (a stage's weight and
    activation tiles of 8-64 KB each)."""
    kc = 256 if fmt != PLAIN and tm <= SHARED_TM[1] else 128
    if k % kc:
        raise ValueError(f"the GPU expert kernel needs K ({k}) to be a multiple of {kc}")
    return kc


def _splits(k: int, kc: int, pairs: int) -> int:
    """S: the shares of K (whole pipeline steps, MIN_SHARE_STEPS at least) that give every CTA work (pairs * S >=
    CTAs, else the most shares), split further only where that ends the work at least SPLIT_GAIN sooner: the
    busiest CTA runs ceil(pairs * S / CTAs) items of 1 / S of K each, and each share costs fp32 partial sums (one
    token: 192 (visit, column tile) pairs of gate_up on 132 CTAs take 3 halves of K, against 2 wholes; 64
    tokens' 10.7K pairs stay whole). The shares, so the grouping of a split K's partial sums and their last
    bits, follow the GPU's multiprocessor count."""
    steps, ctas = k // kc, _multiprocessors()
    shares = [s for s in range(1, steps + 1) if steps % s == 0 and (s == 1 or steps // s >= MIN_SHARE_STEPS)]
    busy = [s for s in shares if pairs * s >= ctas] or shares[-1:]

    def makespan(s: int) -> Fraction:
        return Fraction(-(-pairs * s // ctas), s)

    best = min(busy, key=lambda s: (makespan(s), s))
    return best if makespan(best) <= (1 - SPLIT_GAIN) * makespan(busy[0]) else busy[0]


def _transforms(row_bytes: int, itemsize: int) -> tuple:
    swizzle = min(128, row_bytes)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _across(row: jax.Array, cols: int) -> jax.Array:
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
    .reg .b32 t, u, lo, hi;
    prmt.b32 t, $1, $1, 0x1000;
    and.b32 u, t, 0x7F007F00;
    shr.b32 u, u, 4;
    and.b32 t, t, 0x80008000;
    or.b32 lo, t, u;
    prmt.b32 t, $1, $1, 0x3020;
    and.b32 u, t, 0x7F007F00;
    shr.b32 u, u, 4;
    and.b32 t, t, 0x80008000;
    or.b32 hi, t, u;
    mov.b64 $0, {lo, hi};
}"""


@functools.cache
def _e4m3_as_bf16_bits(run: int):
    """E4M3 words [64, 8R] -> bf16 e4m3 * 2^-120 [64, 32] of run `run`, exactly: per two bytes, PRMT puts them in
    the high bytes of two bf16 lanes, then sign | (exponent, mantissa) >> 4 (Marlin's e4m3 shift)."""

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


def _run_bytes(words: jax.Array, run: int) -> jax.Array:
    """Words [64, 8R] -> run `run`'s bytes [64, 32] in row order (the interpreter's view)."""
    shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
    stored = (words[:, 8 * run : 8 * run + 8, None] >> shifts) & 0xFF
    return gpu_run_order(stored.astype(jnp.uint8).reshape(words.shape[0], 32))


def _mx_values(data: jax.Array, run: int, scale: jax.Array, interpret: bool) -> jax.Array:
    """E4M3 words [64, 8R], the run (one scale block of each row) to decode and the rows' E8M0 bytes [64] -> bf16
    values [64, 32]."""
    if interpret:  # the interpreter runs no inline PTX; XLA:CPU's float conversions, for the same values
        values = lax.bitcast_convert_type(_run_bytes(data, run), jnp.float8_e4m3fn).astype(jnp.float32)
        return (values * block_formats.e8m0_value(scale)[:, None]).astype(jnp.bfloat16)
    factor = lax.bitcast_convert_type((scale.astype(jnp.uint16) + 120) << 7, jnp.bfloat16)  # 2^(scale - 7)
    return _e4m3_as_bf16_bits(run)(data) * _across(factor, block_formats.MX_BLOCK)


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
def _nv_step_table():
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
def _nv_entries():
    """The rows' four block scales of a run ([64, 8] uint32, one value per row) and the warpgroup's
    `_nv_step_table` -> each row's entry for the block of this thread (c = lane % 4), as [64, 16] uint32 in the
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
def _e2m1_by_table(run: int):
    """NVFP4 words [64, 8R] (`layouts.nvfp4_word`) and the rows' `_nv_entries` of run `run` -> the run's two bf16
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


def _nv_values(data: jax.Array, run: int, scales: jax.Array, global_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The interpreter's NVFP4 decode (it runs no inline PTX): words [64, 8R], the run to decode (64 K indices of
    each row), the rows' four block scales of it ([64] uint32, block b in byte b) and global scales ([64] fp32) ->
    the run's bf16 values, bf16(fp32(code value * step)) as the oracle rounds them, as `_e2m1_by_table` gives
    them: two [64, 32] fragments in `layouts.nvfp4_gpu_columns` order."""
    codes = nvfp4_word_codes(data[:, 8 * run : 8 * run + 8]).reshape(LANES, 64)
    scale_bytes = (scales[:, None] >> jnp.arange(0, 32, 8, dtype=jnp.uint32)) & 0xFF
    e4m3 = lax.bitcast_convert_type(scale_bytes.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
    steps = jnp.repeat(e4m3 * global_scale[:, None], block_formats.NV_BLOCK, axis=1)
    values = (e2m1_value(codes) * steps).astype(jnp.bfloat16)  # K index 16c + 8f + 2j + b -> column 32f + 8j + 2c + b
    values = values.reshape(LANES, 4, 2, 4, 2).transpose(0, 2, 3, 1, 4).reshape(LANES, 64)
    return values[:, :32], values[:, 32:]


def _tile(ref) -> jax.Array:
    """A [64, C] SMEM tile in registers, in the layout of wgmma's register operand."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA)


def _row(ref) -> jax.Array:
    """A [64] SMEM vector in registers, one value per row of a `_tile`."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def _store_rows(tile_smem, tile_gmem, start: jax.Array, size: jax.Array) -> None:
    """Rows [start, start + size) of a [TM, C] SMEM tile to the same rows of tile_gmem, in TMA boxes of 2^i rows
    (box shapes are static; the rows are not)."""
    height = tile_smem.shape[0]
    while height:
        rows = 1 << (height.bit_length() - 1)
        height //= 2

        @pl.when(size & rows != 0)
        def _(rows=rows, start=start):
            plgpu.copy_smem_to_gmem(tile_smem.at[pl.ds(start, rows)], tile_gmem.at[pl.ds(start, rows)])

        start = start + (size & rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tiles:
    """Where the sorted copies sit in the kernels' rows, and the visits over them: visit v multiplies rows
    first_row[v] ... first_row[v] + tm - 1 (starting at a multiple of 8: TMA reads GMEM rows in tiles of 8) by
    expert[v]'s weights and writes back the rows of that expert's group among them.

    Shared tiles (decode): the rows are the sorted copies, groups follow each other and several share a tile
    (`routing.visits`: one visit per (tile, expert) pair that meet). Own windows (prefill): each expert's group
    starts at a multiple of 8 rows and is visited in windows of tm rows from there, one visit per window (the
    last may run into the next group's rows, multiplied and not written back): no row is multiplied twice by its
    own expert, each expert's weights are read once per window, and the rows (what XLA gathers before the kernels)
    exceed the copies by at most 7 per expert, 7 more and a window, where groups padded to whole tiles of their own
    nearly doubled them at 4096 tokens.
    """

    expert: jax.Array  # [V] int32: each visit's expert (padding visits repeat the last real one)
    first_row: jax.Array  # [V] int32: each visit's first row, a multiple of 8 (shared tiles: of tm)
    starts: jax.Array  # [E] int32: each expert's first row
    ends: jax.Array  # [E] int32: one past its last row
    real: jax.Array  # [1] int32: the number of real visits
    source: jax.Array | None  # [R] int32: the sorted copy in each row (None: the rows are the sorted copies)
    row_of: jax.Array | None  # [N * k] int32: the row of each sorted copy (None: the same)
    tm: int = dataclasses.field(metadata={"static": True})
    rows: int = dataclasses.field(metadata={"static": True})  # R: every visit's window within them


def shared_rows(copies: int, num_experts: int) -> int:
    """tm of the decode's shared tiles: twice the mean group (copies / experts) in whole tiles of 8 rows, within
    SHARED_TM."""
    low, high = SHARED_TM
    return min(high, max(low, -(-2 * copies // (8 * num_experts)) * 8))


def tile_copies(routing: Routing) -> Tiles:
    """The kernels' rows for the copies `routing` sorted (shared tiles below OWN_TILES_FROM copies per expert, own
    windows from there)."""
    group_sizes, copies = routing.group_sizes, routing.order.shape[0]
    num_experts = group_sizes.shape[0]
    offsets = group_offsets(routing)
    if copies < OWN_TILES_FROM * num_experts:
        tm = shared_rows(copies, num_experts)
        tiles = -(-copies // tm)
        expert, tile, real = visits(offsets, tm, tiles + min(num_experts, copies) - 1)
        return Tiles(expert, tile * tm, offsets[:-1], offsets[1:], real, None, None, tm, tiles * tm)
    tm = OWN_TM
    count = -(-copies // tm) + min(num_experts, copies)  # windows, at most
    padded = -(-group_sizes // 8) * 8
    starts = prefix_sum(padded) - padded
    rows = -(-(copies + 7 * min(num_experts, copies)) // 8) * 8 + tm  # the groups padded to 8, the last window
    per_expert = -(-group_sizes // tm)
    window_ends = prefix_sum(per_expert)
    real = window_ends[-1]
    v = jnp.minimum(jnp.arange(count, dtype=jnp.int32), jnp.maximum(real - 1, 0))
    expert = jnp.minimum(group_of(window_ends, v), num_experts - 1)
    first_row = starts[expert] + (v - window_ends[expert] + per_expert[expert]) * tm
    copy = jnp.arange(copies, dtype=jnp.int32)
    copy_expert = jnp.minimum(group_of(offsets[1:], copy), num_experts - 1)
    row_of = starts[copy_expert] + copy - offsets[copy_expert]  # dropped copies: past every group, within the rows
    source = jnp.zeros(rows, jnp.int32).at[row_of].set(copy)
    return Tiles(expert, first_row, starts, starts + group_sizes, real.reshape(1), source, row_of, tm, rows)


def _grouped(
    rows: jax.Array, w: GpuWeight, tiles: Tiles, *, splits: int, out_dtype: jnp.dtype,
    swiglu: tuple[float, float] | None, interpret: bool,
) -> jax.Array:  # fmt: skip
    """rows [R, K] x the visits' experts' w [E, N, K] -> [S, R, N] (`out_dtype`): each row's product with its
    own expert, summed over one share of K per leading index; with `swiglu` (caps; a paired w, one share) the
    capped SwiGLU of each warpgroup's 32 gate and 32 up columns instead, [1, R, N / 2]."""
    tm = tiles.tm
    fmt = w.format
    _, n, k = w.shape
    blk = BLOCK[fmt]
    data_item = w.data.dtype.itemsize
    cta_rows = _item_rows(n)
    wgs = cta_rows // LANES
    epilogue_values = tm * LANES + ((tm + 2) * PAIR_UNITS if swiglu else 0)  # [tm, 64] products, the SwiGLU's rows
    tabled = fmt == NVFP4 and not interpret  # a table per warpgroup of each block scale byte's magnitudes
    staging = wgs * (epilogue_values * jnp.dtype(out_dtype).itemsize + (LANES * 64 if interpret else 0))
    staging += wgs * TABLE_ENTRIES * 16 if tabled else 0
    for kc in dict.fromkeys((_step_k(fmt, k, tm), 128)):  # the items' pipelines chain on whole rings of stages:
        steps = k // kc // splits  # halve the steps where no ring of 2-4 divides them
        data_cols = kc // VALUES_PER_ITEM[fmt]  # data items (bf16 values, or words) per step of a row
        scale_rows = kc // blk  # MXFP8: one scale byte per block; NVFP4: four in a word per 64 K values
        scale_bytes = 0 if fmt == PLAIN else scale_rows * cta_rows * w.scales.dtype.itemsize
        scale_bytes += cta_rows * 4 if fmt == NVFP4 else 0  # the global scales, fp32
        stage_bytes = cta_rows * data_cols * data_item + tm * kc * 2 + scale_bytes
        fits = max(2, min(4, (SMEM_BYTES - staging - 1024) // stage_bytes))
        stages = max(d for d in range(1, fits + 1) if steps % d == 0)
        if stages > 1:
            break

    # a row's bytes per SMEM load: one block's 64 bytes of bf16, or up to four 32-byte runs of words (swizzled by
    # 128 bytes: the TMA copies of rows narrower than that cap the weights' streaming rate)
    load_bytes = blk * 2 if fmt == PLAIN else min(128, data_cols * data_item)
    load_items, runs = load_bytes // data_item, load_bytes // 32
    data_transforms = _transforms(load_bytes, data_item)
    data_spec = plgpu.BlockSpec((cta_rows, data_cols), lambda kk: (0, kk), transforms=data_transforms)
    x_spec = plgpu.BlockSpec((tm, kc), lambda kk: (0, kk), transforms=_transforms(64, 2))  # 32-column slices
    specs = [data_spec, x_spec]
    if fmt != PLAIN:
        specs.append(plgpu.BlockSpec((scale_rows, cta_rows), lambda kk: (kk, 0)))
    if fmt == NVFP4:  # the rows' global scales again in every stage (kk * 0: a per-step copy, multi-buffered)
        specs.append(plgpu.BlockSpec((1, cta_rows), lambda kk: (kk * 0, 0)))

    n_tiles = n // cta_rows
    weight_operands = {PLAIN: 0, MXFP8: 1, NVFP4: 2}[fmt]  # the weight's scales, global scales
    per_visit = n_tiles * splits  # work items per visit: (column tile, share of K) pairs
    ctas = min(_multiprocessors(), per_visit * tiles.expert.shape[0])

    def body(expert_ref, first_row_ref, starts_ref, ends_ref, real_ref, x_gmem, data_gmem, *refs):
        scales_gmem, global_gmem = (*refs[:weight_operands], None, None)[:2]
        out_gmem, out_smem, *a_smem = refs[weight_operands:]
        hidden_smem = a_smem.pop(0) if swiglu else None
        table_smem = a_smem.pop(0) if tabled else None
        wg, cta = lax.axis_index("wg"), lax.axis_index("sm")
        lanes = pl.ds(pl.multiple_of(wg * LANES, LANES), LANES)

        def item(j: jax.Array) -> tuple[jax.Array, ...]:
            """This CTA's work item j (items cta, cta + ctas, ...): its expert, first row, column tile and share."""
            v, rest = jnp.divmod(cta + ctas * j, per_visit)
            nt, s = jnp.divmod(rest, splits)
            return expert_ref[v], first_row_ref[v], nt, s

        def operands(e, row, nt, s) -> list:
            n_rows = pl.ds(pl.multiple_of(nt * cta_rows, cta_rows), cta_rows)
            k_share = pl.ds(pl.multiple_of(s * steps * kc, kc), steps * kc)
            data_share = pl.ds(pl.multiple_of(s * steps * data_cols, data_cols), steps * data_cols)
            refs = [data_gmem.at[e, n_rows, data_share], x_gmem.at[pl.ds(pl.multiple_of(row, 8), tm), k_share]]
            if fmt != PLAIN:
                blocks_share = pl.ds(pl.multiple_of(s * steps * scale_rows, scale_rows), steps * scale_rows)
                refs.append(scales_gmem.at[e, blocks_share, n_rows])
            if fmt == NVFP4:
                refs.append(global_gmem.at[e, :, n_rows])
            return refs

        def mma(indices, data_smem, x_smem, *refs):
            scale_refs, acc_ref = refs[:-1], refs[-1]
            global_scale = None
            if fmt == NVFP4 and interpret:  # this warpgroup's rows' global scales, [64] fp32
                global_scale = _row(scale_refs[1].at[0, lanes])
            if fmt != PLAIN:  # the rows' scales of each block ([64]: MXFP8 E8M0 bytes, NVFP4 four E4M3 in a word)
                scales = [_row(scale_refs[0].at[j, lanes]) for j in range(kc // blk)]
            if tabled:  # at an item's first step: its expert's table (after the last item's epilogue's barrier)
                table = table_smem.at[wg]

                @pl.when(indices[0] == 0)
                def _():
                    _nv_step_table()(_across(_row(scale_refs[1].at[0, lanes]), 8), table)

                entries = [_nv_entries()(_across(scale, 8), table) for scale in scales]  # up front
            for j in range(kc // blk):
                cols = pl.ds(j * blk, blk)
                if fmt == PLAIN:
                    parts = [(_tile(data_smem.at[lanes, cols]), cols)]
                else:
                    load, run = divmod(j, runs)
                    if run == 0:
                        words = _tile(data_smem.at[lanes, pl.ds(load * load_items, load_items)])
                if fmt == MXFP8:
                    parts = [(_mx_values(words, run, scales[j], interpret), cols)]
                elif fmt == NVFP4:
                    if interpret:
                        low, high = _nv_values(words, run, scales[j], global_scale)
                    else:
                        low, high = _e2m1_by_table(run)(words, entries[j])
                    parts = [(low, pl.ds(j * blk, 32)), (high, pl.ds(j * blk + 32, 32))]
                for values, x_cols in parts:
                    if interpret:  # the interpreter's wgmma takes its A operand from SMEM only
                        a_smem[0].at[wg, :, pl.ds(0, values.shape[1])][...] = values
                        plgpu.commit_smem()
                        values = a_smem[0].at[wg, :, pl.ds(0, values.shape[1])]
                    plgpu.wgmma(acc_ref, values, x_smem.at[:, x_cols].transpose((1, 0)))
                    plgpu.wgmma_wait(0 if interpret else 1)  # the next block decodes under this one's wgmma
            plgpu.wgmma_wait(0)  # the stage is read before the pipeline releases it
            return acc_ref

        def compute(e, row, nt, s, run):
            acc = pl.run_scoped(lambda acc_ref: run(acc_ref)[...], plgpu.ACC((LANES, tm), jnp.float32))
            # pairs of rows in each thread's registers: adjacent in the transposed view
            acc = plgpu.layout_cast(acc.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            out_smem.at[wg].transpose((1, 0))[...] = acc
            plgpu.commit_smem()
            first = jnp.maximum(starts_ref[e], row)
            last = jnp.minimum(ends_ref[e], row + tm)
            if swiglu:  # [tm, 32 gate | 32 up] -> [tm, 32] hidden units nt * wgs + wg's block
                gate, up = (out_smem.at[wg, :, pl.ds(i * PAIR_UNITS, PAIR_UNITS)][...] for i in (0, 1))
                # TMA copies SMEM from 128-byte aligned addresses: the 64-byte hidden rows go one row down where the
                # first row to write back is odd, so that every box of the ladder starts at an even row
                staged = hidden_smem.at[wg, pl.ds((first - row) % 2, tm)]
                staged[...] = capped_swiglu_f32(gate, up, *swiglu).astype(out_dtype)
                plgpu.commit_smem()
                columns = pl.ds((nt * wgs + wg) * PAIR_UNITS, PAIR_UNITS)
            else:
                staged, columns = out_smem.at[wg], pl.ds(nt * cta_rows + wg * LANES, LANES)
            _store_rows(staged, out_gmem.at[s, pl.ds(row, tm), columns], first - row, last - first)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def pipeline(state, context=None):
            return plgpu.emit_pipeline_warp_specialized(
                mma, grid=(steps,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=wgs,
                max_concurrent_steps=stages, compute_context=context, pipeline_state=state,
            )  # fmt: skip

        def run_item(j, state, allocations):
            e, row, nt, s = item(j)
            context = functools.partial(compute, e, row, nt, s)
            pipeline(state, context)(*operands(e, row, nt, s), allocations=allocations)

        # one pipeline over all of this CTA's items (START, STEADY ..., STOP; a lone item a whole pipeline): the
        # next item's weights stream in under this one's last steps and epilogue (no drain between items)
        count = (real_ref[0] * per_visit - cta + ctas - 1) // ctas

        def scoped(allocations):
            @pl.when(count == 1)
            def _():
                run_item(0, None, allocations)

            @pl.when(count > 1)
            def _():
                run_item(0, plgpu.PipelinePipeline.START, allocations)

                @pl.loop(1, count - 1)
                def _(j):
                    run_item(j, plgpu.PipelinePipeline.STEADY, allocations)

                run_item(count - 1, plgpu.PipelinePipeline.STOP, allocations)

        example = operands(*item(jnp.int32(0)))
        pl.run_scoped(
            scoped,
            allocations=pipeline(plgpu.PipelinePipeline.START).get_allocations(*example),
            collective_axes="wg",
        )

    scratch = [plgpu.SMEM((wgs, tm, LANES), out_dtype)]
    if swiglu:
        # one row below for odd starts (see the epilogue), one more to keep each warpgroup's block 128-byte aligned
        scratch.append(plgpu.SMEM((wgs, tm + 2, PAIR_UNITS), out_dtype))
    if tabled:
        scratch.append(plgpu.SMEM((wgs, TABLE_ENTRIES, 4), jnp.uint32))
    if interpret:
        scratch.append(plgpu.SMEM((wgs, LANES, 32), jnp.bfloat16, transforms=_transforms(64, 2)))
    weights = [w.scales, w.global_scale][:weight_operands]
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, rows.shape[0], n // 2 if swiglu else n), out_dtype),
        grid=(ctas,),
        grid_names=("sm",),
        num_threads=wgs + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(tiles.expert, tiles.first_row, tiles.starts, tiles.ends, tiles.real, rows, w.data, *weights)


def grouped_matmul(
    rows: jax.Array, w: GpuWeight, tiles: Tiles, *, swiglu: tuple[float, float] | None = None,
    interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """rows [R, K] laid out by `tiles`, K in `layouts.gpu_k_order` -> [R, N]: each row times its expert's w^T,
    accumulated in fp32 and rounded to the rows' dtype; rows of no expert are left unwritten. With `swiglu`
    (gate_cap, up_cap) and a paired gate_up w: the capped SwiGLU of the products, [R, N / 2] in the hidden units'
    `paired_rows` order (down's K order)."""
    _, n, k = w.shape
    if swiglu and not w.paired:
        raise ValueError("the GPU expert kernel applies the SwiGLU to a gate_up laid out by for_gpu(w, paired=True)")
    splits = _splits(k, _step_k(w.format, k, tiles.tm), tiles.expert.shape[0] * (n // _item_rows(n)))
    if splits == 1:
        return _grouped(rows, w, tiles, splits=1, out_dtype=rows.dtype, swiglu=swiglu, interpret=interpret)[0]
    partial = _grouped(rows, w, tiles, splits=splits, out_dtype=jnp.float32, swiglu=None, interpret=interpret)
    out = round_to(partial.sum(axis=0), rows.dtype)
    if not swiglu:
        return out
    pairs = out.reshape(out.shape[0], -1, 2, PAIR_UNITS)  # [R, I / 32, gate | up, 32]
    return capped_swiglu(pairs[:, :, 0], pairs[:, :, 1], *swiglu).reshape(out.shape[0], n // 2)


def check(x: jax.Array, gate_up: GpuWeight, down: GpuWeight) -> None:
    """Raise ValueError (naming what) unless the kernels take these activations and laid-out experts."""
    check_experts(x, gate_up, down)
    _, two_i, hidden = gate_up.shape
    if not supports(two_i, hidden, gate_up.format):
        raise ValueError(f"the GPU expert kernel needs H ({hidden}) and I ({two_i // 2}) to be multiples of 256")
    if not gate_up.paired or down.paired:
        raise ValueError("the GPU expert kernels take gate_up laid out by for_gpu(w, paired=True), down unpaired")
    plain = [w.data.dtype for w in (gate_up, down) if w.format == PLAIN]
    if x.dtype != jnp.bfloat16 or any(dtype != jnp.bfloat16 for dtype in plain):
        weights = f" and {', '.join(map(str, plain))} weights" if plain else ""
        raise ValueError(
            f"the GPU expert kernel takes bf16 activations (and bf16 plain weights), got {x.dtype}{weights}"
        )


def supports(two_i: int, hidden: int, fmt: str) -> bool:
    """Whether the kernels take experts of gate_up [E, 2I, H] in format `fmt` ("plain" meaning bf16): H and I
    multiples of 256."""
    return hidden % 256 == 0 and (two_i // 2) % 256 == 0 and fmt in (PLAIN, MXFP8, NVFP4)


def moe_experts(
    x: jax.Array, gate_up: GpuWeight, down: GpuWeight, experts: jax.Array, weights: jax.Array, *,
    gate_cap: float, up_cap: float, out_dtype: jnp.dtype | None = None, interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """`reference.moe_experts`'s contract over weights laid out by `layouts.for_gpu` (`interpret`: run the
    kernels in Mosaic GPU's interpreter)."""
    check(x, gate_up, down)
    num_experts, _, hidden = gate_up.shape
    routing = route(experts, weights, num_experts)
    copies = routing.order.shape[0]
    if copies == 0:
        return jnp.zeros((experts.shape[0], hidden), x.dtype if out_dtype is None else out_dtype)
    tiles = tile_copies(routing)
    order = gpu_k_order(gate_up.format, hidden)
    x_in_order = x if order is None else x[:, order]
    if tiles.source is None:
        rows = jnp.pad(x_in_order[routing.token_of], ((0, tiles.rows - copies), (0, 0)))
    else:
        rows = x_in_order[routing.token_of[tiles.source]]
    hidden_rows = grouped_matmul(rows, gate_up, tiles, swiglu=(gate_cap, up_cap), interpret=interpret)
    out_rows = grouped_matmul(hidden_rows, down, tiles, interpret=interpret)
    return combine(out_rows, routing, experts.shape[0], x.dtype if out_dtype is None else out_dtype, tiles.row_of)
