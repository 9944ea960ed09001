"""Routed experts on TPU (Mosaic): two grouped matmuls over the token copies sorted by expert, the expert
weights dequantized in VMEM, CHUNK rows of K at a time, right before the MXU takes them (never in HBM).

Each expert's copies are gathered into row tiles of its own, TM rows each (`_plan`); a "visit" is one of those
tiles with its expert. Visits walk the experts in order. The grid steps through the real visits alone (a dynamic
count; the plan pads its arrays to their static bound) and the output's column tiles, in whichever order reads
fewer bytes (`_visits_first`): column tiles outside, an expert's weight blocks fetched once per column tile and
each visit's row tile once per column tile; or visits outside, each row tile fetched once and the expert's
weights once per visit.

- gate_up: over N tiles of the I columns and the visits: where the visit changes, its copies' token rows [TM, H]
  come from x by one DMA each (`_token_rows`; the next visit's fetched meanwhile); a step multiplies them by the
  expert's gate and up columns [H, TN], accumulates both products in fp32, rounds them to the activation dtype
  (the reference's ragged_dot output), applies the softcapped SwiGLU in fp32 and rounds again.
- down: over N tiles of the H columns and the visits, the same over the hidden rows [TM, I] gate_up wrote; its
  rows rounded to the activation dtype.
- XLA: x relaid for the row DMAs before, the weighted sum of each token's copies after (`routing.combine`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import block_formats, devices
from pallas_kernels.moe.layouts import (
    NVFP4_E4M3_SCALE,
    PLAIN,
    TpuWeight,
    check_experts,
    layers_as_one,
    nvfp4_e4m3,
    nvfp4_order,
)
from pallas_kernels.moe.layouts import TPU_CHUNK as CHUNK
from pallas_kernels.moe.reference import softcap
from pallas_kernels.moe.routing import Routing, combine, group_offsets, placed_copies, prefix_sum, route, visits
from pallas_kernels.quantized import MXFP8, NVFP4

MAX_TM = 256  # rows per tile
LANES = 128
MAX_COPIES = 1 << 17  # token copies per call: gate_up holds each one's token in SMEM (4 bytes: 512 KiB of it)
LANE_OPTIONS = (768, 512, 384, 256, 128)  # output columns per step, the widest that divides N and fits
WEIGHT_BUFFER = 8 << 20  # bytes of one weight operand's block, double-buffered


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Plan:
    """The kernels' rows and their visits: visit v multiplies row tile tile[v] (rows tile[v] * tm ...), one of
    expert[v]'s, by its weights and writes the tile, whose first live[v] rows hold sorted copies first_copy[v] ...
    in order (the rest none); each sorted copy sits in row `row_of`."""

    expert: jax.Array  # [V] int32
    tile: jax.Array  # [V] int32
    first_copy: jax.Array  # [V] int32
    live: jax.Array  # [V] int32: 1 ... TM (real visits)
    real: jax.Array  # [1] int32: the real visits
    met: jax.Array  # [] int32: the experts they meet (with copies)
    row_of: jax.Array  # [N * k] int32
    tm: int = dataclasses.field(metadata={"static": True})
    rows: int = dataclasses.field(metadata={"static": True})  # R, whole tiles


def _plan(routing: Routing) -> _Plan:
    """Each expert's copies in row tiles of their own: its group from a tile's start, padded to whole tiles of the
    expected mean group's next power of two (16 ... 256 rows), so a visit multiplies its own expert's rows alone
    and writes its whole tile. Megablox's shared tiles (the sorted copies cut into tiles of up to 256 rows, each
    visited once per expert it meets) read the same weight blocks but multiplied 33-192x the copies from 32 to 383
    tokens (384 experts, top-8: one tile of 256 rows per chosen expert), 25x at 512, 4x at 4096; these, 16 rows
    per chosen expert in decode and 1.4-1.55x the copies in prefill. The outputs' rows are sized for the static
    bound (each of min(E, copies) experts may hold a partial tile: at 64 tokens 6,656 rows for 512 copies); only
    the real visits' are written."""
    group_sizes, copies = routing.group_sizes, routing.order.shape[0]
    num_experts = group_sizes.shape[0]
    tm = min(MAX_TM, max(16, 1 << (-(-routing.expected // num_experts) - 1).bit_length()))
    tiles = -(-copies // tm) + min(num_experts, copies)  # each group's tiles, at most
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), prefix_sum(-(-group_sizes // tm) * tm)])
    expert, tile, real = visits(starts, tm, tiles)
    offsets = group_offsets(routing)
    first_copy = offsets[expert] + tile * tm - starts[expert]
    live = jnp.minimum(offsets[expert + 1] - first_copy, tm)
    row_of, _ = placed_copies(routing, starts, tiles * tm)
    met = jnp.sum(group_sizes > 0, dtype=jnp.int32)
    return _Plan(expert, tile, first_copy, live, real, met, row_of, tm, tiles * tm)


def _columns_per_step(n: int, k: int, itemsize: float) -> int:
    """TN: the widest of LANE_OPTIONS that divides N and whose [K, TN] weight block fits WEIGHT_BUFFER."""
    fitting = [tn for tn in LANE_OPTIONS if n % tn == 0 and k * tn * itemsize <= WEIGHT_BUFFER]
    if not fitting:
        raise ValueError(f"the TPU expert kernel needs N ({n}) to be a multiple of 128 (and K = {k} to fit VMEM)")
    return fitting[0]


OPERANDS = {PLAIN: 1, MXFP8: 2, NVFP4: 3}  # arrays per weight: data, scales, global scale


def _weight_operands(w: TpuWeight) -> list[jax.Array]:
    return [w.data, w.scales, w.global_scale][: OPERANDS[w.format]]


def _weight_specs(w: TpuWeight, tn: int, column_block) -> list[pl.BlockSpec]:
    """Blocks of expert e's K x TN column tile `column_block(n)` of each operand of w."""

    def at(*lead):
        def index(i, j, expert, tile, order, *_):
            n, v = _column_and_visit(i, j, order)
            return expert[v], *lead, column_block(n)

        return index

    k = w.shape[2]
    if w.format == PLAIN:
        return [pl.BlockSpec((None, k, tn), at(0))]
    if w.format == MXFP8:
        return [pl.BlockSpec((None, k, tn), at(0)), pl.BlockSpec((None, k // block_formats.MX_BLOCK, tn), at(0))]
    blocks = k // block_formats.NV_BLOCK
    return [
        pl.BlockSpec((None, 2, blocks, tn), at(0, 0)),
        pl.BlockSpec((None, blocks, tn), at(0)),
        pl.BlockSpec((None, 1, tn), at(0)),
    ]


def _scale_scratch(w: TpuWeight, tn: int) -> list[pltpu.VMEM]:
    """The block's per-(K block, column) fp32 scales, decoded once per step."""
    if w.format == PLAIN:
        return []
    block = block_formats.MX_BLOCK if w.format == MXFP8 else block_formats.NV_BLOCK
    return [pltpu.VMEM((w.shape[2] // block, tn), jnp.float32)]


def _decode_scales(fmt: str, refs, scratch) -> None:
    """scratch = 2^(byte - 127) (MXFP8), or fp32(block scale) * global scale (the reference's order) * 2^6, which
    `nvfp4_e4m3`'s values lack (NVFP4: infinite for block steps from 2^122, weights of ~1e37). (A TPU flushes fp32
    subnormals: the MXFP8 scale byte 0, 2^-127, reads as 0 there. The encoder gives it only to blocks whose largest
    value is below 2^-117.)"""
    if fmt == MXFP8:
        scratch[...] = block_formats.e8m0_value(refs[1][...].astype(jnp.uint32))
    elif fmt == NVFP4:
        scratch[...] = refs[1][...].astype(jnp.float32) * refs[2][...] * NVFP4_E4M3_SCALE


def _chunk(fmt: str, refs, scratch, c, dtype: jnp.dtype) -> jax.Array:
    """K rows c * CHUNK ... of the weight block, [CHUNK, TN] in `dtype`, each value computed in fp32 and rounded
    once. MXFP8's E4M3 value times its power-of-two scale is exact in any dtype of fp32's exponent range, so it is
    multiplied in `dtype` there (bf16: half the vector work of fp32 on a v7x). NVFP4 (rows in `nvfp4_order`): each
    word's 8 codes become E4M3 bytes in 1 or 5 integer operations per 4 (`nvfp4_e4m3`), bitcast to fp8, widened
    and scaled (at decode a v7x's vector work per code, more than the bytes, may bound the kernel)."""
    rows = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
    if fmt == PLAIN:
        return refs[0][rows, :].astype(dtype)
    if fmt == MXFP8:
        per = CHUNK // block_formats.MX_BLOCK
        wide = dtype if jnp.finfo(dtype).nexp >= jnp.finfo(jnp.float32).nexp else jnp.float32
        values = refs[0][rows, :].astype(wide).reshape(per, block_formats.MX_BLOCK, -1)
        scales = scratch[pl.ds(pl.multiple_of(c * per, per), per), :].astype(wide)
        return (values * scales[:, None, :]).reshape(CHUNK, -1).astype(dtype)
    per = CHUNK // block_formats.NV_BLOCK
    words = refs[0][:, pl.ds(pl.multiple_of(c * per, per), per), :]  # [2, CHUNK / 16, TN]
    scales = scratch[pl.ds(pl.multiple_of(c * per, per), per), :]  # [CHUNK / 16, TN]
    pieces = []
    for plane in (words[0], words[1]):
        for slot in (0, 1):
            e4m3 = pltpu.bitcast(nvfp4_e4m3(plane, slot), jnp.float8_e4m3fn).astype(jnp.float32)  # [4 * per, TN]
            pieces.append((e4m3.reshape(4, per, -1) * scales).reshape(4 * per, -1))
    return jnp.concatenate(pieces, axis=0).astype(dtype)


def _matmul(x: jax.Array, w: jax.Array, widen: bool) -> jax.Array:
    """x [M, C] @ w [C, TN], exact products accumulated in fp32 (`widen` for the CPU interpreter, whose bf16
    dots round)."""
    if widen:
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    return lax.dot_general(
        x, w, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _fetch_rows(v, first_ref, live_ref, token_ref, x_hbm, landing, sem) -> None:
    """Starts the DMAs of visit v's live rows, its copies' tokens' rows of x [T, blocks, 128], into landing."""
    first = first_ref[v]

    def fetch(r, carry):
        pltpu.make_async_copy(x_hbm.at[token_ref[first + r]], landing.at[r], sem).start()
        return carry

    lax.fori_loop(0, live_ref[v], fetch, 0)


def _token_rows(order_ref, first_ref, live_ref, token_ref, x_hbm, landing, x_ref, sem) -> None:
    """x_ref [TM, K] = the grid step's visit's token rows (zeros past its live ones), read where the visit
    changes; the next visit's rows are fetched meanwhile (rows of x by token: no gathered copy of x in HBM)."""
    i, j = pl.program_id(0), pl.program_id(1)
    outer, inner = pl.num_programs(0), pl.num_programs(1)
    _, visit = _column_and_visit(i, j, order_ref)
    first_step = (i == 0) & (j == 0)
    _, previous = _column_and_visit(jnp.where(j == 0, i - 1, i), jnp.where(j == 0, inner - 1, j - 1), order_ref)
    fetch = functools.partial(
        _fetch_rows, first_ref=first_ref, live_ref=live_ref, token_ref=token_ref, x_hbm=x_hbm, landing=landing, sem=sem
    )

    @pl.when(first_step)
    def _():
        fetch(visit)

    @pl.when(first_step | (previous != visit))
    def _():
        live = live_ref[visit]
        pltpu.make_async_copy(landing.at[pl.ds(0, live)], landing.at[pl.ds(0, live)], sem).wait()
        rows = landing[...].reshape(landing.shape[0], -1)[:, : x_ref.shape[1]]
        x_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, x_ref.shape, 0) < live, rows, 0)
        # the next visit's run starts at the next visit (visits outside) or the next step (column tiles outside)
        visits_first = order_ref[0] == 1
        wraps = visits_first | (j + 1 == inner)
        ni, nj = jnp.where(wraps, i + 1, i), jnp.where(wraps, 0, j + 1)
        _, upcoming = _column_and_visit(ni, nj, order_ref)

        @pl.when((ni < outer) & (upcoming != visit))
        def _():
            fetch(upcoming)


def _gate_up_kernel(
    expert_ref, tile_ref, order_ref, first_ref, live_ref, token_ref, x_hbm, *refs, fmt, chunks, caps, widen
):
    count = OPERANDS[fmt]
    gate_refs, up_refs = refs[:count], refs[count : 2 * count]
    out_ref, *scratch, landing, x_ref, sem = refs[2 * count :]
    gate_scales, up_scales = (scratch[0], scratch[1]) if scratch else (None, None)
    _token_rows(order_ref, first_ref, live_ref, token_ref, x_hbm, landing, x_ref, sem)
    _decode_scales(fmt, gate_refs, gate_scales)
    _decode_scales(fmt, up_refs, up_scales)

    def step(c, accs):
        x = x_ref[:, pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)]
        gate = _matmul(x, _chunk(fmt, gate_refs, gate_scales, c, x.dtype), widen)
        up = _matmul(x, _chunk(fmt, up_refs, up_scales, c, x.dtype), widen)
        return accs[0] + gate, accs[1] + up

    tm, tn = out_ref.shape
    zeros = jnp.zeros((tm, tn), jnp.float32)
    gate, up = lax.fori_loop(0, chunks, step, (zeros, zeros))
    # the reference's rounding of the projection, then its SwiGLU in fp32
    gate, up = (y.astype(out_ref.dtype).astype(jnp.float32) for y in (gate, up))
    hidden = softcap(gate, caps[0]) * jax.nn.sigmoid(gate) * softcap(up, caps[1])
    out_ref[...] = hidden.astype(out_ref.dtype)


def _down_kernel(expert_ref, tile_ref, order_ref, h_ref, *refs, fmt, chunks, widen):
    count = OPERANDS[fmt]
    weight_refs, (out_ref, *scratch) = refs[:count], refs[count:]
    scales = scratch[0] if scratch else None
    _decode_scales(fmt, weight_refs, scales)

    def step(c, acc):
        h = h_ref[:, pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)]
        return acc + _matmul(h, _chunk(fmt, weight_refs, scales, c, h.dtype), widen)

    tm, tn = out_ref.shape
    acc = lax.fori_loop(0, chunks, step, jnp.zeros((tm, tn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _visits_first(plan: _Plan, tiles: int, expert_bytes: float, rows_bytes: jax.Array) -> jax.Array:
    """Whether walking the visits outside the column tiles reads fewer bytes than walking the column tiles outside
    (bool []): it reads each visit's rows once where the other reads them once per column tile, and the expert's
    weights (`expert_bytes`) once per visit where the other reads them once per expert. `rows_bytes` (float32 []):
    every visit's rows read once."""
    rows_read_again = (tiles - 1) * rows_bytes
    weights_read_again = (plan.real[0] - plan.met).astype(jnp.float32) * expert_bytes
    return rows_read_again > weights_read_again


def _column_and_visit(i, j, order) -> tuple[jax.Array, jax.Array]:
    """Grid step (i, j)'s column tile and visit, in the order `order[0]` says (1: visits outside)."""
    visits_first = order[0] == 1
    return jnp.where(visits_first, j, i), jnp.where(visits_first, i, j)


def _grouped(
    kernel,
    rows: tuple[jax.Array, pl.BlockSpec],
    weights: list[TpuWeight],
    specs,
    n: int,
    tn: int,
    plan: _Plan,
    reads: tuple[float, jax.Array],
    *,
    scalars: tuple[jax.Array, ...] = (),
    scratch: tuple = (),
    interpret: pltpu.InterpretParams | None,
    **options,
) -> jax.Array:
    """One grouped matmul pallas_call over the visits: the rows of K (`rows`: the operand and its spec; `scalars`
    prefetched after the plan's) -> the plan's rows [R, N] (`reads`: `_visits_first`'s expert and row bytes)."""
    expert, tile, tm = plan.expert, plan.tile, plan.tm
    dtype, tiles, visits = rows[0].dtype, n // tn, plan.real[0]
    visits_first = _visits_first(plan, tiles, *reads)
    grid = (jnp.where(visits_first, visits, tiles), jnp.where(visits_first, tiles, visits))  # the real visits
    # alone (their static bound stepped through up to ~2.3K skipped grid steps over both kernels at 4096 tokens)

    def out_block(i, j, expert, tile, order, *_):
        n, v = _column_and_visit(i, j, order)
        return tile[v], n

    scales = [s for w in weights for s in _scale_scratch(w, tn)]
    operands = [x for w in weights for x in _weight_operands(w)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3 + len(scalars),
        grid=grid,
        in_specs=[rows[1], *specs],
        out_specs=pl.BlockSpec((tm, tn), out_block),
        scratch_shapes=[*scales, *scratch],
    )
    body = functools.partial(
        kernel, fmt=weights[0].format, chunks=weights[0].shape[2] // CHUNK, widen=interpret is not None, **options
    )
    return pl.pallas_call(
        body,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((plan.rows, n), dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=devices.tpu().vmem_bytes * 3 // 4
        ),  # either may be the visits' dynamic count, which a "parallel" one cannot be (nor would one split the work
        # on a v7x: JAX sees its two TensorCores as devices of their own, no megacore); gate_up's steps carry rows
        interpret=False if interpret is None else interpret,
    )(expert, tile, visits_first.astype(jnp.int32).reshape(1), *scalars, rows[0], *operands)


def lane_blocks(k: int, dtype: jnp.dtype) -> int:
    """A token row's K values [K] as gate_up's DMAs take them, [blocks, 128]: K's lane blocks padded to whole VMEM
    tiles of `dtype` (8 rows of 32-bit values, 16 of 16-bit ...)."""
    sublanes = 8 * 4 // jnp.dtype(dtype).itemsize
    return -(-k // LANES // sublanes) * sublanes


def _visit_tiles(tm: int, k: int) -> pl.BlockSpec:
    """Each grid step's visit's row tile [TM, K] of the plan's rows."""

    def index(i, j, expert, tile, order, *_):
        return tile[_column_and_visit(i, j, order)[1]], 0

    return pl.BlockSpec((tm, k), index)


def supports(two_i: int, hidden: int) -> bool:
    """Whether the kernels take experts of gate_up [E, 2I, H] (I and H multiples of CHUNK)."""
    return hidden % CHUNK == 0 and two_i % (2 * CHUNK) == 0


def _check(x: jax.Array, gate_up: TpuWeight, down: TpuWeight, experts: jax.Array) -> None:
    check_experts(x, gate_up, down)
    _, two_i, hidden = gate_up.shape
    if not supports(two_i, hidden):
        raise ValueError(f"the TPU expert kernel needs H ({hidden}) and I ({two_i // 2}) to be multiples of {CHUNK}")
    if experts.size > MAX_COPIES:
        raise ValueError(
            f"the TPU expert kernel takes at most {MAX_COPIES} token copies a call ({experts.shape[0]} tokens x "
            f"{experts.shape[1]} experts given): split the tokens into smaller chunks"
        )


def moe_experts(
    x: jax.Array,
    gate_up: TpuWeight,
    down: TpuWeight,
    experts: jax.Array,
    weights: jax.Array,
    *,
    gate_cap: float,
    up_cap: float,
    out_dtype: jnp.dtype | None = None,
    routed_experts: int | None = None,
    layer: jax.Array | int | None = None,
    interpret: pltpu.InterpretParams | None = None,
) -> jax.Array:
    """`reference.moe_experts`'s contract over weights laid out by `layouts.for_tpu` (`interpret`: run the
    kernels in Pallas' TPU interpreter with these parameters; the tiles sized as `routing.route` expects for
    `routed_experts`). With `layer`, the weights are stacked layers' [L, E, ...] and layer `layer`'s are read in
    place (`layouts.layers_as_one`)."""
    gate_up, down, num_experts, first = layers_as_one(gate_up, down, layer)
    _check(x, gate_up, down, experts)
    _, two_i, hidden = gate_up.shape
    inter = two_i // 2
    routing = route(experts, weights, num_experts, routed_experts)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if routing.order.shape[0] == 0:
        return jnp.zeros((experts.shape[0], hidden), out_dtype)
    plan = _plan(routing)
    plan = dataclasses.replace(plan, expert=plan.expert + first)
    itemsize = {PLAIN: gate_up.data.dtype.itemsize, MXFP8: 1, NVFP4: 0.5}[gate_up.format]

    def rows_in_order(rows: jax.Array, k: int) -> jax.Array:  # [R, K], K in the order the weight's rows are
        return rows[:, nvfp4_order(k)] if gate_up.format == NVFP4 else rows

    tn = _columns_per_step(inter, hidden, itemsize)
    gate_up_specs = [
        *_weight_specs(gate_up, tn, lambda n: n),
        *_weight_specs(gate_up, tn, lambda n, blocks=inter // tn: n + blocks),
    ]
    blocks = lane_blocks(hidden, x.dtype)
    x_rows = jnp.pad(rows_in_order(x, hidden), ((0, 0), (0, blocks * LANES - hidden))).reshape(-1, blocks, LANES)
    # [T, blocks, 128]: a token's row one DMA into whole VMEM tiles of its own (a DMA into part of a tile is not to
    # be had); whole tiles of rows are also what Mosaic's shape cast back to [TM, blocks * 128] asks for
    row_scratch = (
        pltpu.VMEM((plan.tm, blocks, LANES), x.dtype),
        pltpu.VMEM((plan.tm, hidden), x.dtype),
        pltpu.SemaphoreType.DMA,
    )
    kept_rows = jnp.sum(routing.group_sizes).astype(jnp.float32) * (blocks * LANES * x.dtype.itemsize)
    hidden_rows = _grouped(
        _gate_up_kernel,
        (x_rows, pl.BlockSpec(memory_space=pl.ANY)),
        [gate_up, gate_up],
        gate_up_specs,
        inter,
        tn,
        plan,
        (hidden * two_i * itemsize, kept_rows),
        scalars=(plan.first_copy, plan.live, routing.token_of),
        scratch=row_scratch,
        caps=(gate_cap, up_cap),
        interpret=interpret,
    )
    if not gate_up.in_down_order:  # the SwiGLU's columns come in gate_up's order, not yet in down's K order
        hidden_rows = rows_in_order(hidden_rows, inter)
    th = _columns_per_step(hidden, inter, itemsize)
    out_rows = _grouped(
        _down_kernel,
        (hidden_rows, _visit_tiles(plan.tm, inter)),
        [down],
        _weight_specs(down, th, lambda n: n),
        hidden,
        th,
        plan,
        (inter * hidden * itemsize, plan.real[0].astype(jnp.float32) * (plan.tm * inter * x.dtype.itemsize)),
        interpret=interpret,
    )
    return combine(out_rows, routing, experts.shape[0], out_dtype, plan.row_of)
