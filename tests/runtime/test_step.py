"""The engine step: chunked prefill, decode, batch independence, no recompilation; on the tiny parity model's config
in four layers with random weights (every kind of layer and block, in step programs that compile in a third of twelve
layers' time), and greedy decoding on the parity checkpoint itself against transformers' generation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_configs import four_layers
from paths import TINY_TEXT
from step_driver import MAX_PAGES, SLOTS, WIDTH, Driver, full_logprobs, prefill

from inkling_jax.cache import CacheLayout, init_state
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.forward import logits_fn
from inkling_jax.model.attention import grouped_attention
from inkling_jax.model.chunk import Chunk
from inkling_jax.sampling import SamplingParams
from inkling_jax.step import StepBatch, pack_spans, step


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The parity model's config (window 8, relative extent 12, tau floor 10) in four layers, random weights."""
    folder = tmp_path_factory.mktemp("four_layers")
    config = four_layers(TINY_TEXT / "hf" / "config.json", folder / "config.json")
    return write_checkpoint(config, folder / "checkpoint", experts="fp32", seed=7)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_causal_lm(checkpoint, jnp.float32)[1]


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(TINY_TEXT / "reference.npz"))


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("sizes", [[8] * 5, [3, 8, 1, 7, 8, 5, 8], [1] * 40])
def test_chunked_prefill_and_decode_match_the_whole_sequence(model, reference, sizes, lanes):
    ids = reference["input_ids"].tolist()
    want = full_logprobs(model, ids)
    for position, got in prefill(Driver(model, lanes=lanes), 1, ids, sizes, len(want[0])):
        error = np.abs(got - want[position]).max() / np.abs(want[position]).max()
        assert error < 1e-4, (position, error)


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [False, True])
def test_a_slot_a_new_sequence_takes_over_computes_as_a_fresh_one(model, lanes):
    """A new sequence in a slot another one used (its convolution states left as they were) gives the
    log-probabilities it gives in a fresh state, bit for bit: a 2-token prompt, shorter than the convolution's
    history, then decode steps while the rows before its first token still hold the last sequence's."""
    rng = np.random.default_rng(17)
    before, prompt = rng.integers(0, 500, 13).tolist(), rng.integers(0, 500, 2).tolist()
    follow = rng.integers(0, 500, 3).tolist()
    used, fresh = Driver(model, lanes=lanes), Driver(model, lanes=lanes)
    every = model.config.unpadded_vocab_size  # every log-probability: the chunked-prefill test's compiled steps
    used.run({1: before[:8]}, reset={1}, prompt={1}, num_top=every)
    used.run({1: before[8:]}, prompt={1}, emit={1}, num_top=every)
    for driver in (used, fresh):
        outs = [driver.run({1: prompt}, reset={1}, prompt={1}, emit={1}, num_top=every)]
        outs += [driver.run({1: [token]}, emit={1}, num_top=every) for token in follow]
        driver.logprobs = np.stack([np.asarray(out.top_logprobs[1, 0]) for out in outs])
        driver.ids = np.stack([np.asarray(out.top_ids[1, 0]) for out in outs])
    np.testing.assert_array_equal(used.ids, fresh.ids)
    np.testing.assert_array_equal(used.logprobs, fresh.logprobs)


def test_greedy_decode_matches_the_reference_generation(reference):
    driver = Driver(load_causal_lm(TINY_TEXT / "hf", jnp.float32)[1])
    prompt, want = reference["greedy_prompt"].tolist(), reference["greedy_ids"].tolist()
    out = driver.run({0: prompt[:8]}, reset={0}, prompt={0})
    out = driver.run({0: prompt[8:]}, prompt={0}, emit={0})
    tokens = [int(out.tokens[0, 0])]
    while len(tokens) < len(want):
        tokens.append(int(driver.run({0: tokens[-1:]}, emit={0}).tokens[0, 0]))
    assert tokens == want  # 9 + 16 tokens cross the window (8), the relative extent (12) and the tau floor (10)


def _sampled_continuation(model, reference, slot, neighbours, seed, lanes=False):
    """A seeded request in `slot`, while other slots prefill and decode random tokens."""
    rng = np.random.default_rng(slot)
    driver = Driver(model, lanes=lanes)
    ours = reference["input_ids"][:12].tolist()
    params = dataclasses.replace(
        SamplingParams.neutral(SLOTS),
        temperature=jnp.full(SLOTS, 0.9),
        top_p=jnp.full(SLOTS, 0.95),
        seed=jnp.asarray([seed if s == slot else 99 + s for s in range(SLOTS)], jnp.uint32),
    )
    others = {s: rng.integers(0, 500, 24).tolist() for s in neighbours}
    driver.run(
        {slot: ours[:8], **{s: t[:5] for s, t in others.items()}},
        reset={slot, *others},
        prompt={slot, *others},
        sampling=params,
    )
    out = driver.run(
        {slot: ours[8:], **{s: t[5:13] for s, t in others.items()}},
        prompt={slot, *others},
        emit={slot},
        sampling=params,
    )
    tokens = [int(out.tokens[slot, 0])]
    for i in range(10):
        chunks = {slot: tokens[-1:], **{s: t[13 + i : 14 + i] for s, t in others.items()}}
        tokens.append(int(driver.run(chunks, emit={slot, *others}, sampling=params).tokens[slot, 0]))
    return tokens


@pytest.mark.slow
def test_outputs_do_not_depend_on_slot_or_batch(model, reference):
    alone = _sampled_continuation(model, reference, 0, [], seed=5)
    assert alone == _sampled_continuation(model, reference, 2, [0, 1], seed=5)
    assert alone == _sampled_continuation(model, reference, 2, [0, 1], seed=5, lanes=True)
    assert alone == _sampled_continuation(model, reference, 1, [2], seed=5)
    assert alone != _sampled_continuation(model, reference, 0, [], seed=6)


@pytest.mark.slow
def test_a_step_of_fewer_tokens_than_slots_reads_its_busy_slots_alone(model):
    """Two tokens a step among three slots (attention and sampling over the busy slots only) emit what the same
    steps emit with a row for every slot, whichever two slots bring the tokens."""
    rng = np.random.default_rng(11)
    prompts = rng.integers(0, 500, (SLOTS, 6)).tolist()
    params = dataclasses.replace(
        SamplingParams.neutral(SLOTS, logprobs=5),
        temperature=jnp.full(SLOTS, 0.8),
        top_k=jnp.full(SLOTS, 40),
        seed=jnp.arange(SLOTS, dtype=jnp.uint32) + 21,
    )
    emitted = []
    for tokens in (SLOTS, 2):
        driver, fed, outs = Driver(model, width=1, tokens=tokens), [0] * SLOTS, []
        for busy in [(0, 2), (1, 2), (0, 1)] * 6:
            chunks = {slot: prompts[slot][fed[slot] % 6 : fed[slot] % 6 + 1] for slot in busy}
            reset = {slot for slot in busy if fed[slot] == 0}
            out = driver.run(chunks, reset=reset, prompt=set(busy), emit=set(busy), sampling=params, num_top=5)
            for slot in busy:
                fed[slot] += 1
            idle = [slot for slot in range(SLOTS) if slot not in busy]
            assert np.asarray(out.count)[idle].tolist() == [0]
            outs.append([np.asarray(getattr(out, name))[list(busy)] for name in ("tokens", "top_ids", "top_logprobs")])
        emitted.append(outs)
    for full, few in zip(*emitted, strict=True):
        np.testing.assert_array_equal(full[0], few[0])
        np.testing.assert_array_equal(full[1], few[1])
        np.testing.assert_allclose(full[2], few[2], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("slots", "tokens", "width", "busy"), [(6, 4, 1, 4), (6, 4, 1, 2), (6, 6, 1, 0), (5, 9, 1, 0), (4, 12, 3, 0)]
)
def test_lane_free_steps_read_their_rows_in_place(slots, tokens, width, busy):
    """pack_spans lays a lane-free step so that the narrow group's sequences read the flat rows as they lie (a slot
    at slot * width where every slot has room, else the busy slots in turn); attention over those rows as they lie
    equals attention over the gathered rows, padding tokens zero."""
    rng = np.random.default_rng(tokens)
    if tokens >= slots * width:
        counts = rng.integers(0, width + 1, slots).astype(np.int32)
    else:  # `busy` slots packed in turn, each bringing `width` tokens (sequence n at n * width), the rest padding
        counts = np.zeros(slots, np.int32)
        counts[rng.choice(slots, busy, replace=False)] = width
    _, starts, *_ = pack_spans(
        np.zeros((slots, width), np.int32),
        counts,
        np.zeros(slots, bool),
        width=width,
        lane_width=1,
        tokens=tokens,
        lanes=0,
    )
    if tokens >= slots * width:
        assert starts.tolist() == (np.arange(slots) * width).tolist()
        replicas = pack_spans(
            np.zeros((2 * slots, width), np.int32),
            np.tile(counts, 2),
            np.zeros(2 * slots, bool),
            width=width,
            lane_width=1,
            tokens=tokens,
            lanes=0,
            replicas=2,
        )[1]
        assert replicas.tolist() == 2 * starts.tolist()  # replica-local
    lengths = jnp.asarray(rng.integers(0, 50, slots), jnp.int32)
    table = jnp.arange(slots, dtype=jnp.int32)[:, None]
    chunks = [Chunk.make(lengths, jnp.asarray(counts), table, jnp.asarray(starts), None, width=width, tokens=tokens,
                         kernel_size=4, ordered=ordered) for ordered in (False, True)]  # fmt: skip
    q, rel = (jnp.asarray(rng.normal(size=(1, tokens, 2, d)), jnp.float32) for d in (8, 3))
    sinks = jnp.asarray(rng.normal(size=(1, tokens, 2)), jnp.float32)

    def attend(q, rel, sinks, kv_lens, query_lens, table, slots):  # [N, W, ...]; zeros at padding queries
        value = q + rel.sum(-1, keepdims=True) + sinks[..., None] + (kv_lens + 100 * slots)[:, None, None, None]
        return jnp.where((jnp.arange(q.shape[1])[None, :] < query_lens[:, None])[..., None, None], value, 0.0)

    gathered, in_place = (grouped_attention(chunk, attend, q, rel, sinks) for chunk in chunks)
    np.testing.assert_array_equal(np.asarray(in_place), np.asarray(gathered))
    assert np.count_nonzero(np.asarray(gathered)[0, :, 0, 0]) == counts.sum()


@pytest.mark.slow
def test_lanes_in_a_step_of_fewer_tokens_than_slots(model):
    """A prompt read through lanes in steps of two tokens among three slots emits what the same chunks emit in
    steps of a row per slot; an idle slot's feedback token stays the one before."""
    prompt = np.random.default_rng(5).integers(0, 500, 8).tolist()
    emitted = []
    for tokens in (None, 2):
        driver, outs = Driver(model, lanes=True, tokens=tokens), []
        for first in range(0, 8, 2):
            out = driver.run(
                {1: prompt[first : first + 2]}, reset={1} if first == 0 else (), prompt={1}, emit={1}, num_top=5
            )
            outs.append((np.asarray(out.top_ids[1]), np.asarray(out.top_logprobs[1]), np.asarray(out.last)))
        emitted.append(outs)
    for (ids, logprobs, _), (few_ids, few_logprobs, last) in zip(*emitted, strict=True):
        np.testing.assert_array_equal(ids, few_ids)
        np.testing.assert_allclose(logprobs, few_logprobs, rtol=1e-5, atol=1e-6)
        assert last[0] == last[2] == 0  # NO_PREVIOUS: idle slots keep it


@pytest.mark.slow
def test_no_compilation_after_warm_up(model):
    driver = Driver(model)
    driver.run({0: [1, 2, 3]}, reset={0}, prompt={0}, emit={0})  # warm-up: the one (slots, width) shape
    compiled = step._cache_size()
    rng = np.random.default_rng(3)
    lengths = [0] * SLOTS
    for _ in range(30):
        chunks, resets = {}, set()
        for slot in range(SLOTS):
            size = int(rng.integers(0, WIDTH + 1))
            if lengths[slot] + size > MAX_PAGES * 128 or rng.random() < 0.1:
                resets.add(slot)
                lengths[slot] = 0
            lengths[slot] += size
            if size:
                chunks[slot] = rng.integers(0, 500, size).tolist()
        driver.run(chunks, reset=resets, prompt=set(chunks), emit=set(chunks))
    jax.block_until_ready(driver.state)
    assert step._cache_size() == compiled


@pytest.mark.slow
def test_the_state_is_updated_in_place(model):
    """The donated decode state aliases the step's output: no copy of the K/V pool per step."""
    graphdef, params = nnx.split(model)
    slots, width = 2, 4
    state = init_state(model.config, CacheLayout(slots, 512, 8, width), jnp.float32)
    flags = (jnp.zeros(slots, bool) for _ in range(7))
    no_lanes = jnp.zeros(0, jnp.int32)
    batch = StepBatch(
        jnp.zeros(slots * width, jnp.int32),
        jnp.ones(slots, jnp.int32),
        jnp.arange(slots) * width,
        no_lanes,
        no_lanes,
        no_lanes,
        *flags,
        jnp.zeros((slots, 8), jnp.int32),
        SamplingParams.neutral(slots),
    )
    lowered = step.lower(graphdef, params, state, batch, jnp.zeros(slots, jnp.int32), width=width)
    memory = lowered.compile().memory_analysis()
    assert memory.alias_size_in_bytes >= state.nbytes - 1024
    if jax.default_backend() == "cpu":
        # XLA:GPU (JAX 0.11.2, H200) stages this fp32 model's page scatter through a copy of the pools; a
        # bf16 model whose attention runs the Mosaic GPU kernel updated its state in place there (68 MB
        # state, 0.4 MB of temporaries: the closing note of issue 8)
        assert memory.temp_size_in_bytes < 0.1 * state.nbytes


@pytest.mark.slow
def test_fused_attention_projections_give_the_same_logits(checkpoint):
    """The engine's fused projections (query side on every layer, K and V on sliding ones) on a bf16 model of both
    layer kinds: the unfused model's logits bit for bit, on fresh random tokens."""
    from inkling_jax.model.attention import Attention, fuse_attention_projections

    model = load_causal_lm(checkpoint, jnp.bfloat16)[1]
    tokens = jax.random.randint(jax.random.key(31), (2, 19), 0, model.config.unpadded_vocab_size)
    want = np.asarray(logits_fn(model)(tokens), np.float32)
    fuse_attention_projections(model)
    layers = [module for _, module in nnx.iter_graph(model) if isinstance(module, Attention)]
    assert {layer.sliding for layer in layers} == {True, False}
    for layer in layers:
        assert hasattr(layer, "query_side") and not hasattr(layer, "q_proj")
        assert hasattr(layer, "key_value") == layer.sliding == (not hasattr(layer, "k_proj"))
    np.testing.assert_array_equal(np.asarray(logits_fn(model)(tokens), np.float32), want)
