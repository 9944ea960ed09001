"""The engine's pure step: continue every slot's sequence by a chunk of tokens and sample one token.

    step(graphdef, params, state, batch) -> (outputs, state)     # jitted once per (slots, chunk width)

A step's tokens are laid out [S, C]: slot s brings counts[s] real tokens (a prefill chunk, or the one
token a decoding sequence sampled last), padded to the bucket width C; a slot with counts 0 idles.
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


@functools.partial(jax.jit, static_argnames=("graphdef", "num_top"), donate_argnames="state")
def step(
    graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, batch: StepBatch, num_top: int = 0
) -> tuple[Sampled, DecodeState]:
    """One engine step (state donated). Outputs are meaningful for slots with counts > 0."""
    replica_step = functools.partial(_step, graphdef, num_top=num_top)
    mesh = jax.sharding.get_abstract_mesh()
    if DATA in mesh.axis_names and mesh.shape[DATA] > 1:
        slots = P(DATA)
        replica_step = jax.shard_map(
            replica_step,
            in_specs=(P(), replica_specs(state), slots),
            out_specs=(slots, replica_specs(state)),
            axis_names={DATA},
        )
    sampled, state = replica_step(params, state, batch)
    if not mesh.empty:
        sampled = jax.lax.with_sharding_constraint(sampled, P())
    return sampled, state


def _step(
    graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, batch: StepBatch, num_top: int
) -> tuple[Sampled, DecodeState]:
    model = nnx.merge(graphdef, params)
    state = dataclasses.replace(_reset(state, batch.reset), page_table=batch.page_table)
    chunk = Chunk(state.lengths, batch.counts, state.page_table, batch.token_ids.shape[1])
    logits, kv = model.step(batch.token_ids, state.kv, chunk)
    state = dataclasses.replace(state, kv=kv)

    slots = jnp.arange(batch.counts.shape[0])[:, None]
    prompt_tokens = jnp.where(chunk.valid & batch.is_prompt[:, None], batch.token_ids, state.prompt_mask.shape[1])
    prompt_mask = state.prompt_mask.at[slots, prompt_tokens].set(True, mode="drop")
    sampled = sample(logits, batch.sampling, state.output_counts, prompt_mask, state.generated, num_top)
    emit = batch.emit & (batch.counts > 0)
    chosen = jnp.where(emit, sampled.tokens, state.output_counts.shape[1])
    state = dataclasses.replace(
        state,
        lengths=state.lengths + batch.counts,
        prompt_mask=prompt_mask,
        output_counts=state.output_counts.at[slots[:, 0], chosen].add(1, mode="drop"),
        generated=state.generated + emit.astype(jnp.int32),
    )
    return sampled, state
