"""The work of the Mosaic GPU expert kernel (`gpu`): how a grouped matmul's weight rows (N) are cut into work items over
the CTAs (each item sums the whole K, in one order whatever the call's size), the ring of SMEM stages an item streams
through, the pipeline step that decodes a compute warpgroup's 64 weight rows and multiplies them with the activations
(wgmma, "swap AB": the weights are its M side, in registers; the activation rows its N side, from SMEM), and the
chain of items one CTA walks through one pipeline (one per visit width)."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import block_formats, devices
from pallas_kernels.moe.gpu_decode import (
    LANES,
    across,
    e2m1_by_table,
    joined,
    mx_values,
    nv_entries,
    nv_step_table,
    nv_values,
)
from pallas_kernels.moe.layouts import PAIR_UNITS, PLAIN, GpuWeight
from pallas_kernels.moe.reference import capped_swiglu_f32
from pallas_kernels.quantized import MXFP8, NVFP4

COMPUTE_WGS = (3, 2)  # compute warpgroups per CTA, the most that divide N's tiles of 64 rows (3 is faster than 2 at
# a decode's few tokens, more warps hiding the decode's latencies; a CTA of 4 compute warpgroups hangs)
SHARED_TM = (8, 32)  # decode: the fewest and most rows of a shared tile (a multiple of 8 between: twice the mean group,
# below the device's `own_windows_from` copies per expert)
BLOCK = {PLAIN: 32, MXFP8: block_formats.MX_BLOCK, NVFP4: 64}  # K values per decode (quantized: 32 bytes a row)
VALUES_PER_ITEM = {PLAIN: 1, MXFP8: 4, NVFP4: 8}  # K values per item of GpuWeight.data (bf16, or uint32 words)


def item_rows(n: int) -> int:
    """Weight rows per work item for N rows: 64 per compute warpgroup (the wgmma M tile), as many warpgroups of
    COMPUTE_WGS as divide N."""
    return next(wgs * LANES for wgs in COMPUTE_WGS if n % (wgs * LANES) == 0)


def step_k(fmt: str, k: int, tm: int) -> int:
    """K values per pipeline step: 256 for quantized weights in shared tiles, else 128 (a stage's weight and
    activation tiles of 8-64 KB each)."""
    kc = 256 if fmt != PLAIN and tm <= SHARED_TM[1] else 128
    if k % kc:
        raise ValueError(f"the GPU expert kernel needs K ({k}) to be a multiple of {kc}")
    return kc


def ring(w: GpuWeight, tm: int, kc: int, staging: int) -> tuple[int, int, int]:
    """(K per step, steps, stages) of the SMEM ring an item of w streams through: steps of `kc`, halved to 128
    where no ring of 2-4 stages that fits beside `staging` bytes of SMEM (the epilogue's, NVFP4's tables) divides
    K's steps (the items' pipelines chain on whole rings; at 128, fewer stages, down to one, if no more fit or
    divide them). A stage holds the CTA's weight rows' bytes and scales of one step and the
    activations' [tm, step]. Raises ValueError where not even one stage of 128 fits."""
    fmt = w.format
    _, n, k = w.shape
    cta_rows, smem_bytes = item_rows(n), devices.gpu().smem_bytes
    for step in dict.fromkeys((kc, 128)):
        steps = k // step
        scale_bytes = 0 if fmt == PLAIN else step // BLOCK[fmt] * cta_rows * w.scales.dtype.itemsize
        scale_bytes += cta_rows * 4 if fmt == NVFP4 else 0  # the global scales, fp32
        weight_bytes = cta_rows * step // VALUES_PER_ITEM[fmt] * w.data.dtype.itemsize
        stage_bytes = weight_bytes + tm * step * 2 + scale_bytes
        fits = min(4, (smem_bytes - staging - 1024) // stage_bytes)
        stages = max((d for d in range(1, fits + 1) if steps % d == 0), default=0)
        if stages > 1:
            break
    if not stages:
        raise ValueError(
            f"the GPU expert kernel's pipeline stage ({stage_bytes} bytes: {cta_rows} weight rows, {tm} activation"
            f" rows, K step {step}) does not fit the {smem_bytes}-byte SMEM beside {staging} other bytes"
        )
    return step, steps, stages


def _transforms(row_bytes: int, itemsize: int) -> tuple:
    swizzle = min(128, row_bytes)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


WGMMA_K = 64  # K values per wgmma: an activation tile's 128-byte swizzled rows (rows of 64 bytes, a wgmma per
# 32 columns stream slower beside the weights: TMA moves fewer bytes per row it reads)
X_TRANSFORMS = _transforms(2 * WGMMA_K, 2)  # an activation tile's: WGMMA_K-column slices, one wgmma's K each


def _load_bytes(fmt: str, kc: int, data_item: int) -> int:
    """A row's bytes per SMEM load: one block's 64 bytes of bf16, or up to four 32-byte runs of words (swizzled by
    128 bytes: the TMA copies of rows narrower than that cap the weights' streaming rate)."""
    return BLOCK[fmt] * 2 if fmt == PLAIN else min(128, kc // VALUES_PER_ITEM[fmt] * data_item)


def weight_transforms(fmt: str, kc: int, data_item: int) -> tuple:
    """The SMEM tiling and swizzle of a stage's weight rows (`kc` K values of `data_item`-byte items each)."""
    return _transforms(_load_bytes(fmt, kc, data_item), data_item)


def stage_specs(w: GpuWeight, kc: int, tm: int) -> list:
    """BlockSpecs of one pipeline step of an item: the CTA's weight rows' data over `kc` K values, the activations
    [tm, kc], the rows' block scales, NVFP4's global scales (again in every stage: kk * 0, a per-step copy,
    multi-buffered)."""
    fmt = w.format
    cta_rows = item_rows(w.shape[1])
    data_cols = kc // VALUES_PER_ITEM[fmt]
    data_transforms = weight_transforms(fmt, kc, w.data.dtype.itemsize)
    specs = [plgpu.BlockSpec((cta_rows, data_cols), lambda kk: (0, kk), transforms=data_transforms)]
    specs.append(plgpu.BlockSpec((tm, kc), lambda kk: (0, kk), transforms=X_TRANSFORMS))
    if fmt != PLAIN:
        specs.append(plgpu.BlockSpec((kc // BLOCK[fmt], cta_rows), lambda kk: (kk, 0)))
    if fmt == NVFP4:
        specs.append(plgpu.BlockSpec((1, cta_rows), lambda kk: (kk * 0, 0)))
    return specs


def weight_blocks(w: GpuWeight, refs: tuple, e: jax.Array, nt: jax.Array, activations) -> list:
    """An item's GMEM operands, in `stage_specs`' order: expert e's column tile nt of w (`refs`: its data,
    scales and global scales in GMEM) over the whole K, the `activations` (the item's rows), the tile's block
    scales and global scales."""
    fmt = w.format
    data_gmem, scales_gmem, global_gmem = refs
    cta_rows = item_rows(w.shape[1])
    n_rows = pl.ds(pl.multiple_of(nt * cta_rows, cta_rows), cta_rows)

    blocks = [data_gmem.at[e, n_rows, :], activations]
    if fmt != PLAIN:
        blocks.append(scales_gmem.at[e, :, n_rows])
    if fmt == NVFP4:
        blocks.append(global_gmem.at[e, :, n_rows])
    return blocks


def paired_swiglu(products, staged, caps: tuple[float, float]) -> None:
    """A warpgroup's products [tm, 32 gate | 32 up] (SMEM, rounded to the activations' dtype) -> the capped SwiGLU
    of its 32 hidden units into `staged` [tm, 32] SMEM."""
    gate, up = (products.at[:, pl.ds(i * PAIR_UNITS, PAIR_UNITS)][...] for i in (0, 1))
    staged[...] = capped_swiglu_f32(gate, up, *caps).astype(staged.dtype)
    plgpu.commit_smem()


def _tile(ref) -> jax.Array:
    """A [64, C] SMEM tile in registers, in the layout of wgmma's register operand."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA)


def _row(ref) -> jax.Array:
    """A [64] SMEM vector in registers, one value per row of a `_tile`."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def multiply_step(fmt: str, kc: int, data_item: int, wg: jax.Array, tables, a_smem, interpret: bool):
    """The pipeline step of compute warpgroup `wg`: mma(step, data_smem, x_smem [tm, kc], scale_refs, acc_ref)
    decodes its 64 rows of the stage's weights block by block into wgmma's register operand, WGMMA_K columns (two
    blocks of 32) right before the wgmma that multiplies them with the activations' matching columns (the next two
    decode under that wgmma).
    NVFP4 on the GPU (`tables`: [wgs, TABLE_ENTRIES, 4] SMEM) looks its codes up in a table per scale byte, built
    at an item's first step; in the interpreter (`a_smem`: [wgs, 64, WGMMA_K] bf16) values are decoded by float
    conversions and the wgmma takes them from SMEM."""
    if kc % WGMMA_K:
        raise ValueError(f"a pipeline step's K ({kc}) is no multiple of a wgmma's ({WGMMA_K})")
    blk = BLOCK[fmt]
    load_items = _load_bytes(fmt, kc, data_item) // data_item
    runs = load_items * data_item // 32
    lanes = pl.ds(pl.multiple_of(wg * LANES, LANES), LANES)

    def mma(step, data_smem, x_smem, scale_refs, acc_ref):
        global_scale = None
        if fmt == NVFP4 and interpret:  # this warpgroup's rows' global scales, [64] fp32
            global_scale = _row(scale_refs[1].at[0, lanes])
        if fmt != PLAIN:  # the rows' scales of each block ([64]: MXFP8 E8M0 bytes, NVFP4 four E4M3 in a word)
            scales = [_row(scale_refs[0].at[j, lanes]) for j in range(kc // blk)]
        if tables is not None:  # at an item's first step: its expert's table (after the last item's epilogue)
            table = tables.at[wg]

            @pl.when(step == 0)
            def _():
                nv_step_table()(across(_row(scale_refs[1].at[0, lanes]), 8), table)

            entries = [nv_entries()(across(scale, 8), table) for scale in scales]  # up front
        pending = []  # a block of 32 columns waiting for the next: a wgmma takes WGMMA_K
        for j in range(kc // blk):
            cols = pl.ds(j * blk, blk)
            if fmt == PLAIN:
                parts = [_tile(data_smem.at[lanes, cols])]
            else:
                load, run = divmod(j, runs)
                if run == 0:
                    words = _tile(data_smem.at[lanes, pl.ds(load * load_items, load_items)])
            if fmt == MXFP8:
                parts = [mx_values(words, run, scales[j], interpret)]
            elif fmt == NVFP4:
                parts = list(
                    nv_values(words, run, scales[j], global_scale)
                    if interpret
                    else e2m1_by_table(run)(words, entries[j])
                )
            pending += parts
            if len(pending) * 32 < WGMMA_K:
                continue
            values, pending = joined(*pending, interpret), []
            if interpret:  # the interpreter's wgmma takes its A operand from SMEM only
                a_smem.at[wg][...] = values
                plgpu.commit_smem()
                values = a_smem.at[wg]
            x_cols = pl.ds((j + 1) * blk - WGMMA_K, WGMMA_K)
            plgpu.wgmma(acc_ref, values, x_smem.at[:, x_cols].transpose((1, 0)))
            plgpu.wgmma_wait(0 if interpret else 1)  # the next blocks decode under this one's wgmma
        plgpu.wgmma_wait(0)  # the stage is read before the pipeline releases it
        return acc_ref

    return mma


def accumulate(run, tm: int) -> jax.Array:
    """An item's products [64, tm] in fp32: the pipeline's steps (`run`, a compute context's) over one
    accumulator."""
    return pl.run_scoped(lambda acc_ref: run(acc_ref)[...], plgpu.ACC((LANES, tm), jnp.float32))


def chain(run_item, start: jax.Array | int, stop: jax.Array) -> None:
    """Items start ... stop - 1 (`run_item(j, pipeline_state)`) through one pipeline (START, STEADY ..., STOP; a
    lone item a whole pipeline): the next item's weights stream in under this one's last steps and epilogue (a
    pipeline per item would drain at every item's end, idling the memory system)."""

    @pl.when(stop - start == 1)
    def _():
        run_item(start, None)

    @pl.when(stop - start > 1)
    def _():
        run_item(start, plgpu.PipelinePipeline.START)

        @pl.loop(start + 1, stop - 1)
        def _(j):
            run_item(j, plgpu.PipelinePipeline.STEADY)

        run_item(stop - 1, plgpu.PipelinePipeline.STOP)


def store_rows(tile_smem, tile_gmem, start: jax.Array, size: jax.Array) -> None:
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
