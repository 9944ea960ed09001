"""The Mosaic GPU ragged paged attention kernel equals the pure-jnp reference on the same inputs: mixed
batches (decode, verify, prefill chunks, an idle slot), the page pool in random page order and the
sliding rings, with and without a window, bias extents shorter and longer than the context, GQA with
the production tiling (page 128, head dim 128, 6 query heads per KV head), with and without splitting
the KV blocks over CTAs, the bias from the frame (decode, verify, rings) and built in the kernel (prefill over
the pool, decode over the pool and over rings that have lapped). On an H200 the kernel is compiled and every case
runs; on CPU it runs in Mosaic GPU's interpreter, slowly, so there a subset runs (one KV head; each layout, mode
and split choice still covered), and `jax.export(..., platforms=["cuda"])` lowers the compiled kernel at the
production shapes (Mosaic GPU's layouts and TMA boxes, which the interpreter does not check; ptxas runs only on a
GPU).
The interpreter runs under conftest's 8 host devices: outside pytest with the default single CPU device its
warpgroup threads were seen to stall on a barrier (XLA_FLAGS=--xla_force_host_platform_device_count=8 avoids it).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_wgmma import exact_wgmma  # noqa: F401 (an autouse fixture)
from jax import export
from test_ragged_paged_attention import PRODUCTION_DIM, among_other_layers, production_operands

from pallas_kernels.ragged_paged_attention import gpu
from pallas_kernels.ragged_paged_attention.blocks import attend, reversed_profiles
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

reference = jax.jit(ragged_paged_attention, static_argnames=("scale", "window"))  # one program a case, not an op
# at a time (each operation compiled on its own for each new shape)

CPU = jax.default_backend() == "cpu"
gpu_decode_rows = gpu._decode_rows
PAGE, DIM, KV_HEADS, GROUPS, D_REL = 128, 128, 1 if CPU else 2, 6, 8
HEADS = KV_HEADS * GROUPS

# (kv_lens, query_lens, width C): decode, verify (γ + 1 = 8), a first chunk, a later chunk, an idle slot
MIXED = ([450, 300, 40, 600, 257] if CPU else [700, 300, 40, 1000, 513], [1, 8, 40, 64, 0], 64)
# A prefill step of C = 128 (in prefill tiles, with C % 64 == 0 and more than 64 rows the bias is built in the kernel;
# here the second warpgroup's rows start mid-chunk): a first chunk and a later, partial one (in the interpreter only
# the latter).
PREFILL = ([300], [100], 128) if CPU else ([128, 1000], [128, 100], 128)
DECODE = ([600 if CPU else 1000, 129, 5], [1, 1, 1], 1)
VERIFY = ([500, 77, 600 if CPU else 1000, 9], [8, 8, 3, 0], 8)  # at most 64 rows: the warpgroups share the rows


def inputs(
    seed: int,
    kv_lens: list[int],
    query_lens: list[int],
    width: int,
    extent: int,
    ring: int | None,
    d_rel: int = D_REL,
    groups: int = GROUPS,
) -> dict:
    """Random bf16 step inputs (`groups` query heads a KV head); K / V as a pool of pages in random order (ring None)
    or rings of `ring` slots."""
    rng = np.random.default_rng(seed)
    slots, heads = len(kv_lens), KV_HEADS * groups

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape), jnp.bfloat16)

    def grid(*shape: int) -> jax.Array:
        """Nonzero multiples of 1/4 in [-1, 1]: q.k is exact in fp32 whatever the summation order, so the
        kernel and the reference round the same logits (a one-ulp flip of a bf16 logit moves a peaked
        softmax by more than any tolerance)."""
        return jnp.asarray(rng.choice([-1, 1], size=shape) * rng.integers(1, 5, size=shape) / 4, jnp.bfloat16)

    case = {
        "q": grid(slots, width, heads, DIM),
        "rel": normal(slots, width, heads, d_rel),
        "rel_proj": normal(d_rel, extent),
        "sinks": normal(slots, width, heads),
        "kv_lens": jnp.asarray(kv_lens, jnp.int32),
        "query_lens": jnp.asarray(query_lens, jnp.int32),
    }
    if ring is None:
        max_pages = -(-max(kv_lens) // PAGE) + 1
        num_pages = slots * max_pages + 3
        case["page_table"] = jnp.asarray(rng.permutation(num_pages)[: slots * max_pages].reshape(slots, max_pages))
        shape = (num_pages, KV_HEADS, PAGE, DIM)
    else:
        case["page_table"] = None
        shape = (slots, KV_HEADS, ring, DIM)
    case["k"], case["v"] = grid(*shape), normal(*shape)
    return case


def run(fn, case: dict, window: int | None, **ring) -> np.ndarray:
    args = [case[name] for name in ("q", "k", "v", "kv_lens", "query_lens", "rel", "rel_proj", "sinks")]
    out = fn(*args, page_table=case["page_table"], scale=DIM**-0.5, window=window, **ring)
    return np.asarray(out.astype(jnp.float32))


def compare(case: dict, window: int | None, splits: int | None, among_layers: bool = False, **options) -> None:
    """The kernel equals the reference on `case`; `among_layers`: the kernel reads the case's rings in place from
    a stack of several layers' rings."""
    kernel = functools.partial(gpu._attention, splits=splits, interpret=jax.default_backend() == "cpu", **options)
    on_kernel, ring = case, {}
    if among_layers:
        rng = np.random.default_rng(0)
        k, v, rows = among_other_layers(rng, *(np.asarray(case[n], np.float32) for n in ("k", "v")))
        on_kernel = case | {"k": jnp.asarray(k, jnp.bfloat16), "v": jnp.asarray(v, jnp.bfloat16)}
        ring = {"ring_rows": rows}
    got = run(
        jax.jit(functools.partial(attend, kernel), static_argnames=("scale", "window")), on_kernel, window, **ring
    )
    want = run(reference, case, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def cases(*full: list, cpu: list[tuple]) -> list[tuple]:
    """Every combination of the `full` parameter lists on GPU; only the `cpu` combinations in the interpreter."""
    return cpu if CPU else list(itertools.product(*full))


WINDOW_EXTENTS = [(None, 64), (None, 2048), (200, 256)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("window", "extent", "splits", "invariant"),
    [  # and test_pool_prefill
        (*we, sp, inv)
        for we, sp, inv in cases(WINDOW_EXTENTS, [None, 1], [True, False], cpu=[((None, 2048), None, True)])
    ],
)
def test_pool_mixed_batch(window, extent, splits, invariant):  # invariant: every row in decode tiles
    compare(inputs(17 + (window or 0) + extent, *MIXED, extent, ring=None), window, splits, invariant=invariant)


@pytest.mark.slow
@pytest.mark.parametrize(("window", "extent"), [(200, 256)] if CPU else WINDOW_EXTENTS)
def test_pool_prefill(window, extent):  # the prefill tiles; on CPU also the interpreter's window over them
    compare(inputs(29 + extent, *PREFILL, extent, ring=None), window, None, in_kernel=True, invariant=False)


@pytest.mark.slow
@pytest.mark.parametrize(("splits", "invariant"), [(None, False)] if CPU else [(None, True), (None, False), (1, True)])
def test_ring_mixed_batch(splits, invariant):
    window = 200
    case = inputs(5, *MIXED, extent=window, ring=384)  # at least window + C slots, a multiple of the block
    compare(case, window, splits, among_layers=True, invariant=invariant)


@pytest.mark.slow
@pytest.mark.parametrize("in_kernel", [True] if CPU else [True, False])
def test_ring_decode(in_kernel):
    """Decode over rings, one far past a lap of the ring (its slots hold positions from two laps), its bias built
    in the kernel (a ring that holds the window and a step of keys) or read from the frame."""
    case = inputs(13, *DECODE, extent=256, ring=384)
    compare(case, 200, None, among_layers=True, in_kernel=in_kernel)


def test_ring_bias_in_kernel_only_where_the_ring_holds_a_window_and_a_step():
    with pytest.raises(ValueError, match="in the kernel"):  # 256 slots: a window of 200 and a step of 64 overflow
        compare(inputs(2, *DECODE, extent=256, ring=256), 200, None, in_kernel=True)


# decode with its bias built in the kernel (None) or read from the frame (False); verify always reads the frame
DECODE_AND_VERIFY = [
    *itertools.product([DECODE], [None, 1], [None, False]),
    *itertools.product([VERIFY], [None, 1], [None]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("batch", "splits", "in_kernel"), [(VERIFY, None, None)] if CPU else DECODE_AND_VERIFY)
def test_pool_decode_and_verify(batch, splits, in_kernel):
    compare(inputs(3 + batch[2], *batch, extent=1024, ring=None), None, splits, in_kernel=in_kernel)


@pytest.mark.slow
@pytest.mark.parametrize("splits", [None] if CPU else [None, 1])
def test_decode_rows_read_in_place(splits, monkeypatch):  # d_rel 16, S * Hq % 8 == 0: q, rel from [S * Hq] boxes
    picked = []
    monkeypatch.setattr(gpu, "_decode_rows", lambda x, *a: picked.append(x.shape) or gpu_decode_rows(x, *a))
    compare(inputs(7, [600 if CPU else 1000, 129, 5, 300], [1] * 4, 1, extent=1024, ring=None, d_rel=16), None, splits)
    assert picked, "the decode tiles did not read their rows in place"


@pytest.mark.slow
def test_public_entry_point():  # on CPU also the interpreter's decode case (its bias built in the kernel)
    case = inputs(11, *DECODE, extent=64, ring=None)
    got = run(jax.jit(gpu.ragged_paged_attention, static_argnames=("scale", "window")), case, None)
    np.testing.assert_allclose(got, run(reference, case, None), rtol=2e-2, atol=2e-2)


def test_bias_in_kernel_only_for_decode_and_prefill():
    with pytest.raises(ValueError, match="in the kernel"):  # verify rows sit at several positions: the frame
        compare(inputs(1, *VERIFY, extent=64, ring=None), None, None, in_kernel=True)
    with pytest.raises(ValueError, match="in the kernel"):  # C % 64 != 0
        compare(inputs(1, [100], [96], 96, extent=64, ring=None), None, None, in_kernel=True, invariant=False)
    with pytest.raises(ValueError, match="in the kernel"):  # decode tiles over several positions read the frame
        compare(inputs(1, [300], [128], 128, extent=64, ring=None), None, None, in_kernel=True)


@pytest.mark.parametrize(
    ("width", "ring", "d_rel"),
    [(1, False, 16), (1, False, 8), (8, False, 16), (1024, False, 16), (1, True, 16), (8, True, 16)],
)
def test_lowers_for_cuda_at_production_shapes(width, ring, d_rel):
    """The kernel as compiled for the H200 (not the interpreter) lowers through Mosaic GPU on any machine: 48 query /
    8 KV heads of 128, 128-token pages, extent 1024, bf16; decode over the pool and the rings (its rows in place
    with d_rel 16, from padded copies with 8) and prefill build their bias in the kernel, verify reads the frame.
    (What the interpreter does not check: layouts, TMA boxes.)"""
    slots = 8
    args = production_operands(slots, width, ring, d_rel)
    table = None if ring else jax.ShapeDtypeStruct((slots, 8), jnp.int32)
    kernel = functools.partial(
        gpu._attention, interpret=False, in_kernel=True if width in (1, 1024) else None, invariant=width < 1024
    )  # the prefill tiles build the bias in the kernel

    def attention(*args, table):
        return attend(kernel, *args, page_table=table, scale=PRODUCTION_DIM**-0.5, window=1024 if ring else None)

    lowered = export.export(jax.jit(attention), platforms=["cuda"])(*args, table=table)
    assert "mosaic_gpu" in lowered.mlir_module()


def test_decode_splits_do_not_depend_on_the_number_of_sequences():
    """Every step cuts a sequence's KV blocks at the same places whatever the call's size and width (batch
    invariance): the split count follows the KV heads and the blocks in reach, never the sequences nor the rows;
    without invariance prefill's still fill the SMs."""
    for kv_heads, steps in [(8, 16), (2, 64), (8, 2), (1, 8192)]:
        # decode of 6 query heads a KV head; a verify pass of 8 positions; prefill chunks of 64 and 1024
        found = {
            gpu._config(slots, kv_heads, rows, steps, None)
            for slots in (1, 8, 16, 64, 68, 196)
            for rows in (6, 48, 384, 6144)
        }
        assert len(found) == 1 and next(iter(found))[0]  # one choice, the warpgroups sharing the KV blocks
    assert gpu._config(8, 8, 6, 16, None) == (True, 2)
    assert gpu._config(1, 8, 128, 16, None, invariant=False) != gpu._config(64, 8, 128, 16, None, invariant=False)


def test_supports():
    assert gpu.supports(jnp.bfloat16, 128, 128) and gpu.supports(jnp.float16, 64, 64)
    assert not gpu.supports(jnp.float32, 128, 128)  # tiny f32 test models take the reference
    assert not gpu.supports(jnp.bfloat16, 96, 128) and not gpu.supports(jnp.bfloat16, 128, 16)
    with pytest.raises(ValueError, match="bf16 or f16 activations .* got float32, head dim 128"):
        compare(dict(inputs(1, *DECODE, extent=64, ring=None), q=jnp.zeros((3, 1, HEADS, DIM), jnp.float32)), None, 1)


# (kv_lens, query_lens, width C, bias extent, ring slots, bias built in the kernel) of steps whose rows must get their
# decode bits
ROW_BITS = [
    # verify passes at positions 252 ... 259 and 636 ... 643 (straddling blocks 2 and 5); the frame's bias
    ([260, 644, 1100], [8, 8, 0], 8, 1024, None, False),
    # a prefill chunk at positions 244 ... 267: three decode tiles, one straddling block 2; the frame's bias
    ([268, 1100], [24, 0], 24, 1024, None, False),
    # the bias as the engine takes it (decode rows build it in the kernel, chunks read the frame), rows past a short
    # extent: a chunk at positions 256 ... 279 over the pool; one row at 256 in a 64-wide lane over 256-slot rings of
    # a 128-key window, where they first lap
    ([280, 600], [24, 0], 24, 256, None, None),
    ([257, 600], [1, 0], 64, 256, 256, None),
    # a replayed sequence's chunk as the engine runs it, at positions 236 ... 299 over the rings (its rows from 256 on
    # lie a lap on)
    ([300, 600], [64, 0], 64, 256, 256, None),
]
# on a GPU also: that chunk over the pool (straddling block 2, the rows' profiles reaching past the extent), and at
# 256 ... 319 over both
ROW_BITS_GPU = [([300, 600], [64, 0], 64, 256, None, None)] + [
    ([320, 600], [64, 0], 64, 256, r, None) for r in (None, 256)
]
# and over the rings at the engine test's widths (4 query heads a KV head, d_rel 16: decode rows read in place), alone
# and beside a decoding sequence
ENGINE_TEST_BITS = [([300, 600], [64, 0], 64, 256, 256, None), ([303, 257], [64, 1], 64, 256, 256, None)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kv_lens", "query_lens", "width", "extent", "ring", "in_kernel", "widths"),
    [(*case, (GROUPS, D_REL)) for case in ROW_BITS + ([] if CPU else ROW_BITS_GPU)]
    + ([] if CPU else [(*case, (4, 16)) for case in ENGINE_TEST_BITS]),
)
def test_a_row_gets_its_decode_bits_at_any_step_width(kv_lens, query_lens, width, extent, ring, in_kernel, widths):
    """Each row of a verify pass or a prefill chunk equals the same position decoded beside another sequence, bit
    for bit (batch invariance), also where the step straddles a KV block boundary, which moves where a tile's blocks
    would split: each tile runs as reach groups that split their own blocks as their rows' decodes do."""
    groups, d_rel = widths  # query heads a KV head, relative-state width
    step = inputs(41 + width, kv_lens, query_lens, width, extent, ring=ring, d_rel=d_rel, groups=groups)
    rows = [(s, c) for s, length in enumerate(query_lens) for c in range(length)]
    rows += rows[-1:] * (len(rows) % 2)  # an even count of decoding sequences, as the engine's decode steps hold
    decode = (
        step
        | {name: jnp.stack([step[name][s, c] for s, c in rows])[:, None] for name in ("q", "rel", "sinks")}
        | {
            "kv_lens": jnp.asarray([kv_lens[s] - query_lens[s] + 1 + c for s, c in rows], jnp.int32),
            "query_lens": jnp.ones(len(rows), jnp.int32),
        }
    )
    if ring is None:
        decode["page_table"] = step["page_table"][jnp.asarray([s for s, _ in rows])]
        on_rings = ({}, {})
    else:
        on_rings = ({"ring_rows": jnp.arange(len(kv_lens), dtype=jnp.int32)}, {"ring_rows": jnp.asarray(rows)[:, 0]})
    window = None if ring is None else 128
    kernel = functools.partial(gpu._attention, interpret=CPU, in_kernel=in_kernel)
    call = jax.jit(functools.partial(attend, kernel), static_argnames=("scale", "window"))
    got_step, got_decode = run(call, step, window, **on_rings[0]), run(call, decode, window, **on_rings[1])
    np.testing.assert_array_equal(got_decode[:, 0], np.stack([got_step[s, c] for s, c in rows]))


def test_invariance_takes_tiles_within_two_blocks():
    """A step of 200 positions puts positions 192 ... 199 and 0 ... 55 of the next query head in one 64-row tile
    (three 128-key blocks): refused under batch invariance, naming the way out; the prefill tiles take it."""
    case = inputs(3, [300], [200], 200, extent=64, ring=None)
    with pytest.raises(ValueError, match="at most two KV blocks .* invariant=False"):
        compare(case, None, None)
    if not CPU:
        compare(case, None, None, invariant=False)


@pytest.mark.parametrize(("slots", "width", "heads", "d_rel", "extent"), [(2, 3, 4, 16, 200), (3, 1, 6, 8, 1024)])
def test_frame_profiles_are_the_reference_products(slots, width, heads, d_rel, extent):
    """The frame's profiles from the bias wgmma (the sum the decode tiles' in-kernel bias takes) are the reference's
    rounded products, in its layout: to the bit in the interpreter (which sums as XLA does), within one rounding of
    the activation dtype on the GPU's tensor cores. d_rel 8 pads the wgmma's contraction with zeros; an extent that
    is no multiple of 64 pads the table."""
    rng = np.random.default_rng(slots * 100 + d_rel)
    rel = jnp.asarray(rng.normal(size=(slots, width, heads, d_rel)), jnp.bfloat16)
    rel_proj = jnp.asarray(rng.normal(size=(d_rel, extent)), jnp.float32)
    got = np.asarray(jax.jit(functools.partial(gpu._frame_profiles, interpret=CPU))(rel, rel_proj), np.float32)
    want = np.asarray(jax.jit(reversed_profiles)(rel, rel_proj), np.float32)
    assert got.shape == (slots, heads, width, extent)
    if CPU:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2**-8, atol=1e-6)
