"""Routed experts on Hopper (sm90) through Mosaic GPU: two grouped matmuls over the token copies (sorted by expert, or
up to 8 tokens each chosen expert's), each weight decoded in registers right before the wgmma that takes it (never in
HBM or SMEM).

The copies are walked in visits of a few rows each (`Tiles`: 8 ... 112), every visit one expert's. A work item is one
visit's product for one tile of 128 or 192 weight rows (N) over the whole K ("swap AB": the weight rows are wgmma's M
side, in registers; the visit's copies its N side, from SMEM). One CTA per multiprocessor walks its items (cta, cta +
CTAs, ...) through one software pipeline per visit width: the next item's first stages stream in under the last steps
and the epilogue of the one before (a CTA per item would drain its pipeline at every item's end, idling the memory
system). One warpgroup issues the TMA copies of each K step (the weight tile's bytes, its block scales, the tile's
activations) into a ring of SMEM stages; three compute (two where N is no multiple of 192), 64 weight rows each,
decoding each run of their rows (32 MXFP8 values, one scale block, or 64 NVFP4, four) to bf16 and multiplying 64 K
values at a time with the activations' matching columns (128-byte swizzled) while the next 64 decode. The epilogue
stores the accumulator transposed into SMEM and copies only the visit's own rows out (a log ladder of TMA boxes, as in
jax's ragged_dot_mgpu), so visits that share rows never write each other's.

Up to 8 tokens (`chosen_experts`): one visit per distinct chosen expert, multiplying every token (8 rows, wgmma's
narrowest N side) into rows of its own: no sort, no row gather, three small reductions for the plan. The same plan
up to 64 tokens where the routing is dense (`visits_every_token`: each expert expected to be chosen by at least half
of them, as 16 experts top-8 are): each chosen expert's bytes read once, against about twice in shared tiles, for at
most twice the rows its copies fill, and none of the sort's kernels. Decode of more tokens: the copies share tiles
of TM rows (TM twice the mean group, 8 ... 32: about one tile per chosen expert, so each wgmma's N side is no wider
than the groups need), each chosen expert's bytes read once per column tile. Prefill: each expert's copies are
visited in windows of their own (no row multiplied twice), each in the narrowest of a few widths (64 ... 112 rows,
those a group of the call's tokens can need) that holds it: one pipeline per width in each CTA, the items of all
widths dealt round the CTAs in turn. The gate_up kernel applies the softcapped SwiGLU in its epilogue (its rows
laid out in pairs, `layouts.paired_rows`: a warpgroup's 64 rows are 32 hidden units' gate and up rows). After the
matmuls XLA combines the copies (`routing.combine`, `routing.weighted_sum`).

Every work item sums its whole K, in the same order in every plan: a token's products are the same bits whatever
else the call holds (batch invariance; K split over CTAs where the items fell unevenly on them gave a token's row
other bits at some token counts, and the decode calls measured no slower without it: bench/results at 3bff46a).

The weights are decoded to bf16 wgmma register operands by `gpu_decode`, the oracle's values bit for bit."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import devices
from pallas_kernels.moe import gpu_work as work
from pallas_kernels.moe.gpu_decode import LANES, TABLE_ENTRIES
from pallas_kernels.moe.gpu_work import SHARED_TM
from pallas_kernels.moe.layouts import (
    PAIR_UNITS,
    PLAIN,
    GpuWeight,
    check_experts,
    in_gpu_k_order,
    layers_as_one,
    rows_in_gpu_k_order,
)
from pallas_kernels.moe.routing import (
    Routing,
    combine,
    composed_indices,
    group_of,
    group_offsets,
    kept_copies,
    placed_copies,
    prefix_sum,
    route,
    visits,
    weighted_sum,
)
from pallas_kernels.platform import ask_ptxas_once
from pallas_kernels.quantized import MXFP8, NVFP4

ask_ptxas_once()

EVERY_TOKEN_TM = 64  # the most tokens a visit of `chosen_experts` multiplies (dense routing)
OWN_TMS = (64, 80, 96, 112)  # prefill: the widths (rows) of the windows of an expert's own, each window the narrowest
# that holds its copies (at 4096 tokens the groups average 85 copies: one width of 96, two windows for groups past
# it, multiplied 41K rows; these, 36K); 112 the widest where the quantized formats keep rings of 3 SMEM stages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tiles:
    """Where the copies sit in the kernels' rows, and the visits over them: visit v multiplies rows first_row[v] ...
    first_row[v] + width - 1 (starting at a multiple of 8: TMA reads GMEM rows in tiles of 8; width its class's,
    one of `widths`) by expert[v]'s weights and writes back rows writes_from[v] ... writes_to[v] - 1 of them (with
    `reads_tokens`: multiplies the token rows 0 ... width - 1 and writes all of its rows v * width ...;
    `chosen_experts`).

    Shared tiles (decode, one width): the rows are the sorted copies, groups follow each other and several share a
    tile (`routing.visits`: one visit per (tile, expert) pair that meet). Own windows (prefill): each expert's group
    starts at a multiple of 8 rows and is cut into windows of at most the widest width, near equal in whole tiles
    of 8; each window is visited once, in the narrowest width that holds it (rows past it, multiplied and not
    written back, belong to the next window or group): no row is written twice, each expert's weights are read once
    per window, few rows are multiplied for nothing, and the rows (what XLA gathers before the kernels) exceed the
    copies by at most 7 per expert, 7 more and a window. The visits come in width order: class c's are visits
    real[c - 1] ... real[c] - 1 (real[-1] meaning 0)."""

    expert: jax.Array  # [V] int32: each visit's expert (padding visits, never run, name a valid one)
    first_row: jax.Array | None  # [V] int32: each visit's first row, a multiple of 8 (shared tiles: of the width;
    # None: v * width, which the kernel computes, where XLA would launch a kernel for the constant)
    writes_from: jax.Array | None  # [V] int32: the first row each visit writes (None: every visit writes its rows)
    writes_to: jax.Array | None  # [V] int32: one past its last
    real: jax.Array  # [>= C] int32: one past each width's last real visit (one width: the real visits' count)
    source: jax.Array | None  # [R] int32: the sorted copy in each row (None: the rows are the sorted copies)
    row_of: jax.Array | None  # [N * k] int32: the row of each sorted copy (None: the same)
    widths: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # C ascending visit widths (rows)
    rows: int = dataclasses.field(metadata={"static": True})  # R: every visit's window within them
    reads_tokens: bool = dataclasses.field(default=False, metadata={"static": True})  # every visit reads rows 0 ...
    # width - 1 (the tokens), not the rows it writes

    @property
    def tm(self) -> int:
        """The widest visit's rows."""
        return self.widths[-1]


def shared_rows(copies: int, num_experts: int) -> int:
    """tm of the decode's shared tiles: twice the mean group (copies / experts) in whole tiles of 8 rows, within
    SHARED_TM."""
    low, high = SHARED_TM
    return min(high, max(low, -(-2 * copies // (8 * num_experts)) * 8))


def tile_copies(routing: Routing, distinct_ids: bool = False) -> Tiles:
    """The kernels' rows for the copies `routing` sorted (shared tiles below the device's `own_windows_from` copies
    expected per expert, own windows from there; shared tiles sized by all the copies, foreign ones included: sized
    for the expected ones under expert parallelism they made more visits, 137 against 96 at 1024 tokens on one
    shard of four). `distinct_ids`: no token names an expert twice, so a group holds at most one copy of each token."""
    group_sizes, copies = routing.group_sizes, routing.order.shape[0]
    num_experts = group_sizes.shape[0]
    offsets = group_offsets(routing)
    if routing.expected < devices.gpu().own_windows_from * num_experts:
        tm = shared_rows(copies, num_experts)
        tiles = -(-copies // tm)
        expert, tile, real = visits(offsets, tm, tiles + min(num_experts, copies) - 1)
        row = tile * tm
        writes_from, writes_to = jnp.maximum(offsets[expert], row), jnp.minimum(offsets[expert + 1], row + tm)
        return Tiles(expert, row, writes_from, writes_to, real, None, None, (tm,), tiles * tm)
    largest = copies // routing.top_k if distinct_ids else copies  # a group's copies, at most
    widths = own_widths(largest)
    widest = widths[-1]
    # windows, at most: one a group where every group fits the widest
    count = min(num_experts, copies) + (-(-copies // widest) if largest > widest else 0)
    padded = -(-group_sizes // 8) * 8
    starts = prefix_sum(padded) - padded
    rows = -(-(copies + 7 * min(num_experts, copies)) // 8) * 8 + widest  # the groups padded to 8, the last window
    per_expert = -(-group_sizes // widest)  # windows
    window_copies = -(-group_sizes // jnp.maximum(per_expert, 1))
    window_rows = -(-window_copies // 8) * 8  # near equal, in whole tiles of 8
    window_ends = prefix_sum(per_expert)
    real = window_ends[-1]
    v = jnp.arange(count, dtype=jnp.int32)
    visit = jnp.minimum(v, jnp.maximum(real - 1, 0))  # padding visits repeat the last real one
    expert = jnp.minimum(group_of(window_ends, visit), num_experts - 1)
    first_copy = (visit - window_ends[expert] + per_expert[expert]) * window_rows[expert]  # within the group
    width = jnp.minimum(window_rows[expert], group_sizes[expert] - first_copy)
    classes = jnp.asarray(widths, jnp.int32)
    width_class = jnp.where(v < real, jnp.sum(width[:, None] > classes[None, :], axis=1), len(widths))
    order = jnp.argsort(width_class, stable=True)  # by width, padding visits last
    expert, first_row = expert[order], (starts[expert] + first_copy)[order]
    class_ends = jnp.sum(width_class[None, :] <= jnp.arange(len(widths))[:, None], axis=1, dtype=jnp.int32)
    row_of, source = placed_copies(routing, starts, rows)
    writes_to = first_row + width[order]
    return Tiles(expert, first_row, first_row, writes_to, class_ends, source, row_of, widths, rows)


def own_widths(largest_group: int) -> tuple[int, ...]:
    """The widths of OWN_TMS a window of a group of at most `largest_group` copies can need: each width is one more
    pipeline in the kernel to lower and build."""
    fits = [width for width in OWN_TMS if width >= largest_group]
    return tuple(width for width in OWN_TMS if width < largest_group) + tuple(fits[:1])


def visits_every_token(tokens: int, top_k: int, num_experts: int, routed_experts: int | None = None) -> bool:
    """Whether the call's plan is `chosen_experts` (each chosen expert's visit multiplies every token): at most
    SHARED_TM[0] tokens (wgmma's narrowest N side, what a shared tile of their copies costs), or at most
    EVERY_TOKEN_TM where a token chooses each of the `routed_experts` (default `num_experts`) with a chance of at
    least one half, so that a visit multiplies at most twice the rows its expert's copies fill."""
    if tokens <= SHARED_TM[0]:
        return True
    return tokens <= EVERY_TOKEN_TM and 2 * top_k >= (routed_experts or num_experts)


def chosen_experts(experts: jax.Array, num_experts: int, first: jax.Array | int = 0) -> tuple[Tiles, jax.Array]:
    """The plan of `visits_every_token`: one visit per distinct chosen expert (in id order), each multiplying
    every token (rows 0 ... tm - 1: the tokens, then zeros; tm the tokens in whole tiles of 8, wgmma's N side)
    and writing rows v * tm ... v * tm + tm - 1 of its own. There is nothing to sort or gather; three small
    reductions over the experts make the plan (which are chosen, each one's visit, each visit's expert; over pairs
    of copies they cost [N * k, N * k] comparisons, which XLA split into twice the kernels at 64 tokens). `first`:
    the weights' index of expert 0 (a layer's first expert in stacked layers' weights), added to the visits' experts
    inside the last reduction rather than by a kernel of its own. Also each copy's visit, [N, k] int32 (meaningless
    for a dropped copy): copy (n, j)'s product is row visit * tm + n."""
    tokens, top_k = experts.shape
    tm, count = -(-tokens // 8) * 8, min(num_experts, tokens * top_k)
    flat = experts.reshape(-1)
    ids = jnp.arange(num_experts, dtype=flat.dtype)
    chosen = jnp.any(flat[None, :] == ids[:, None], axis=1)  # [E]; a dropped id names none
    # each expert's visit: the chosen experts below it; a sentinel id past them all (row 0) counts them
    ends = jnp.concatenate([jnp.full(1, num_experts, flat.dtype), ids])
    below = jnp.sum(chosen[None, :] & (ids[None, :] < ends[:, None]), axis=1, dtype=jnp.int32)  # [1 + E]
    # an array of its own: fused into the combine's gather of the rows, it would be recomputed for every value read
    visit = composed_indices(below[1:], jnp.clip(flat, 0, num_experts - 1))
    takes = chosen[None, :] & (below[None, 1:] == jnp.arange(count)[:, None])  # [count, E]
    expert = jnp.sum(jnp.where(takes, ids[None, :] + first, 0), axis=1, dtype=jnp.int32)  # padding: expert 0
    tiles = Tiles(expert, None, None, None, below, None, None, (tm,), count * tm, reads_tokens=True)
    return tiles, visit.reshape(tokens, top_k)


def _grouped(
    rows: jax.Array, w: GpuWeight, tiles: Tiles, *, step_k: int, swiglu: tuple[float, float] | None, interpret: bool
) -> jax.Array:
    """rows [R', K] (those the visits read) x the visits' experts' w [E, N, K] -> [R, N] (the rows' dtype, R the
    tiles' rows): each row's product with its own expert, summed over K in pipeline steps of `step_k` (of 128 where
    no ring of stages fits SMEM and divides those: `gpu_work.ring`); with `swiglu` (caps; a paired w) the capped
    SwiGLU of each warpgroup's 32 gate and 32 up columns instead, [R, N / 2]."""
    out_dtype = rows.dtype
    tm = tiles.tm  # the widest visit: the epilogue's staging holds its rows
    fmt = w.format
    n = w.shape[1]
    cta_rows = work.item_rows(n)
    wgs = cta_rows // LANES
    epilogue_values = tm * LANES + ((tm + 2) * PAIR_UNITS if swiglu else 0)  # [tm, 64] products, the SwiGLU's rows
    tabled = fmt == NVFP4 and not interpret  # a table per warpgroup of each block scale byte's magnitudes
    staging = wgs * (epilogue_values * jnp.dtype(out_dtype).itemsize + (LANES * work.WGMMA_K * 2 if interpret else 0))
    staging += wgs * TABLE_ENTRIES * 16 if tabled else 0
    rings = [work.ring(w, width, step_k, staging) for width in tiles.widths]  # (kc, steps, stages) each
    n_tiles = n // cta_rows  # work items per visit: its column tiles
    weight_operands = {PLAIN: 0, MXFP8: 1, NVFP4: 2}[fmt]  # the weight's scales, global scales
    visit_bound = tiles.expert.shape[0]
    ctas = min(devices.gpu().multiprocessors, n_tiles * visit_bound)

    whole = tiles.writes_from is None  # every visit writes all its rows
    strided = tiles.first_row is None  # visit v's rows start at v * width

    def body(expert_ref, *refs):
        first_row_ref, real_ref, *refs = (None, *refs) if strided else refs
        from_ref, to_ref, x_gmem, data_gmem, *refs = (None, None, *refs) if whole else refs
        scales_gmem, global_gmem = (*refs[:weight_operands], None, None)[:2]
        out_gmem, out_smem, *a_smem = refs[weight_operands:]
        hidden_smem = a_smem.pop(0) if swiglu else None
        table_smem = a_smem.pop(0) if tabled else None
        wg, cta = lax.axis_index("wg"), lax.axis_index("sm")

        def run_width(c: int, width: int) -> None:
            """This CTA's items of the visits of width c through one pipeline: the items of all widths in turn are
            dealt round the CTAs (cta, cta + ctas, ...), so that no CTA runs more than one item above another."""
            kc, steps, stages = rings[c]
            specs = work.stage_specs(w, kc, width)
            step_mma = work.multiply_step(
                fmt, kc, w.data.dtype.itemsize, wg, table_smem, (a_smem or [None])[0], interpret
            )
            first_item = 0 if c == 0 else real_ref[c - 1] * n_tiles
            mine = first_item + (cta - first_item % ctas + ctas) % ctas  # this CTA's first item of the width

            def item(j: jax.Array) -> tuple[jax.Array, ...]:
                """This CTA's work item j of the width: its expert, first row read, rows written [first, last) and
                column tile."""
                v, nt = jnp.divmod(mine + ctas * j, n_tiles)
                v = jnp.minimum(v, visit_bound - 1)  # past the visits only where the CTA has no item of the width
                row = v * width if strided else first_row_ref[v]
                first, last = (row, row + width) if whole else (from_ref[v], to_ref[v])
                return expert_ref[v], 0 if tiles.reads_tokens else row, row, first, last, nt

            def operands(e, read, row, first, last, nt) -> list:
                x_rows = x_gmem.at[pl.ds(pl.multiple_of(read, 8), width), :]
                return work.weight_blocks(w, (data_gmem, scales_gmem, global_gmem), e, nt, x_rows)

            def mma(indices, data_smem, x_smem, *refs):
                return step_mma(indices[0], data_smem, x_smem, refs[:-1], refs[-1])

            def compute(_expert, _read, row, first, last, nt, run):
                acc = work.accumulate(run, width)
                # pairs of rows in each thread's registers: adjacent in the transposed view
                acc = plgpu.layout_cast(acc.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
                products = out_smem.at[wg, pl.ds(0, width)]
                products.transpose((1, 0))[...] = acc
                plgpu.commit_smem()
                if swiglu:  # [width, 32 gate | 32 up] -> [width, 32] hidden units nt * wgs + wg's block
                    # TMA copies SMEM from 128-byte aligned addresses: the 64-byte hidden rows go one row down where
                    # the first row to write back is odd, so that every box of the ladder starts at an even row
                    staged = hidden_smem.at[wg, pl.ds((first - row) % 2, width)]
                    work.paired_swiglu(products, staged, swiglu)
                    columns = pl.ds((nt * wgs + wg) * PAIR_UNITS, PAIR_UNITS)
                else:
                    staged, columns = products, pl.ds(nt * cta_rows + wg * LANES, LANES)
                work.store_rows(staged, out_gmem.at[pl.ds(row, width), columns], first - row, last - first)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            def pipeline(state, context=None):
                return plgpu.emit_pipeline_warp_specialized(
                    mma,
                    grid=(steps,),
                    memory_registers=40,
                    in_specs=specs,
                    wg_axis="wg",
                    num_compute_wgs=wgs,
                    max_concurrent_steps=stages,
                    compute_context=context,
                    pipeline_state=state,
                )

            def run_item(j, state, allocations):
                where = item(j)
                pipeline(state, functools.partial(compute, *where))(*operands(*where), allocations=allocations)

            count = (real_ref[c] * n_tiles - mine + ctas - 1) // ctas
            pl.run_scoped(
                lambda allocations: work.chain(functools.partial(run_item, allocations=allocations), 0, count),
                allocations=pipeline(plgpu.PipelinePipeline.START).get_allocations(*operands(*item(jnp.int32(0)))),
                collective_axes="wg",
            )

        for c, width in enumerate(tiles.widths):  # one pipeline per width, over the same SMEM
            run_width(c, width)

    scratch = [plgpu.SMEM((wgs, tm, LANES), out_dtype)]
    if swiglu:
        # one row below for odd starts (see the epilogue), one more to keep each warpgroup's block 128-byte aligned
        scratch.append(plgpu.SMEM((wgs, tm + 2, PAIR_UNITS), out_dtype))
    if tabled:
        scratch.append(plgpu.SMEM((wgs, TABLE_ENTRIES, 4), jnp.uint32))
    if interpret:
        scratch.append(plgpu.SMEM((wgs, LANES, work.WGMMA_K), jnp.bfloat16, transforms=work.X_TRANSFORMS))
    weights = [w.scales, w.global_scale][:weight_operands]
    plan = [tiles.expert, *([] if strided else [tiles.first_row]), tiles.real]
    plan += [] if whole else [tiles.writes_from, tiles.writes_to]
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tiles.rows, n // 2 if swiglu else n), out_dtype),
        grid=(ctas,),
        grid_names=("sm",),
        num_threads=wgs + 1,
        thread_name="wg",
        kernel_name=f"experts_{fmt}_{'swiglu' if swiglu else 'matmul'}",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*plan, rows, w.data, *weights)


def grouped_matmul(
    rows: jax.Array,
    w: GpuWeight,
    tiles: Tiles,
    *,
    swiglu: tuple[float, float] | None = None,
    interpret: bool = False,
) -> jax.Array:
    """rows [R, K] laid out by `tiles` (with `reads_tokens`: the tokens [<= tm, K]), K in `layouts.gpu_k_order` ->
    [R, N] (R = tiles.rows): each row times its expert's w^T, accumulated in fp32 over the whole K in one order
    (whatever the call's size: a token's row is the same bits beside any other tokens) and rounded to the rows'
    dtype; rows of no expert are left unwritten. With `swiglu` (gate_cap, up_cap) and a paired gate_up w: the
    capped SwiGLU of the products, [R, N / 2] in the hidden units' `paired_rows` order (down's K order)."""
    if swiglu and not w.paired:
        raise ValueError("the GPU expert kernel applies the SwiGLU to a gate_up laid out by for_gpu(w, paired=True)")
    step_k = work.step_k(w.format, w.shape[2], tiles.tm)
    return _grouped(rows, w, tiles, step_k=step_k, swiglu=swiglu, interpret=interpret)


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


def _every_token(
    x: jax.Array,
    gate_up: GpuWeight,
    down: GpuWeight,
    experts: jax.Array,
    weights: jax.Array,
    *,
    caps: tuple[float, float],
    out_dtype: jnp.dtype,
    num_experts: int,
    first: jax.Array | int,
    interpret: bool = False,
) -> jax.Array:
    """The tokens (x in gate_up's `layouts.gpu_k_order`, checked by `check`), at least one expert each, by
    `chosen_experts`, in two kernels; the ids name experts first ... first + num_experts - 1 of the weights."""
    tiles, visit = chosen_experts(experts, num_experts, first)
    # the token rows as they are: TMA reads the tile's rows past them as zeros (no padded copy)
    hidden_rows = grouped_matmul(x, gate_up, tiles, swiglu=caps, interpret=interpret)
    written = dataclasses.replace(tiles, reads_tokens=False)  # down reads the rows gate_up wrote
    out_rows = grouped_matmul(hidden_rows, down, written, interpret=interpret)
    token_rows = out_rows[visit * tiles.tm + jnp.arange(experts.shape[0])[:, None]]  # [N, k, H]
    return weighted_sum(token_rows, weights, kept_copies(experts, num_experts), out_dtype)


def moe_experts(
    x: jax.Array,
    gate_up: GpuWeight,
    down: GpuWeight,
    experts: jax.Array,
    weights: jax.Array,
    *,
    gate_cap: float,
    up_cap: float,
    out_dtype: jnp.dtype | None = None,
    routed_experts: int | None = None,
    layer: jax.Array | int | None = None,
    distinct_ids: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """`reference.moe_experts`'s contract over weights laid out by `layouts.for_gpu` (`interpret`: run the
    kernels in Mosaic GPU's interpreter): by `chosen_experts` where `visits_every_token`, else by the copies
    sorted by expert (`tile_copies`, choosing shared tiles or own windows by the copies `routing.route` expects
    to keep for `routed_experts`; `distinct_ids`: no token names an expert twice). With `layer`, the weights are
    stacked layers' [L, E, ...] and layer `layer`'s are read in place (`layouts.layers_as_one`)."""
    gate_up, down, num_experts, first = layers_as_one(gate_up, down, layer)
    check(x, gate_up, down)
    hidden = gate_up.shape[2]
    tokens = experts.shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if experts.size == 0:
        return jnp.zeros((tokens, hidden), out_dtype)
    caps = (gate_cap, up_cap)
    if visits_every_token(tokens, experts.shape[1], num_experts, routed_experts):
        return _every_token(
            in_gpu_k_order(x, gate_up.format),
            gate_up,
            down,
            experts,
            weights,
            caps=caps,
            out_dtype=out_dtype,
            num_experts=num_experts,
            first=first,
            interpret=interpret,
        )
    routing = route(experts, weights, num_experts, routed_experts)
    tiles = tile_copies(routing, distinct_ids)
    tiles = dataclasses.replace(tiles, expert=tiles.expert + first)
    token_rows = routing.token_of if tiles.source is None else composed_indices(routing.token_of, tiles.source)
    rows = rows_in_gpu_k_order(x, token_rows, gate_up.format)
    if tiles.source is None:  # shared tiles: the sorted copies in whole tiles
        rows = jnp.pad(rows, ((0, tiles.rows - rows.shape[0]), (0, 0)))
    hidden_rows = grouped_matmul(rows, gate_up, tiles, swiglu=caps, interpret=interpret)
    out_rows = grouped_matmul(hidden_rows, down, tiles, interpret=interpret)
    return combine(out_rows, routing, tokens, out_dtype, tiles.row_of)
