"""Routed experts on TPU (Mosaic): two grouped matmuls over the token copies sorted by expert, the expert
weights dequantized in VMEM, CHUNK rows of K at a time, right before the MXU takes them (never in HBM).

The copies' rows are cut into tiles of TM rows (`_plan`). A "visit" is one (tile, expert) pair whose rows meet: an
expert's copies are contiguous, so it visits one tile, or a few when its group crosses tile boundaries, and a
tile holding several experts' copies is visited once per expert (megablox's grouped matmul). Visits walk the
experts in order, so a tile's visits are consecutive grid steps: its output block stays in VMEM between them
and each visit writes only its own rows. The grid steps through the real visits alone (a dynamic count); the plan
pads its arrays to their static bound.

- gate_up: grid (N tiles of the I columns [parallel], visits): the tile's x rows [TM, H] stay resident over
  its visits; a step reads the expert's gate and up columns [H, TN] each (the weight bytes of the chosen
  experts, once per column tile), accumulates both products in fp32, rounds them to the activation dtype
  (the reference's ragged_dot output), applies the softcapped SwiGLU in fp32 and rounds again.
- down: grid (N tiles of the H columns [parallel], visits), the same over the hidden rows [TM, I]; its rows
  rounded to the activation dtype.
- XLA: the weighted sum of each token's copies (`routing.combine`).

Decode (a few tokens: k copies each) reads each chosen expert's weights once, as long as its copies share a
tile (TM covers up to 256 copies). Prefill (from OWN_FROM copies per expert on average) gives each expert's copies
tiles of their own (`_plan`), so a visit multiplies its own expert's rows only, and reuses each dequantized chunk
over them.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import block_formats
from pallas_kernels.moe.layouts import PLAIN, PLANE_ROWS, TpuWeight, check_experts, e2m1_value, nvfp4_codes, nvfp4_order
from pallas_kernels.moe.reference import softcap
from pallas_kernels.moe.routing import Routing, combine, group_offsets, placed_copies, prefix_sum, route, visits
from pallas_kernels.quantized import MXFP8, NVFP4

CHUNK = 256  # K rows dequantized per matmul: 8 MXFP8 scale rows, 16 NVFP4 scale rows (whole (8, 128) tiles)
MAX_TM = 256  # copies per tile
OWN_FROM = 8  # copies per expert (on average) from which each expert's copies get tiles of their own (prefill)
LANE_OPTIONS = (768, 512, 384, 256, 128)  # output columns per step, the widest that divides N and fits
WEIGHT_BUFFER = 8 << 20  # bytes of one weight operand's block, double-buffered
VMEM_LIMIT = 48 << 20  # v7x: 64 MiB per core


def _rows_per_tile(copies: int) -> int:
    """TM: all the copies in one tile up to MAX_TM (a decode step reads each expert once), 16-row aligned."""
    return min(MAX_TM, -(-copies // 16) * 16)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Plan:
    """The kernels' rows and their visits: visit v multiplies row tile tile[v] (rows tile[v] * tm ...) by
    expert[v]'s weights and writes the rows of that tile in [starts[e], starts[e + 1]); the copies sit in rows
    `row_of` (None: the sorted copies in order), gathered from sorted copies `source` (None: the same)."""

    expert: jax.Array  # [V] int32
    tile: jax.Array  # [V] int32
    starts: jax.Array  # [E + 1] int32
    real: jax.Array  # [1] int32: the real visits
    source: jax.Array | None  # [R] int32
    row_of: jax.Array | None  # [N * k] int32
    tm: int = dataclasses.field(metadata={"static": True})
    rows: int = dataclasses.field(metadata={"static": True})  # R, whole tiles


def _plan(routing: Routing) -> _Plan:
    """Decode (below OWN_FROM copies per expert): the sorted copies in shared tiles of `_rows_per_tile` rows, a
    tile visited once per expert whose copies it holds (megablox's plan: each chosen expert's weights read once
    per column tile). Prefill: each expert's copies in tiles of their own (its group from a tile's start, padded to
    whole tiles of the mean group's next power of two, 16 ... 256 rows), so no visit multiplies another expert's
    rows: shared tiles of 256 rows, visited by every expert they meet, multiplied 25x the copies at 512 tokens (384
    experts, top-8), 4x at 4096; these, 1.4-1.55x (2x at 384)."""
    group_sizes, copies, expected = routing.group_sizes, routing.order.shape[0], routing.expected
    num_experts = group_sizes.shape[0]
    offsets = group_offsets(routing)
    if expected < OWN_FROM * num_experts:
        tm = _rows_per_tile(expected)
        tiles = -(-copies // tm)
        expert, tile, real = visits(offsets, tm, tiles + min(num_experts, copies) - 1)
        return _Plan(expert, tile, offsets, real, None, None, tm, tiles * tm)
    tm = min(MAX_TM, max(16, 1 << (-(-expected // num_experts) - 1).bit_length()))
    tiles = -(-copies // tm) + min(num_experts, copies)  # each group's tiles, at most
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), prefix_sum(-(-group_sizes // tm) * tm)])
    expert, tile, real = visits(starts, tm, tiles)
    row_of, source = placed_copies(routing, starts, tiles * tm)
    return _Plan(expert, tile, starts, real, source, row_of, tm, tiles * tm)


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
        return lambda n, v, expert, tile, starts: (expert[v], *lead, column_block(n))

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
    """scratch = 2^(byte - 127) (MXFP8), or fp32(block scale) * global scale (NVFP4, the reference's order).
    (A TPU flushes fp32 subnormals: the MXFP8 scale byte 0, 2^-127, reads as 0 there. The encoder gives it only
    to blocks whose largest value is below 2^-117.)"""
    if fmt == MXFP8:
        scratch[...] = block_formats.e8m0_value(refs[1][...].astype(jnp.uint32))
    elif fmt == NVFP4:
        scratch[...] = refs[1][...].astype(jnp.float32) * refs[2][...]


def _chunk(fmt: str, refs, scratch, c, dtype: jnp.dtype) -> jax.Array:
    """K rows c * CHUNK ... of the weight block, [CHUNK, TN] in `dtype`: each value computed in fp32 and rounded
    once (NVFP4 rows in `nvfp4_order`)."""
    rows = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
    if fmt == PLAIN:
        return refs[0][rows, :].astype(dtype)
    if fmt == MXFP8:
        per = CHUNK // block_formats.MX_BLOCK
        values = refs[0][rows, :].astype(jnp.float32).reshape(per, block_formats.MX_BLOCK, -1)
        scales = scratch[pl.ds(pl.multiple_of(c * per, per), per), :]
        return (values * scales[:, None, :]).reshape(CHUNK, -1).astype(dtype)
    per = CHUNK // block_formats.NV_BLOCK
    words = refs[0][:, pl.ds(pl.multiple_of(c * per, per), per), :]  # [2, CHUNK / 16, TN]
    scales = scratch[pl.ds(pl.multiple_of(c * per, per), per), :]
    pieces = [e2m1_value(nvfp4_codes(words[p], j)) * scales for p in range(2) for j in range(PLANE_ROWS)]
    return jnp.concatenate(pieces, axis=0).astype(dtype)


def _matmul(x: jax.Array, w: jax.Array, widen: bool) -> jax.Array:
    """x [M, C] @ w [C, TN], exact products accumulated in fp32 (`widen` for the CPU interpreter, whose bf16
    dots round)."""
    if widen:
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)  # fmt: skip


def _in_group(tile_ref, expert_ref, starts_ref, v, tm: int) -> jax.Array:
    """[TM, 1]: which rows of visit v's tile are its expert's (its copies; with tiles of its own, the padding too)."""
    rows = tile_ref[v] * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    e = expert_ref[v]
    return (rows >= starts_ref[e]) & (rows < starts_ref[e + 1])


def _gate_up_kernel(expert_ref, tile_ref, starts_ref, x_ref, *refs, fmt, chunks, caps, widen):
    count = OPERANDS[fmt]
    gate_refs, up_refs = refs[:count], refs[count : 2 * count]
    out_ref, *scratch = refs[2 * count :]
    gate_scales, up_scales = (scratch[0], scratch[1]) if scratch else (None, None)
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
    in_group = _in_group(tile_ref, expert_ref, starts_ref, pl.program_id(1), tm)
    out_ref[...] = jnp.where(in_group, hidden.astype(out_ref.dtype), out_ref[...])


def _down_kernel(expert_ref, tile_ref, starts_ref, h_ref, *refs, fmt, chunks, widen):
    count = OPERANDS[fmt]
    weight_refs, (out_ref, *scratch) = refs[:count], refs[count:]
    scales = scratch[0] if scratch else None
    _decode_scales(fmt, weight_refs, scales)

    def step(c, acc):
        h = h_ref[:, pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)]
        return acc + _matmul(h, _chunk(fmt, weight_refs, scales, c, h.dtype), widen)

    tm, tn = out_ref.shape
    acc = lax.fori_loop(0, chunks, step, jnp.zeros((tm, tn), jnp.float32))
    in_group = _in_group(tile_ref, expert_ref, starts_ref, pl.program_id(1), tm)
    out_ref[...] = jnp.where(in_group, acc.astype(out_ref.dtype), out_ref[...])


def _grouped(
    kernel, rows: jax.Array, weights: list[TpuWeight], specs, n: int, tn: int, plan: _Plan, *,
    interpret: pltpu.InterpretParams | None, **options,
) -> jax.Array:  # fmt: skip
    """One grouped matmul pallas_call over the visits: rows [R, K] (resident per tile) -> [R, N]."""
    expert, tile, starts, real, tm = plan.expert, plan.tile, plan.starts, plan.real, plan.tm
    k = rows.shape[1]
    grid = (n // tn, real[0])  # a dynamic count: the real visits alone (their static bound stepped through up to
    # ~2.3K skipped grid steps over both kernels at 4096 tokens)
    row_spec = pl.BlockSpec((tm, k), lambda n, v, expert, tile, starts: (tile[v], 0))
    out_spec = pl.BlockSpec((tm, tn), lambda n, v, expert, tile, starts: (tile[v], n))
    scratch = [s for w in weights for s in _scale_scratch(w, tn)]
    operands = [x for w in weights for x in _weight_operands(w)]
    return pl.pallas_call(
        functools.partial(kernel, fmt=weights[0].format, chunks=k // CHUNK, widen=interpret is not None, **options),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=grid, in_specs=[row_spec, *specs], out_specs=out_spec, scratch_shapes=scratch
        ),
        out_shape=jax.ShapeDtypeStruct((rows.shape[0], n), rows.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT
        ),
        interpret=False if interpret is None else interpret,
    )(expert, tile, starts, rows, *operands)


def supports(two_i: int, hidden: int) -> bool:
    """Whether the kernels take experts of gate_up [E, 2I, H] (I and H multiples of CHUNK)."""
    return hidden % CHUNK == 0 and two_i % (2 * CHUNK) == 0


def _check(x: jax.Array, gate_up: TpuWeight, down: TpuWeight) -> None:
    check_experts(x, gate_up, down)
    _, two_i, hidden = gate_up.shape
    if not supports(two_i, hidden):
        raise ValueError(f"the TPU expert kernel needs H ({hidden}) and I ({two_i // 2}) to be multiples of {CHUNK}")


def moe_experts(
    x: jax.Array, gate_up: TpuWeight, down: TpuWeight, experts: jax.Array, weights: jax.Array, *,
    gate_cap: float, up_cap: float, out_dtype: jnp.dtype | None = None, routed_experts: int | None = None,
    interpret: pltpu.InterpretParams | None = None,
) -> jax.Array:  # fmt: skip
    """`reference.moe_experts`'s contract over weights laid out by `layouts.for_tpu` (`interpret`: run the
    kernels in Pallas' TPU interpreter with these parameters; the tiles sized as `routing.route` expects for
    `routed_experts`)."""
    _check(x, gate_up, down)
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    routing = route(experts, weights, num_experts, routed_experts)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if routing.order.shape[0] == 0:
        return jnp.zeros((experts.shape[0], hidden), out_dtype)
    plan = _plan(routing)
    token_rows = routing.token_of if plan.source is None else routing.token_of[plan.source]
    itemsize = {PLAIN: gate_up.data.dtype.itemsize, MXFP8: 1, NVFP4: 0.5}[gate_up.format]

    def rows_in_order(rows: jax.Array, k: int) -> jax.Array:  # [R, K], K in the order the weight's rows are
        rows = jnp.pad(rows, ((0, plan.rows - rows.shape[0]), (0, 0)))
        return rows[:, nvfp4_order(k, CHUNK)] if gate_up.format == NVFP4 else rows

    tn = _columns_per_step(inter, hidden, itemsize)
    gate_up_specs = [
        *_weight_specs(gate_up, tn, lambda n: n),
        *_weight_specs(gate_up, tn, lambda n, blocks=inter // tn: n + blocks),
    ]
    hidden_rows = _grouped(
        _gate_up_kernel, rows_in_order(x[token_rows], hidden), [gate_up, gate_up], gate_up_specs, inter, tn, plan,
        caps=(gate_cap, up_cap), interpret=interpret,
    )  # fmt: skip
    th = _columns_per_step(hidden, inter, itemsize)
    out_rows = _grouped(
        _down_kernel, rows_in_order(hidden_rows, inter), [down], _weight_specs(down, th, lambda n: n), hidden, th,
        plan, interpret=interpret,
    )  # fmt: skip
    return combine(out_rows, routing, experts.shape[0], out_dtype, plan.row_of)
