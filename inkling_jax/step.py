"""The engine's pure step: continue every slot's sequence by a chunk of tokens and emit its next tokens.

    step(graphdef, params, state, batch, previous) -> (emitted, state)   # jitted once per step shape

A step's tokens are one flat run [T] (`inkling_jax.model.chunk`): slot s brings counts[s] tokens at
starts[s] ... (a prompt chunk, or the one token a decoding sequence sampled last); a slot with counts 0
idles. Attention reads decoding and verifying slots as a narrow group of `width` queries per slot and prompt
chunks through lanes of `lane_width` (lane p: lane_count[p] tokens of slot lane_slot[p], from lane_first[p]
in its span). A decoding slot's token can come straight from the previous step's output on device
(`feedback`), so the host can dispatch the next step before it has read the last one's tokens.
Every slot that brings tokens samples from the logits after its last real token; where `emit` is set
the token counts as generated (penalties, seeded stream), elsewhere (a prompt's earlier chunks) it is
discarded.

A speculative step (`speculative=True`, width γ + 1) also lets the slots with `speculate` set run one
DSpark round from their one token (the anchor, at the start of a span of γ + 1 flat tokens the host leaves
for it): the draft proposes γ tokens, the target verifies [anchor, drafts] in the same pass as the other
slots' tokens, and the slot emits its accepted drafts and one more token (`inkling_jax.speculative`); its
convolution states keep only the committed prefix. The emitted tokens follow the target's distribution
exactly. Other slots run as in a plain step and sample from the same noise as a plain step, so a request's
output does not depend on whether its neighbours speculate.

A constrained slot whose mask follows a token the host has not read yet (the step before is still running) is
stepped without its mask and its sample deferred: the step keeps the logits it sampled from, and `resample_fn`
draws it again under the mask once the host has it, while the next step can already run.

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
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from inkling_jax.cache import (
    PAGE_SIZE,
    DecodeState,
    Snapshots,
    commit_conv,
    landed_on_boundaries,
    record_boundaries,
    restore_snapshot,
    save_snapshot,
)
from inkling_jax.model.chunk import Chunk, Lanes
from inkling_jax.model.text import CausalLM
from inkling_jax.sampling import Sampled, SamplingParams, any_slot, sample
from inkling_jax.sharding import DATA, replica_specs
from inkling_jax.speculative import propose, verify


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """What the host sends each step ([S, ...] per slot unless noted)."""

    token_ids: jax.Array  # [T] int32, slot s's at starts[s] ... starts[s] + counts[s] - 1
    counts: jax.Array  # [S] int32
    starts: jax.Array  # [S] int32, as `pack_spans` lays them (a lane-free width-1 step reads its rows in place)
    lane_slot: jax.Array  # [P] int32: the prompt lanes (`inkling_jax.model.chunk.Lanes`)
    lane_first: jax.Array  # [P] int32
    lane_count: jax.Array  # [P] int32
    reset: jax.Array  # [S] bool: a new sequence starts in this slot (its state is cleared first)
    is_prompt: jax.Array  # [S] bool: the tokens are prompt tokens (they join the repetition-penalty set)
    emit: jax.Array  # [S] bool: the sampled token is kept (the prompt's last chunk, or decoding)
    feedback: jax.Array  # [S] bool: the slot's one token is what the previous step sampled for it
    replay: jax.Array  # [S] bool: the tokens are the sequence's earlier outputs, fed again after a preemption
    speculate: jax.Array  # [S] bool: a decoding slot runs a speculative round from its token (speculative steps)
    defer: jax.Array  # [S] bool: the slot's one sample is drawn again by `resample_fn` (sampled unconstrained here)
    page_table: jax.Array  # [S, max pages] int32, host-owned page assignments
    sampling: SamplingParams
    # [T] int32: each flat token's row in the image-feature pool (its image tile's features), -1 for a token that
    # takes its own embedding (None: no token does)
    image_rows: jax.Array | None = None


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
    drafts: jax.Array  # [S, γ] int32: the drafts a constrained round kept for its slot's next round (`Rounds`; else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rounds:
    """A speculative step's constrained rounds, ROUND_ROWS rows a replica (sent packed, one transfer). Row r's slot
    verifies the drafts the state keeps in its row r (`kept`; else none: its first round) under each position's mask,
    the masks the host computed along those drafts, and after what it emits drafts its next round into row r, which
    the step emits (`Emitted.drafts`, by slot) for the host to compute that round's masks: a sequence keeps its row
    from round to round."""

    slot: jax.Array  # [R] int32: the row's slot in its replica (S: an unused row)
    kept: jax.Array  # [R] bool: verify the slot's kept drafts (else no draft)
    allowed: jax.Array  # [R, γ + 1, W] int32: the tokens each position may emit, as packed bits (-1: any)


def pack_spans(
    tokens_of: np.ndarray,
    counts: np.ndarray,
    speculating: np.ndarray,
    *,
    width: int,
    lane_width: int,
    tokens: int,
    lanes: int,
    replicas: int = 1,
) -> tuple[np.ndarray, ...]:
    """The host's layout of a step (numpy): each slot's tokens_of[s, :counts[s]] ([S, any width]) at the next free
    flat index of its replica's `tokens`, a speculating slot's span `width` long; a slot that brings more than
    `width` tokens read through lanes of `lane_width`. A step without lanes that has `width` tokens for every slot
    lays slot s at s * width instead. Either way a lane-free step's narrow group of sequences (the busy slots in
    order, or every slot: `chunk.busy_slots`) reads sequence n's queries at flat tokens n * width ... when every busy
    slot's span is `width` long (`Chunk.ordered`). -> (token_ids [replicas * tokens], starts [S] (replica-local),
    lane_slot, lane_first, lane_count [replicas * lanes]). ValueError when a replica's spans or lanes do not fit."""
    slots = counts.shape[0]
    per_replica = slots // replicas
    flat, starts = np.zeros((replicas, tokens), np.int32), np.zeros(slots, np.int32)
    lane_table = np.zeros((3, replicas, lanes), np.int32)  # slot, first, count
    uniform = lanes == 0 and tokens >= per_replica * width
    for replica in range(replicas):
        cursor = lane = 0
        for local in range(per_replica):
            slot = replica * per_replica + local
            count = int(counts[slot])
            cursor = local * width if uniform else cursor
            if count > width:
                for first in range(0, count, lane_width):
                    if lane < lanes:
                        lane_table[:, replica, lane] = local, first, min(lane_width, count - first)
                    lane += 1
            if cursor + count <= tokens:
                flat[replica, cursor : cursor + count] = tokens_of[slot, :count]
            starts[slot] = cursor
            cursor += width if speculating[slot] else count
        if cursor > tokens or lane > lanes:
            raise ValueError(
                f"replica {replica}: spans of {cursor} tokens in {lane} lanes do not fit a step of "
                f"{tokens} tokens and {lanes} lanes"
            )
    return flat.reshape(-1), starts, *lane_table.reshape(3, -1)


def _one_token(sampled: Sampled, emit: jax.Array, drafts: jax.Array) -> Emitted:
    """A plain step's output: each slot's one sampled token, kept where `emit` is set (drafts [S, γ]: none kept)."""
    return Emitted(
        sampled.tokens[:, None],
        emit.astype(jnp.int32),
        sampled.logprobs[:, None],
        sampled.top_ids[:, None],
        sampled.top_logprobs[:, None],
        sampled.tokens,
        drafts,
    )


def _reset(state: DecodeState, reset: jax.Array) -> DecodeState:
    """Clear the per-sequence state of the slots where a new sequence starts (the convolution states need no
    clearing: a sequence of length 0 reads its history as zeros, `Chunk.known`)."""
    slots = reset.shape[0]
    rows = jnp.where(reset, jnp.arange(slots), slots)  # only the reset slots are touched

    def clear(x: jax.Array) -> jax.Array:
        return x.at[rows].set(jnp.zeros((), x.dtype), mode="drop")

    def clear_vocabulary_rows(counts: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        return clear(counts), clear(mask)

    # a scatter of whole vocabulary rows walks all S rows of updates, dropped ones too; most steps start no
    # sequence
    output_counts, prompt_mask = jax.lax.cond(
        any_slot(reset), clear_vocabulary_rows, lambda *kept: kept, state.output_counts, state.prompt_mask
    )
    return dataclasses.replace(
        state,
        lengths=clear(state.lengths),
        output_counts=output_counts,
        prompt_mask=prompt_mask,
        generated=clear(state.generated),
    )


def step_fn(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    batch: StepBatch,
    previous: jax.Array,
    image_pool: jax.Array | None = None,
    allowed: jax.Array | None = None,
    rounds: Rounds | None = None,
    num_top: int = 0,
    speculative: bool = False,
    greedy_draft: bool = False,
    width: int = 1,
    lane_width: int = 1,
) -> tuple[Emitted, DecodeState]:
    """One engine step; previous [S]: each slot's `last` token of the previous step (read where `batch.feedback` is
    set); image_pool [R, H]: the image features `batch.image_rows` point at (read only; a model without an image tower
    ignores it); allowed [S, W] int32: the tokens each slot may sample, as packed bits (`sampling.allowed_only`; None or
    a row of -1: any; a speculating slot's row must be -1: its masks come in `rounds`). A `batch.defer` slot is sampled
    unconstrained whatever its row and its logits are kept for `resample_fn`, which draws the sample again under the
    mask the host computes meanwhile. Outputs are meaningful for slots with counts > 0. speculative (static): run DSpark
    rounds for the `batch.speculate` slots (the model needs a draft; width γ + 1), those `rounds` names constrained
    (None: none); greedy_draft (static): the draft proposes its argmax instead of sampling; width, lane_width (static):
    the narrow group's queries per slot and the lanes'. `step` is it jitted with the state donated;
    `inkling_jax.runtime.engine` jits it with the output shardings pinned to the input ones."""
    replica_step = functools.partial(
        _step,
        graphdef,
        num_top=num_top,
        speculative=speculative,
        greedy_draft=greedy_draft,
        width=width,
        lane_width=lane_width,
    )
    mesh = jax.sharding.get_abstract_mesh()
    if DATA in mesh.axis_names and mesh.shape[DATA] > 1:
        slots = P(DATA)
        replica_step = jax.shard_map(
            replica_step,
            in_specs=(P(), replica_specs(state), slots, slots, P(), slots, slots),
            out_specs=(slots, replica_specs(state)),
            axis_names={DATA},
        )
    emitted, state = replica_step(params, state, batch, previous, image_pool, allowed, rounds)
    if not mesh.empty:
        emitted = jax.lax.with_sharding_constraint(emitted, P())
    return emitted, state


step = jax.jit(
    step_fn,
    static_argnames=("graphdef", "num_top", "speculative", "greedy_draft", "width", "lane_width"),
    donate_argnames="state",
)


def _step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    batch: StepBatch,
    previous: jax.Array,
    image_pool: jax.Array | None,
    allowed: jax.Array | None,
    rounds: Rounds | None,
    num_top: int,
    speculative: bool,
    greedy_draft: bool,
    width: int,
    lane_width: int,
) -> tuple[Emitted, DecodeState]:
    model = nnx.merge(graphdef, params)
    kept_width = 0 if state.drafts is None else state.drafts.shape[1]  # γ of the kept rounds' drafts
    deferred = batch.defer
    if allowed is not None:
        allowed = jnp.where(deferred[:, None], -1, allowed)
    tokens, starts = batch.token_ids.shape[0], batch.starts
    token_ids = batch.token_ids.at[jnp.where(batch.feedback, starts, tokens)].set(previous, mode="drop")
    state = dataclasses.replace(_reset(state, batch.reset), page_table=batch.page_table)
    spec = batch.speculate & (batch.counts > 0) if speculative else jnp.zeros_like(batch.speculate)
    gamma = model.dspark.config.block_size if speculative else 0
    if speculative and rounds is None:
        words = -(-state.prompt_mask.shape[1] // 32)
        rounds = Rounds(jnp.zeros(0, jnp.int32), jnp.zeros(0, bool), jnp.zeros((0, gamma + 1, words), jnp.int32))
    lanes = None
    if batch.lane_slot.shape[0]:
        lanes = Lanes(batch.lane_slot, batch.lane_first, batch.lane_count, lane_width)
    counts = jnp.where(spec, gamma + 1, batch.counts)  # a verify pass: the anchor and its drafts
    chunk = Chunk.make(
        state.lengths,
        counts,
        state.page_table,
        starts,
        lanes,
        width=width,
        tokens=tokens,
        kernel_size=model.config.conv_kernel_size,
        ordered=lanes is None and width == 1,
    )

    images = None
    if model.vision_tower is not None and image_pool is not None and batch.image_rows is not None:
        images = (image_pool, batch.image_rows)

    vocab = state.prompt_mask.shape[1]
    slot, real = chunk.token_slot, chunk.valid[0]  # the host's tokens: a speculating slot's one is not a prompt's
    prompt_tokens = jnp.where(real & batch.is_prompt[jnp.minimum(slot, batch.counts.shape[0] - 1)], token_ids, vocab)
    prompt_mask = state.prompt_mask.at[slot, prompt_tokens].set(True, mode="drop")
    replayed = real & batch.replay[jnp.minimum(slot, batch.counts.shape[0] - 1)]  # earlier outputs, generated again
    output_counts = state.output_counts.at[slot, jnp.where(replayed, token_ids, vocab)].add(1, mode="drop")
    generated = state.generated + jnp.where(batch.replay, batch.counts, 0)
    emit = batch.emit & (batch.counts > 0)

    if speculative:
        slots = batch.counts.shape[0]
        anchors = token_ids[jnp.minimum(starts, tokens - 1)]
        drafts, q = propose(
            model, anchors, state.kv, chunk.lengths, chunk.page_table, batch.sampling, generated, greedy_draft
        )
        drafts, q = _kept_rounds(rounds, (drafts, q), (state.drafts, state.draft_probs))
        after = starts[:, None] + 1 + jnp.arange(gamma)[None, :]
        token_ids = token_ids.at[jnp.where(spec[:, None], after, tokens)].set(drafts, mode="drop")
        at = jnp.where(spec[:, None], starts[:, None] + jnp.arange(gamma + 1), chunk.last[:, None])  # [S, γ + 1]
        at = jnp.minimum(at, tokens - 1)
        logits, kv, windows = model.step(token_ids, state.kv, chunk, windows=True, at=at, images=images)
        none_kept = jnp.zeros((slots, kept_width), jnp.int32)
        plain = _one_token(
            sample(logits[:, 0], batch.sampling, output_counts, prompt_mask, generated, num_top, allowed),
            emit,
            none_kept,
        )
        kept_logits = _deferred_logits(state.logits, logits[:, 0], jnp.arange(slots), deferred)
        num_drafts = jnp.where(spec, gamma, 0).at[jnp.where(rounds.kept, slots, rounds.slot)].set(0, mode="drop")
        if state.boundaries is not None:  # a round ends on the next page boundary at most: it lands on every one
            num_drafts = jnp.minimum(num_drafts, PAGE_SIZE - 1 - state.lengths % PAGE_SIZE)
        masks = (rounds.slot, rounds.allowed)
        verified = verify(
            logits, drafts, q, num_drafts, batch.sampling, output_counts, prompt_mask, generated, num_top, masks
        )
        last = jnp.take_along_axis(verified.tokens, verified.num_accepted[:, None], axis=1)[:, 0]
        speculated = Emitted(
            verified.tokens,
            verified.num_accepted + 1,
            verified.logprobs,
            verified.top_ids,
            verified.top_logprobs,
            last,
            none_kept,
        )
        emitted = jax.tree.map(  # plain's [S, 1] entries broadcast: past its count they are padding
            lambda ours, theirs: jnp.where(spec.reshape(-1, *(1,) * (ours.ndim - 1)), ours, theirs), speculated, plain
        )
        committed = jnp.where(spec, emitted.count, batch.counts)
        kv = commit_conv(kv, windows, committed, spec)
        lengths = state.lengths + committed
        kept_drafts, kept_probs = _next_rounds(
            model,
            rounds.slot,
            (emitted.last, kv, lengths, state.page_table, batch.sampling, generated + emitted.count),
            (state.drafts, state.draft_probs),
            greedy_draft,
        )
        emitted = dataclasses.replace(emitted, drafts=none_kept.at[rounds.slot].set(kept_drafts, mode="drop"))
        state = dataclasses.replace(state, drafts=kept_drafts, draft_probs=kept_probs)
    elif chunk.busy.shape[0] < chunk.slots:  # fewer tokens than slots: the busy slots' rows alone are sampled
        rows, slots = chunk.busy_index, chunk.slots
        logits, kv = model.step(token_ids, state.kv, chunk, at=chunk.last[rows][:, None], images=images)
        sampling = jax.tree.map(lambda column: column[rows], batch.sampling)
        sampled = sample(
            logits[:, 0],
            sampling,
            output_counts[rows],
            prompt_mask[rows],
            generated[rows],
            num_top,
            None if allowed is None else allowed[rows],
        )
        busy = _one_token(sampled, emit[rows] & (chunk.busy < slots), jnp.zeros((rows.shape[0], kept_width), jnp.int32))
        kept_logits = _deferred_logits(state.logits, logits[:, 0], chunk.busy, deferred)
        emitted = jax.tree.map(
            lambda x: jnp.zeros((slots, *x.shape[1:]), x.dtype).at[chunk.busy].set(x, mode="drop"), busy
        )  # an idle slot keeps the token its next step would start from
        emitted = dataclasses.replace(emitted, last=previous.at[chunk.busy].set(busy.last, mode="drop"))
        lengths = state.lengths + batch.counts
    else:
        logits, kv = model.step(token_ids, state.kv, chunk, images=images)
        emitted = _one_token(
            sample(logits, batch.sampling, output_counts, prompt_mask, generated, num_top, allowed),
            emit,
            jnp.zeros((batch.counts.shape[0], kept_width), jnp.int32),
        )
        kept_logits = _deferred_logits(state.logits, logits, jnp.arange(batch.counts.shape[0]), deferred)
        lengths = state.lengths + batch.counts

    slots = jnp.arange(batch.counts.shape[0])[:, None]
    kept = jnp.where(jnp.arange(emitted.tokens.shape[1])[None, :] < emitted.count[:, None], emitted.tokens, vocab)
    if state.boundaries is not None:  # a scatter walking every slot's conv states: only in a step where one lands
        landed = landed_on_boundaries(state.lengths, lengths)
        record = functools.partial(record_boundaries, kv=kv, after=lengths, landed=landed)
        boundaries = jax.lax.cond(any_slot(landed), record, lambda kept: kept, state.boundaries)
        state = dataclasses.replace(state, boundaries=boundaries)
    state = dataclasses.replace(
        state,
        kv=kv,
        lengths=lengths,
        prompt_mask=prompt_mask,
        output_counts=output_counts.at[slots, kept].add(1, mode="drop"),
        generated=generated + emitted.count,
        logits=kept_logits,
    )
    return emitted, state


def _kept_rounds(rounds: Rounds, fresh: tuple[jax.Array, jax.Array], kept: tuple[jax.Array, jax.Array]) -> tuple:
    """The step's drafts [S, γ] and q [S, γ, V] (`fresh`) with the rows' kept ones ([R, γ], [R, γ, V]) for the rounds
    that verify what they kept; only in a step that has one."""
    slots = fresh[0].shape[0]
    rows = jnp.where(rounds.kept, rounds.slot, slots)

    def substituted(drafts: jax.Array, q: jax.Array) -> tuple[jax.Array, jax.Array]:
        return drafts.at[rows].set(kept[0], mode="drop"), q.at[rows].set(kept[1], mode="drop")

    return jax.lax.cond(any_slot(rows < slots), substituted, lambda *fresh: fresh, *fresh)


def _next_rounds(
    model: CausalLM, rows: jax.Array, after: tuple, kept: tuple[jax.Array, jax.Array], greedy: bool
) -> tuple[jax.Array, jax.Array]:
    """The rounds' kept drafts [R, γ] and their q [R, γ, V] with each row's next round drafted for its slot (rows
    [R]: S for an unused row, whose kept ones stay), after what the slot emitted: after = (anchors [S], kv, lengths
    [S], page_table, sampling, generated [S]) once the step committed. A draft pass over the rows alone, run only in
    a step that has one."""
    anchors, kv, lengths, page_table, sampling, generated = after
    slots = lengths.shape[0]
    at, used = jnp.minimum(rows, slots - 1), rows < slots

    def drafted(drafts: jax.Array, probs: jax.Array) -> tuple[jax.Array, jax.Array]:
        params = jax.tree.map(lambda column: column[at], sampling)
        new, q = propose(model, anchors[at], kv, lengths[at], page_table[at], params, generated[at], greedy)
        return jnp.where(used[:, None], new, drafts), jnp.where(used[:, None, None], q, probs)

    return jax.lax.cond(any_slot(used), drafted, lambda *kept: kept, *kept)


def _deferred_logits(kept: jax.Array, logits: jax.Array, rows: jax.Array, deferred: jax.Array) -> jax.Array:
    """kept [S, V] with the logits [R, V] of rows (slot of each row, S for none) copied in for the deferred slots
    (a whole-vocabulary scatter, run only in a step that defers a sample)."""
    slots = kept.shape[0]

    def copied(kept: jax.Array) -> jax.Array:
        target = jnp.where((rows < slots) & deferred[jnp.minimum(rows, slots - 1)], rows, slots)
        return kept.at[target].set(logits, mode="drop")

    return jax.lax.cond(any_slot(deferred), copied, lambda kept: kept, kept)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Redrawn:
    """What `resample_fn` draws: the named slots' tokens and their log-probabilities, and every slot's next input."""

    tokens: jax.Array  # [R] int32
    logprobs: jax.Array  # [R] float32, under the model's raw distribution
    last: jax.Array  # [S] int32: the token each slot's next step starts from


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Redraw:
    """What `resample_fn` takes from the host: the slots whose samples it draws and how (one transfer, packed)."""

    rows: jax.Array  # [R] int32: the slots (a row past the slots: none)
    allowed: jax.Array  # [R, W] int32: each row's allowed tokens as packed bits
    sampling: SamplingParams  # each [R]: the rows' slots' sampling parameters


def resample_fn(
    state: DecodeState,
    last: jax.Array,
    count: jax.Array,
    redraw: Redraw,
) -> tuple[Redrawn, DecodeState]:
    """A step's one-token samples of the slots `redraw.rows` names (the step deferred them, `StepBatch.defer`) drawn
    again from the logits it kept, under `redraw.allowed`: what the step would have emitted and left had it taken
    these masks (the same logits, penalties, noise and filters, in a program of its own: the chosen tokens'
    log-probabilities equal up to fp32 rounding). last, count [S]: the step's `Emitted.last` (a plain slot's one
    sample) and `Emitted.count`. So the host can compute a slot's mask while the step that needs it runs, once it has
    read the token before."""
    rows, allowed, params = redraw.rows, redraw.allowed, redraw.sampling
    slots, vocab = state.output_counts.shape
    real, at = rows < slots, jnp.minimum(rows, slots - 1)
    into = jnp.where(real, rows, slots)  # scatters drop the padding rows
    counted, own = real & (count[at] > 0), jnp.arange(rows.shape[0])
    before = state.output_counts[at].at[own, jnp.where(counted, last[at], vocab)].add(-1, mode="drop")
    sampled = sample(
        state.logits[at], params, before, state.prompt_mask[at], state.generated[at] - count[at], 0, allowed
    )
    counts = before.at[own, jnp.where(counted, sampled.tokens, vocab)].add(1, mode="drop")
    redrawn = Redrawn(sampled.tokens, sampled.logprobs, last.at[into].set(sampled.tokens, mode="drop"))
    return redrawn, dataclasses.replace(state, output_counts=state.output_counts.at[into].set(counts, mode="drop"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SnapshotMove:
    """A prefix cache's copy between one slot of each replica and its snapshot pool, each [replicas]: the slot (in
    its replica), the snapshot, the page boundary, and whether the replica copies at all."""

    slot: jax.Array  # int32
    index: jax.Array  # int32
    boundary: jax.Array  # int32
    valid: jax.Array  # bool


def save_fn(state: DecodeState, snapshots: Snapshots, move: SnapshotMove) -> Snapshots:
    """`save_snapshot` of each replica's `move` (a replica's snapshots are its own: [replicas * N, ...] by replica)."""

    def save(state: DecodeState, snapshots: Snapshots, move: SnapshotMove) -> Snapshots:
        return jax.lax.cond(
            move.valid[0],
            lambda kept: save_snapshot(state, kept, move.slot[0], move.index[0], move.boundary[0]),
            lambda kept: kept,
            snapshots,
        )

    return _in_replicas(save, state, (P(DATA), P(DATA)), P(DATA))(state, snapshots, move)


def restore_fn(
    state: DecodeState, snapshots: Snapshots, move: SnapshotMove, prompt_mask: jax.Array, output_counts: jax.Array
) -> DecodeState:
    """`restore_snapshot` of each replica's `move`, with its sampling state (prompt_mask [replicas, V] bool,
    output_counts [replicas, V] int32)."""

    def restore(state: DecodeState, snapshots: Snapshots, move: SnapshotMove, mask: jax.Array, counts: jax.Array):
        return jax.lax.cond(
            move.valid[0],
            lambda kept: restore_snapshot(
                kept, snapshots, move.slot[0], move.index[0], move.boundary[0], mask[0], counts[0]
            ),
            lambda kept: kept,
            state,
        )

    specs = (P(DATA), P(DATA), P(DATA), P(DATA))
    return _in_replicas(restore, state, specs, replica_specs(state))(state, snapshots, move, prompt_mask, output_counts)


def _in_replicas(fn, state: DecodeState, in_specs: tuple, out_specs: object):
    """fn(state, *rest) run by each data-parallel replica on its own slots (rest split by replica: in_specs), or as
    it is on a mesh without replicas."""
    mesh = jax.sharding.get_abstract_mesh()
    if DATA not in mesh.axis_names or mesh.shape[DATA] == 1:
        return fn
    return jax.shard_map(fn, in_specs=(replica_specs(state), *in_specs), out_specs=out_specs, axis_names={DATA})
