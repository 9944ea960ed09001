"""The engine's pure step: continue every slot's sequence by a chunk of tokens and emit its next tokens.

    step(graphdef, params, state, batch, previous) -> (emitted, state)   # jitted once per (slots, width, mode)

A step's tokens are laid out [S, C]: slot s brings counts[s] real tokens (a prefill chunk, or the one
token a decoding sequence sampled last), padded to the bucket width C; a slot with counts 0 idles.
A decoding slot's token can come straight from the previous step's output on device (`feedback`), so
the host can dispatch the next step before it has read the last one's tokens.
Every slot that brings tokens samples from the logits after its last real token; where `emit` is set
the token counts as generated (penalties, seeded stream), elsewhere (a prompt's earlier chunks) it is
discarded.

A speculative step (`speculative=True`, C >= γ + 1) also lets the slots with `speculate` set run one
DSpark round from their one token (the anchor): the draft proposes γ tokens, the target verifies
[anchor, drafts] in the same pass as the other slots' chunks, and the slot emits its accepted drafts
and one more token (`inkling_jax.speculative`); its convolution states keep only the committed
prefix. The emitted tokens follow the target's distribution exactly. Other slots run as in a plain step
and sample from the same noise as a plain step, so a request's output does not depend on whether its
neighbours speculate.

Under a mesh with a `data` axis (set with `jax.set_mesh`), the slots and the page pool split into
data-parallel replicas: each replica steps its own slots against its own pages (page-table entries are
replica-local page ids), while parameters and activations split over `model` inside each replica.
The emitted outputs come back replicated, so every process of a multi-host run reads all of them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from inkling_jax.cache import DecodeState, commit_conv
from inkling_jax.model.attention import Chunk
from inkling_jax.sampling import Sampled, SamplingParams, sample
from inkling_jax.sharding import DATA, replica_specs
from inkling_jax.speculative import propose, verify


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """What the host sends each step (all [S, ...])."""

    token_ids: jax.Array  # [S, C] int32, the first counts[s] real
    counts: jax.Array  # [S] int32
    reset: jax.Array  # [S] bool: a new sequence starts in this slot (its state is cleared first)
    is_prompt: jax.Array  # [S] bool: the tokens are prompt tokens (they join the repetition-penalty set)
    emit: jax.Array  # [S] bool: the sampled token is kept (the prompt's last chunk, or decoding)
    feedback: jax.Array  # [S] bool: the slot's one token is what the previous step sampled for it
    replay: jax.Array  # [S] bool: the tokens are the sequence's earlier outputs, fed again after a preemption
    speculate: jax.Array  # [S] bool: a decoding slot runs a speculative round from its token (speculative steps)
    page_table: jax.Array  # [S, max pages] int32, host-owned page assignments
    sampling: SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Emitted:
    """What a step emits: slot s keeps tokens[s, :count[s]] (0 for a slot whose sample is discarded; 1 in a
    plain step; accepted drafts + 1 after a speculative round). Entries past count are padding."""

    tokens: jax.Array  # [S, K] int32
    count: jax.Array  # [S] int32
    logprobs: jax.Array  # [S, K] float32, of each token under the model's raw distribution
    top_ids: jax.Array  # [S, K, n] int32, the n most likely tokens at each position
    top_logprobs: jax.Array  # [S, K, n] float32
    last: jax.Array  # [S] int32: the token the slot's next step starts from (its feedback)


def _one_token(sampled: Sampled, emit: jax.Array) -> Emitted:
    """A plain step's output: each slot's one sampled token, kept where `emit` is set."""
    return Emitted(
        sampled.tokens[:, None], emit.astype(jnp.int32), sampled.logprobs[:, None], sampled.top_ids[:, None],
        sampled.top_logprobs[:, None], sampled.tokens,
    )  # fmt: skip


def _reset(state: DecodeState, reset: jax.Array) -> DecodeState:
    """Clear the per-sequence state of the slots where a new sequence starts."""

    slots = reset.shape[0]
    rows = jnp.where(reset, jnp.arange(slots), slots)  # only the reset slots are touched

    def clear(x: jax.Array, axis: int) -> jax.Array:
        index = (slice(None),) * axis + (rows,)
        return x.at[index].set(jnp.zeros((), x.dtype), mode="drop")

    kv = state.kv
    kv = dataclasses.replace(
        kv,
        conv_k=clear(kv.conv_k, 1),
        conv_v=clear(kv.conv_v, 1),
        conv_attention=clear(kv.conv_attention, 1),
        conv_mlp=clear(kv.conv_mlp, 1),
    )
    return dataclasses.replace(
        state,
        kv=kv,
        lengths=clear(state.lengths, 0),
        output_counts=clear(state.output_counts, 0),
        prompt_mask=clear(state.prompt_mask, 0),
        generated=clear(state.generated, 0),
    )


def step_fn(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    batch: StepBatch,
    previous: jax.Array,
    num_top: int = 0,
    speculative: bool = False,
    greedy_draft: bool = False,
) -> tuple[Emitted, DecodeState]:
    """One engine step; previous [S]: each slot's `last` token of the previous step (read where
    `batch.feedback` is set). Outputs are meaningful for slots with counts > 0. speculative (static):
    run DSpark rounds for the `batch.speculate` slots (the model needs a draft); greedy_draft (static):
    the draft proposes its argmax instead of sampling. `step` is it jitted with the state donated;
    `inkling_jax.runtime.engine` jits it with the output shardings pinned to the input ones."""
    replica_step = functools.partial(_step, graphdef, num_top=num_top, speculative=speculative,
                                     greedy_draft=greedy_draft)  # fmt: skip
    mesh = jax.sharding.get_abstract_mesh()
    if DATA in mesh.axis_names and mesh.shape[DATA] > 1:
        slots = P(DATA)
        replica_step = jax.shard_map(
            replica_step,
            in_specs=(P(), replica_specs(state), slots, slots),
            out_specs=(slots, replica_specs(state)),
            axis_names={DATA},
        )
    emitted, state = replica_step(params, state, batch, previous)
    if not mesh.empty:
        emitted = jax.lax.with_sharding_constraint(emitted, P())
    return emitted, state


step = jax.jit(step_fn, static_argnames=("graphdef", "num_top", "speculative", "greedy_draft"),
               donate_argnames="state")  # fmt: skip


def _step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    batch: StepBatch,
    previous: jax.Array,
    num_top: int,
    speculative: bool,
    greedy_draft: bool,
) -> tuple[Emitted, DecodeState]:
    model = nnx.merge(graphdef, params)
    token_ids = batch.token_ids.at[:, 0].set(jnp.where(batch.feedback, previous, batch.token_ids[:, 0]))
    state = dataclasses.replace(_reset(state, batch.reset), page_table=batch.page_table)
    fed = Chunk(state.lengths, batch.counts, state.page_table, token_ids.shape[1])  # the host's tokens

    vocab = state.prompt_mask.shape[1]
    slots = jnp.arange(batch.counts.shape[0])[:, None]
    prompt_tokens = jnp.where(fed.valid & batch.is_prompt[:, None], token_ids, vocab)
    prompt_mask = state.prompt_mask.at[slots, prompt_tokens].set(True, mode="drop")
    replayed = fed.valid & batch.replay[:, None]  # earlier outputs count as generated again
    output_counts = state.output_counts.at[slots, jnp.where(replayed, token_ids, vocab)].add(1, mode="drop")
    generated = state.generated + jnp.sum(replayed, axis=1, dtype=jnp.int32)
    emit = batch.emit & (batch.counts > 0)

    if speculative:
        spec = batch.speculate & (batch.counts > 0)
        drafts, q = propose(model, token_ids[:, 0], state.kv, fed, batch.sampling, generated, greedy_draft)
        gamma = drafts.shape[1]
        verified = jnp.concatenate([token_ids[:, :1], drafts], axis=1)  # [S, γ + 1]: anchor, drafts
        token_ids = jnp.where(spec[:, None], jnp.pad(verified, ((0, 0), (0, fed.width - gamma - 1))), token_ids)
        chunk = dataclasses.replace(fed, counts=jnp.where(spec, gamma + 1, batch.counts))
        at = jnp.where(spec[:, None], jnp.arange(gamma + 1), jnp.maximum(batch.counts - 1, 0)[:, None])  # [S, K]
        logits, kv, windows = model.step(token_ids, state.kv, chunk, windows=True, at=at)
        plain = _one_token(sample(logits[:, 0], batch.sampling, output_counts, prompt_mask, generated, num_top), emit)
        num_drafts = jnp.where(spec, gamma, 0)
        rounds = verify(logits, drafts, q, num_drafts, batch.sampling, output_counts, prompt_mask, generated, num_top)
        last = jnp.take_along_axis(rounds.tokens, rounds.num_accepted[:, None], axis=1)[:, 0]
        speculated = Emitted(rounds.tokens, rounds.num_accepted + 1, rounds.logprobs, rounds.top_ids,
                             rounds.top_logprobs, last)  # fmt: skip
        emitted = jax.tree.map(  # plain's [S, 1] entries broadcast: past its count they are padding
            lambda ours, theirs: jnp.where(spec.reshape(-1, *(1,) * (ours.ndim - 1)), ours, theirs), speculated, plain
        )
        committed = jnp.where(spec, emitted.count, batch.counts)
        kv = commit_conv(kv, windows, committed)
        lengths = state.lengths + committed
    else:
        logits, kv = model.step(token_ids, state.kv, fed)
        emitted = _one_token(sample(logits, batch.sampling, output_counts, prompt_mask, generated, num_top), emit)
        lengths = state.lengths + batch.counts

    kept = jnp.where(jnp.arange(emitted.tokens.shape[1])[None, :] < emitted.count[:, None], emitted.tokens, vocab)
    state = dataclasses.replace(
        state,
        kv=kv,
        lengths=lengths,
        prompt_mask=prompt_mask,
        output_counts=output_counts.at[slots, kept].add(1, mode="drop"),
        generated=generated + emitted.count,
    )
    return emitted, state
