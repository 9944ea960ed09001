"""On-device sampling: filters, penalties, seeds and log-probabilities, on fresh random logits."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inkling_jax.sampling import SamplingParams, filtered_logits, most_likely, penalize, sample

VOCAB = 12


def params_for(slots: int, **values) -> SamplingParams:
    neutral = SamplingParams.neutral(slots)
    return dataclasses.replace(neutral, **{k: jnp.full(slots, v, getattr(neutral, k).dtype) for k, v in values.items()})


def expected_distribution(logits, temperature, top_k, top_p, min_p):
    """The filtered distribution, written from the definitions (vLLM's order: temperature, then filters)."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled[order].max())
    probs /= probs.sum()
    keep = np.ones(len(probs), bool)
    if top_k > 0:
        keep[top_k:] = False
    keep &= np.concatenate([[0.0], np.cumsum(probs)[:-1]]) < top_p
    keep &= probs >= min_p * probs[0]
    filtered = np.where(keep, probs, 0.0)
    result = np.zeros(len(probs))
    result[order] = filtered / filtered.sum()
    return result


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.1), (0.8, 6, 0.9, 0.02)],
)
def test_samples_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, VOCAB).astype(np.float32)
    draws = 8000
    params = params_for(draws, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=7)
    zeros = jnp.zeros((draws, VOCAB), jnp.int32)
    out = jax.jit(sample)(
        jnp.tile(logits, (draws, 1)), params, zeros, zeros.astype(bool), jnp.arange(draws, dtype=jnp.int32)
    )
    frequencies = np.bincount(np.asarray(out.tokens), minlength=VOCAB) / draws
    want = expected_distribution(logits, temperature, top_k, top_p, min_p)
    assert np.all(frequencies[want == 0] == 0)
    np.testing.assert_allclose(frequencies, want, atol=4.5 * np.sqrt(0.25 / draws))


@pytest.mark.slow
def test_a_seeded_request_ignores_its_slot_and_batch():
    rng = np.random.default_rng(1)
    ours = rng.normal(size=VOCAB).astype(np.float32)
    step = jax.jit(sample, static_argnames="num_top")
    results = []
    for slot, others in ((0, 3), (2, 4), (5, 7)):
        batch = rng.normal(size=(others + 1, VOCAB)).astype(np.float32)
        batch[slot] = ours
        params = params_for(others + 1, temperature=0.9, top_p=0.95)
        params = dataclasses.replace(params, seed=params.seed.at[slot].set(1234))
        generated = jnp.asarray(rng.integers(0, 50, others + 1), jnp.int32).at[slot].set(17)
        zeros = jnp.zeros((others + 1, VOCAB), jnp.int32)
        out = step(jnp.asarray(batch), params, zeros, zeros.astype(bool), generated, num_top=3)
        results.append((int(out.tokens[slot]), float(out.logprobs[slot])))
    assert len(set(results)) == 1
    zeros = jnp.zeros((1, VOCAB), jnp.int32)
    draws = [
        int(
            step(
                jnp.asarray(ours[None]),
                params_for(1, temperature=1.0, seed=seed),
                zeros,
                zeros.astype(bool),
                jnp.asarray([17], jnp.int32),
            ).tokens[0]
        )
        for seed in range(40)
    ]
    assert len(set(draws)) > 3  # different seeds, different streams


def test_penalties_match_their_definitions():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, VOCAB)).astype(np.float32)
    counts = rng.integers(0, 3, size=(3, VOCAB)).astype(np.int32)
    prompt = rng.random((3, VOCAB)) < 0.3
    params = dataclasses.replace(
        SamplingParams.neutral(3),
        repetition_penalty=jnp.asarray([1.0, 1.3, 0.8]),
        presence_penalty=jnp.asarray([0.5, 0.0, -0.2]),
        frequency_penalty=jnp.asarray([0.0, 0.25, 0.1]),
    )
    got = np.asarray(penalize(jnp.asarray(logits), params, jnp.asarray(counts), jnp.asarray(prompt)))
    want = logits.astype(np.float64).copy()
    for s in range(3):
        for v in range(VOCAB):
            if prompt[s, v] or counts[s, v] > 0:
                r = float(params.repetition_penalty[s])
                want[s, v] = want[s, v] / r if want[s, v] > 0 else want[s, v] * r
            want[s, v] -= float(params.frequency_penalty[s]) * counts[s, v]
            want[s, v] -= float(params.presence_penalty[s]) * (counts[s, v] > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_greedy_and_logprobs():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    counts = np.zeros((4, VOCAB), np.int32)
    counts[1, logits[1].argmax()] = 2  # a repeated best token loses to the frequency penalty
    penalties = {"frequency_penalty": jnp.asarray([0.0, 50.0, 0.0, 0.0])}
    expected = logits.argmax(-1)
    expected[1] = np.argsort(-logits[1])[1]
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for asked in (4, 0):  # with no slot asking for top log-probabilities the step skips their search
        out = sample(
            jnp.asarray(logits),
            dataclasses.replace(SamplingParams.neutral(4, logprobs=asked), **penalties),
            jnp.asarray(counts),
            jnp.zeros((4, VOCAB), bool),
            jnp.zeros(4, jnp.int32),
            num_top=4,
        )
        np.testing.assert_array_equal(np.asarray(out.tokens), expected)
        np.testing.assert_allclose(np.asarray(out.logprobs), logprobs[np.arange(4), expected], rtol=1e-5)
    out = sample(
        jnp.asarray(logits),
        dataclasses.replace(SamplingParams.neutral(4, logprobs=4), **penalties),
        jnp.asarray(counts),
        jnp.zeros((4, VOCAB), bool),
        jnp.zeros(4, jnp.int32),
        num_top=4,
    )
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-logits, axis=-1)[:, :4])
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-logprobs, axis=-1)[:, :4], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("n", "vocab"), [(0, 1000), (7, 1000), (16, 1000), (20, 1000), (40, 1000), (1, 5000), (20, 12411), (20, 90001)]
)
def test_most_likely_is_top_k(n, vocab):
    """The rounds of at most 16 (and a long row's chunks, twice over at 90001) give lax.top_k's values and ids, in
    its order: ties at the top, across a round's and a chunk's edge, of many chunks' maxima, signed zeros, -inf,
    and fewer chunks with a finite maximum than n."""
    rng = np.random.default_rng(n + vocab)
    logprobs = rng.standard_normal((4, 2, vocab)).astype(np.float32)
    logprobs[1, 0, rng.choice(vocab, 30, replace=False)] = 9.0  # 30 tied values at the top
    logprobs[2, 1, 60:70] = 8.0  # ties across the edge of the first chunk
    logprobs[3, 0] = np.round(logprobs[3, 0])  # ties everywhere: many chunks share their maximum
    logprobs[3, 1, rng.choice(vocab, vocab // 2, replace=False)] = -np.inf
    logprobs[0, 1, 64:] = -np.inf  # all finite values in one chunk: the other chunks' maxima are -inf
    logprobs[1, 1] = -1 - np.abs(logprobs[1, 1])  # signed zeros on top: -0.0 first in every chunk, 0.0 next in
    logprobs[1, 1, 11::64] = -0.0  # every other one (lax.top_k ranks 0.0 above -0.0; XLA's max may not)
    logprobs[1, 1, 14::128] = 0.0
    values, ids = most_likely(jnp.asarray(logprobs), n)
    expected_values, expected_ids = jax.lax.top_k(jnp.asarray(logprobs), n)
    assert ids.dtype == jnp.int32 and values.shape == ids.shape == (4, 2, n)
    np.testing.assert_array_equal(values, expected_values)
    np.testing.assert_array_equal(ids, expected_ids)


@pytest.mark.slow
def test_top_k_and_top_p_keep_what_their_definitions_keep():
    """Rows of a large vocabulary with ties, each with its own top-k and top-p: the kept tokens are those the sorted
    definition keeps (the first k; every token whose mass before it is below top_p; ties of the last one kept),
    but where a token's mass before it lies within float32 rounding of top_p."""
    rng = np.random.default_rng(11)
    slots, vocab = 12, 3000
    logits = rng.standard_normal((slots, vocab)).astype(np.float32) * 3
    logits[1, rng.choice(vocab, 40, replace=False)] = logits[1].max() + 1  # 40 tied tokens on top
    logits[2] = np.round(logits[2])  # many ties everywhere
    top_k = np.asarray([0, 25, 7, 1, vocab, vocab + 5, 0, 0, 40, 3, 0, 100], np.int32)
    top_p = np.asarray([0.5, 1.0, 0.9, 1.0, 1.0, 0.3, 0.99, 1e-6, 0.7, 1.0, 1.0, 0.95], np.float32)
    params = dataclasses.replace(params_for(slots, temperature=0.8), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p))
    kept = np.isfinite(np.asarray(filtered_logits(jnp.asarray(logits), params)))
    for row in range(slots):
        scaled = logits[row].astype(np.float64) / 0.8
        order = np.argsort(-scaled, kind="stable")
        probs = np.exp(scaled[order] - scaled[order].max())
        probs /= probs.sum()
        before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        keep = before < top_p[row]
        if top_k[row] > 0:
            keep[top_k[row] :] = False
        floor = scaled[order][keep].min()
        want = scaled >= floor
        borderline = np.zeros(vocab, bool)
        borderline[order] = np.abs(before - top_p[row]) < 1e-5
        assert np.array_equal(kept[row] | borderline, want | borderline), row
        assert kept[row].sum() >= 1


@pytest.mark.slow
def test_a_slot_gets_alone_what_it_gets_in_any_mixed_batch():
    """The batch decides whether the penalties, the top-k / top-p search, the draw and the search for top
    log-probabilities run at all; a slot's token and log-probabilities do not depend on which of them its
    neighbours switch on."""
    rng = np.random.default_rng(5)
    slots = [
        {},  # greedy, nothing on
        {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "logprobs": 3},  # greedy with penalties
        {"temperature": 0.8, "seed": 11},  # plain sampling
        {"temperature": 1.1, "top_k": 4, "seed": 12, "logprobs": 2},
        {"temperature": 0.9, "top_p": 0.7, "min_p": 0.05, "presence_penalty": 0.5, "seed": 13},
    ]
    logits = rng.normal(0, 2.0, (len(slots), VOCAB)).astype(np.float32)
    counts = rng.integers(0, 3, (len(slots), VOCAB)).astype(np.int32)
    prompt = rng.random((len(slots), VOCAB)) < 0.3
    generated = rng.integers(0, 40, len(slots)).astype(np.int32)
    step = jax.jit(sample, static_argnames="num_top")
    top = [slot.get("logprobs", 0) for slot in slots]

    def run(rows):
        params = SamplingParams.neutral(len(rows))
        for field in dataclasses.fields(SamplingParams):
            column = np.asarray(getattr(params, field.name)).copy()
            for i, row in enumerate(rows):
                column[i] = slots[row].get(field.name, column[i])
            params = dataclasses.replace(params, **{field.name: jnp.asarray(column)})
        out = step(
            jnp.asarray(logits[rows]),
            params,
            jnp.asarray(counts[rows]),
            jnp.asarray(prompt[rows]),
            jnp.asarray(generated[rows]),
            num_top=3,
        )
        return {
            row: (int(out.tokens[i]), float(out.logprobs[i]), tuple(np.asarray(out.top_ids[i])[: top[row]]))
            for i, row in enumerate(rows)
        }

    alone = {row: run([row])[row] for row in range(len(slots))}
    for rows in ([0, 1], [0, 2], [1, 3], [4, 0, 2], list(range(len(slots)))):
        assert run(rows) == {row: alone[row] for row in rows}


def packed_bits(keep: np.ndarray) -> np.ndarray:
    """[S, V] bool -> [S, ceil(V / 32)] int32 words, bit t % 32 of word t // 32 for token t."""
    padded = np.zeros((keep.shape[0], -(-keep.shape[1] // 32) * 32), bool)
    padded[:, : keep.shape[1]] = keep
    weights = np.left_shift(np.uint64(1), np.arange(32, dtype=np.uint64))
    words = (padded.reshape(keep.shape[0], -1, 32) * weights).sum(axis=-1).astype(np.uint32)
    return words.view(np.int32)


def test_a_constraint_keeps_greedy_and_draws_to_its_tokens():
    rng = np.random.default_rng(12)
    vocab, draws = 45, 6000  # two mask words, the second one partly past the vocabulary
    logits = rng.normal(0, 1.5, vocab).astype(np.float32)
    keep = rng.random(vocab) < 0.3
    keep[np.argmax(np.where(keep, -np.inf, logits))] = False  # the unconstrained best token is left out
    params = params_for(draws, temperature=0.9, seed=3, logprobs=3)
    params = dataclasses.replace(params, temperature=params.temperature.at[:2].set(0.0))  # two greedy rows
    rows = np.tile(keep, (draws, 1))
    rows[-1] = True  # one row of -1: unconstrained
    allowed = jnp.asarray(packed_bits(rows))
    zeros = jnp.zeros((draws, vocab), jnp.int32)
    tiled = jnp.tile(logits, (draws, 1))
    generated = jnp.arange(draws, dtype=jnp.int32)
    sampler = functools.partial(jax.jit(sample, static_argnames="num_top"), tiled, params, zeros, zeros.astype(bool))
    out, free = sampler(generated, 3, allowed), sampler(generated, 3)
    tokens = np.asarray(out.tokens)
    assert tokens[0] == tokens[1] == np.argmax(np.where(keep, logits, -np.inf))
    assert np.all(keep[tokens[:-1]])
    assert tokens[-1] == np.asarray(free.tokens)[-1]  # an unconstrained row beside constrained ones
    expected = np.where(keep, np.exp(logits / 0.9), 0.0)
    frequencies = np.bincount(tokens[2:-1], minlength=vocab) / (draws - 3)
    np.testing.assert_allclose(frequencies, expected / expected.sum(), atol=4.5 * np.sqrt(0.25 / draws))
    for name in ("logprobs", "top_ids", "top_logprobs"):  # the model's own distribution, whatever is allowed
        got, raw = np.asarray(getattr(out, name)), np.asarray(getattr(free, name))
        np.testing.assert_array_equal(got[-1], raw[-1])
        if name != "logprobs":
            np.testing.assert_array_equal(got[0], raw[0])
    logprobs = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    np.testing.assert_allclose(np.asarray(out.logprobs)[:-1], logprobs[tokens[:-1]], rtol=1e-5, atol=1e-6)
    everything = jnp.full_like(allowed, -1)
    same = sampler(generated, 3, everything)
    np.testing.assert_array_equal(np.asarray(same.tokens), np.asarray(free.tokens))
