"""Lossless speculative verification: the draft's sampler and the target's acceptance rule, per slot.

One round verifies γ drafts x_0 … x_{γ−1} of every slot against the target's logits z_0 … z_γ for the
K = γ + 1 positions [anchor, x_0, …, x_{γ−1}] (z_k predicts the token after the k-th input). With p_k the
distribution plain sampling would draw from at position k (the same penalties, temperature, top-k, top-p
and min-p as `inkling_jax.sampling.sample`) and q_k the exact distribution x_k was drawn from:

    for k = 0 … γ−1: accept x_k with probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection emit
                     y ~ normalize(max(0, p_k − q_k)) and stop
    if every draft passes: emit the bonus y ~ p_γ

At any position reached, P(emit v) = min(p, q)(v) + (p − min(p, q))(v) = p(v), so by the chain rule the
emitted tokens follow the target alone, whatever the draft is, as long as q is what x was sampled from
(after the draft's own bias, temperature and filters; never an approximation of it). A greedy request
(temperature 0) accepts while x_k equals the argmax of the penalized logits and emits that argmax, which is
plain greedy decoding token for token.

Randomness: the k-th token of a round has index `generated + k` in its request; its noise is
`fold_in(request_keys(seed, index), purpose)`, with one purpose each for the draft's sample, the
acceptance uniform and the residual / bonus sample. A request's stream thus depends only on its seed and
its token indices, never on its slot or batch, and the streams of different purposes are independent.
Noise at indices past the emitted tokens is drawn again in the next round; that is exact, because nothing
emitted depended on it. How many drafts a slot verifies (`num_drafts`) must not depend on the noise or
the target's logits of the round (choosing it from earlier rounds is fine).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from inkling_jax.cache import KVCache
from inkling_jax.model.attention import read_draft_context
from inkling_jax.model.text import CausalLM
from inkling_jax.sampling import (
    SamplingParams,
    allowed_only,
    any_slot,
    filtered_logits,
    most_likely_if_asked,
    penalize,
    request_keys,
)
from pallas_kernels.numerics import log_softmax, softmax, total

# --speculative: no speculation, DSpark drafts sampled from the draft's distribution, or its argmax
SPECULATIVE_MODES = ("none", "dspark", "dspark-greedy")


class SpeculationError(ValueError):
    """Speculation the engine's shapes cannot do (the model's draft is checked by `require_draft`)."""


# fold_in tags separating a token index's independent noise streams (plain `sample` uses the unfolded key)
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
    """One verified round. Slot s emits tokens[s, :num_accepted[s] + 1]: its accepted drafts, then the
    residual sample at the first rejection or the bonus token. Later entries are V (out of vocabulary,
    so a scatter with mode="drop" skips them) with log-probability 0. The last emitted token is the
    next round's anchor."""

    num_accepted: jax.Array  # [S] int32, 0 … num_drafts
    tokens: jax.Array  # [S, K] int32
    logprobs: jax.Array  # [S, K] float32, of each emitted token under the model's raw distribution
    top_ids: jax.Array  # [S, K, n] int32, the n most likely tokens at each position
    top_logprobs: jax.Array  # [S, K, n] float32


def vocab_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """probs [S, V] in vocabulary order: the distribution `sample` draws from at temperature > 0
    (softmax of the temperature-scaled logits restricted by top-k, top-p and min-p)."""
    return softmax(filtered_logits(logits, params))


def token_keys(seed: jax.Array, first: jax.Array, count: int, purpose: int) -> jax.Array:
    """keys [S, count]: the `purpose` stream of each slot's tokens number first … first + count − 1.

    seed [S] uint32; first [S] int32."""
    index = first[:, None] + jnp.arange(count, dtype=first.dtype)  # [S, count]
    keys = jax.vmap(request_keys, in_axes=(None, 1), out_axes=1)(seed, index)
    return jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(0, None)), in_axes=(0, None))(keys, purpose)


def sample_draft(
    logits: jax.Array, params: SamplingParams, generated: jax.Array, greedy: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(tokens [S] int32, q [S, V] float32): one draft token per slot and the exact distribution it was
    drawn from, which `verify` needs as `draft_probs`.

    logits [S, V]: the draft's logits for this draft position, after any bias or penalties the caller
    applies (they need not match the target's; only q must be exact). The request's temperature, top-k,
    top-p and min-p apply as in `sample`. generated [S] int32: the index of the drafted token in its request
    (round's `generated` + draft position). greedy (static): draft the argmax, q one-hot, at any temperature.
    Greedy requests (temperature 0) always draft the argmax.
    """
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    one_hot = jax.nn.one_hot(argmax, logits.shape[-1], dtype=jnp.float32)
    if greedy:
        return argmax, one_hot
    q = vocab_probs(logits, params)  # drawn from exactly, via its logarithm
    sampled = jax.vmap(jax.random.categorical)(token_keys(params.seed, generated, 1, DRAFT)[:, 0], jnp.log(q))
    sampling = params.temperature > 0
    return jnp.where(sampling, sampled, argmax).astype(jnp.int32), jnp.where(sampling[:, None], q, one_hot)


def propose(
    model: CausalLM,
    anchors: jax.Array,
    kv: KVCache,
    lengths: jax.Array,
    page_table: jax.Array,
    params: SamplingParams,
    generated: jax.Array,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(drafts [S, γ] int32, q [S, γ, V] float32): the DSpark draft's γ tokens after each slot's anchor and
    the exact distribution each was drawn from.

    anchors [S]: the last sampled token of each slot, at position lengths [S] (not yet in the state); kv: the
    state holding the draft's context for the positions before it, through page_table [S, max pages] (any rows
    of the state's slots, with their lengths, sampling and generated); generated [S]: the index of
    the round's first emitted token in its request (draft k has index generated + k). One block pass
    gives every slot's hidden state, then the RNN head runs slot by slot, each bias reading the token
    just drafted: q_k = softmax of (U_k + bias_k) under the request's temperature and filters.
    """
    draft = model.dspark
    context_k, context_v, context_positions = read_draft_context(kv, page_table)
    h = draft.block_hidden(anchors, lengths, context_k, context_v, context_positions, model.model.embed_tokens)
    base = model.logits(h)  # [S, γ, V]
    gamma = h.shape[1]

    def slot(carry: tuple[jax.Array, jax.Array], k: jax.Array) -> tuple[tuple, tuple[jax.Array, jax.Array]]:
        state, previous = carry
        state, bias = draft.rnn_step(state, previous, h[:, k])
        token, q = sample_draft(base[:, k] + bias, params, generated + k, greedy)
        return (state, token), (token, q)

    _, (drafts, q) = jax.lax.scan(slot, (draft.initial_state(h), anchors), jnp.arange(gamma))
    return drafts.T, jnp.swapaxes(q, 0, 1)


def penalize_positions(
    logits: jax.Array, drafts: jax.Array, params: SamplingParams, output_counts: jax.Array, prompt_mask: jax.Array
) -> jax.Array:
    """logits [S, K, V] with position k penalized as `sample` would once x_0 … x_{k−1} were emitted.

    drafts [S, γ] (γ = K − 1); output_counts [S, V] and prompt_mask [S, V]: what `sample` would use for the
    token after the anchor (so the anchor is counted). Only the drafts' own columns see other counts than
    the round's, so those γ columns per position are penalized again with their counts at that position.
    """
    slots, positions, _ = logits.shape
    width = drafts.shape[1]
    base = jax.vmap(penalize, in_axes=(1, None, None, None), out_axes=1)(logits, params, output_counts, prompt_mask)
    earlier = (jnp.arange(width)[None, :] < jnp.arange(positions)[:, None]).astype(jnp.int32)  # [K, γ]: i < k
    same = (drafts[:, :, None] == drafts[:, None, :]).astype(jnp.int32)  # [S, γ, γ]: x_i == x_j
    extra = jnp.einsum("ki,sij->skj", earlier, same)  # [S, K, γ]: copies of x_j among x_0 … x_{k−1}
    columns = jnp.broadcast_to(drafts[:, None, :], (slots, positions, width))  # [S, K, γ]
    counts = jnp.take_along_axis(output_counts, drafts, axis=-1)[:, None, :] + extra
    seen = jnp.broadcast_to(jnp.take_along_axis(prompt_mask, drafts, axis=-1)[:, None, :], columns.shape)
    flat = (slots, positions * width)
    repenalized = penalize(
        jnp.take_along_axis(logits, columns, axis=-1).reshape(flat), params, counts.reshape(flat), seen.reshape(flat)
    ).reshape(columns.shape)
    return jnp.put_along_axis(base, columns, repenalized, axis=-1, inplace=False)  # duplicates agree


def constrain_positions(logits: jax.Array, rows: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [S, K, V] with -inf where allowed [R, K, W] leaves a token out of the slot that rows [R] names (S:
    none; `allowed_only` per position); only the named slots' logits are touched, in a round that names one."""
    slots, positions, vocab = logits.shape
    at = jnp.minimum(rows, slots - 1)

    def cut(logits: jax.Array) -> jax.Array:
        named = logits[at].reshape(-1, vocab)
        cut = allowed_only(named, allowed.reshape(named.shape[0], -1)).reshape(rows.shape[0], positions, vocab)
        return logits.at[rows].set(cut, mode="drop")

    return jax.lax.cond(any_slot(rows < slots), cut, lambda logits: logits, logits)


def accepts(u: jax.Array, p_x: jax.Array, q_x: jax.Array) -> jax.Array:
    """Whether a draft x passes, given u ~ U[0, 1): with probability min(1, p(x) / q(x)).

    q(x) = 0 cannot happen for a draft drawn from q; such a draft is rejected (as vLLM does), never taken
    as certain."""
    return (u * q_x < p_x) & (q_x > 0)


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """normalize(max(0, p − q)) [..., V]: what a rejection emits. Where it has no mass (p == q, up to
    rounding), a rejection has probability ≈ 0 and p itself is returned."""
    excess = jnp.maximum(p - q, 0.0)
    mass = total(excess, keepdims=True)
    return jnp.where(mass > 0, excess / jnp.where(mass > 0, mass, 1.0), p)


def verify(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    num_drafts: jax.Array,
    params: SamplingParams,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    generated: jax.Array,
    num_top: int = 0,
    allowed: tuple[jax.Array, jax.Array] | None = None,
) -> Verified:
    """Accept a prefix of every slot's drafts and sample the token after it, exactly as the target alone.

    target_logits [S, K, V] float32: raw logits at [anchor, x_0, …, x_{γ−1}]; draft_tokens [S, γ] int32
    (valid token ids everywhere, padding included); draft_probs [S, γ, V] float32: the exact q each draft was
    drawn from (`sample_draft`'s q); num_drafts [S] int32 in 0 … γ: how many leading drafts to consider
    (0: a plain decode step for that slot); output_counts [S, V], prompt_mask [S, V]: as `sample` would see
    them for the token after the anchor; generated [S] int32: the index of the round's first emitted token
    in its request (tokens generated before it); num_top (static): top log-probabilities to return; allowed
    (rows [R], masks [R, K, W] int32) or None: the tokens each position of the slots `rows` names (S: none) may
    emit, as `sample`'s packed bits, each position's row after the inputs before it (a row of -1: any); the other
    slots are unconstrained. A constraint cuts the target's logits where `sample` cuts them,
    so the emitted tokens follow the constrained target exactly: a refused draft has p(x) = 0 and is rejected,
    and neither the residual nor the bonus holds a refused token.
    """
    _, positions, vocab = target_logits.shape
    position = jnp.arange(positions)[None, :]  # [1, K]
    constrained = target_logits if allowed is None else constrain_positions(target_logits, *allowed)
    penalized = penalize_positions(constrained, draft_tokens, params, output_counts, prompt_mask)  # [S, K, V]
    p = jax.vmap(vocab_probs, in_axes=(1, None), out_axes=1)(penalized, params)  # [S, K, V]
    q = jnp.concatenate([draft_probs, jnp.zeros_like(p[:, :1])], axis=1)  # [S, K, V]; no draft at the last
    x = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)  # [S, K]
    p_x = jnp.take_along_axis(p, x[..., None], axis=-1)[..., 0]  # [S, K]
    q_x = jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.vmap(jax.random.uniform))(token_keys(params.seed, generated, positions, ACCEPT))  # [S, K]
    greedy = jnp.argmax(penalized, axis=-1).astype(jnp.int32)  # [S, K]
    sampling = params.temperature[:, None] > 0  # [S, 1]
    drafted = position < num_drafts[:, None]  # [S, K]
    passes = drafted & jnp.where(sampling, accepts(u, p_x, q_x), x == greedy)
    num_accepted = jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)  # [S]

    # the token after the accepted prefix: the residual where a draft was rejected, else p (the bonus)
    weights = jnp.where(drafted[..., None], residual(p, q), p)  # [S, K, V]
    noise = token_keys(params.seed, generated, positions, RESIDUAL)
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(noise, jnp.log(weights)).astype(jnp.int32)  # [S, K]
    final = jnp.where(sampling, drawn, greedy)
    accepted = num_accepted[:, None]
    tokens = jnp.where(position < accepted, x, jnp.where(position == accepted, final, vocab))

    logprobs = log_softmax(target_logits)
    chosen = jnp.take_along_axis(logprobs, jnp.minimum(tokens, vocab - 1)[..., None], axis=-1)[..., 0]
    top_values, top_ids = most_likely_if_asked(logprobs, params, num_top)
    return Verified(num_accepted, tokens, jnp.where(tokens < vocab, chosen, 0.0), top_ids.astype(jnp.int32), top_values)
