"""On-device sampling with per-request parameters, inside the jitted step.

For each slot: penalties (repetition over prompt and output tokens, presence and frequency over output
tokens, as vLLM defines them), then greedy (temperature 0) or sampling from the temperature-scaled
distribution restricted by top-k, top-p and min-p. A request's random stream depends only on its seed
and on how many tokens it has generated, never on its slot or the rest of the batch. Log-probabilities
are those of the model's own distribution (log-softmax of the raw logits), as vLLM reports by default.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from inkling_jax.sharding import DATA
from pallas_kernels.numerics import log_softmax, softmax, total


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-slot sampling parameters, each [S]. The neutral value of each disables it."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = all tokens
    top_p: jax.Array  # float32; 1 = all tokens
    min_p: jax.Array  # float32; 0 = all tokens
    repetition_penalty: jax.Array  # float32; 1 = off
    presence_penalty: jax.Array  # float32; 0 = off
    frequency_penalty: jax.Array  # float32; 0 = off
    seed: jax.Array  # uint32
    logprobs: jax.Array  # int32; how many top log-probabilities the slot returns (0: none)

    @classmethod
    def neutral(cls, slots: int, logprobs: int = 0) -> SamplingParams:
        """Greedy decoding with every filter and penalty off, for `slots` slots, each returning `logprobs` top
        log-probabilities."""
        zeros, ones, none = jnp.zeros(slots, jnp.float32), jnp.ones(slots, jnp.float32), jnp.zeros(slots, jnp.int32)
        tops = jnp.full(slots, logprobs, jnp.int32)
        return cls(zeros, none, ones, zeros, ones, zeros, zeros, jnp.zeros(slots, jnp.uint32), tops)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] float32, of the chosen token
    top_ids: jax.Array  # [S, n] int32, the n most likely tokens
    top_logprobs: jax.Array  # [S, n] float32


def any_slot(flags: jax.Array) -> jax.Array:
    """Whether any slot of the step raises its flag [S], over every data-parallel replica's slots (inside the
    step's map over them): the predicate of a conditional that every device must take alike, so that the
    collectives inside a branch meet."""
    found = jnp.any(flags)
    if DATA in jax.sharding.get_abstract_mesh().manual_axes:
        found = jax.lax.psum(found.astype(jnp.int32), DATA) > 0
    return found


def penalizing(params: SamplingParams) -> jax.Array:
    """[S] bool: the slots with a penalty on."""
    return (params.repetition_penalty != 1) | (params.presence_penalty != 0) | (params.frequency_penalty != 0)


def penalize(logits: jax.Array, params: SamplingParams, output_counts: jax.Array, prompt_mask: jax.Array) -> jax.Array:
    """logits [S, V] after repetition (prompt or output tokens), presence and frequency (output) penalties.

    output_counts [S, V] int32: how often each token was generated; prompt_mask [S, V] bool.
    """
    counts = output_counts.astype(jnp.float32)
    seen = prompt_mask | (output_counts > 0)
    repetition = params.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return logits - params.presence_penalty[:, None] * (counts > 0)


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """[S, V]: the temperature-scaled logits in vocabulary order, -inf outside top-k, top-p and min-p (each
    measured on the whole scaled distribution; a token tied with the last one top-k or top-p keeps is kept too).
    A greedy row (temperature 0, whose token is the argmax) is scaled by 1 and cut by min-p alone. The top-k and
    top-p search runs only in a batch where a sampling slot asks for one (it reads the vocabulary's rows many
    times)."""
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled = logits / temperature
    probs = softmax(scaled)
    keep = probs >= params.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    cutting = (params.temperature > 0) & ((params.top_k > 0) | (params.top_p < 1))

    def uncut(scaled: jax.Array, *_) -> jax.Array:
        return jnp.full_like(scaled[:, :1], -jnp.inf)

    floor = jax.lax.cond(any_slot(cutting), ranked_floor, uncut, scaled, probs, params)
    floor = jnp.where(cutting[:, None], floor, -jnp.inf)  # a greedy row's filters, whatever its neighbours ask
    return jnp.where(keep & (scaled >= floor), scaled, -jnp.inf)


def ranked_floor(scaled: jax.Array, probs: jax.Array, params: SamplingParams) -> jax.Array:
    """[S, 1]: each row's smallest scaled logit that top-k and top-p keep (-inf where neither cuts). In the order
    sorted from the largest, top-k keeps the first k and top-p every token whose mass before it is below top_p, so
    the floor is the larger of the k-th largest value and the largest value T whose mass at or above T reaches
    top_p. Both are found without a sort (a sort of the vocabulary costs more than any layer of a decode step): 32
    steps of a binary search over the values' order-preserving 32-bit keys, each step a count and a mass of the
    keys at or above a candidate (XLA:GPU makes a step over several bits' candidates at once a reduction that reads
    the rows once per candidate: slower than these 32 steps)."""
    keys = _ordered_keys(scaled)
    top_k, top_p = params.top_k[:, None], params.top_p[:, None]

    def halve(bit: int, found: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        at_k, at_p = (threshold | (jnp.uint32(1) << (31 - bit)).astype(jnp.uint32) for threshold in found)
        count = jnp.sum(keys >= at_k, axis=-1, keepdims=True, dtype=jnp.int32)
        mass = total(jnp.where(keys >= at_p, probs, 0.0), keepdims=True)
        return jnp.where(count >= top_k, at_k, found[0]), jnp.where(mass >= top_p, at_p, found[1])

    start = keys[:, :1] & jnp.uint32(0)  # zeros that vary over a mesh where the logits do
    by_k, by_p = jax.lax.fori_loop(0, 32, halve, (start, start))
    # a search that found no value (k past the vocabulary; a top_p the rounded mass never reaches) keeps all
    cut_k = (top_k > 0) & (by_k > 0)
    cut_p = (top_p < 1) & (by_p > 0)
    return jnp.maximum(
        jnp.where(cut_k, _from_ordered_keys(by_k), -jnp.inf), jnp.where(cut_p, _from_ordered_keys(by_p), -jnp.inf)
    )


def _ordered_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (larger float, larger key; -0.0 just below 0.0; every value's key,
    -inf's included, above 0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_ordered_keys(keys: jax.Array) -> jax.Array:
    """The inverse of `_ordered_keys`."""
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


TOP_K_ROUND = 16  # the most values per row XLA:GPU's TopK kernel takes (more is a sort of the whole row)
TOP_K_CHUNK = 64  # values per chunk of a long row's top-k


def most_likely(logprobs: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(logprobs, n)` over the last axis ([..., V] -> values, int32 ids [..., n]). A row longer than n
    chunks of TOP_K_CHUNK values is cut into chunks: its n best lie in the n chunks of the largest maxima, ties by
    index (every value of another chunk has those n maxima ahead of it), found the same way among the chunks'
    maxima; those chunks, in index order so that ties keep lax.top_k's order, hold the candidates. The chunks'
    maxima are one read of the row, where XLA:GPU's TopK kernel gives each row one block (slices of 4096 values in
    two stages are several times slower). Rows need n finite values."""
    vocab = logprobs.shape[-1]
    if n == 0 or vocab <= TOP_K_CHUNK * n:
        return _rounds(logprobs, n)
    chunks = -(-vocab // TOP_K_CHUNK)
    padding = [(0, 0)] * (logprobs.ndim - 1) + [(0, chunks * TOP_K_CHUNK - vocab)]
    chunked = jnp.pad(logprobs, padding, constant_values=-jnp.inf).reshape(*logprobs.shape[:-1], chunks, -1)
    maxima = _from_ordered_keys(jnp.max(_ordered_keys(chunked), axis=-1))  # lax.top_k's order: -0.0 < 0.0, NaN
    _, best = most_likely(maxima.astype(logprobs.dtype), n)
    best = jnp.sort(best, axis=-1)  # [..., n] chunk ids, ascending
    # a chunk named twice (fewer than n chunks with a finite maximum: the rounds pick masked ones again) is read once
    again = jnp.concatenate([jnp.zeros_like(best[..., :1], bool), best[..., 1:] == best[..., :-1]], axis=-1)
    candidates = jnp.where(again[..., None], -jnp.inf, jnp.take_along_axis(chunked, best[..., None], axis=-2))
    values, at = _rounds(candidates.reshape(*best.shape[:-1], -1), n)  # at: [..., n] among the n * CHUNK
    chunk = jnp.take_along_axis(best, at // TOP_K_CHUNK, axis=-1)
    return values, chunk * TOP_K_CHUNK + at % TOP_K_CHUNK


def most_likely_if_asked(logprobs: jax.Array, params: SamplingParams, n: int) -> tuple[jax.Array, jax.Array]:
    """`most_likely(logprobs, n)` ([S, ..., V] -> [S, ..., n] values and ids) in a batch where a slot returns top
    log-probabilities; in one where none does, zeros (never read) without the search (on a GPU, TopK kernels of
    one block per row at the end of every step)."""
    if n == 0:
        return most_likely(logprobs, n)

    def skipped(logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
        first = logprobs[..., :n]  # zeros like it: its type varies over a data-parallel map as the search's does
        return jnp.zeros_like(first), jnp.zeros_like(first, dtype=jnp.int32)

    return jax.lax.cond(any_slot(params.logprobs > 0), lambda x: most_likely(x, n), skipped, logprobs)


def _rounds(logprobs: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(logprobs, n)` in rounds of at most TOP_K_ROUND, each after the rounds before are masked out: at
    n = 20 over the vocabulary a single top_k is a full sort of every row on the GPU."""
    values, ids = [], []
    for first in range(0, max(n, 1), TOP_K_ROUND):
        if first:
            logprobs = jnp.put_along_axis(logprobs, ids[-1], -jnp.inf, axis=-1, inplace=False)
        top, at = jax.lax.top_k(logprobs, min(n - first, TOP_K_ROUND))
        values.append(top)
        ids.append(at)
    return jnp.concatenate(values, axis=-1), jnp.concatenate(ids, axis=-1).astype(jnp.int32)


def request_keys(seed: jax.Array, generated: jax.Array) -> jax.Array:
    """One PRNG key per slot, from the request's seed and its count of generated tokens."""
    return jax.vmap(lambda s, g: jax.random.fold_in(jax.random.key(s), g))(seed, generated)


def allowed_only(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [S, V] with -inf at every token its row of `allowed` ([S, ceil(V / 32)] int32, bit t % 32 of word
    t // 32 set for an allowed token t) leaves out."""
    slots, vocab = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    return jnp.where(bits.reshape(slots, -1)[:, :vocab] == 1, logits, -jnp.inf)


def sample(
    logits: jax.Array,
    params: SamplingParams,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    generated: jax.Array,
    num_top: int = 0,
    allowed: jax.Array | None = None,
) -> Sampled:
    """The next token of every slot.

    logits [S, V] float32; output_counts [S, V]; prompt_mask [S, V]; generated [S] int32 (tokens each
    request has produced so far); num_top: how many top log-probabilities to return (static); allowed [S, W] int32:
    the tokens each slot may take, as packed bits (`allowed_only`; a row of -1: every token; None: no constraint).
    A constraint cuts the logits before the penalties and filters, so that greedy takes the best allowed token and
    sampling draws from the allowed tokens' renormalized distribution; the log-probabilities stay the model's own.
    The masks, penalties, the draw and the search for top log-probabilities run only in a batch where a slot needs
    them (on a GPU the step's command buffers decide these branches on the device)."""
    logprobs = log_softmax(logits)
    if allowed is not None:
        constrained = jnp.any(allowed != -1, axis=-1)
        logits = jax.lax.cond(any_slot(constrained), allowed_only, lambda logits, _: logits, logits, allowed)
    penalized = jax.lax.cond(
        any_slot(penalizing(params)), penalize, lambda logits, *_: logits, logits, params, output_counts, prompt_mask
    )
    greedy = jnp.argmax(penalized, axis=-1).astype(jnp.int32)

    def drawn(penalized: jax.Array) -> jax.Array:
        keys = request_keys(params.seed, generated)
        return jax.vmap(jax.random.categorical)(keys, filtered_logits(penalized, params)).astype(jnp.int32)

    sampling = params.temperature > 0
    sampled = jax.lax.cond(any_slot(sampling), drawn, lambda _: greedy, penalized)
    tokens = jnp.where(sampling, sampled, greedy)
    top_values, top_ids = most_likely_if_asked(logprobs, params, num_top)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_values)
