"""Speculative verification emits exactly what the target alone would: the one-step law by exact algebra,
the joint law of the first emitted tokens by chi-square tests through the jitted rule on a toy Markov target
and draft (which deliberately broken variants must fail), under a toy grammar the constrained target's, greedy
equality (constrained too), and slot independence."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from xla_flags import OPTIMIZED_STEPS

from inkling_jax import speculative
from inkling_jax.sampling import SamplingParams, sample
from inkling_jax.speculative import accepts, residual, sample_draft, verify, vocab_probs

ALPHA = 1e-3  # a correct rule passes the chi-square test at this level (fixed seeds: deterministic)


def params_for(slots: int, **values) -> SamplingParams:
    neutral = SamplingParams.neutral(slots)
    return dataclasses.replace(neutral, **{k: jnp.full(slots, v, getattr(neutral, k).dtype) for k, v in values.items()})


def random_distributions(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(p, q) pairs [N, V]: random ones and the edge cases of the rule."""
    pairs = [
        (rng.dirichlet(np.full(vocab, a)), rng.dirichlet(np.full(vocab, a))) for a in (0.2, 1.0) for _ in range(40)
    ]
    one_hot = np.eye(vocab)
    for _ in range(10):
        p, q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
        holes = rng.random(vocab) < 0.4
        holes[0] = False
        pairs += [
            (p, np.where(holes, 0, q) / np.where(holes, 0, q).sum()),  # q = 0 where p > 0
            (np.where(holes, 0, p) / np.where(holes, 0, p).sum(), q),  # p = 0 where q > 0
            (p, p),
            (one_hot[rng.integers(vocab)], q),  # temperature → 0
            (p, one_hot[rng.integers(vocab)]),  # greedy drafting
            (one_hot[1], one_hot[1]),
        ]
    logits = jnp.asarray(rng.normal(0, 2, (20, vocab)), jnp.float32)
    top_k = np.asarray(vocab_probs(logits, params_for(20, temperature=0.7, top_k=3)))
    top_p = np.asarray(vocab_probs(logits[::-1], params_for(20, temperature=1.2, top_p=0.7, min_p=0.05)))
    pairs += list(zip(top_k, top_p, strict=True)) + list(zip(top_p, top_k, strict=True))  # filtered p and q
    p, q = (np.stack(side).astype(np.float32) for side in zip(*pairs, strict=True))
    return p, q


@pytest.mark.parametrize("vocab", [5, 8])
def test_one_step_law_is_exactly_p(vocab):
    """P(emit y) = q(y)·min(1, p(y)/q(y)) + (1 − Σ_v q(v)·min(1, p(v)/q(v)))·r(y), in float64 with the
    implementation's residual r, equals p for every case."""
    p, q = random_distributions(np.random.default_rng(vocab), vocab)
    r = np.asarray(residual(jnp.asarray(p), jnp.asarray(q))).astype(np.float64)
    p, q = p.astype(np.float64), q.astype(np.float64)
    np.testing.assert_allclose(r.sum(-1), 1.0, atol=1e-6)
    assert np.all(r >= 0)
    kept = q * np.minimum(1.0, np.divide(p, q, out=np.ones_like(p), where=q > 0))  # q(y)·P(accept y)
    law = kept + (1.0 - kept.sum(-1, keepdims=True)) * r
    np.testing.assert_allclose(law, p, atol=1e-6, rtol=0)


def test_acceptance_is_the_ratio_threshold():
    """accepts(u, p, q) is u < p/q (probability min(1, p/q)) away from rounding at the threshold, and
    rejects what q could not have drawn."""
    rng = np.random.default_rng(1)
    u, p_x, q_x = rng.random(100_000), rng.random(100_000), rng.random(100_000)
    p_x[:1000], q_x[1000:2000] = 0.0, 0.0
    got = np.asarray(accepts(*(jnp.asarray(a, jnp.float32) for a in (u, p_x, q_x))))
    ratio = np.divide(p_x, q_x, out=np.zeros_like(p_x), where=q_x > 0)
    clear = np.abs(u - ratio) > 1e-5
    np.testing.assert_array_equal(got[clear], (u < ratio)[clear])
    assert not got[1000:2000].any()


# --- joint law of the first emitted tokens: a toy Markov target and a sequential (Markov) draft ---

VOCAB, GAMMA, FIRST, SLOTS, ANCHOR, GENERATED = 6, 3, 3, 200_000, 2, 3
_toy = np.random.default_rng(10)
TARGET = _toy.normal(0, 1.2, (VOCAB, VOCAB)).astype(np.float32)  # logits of the next token given the last
DRAFT_BASE = _toy.normal(0, 0.6, (GAMMA, VOCAB)).astype(np.float32)  # per draft position
DRAFT_BIAS = _toy.normal(0, 1.0, (VOCAB, VOCAB)).astype(np.float32)  # on the previous draft token
PROMPT = np.isin(np.arange(VOCAB), [0, 4])
ALLOWED = np.random.default_rng(12).random((VOCAB, VOCAB)) < 0.5  # a toy grammar: the tokens allowed after each
ALLOWED[np.arange(VOCAB), (np.arange(VOCAB) + 1) % VOCAB] = True  # one, at least
COUNTS = np.bincount([ANCHOR, 1, 1], minlength=VOCAB)  # the anchor and two earlier outputs

CONFIGS = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.6": dict(temperature=0.6),
    "filters and penalties": dict(
        temperature=0.8,
        top_k=5,
        top_p=0.95,
        min_p=0.03,
        repetition_penalty=1.3,
        presence_penalty=0.3,
        frequency_penalty=0.2,
    ),
}


def exact_next(last: int, counts: np.ndarray, values: dict, constrained: bool = False) -> np.ndarray:
    """The target's next-token distribution, from the definitions, in float64 (under the toy grammar: restricted
    to the tokens it allows after `last` before the penalties and filters)."""
    logits = TARGET[last].astype(np.float64)
    if constrained:
        logits = np.where(ALLOWED[last], logits, -np.inf)
    seen = PROMPT | (counts > 0)
    repetition = values.get("repetition_penalty", 1.0)
    logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - values.get("frequency_penalty", 0.0) * counts - values.get("presence_penalty", 0.0) * (counts > 0)
    scaled = logits / values["temperature"]
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled[order].max())
    probs /= probs.sum()
    keep = np.arange(VOCAB) < (values.get("top_k", 0) or VOCAB)
    keep &= np.concatenate([[0.0], np.cumsum(probs)[:-1]]) < values.get("top_p", 1.0)
    keep &= probs >= values.get("min_p", 0.0) * probs[0]
    result = np.zeros(VOCAB)
    result[order] = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    return result


def exact_joint(values: dict, constrained: bool = False) -> np.ndarray:
    """P(y_1, y_2, y_3) [V**3] after the anchor, by the chain rule."""
    joint = np.zeros((VOCAB,) * FIRST)
    for cell in np.ndindex(*joint.shape):
        counts, last, prob = COUNTS.copy(), ANCHOR, 1.0
        for token in cell:
            prob *= exact_next(last, counts, values, constrained)[token]
            counts[token] += 1
            last = token
        joint[cell] = prob
    return joint.reshape(-1)


@functools.cache
def make_round():
    """A jitted speculative round of the toy: GAMMA sequential drafts, then verify against the target.

    greedy_draft (bool scalar): draft the argmax with a one-hot q. prebias_q (bool scalar): a broken draft
    that hands verify its q without the Markov bias, not the q it sampled from. constrained (bool scalar): verify
    under the toy grammar, each position's mask after its input (the drafts themselves unconstrained). Traced, so
    that every variant shares one compilation; compiled with LLVM's optimisations (the suite turns them off,
    tests/conftest.py): its rounds over 200,000 slots are run-bound."""
    target, base, bias = (jnp.asarray(t) for t in (TARGET, DRAFT_BASE, DRAFT_BIAS))
    masks = jnp.asarray(packed_bits(ALLOWED))  # [V, 1]: the allowed tokens after each token

    def round_(anchor, params, counts, prompt, generated, num_drafts, greedy_draft, prebias_q, constrained):
        def draft(last, k):
            logits = 0.6 * target[last] + base[k] + bias[last]  # [S, V]
            sampled, greedy = (sample_draft(logits, params, generated + k, greedy=g) for g in (False, True))
            x, q = (jnp.where(greedy_draft, g, s) for g, s in zip(greedy, sampled, strict=True))
            return x, (x, jnp.where(prebias_q, vocab_probs(logits - bias[last], params), q))

        _, (drafts, probs) = jax.lax.scan(draft, anchor, jnp.arange(GAMMA))  # [γ, S], [γ, S, V]
        drafts, probs = drafts.T, probs.transpose(1, 0, 2)
        inputs = jnp.concatenate([anchor[:, None], drafts], axis=1)  # [S, K]
        rows = jnp.where(constrained, jnp.arange(anchor.shape[0]), anchor.shape[0])  # every slot, or none
        out = verify(
            target[inputs], drafts, probs, num_drafts, params, counts, prompt, generated, 0, (rows, masks[inputs])
        )
        emitted = out.num_accepted + 1
        counts = counts.at[jnp.arange(counts.shape[0])[:, None], out.tokens].add(1, mode="drop")
        anchor = jnp.take_along_axis(out.tokens, out.num_accepted[:, None], axis=1)[:, 0]
        return drafts, out.tokens, emitted, anchor, counts, generated + emitted

    return jax.jit(round_, compiler_options=OPTIMIZED_STEPS)


def packed_bits(allowed: np.ndarray) -> np.ndarray:
    """[..., V] bool as `sample`'s allowed masks [..., ceil(V / 32)] int32."""
    words = -(-allowed.shape[-1] // 32)
    padded = np.zeros((*allowed.shape[:-1], 32 * words), bool)
    padded[..., : allowed.shape[-1]] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


def start(values: dict, num_drafts: np.ndarray) -> tuple:
    """The round's inputs for SLOTS independent requests, each right after the same anchor."""
    params = dataclasses.replace(params_for(SLOTS, **values), seed=jnp.arange(SLOTS, dtype=jnp.uint32))
    anchor = jnp.full(SLOTS, ANCHOR, jnp.int32)
    counts = jnp.asarray(np.broadcast_to(COUNTS, (SLOTS, VOCAB)), jnp.int32)
    prompt = jnp.asarray(np.broadcast_to(PROMPT, (SLOTS, VOCAB)))
    inputs = anchor, params, counts, prompt, jnp.full(SLOTS, GENERATED, jnp.int32), jnp.asarray(num_drafts, jnp.int32)
    return jax.device_put(inputs, jax.devices()[0])  # placed like the round's outputs: one compilation


@pytest.mark.slow
def test_verify_accepts_and_resamples_with_the_formula():
    """One draft per slot: the acceptance rate of each draft token is min(1, p(x)/q(x)), a rejection emits
    the residual, a full acceptance the bonus from p_1 (which depends on the accepted draft)."""
    values = CONFIGS["filters and penalties"]
    inputs = start(values, np.ones(SLOTS))
    drafts, tokens, emitted, *_ = (np.asarray(a) for a in make_round()(*inputs, False, False, False))
    x, accepted = drafts[:, 0], emitted == 2
    p = exact_next(ANCHOR, COUNTS, values)
    draft_logits = 0.6 * TARGET[ANCHOR] + DRAFT_BASE[0] + DRAFT_BIAS[ANCHOR]
    q = np.asarray(vocab_probs(jnp.asarray(draft_logits[None]), params_for(1, **values))[0], np.float64)
    np.testing.assert_array_equal(tokens[accepted, 0], x[accepted])
    np.testing.assert_array_equal(tokens[:, 2:], VOCAB)  # padding
    np.testing.assert_array_equal(tokens[~accepted, 1], VOCAB)
    for token in range(VOCAB):
        drawn = x == token
        assert (
            drawn.sum() == 0
            if q[token] == 0
            else abs(accepted[drawn].mean() - min(1.0, p[token] / q[token])) < (5 * np.sqrt(0.25 / drawn.sum()))
        )
    tolerance = 5 * np.sqrt(0.25 / (~accepted).sum())
    frequencies = np.bincount(tokens[~accepted, 0], minlength=VOCAB) / (~accepted).sum()
    np.testing.assert_allclose(frequencies, np.maximum(p - q, 0) / np.maximum(p - q, 0).sum(), atol=tolerance)
    for token in np.unique(x[accepted]):
        rows = accepted & (x == token)
        bonus = exact_next(token, COUNTS + np.eye(VOCAB, dtype=COUNTS.dtype)[token], values)
        frequencies = np.bincount(tokens[rows, 1], minlength=VOCAB) / rows.sum()
        np.testing.assert_allclose(frequencies, bonus, atol=5 * np.sqrt(0.25 / rows.sum()))


def first_tokens(
    round_fn, values: dict, greedy_draft: bool = False, prebias_q: bool = False, constrained: bool = False
) -> np.ndarray:
    """The first FIRST tokens each of SLOTS independent requests emits [S, FIRST], over as many rounds as
    needed. Each slot verifies a random (but fixed, so non-anticipating) number of drafts."""
    rng = np.random.default_rng(11)
    anchor, params, counts, prompt, generated, num_drafts = start(
        values, rng.choice(GAMMA + 1, SLOTS, p=[0.1, 0.2, 0.2, 0.5])
    )
    result = np.full((SLOTS, FIRST), -1)
    filled = np.zeros(SLOTS, np.int64)
    rows = np.broadcast_to(np.arange(SLOTS)[:, None], (SLOTS, GAMMA + 1))
    for _ in range(FIRST):  # every round emits at least one token
        _, tokens, emitted, anchor, counts, generated = round_fn(
            anchor, params, counts, prompt, generated, num_drafts, greedy_draft, prebias_q, constrained
        )
        tokens, emitted = np.asarray(tokens), np.asarray(emitted)
        columns = filled[:, None] + np.arange(GAMMA + 1)
        valid = (np.arange(GAMMA + 1)[None, :] < emitted[:, None]) & (columns < FIRST)
        result[rows[valid], columns[valid]] = tokens[valid]
        filled += emitted
    assert np.all(result >= 0)
    return result


def chi_square(tokens: np.ndarray, values: dict, constrained: bool = False) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of the observed joint against the exact one; cells the
    filters (or the grammar) exclude must stay empty, cells expecting fewer than 5 are pooled."""
    observed = np.bincount(np.ravel_multi_index(tokens.T, (VOCAB,) * FIRST), minlength=VOCAB**FIRST)
    expected = exact_joint(values, constrained) * len(tokens)
    assert observed[expected == 0].sum() == 0
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    if small.any():
        observed = np.append(observed[big], observed[small].sum())
        expected = np.append(expected[big], expected[small].sum())
    else:
        observed, expected = observed[big], expected[big]
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    dof = len(expected) - 1
    return statistic, float(stats.chi2.sf(statistic, dof)), dof


@pytest.mark.slow
@pytest.mark.parametrize(("name", "greedy_draft"), [(name, False) for name in CONFIGS] + [("temperature 1", True)])
def test_joint_of_the_first_tokens_is_the_targets(name, greedy_draft):
    values = CONFIGS[name]
    statistic, p_value, dof = chi_square(first_tokens(make_round(), values, greedy_draft), values)
    print(f"{name}, greedy draft {greedy_draft}: chi2 = {statistic:.1f}, dof {dof}, p = {p_value:.3g}")
    assert p_value > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("name", ["temperature 1", "filters and penalties"])
def test_joint_under_a_grammar_is_the_constrained_targets(name):
    """Verifying under each position's mask (drafts drawn without one) emits the constrained target's joint: the
    grammar's refused sequences never, the others as often as the target restricted to the grammar draws them."""
    values = CONFIGS[name]
    tokens = first_tokens(make_round(), values, constrained=True)
    statistic, p_value, dof = chi_square(tokens, values, constrained=True)
    print(f"{name} under the grammar: chi2 = {statistic:.1f}, dof {dof}, p = {p_value:.3g}")
    assert p_value > ALPHA
    assert exact_joint(values)[exact_joint(values, True) == 0].sum() > 0.3  # the grammar refuses likely sequences


@pytest.mark.slow
def test_broken_rules_fail_the_joint_test(monkeypatch):
    """The same test must reject (a) a rejection sampling p instead of the residual, (b) a q other than the
    one the draft sampled from (its pre-bias distribution)."""
    values = CONFIGS["temperature 1"]
    wrong_q = chi_square(first_tokens(make_round(), values, prebias_q=True), values)
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    from_p = chi_square(first_tokens(make_round.__wrapped__(), values), values)  # a fresh trace sees the patch
    for label, (statistic, p_value, dof) in (("residual -> p", from_p), ("pre-bias q", wrong_q)):
        critical = stats.chi2.isf(ALPHA, dof)
        print(f"{label}: chi2 = {statistic:.1f}, dof {dof}, critical {critical:.1f}, p = {p_value:.3g}")
        assert statistic > 3 * critical


# --- greedy and seeding ---


@pytest.mark.slow
@pytest.mark.parametrize("constrained", [False, True])
def test_greedy_emits_the_targets_greedy_decoding(constrained):
    """At temperature 0 the emitted tokens are plain greedy decoding (with penalties, filters ignored as in
    `sample`; under a grammar, plain constrained greedy decoding), whatever the drafts and their q, and the padding
    and log-probabilities are as documented."""
    vocab, slots, length = 12, 32, 10
    rng = np.random.default_rng(20)
    table = jnp.asarray(rng.normal(0, 1.0, (vocab, vocab)), jnp.float32)
    grammar = rng.random((vocab, vocab)) < (0.4 if constrained else 1.0)  # the tokens allowed after each
    grammar[np.arange(vocab), rng.integers(0, vocab, vocab)] = True
    masks = jnp.asarray(packed_bits(grammar))  # [V, 1]
    params = dataclasses.replace(
        params_for(slots, top_k=3, top_p=0.5, logprobs=2),
        repetition_penalty=jnp.asarray(rng.uniform(1.0, 1.6, slots), jnp.float32),
        presence_penalty=jnp.asarray(rng.uniform(0.0, 0.8, slots), jnp.float32),
        frequency_penalty=jnp.asarray(rng.uniform(0.0, 0.5, slots), jnp.float32),
    )
    prompt = jnp.asarray(rng.random((slots, vocab)) < 0.2)
    first = jnp.asarray(rng.integers(0, vocab, slots), jnp.int32)
    counts0 = jnp.zeros((slots, vocab), jnp.int32).at[jnp.arange(slots), first].add(1)
    rows = jnp.arange(slots)

    plain, last, counts = [], first, counts0
    sample_step = jax.jit(sample, static_argnames="num_top")  # one program, not each operation compiled on its own
    for t in range(length + GAMMA):
        token = sample_step(table[last], params, counts, prompt, jnp.full(slots, t, jnp.int32), 0, masks[last]).tokens
        plain.append(token)
        counts, last = counts.at[rows, token].add(1), token
    plain = np.stack(plain, axis=1)

    step = jax.jit(verify, static_argnames="num_top")
    emitted = np.zeros((slots, length + 2 * (GAMMA + 1)), np.int64)
    filled, anchor, counts, generated = np.zeros(slots, np.int64), first, counts0, jnp.zeros(slots, jnp.int32)
    accepted = 0
    while filled.min() < length:
        truth = np.take_along_axis(plain, np.minimum(filled[:, None] + np.arange(GAMMA), length + GAMMA - 1), axis=1)
        drafts = jnp.asarray(np.where(rng.random(truth.shape) < 0.3, rng.integers(0, vocab, truth.shape), truth))
        q = jnp.asarray(rng.dirichlet(np.ones(vocab), (slots, GAMMA)), jnp.float32)  # unrelated to the drafts
        inputs = jnp.concatenate([anchor[:, None], drafts.astype(jnp.int32)], axis=1)
        num_drafts = jnp.asarray(rng.integers(0, GAMMA + 1, slots), jnp.int32)
        out = step(
            table[inputs],
            inputs[:, 1:],
            q,
            num_drafts,
            params,
            counts,
            prompt,
            generated,
            num_top=2,
            allowed=(jnp.arange(slots), masks[inputs]),
        )
        tokens, a = np.asarray(out.tokens), np.asarray(out.num_accepted)
        assert np.all(a <= np.asarray(num_drafts))
        position = np.arange(GAMMA + 1)[None, :]
        assert np.all(tokens[position > a[:, None]] == vocab)
        logprobs = np.asarray(jax.nn.log_softmax(table[inputs], axis=-1))
        chosen = np.take_along_axis(logprobs, np.minimum(tokens, vocab - 1)[..., None], axis=-1)[..., 0]
        np.testing.assert_allclose(np.asarray(out.logprobs), np.where(position <= a[:, None], chosen, 0), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-logprobs, axis=-1, kind="stable")[..., :2])
        for s in range(slots):
            emitted[s, filled[s] : filled[s] + a[s] + 1] = tokens[s, : a[s] + 1]
        filled += a + 1
        accepted += a.sum()
        counts = counts.at[rows[:, None], out.tokens].add(1, mode="drop")
        anchor = jnp.take_along_axis(out.tokens, out.num_accepted[:, None], axis=1)[:, 0]
        generated = generated + out.num_accepted + 1
    np.testing.assert_array_equal(emitted[:, :length], plain[:, :length])
    assert accepted > slots  # drafts were accepted, not only corrected
    assert grammar[plain[:, :-1], plain[:, 1:]].all()


def random_round(rng: np.random.Generator, slots: int, vocab: int) -> tuple:
    """Inputs of `speculative_round` for `slots` requests with their own parameters, seeds and positions."""
    params = SamplingParams(
        temperature=jnp.asarray(rng.uniform(0.5, 1.5, slots), jnp.float32),
        top_k=jnp.asarray(rng.integers(0, 8, slots), jnp.int32),
        top_p=jnp.asarray(rng.uniform(0.7, 1.0, slots), jnp.float32),
        min_p=jnp.zeros(slots, jnp.float32),
        repetition_penalty=jnp.asarray(rng.uniform(1.0, 1.3, slots), jnp.float32),
        presence_penalty=jnp.zeros(slots, jnp.float32),
        frequency_penalty=jnp.asarray(rng.uniform(0.0, 0.3, slots), jnp.float32),
        seed=jnp.asarray(rng.integers(0, 2**31, slots), jnp.uint32),
        logprobs=jnp.asarray(rng.integers(0, 3, slots), jnp.int32),  # some return top log-probabilities
    )
    return (
        params,
        jnp.asarray(rng.integers(0, 100, slots), jnp.int32),  # generated
        jnp.asarray(rng.normal(0, 1.5, (slots, GAMMA, vocab)), jnp.float32),  # draft logits
        jnp.asarray(rng.normal(0, 1.5, (slots, GAMMA + 1, vocab)), jnp.float32),  # target logits
        jnp.asarray(rng.integers(0, 2, (slots, vocab)), jnp.int32),  # output counts
        jnp.asarray(rng.random((slots, vocab)) < 0.2),  # prompt mask
        jnp.asarray(rng.integers(0, GAMMA + 1, slots), jnp.int32),  # num_drafts
    )


@jax.jit
def speculative_round(params, generated, draft_logits, target, counts, prompt, num_drafts):
    drafts, q = jax.vmap(sample_draft, in_axes=(1, None, 0), out_axes=1)(
        draft_logits, params, generated + jnp.arange(GAMMA)[:, None]
    )  # [S, γ], [S, γ, V]
    return drafts, verify(target, drafts, q, num_drafts, params, counts, prompt, generated)


@pytest.mark.slow
def test_a_request_ignores_its_slot_and_batch():
    """Permuting the slots permutes the outputs, and other requests around one leave its outputs alone: a
    request's drafts, acceptances and samples depend only on its seed and token indices."""
    rng = np.random.default_rng(30)
    inputs = random_round(rng, 16, 12)
    drafts, out = speculative_round(*inputs)
    assert 0 < int(out.num_accepted.sum()) < int(inputs[-1].sum())  # the case is not trivial
    order = rng.permutation(16)
    moved_drafts, moved = speculative_round(*jax.tree.map(lambda a: a[order], inputs))
    np.testing.assert_array_equal(np.asarray(moved_drafts), np.asarray(drafts)[order])
    np.testing.assert_array_equal(np.asarray(moved.tokens), np.asarray(out.tokens)[order])
    np.testing.assert_array_equal(np.asarray(moved.num_accepted), np.asarray(out.num_accepted)[order])
    others = random_round(rng, 16, 12)  # new neighbours for slot 3's request, now in slot 0
    moved_drafts, moved = speculative_round(*jax.tree.map(lambda a, b: a.at[0].set(b[3]), others, inputs))
    np.testing.assert_array_equal(np.asarray(moved_drafts[0]), np.asarray(drafts[3]))
    np.testing.assert_array_equal(np.asarray(moved.tokens[0]), np.asarray(out.tokens[3]))
    np.testing.assert_array_equal(np.asarray(moved.logprobs[0]), np.asarray(out.logprobs[3]))
