"""Ragged paged relative-bias attention on Hopper (sm90) through Mosaic GPU: the kernel `attend` drives.

A CTA works on one (sequence, KV head), one tile of grouped query rows and one contiguous share of the KV
blocks that tile sees. Three warpgroups: one only issues TMA copies (each block's K, V and, inside the bias
frame, the tile's bias slice, into a ring of SMEM stages that the readers release); two compute. In prefill
tiles (more than 64 rows, without batch invariance) the compute warpgroups take 64 rows each (the wgmma M tile),
read every block and take turns (FlashAttention-3's ping-pong: one's softmax runs while the other's wgmmas do);
with C % 64 == 0 (and G * C % 128 == 0) each one's q and output tiles are strided TMA boxes of the [S, C, Hq, D]
arrays, one query head at 64 consecutive steps. In decode tiles (at most 64 rows: decode and verify, and every
step under batch invariance) they share the rows and alternate 64-key halves of the blocks (four smaller SMEM
stages instead of two), each keeping its own softmax, merged in SMEM at the end (one partial per CTA); a decode
tile (the G query heads at one position) reads its q and relative-state rows in place from the [S * Hq] arrays, in
an 8-aligned box (when S * Hq % 8 == 0 and d_rel is 16, 32 or 64; else from padded grouped copies). Compute is
FlashAttention's: S = Q K^T on wgmma (the K stage released as soon as it is read), rounded to the activation
dtype where the reference rounds it (after the product, the scale and the bias), the visibility mask only on
blocks that straddle a boundary, an online softmax that starts from the sink logit (running max = sink, sum =
1, acc = 0), the row max taken on the rounded 16-bit logits (exact), then P V on wgmma accumulating in place,
with the next step's K stage waited for under it (attention_mgpu's order). In-kernel prefill runs the steps
that need neither bias nor mask (behind the causal edge and past the profile) in a loop of their own, without
the per-step conditionals.

The bias: decode tiles over several positions (verify, and prefill under batch invariance) and prefill tiles
over the rings or of other widths copy tiles of `blocks.frame_bias`, built in XLA around profiles that a small
kernel sums on the tensor cores as the in-kernel bias does (`_frame_profiles`: one wgmma of the relative states
with the profile table), so that a position's bias has the same bits in every tile. Decode tiles at one position
(over the pool, or over a ring that holds a window and a step of keys) and prefill tiles over the pool build theirs
in the kernel: for prefill tiles (C a multiple of 64) the frame would cost Hq * C * (extent + C) values written
through several XLA passes, twice the kernel; for decode it is two small XLA kernels per call. A decode tile's rows
(the query heads at one position) see key t of a step at distance D0 - t: their bias is one small wgmma of the
relative states with a window of `keys` rows of a reversed, zero-padded copy of rel_proj. In a ring, a step's
slots hold consecutive positions up to a wrap, past which they lie a lap back, beyond the window: hidden by the
mask, whatever bias they get. A prefill warpgroup's 64 rows are one
query head at consecutive positions, so against a step of B keys from position p0 its distances are D0 + r - t
(D0 = its first query position - p0): the bias tile is a shear of Qw = rel rows [64, d_rel] @ the B + 64
profile columns at distances D0 + 63 ... D0 - B, a small wgmma on a window of a zero-padded, reversed copy
of rel_proj (TMA'd per step, one step ahead). Qw goes to an untiled SMEM buffer of row pitch W and comes
back through a view of pitch W - 1, which shifts row r by r: bias[r, t] = Qw[r, t - r + 63]. That kernel lowers
with Mosaic GPU's lane-level semantics: the warpgroup-level layout inference fails on the reshaped view.

Decoding has few (sequence, head) pairs, too few CTAs for the SMs (`devices.gpu`): the KV blocks are then split
over several CTAs (flash-decoding). Every CTA's partial softmax writes its normalised output, running max and sum,
and plain jnp combines them, partial after partial; only the first counts the sink. Batch invariance (the
default): every step, verify passes and prefill chunks too, runs as decode tiles of at most 64 rows with
decode's splits, and a tile whose rows sit at several positions runs as two reach groups, the queries before the
last one's KV block and those in it, each visiting and splitting the blocks up to its own last query's as that
query's decode does: a position's row is the same bits decoded, verified or prefilled, over rings and over the
pool without a window (the model's layers; a windowed pool's visible blocks and split count change with the
step's width). Prefill attention takes longer so than in prefill tiles (bench/results/README.md).
Without it, prefill tiles rows over CTAs instead (and splits too where there are few), each tile walking only the
blocks its queries can see (causal and window bounds per tile, `blocks.visible_blocks`).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import devices
from pallas_kernels.numerics import round_to
from pallas_kernels.ragged_paged_attention.blocks import (
    Plan,
    attend,
    frame_bias,
    group_rows,
    spanned,
    ungroup_rows,
    visible_blocks,
    zero_padding,
)

LANES = 64  # rows per compute warpgroup: the wgmma M tile
DECODE_SEQUENCES = 8  # sequences of the calls decode splits are sized for (an engine's smallest decode step)
LOG2E = math.log2(math.e)
TRANSFORMS_16BIT = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
ALIGN = 8  # rows per SMEM tile of the profile window: its TMA starts on a multiple of this


def _transforms(cols: int) -> tuple:
    """SMEM tiling and swizzle of a 16-bit operand whose minor dimension holds `cols` (16, 32 or 64) elements."""
    return plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(2 * cols)


def _widen(x: jax.Array) -> jax.Array:
    """x (16-bit floats) in f32, exactly. For bf16 an integer shift of its bits: sm90 converts floats at 16 per
    clock per SM, the rate of the softmax's exponentials (measured: 4-7% faster prefill, identical outputs)."""
    if x.dtype != jnp.bfloat16:
        return x.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(bits << 16, jnp.float32)


def _decode_rows(x: jax.Array, heads: int, groups: int) -> jax.Array:
    """Decode tiles' real rows: [P, S, Hkv, box, ...] -> [P, S, Hkv, G, ...], query head h * G + g of sequence s
    at tile row (s * Hq + h * G) % 8 + g. The offsets repeat every `period` sequences: static slices, which
    (unlike a gather) fuse into the combine that reads them."""
    parts, slots, kv_heads, tile = x.shape[:4]
    period = ALIGN // math.gcd(heads, ALIGN)  # divides S, since S * Hq % 8 == 0
    x = x.reshape(parts, slots // period, period, kv_heads, tile, *x.shape[4:])

    def heads_of(i: int) -> jax.Array:  # [P, S / period, Hkv, G, ...] of the sequences s = i mod period
        offsets = [(i * heads + h * groups) % ALIGN for h in range(kv_heads)]
        return jnp.stack([x[:, :, i, h, o : o + groups] for h, o in enumerate(offsets)], axis=2)

    picked = jnp.stack([heads_of(i) for i in range(period)], axis=2)
    return picked.reshape(parts, slots, kv_heads, groups, *x.shape[5:])


def _rel_width(d_rel: int) -> int | None:
    """The contraction of the in-kernel bias wgmma: d_rel padded with zeros to 16, 32 or 64 (None: too wide)."""
    return next((w for w in (16, 32, 64) if d_rel <= w), None)


def _profile_tables(rel_proj: jax.Array, dtype: jnp.dtype, keys: int, width: int) -> tuple[jax.Array, int]:
    """[ALIGN, L, width] copies of the profile table T (row i of copy d is T[i + d]) and the distance Z of row 0.

    Row j of T holds rel_proj at distance Z - j, rounded to the activation dtype as the reference rounds it,
    and zeros at distances outside [0, extent); Z leaves room for every window a warpgroup reads: prefill's
    distances D0 + 63 ... D0 - keys for D0 in [-63, extent + keys - 2], its steps that see some profile, and
    decode's D0 ... D0 - keys + 1 for D0 in [0, extent + keys - 2], within those. The ALIGN copies let each
    window start on a tile row."""
    d_rel, extent = rel_proj.shape
    z = extent + keys + LANES - 3
    rows = -(-(z + keys + LANES) // ALIGN) * ALIGN  # the last window ends before z + keys + LANES
    proj = round_to(rel_proj, dtype)[:, ::-1].T  # [extent, d_rel], row i: distance extent - 1 - i
    table = jnp.pad(proj, ((z - extent + 1, rows + ALIGN - z - 1), (0, width - d_rel)))
    return jnp.stack([table[d : d + rows] for d in range(ALIGN)]), z


def _frame_profiles(rel: jax.Array, rel_proj: jax.Array, *, interpret: bool) -> jax.Array:
    """`blocks.reversed_profiles` with each product summed as the in-kernel bias sums it: the d_rel terms (padded
    with zeros to the bias wgmma's contraction) in one wgmma into fp32, rounded once. The frame's rows (verify,
    chunks, rings) then carry the bias bits a decode tile builds for the same position; XLA's own sum of the
    terms rounds differently now and then, which breaks batch invariance. rel [S, C, Hq, d_rel] (d_rel at most 64),
    rel_proj [d_rel, extent] -> [S, Hq, C, extent]."""
    slots, width, heads, d_rel = rel.shape
    extent, dtype, contraction = rel_proj.shape[1], rel.dtype, _rel_width(d_rel)
    rows = slots * heads * width
    m, n = -(-rows // LANES) * LANES, -(-extent // LANES) * LANES
    cols = next(c for c in (256, 128, LANES) if n % c == 0)  # the wgmma's N
    states = jnp.pad(rel.transpose(0, 2, 1, 3).reshape(rows, d_rel), ((0, m - rows), (0, contraction - d_rel)))
    table = round_to(rel_proj, dtype)[:, ::-1].T  # [extent, d_rel], row t: distance extent - 1 - t
    table = jnp.pad(table, ((0, n - extent), (0, contraction - d_rel)))

    def body(states_ref, table_ref, out_ref, states_smem, table_smem, out_smem, landed):
        i, j = lax.axis_index("m"), lax.axis_index("n")
        plgpu.copy_gmem_to_smem(states_ref.at[pl.ds(i * LANES, LANES)], states_smem, landed)
        plgpu.copy_gmem_to_smem(table_ref.at[pl.ds(j * cols, cols)], table_smem, landed)
        plgpu.barrier_wait(landed)

        def product(acc_ref):
            plgpu.wgmma(acc_ref, states_smem, table_smem.transpose((1, 0)))
            return acc_ref[...]

        out_smem[...] = pl.run_scoped(product, plgpu.ACC((LANES, cols), jnp.float32)).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(i * LANES, LANES), pl.ds(j * cols, cols)])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), dtype),
        scratch_types=(
            plgpu.SMEM((LANES, contraction), dtype, transforms=_transforms(contraction)),
            plgpu.SMEM((cols, contraction), dtype, transforms=_transforms(contraction)),
            plgpu.SMEM((LANES, cols), dtype, transforms=TRANSFORMS_16BIT),
            plgpu.Barrier(num_arrivals=2),
        ),
        grid=(m // LANES, n // cols),
        grid_names=("m", "n"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(states, table)
    return out[:rows, :extent].reshape(slots, heads, width, extent)


def _lap_position(slot: jax.Array, last: jax.Array, ring: int) -> jax.Array:
    """The position a ring's slot holds: the last one at or before `last` that is `slot` modulo the ring's size."""
    return last - lax.rem(last - slot, ring)


def _row_bounds(rows: int, padded: int, tile: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Smallest and largest step position c = r % width among the real rows of each tile [tiles] (static)."""
    c = np.arange(padded) % width
    real = np.arange(padded) < rows
    c_min = np.where(real, c, width).reshape(-1, tile).min(axis=1)
    c_max = np.where(real, c, -1).reshape(-1, tile).max(axis=1)
    return c_min.astype(np.int32), c_max.astype(np.int32)


def _reach_groups(
    kv_lens: jax.Array, query_lens: jax.Array, c_min: np.ndarray, c_max: np.ndarray, width: int, block: int
) -> tuple[jax.Array, ...]:
    """Each tile's rows (step positions c_min ... c_max [tiles], within two KV blocks) as two reach groups: the
    queries before the KV block of the tile's last real one (they see a block less), then those in it. Returns the
    first step position of the later group [S, tiles] and the groups' smallest and largest step positions
    [S, 2 * tiles], tile t's at 2t and 2t + 1 (a group of none: smallest `width`, which `visible_blocks` gives
    nothing)."""
    first_query = (kv_lens - query_lens)[:, None]  # [S, 1]
    last = first_query + jnp.minimum(c_max, query_lens[:, None] - 1)  # each tile's last real query [S, tiles]
    later = jnp.maximum(last // block * block - first_query, c_min)  # at most the last's position: c_max at most
    lows = jnp.stack([jnp.where(later > c_min, c_min, width), later], axis=-1)
    highs = jnp.stack([later - 1, jnp.broadcast_to(c_max, later.shape)], axis=-1)
    return later, *(x.reshape(x.shape[0], -1).astype(jnp.int32) for x in (lows, highs))


def _work(
    kv_lens: jax.Array,
    query_lens: jax.Array,
    bias_first: jax.Array,
    ring_rows: jax.Array,
    c_min: jax.Array,
    c_max: jax.Array,
    *,
    block: int,
    splits: int,
    window: int | None,
    ring: int | None,
) -> jax.Array:
    """[S, T, splits, 8] int32 (T: the grid's tiles), the kernel's one table of scalars: each CTA's KV blocks
    [lo, hi), its tile's smallest and largest real query position (tiles of padding queries get nothing to visit), then
    its sequence's first query position, last key position, bias frame start and ring (ring_rows[s]). c_min,
    c_max: each tile's smallest and largest step position, [tiles] or per sequence [S, tiles]. A tile reaches the
    blocks up to its last query's, on a ring too (the slots past them hold later positions or none yet)."""
    seq = jnp.stack([kv_lens - query_lens, kv_lens - 1, bias_first, ring_rows], axis=-1)  # [S, 4]
    kv_lens, query_lens = kv_lens[:, None], query_lens[:, None]  # [S, 1]
    q_min = kv_lens - query_lens + c_min  # [S, tiles]
    q_max = kv_lens - query_lens + jnp.minimum(c_max, query_lens - 1)
    reach = q_max + 1 if ring else kv_lens
    lo, hi = visible_blocks(reach, query_lens, c_min, c_max, block=block, window=window, ring=ring)
    share = (hi - lo + splits - 1) // splits
    start = jnp.minimum(lo[..., None] + share[..., None] * jnp.arange(splits), hi[..., None])  # [S, tiles, splits]
    stop = jnp.minimum(start + share[..., None], hi[..., None])
    bounds = [jnp.broadcast_to(x[..., None], start.shape) for x in (q_min, q_max, *(seq[:, None, i] for i in range(4)))]
    return jnp.stack([start, stop, *bounds], axis=-1).astype(jnp.int32)


def _config(
    slots: int, kv_heads: int, rows: int, steps: int, splits: int | None, invariant: bool = True
) -> tuple[bool, int]:
    """(whether the two compute warpgroups share the KV blocks rather than the rows, KV splits).

    Decode tiles (at most 64 rows: decode and verify; with `invariant`, every width): both warpgroups take the same
    rows and alternate 64-key steps, each keeping its own partial softmax, and the KV blocks are split as a call of
    DECODE_SEQUENCES sequences of one tile needs to fill the SMs, whatever the call's count and width: a position's
    keys are cut at the same places (each tile's reach groups, `_reach_groups`), and its row gets the same bits,
    beside any other sequences and in a step of any width (batch invariance). Prefill tiles (more than 64 rows,
    not `invariant`): the warpgroups take 64 rows each (ping-pong), and the splits make enough CTAs for the SMs,
    with more CTAs than SMs filling the last wave (one CTA per SM: 192 CTAs would leave a quarter of two waves
    idle).
    """
    kv_parallel = rows <= LANES or invariant
    if splits is None:
        sms = devices.gpu().multiprocessors
        sequences = DECODE_SEQUENCES if kv_parallel else slots
        ctas = sequences * kv_heads * (1 if kv_parallel else -(-rows // (2 * LANES)))
        if ctas < sms:
            splits = max(1, min(sms // ctas, steps // 4))
        else:

            def filled(n: int) -> float:  # the busy share of the SMs over the waves of ctas * n CTAs
                return ctas * n / (-(-ctas * n // sms) * sms)

            options = range(1, max(1, min(4, steps // 4)) + 1)
            splits = next((n for n in options if filled(n) >= 0.9), max(options, key=filled))
    return kv_parallel, splits


def _stages(tile: int, keys: int, dim: int, itemsize: int, *, extra: int = 0) -> int:
    """How many K / V / bias stages of `keys` keys fit in SMEM next to the query tiles and `extra` bytes: an
    even number up to four, 0 when two do not fit. tile: rows of bias per stage (0: built in the kernel)."""
    fixed = 2 * LANES * dim * itemsize + 3 * 1024 + extra  # q or output tiles; sinks, max and sum; barriers
    stage = (2 * keys * dim + tile * keys) * itemsize
    stages = min(4, (devices.gpu().smem_bytes - fixed) // stage) // 2 * 2
    return stages if stages >= 2 else 0


def supports(dtype: jnp.dtype, head_dim: int, block: int) -> bool:
    """Whether the kernel takes activations of `dtype`, this head dim and KV blocks of `block` keys (else
    `kernel` raises ValueError): bf16 or f16, both multiples of 64, two SMEM stages of K and V."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    if head_dim % 64 or block % 64 or head_dim > 256:
        return False
    itemsize, decode_keys = jnp.dtype(dtype).itemsize, _step_keys(True, block, None)
    return bool(_stages(2 * LANES, block, head_dim, itemsize) and _stages(LANES, decode_keys, head_dim, itemsize))


def _step_keys(kv_parallel: bool, block: int, step_keys: int | None) -> int:
    """Keys per pipeline step: a whole block when the warpgroups share the rows; 64 (the block in two or
    more steps, each warpgroup with twice as many smaller stages in flight) when they share the blocks."""
    if step_keys is None:
        step_keys = LANES if kv_parallel else block
    if block % step_keys or step_keys % 64:
        raise ValueError(f"step of {step_keys} keys must be a multiple of 64 dividing the block {block}")
    return step_keys


def _attention(
    q: jax.Array, k: jax.Array, v: jax.Array, rel: jax.Array, rel_proj: jax.Array, sinks: jax.Array, kv_lens: jax.Array,
    query_lens: jax.Array, page_table: jax.Array | None, ring_rows: jax.Array, plan: Plan, *, scale: float,
    window: int | None, invariant: bool = True, splits: int | None = None, step_keys: int | None = None,
    in_kernel: bool | None = None, interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """`kernel` with the KV split count (None: chosen for the SMs), the keys per pipeline step (None: see
    `_step_keys`) and the bias (True: built in the kernel, False: the frame, None: in the kernel where it can
    be) open, and the CPU interpreter on demand."""
    slots, width, heads, dim = q.shape
    kv_heads = k.shape[1]
    groups, rows = heads // kv_heads, heads // kv_heads * width
    dtype, block, frame_blocks = q.dtype, plan.block, plan.frame_blocks
    itemsize = jnp.dtype(dtype).itemsize
    ring = page_table is None
    if not supports(dtype, dim, block):
        raise ValueError(
            "the Mosaic GPU kernel takes bf16 or f16 activations and head dims (at most 256) and KV blocks that are"
            f" multiples of 64; got {jnp.dtype(dtype).name}, head dim {dim}, block {block}"
        )
    k, v = k.astype(dtype), v.astype(dtype)  # a no-op unless the cache keeps another dtype
    ring_size = k.shape[2]

    kv_parallel, splits = _config(slots, kv_heads, rows, plan.steps, splits, invariant)
    ping_pong = not kv_parallel  # warpgroups with their own rows visit the same steps: they can take turns
    tile = LANES if kv_parallel else 2 * LANES  # rows per CTA
    partials = splits  # partial softmaxes per row, combined after the kernel
    padded = -(-rows // tile) * tile
    tiles = padded // tile
    # A decode tile over several positions (verify; prefill under invariance) runs as two reach groups over the
    # same rows, each visiting the blocks up to its own last query's and splitting them as that query's decode does:
    # a position's row then gets its decode bits where the tile straddles a KV block boundary (one group empty where
    # it does not).
    grouped = kv_parallel and width > 1
    grid_tiles = 2 * tiles if grouped else tiles
    # Each warpgroup's 64 rows one query head (C % 64 == 0), no padding rows: q and the output move straight
    # between the [S, C, Hq, D] arrays and SMEM (a strided TMA box), without a grouped copy of either.
    direct = not kv_parallel and width % LANES == 0 and padded == rows
    keys = _step_keys(kv_parallel, block, step_keys)
    sub = block // keys  # pipeline steps per KV block
    # The in-kernel bias: each compute warpgroup's profile window [span, d_rel], the distances D0 + lead ...
    # D0 - span + lead + 1 of a step from its first row's, and for prefill (sheared) its Qw buffer of pitch W
    # (even, so that the stores pair up; W / 2 = 4 mod 32 spreads a warp's 8 rows over the banks). Decode rows
    # all sit at one position: their bias is the window's product itself; their relative states may sit in SMEM.
    d_rel = _rel_width(rel.shape[-1])
    sheared = not kv_parallel
    lead, span = (LANES - 1, keys + LANES) if sheared else (0, keys)
    pitch = span + 8
    extra = 2 * (span * (d_rel or 0) + (LANES * pitch if sheared else LANES * (d_rel or 0))) * itemsize
    # A ring's decode tiles too: slot key0 + t holds the position one lap back from the last where it would pass it,
    # so a step's distances are D0 - t (D0 the distance of its first slot's position) except past the wrap, whose
    # keys lie a lap back, at least ring - keys + 1 away: past the window (hidden by the mask) where the ring holds
    # a window and a step.
    lapped = ring and window is not None and ring_size >= window + keys - 1
    tiled = width % LANES == 0 if sheared else width == 1  # prefill (C % 64 == 0) or decode tiles
    eligible = (  # over the pool, or decode over a ring that laps; with room for the windows and Qw buffers
        tiled
        and (not ring or (lapped and not sheared))
        and span <= 256
        and d_rel is not None
        and rel.dtype == dtype
        and _stages(0, keys, dim, itemsize, extra=extra) > 0
    )
    if in_kernel is None:
        in_kernel = eligible
    elif in_kernel and not eligible:
        raise ValueError(
            "the bias can be built in the kernel only for decode (C = 1) over the pool or a ring that holds a window"
            " and a step of keys, or for prefill tiles (C % 64 == 0, invariant=False) over the pool"
        )
    stages = _stages(0, keys, dim, itemsize, extra=extra) if in_kernel else _stages(tile, keys, dim, itemsize)
    # Decode rows (the G query heads at one position) are consecutive rows of q [S * Hq, D] and of the relative
    # states: a tile reads the 8-aligned box of `box` rows holding its own (TMA wants the alignment, in whole
    # tiles of 8 rows, and fills rows past the end with zeros) and finds them at offset (s * Hq + h * G) % 8; its
    # G sink logits are G scalar reads. No padded copy of any of them.
    box = -(-(ALIGN - 1 + groups) // ALIGN) * ALIGN
    flat = (
        in_kernel
        and not sheared
        and rel.shape[-1] == d_rel
        and slots * heads % ALIGN == 0
        and box <= min(LANES, slots * heads)
    )
    rel_in_smem = flat or (in_kernel and interpret)  # copied to SMEM, not loaded into registers from GMEM
    c_min, c_max = _row_bounds(rows, padded, tile, width)
    if grouped:
        if max(spanned(int(hi - lo) + 1, block) for lo, hi in zip(c_min, c_max, strict=True) if lo <= hi) > 2:
            raise ValueError(
                f"batch invariance takes a step of {width} positions in tiles of {tile} rows whose positions touch"
                f" at most two KV blocks of {block}: C at most 64 or a multiple of 64 (or invariant=False)"
            )
        later, c_min, c_max = _reach_groups(kv_lens, query_lens, c_min, c_max, width, block)
    work = _work(
        kv_lens,
        query_lens,
        plan.bias_first,
        ring_rows,
        c_min,
        c_max,
        block=block,
        splits=splits,
        window=window,
        ring=ring_size if ring else None,
    )
    pad = ((0, 0), (0, 0), (0, padded - rows))
    if flat:  # [S * Hq, ...]; a box past the end reads zeros (TMA and the interpreter alike)
        q, rel, sinks = q.reshape(slots * heads, dim), rel.reshape(slots * heads, d_rel), sinks.reshape(-1)
    else:
        sinks = jnp.pad(group_rows(sinks.astype(jnp.float32), kv_heads), pad)  # [S, Hkv, Rp]
        if not direct:
            q = jnp.pad(group_rows(q, kv_heads), (*pad, (0, 0)))  # [S, Hkv, Rp, D]
    if in_kernel:
        extent = rel_proj.shape[1]
        tables, z = _profile_tables(rel_proj, dtype, keys, d_rel)  # [ALIGN, L, d_rel]
        if not flat:
            rel = jnp.pad(group_rows(rel, kv_heads), (*pad, (0, d_rel - rel.shape[-1])))  # [S, Hkv, Rp, d_rel]
        bias_operands = [tables, rel]
        bias_rows = 0
    else:
        bias = frame_bias(  # [S, Hkv, R, F]
            rel, rel_proj, kv_lens, query_lens, plan, kv_heads=kv_heads, ring=ring,
            profiles=functools.partial(_frame_profiles, interpret=interpret),
        )  # fmt: skip
        # Bias rows copied per tile: a single tile (at most 64 rows) copies only its real rows, rounded up to
        # the 8-row SMEM tiling; the rest of its SMEM slot is never written and feeds only padding rows.
        bias_rows = -(-rows // 8) * 8 if tiles == 1 else tile
        bias_operands = [jnp.pad(bias, ((0, 0), (0, 0), (0, (bias_rows if tiles == 1 else padded) - rows), (0, 0)))]

    def body(*refs):
        work_ref, q_ref, k_ref, v_ref, *refs = refs
        bias_refs, (sink_ref, *refs) = refs[: len(bias_operands)], refs[len(bias_operands) :]
        table_ref = None if ring else refs.pop(0)
        outs, smem_refs, barriers = refs[:-2], refs[-2], refs[-1]
        q_smem, sink_smem, stat_smem, k_smem, v_smem, b_smem, p_smem, w_smem, qw_smem, rel_smem = smem_refs
        k_bar, v_bar, b_bar, q_bar, k_free, v_free, w_bar, turn_bar, merge_bar = barriers
        split, sh = lax.axis_index("split"), lax.axis_index("sh")
        tile_idx = grid_tiles - 1 - lax.axis_index("tile")  # the tiles with the most blocks start first
        read_idx = tile_idx // 2 if grouped else tile_idx  # a tile's two reach groups read its rows
        s, h = sh // kv_heads, sh % kv_heads
        lo, hi, q_min, q_max, first_q, last, bias_first, ring_row = (work_ref[s, tile_idx, split, i] for i in range(8))
        wg = lax.axis_index("wg")

        def in_frame(j):
            return (j >= bias_first) & (j < bias_first + frame_blocks)

        @pl.when(wg == 2)
        def _copies():
            plgpu.set_max_registers(40, action="decrease")

            def issue(step, page):
                j, off, slot = lo + step // sub, step % sub * keys, step % stages
                if ring:
                    src_k, src_v = (ref.at[ring_row, h, pl.ds(j * block + off, keys)] for ref in (k_ref, v_ref))
                else:  # the next step's page number is read now, so that its latency hides behind the waits
                    src_k, src_v = (ref.at[page, h, pl.ds(off, keys)] for ref in (k_ref, v_ref))
                    page = table_ref[s, jnp.minimum(lo + (step + 1) // sub, hi - 1)]

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                plgpu.copy_gmem_to_smem(src_k, k_smem.at[slot], k_bar.at[slot])

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                if not in_kernel:

                    @pl.when(in_frame(j))
                    def _():
                        cols = pl.ds((j - bias_first) * block + off, keys)
                        src = bias_refs[0].at[s, h, pl.ds(read_idx * tile, bias_rows), cols]
                        plgpu.copy_gmem_to_smem(src, b_smem.at[slot, pl.ds(0, bias_rows)], b_bar.at[slot])

                plgpu.copy_gmem_to_smem(src_v, v_smem.at[slot], v_bar.at[slot])
                return page

            steps = (hi - lo) * sub
            first_page = 0 if ring else table_ref[s, jnp.minimum(lo, table_ref.shape[1] - 1)]
            lax.fori_loop(0, steps, issue, first_page)

            @pl.loop(jnp.maximum(steps - stages, 0), steps)
            def _drain(step):  # see the last stages released, so that every barrier phase is observed
                plgpu.barrier_wait(k_free.at[step % stages])
                plgpu.barrier_wait(v_free.at[step % stages])

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            row0 = read_idx * tile + (0 if kv_parallel else wg * LANES)
            rows_here = pl.ds(row0, LANES)
            rows_out = pl.ds(tile_idx * tile + (0 if kv_parallel else wg * LANES), LANES)  # its copy of the rows
            my_bias = pl.ds(0 if kv_parallel else wg * LANES, LANES)  # this warpgroup's rows of the bias slot
            first, stride = (wg, 2) if kv_parallel else (0, 1)  # the steps this warpgroup visits
            count = ((hi - lo) * sub - first + stride - 1) // stride
            if direct:  # the warpgroup's rows: query head h * G + g at steps c0 ... c0 + 63
                q_here = (s, pl.ds(lax.rem(row0, width), LANES), h * groups + row0 // width)
            else:
                q_here = (s, h, rows_here)
            if flat:  # rows start ... start + box - 1 of the [S * Hq] arrays; the rest of the SMEM tiles feed no row
                start = pl.multiple_of((s * heads + h * groups) // ALIGN * ALIGN, ALIGN)
                box_here, in_box = pl.ds(start, box), (wg, pl.ds(0, box))
                plgpu.copy_gmem_to_smem(q_ref.at[box_here], q_smem.at[in_box], q_bar.at[wg])
            else:
                plgpu.copy_gmem_to_smem(q_ref.at[q_here], q_smem.at[wg], q_bar.at[wg])
                plgpu.copy_gmem_to_smem(sink_ref.at[s, h, rows_here], sink_smem.at[wg], q_bar.at[wg])
            if in_kernel:
                table_win, rel_rows = bias_refs
                # the warpgroup's rows: one query head at positions first_q + c0 + r (prefill, C % 64 == 0), or
                # the query heads at the one decode position
                position0 = first_q + lax.rem(row0, width)

                def distance(key0):  # D0: from the rows' first position to the position slot key0 holds
                    return position0 - (_lap_position(key0, last, ring_size) if ring else key0)

                def profiled(key0):  # whether some distance of the step (D0 + r - t, or D0 - t) lies in [0, extent)
                    d0 = distance(key0)
                    return (d0 >= -lead) & (d0 <= extent + keys - 2)

                def fetch(key0):  # the step's profile window: table rows j0 ... j0 + span - 1
                    j0 = z - distance(key0) - lead
                    shift = lax.rem(j0, ALIGN)
                    src = table_win.at[shift, pl.ds(pl.multiple_of(j0 - shift, ALIGN), span)]
                    plgpu.copy_gmem_to_smem(src, w_smem.at[wg], w_bar.at[wg])

                key_first = lo * block + first * keys

                @pl.when((count > 0) & profiled(key_first))
                def _():
                    fetch(key_first)

                if flat:
                    plgpu.copy_gmem_to_smem(rel_rows.at[box_here], rel_smem.at[in_box], q_bar.at[wg])
                elif interpret:  # the interpreter's wgmma reads its left operand from SMEM only
                    plgpu.copy_gmem_to_smem(rel_rows.at[s, h, rows_here], rel_smem.at[wg], q_bar.at[wg])
                else:  # issued before the wait, so that it overlaps q's copy
                    rel_here = plgpu.load(rel_rows.at[s, h, rows_here], layout=plgpu.Layout.WGMMA, optimized=False)
            plgpu.barrier_wait(q_bar.at[wg])
            if in_kernel and rel_in_smem:
                if interpret:
                    rel_here = rel_smem.at[wg]
                else:
                    rel_here = plgpu.load(rel_smem.at[wg], layout=plgpu.Layout.WGMMA, optimized=False)
            row = plgpu.Layout.WGMMA.reduce(1)
            if flat:  # tile row (s * Hq + h * G) % 8 + g: query head h * G + g
                first_row = s * heads + h * groups
                r = plgpu.broadcasted_iota(jnp.int32, (LANES,), 0, layout=row) + start - first_row
                sink = plgpu.layout_cast(jnp.zeros((LANES,), jnp.float32), row)
                for g in range(groups):
                    sink = jnp.where(r == g, sink_ref[first_row + g].astype(jnp.float32), sink)
            else:
                sink = plgpu.load(sink_smem.at[wg], layout=row)
            m = sink * LOG2E  # the running max, in the log2 domain
            counts_sink = (split == 0) & (wg == 0) if kv_parallel else split == 0  # once per row
            l_init = jnp.where(counts_sink, 1.0, 0.0).astype(jnp.float32)
            total = plgpu.layout_cast(jnp.full((LANES,), l_init, jnp.float32), row)
            acc = plgpu.layout_cast(jnp.zeros((LANES, dim), jnp.float32), plgpu.Layout.WGMMA)

            def take_turn():
                """Meet the other warpgroup: with ping-pong turns, one's softmax runs while the other's wgmmas do."""
                plgpu.barrier_arrive(turn_bar)
                plgpu.barrier_wait(turn_bar)

            def scores(slot, meanwhile=lambda: None):
                """The step's q.k in the activation dtype, rounded as the reference rounds it (after the product,
                then the scale), and what `meanwhile` returns (run while the wgmma does); releases the K stage.
                (Its K stage was waited for under the previous step's P V, or before the loop.)"""

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    other = meanwhile()
                    if ping_pong:
                        take_turn()
                    return acc_ref[...], other

                logits, other = pl.run_scoped(qk, plgpu.ACC((LANES, keys), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                return (_widen(logits.astype(dtype)) * scale).astype(dtype), other

            def biased(key0, slot):
                """q.k plus the in-kernel bias of a step whose window has been fetched; fetches the next one."""
                plgpu.barrier_wait(w_bar.at[wg])

                def profiles(acc_ref):
                    plgpu.wgmma(acc_ref, rel_here, w_smem.at[wg].transpose((1, 0)))
                    return acc_ref[...]

                qw = pl.run_scoped(profiles, plgpu.ACC((LANES, span), jnp.float32)).astype(dtype)
                prefetch(key0)  # the window has been read
                if not sheared:
                    bias = qw
                    logits, _ = scores(slot)
                elif interpret:  # the interpreter takes no reshaped refs: the same shear on the value
                    padded_qw = jnp.pad(qw, ((0, 0), (0, pitch - span))).reshape(-1)
                    bias = padded_qw[LANES - 1 : LANES - 1 + LANES * (pitch - 1)].reshape(LANES, pitch - 1)[:, :keys]
                    logits, _ = scores(slot)
                else:
                    qw_smem.at[wg, pl.ds(0, LANES * pitch)].reshape(LANES, pitch).at[:, pl.ds(0, span)][...] = qw
                    view = qw_smem.at[wg, pl.ds(LANES - 1, LANES * (pitch - 1))].reshape(LANES, pitch - 1)

                    def shear():  # rows start at odd and even elements alike: one element per load, then pairs
                        tile = view.at[:, pl.ds(0, keys)]
                        bias = plgpu.load(tile, layout=plgpu.Layout._WGMMA_ACC_32BIT, optimized=False)
                        return plgpu.layout_cast(bias, plgpu.Layout.WGMMA)

                    logits, bias = scores(slot, shear)
                return logits + bias  # in the activation dtype: one rounding, as the reference's sum

            def prefetch(key0):
                nxt = key0 + stride * keys

                @pl.when((nxt < hi * block) & profiled(nxt))
                def _():
                    fetch(nxt)

            def visit(i, carry, plain=False):
                acc, m, total = carry
                step = first + i * stride
                j, slot = lo + step // sub, step % stages
                key0 = j * block + step % sub * keys  # the step's first key slot
                if plain:  # no bias, no mask (see `_plain_steps`)
                    logits = scores(slot)[0]
                elif in_kernel:

                    def unbiased(key0):
                        prefetch(key0)
                        return scores(slot)[0]

                    logits = lax.cond(profiled(key0), biased, lambda k0, _: unbiased(k0), key0, slot)
                else:
                    logits, _ = scores(slot)

                    def add_bias(x):
                        plgpu.barrier_wait(b_bar.at[slot])
                        return x + b_smem.at[slot, my_bias][...]

                    logits = lax.cond(in_frame(j), add_bias, lambda x: x, logits)
                if not plain:
                    logits = lax.cond(_straddles(key0), functools.partial(mask, key0), lambda x: x, logits)
                row_max = logits.max(axis=1).astype(jnp.float32)  # packed bf16 maxima, exact
                logits = _widen(logits)

                # the log2 domain, with the scaling folded into the exponent's FMA
                m_new = jnp.maximum(m, row_max * LOG2E)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(logits * LOG2E - lax.broadcast_in_dim(m_new, logits.shape, [0]))
                total = total * alpha + p.sum(axis=1)
                probs = p.astype(dtype)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if not interpret:  # the softmax done before the turn is handed over (attention_mgpu's order)
                    acc, total, m_new, probs = lax.optimization_barrier((acc, total, m_new, probs))
                if ping_pong:
                    plgpu.barrier_arrive(turn_bar)
                plgpu.barrier_wait(v_bar.at[slot])
                if ping_pong:
                    plgpu.barrier_wait(turn_bar)
                if interpret:  # the interpreter's wgmma reads its left operand from SMEM only
                    p_smem.at[wg][...] = probs
                    plgpu.commit_smem()
                    probs = p_smem.at[wg]

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, probs, v_smem.at[slot])

                    @pl.when(i + 1 < count)
                    def _():  # the next step's keys, waited for under this matmul
                        plgpu.barrier_wait(k_bar.at[(step + stride) % stages])

                if interpret:  # the interpreter starts no accumulator from registers

                    def fresh(acc_ref):
                        pv(acc_ref)
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(fresh, plgpu.ACC((LANES, dim), jnp.float32))
                else:  # accumulate in place: no second accumulator, no add
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, total

            def _straddles(key0):
                """Whether some key of the step from slot key0 is hidden from some query of the tile (else no mask)."""
                if ring:
                    return jnp.bool_(True)
                hidden = key0 + keys - 1 > q_min
                if window is not None:
                    hidden |= q_max - key0 >= window
                return hidden

            def mask(key0, x):
                r = plgpu.broadcasted_iota(jnp.int32, (LANES, keys), 0, layout=plgpu.Layout.WGMMA)
                t = plgpu.broadcasted_iota(jnp.int32, (LANES, keys), 1, layout=plgpu.Layout.WGMMA)
                query = first_q + lax.rem(row0 + r, width)
                if ring:  # slot key0 + t holds position start + t, one lap back past the last key
                    pos = _lap_position(key0, last, ring_size) + t
                    pos = jnp.where(pos > last, pos - ring_size, pos)
                else:
                    pos = key0 + t
                visible = pos <= query
                if ring:
                    visible &= pos >= 0
                if window is not None:
                    visible &= query - pos < window
                return jnp.where(visible, x, jnp.array(-jnp.inf, x.dtype))

            @pl.when(count > 0)
            def _():  # the first step's keys (later ones are waited for under the previous P V)
                plgpu.barrier_wait(k_bar.at[first % stages])

            if ping_pong:  # the second warpgroup starts a turn behind, the first ends one behind
                pl.when(wg == 1)(take_turn)

            def step_key(i):
                step = first + i * stride
                return (lo + step // sub) * block + step % sub * keys

            def _plain_steps():
                """[a, b): the steps that need neither the bias nor the mask (in-kernel prefill: their first key
                slots key0 = base + i * keys increase with i; the left window edge masks the first steps, the
                causal edge and the profile the last)."""
                base = lo * block + first * keys
                # key0 <= last_plain: no key past any query of the tile, every distance past the profile
                last_plain = jnp.minimum(q_min - keys + 1, position0 - extent - keys + 1)
                b = jnp.clip(lax.div(last_plain - base + stride * keys, stride * keys), 0, count)
                b = jnp.where(last_plain >= base, b, 0)
                if window is None:
                    a = jnp.int32(0)
                else:  # key0 > q_max - window: every key inside every query's window
                    first_in = q_max - window + 1 - base
                    a = jnp.clip(lax.div(jnp.maximum(first_in, 0) + stride * keys - 1, stride * keys), 0, count)
                return a, jnp.maximum(a, b)

            carry = (acc, m, total)
            if ring or kv_parallel or not in_kernel:
                carry = lax.fori_loop(0, count, visit, carry)
            else:
                a, b = _plain_steps()
                carry = lax.fori_loop(0, a, visit, carry)
                carry = lax.fori_loop(a, b, functools.partial(visit, plain=True), carry)

                @pl.when((b > a) & (b < count) & profiled(step_key(b)))
                def _():  # the plain steps prefetched no window: the first biased step's
                    fetch(step_key(b))

                carry = lax.fori_loop(b, count, visit, carry)
            acc, m, total = carry
            if ping_pong:
                pl.when(wg == 0)(take_turn)
            # a partial with neither keys nor the sink has total = acc = 0: any divisor keeps it 0
            out = acc / lax.broadcast_in_dim(jnp.maximum(total, 1e-30), acc.shape, [0])
            if direct:  # zeros at padding queries, as `attend` returns them
                r = plgpu.broadcasted_iota(jnp.int32, out.shape, 0, layout=plgpu.Layout.WGMMA)
                out = jnp.where(lax.rem(row0, width) + r < last + 1 - first_q, out, 0.0)

            # a decode tile's rows all sit in its first `box`: only those are written
            kept, out_here, stat_here = (
                (pl.ds(0, box), (s, h), (s, h))
                if flat
                else (pl.ds(0, LANES), q_here if direct else (s, h, rows_out), (s, h, rows_out))
            )

            def store(out, m, total):
                q_smem.at[wg][...] = out.astype(dtype)
                if partials > 1:
                    stat_smem.at[wg, 0][...] = m
                    stat_smem.at[wg, 1][...] = total
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem.at[wg, kept], outs[0].at[split].at[out_here])
                if partials > 1:
                    plgpu.copy_smem_to_gmem(stat_smem.at[wg, 0, kept], outs[1].at[split].at[stat_here])
                    plgpu.copy_smem_to_gmem(stat_smem.at[wg, 1, kept], outs[2].at[split].at[stat_here])
                plgpu.wait_smem_to_gmem(0)

            if not kv_parallel:
                store(out, m, total)
                return

            @pl.when(wg == 1)  # hand its partial (over the odd steps) to the first warpgroup
            def _():
                q_smem.at[1][...] = out.astype(dtype)
                stat_smem.at[1, 0][...] = m
                stat_smem.at[1, 1][...] = total
                plgpu.barrier_arrive(merge_bar)

            @pl.when(wg == 0)  # one partial per CTA: the two softmaxes merged as the combine would
            def _():
                plgpu.barrier_wait(merge_bar)
                other = plgpu.load(q_smem.at[1], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                m1, total1 = (plgpu.load(stat_smem.at[1, i], layout=row) for i in (0, 1))
                top = jnp.maximum(m, m1)
                w0, w1 = jnp.exp2(m - top) * total, jnp.exp2(m1 - top) * total1

                def rows_times(x, w):
                    return x * lax.broadcast_in_dim(w, x.shape, [0])

                # a CTA with neither keys nor the sink has w0 = w1 = 0: any divisor keeps it 0
                mixed = rows_times(rows_times(out, w0) + rows_times(other, w1), 1 / jnp.maximum(w0 + w1, 1e-30))
                store(mixed, top, w0 + w1)

    shape = (partials, slots, kv_heads, box if flat else grid_tiles * tile)
    out_shape = (partials, *q.shape) if direct else (*shape, dim)
    out_type = [jax.ShapeDtypeStruct(out_shape, dtype)]  # each partial's own normalised output
    if partials > 1:
        out_type += [jax.ShapeDtypeStruct(shape, jnp.float32)] * 2  # its running max (log2 domain) and sum
    smem = (
        plgpu.SMEM((2, LANES, dim), dtype, transforms=TRANSFORMS_16BIT),  # q, then the output
        None if flat else plgpu.SMEM((2, LANES), jnp.float32),  # sinks
        plgpu.SMEM((2, 2, LANES), jnp.float32),  # running max and sum
        plgpu.SMEM((stages, keys, dim), dtype, transforms=TRANSFORMS_16BIT),  # K
        plgpu.SMEM((stages, keys, dim), dtype, transforms=TRANSFORMS_16BIT),  # V
        None if in_kernel else plgpu.SMEM((stages, tile, keys), dtype, transforms=TRANSFORMS_16BIT),  # bias
        plgpu.SMEM((2, LANES, keys), dtype, transforms=TRANSFORMS_16BIT) if interpret else None,  # P
        plgpu.SMEM((2, span, d_rel), dtype, transforms=_transforms(d_rel)) if in_kernel else None,  # windows
        plgpu.SMEM((2, LANES * pitch), dtype) if in_kernel and sheared and not interpret else None,  # Qw
        plgpu.SMEM((2, LANES, d_rel), dtype, transforms=_transforms(d_rel)) if rel_in_smem else None,  # rel
    )
    # With shared KV blocks each stage has one reader (its steps' warpgroup); with shared rows, two.
    readers = 1 if kv_parallel else 2
    barriers = (
        plgpu.Barrier(num_barriers=stages),  # K landed
        plgpu.Barrier(num_barriers=stages),  # V landed
        None if in_kernel else plgpu.Barrier(num_barriers=stages),  # bias landed
        plgpu.Barrier(num_arrivals=1 + (not flat) + rel_in_smem, num_barriers=2),  # q, sinks, rel landed
        plgpu.Barrier(num_arrivals=readers, num_barriers=stages),  # K stage read
        plgpu.Barrier(num_arrivals=readers, num_barriers=stages),  # V (and bias) stage read
        plgpu.Barrier(num_barriers=2) if in_kernel else None,  # profile window landed
        plgpu.Barrier(num_arrivals=2) if ping_pong else None,  # the compute warpgroups' turns
        plgpu.Barrier(num_barriers=1) if kv_parallel else None,  # the second warpgroup's partial handed over
    )

    def entry(*refs):
        pl.run_scoped(lambda *scratch: body(*refs, *scratch), smem, barriers, collective_axes="wg")

    # The prefill bias reads its shear through a reshaped SMEM view, which only the lane-level lowering takes; the
    # decode bias is lowered the same way (its profile wgmma's register operand as the prefill's).
    semantics = plgpu.LoweringSemantics.Lane if in_kernel else plgpu.LoweringSemantics.Warpgroup
    operands = [work, q, k, v, *bias_operands, sinks] + ([] if ring else [page_table])
    results = plgpu.kernel(
        entry,
        out_type=tuple(out_type),
        grid=(splits, grid_tiles, slots * kv_heads),
        grid_names=("split", "tile", "sh"),
        num_threads=3,
        thread_name="wg",
        kernel_name="ragged_paged_attention",
        compiler_params=plgpu.CompilerParams(  # rows reduce in-warp
            approx_math=True, reduction_scratch_bytes=0, lowering_semantics=semantics
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*operands)
    if flat:
        results = [_decode_rows(x, heads, groups) for x in results]
    elif not direct:
        if grouped:  # each row from its own reach group's copy: the later group from the last query's block on
            step = (jnp.arange(padded) % width).reshape(tiles, tile)
            in_later = step[None] >= later[..., None]  # [S, tiles, tile]

            def own_group(x: jax.Array) -> jax.Array:  # [P, S, Hkv, 2 * padded, ...] -> [P, S, Hkv, padded, ...]
                x = x.reshape(*x.shape[:3], tiles, 2, tile, *x.shape[4:])
                pick = in_later.reshape(1, slots, 1, tiles, tile, *[1] * (x.ndim - 6))
                return jnp.where(pick, x[:, :, :, :, 1], x[:, :, :, :, 0]).reshape(*x.shape[:3], padded, *x.shape[6:])

            results = [own_group(x) for x in results]
        results = [x[:, :, :, :rows] for x in results]
    outs = results[0]
    if partials > 1:  # each partial's weight: its sum, at the largest running max of the row
        m, total = results[1:]  # [P, S, Hkv, R]
        weight = jnp.exp2(m - m.max(axis=0)) * total
        if direct:
            weight = ungroup_rows(weight.reshape(-1, *weight.shape[2:]), width).reshape(partials, *q.shape[:3])
        # summed partial by partial, in order: one order at any shape (a reduction's may change with the shape)
        mixed = functools.reduce(jnp.add, [weight[i, ..., None] * outs[i].astype(jnp.float32) for i in range(partials)])
        out = mixed / functools.reduce(jnp.add, list(weight))[..., None]
    else:
        out = outs[0]
    out = out.astype(dtype)
    if direct and partials == 1:  # the kernel wrote zeros at padding queries; a combine may not keep them
        return out
    return zero_padding(out if direct else ungroup_rows(out, width), query_lens)


def kernel(
    q: jax.Array, k: jax.Array, v: jax.Array, rel: jax.Array, rel_proj: jax.Array, sinks: jax.Array, kv_lens: jax.Array,
    query_lens: jax.Array, page_table: jax.Array | None, ring_rows: jax.Array, plan: Plan, *, scale: float,
    window: int | None, invariant: bool = True,
) -> jax.Array:  # fmt: skip
    """[S, C, Hq, D] attention of the queries q [S, C, Hq, D] over the pool or the rings (see `attend`).
    invariant: every row as decode tiles (see `_config`); False lets prefill rows take the faster prefill tiles."""
    interpret = jax.default_backend() == "cpu"
    return _attention(
        q, k, v, rel, rel_proj, sinks, kv_lens, query_lens, page_table, ring_rows, plan, scale=scale,
        window=window, invariant=invariant, interpret=interpret,
    )  # fmt: skip


def ragged_paged_attention(*args, invariant: bool = True, **kwargs) -> jax.Array:
    """`reference.ragged_paged_attention`'s contract on this kernel (`invariant`: see `kernel`)."""
    return attend(functools.partial(kernel, invariant=invariant), *args, **kwargs)
