"""The engine's pure step: continue every slot's sequence by a chunk of tokens and sample one token.

    step(graphdef, params, state, batch, previous) -> (outputs, state)   # jitted once per (slots, width)

A step's tokens are laid out [S, C]: slot s brings counts[s] real tokens (a prefill chunk, or the one
token a decoding sequence sampled last), padded to the bucket width C; a slot with counts 0 idles.
A decoding slot's token can come straight from the previous step's output on device (`feedback`), so
the host can dispatch the next step before it has read the last one's tokens.
Every slot that brings tokens samples from the logits after its last real token; where `emit` is set
the token counts as generated (penalties, seeded stream), elsewhere (a prompt's earlier chunks) it is
discarded.

Under a mesh with a `data` axis (set with `jax.set_mesh`), the slots and the page pool split into
data-parallel replicas: each replica steps its own slots against its own pages (page-table entries are
replica-local page ids), while parameters and activations split over `model` inside each replica.
The sampled outputs come back replicated, so every process of a multi-host run reads all of them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from inkling_jax.cache import DecodeState
from inkling_jax.model.attention import Chunk
from inkling_jax.sampling import Sampled, SamplingParams, sample
from inkling_jax.sharding import DATA, replica_specs


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
    page_table: jax.Array  # [S, max pages] int32, host-owned page assignments
    sampling: SamplingParams


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
) -> tuple[Sampled, DecodeState]:
    """One engine step; previous [S]: the tokens the last step sampled (read where `batch.feedback` is
    set). Outputs are meaningful for slots with counts > 0. `step` is it jitted with the state donated;
    `inkling_jax.engine` jits it with the output shardings pinned to the input ones."""
    replica_step = functools.partial(_step, graphdef, num_top=num_top)
    mesh = jax.sharding.get_abstract_mesh()
    if DATA in mesh.axis_names and mesh.shape[DATA] > 1:
        slots = P(DATA)
        replica_step = jax.shard_map(
            replica_step,
            in_specs=(P(), replica_specs(state), slots, slots),
            out_specs=(slots, replica_specs(state)),
            axis_names={DATA},
        )
    sampled, state = replica_step(params, state, batch, previous)
    if not mesh.empty:
        sampled = jax.lax.with_sharding_constraint(sampled, P())
    return sampled, state


step = jax.jit(step_fn, static_argnames=("graphdef", "num_top"), donate_argnames="state")


def _step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    batch: StepBatch,
    previous: jax.Array,
    num_top: int,
) -> tuple[Sampled, DecodeState]:
    model = nnx.merge(graphdef, params)
    token_ids = batch.token_ids.at[:, 0].set(jnp.where(batch.feedback, previous, batch.token_ids[:, 0]))
    state = dataclasses.replace(_reset(state, batch.reset), page_table=batch.page_table)
    chunk = Chunk(state.lengths, batch.counts, state.page_table, token_ids.shape[1])
    logits, kv = model.step(token_ids, state.kv, chunk)
    state = dataclasses.replace(state, kv=kv)

    vocab = state.prompt_mask.shape[1]
    slots = jnp.arange(batch.counts.shape[0])[:, None]
    prompt_tokens = jnp.where(chunk.valid & batch.is_prompt[:, None], token_ids, vocab)
    prompt_mask = state.prompt_mask.at[slots, prompt_tokens].set(True, mode="drop")
    replayed = chunk.valid & batch.replay[:, None]  # earlier outputs count as generated again
    output_counts = state.output_counts.at[slots, jnp.where(replayed, token_ids, vocab)].add(1, mode="drop")
    generated = state.generated + jnp.sum(replayed, axis=1, dtype=jnp.int32)
    sampled = sample(logits, batch.sampling, output_counts, prompt_mask, generated, num_top)
    emit = batch.emit & (batch.counts > 0)
    chosen = jnp.where(emit, sampled.tokens, vocab)
    state = dataclasses.replace(
        state,
        lengths=state.lengths + batch.counts,
        prompt_mask=prompt_mask,
        output_counts=output_counts.at[slots[:, 0], chosen].add(1, mode="drop"),
        generated=generated + emit.astype(jnp.int32),
    )
    return sampled, state
