"""Decode state: what each sequence keeps between steps, sized from the config and a memory budget.

Per sequence (DESIGN.md):
- full-attention layers: K and V of every token, in 128-token pages drawn from one shared pool, found
  through the sequence's page table;
- sliding-window layers: K and V of the last `window + max_chunk` tokens in a ring. A chunk of C new
  tokens is written before attention reads, and its first token still needs the window - 1 tokens
  before it, so the ring must hold window - 1 + C tokens: a ring of exactly the window is not enough.
  A ring longer than a page is rounded up to whole pages, so that the attention kernels tile it in
  128-key blocks whatever the chunk (`ring_size`);
- four short-convolution states per layer (the last K - 1 inputs of the K, V, post-attention and
  post-MLP convolutions), in the activation dtype, which is exactly what the convolutions read. Unlike
  K/V they do not roll back by length: a speculative verify pass records each layer's window (history
  then the chunk's inputs, `ConvWindows`) and `commit_conv` keeps the accepted prefix;
- when speculating with a DSpark draft, the draft's context K/V of every position fed, in the same pages as the
  full-attention layers (like K/V, rejected positions past the committed length are never read);
- for sampling: each sequence's generated-token counts, its prompt's token set and its count of
  generated tokens.
Block attention residuals keep nothing across tokens. Under tensor parallelism (`tp`) attention heads,
and with them K/V and the K/V convolution states, split across devices; the residual-stream
convolution states are replicated. Beyond as many devices as KV heads, the K/V caches hold each KV head
once per device that reads it (tp heads in all, one per device) and the K/V convolution states are
replicated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from inkling_jax.config import DraftConfig, TextConfig
from inkling_jax.model.chunk import Chunk
from inkling_jax.model.short_conv import committed_history, conv_window

PAGE_SIZE = 128


class CacheBudgetError(ValueError):
    """A memory budget too small for the requested slots and context."""


ROUND_ROWS = 8  # the constrained speculative rounds a step runs in each replica (`inkling_jax.step.Rounds`)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static sizes of a decode state (all compiled into the step's shapes)."""

    max_num_seqs: int
    num_pages: int
    max_pages_per_seq: int
    max_chunk: int
    page_size: int = PAGE_SIZE
    boundaries: bool = False  # keep what a prefix cache saves at page boundaries (`BoundaryStates`)

    def ring(self, text: TextConfig) -> int:
        """Tokens a sliding layer keeps per sequence."""
        return ring_size(text, self.max_chunk, self.boundaries)


def ring_size(text: TextConfig, max_chunk: int, boundaries: bool = False) -> int:
    """A sliding layer's ring: window + max_chunk slots, rounded up to whole pages beyond one (a tiny test model's
    ring stays as it is). With `boundaries`, window + two pages at least: a prefix cache saves the window before the
    last page boundary a sequence landed on once the sequence ends, up to a page and a few in-flight steps later."""
    ring = text.sliding_window_size + (max(max_chunk, 2 * PAGE_SIZE) if boundaries else max_chunk)
    return ring if ring <= PAGE_SIZE else -(-ring // PAGE_SIZE) * PAGE_SIZE


def _kv_heads(text: TextConfig, sliding: bool, tp: int) -> tuple[int, int]:
    """(KV heads per device, head dim): heads split over tp devices, one each once tp exceeds them."""
    kv_heads, head_dim = (
        (text.swa_num_key_value_heads, text.swa_head_dim) if sliding else (text.num_key_value_heads, text.head_dim)
    )
    return max(1, kv_heads // tp), head_dim


def kv_split(text: TextConfig, tp: int) -> bool:
    """Whether tp devices split the KV heads of both layer kinds (else each keeps the K/V projections whole)."""
    return text.num_key_value_heads % tp == 0 and text.swa_num_key_value_heads % tp == 0


def _layer_counts(text: TextConfig) -> tuple[int, int]:
    sliding = sum(text.is_sliding(i) for i in range(text.num_hidden_layers))
    return sliding, text.num_hidden_layers - sliding


def kv_bytes_per_token(text: TextConfig, sliding: bool, dtype: jnp.dtype, tp: int = 1) -> int:
    """K and V bytes of one token in one layer of the given kind, per device."""
    heads, head_dim = _kv_heads(text, sliding, tp)
    return 2 * heads * head_dim * jnp.dtype(dtype).itemsize


def conv_state_bytes(text: TextConfig, dtype: jnp.dtype, tp: int = 1) -> int:
    """Short-convolution state bytes of one sequence over all layers, per device."""
    total = 0
    for layer in range(text.num_hidden_layers):
        heads, head_dim = _kv_heads(text, text.is_sliding(layer), tp if kv_split(text, tp) else 1)
        channels = 2 * heads * head_dim + 2 * text.hidden_size  # K, V; post-attention, post-MLP (replicated)
        total += (text.conv_kernel_size - 1) * channels * jnp.dtype(dtype).itemsize
    return total


def snapshot_bytes(text: TextConfig, dtype: jnp.dtype, tp: int = 1) -> int:
    """Bytes per device of one prefix-cache snapshot (`Snapshots`): the sliding layers' window and every layer's
    convolution states."""
    sliding_layers, _ = _layer_counts(text)
    window = sliding_layers * text.sliding_window_size * kv_bytes_per_token(text, True, dtype, tp)
    return window + conv_state_bytes(text, dtype, tp)


def draft_split(draft: DraftConfig, tp: int) -> bool:
    """Whether tp devices split the draft's context KV heads (else each device keeps all of them)."""
    return draft.num_key_value_heads % tp == 0


def draft_bytes_per_token(draft: DraftConfig | None, dtype: jnp.dtype, tp: int = 1) -> int:
    """Draft context K and V bytes of one token over all draft layers, per device (0 without a draft)."""
    if draft is None:
        return 0
    heads = draft.num_key_value_heads // tp if draft_split(draft, tp) else draft.num_key_value_heads
    return draft.num_hidden_layers * 2 * heads * draft.head_dim * jnp.dtype(dtype).itemsize


def bytes_per_sequence(
    text: TextConfig,
    context: int,
    *,
    max_chunk: int,
    dtype: jnp.dtype = jnp.bfloat16,
    tp: int = 1,
    draft: DraftConfig | None = None,
) -> dict[str, int]:
    """Device bytes one sequence of `context` tokens holds, by part (sampling state excluded)."""
    sliding_layers, full_layers = _layer_counts(text)
    pages = math.ceil(context / PAGE_SIZE)
    ring = min(ring_size(text, max_chunk), context)
    parts = {
        "full_attention_kv": full_layers * pages * PAGE_SIZE * kv_bytes_per_token(text, False, dtype, tp),
        "sliding_window_kv": sliding_layers * ring * kv_bytes_per_token(text, True, dtype, tp),
        "conv_states": conv_state_bytes(text, dtype, tp),
        "draft_context_kv": pages * PAGE_SIZE * draft_bytes_per_token(draft, dtype, tp),
    }
    return {**parts, "total": sum(parts.values())}


def layout_for_budget(
    text: TextConfig,
    budget_bytes: int,
    *,
    max_num_seqs: int,
    max_context: int,
    max_chunk: int,
    dtype: jnp.dtype = jnp.bfloat16,
    tp: int = 1,
    draft: DraftConfig | None = None,
    snapshots: int = 0,
) -> CacheLayout:
    """The largest page pool that fits `budget_bytes` (per device) after every slot's fixed state and, with a
    prefix cache, its `snapshots` and each slot's boundary states; a page holds its tokens' K/V of every
    full-attention layer and, with a draft, their draft context K/V."""
    sliding_layers, full_layers = _layer_counts(text)
    ring = ring_size(text, max_chunk, snapshots > 0)
    gamma = 0 if draft is None else draft.block_size
    fixed = (
        max_num_seqs
        * (
            sliding_layers * ring * kv_bytes_per_token(text, True, dtype, tp)
            + conv_state_bytes(text, dtype, tp)
            + text.unpadded_vocab_size * 9  # sampling: int32 output counts, a bool prompt mask, float32 kept logits
        )
        + ROUND_ROWS * gamma * (text.unpadded_vocab_size + 1) * 4  # the constrained rounds' kept drafts and q
    )
    if snapshots:  # the prefix cache's: each slot's boundary states, and the snapshots
        fixed += max_num_seqs * 2 * conv_state_bytes(text, dtype, tp) + snapshots * snapshot_bytes(text, dtype, tp)
    per_page = PAGE_SIZE * (
        max(1, full_layers) * kv_bytes_per_token(text, False, dtype, tp) + draft_bytes_per_token(draft, dtype, tp)
    )
    num_pages = (budget_bytes - fixed) // per_page
    max_pages_per_seq = math.ceil(max_context / PAGE_SIZE)
    if num_pages < max_pages_per_seq:
        raise CacheBudgetError(
            f"a budget of {budget_bytes / 2**30:.2f} GiB holds {max(num_pages, 0)} pages after the fixed state of "
            f"{max_num_seqs} sequences ({fixed / 2**30:.2f} GiB); one sequence of {max_context} tokens needs "
            f"{max_pages_per_seq}"
        )
    return CacheLayout(max_num_seqs, int(num_pages), max_pages_per_seq, max_chunk, boundaries=snapshots > 0)


CONV_STREAMS = ("k", "v", "attention", "mlp")  # KVCache.conv_{stream}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvWindows:
    """One step's short-convolution windows, per stream: each layer's history before the step followed by the
    narrow group's W inputs (`Chunk.narrow`), [layers, S, K - 1 + W, channels] (channels as in the KVCache's
    conv_{stream}; a layer with fewer K/V channels leaves the rest zero, as its state does)."""

    k: jax.Array
    v: jax.Array
    attention: jax.Array
    mlp: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The layers' state, stacked by layer kind; each layer updates its part in place."""

    full_k: jax.Array  # [full layers, num_pages, kv_heads, page, head_dim] (head-major pages, as kernels read them)
    full_v: jax.Array
    sliding_k: jax.Array  # [sliding layers, S, kv_heads, ring, head_dim]; token p at ring slot p % ring
    sliding_v: jax.Array
    conv_k: jax.Array  # [layers, S, K - 1, kv channels], oldest first
    conv_v: jax.Array
    conv_attention: jax.Array  # [layers, S, K - 1, hidden]
    conv_mlp: jax.Array
    draft_k: jax.Array | None = None  # [draft layers, num_pages, draft kv_heads, page, draft head_dim]; None: no draft
    draft_v: jax.Array | None = None
    windows: ConvWindows | None = None  # only inside a pass that records them (`record_windows`), never kept


def record_windows(kv: KVCache, width: int) -> KVCache:
    """kv, set to also record every layer's convolution windows (`ConvWindows`) of a chunk of `width` tokens."""

    return dataclasses.replace(
        kv, windows=ConvWindows(*(_empty_windows(getattr(kv, f"conv_{s}"), width) for s in CONV_STREAMS))
    )


def _empty_windows(history: jax.Array, width: int) -> jax.Array:
    """[layers, S, K - 1, ch] -> zeros [layers, S, K - 1 + width, ch] (varying where history does)."""
    return jnp.pad(jnp.zeros_like(history), ((0, 0), (0, 0), (0, width), (0, 0)))


def advance_conv(kv: KVCache, stream: str, x: jax.Array, chunk: Chunk) -> KVCache:
    """kv (one layer's view, `layer_view`) with its `stream` convolution state moved past each slot's span of the
    step's inputs x [1, T, ch] (ch: the layer's channels, a prefix of the state's), and its narrow group's window
    recorded when kv records them."""
    name, channels = f"conv_{stream}", x.shape[-1]
    state = getattr(kv, name)  # [1, S, K - 1, all channels]
    history = state[0, ..., :channels]
    kv = dataclasses.replace(kv, **{name: state.at[0, ..., :channels].set(chunk.history(x, history))})
    if kv.windows is None:
        return kv
    window = conv_window(chunk.known(history), chunk.narrow(x))  # [S, K - 1 + width, ch]
    recorded = getattr(kv.windows, stream).at[0, ..., :channels].set(window)
    return dataclasses.replace(kv, windows=dataclasses.replace(kv.windows, **{stream: recorded}))


def conv_rows(kv: KVCache, first: int, rows: int, width: int, slots: jax.Array | None) -> tuple[jax.Array, ...]:
    """The four convolution states of layers first .. first + rows * width - 1, each [rows, width, N, K - 1, ch]:
    the per-layer inputs of a scan over `rows` blocks of `width` layers, for the step's `Chunk.conv_slots`
    (`slots`: [N] int32, S for padding; None: every slot)."""

    def rows_of(stack: jax.Array) -> jax.Array:
        layers = stack[first : first + rows * width]
        if slots is not None:
            layers = layers[:, jnp.minimum(slots, stack.shape[1] - 1)]
        return layers.reshape(rows, width, *layers.shape[1:])

    return tuple(rows_of(getattr(kv, f"conv_{s}")) for s in CONV_STREAMS)


def layer_view(kv: KVCache, states: tuple[jax.Array, ...]) -> KVCache:
    """kv as one layer sees it: its four convolution states `states` ([N, K - 1, ch] each, the step's
    `Chunk.conv_slots`) as stacks of one layer,
    and, when kv records windows, empty windows of one layer. A scan over layers carries the rest of the cache and
    hands each layer its states as scan inputs, so that no layer updates a stack of every layer's (XLA copies a
    stack that one layer reads and another updates inside a loop)."""
    views = {f"conv_{s}": state[None] for s, state in zip(CONV_STREAMS, states, strict=True)}
    if kv.windows is not None:
        width = kv.windows.k.shape[2] - kv.conv_k.shape[2]
        views["windows"] = ConvWindows(*(_empty_windows(state[None], width) for state in states))
    return dataclasses.replace(kv, **views)


def leave_view(view: KVCache, kv: KVCache) -> tuple[KVCache, tuple[jax.Array, ...], tuple[jax.Array, ...] | None]:
    """A layer's `layer_view` after the layer -> (kv with the view's attention state, the layer's four convolution
    states [N, K - 1, ch], its four windows [N, K - 1 + C, ch] or None when not recording)."""
    states = tuple(getattr(view, f"conv_{s}")[0] for s in CONV_STREAMS)
    windows = None if view.windows is None else tuple(getattr(view.windows, s)[0] for s in CONV_STREAMS)
    convs = {f"conv_{s}": getattr(kv, f"conv_{s}") for s in CONV_STREAMS}
    return dataclasses.replace(view, **convs, windows=kv.windows), states, windows


def put_conv_rows(
    kv: KVCache,
    first: int,
    states: tuple[jax.Array, ...],
    windows: tuple[jax.Array, ...] | None,
    slots: jax.Array | None,
) -> KVCache:
    """kv with layers first .. first + n - 1's convolution states (and windows) set from a scan's outputs
    [rows, width, ...] (n = rows * width), for `conv_rows`' `slots`."""

    def put(stack: jax.Array, rows: jax.Array) -> jax.Array:
        rows = rows.reshape(-1, *rows.shape[2:])
        if slots is None:
            return jax.lax.dynamic_update_slice_in_dim(stack, rows, first, 0)
        return stack.at[first : first + rows.shape[0], slots].set(rows, mode="drop")

    kv = dataclasses.replace(
        kv, **{f"conv_{s}": put(getattr(kv, f"conv_{s}"), rows) for s, rows in zip(CONV_STREAMS, states, strict=True)}
    )
    if windows is None:
        return kv
    recorded = ConvWindows(*(put(getattr(kv.windows, s), rows) for s, rows in zip(CONV_STREAMS, windows, strict=True)))
    return dataclasses.replace(kv, windows=recorded)


def commit_conv(kv: KVCache, windows: ConvWindows, commit: jax.Array, slots: jax.Array) -> KVCache:
    """kv with every layer's four convolution states, for the `slots` ([S] bool, slots of the narrow group), as
    if only the first commit[s] tokens of the windows' chunk had been fed: window[layer, s, commit[s] : commit[s]
    + K - 1] (research 3.3). Full and sliding K/V need no such step: entries past the committed length are never
    read."""
    taps = kv.conv_k.shape[2]

    def keep(state: jax.Array, window: jax.Array) -> jax.Array:  # window [layers, S, K - 1 + W, ch]
        committed = jax.vmap(committed_history, in_axes=(0, None, None))(window, commit, taps)
        return jnp.where(slots[None, :, None, None], committed, state)

    return dataclasses.replace(
        kv, **{f"conv_{s}": keep(getattr(kv, f"conv_{s}"), getattr(windows, s)) for s in CONV_STREAMS}
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BoundaryStates:
    """Each slot's four convolution states (as the KVCache's conv_{stream}) at the last two page boundaries its
    length landed on, [layers, S, 2, K - 1, ch]: boundary b at index (b // PAGE_SIZE) % 2, so that a step which runs
    a sequence on past its end (dispatched before the end was read) lands at most on the other index."""

    k: jax.Array
    v: jax.Array
    attention: jax.Array
    mlp: jax.Array


def landed_on_boundaries(before: jax.Array, after: jax.Array) -> jax.Array:
    """[S] bool: the slots whose length went from before [S] to after [S], a multiple of PAGE_SIZE."""
    return (after > before) & (after % PAGE_SIZE == 0)


def record_boundaries(boundaries: BoundaryStates, kv: KVCache, after: jax.Array, landed: jax.Array) -> BoundaryStates:
    """boundaries with the convolution states of kv (after a step) kept for the `landed` slots (at their lengths
    `after`, [S]; `landed_on_boundaries`)."""
    slots = after.shape[0]
    rows, parity = jnp.where(landed, jnp.arange(slots), slots), (after // PAGE_SIZE) % 2

    def kept(states: jax.Array, conv: jax.Array) -> jax.Array:  # [layers, S, 2, K - 1, ch], [layers, S, K - 1, ch]
        return states.at[:, rows, parity].set(conv, mode="drop")

    return BoundaryStates(*(kept(getattr(boundaries, s), getattr(kv, f"conv_{s}")) for s in CONV_STREAMS))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Snapshots:
    """A prefix cache's saved states, each where a sequence landed on a page boundary b: the sliding layers' K and V
    of the window positions before it (position b - window + j at j: [N, sliding layers, kv_heads, window,
    head_dim]) and every layer's four convolution states there ([N, layers, K - 1, ch]). With the K/V of the pages
    before b, a sequence resumes at b as if it had computed them."""

    sliding_k: jax.Array
    sliding_v: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    conv_attention: jax.Array
    conv_mlp: jax.Array


def init_snapshots(state: DecodeState, text: TextConfig, count: int) -> Snapshots:
    """`count` empty snapshots for `state`'s layers (its sliding K/V heads and convolution channels)."""
    window = text.sliding_window_size
    kv = state.kv

    def pool(like: jax.Array, *shape: int) -> jax.Array:
        return jnp.zeros((count, *shape), like.dtype)

    layers, _, heads, _, dim = kv.sliding_k.shape
    convs = {f"conv_{s}": pool(c, c.shape[0], *c.shape[2:]) for s in CONV_STREAMS for c in [getattr(kv, f"conv_{s}")]}
    return Snapshots(
        pool(kv.sliding_k, layers, heads, window, dim), pool(kv.sliding_v, layers, heads, window, dim), **convs
    )


def _window_slots(boundary: jax.Array, window: int, ring: int) -> tuple[jax.Array, jax.Array]:
    """The ring slots of the window positions before `boundary` and whether each is a position of the sequence."""
    positions = boundary - window + jnp.arange(window)
    return positions % ring, positions >= 0


def save_snapshot(
    state: DecodeState, snapshots: Snapshots, slot: jax.Array, index: jax.Array, boundary: jax.Array
) -> Snapshots:
    """snapshots with the state `slot` kept at the page `boundary` it landed on last (or the one before) saved at
    `index`: its window from the rings, its convolution states from `DecodeState.boundaries`."""
    kv, window = state.kv, snapshots.sliding_k.shape[3]
    at, _ = _window_slots(boundary, window, kv.sliding_k.shape[3])
    parity = (boundary // PAGE_SIZE) % 2
    saved = {
        name: getattr(snapshots, name).at[index].set(jnp.take(getattr(kv, name)[:, slot], at, axis=2))
        for name in ("sliding_k", "sliding_v")
    }
    for stream in CONV_STREAMS:
        saved[f"conv_{stream}"] = (
            getattr(snapshots, f"conv_{stream}").at[index].set(getattr(state.boundaries, stream)[:, slot, parity])
        )
    return Snapshots(**saved)


def restore_snapshot(
    state: DecodeState,
    snapshots: Snapshots,
    slot: jax.Array,
    index: jax.Array,
    boundary: jax.Array,
    prompt_mask: jax.Array,
    output_counts: jax.Array,
) -> DecodeState:
    """state with `slot` resuming a sequence at the page `boundary`, the snapshot at `index` saved there (the K/V
    of the pages before it are the sequence's own, shared through its page table): its window and convolution
    states, its length, and its sampling state (prompt_mask [V] bool: the prompt's tokens before the boundary;
    output_counts [V] int32: the counts of its outputs there)."""
    kv, window = state.kv, snapshots.sliding_k.shape[3]
    at, real = _window_slots(boundary, window, kv.sliding_k.shape[3])
    at = jnp.where(real, at, kv.sliding_k.shape[3])  # positions before the sequence: not written

    def into_ring(ring: jax.Array, saved: jax.Array) -> jax.Array:  # [layers, S, heads, ring, dim], [layers, ...]
        return ring.at[:, slot].set(ring[:, slot].at[:, :, at].set(saved[index], mode="drop"))

    restored = {name: into_ring(getattr(kv, name), getattr(snapshots, name)) for name in ("sliding_k", "sliding_v")}
    boundaries = state.boundaries
    for stream in CONV_STREAMS:
        name = f"conv_{stream}"
        restored[name] = getattr(kv, name).at[:, slot].set(getattr(snapshots, name)[index])
        if boundaries is not None:  # the slot landed on the boundary: a save there finds its states
            kept = (
                getattr(boundaries, stream)
                .at[:, slot, (boundary // PAGE_SIZE) % 2]
                .set(getattr(snapshots, name)[index])
            )
            boundaries = dataclasses.replace(boundaries, **{stream: kept})
    return dataclasses.replace(
        state,
        boundaries=boundaries,
        kv=dataclasses.replace(kv, **restored),
        lengths=state.lengths.at[slot].set(boundary),
        prompt_mask=state.prompt_mask.at[slot].set(prompt_mask),
        output_counts=state.output_counts.at[slot].set(output_counts),
        generated=state.generated.at[slot].set(output_counts.sum()),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything sequences keep between steps (donated to the step)."""

    kv: KVCache
    page_table: jax.Array  # [S, max_pages_per_seq] int32 page ids
    lengths: jax.Array  # [S] int32 tokens already in the state
    output_counts: jax.Array  # [S, vocab] int32
    prompt_mask: jax.Array  # [S, vocab] bool
    generated: jax.Array  # [S] int32
    # [S, vocab] float32: the logits each slot's one-token sample of the last step came from, for the slots whose
    # sample that step deferred (`inkling_jax.step.resample_fn`); other rows hold older steps' logits
    logits: jax.Array
    # [replicas * ROUND_ROWS, γ] int32 and [replicas * ROUND_ROWS, γ, vocab] float32, None without a draft: by row of
    # `inkling_jax.step.Rounds`, the drafts of a constrained round's next round and the q each was drawn from, kept
    # while the host computes their masks. Never zero-sized: XLA turns a zero-sized input of a data-parallel step's
    # shard_map into an unused one, and Shardy's pass that drops unused inputs of a manual computation segfaults now
    # and then (jaxlib 0.11.2, on CPU)
    drafts: jax.Array | None = None
    draft_probs: jax.Array | None = None
    boundaries: BoundaryStates | None = None  # with a prefix cache (`CacheLayout.boundaries`)

    @property
    def nbytes(self) -> int:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self))


def init_state(
    text: TextConfig,
    layout: CacheLayout,
    dtype: jnp.dtype = jnp.bfloat16,
    tp: int = 1,
    draft: DraftConfig | None = None,
    replicas: int = 1,
) -> DecodeState:
    """An empty decode state for `tp` devices (unsharded; `inkling_jax.sharding` places it on a mesh), with the
    draft's context K/V pool and its constrained rounds' kept drafts (ROUND_ROWS for each of `replicas`) when a
    draft is given."""
    sliding_layers, full_layers = _layer_counts(text)
    slots, ring, taps = layout.max_num_seqs, layout.ring(text), text.conv_kernel_size - 1
    swa_heads, swa_dim = _kv_heads(text, True, 1)
    full_heads, full_dim = _kv_heads(text, False, 1)
    kv_channels = max(swa_heads * swa_dim, full_heads * full_dim)  # one array for both layer kinds
    swa_heads, full_heads = max(swa_heads, tp), max(full_heads, tp)  # a copy per device beyond the KV heads

    def zeros(*shape: int) -> jax.Array:  # a buffer of its own per field: the state is donated
        return jnp.zeros(shape, dtype)

    kv = KVCache(
        full_k=zeros(full_layers, layout.num_pages, full_heads, layout.page_size, full_dim),
        full_v=zeros(full_layers, layout.num_pages, full_heads, layout.page_size, full_dim),
        sliding_k=zeros(sliding_layers, slots, swa_heads, ring, swa_dim),
        sliding_v=zeros(sliding_layers, slots, swa_heads, ring, swa_dim),
        conv_k=zeros(text.num_hidden_layers, slots, taps, kv_channels),
        conv_v=zeros(text.num_hidden_layers, slots, taps, kv_channels),
        conv_attention=zeros(text.num_hidden_layers, slots, taps, text.hidden_size),
        conv_mlp=zeros(text.num_hidden_layers, slots, taps, text.hidden_size),
    )
    kept = {}
    if layout.boundaries:
        kept["boundaries"] = BoundaryStates(
            *(
                jnp.zeros((c.shape[0], slots, 2, *c.shape[2:]), dtype)
                for c in (kv.conv_k, kv.conv_v, kv.conv_attention, kv.conv_mlp)
            )
        )
    if draft is not None:
        pool = (draft.num_hidden_layers, layout.num_pages, draft.num_key_value_heads, layout.page_size, draft.head_dim)
        kv = dataclasses.replace(kv, draft_k=zeros(*pool), draft_v=zeros(*pool))
        rows, gamma, vocab = replicas * ROUND_ROWS, draft.block_size, text.unpadded_vocab_size
        kept |= {
            "drafts": jnp.zeros((rows, gamma), jnp.int32),
            "draft_probs": jnp.zeros((rows, gamma, vocab), jnp.float32),
        }
    return DecodeState(
        kv=kv,
        page_table=jnp.zeros((slots, layout.max_pages_per_seq), jnp.int32),
        lengths=jnp.zeros(slots, jnp.int32),
        output_counts=jnp.zeros((slots, text.unpadded_vocab_size), jnp.int32),
        prompt_mask=jnp.zeros((slots, text.unpadded_vocab_size), bool),
        generated=jnp.zeros(slots, jnp.int32),
        logits=jnp.zeros((slots, text.unpadded_vocab_size), jnp.float32),
        **kept,
    )
