"""The Mosaic TPU kernel against whole-sequence attention, in Pallas' TPU interpret mode with race detection
(same cases as the oracle's harness: pages in random order, rings, decode/verify/prefill/idle in one batch,
windows, extents shorter and longer than the context, GQA; fp32 and bf16), and lowered for TPU with
jax.export at the production shapes (the interpreter does not check Mosaic's layout rules)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from test_ragged_paged_attention import (
    DIM,
    MIXED,
    PRODUCTION_DIM,
    WIDTH,
    among_other_layers,
    check,
    paged,
    production_operands,
    random_case,
    rings,
    step_inputs,
)
from tpu_interpret import race_checked

import pallas_kernels.ragged_paged_attention as ragged_paged_attention
from pallas_kernels.ragged_paged_attention import reference, tpu

# the kernel (its plan and the interpreted pallas calls) and the reference as one program a case: op by op, each of
# their operations compiled on its own for each new shape
kernel = jax.jit(tpu.ragged_paged_attention, static_argnames=("scale", "window"))
oracle = jax.jit(reference.ragged_paged_attention, static_argnames=("scale", "window"))


def interpreted(**inputs) -> np.ndarray:
    """The kernel's output in interpret mode, failing on any race between its DMAs and compute."""
    return np.asarray(race_checked(lambda _: kernel(**inputs, scale=DIM**-0.5)))


def inputs(
    case: dict,
    k: np.ndarray,
    v: np.ndarray,
    table: np.ndarray | None,
    window: int | None,
    width: int = WIDTH,
    ring_rows: jax.Array | None = None,
) -> dict:
    step = step_inputs(case, width)
    return dict(
        q=step["q"],
        k=k,
        v=v,
        kv_lens=case["kv_lens"],
        query_lens=case["query_lens"],
        rel=step["rel"],
        rel_proj=case["rel_proj"],
        sinks=step["sinks"],
        page_table=table,
        window=window,
        ring_rows=ring_rows,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("extent", "window"), [(5, None), (64, None), (5, 6), (64, 12)])
def test_paged_layout(extent, window):
    case = random_case(100 + extent + (window or 0), *MIXED, extent)
    k_pages, v_pages, table = paged(case, num_pages=64, max_pages=8)
    check(case, interpreted(**inputs(case, k_pages, v_pages, table, window)), window)


@pytest.mark.slow
@pytest.mark.parametrize("ring", [False, True])
def test_decode_only_steps(ring):
    """A step of width 1 (every row of a KV head at one position): bias rows rotated alike."""
    window = 9 if ring else None
    case = random_case(5, [37, 29, 61, 1, 140], [1, 1, 1, 1, 0], extent=9 if ring else 24)
    rows = None
    if ring:  # read in place among other layers' rings
        k, v, rows = among_other_layers(case["rng"], *rings(case, size=window + 1))
        table = None
    else:
        k, v, table = paged(case, num_pages=128, max_pages=20)
    check(case, interpreted(**inputs(case, k, v, table, window, width=1, ring_rows=rows)), window)


@pytest.mark.slow
def test_wide_chunks_in_row_tiles_over_many_steps():
    """Chunks of 128 queries (two row tiles per sequence, each with its own causal horizon and window
    start) against up to 28 pages, visited 8 per step."""
    window = 40
    case = random_case(11, [220, 128], [128, 3], extent=64)
    k_pages, v_pages, table = paged(case, num_pages=64, max_pages=28)
    check(case, interpreted(**inputs(case, k_pages, v_pages, table, window, width=128)), window)


@pytest.mark.slow
@pytest.mark.parametrize(("window", "lengths"), [(6, MIXED), (130, ([300, 137, 9, 140], [1, 8, 8, 0]))])
def test_ring_layout(window, lengths):
    """Rings of one block (window 6 + chunk 8) and of two blocks of 69 slots, wrapped more than once."""
    case = random_case(window, *lengths, extent=window)
    k_ring, v_ring = rings(case, size=window + WIDTH)
    check(case, interpreted(**inputs(case, k_ring, v_ring, None, window)), window)


@pytest.mark.slow
def test_bf16_matches_the_reference():
    """In bf16 the kernel rounds where the oracle does, up to the online softmax's order of operations."""
    case = random_case(7, *MIXED, extent=24)
    k_pages, v_pages, table = paged(case, num_pages=64, max_pages=8)
    args = inputs(case, k_pages, v_pages, table, None)
    for name in ("q", "k", "v", "rel", "rel_proj", "sinks"):
        args[name] = jnp.asarray(args[name], jnp.bfloat16)
    want = np.asarray(oracle(**args, scale=DIM**-0.5), np.float32)
    got = interpreted(**args).astype(np.float32)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize(("width", "ring"), [(1, False), (8, False), (512, False), (1, True), (512, True)])
def test_lowers_for_tpu_at_production_shapes(width, ring):
    """48 query / 8 KV heads of 128, 128-token pages, extent and window 1024, bf16, for TPU v7x."""
    slots = 4
    args = production_operands(slots, width, ring)
    table = None if ring else jax.ShapeDtypeStruct((slots, 32), jnp.int32)

    def attention(*args, table):
        window = 1024 if ring else None
        return tpu.ragged_paged_attention(*args, page_table=table, scale=PRODUCTION_DIM**-0.5, window=window)

    v7x = jax.sharding.AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=v7x)):
        lowered = export.export(jax.jit(attention), platforms=["tpu"])(*args, table=table)
    assert "tpu_custom_call" in lowered.mlir_module()


@pytest.mark.slow
def test_the_engine_step_through_the_kernel(monkeypatch, tmp_path):
    """Chunked prefill and decode with both cached attention layers (a ring and a pool) running the TPU kernel
    in interpret mode: the same log-probabilities as a whole-sequence forward. The model is the tiny parity
    model's config cut to those two layers, with random weights: each layer inlines the interpreted kernel,
    whose compilation took most of this test's time with all twelve. Their std is 0.4, not the config's 0.02,
    so that attention moves the logits as much as through the twelve: scaling the kernel's output by 0.998
    fails the comparison on either model."""
    from paths import TINY_TEXT as FIXTURE
    from step_driver import Driver, full_logprobs, prefill

    from inkling_jax.checkpoint import load_causal_lm
    from inkling_jax.checkpoint.synthetic import write_checkpoint

    calls = []

    def tpu_backend(backend: str = "auto"):
        calls.append(backend)
        return tpu.ragged_paged_attention

    config = json.loads((FIXTURE / "hf" / "config.json").read_text())
    two_layers = {"num_hidden_layers": 2, "layer_types": ["hybrid_sliding", "hybrid"], "n_layers_per_attn_res_block": 2}
    (tmp_path / "config.json").write_text(json.dumps(config | two_layers | {"initializer_range": 0.4}))
    checkpoint = write_checkpoint(tmp_path / "config.json", tmp_path / "ckpt", experts="fp32")
    model = load_causal_lm(checkpoint, jnp.float32)[1]
    ids = np.load(FIXTURE / "reference.npz")["input_ids"].tolist()[:14]  # past the window (8) and extent (12)
    want = full_logprobs(model, ids)
    monkeypatch.setattr(ragged_paged_attention, "implementation", tpu_backend)
    jax.clear_caches()  # the step may be cached from another test's trace with the reference
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            got = prefill(Driver(model), 1, ids, [5, 8, 1], len(want[0]))
    finally:
        pltpu.reset_tpu_interpret_mode_state()
        jax.clear_caches()
    assert calls  # traced through the kernel, not a cached reference step
    for position, logprobs in got:
        np.testing.assert_allclose(logprobs, want[position], rtol=1e-4, atol=1e-4 * np.abs(want[position]).max())


@pytest.mark.slow
def test_the_kernel_runs_on_each_devices_heads_under_tensor_parallelism(monkeypatch):
    """The model's cached attention on a 2-device `model` mesh: every device runs the kernel (interpret mode)
    on its own query and KV heads, and the whole equals whole-sequence attention."""
    from inkling_jax.model.attention import cached_attention
    from inkling_jax.sharding import MODEL

    calls = []
    monkeypatch.setattr(
        ragged_paged_attention, "implementation", lambda backend: calls.append(backend) or tpu.ragged_paged_attention
    )
    case = random_case(21, *MIXED, extent=24)
    k_pages, v_pages, table = paged(case, num_pages=64, max_pages=8)
    args = inputs(case, k_pages, v_pages, table, None)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (MODEL,))
    attention = jax.jit(cached_attention, static_argnames=("scale", "window"))
    params = pltpu.InterpretParams(detect_races=True)
    try:
        with jax.set_mesh(mesh), pltpu.force_tpu_interpret_mode(params):
            got = np.asarray(attention(**args, scale=DIM**-0.5))
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert calls
    check(case, got, None)


def test_auto_takes_the_reference_for_blocks_mosaic_cannot_tile(monkeypatch):
    """On TPU, a ring of window 1024 + chunk 100 slots has no block of whole sublane tiles (its largest divisor
    up to 128 is 4): "auto" falls back to the reference rather than failing to compile."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    q = jnp.zeros((1, 1, 48, 128), jnp.bfloat16)
    ring = jnp.zeros((1, 8, 1024 + 100, 128), jnp.bfloat16)
    pool = jnp.zeros((4, 8, 128, 128), jnp.bfloat16)
    assert ragged_paged_attention.automatic(q, ring, None) == "reference"
    assert ragged_paged_attention.automatic(q, jnp.zeros((1, 8, 1024 + 512, 128), jnp.bfloat16), None) == "tpu"
    assert ragged_paged_attention.automatic(q, pool, jnp.zeros((1, 4), jnp.int32)) == "tpu"
