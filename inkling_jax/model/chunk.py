"""Where a step's tokens sit: one flat run of T tokens in which every slot's new tokens are one contiguous span.

Slot s brings counts[s] tokens at flat indices starts[s] ... starts[s] + counts[s] - 1, continuing the lengths[s]
tokens its state holds; the rest of the T are padding. Everything that works token by token (projections,
norms, experts, the convolutions' taps) runs over the T rows, so a slot costs the tokens it brings: a decoding
slot one, a verify pass γ + 1, a prompt its chunk.

Attention reads the spans as the ragged kernels take them, query rows padded per sequence, in two groups:
- the narrow group: one sequence per busy slot (`busy`: a slot that brings tokens), with up to `width` queries
  (1 when decoding, γ + 1 when a step verifies drafts); a slot in a lane has none here. A step of fewer tokens
  than slots has at most T busy slots, so its group holds T sequences and idle slots cost nothing; otherwise
  sequence s is slot s;
- the lanes (`Lanes`), for prompt chunks: lane p holds up to `lanes.width` consecutive tokens of one slot's span,
  a longer chunk several lanes, so a chunk pads at most one lane's width.
`source` maps each flat token to its row in the two groups' outputs, so a layer gathers its queries into the
groups and its outputs back with one gather each; the maps are computed once per step (`Chunk.make`). An ordered
layout (`Chunk.ordered`: no lanes, sequence n at flat tokens n * width ...) needs neither gather.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Lanes:
    """Prompt chunks as attention reads them: lane p holds tokens first[p] ... first[p] + count[p] - 1 of slot
    slot[p]'s span (count 0: an unused lane)."""

    slot: jax.Array  # [P] int32
    first: jax.Array  # [P] int32
    count: jax.Array  # [P] int32
    width: int = dataclasses.field(metadata={"static": True})  # query rows per lane


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Chunk:
    """A step's layout over its T flat tokens (see the module docstring); make with `make` or `uniform`."""

    lengths: jax.Array  # [S] int32 tokens already in each slot's state
    counts: jax.Array  # [S] int32 tokens the slot brings
    page_table: jax.Array  # [S, max pages] int32
    starts: jax.Array  # [S] int32 flat index of the slot's first token
    lanes: Lanes | None
    token_slot: jax.Array  # [T] int32 the slot of each flat token (S for padding)
    offset: jax.Array  # [T] int32 each token's index in its slot's span
    narrow_counts: jax.Array  # [S] int32 each slot's queries in the narrow group
    busy: jax.Array  # [N] int32 the narrow group's slots (see `busy_slots`), N = min(S, T)
    source: jax.Array  # [T] int32 each token's row in the groups' outputs (past them for padding)
    lag_index: jax.Array  # [K, T] int32 each token's convolution inputs at lags 0..K-1 (see `lags`)
    history_index: jax.Array  # [N, K - 1] int32 each busy slot's convolution history after the step (`history`)
    in_sequence: jax.Array  # [N, K - 1] bool each history row that holds a token of the slot's sequence (`known`)
    width: int = dataclasses.field(metadata={"static": True})  # the narrow group's queries per slot
    tokens: int = dataclasses.field(metadata={"static": True})  # T
    # the narrow group's sequence n reads flat tokens n * width ... (no lanes): its queries and outputs are the
    # step's rows as they lie, with no gather (`step.pack_spans` lays decode steps out so)
    ordered: bool = dataclasses.field(default=False, metadata={"static": True})

    @classmethod
    def make(
        cls,
        lengths: jax.Array,
        counts: jax.Array,
        page_table: jax.Array,
        starts: jax.Array,
        lanes: Lanes | None,
        *,
        width: int,
        tokens: int,
        kernel_size: int,
        ordered: bool = False,
    ) -> Chunk:
        """The layout of spans (starts, counts) over `tokens` flat tokens, with its index maps for convolutions of
        `kernel_size` taps. A slot covered by a used lane is in the lanes only; every other slot brings at most
        `width` tokens. `ordered`: the caller lays the narrow group's sequence n at flat tokens n * width ... (see
        the field; no lanes)."""
        if ordered and (lanes is not None or tokens < min(lengths.shape[0], tokens) * width):
            raise ValueError("an ordered layout has no lanes and room for every narrow sequence's queries")
        slots = lengths.shape[0]
        flat = jnp.arange(tokens, dtype=jnp.int32)
        token_slot = token_slots(starts, counts, tokens)
        offset = flat - starts[jnp.minimum(token_slot, slots - 1)]
        laned = jnp.zeros(slots, bool)
        if lanes is not None:
            laned = laned.at[lanes.slot].max(lanes.count > 0)
        narrow_counts = jnp.where(laned, 0, counts)

        # the groups' rows: narrow sequence n's query c at n * width + c, lane p's query c after them at p * lane + c
        busy = busy_slots(counts, tokens)
        sequences = busy.shape[0]
        rows = jnp.full(tokens, _past(sequences, width, lanes), jnp.int32)
        c = jnp.arange(width, dtype=jnp.int32)
        queries = _sequence_counts(busy, narrow_counts)
        at = jnp.where(c[None, :] < queries[:, None], starts[_clipped(busy, slots)][:, None] + c[None, :], tokens)
        rows = rows.at[at].set(jnp.arange(sequences * width, dtype=jnp.int32).reshape(sequences, width), mode="drop")
        if lanes is not None:
            at = jnp.where(_lane_real(lanes), _lane_tokens(starts, lanes), tokens)
            lane_rows = sequences * width + jnp.arange(lanes.count.shape[0] * lanes.width, dtype=jnp.int32)
            rows = rows.at[at].set(lane_rows.reshape(at.shape), mode="drop")

        # convolutions, over the busy slots' histories (`conv_slots`): a token's input at lag j is the span's token
        # offset - j before it, else its slot's history
        taps, own = kernel_size - 1, _clipped(busy, slots)
        lag = jnp.arange(kernel_size, dtype=jnp.int32)[:, None]  # [K, 1]
        history_row = jnp.full(slots + 1, sequences, jnp.int32).at[busy].set(jnp.arange(sequences, dtype=jnp.int32))
        held = history_row[token_slot][None, :] * taps + taps + offset[None, :] - lag
        lag_index = jnp.where(offset[None, :] >= lag, sequences * taps + flat[None, :] - lag, held)
        position = counts[own][:, None] - taps + jnp.arange(taps, dtype=jnp.int32)[None, :]  # [N, K - 1] in the span
        held = jnp.arange(sequences)[:, None] * taps + taps + position
        history_index = jnp.where(position >= 0, sequences * taps + starts[own][:, None] + position, held)
        in_sequence = lengths[own][:, None] - taps + jnp.arange(taps, dtype=jnp.int32)[None, :] >= 0  # [N, K - 1]
        return cls(
            lengths, counts, page_table, starts, lanes, token_slot, offset, narrow_counts, busy, rows,
            jnp.clip(lag_index, 0, sequences * taps + tokens - 1).astype(jnp.int32), history_index.astype(jnp.int32),
            in_sequence, width=width, tokens=tokens, ordered=ordered,
        )  # fmt: skip

    @classmethod
    def uniform(
        cls, lengths: jax.Array, counts: jax.Array, page_table: jax.Array, width: int, *, kernel_size: int
    ) -> Chunk:
        """Every slot's span at s * width (T = S * width), no lanes: a decode step's layout, or tokens laid out
        [S, width] and flattened."""
        starts = jnp.arange(lengths.shape[0], dtype=jnp.int32) * width
        return cls.make(
            lengths,
            counts,
            page_table,
            starts,
            None,
            width=width,
            tokens=lengths.shape[0] * width,
            kernel_size=kernel_size,
            ordered=True,
        )

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def valid(self) -> jax.Array:
        """[1, T] real tokens."""
        return (self.token_slot < self.slots)[None]

    @property
    def positions(self) -> jax.Array:
        """[1, T] int32 absolute positions of the tokens (padding: after its nearest slot's)."""
        return (self.lengths[jnp.minimum(self.token_slot, self.slots - 1)] + self.offset)[None]

    @property
    def busy_index(self) -> jax.Array:
        """[N] the narrow group's slots as indices (padding clipped to the last slot; its sequences are empty)."""
        return _clipped(self.busy, self.slots)

    @property
    def last(self) -> jax.Array:
        """[S] int32 the flat index of each slot's last token (its first for a slot that brings none)."""
        return self.starts + jnp.maximum(self.counts - 1, 0)

    def groups(self) -> list[tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]]:
        """Attention's sequences, per group: (flat index of each query row [N, W] (clipped into the step),
        kv_lens [N], query_lens [N], page table [N, max pages], slot [N])."""
        slots = self.busy_index
        query_lens = _sequence_counts(self.busy, self.narrow_counts)
        kv_lens = jnp.where(self.busy < self.slots, self.lengths[slots] + query_lens, 0)
        index = self.starts[slots][:, None] + jnp.arange(self.width, dtype=jnp.int32)[None, :]
        groups = [(index, kv_lens, query_lens, self.page_table[slots], slots)]
        if self.lanes is not None:
            lanes = self.lanes
            kv_lens = self.lengths[lanes.slot] + lanes.first + lanes.count
            index = _lane_tokens(self.starts, lanes)
            groups.append((index, kv_lens, lanes.count, self.page_table[lanes.slot], lanes.slot))
        return [(jnp.clip(index, 0, self.tokens - 1), *rest) for index, *rest in groups]

    @property
    def conv_slots(self) -> jax.Array | None:
        """The slots whose convolution histories the step reads and writes, in the order of its history rows: the
        busy slots (`busy`, S past the last) when the step has fewer tokens than slots, else None: every slot, in
        order. A decode step of a few tokens reads, carries through its layers and writes back their rows alone,
        not every slot's."""
        return self.busy if self.busy.shape[0] < self.slots else None

    def known(self, history: jax.Array) -> jax.Array:
        """The slots' convolution histories [N, K - 1, C] as their sequences have them: zeros before a sequence's
        first token. A slot's state is never cleared when a new sequence takes it (that would be a scatter over every
        layer's state in every step); whatever it holds before the new sequence's first token is read as zeros
        here."""
        return jnp.where(self.in_sequence[..., None], history, jnp.zeros((), history.dtype))

    def lags(self, x: jax.Array, history: jax.Array) -> jax.Array:
        """x [1, T, C] after the busy slots' histories [N, K - 1, C] -> [K, 1, T, C]: each token's inputs at lags
        0..K-1 (lag-major, as `short_conv.lagged`)."""
        buffer = jnp.concatenate([self.known(history).reshape(-1, history.shape[-1]).astype(x.dtype), x[0]])
        return buffer[self.lag_index][:, None]

    def history(self, x: jax.Array, history: jax.Array) -> jax.Array:
        """x [1, T, C] after the busy slots' histories [N, K - 1, C] -> theirs [N, K - 1, C] once the spans are in."""
        buffer = jnp.concatenate([self.known(history).reshape(-1, history.shape[-1]), x[0].astype(history.dtype)])
        return buffer[self.history_index]

    def narrow(self, x: jax.Array) -> jax.Array:
        """x [1, T, ...] -> [S, width, ...]: each slot's narrow-group tokens (padding past its count)."""
        return x[0][jnp.clip(self._narrow_index(), 0, self.tokens - 1)]

    def _narrow_index(self) -> jax.Array:
        """[S, width] the flat index of each slot's narrow-group query rows (unclipped)."""
        return self.starts[:, None] + jnp.arange(self.width, dtype=jnp.int32)[None, :]


def token_slots(starts: jax.Array, counts: jax.Array, tokens: int) -> jax.Array:
    """starts, counts [S] -> [T] int32: the slot whose span (disjoint, as a step's are) holds each flat token, S
    where none does. Linear in S + T: each token takes the span that opens last at or before it, and is in it
    where that span reaches it (a step of thousands of slots and tokens would not hold an [S, T] comparison)."""
    slots = starts.shape[0]
    flat = jnp.arange(tokens, dtype=jnp.int32)
    opens = jnp.where(counts > 0, starts, tokens)  # an empty span holds nothing
    opening = jnp.full(tokens, slots, jnp.int32).at[opens].set(jnp.arange(slots, dtype=jnp.int32), mode="drop")
    last_open = jax.lax.cummax(jnp.where(opening < slots, flat, -1))  # [T]: -1 before the first span
    slot = opening[jnp.maximum(last_open, 0)]
    ends = (starts + counts)[jnp.minimum(slot, slots - 1)]
    return jnp.where((last_open >= 0) & (flat < ends), slot, slots).astype(jnp.int32)


def busy_slots(counts: jax.Array, tokens: int) -> jax.Array:
    """counts [S] -> [min(S, tokens)] int32: the slots that bring tokens, in slot order, then S (past every slot).
    With at least as many tokens as slots, every slot in order (busy or not)."""
    slots = counts.shape[0]
    if tokens >= slots:
        return jnp.arange(slots, dtype=jnp.int32)
    busy = counts > 0
    rank = jnp.where(busy, jnp.cumsum(busy) - 1, tokens)
    return jnp.full(tokens, slots, jnp.int32).at[rank].set(jnp.arange(slots, dtype=jnp.int32), mode="drop")


def _clipped(busy: jax.Array, slots: int) -> jax.Array:
    """Busy slots as indices: the padding past them (S) clipped to the last slot (its sequences are empty)."""
    return jnp.minimum(busy, slots - 1)


def _sequence_counts(busy: jax.Array, narrow_counts: jax.Array) -> jax.Array:
    """[N] each narrow sequence's queries (0 for padding)."""
    slots = narrow_counts.shape[0]
    return jnp.where(busy < slots, narrow_counts[_clipped(busy, slots)], 0)


def _lane_tokens(starts: jax.Array, lanes: Lanes) -> jax.Array:
    """[P, lane width] the flat index of each lane's query rows."""
    c = jnp.arange(lanes.width, dtype=jnp.int32)
    return (starts[lanes.slot] + lanes.first)[:, None] + c[None, :]


def _lane_real(lanes: Lanes) -> jax.Array:
    return jnp.arange(lanes.width)[None, :] < lanes.count[:, None]


def _past(slots: int, width: int, lanes: Lanes | None) -> int:
    """The row after both groups' (a zero row there gives padding tokens zeros)."""
    return slots * width + (0 if lanes is None else lanes.count.shape[0] * lanes.width)
