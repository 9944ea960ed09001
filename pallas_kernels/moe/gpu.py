"""Routed experts on Hopper (sm90) through Mosaic GPU: two grouped matmuls over the token copies sorted by
expert, each weight dequantized in registers right before the wgmma that takes it (never in HBM or SMEM).

The copies are cut into tiles of TM rows and walked in (tile, expert) visits, as on TPU (`routing.visits`). A
CTA computes one visit's product for one 128-row tile of the weight's N rows and one share of its K ("swap
AB": the weight rows are wgmma's M side, in registers, the TM copies its N side, from SMEM): out[copies of
the visit, 128 columns]. Three warpgroups: one issues the TMA copies of each K step (the weight tile's bytes,
its scales, the tile's activations) into a ring of SMEM stages; two compute, 64 weight rows each, decoding
every scale block of their rows (32 MXFP8 or 16 NVFP4 values per row) to bf16 and multiplying it with the
activations' matching columns. The epilogue stores the accumulator transposed into SMEM and copies only the
visit's own rows out (a log ladder of TMA boxes, as in jax's ragged_dot_mgpu), so the visits that share a
tile never write each other's rows.

Decode (a few tokens) reads each chosen expert's weight bytes once per column tile; K is split over several
CTAs when there are too few (visit, column tile) pairs to fill the GPU, each writing fp32 partial sums that
XLA adds. Between the two matmuls XLA applies the softcapped SwiGLU; after them it combines the copies
(`routing.combine`).

The values: MXFP8 E4M3 bytes become bf16 by moving their bits (e4m3 * 2^-120, exact, subnormals included)
and a bf16 multiply by 2^(scale - 7) (exact for scale bytes <= 134: `layouts.for_gpu` checks); NVFP4 codes
become fp32 by their bits, times fp32(block scale) * global scale, rounded once to bf16: both the
reference's values bit for bit. (In Mosaic GPU's interpreter, whose XLA:CPU flushes subnormals, the values
are decoded through float conversions instead, and the wgmma takes them from SMEM.)
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import block_formats
from pallas_kernels.moe.layouts import PLAIN, GpuWeight
from pallas_kernels.moe.reference import capped_swiglu
from pallas_kernels.moe.routing import combine, group_offsets, route, visits
from pallas_kernels.quantized import MXFP8, NVFP4

ROWS = 128  # weight rows per CTA: two compute warpgroups of 64 (the wgmma M tile)
LANES = 64
MAX_TM = 64  # copies per tile (wgmma N)
SMS = 132  # H200 multiprocessors
SMEM_BYTES = 200 * 1024  # the ring's budget (of 227 KB), leaving room for the epilogue's staging
MIN_CTAS = 4 * SMS  # K is split until the (visit, column tile) pairs reach this
BLOCK = {PLAIN: 32, MXFP8: block_formats.MX_BLOCK, NVFP4: 64}  # K values per decode (NVFP4: 32 bytes a row)


def _step_k(fmt: str, k: int) -> int:
    """K values per pipeline step: 256 (quantized) or 128 (bf16), i.e. 32 KB of weight per 128 rows."""
    kc = 128 if fmt == PLAIN else 256
    if k % kc:
        raise ValueError(f"the GPU expert kernel needs K ({k}) to be a multiple of {kc}")
    return kc


def _splits(k: int, kc: int, pairs: int) -> int:
    """S: the fewest shares of K (each a multiple of kc) that give at least MIN_CTAS CTAs."""
    steps = k // kc
    return next((s for s in range(1, steps + 1) if steps % s == 0 and pairs * s >= MIN_CTAS), steps)


def _transforms(row_bytes: int, itemsize: int) -> tuple:
    swizzle = min(128, row_bytes)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _across(row: jax.Array, cols: int) -> jax.Array:
    """[64] -> [64, cols]: each row's value in every column, in the wgmma register layout."""
    return plgpu.layout_cast(lax.broadcast_in_dim(row, (row.shape[0], cols), (0,)), plgpu.Layout.WGMMA)


def _mx_values(data: jax.Array, scale: jax.Array, interpret: bool) -> jax.Array:
    """E4M3 bytes [64, 32] (uint8) and their rows' E8M0 bytes [64] -> bf16 values."""
    if interpret:
        values = lax.bitcast_convert_type(data, jnp.float8_e4m3fn).astype(jnp.float32)
        return (values * block_formats.e8m0_value(scale)[:, None]).astype(jnp.bfloat16)
    byte = data.astype(jnp.uint16)
    bits = (byte & 0x80) << 8 | (byte & 0x7F) << 4  # bf16 e4m3 * 2^-120
    factor = lax.bitcast_convert_type((scale.astype(jnp.uint16) + 120) << 7, jnp.bfloat16)  # 2^(scale - 7)
    return lax.bitcast_convert_type(bits, jnp.bfloat16) * _across(factor, data.shape[1])


def _nv_values(data: jax.Array, steps: tuple[jax.Array, jax.Array], high: bool) -> jax.Array:
    """Two 16-value blocks of each row: the low (or high) E2M1 nibbles of bytes [64, 32] (uint8) times their
    rows' fp32 steps [64] (block scale * global scale; the first for columns 0-15), rounded once to bf16."""
    byte = data.astype(jnp.uint32)
    codes = byte >> 4 if high else byte & 0xF
    magnitude, sign = codes & 7, codes >> 3
    mantissa = jnp.where(magnitude >= 2, magnitude & 1, 0)
    bits = jnp.where(magnitude == 0, 0, ((magnitude >> 1) + 126) << 23 | mantissa << 22) | sign << 31
    column = plgpu.broadcasted_iota(jnp.int32, data.shape, 1, layout=plgpu.Layout.WGMMA)
    first, second = (_across(step, data.shape[1]) for step in steps)
    step = jnp.where(column < block_formats.NV_BLOCK, first, second)
    return (lax.bitcast_convert_type(bits, jnp.float32) * step).astype(jnp.bfloat16)


def _e4m3_value(byte: jax.Array) -> jax.Array:
    """fp32 values of E4M3 bytes (uint32; subnormals exact, no float conversion)."""
    exponent, mantissa, sign = (byte >> 3) & 0xF, byte & 7, byte >> 7
    normal = lax.bitcast_convert_type((exponent + 120) << 23 | mantissa << 20 | sign << 31, jnp.float32)
    tiny = mantissa.astype(jnp.float32) * (2.0**-9)
    return jnp.where(exponent == 0, jnp.where(sign == 1, -tiny, tiny), normal)


def _tile(ref) -> jax.Array:
    """A [64, C] SMEM tile in registers, in the layout of wgmma's register operand."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False)


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


def _grouped(
    rows: jax.Array, w: GpuWeight, plan: tuple, *, tm: int, splits: int, out_dtype: jnp.dtype, interpret: bool
) -> jax.Array:
    """rows [Mp, K] x the visits' experts' w [E, N, K] -> [S, Mp, N] (`out_dtype`): each copy's product with
    its own expert, summed over one share of K per leading index."""
    expert, tile, offsets, real = plan
    fmt = w.format
    _, n, k = w.shape
    kc = _step_k(fmt, k)
    steps = k // kc // splits
    blk = BLOCK[fmt]
    data_cols = kc // 2 if fmt == NVFP4 else kc
    data_item = w.data.dtype.itemsize
    scale_rows = kc // (block_formats.NV_BLOCK if fmt == NVFP4 else block_formats.MX_BLOCK)
    stage_bytes = ROWS * data_cols * data_item + tm * kc * 2 + (0 if fmt == PLAIN else scale_rows * ROWS)
    stages = max(2, min(4, SMEM_BYTES // stage_bytes))

    group_bytes = (blk // 2 if fmt == NVFP4 else blk) * data_item  # one decode's columns of a row
    data_spec = plgpu.BlockSpec((ROWS, data_cols), lambda kk: (0, kk), transforms=_transforms(group_bytes, data_item))
    x_spec = plgpu.BlockSpec((tm, kc), lambda kk: (0, kk), transforms=_transforms(64, 2))  # 32-column slices
    specs = [data_spec, x_spec]
    if fmt != PLAIN:
        specs.append(plgpu.BlockSpec((scale_rows, ROWS), lambda kk: (kk, 0)))

    def body(expert_ref, tile_ref, offsets_ref, real_ref, x_gmem, data_gmem, *refs):
        if fmt == NVFP4:
            scales_gmem, global_gmem, out_gmem, out_smem, global_smem, landed, *a_smem = refs
        else:
            scales_gmem = refs[0] if fmt == MXFP8 else None
            out_gmem, out_smem, *a_smem = refs[fmt == MXFP8 :]
        s, nt, v = lax.axis_index("s"), lax.axis_index("n"), lax.axis_index("v")
        wg = lax.axis_index("wg")
        e, t = expert_ref[v], tile_ref[v]
        lanes = pl.ds(pl.multiple_of(wg * LANES, LANES), LANES)
        k_share = pl.ds(pl.multiple_of(s * steps * kc, kc), steps * kc)
        data_share = pl.ds(pl.multiple_of(s * steps * data_cols, data_cols), steps * data_cols)
        n_rows = pl.ds(pl.multiple_of(nt * ROWS, ROWS), ROWS)

        global_scale = None

        def mma(_, data_smem, x_smem, *refs):
            scale_refs, acc_ref = refs[:-1], refs[-1]
            for j in range(kc // blk):
                cols = pl.ds(j * blk, blk)
                if fmt == PLAIN:
                    parts = [(_tile(data_smem.at[lanes, cols]), cols)]
                elif fmt == MXFP8:
                    scale = _row(scale_refs[0].at[j, lanes])
                    parts = [(_mx_values(_tile(data_smem.at[lanes, cols]), scale, interpret), cols)]
                else:
                    data = _tile(data_smem.at[lanes, pl.ds(j * 32, 32)])
                    steps = [
                        _e4m3_value(_row(scale_refs[0].at[4 * j + b, lanes]).astype(jnp.uint32)) * global_scale
                        for b in range(4)
                    ]
                    parts = [
                        (_nv_values(data, steps[2 * h : 2 * h + 2], h == 1), pl.ds(j * blk + 32 * h, 32))
                        for h in range(2)
                    ]
                for values, x_cols in parts:
                    if interpret:  # the interpreter's wgmma takes its A operand from SMEM only
                        a_smem[0].at[wg, :, pl.ds(0, values.shape[1])][...] = values
                        plgpu.commit_smem()
                        values = a_smem[0].at[wg, :, pl.ds(0, values.shape[1])]
                    plgpu.wgmma(acc_ref, values, x_smem.at[:, x_cols].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
            return acc_ref

        def compute(run):
            nonlocal global_scale
            if fmt == NVFP4:  # this warpgroup's rows' global scales, [64] fp32, for every step
                columns = pl.ds(pl.multiple_of(nt * ROWS + wg * LANES, LANES), LANES)
                plgpu.copy_gmem_to_smem(global_gmem.at[e, :, columns], global_smem.at[wg], landed.at[wg])
                plgpu.barrier_wait(landed.at[wg])
                global_scale = _row(global_smem.at[wg, 0])
            acc = pl.run_scoped(lambda acc_ref: run(acc_ref)[...], plgpu.ACC((LANES, tm), jnp.float32))
            # pairs of rows in each thread's registers: adjacent in the transposed view
            acc = plgpu.layout_cast(acc.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            out_smem.at[wg].transpose((1, 0))[...] = acc
            plgpu.commit_smem()
            first = jnp.maximum(offsets_ref[e], t * tm)
            last = jnp.minimum(offsets_ref[e + 1], (t + 1) * tm)
            columns = pl.ds(nt * ROWS + wg * LANES, LANES)
            _store_rows(out_smem.at[wg], out_gmem.at[s, pl.ds(t * tm, tm), columns], first - t * tm, last - first)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            mma, grid=(steps,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=compute,
        )  # fmt: skip
        operands = [
            data_gmem.at[e, n_rows, data_share],
            x_gmem.at[pl.ds(pl.multiple_of(t * tm, 8), tm), k_share],
        ]
        if fmt != PLAIN:
            blocks_share = pl.ds(pl.multiple_of(s * steps * scale_rows, scale_rows), steps * scale_rows)
            operands.append(scales_gmem.at[e, blocks_share, n_rows])

        @pl.when(v < real_ref[0])
        def _():
            pipeline(*operands)

    scratch = [plgpu.SMEM((2, tm, LANES), out_dtype)]
    if fmt == NVFP4:
        scratch += [plgpu.SMEM((2, 1, LANES), jnp.float32), plgpu.Barrier(num_barriers=2)]
    if interpret:
        scratch.append(plgpu.SMEM((2, LANES, 32), jnp.bfloat16, transforms=_transforms(64, 2)))
    weight_operands = [] if fmt == PLAIN else [w.scales] + ([w.global_scale] if fmt == NVFP4 else [])
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, rows.shape[0], n), out_dtype),
        grid=(splits, n // ROWS, expert.shape[0]),
        grid_names=("s", "n", "v"),
        num_threads=3,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(expert, tile, offsets, real, rows, w.data, *weight_operands)


def grouped_matmul(
    rows: jax.Array, w: GpuWeight, offsets: jax.Array, plan: tuple[jax.Array, jax.Array, jax.Array], *, tm: int,
    interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """rows [Mp, K] sorted by expert (expert e's are rows offsets[e] ... offsets[e + 1] - 1) -> [Mp, N]: each row
    times its expert's w^T, accumulated in fp32 and rounded to the rows' dtype; rows of no expert are not
    written. `plan` is `routing.visits(offsets, tm, count)` for tiles of tm rows."""
    expert, tile, real = plan
    _, n, k = w.shape
    splits = _splits(k, _step_k(w.format, k), expert.shape[0] * (n // ROWS))
    dtype = rows.dtype if splits == 1 else jnp.float32
    out = _grouped(rows, w, (expert, tile, offsets, real), tm=tm, splits=splits, out_dtype=dtype, interpret=interpret)
    return out[0] if splits == 1 else out.sum(axis=0).astype(rows.dtype)


def _check(x: jax.Array, gate_up: GpuWeight, down: GpuWeight) -> None:
    experts, two_i, hidden = gate_up.shape
    if down.shape != (experts, hidden, two_i // 2) or x.shape[-1] != hidden:
        raise ValueError(
            f"expert shapes do not match: x [..., {x.shape[-1]}], gate_up {gate_up.shape}, down {down.shape}"
            " (want [E, 2I, H] and [E, H, I])"
        )
    if gate_up.format != down.format:
        raise ValueError(f"gate_up is {gate_up.format} but down is {down.format}")
    if not supports(two_i, hidden, gate_up.format):
        raise ValueError(
            f"the GPU expert kernel needs H ({hidden}) and 2I ({two_i}) to be multiples of {ROWS} and I to be a"
            f" multiple of {_step_k(gate_up.format, 256)}"
        )
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"the GPU expert kernel takes bf16 activations, got {x.dtype}")


def supports(two_i: int, hidden: int, fmt: str) -> bool:
    """Whether the kernels take experts of gate_up [E, 2I, H] in format `fmt`."""
    kc = 128 if fmt == PLAIN else 256
    return hidden % ROWS == 0 and two_i % ROWS == 0 and hidden % kc == 0 and (two_i // 2) % kc == 0


def moe_experts(
    x: jax.Array, gate_up: GpuWeight, down: GpuWeight, experts: jax.Array, weights: jax.Array, *,
    gate_cap: float, up_cap: float, out_dtype: jnp.dtype | None = None, interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """`reference.moe_experts`'s contract over weights laid out by `layouts.for_gpu` (`interpret`: run the
    kernels in Mosaic GPU's interpreter)."""
    _check(x, gate_up, down)
    num_experts, two_i, hidden = gate_up.shape
    routing = route(experts, weights, num_experts)
    copies = routing.order.shape[0]
    if copies == 0:
        return jnp.zeros((experts.shape[0], hidden), x.dtype if out_dtype is None else out_dtype)
    tm = min(MAX_TM, -(-copies // 8) * 8)
    tiles = -(-copies // tm)
    offsets = group_offsets(routing)
    plan = visits(offsets, tm, tiles + min(num_experts, copies) - 1)

    rows = jnp.pad(x[routing.token_of], ((0, tiles * tm - copies), (0, 0)))
    gate_up_rows = grouped_matmul(rows, gate_up, offsets, plan, tm=tm, interpret=interpret)
    hidden_rows = capped_swiglu(gate_up_rows[:, : two_i // 2], gate_up_rows[:, two_i // 2 :], gate_cap, up_cap)
    out_rows = grouped_matmul(hidden_rows, down, offsets, plan, tm=tm, interpret=interpret)
    return combine(out_rows[:copies], routing, experts.shape[0], x.dtype if out_dtype is None else out_dtype)
