"""Inkling 2 relative-bias attention (sliding-window and full layers).

q, k and relative states are L2-clipped (q and relative states after a learned scale), v is
RMS-normalised without gain, K and V pass through short convolutions (static on sliding layers,
input-dependent on full layers). Full layers scale q and the relative states by
tau = 1 + alpha * log(max((pos + 1) / n_floor, 1)). The output is gated by sigmoid(gate_proj(x)).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from inkling_jax.cache import KVCache, advance_conv
from inkling_jax.config import TextConfig
from inkling_jax.model.chunk import Chunk
from inkling_jax.model.norms import ScaledL2Clip, l2_clip, rms_normalize
from inkling_jax.model.params import HeadProjections, Linear, normal, param
from inkling_jax.model.short_conv import DynamicShortConvolution, ShortConvolution
from inkling_jax.sharding import MODEL
from pallas_kernels.numerics import materialized, round_to
from pallas_kernels.ragged_paged_attention import paged_keys, ragged_paged_attention
from pallas_kernels.relative_attention import relative_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerIndex:
    """Where a layer's K/V sit in the decode state: its index among the layers of its kind (an int32 scalar,
    traced inside the scan over layers). Its convolution states come in the cache's one-layer view
    (`inkling_jax.cache.layer_view`)."""

    kind: jax.Array


def write_pages(pages: jax.Array, layer: int, values: jax.Array, chunk: Chunk) -> jax.Array:
    """pages [layers, P, H, page, D] with each real token's values [1, T, H, D] stored at its position in
    `layer`'s pages (an in-place update of the donated state)."""
    page_size = pages.shape[3]
    positions, slot = chunk.positions[0], jnp.minimum(chunk.token_slot, chunk.slots - 1)
    page = chunk.page_table[slot, jnp.minimum(positions // page_size, chunk.page_table.shape[1] - 1)]
    page = jnp.where(chunk.valid[0], page, pages.shape[1])  # padding writes nowhere
    return pages.at[layer, page, :, positions % page_size].set(values[0].astype(pages.dtype), mode="drop")


def all_layer_pages(pages: jax.Array, layer: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """pages [layers, P, H, page, D] as one pool [layers * P, H, page, D] (a free reshape) and what to add to a page
    id of `layer` to find it there: a kernel reads the layer in place, where indexing the layer (traced inside the
    scan over layers) would copy all its pages first."""
    layers, count = pages.shape[:2]
    return pages.reshape(layers * count, *pages.shape[2:]), jnp.asarray(layer, jnp.int32) * count


def all_layer_rings(rings: jax.Array, layer: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """rings [layers, S, H, R, D] as one stack [layers * S, H, R, D] (a free reshape) and the row where `layer`'s
    rings start in it: a kernel reads the layer in place, where indexing it (traced inside the scan) would copy."""
    layers, slots = rings.shape[:2]
    return rings.reshape(layers * slots, *rings.shape[2:]), jnp.asarray(layer, jnp.int32) * slots


def read_pages(pages: jax.Array, layer: int, chunk: Chunk) -> tuple[jax.Array, jax.Array]:
    """Each slot's keys of `layer` in position order [S, L, H, D] and their positions [S, L]."""
    return paged_keys(pages[layer], chunk.page_table)


def write_draft_context(kv: KVCache, k: jax.Array, v: jax.Array, chunk: Chunk) -> KVCache:
    """kv with the draft's context K, V [draft layers, 1, T, Hkv, D] (`Draft.context_kv` of the step's
    positions) stored for every real token. A verify pass writes all its positions: the draft reads only
    positions before its anchor, which are committed, and the next round overwrites the rejected ones (as
    with the target's K/V, nothing is rolled back)."""
    draft_k, draft_v = kv.draft_k, kv.draft_v
    for layer in range(k.shape[0]):
        draft_k = write_pages(draft_k, layer, k[layer], chunk)
        draft_v = write_pages(draft_v, layer, v[layer], chunk)
    return dataclasses.replace(kv, draft_k=draft_k, draft_v=draft_v)


def read_draft_context(kv: KVCache, page_table: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's draft context K, V [draft layers, S, L, Hkv, D] in position order and their positions [S, L],
    through the rows' pages (page_table [S, max pages]): `Draft.block_hidden`'s context (it reads only positions
    before the anchor)."""
    layers = range(kv.draft_k.shape[0])
    k = jnp.stack([paged_keys(kv.draft_k[layer], page_table)[0] for layer in layers])
    v = jnp.stack([paged_keys(kv.draft_v[layer], page_table)[0] for layer in layers])
    return k, v, paged_keys(kv.draft_k[0], page_table)[1]


def write_ring(rings: jax.Array, layer: int, values: jax.Array, chunk: Chunk) -> jax.Array:
    """rings [layers, S, H, R, D] with each real token's values [1, T, H, D] at its slot's ring position
    % R of `layer`."""
    size = rings.shape[3]
    index = jnp.where(chunk.valid[0], chunk.positions[0] % size, size)
    return rings.at[layer, chunk.token_slot, :, index].set(values[0].astype(rings.dtype), mode="drop")


def grouped_attention(
    chunk: Chunk, attend: Callable[..., jax.Array], q: jax.Array, rel: jax.Array, sinks: jax.Array
) -> jax.Array:
    """The step's attention [1, T, Hq, D] from q [1, T, Hq, D], rel [1, T, Hq, d_rel], sinks [1, T, Hq]: each
    group of sequences (`Chunk.groups`) through attend(q, rel, sinks, kv_lens, query_lens, page_table, slots) with
    its query rows gathered [N, W, ...], and the rows back to their tokens (zeros at padding). An ordered chunk's
    one group reads and writes the step's rows as they lie: no gather of q, rel and sinks, none of the output."""
    if chunk.ordered:
        index, kv_lens, query_lens, table, slots = chunk.groups()[0]
        rows = index.size

        def grouped(x: jax.Array) -> jax.Array:  # [1, T, ...] -> [N, W, ...]
            return x[0, :rows].reshape(*index.shape, *x.shape[2:])

        out = attend(grouped(q), grouped(rel), grouped(sinks), kv_lens, query_lens, table, slots)
        out = out.reshape(rows, *out.shape[2:])
        return jnp.pad(out, [(0, chunk.tokens - rows)] + [(0, 0)] * (out.ndim - 1))[None]
    outs = []
    for index, kv_lens, query_lens, table, slots in chunk.groups():
        out = attend(q[0][index], rel[0][index], sinks[0][index], kv_lens, query_lens, table, slots)
        outs.append(out.reshape(-1, *out.shape[2:]))
    outs.append(jnp.zeros((1, *outs[0].shape[1:]), outs[0].dtype))
    return jnp.concatenate(outs)[chunk.source][None]


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_lens: jax.Array,
    query_lens: jax.Array,
    rel: jax.Array,
    rel_proj: jax.Array,
    sinks: jax.Array,
    *,
    page_table: jax.Array | None,
    scale: float,
    window: int | None,
    ring_rows: jax.Array | None = None,
) -> jax.Array:
    """`ragged_paged_attention` (the platform's kernel) over this device's heads: q, rel, sinks split by
    query head and the cache by KV head on the mesh's `model` axis (heads never meet in attention)."""
    attend = functools.partial(ragged_paged_attention, scale=scale, window=window)
    mesh = jax.sharding.get_abstract_mesh()
    ring_rows = jnp.arange(q.shape[0], dtype=jnp.int32) if ring_rows is None else ring_rows
    if MODEL not in mesh.axis_names or mesh.shape[MODEL] == 1:
        return attend(q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, page_table=page_table, ring_rows=ring_rows)
    heads, kv_heads = P(None, None, MODEL), P(None, MODEL)
    tables = () if page_table is None else (page_table,)

    def local(q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, ring_rows, *tables):
        table = tables[0] if tables else None
        return attend(q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, page_table=table, ring_rows=ring_rows)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads, kv_heads, kv_heads, P(), P(), heads, P(), heads, P(), *(P() for _ in tables)),
        out_specs=heads,
        axis_names={MODEL},
        check_vma=False,  # Pallas kernels' outputs carry no varying-axes type
    )(q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, ring_rows, *tables)


class RelativeLogits(nnx.Module):
    """The bank of bias-versus-distance profiles that relative states mix: proj [d_rel, extent]."""

    def __init__(self, rngs: nnx.Rngs, d_rel: int, extent: int, dtype: jnp.dtype, std: float):
        self.proj = param(rngs, (d_rel, extent), (None, None), dtype, normal(std))


def log_length_scale(positions: jax.Array, alpha: float, n_floor: int) -> jax.Array:
    """tau [B, T] in fp32: 1 before position n_floor - 1, growing with log(position) after."""
    ratio = (positions + 1).astype(jnp.float32) / n_floor
    return 1.0 + alpha * jnp.log(jnp.maximum(ratio, 1.0))


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: TextConfig, layer: int, dtype: jnp.dtype):
        self.config = config
        self.sliding = config.is_sliding(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = config.attention_dims(layer)
        hidden, std = config.hidden_size, config.initializer_range
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

        def linear(in_features: int, out_features: int, axes: tuple[str, str]) -> Linear:
            return Linear(rngs, in_features, out_features, axes, dtype, std)

        self.q_proj = linear(hidden, q_size, ("heads", "embed"))
        self.k_proj = linear(hidden, kv_size, ("kv_heads", "embed"))
        self.v_proj = linear(hidden, kv_size, ("kv_heads", "embed"))
        self.r_proj = linear(hidden, self.num_heads * config.d_rel, ("heads", "embed"))
        self.o_proj = linear(q_size, hidden, ("embed", "heads"))
        self.gate_proj = linear(hidden, q_size, ("heads", "embed"))
        self.sink_proj = linear(hidden, self.num_heads, ("heads", "embed"))
        kernel = config.conv_kernel_size
        if self.sliding:
            self.k_sconv = ShortConvolution(rngs, kv_size, kernel, "kv_heads", std)
            self.v_sconv = ShortConvolution(rngs, kv_size, kernel, "kv_heads", std)
        else:
            self.k_sconv = DynamicShortConvolution(rngs, kv_size, hidden, self.num_kv_heads, kernel, dtype, std)
            self.v_sconv = DynamicShortConvolution(rngs, kv_size, hidden, self.num_kv_heads, kernel, dtype, std)
        self.rel_logits_proj = RelativeLogits(rngs, config.d_rel, config.relative_extent(layer), dtype, std)
        self.q_l2_clip = ScaledL2Clip(rngs, self.num_heads, self.head_dim, config.qk_l2_clip_threshold, dtype)
        self.rel_l2_clip = ScaledL2Clip(rngs, self.num_heads, config.d_rel, config.rel_l2_clip_threshold, dtype)

    def fuse_projections(self) -> None:
        """In place: one weight for the projections that read the same input (`HeadProjections`), the query
        side's (q, gate, r, sink: [..., H, 2D + d_rel + 1, hidden]) and on sliding layers K and V's ([..., KV,
        2D, hidden]), so one gemm reads each group (at a decode step's few tokens a gemm costs about its launch).
        Same values (`HeadProjections`). The fused module no longer names its weights as checkpoints do."""
        d, d_rel = self.head_dim, self.config.d_rel
        query_side = [(self.q_proj, d), (self.gate_proj, d), (self.r_proj, d_rel), (self.sink_proj, 1)]
        self.query_side = HeadProjections(query_side, self.num_heads, "heads")
        del self.q_proj, self.gate_proj, self.r_proj, self.sink_proj
        if self.sliding:
            self.key_value = HeadProjections([(self.k_proj, d), (self.v_proj, d)], self.num_kv_heads, "kv_heads")
            del self.k_proj, self.v_proj

    def _query_side(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x [B, T, hidden] -> q [B, T, H, D], gate logits [B, T, H * D], rel [B, T, H, d_rel], sinks [B, T, H]."""
        if hasattr(self, "query_side"):
            q, gate, rel, sinks = self.query_side(x)
            return q, gate.reshape(*x.shape[:-1], -1), rel, sinks[..., 0]
        heads = (*x.shape[:-1], self.num_heads, -1)
        return (self.q_proj(x).reshape(heads), self.gate_proj(x), self.r_proj(x).reshape(heads), self.sink_proj(x))

    def _keys_values(self, k_in: jax.Array, v_in: jax.Array) -> tuple[jax.Array, jax.Array]:
        """k_in, v_in [B, T, hidden] -> K and V before their convolutions, [B, T, KV * D] each."""
        if hasattr(self, "key_value"):
            k, v = self.key_value(k_in)
            return k.reshape(*k.shape[:-2], -1), v.reshape(*v.shape[:-2], -1)
        return self.k_proj(k_in), self.v_proj(v_in)

    def _convolve(self, conv: nnx.Module, x: jax.Array, source: jax.Array, lags: jax.Array | None) -> jax.Array:
        return conv(x, lags=lags) if self.sliding else conv(x, source, lags=lags)

    def __call__(
        self,
        q_in: jax.Array,
        k_in: jax.Array,
        v_in: jax.Array,
        positions: jax.Array,
        kv: KVCache | None = None,
        chunk: Chunk | None = None,
        at: LayerIndex | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """q_in, k_in, v_in [B, T, H] (the same array on sliding layers); positions [B, T] -> [B, T, H].

        Without a cache the T tokens are a whole sequence; with one (and its `chunk`) they follow what
        the cache holds, and the cache comes back with this layer's part updated (`at`: where that part is).
        """
        config = self.config
        batch, length, _ = q_in.shape
        dtype = q_in.dtype
        kv_heads = (batch, length, self.num_kv_heads, self.head_dim)
        kv_size = self.num_kv_heads * self.head_dim

        q, gate_logits, rel, sinks = self._query_side(q_in)
        q = self.q_l2_clip(q)
        k_pre, v_pre = self._keys_values(k_in, v_in)
        k_lags = v_lags = None
        if kv is not None:
            k_lags = chunk.lags(k_pre.astype(jnp.float32), kv.conv_k[0, ..., :kv_size])
            v_lags = chunk.lags(v_pre.astype(jnp.float32), kv.conv_v[0, ..., :kv_size])
        # each convolved once into its own array: the norms' reductions and the cache writes read the values, where
        # fused with the convolution the reductions' few rows each redo its lag gathers
        k = materialized(self._convolve(self.k_sconv, k_pre, k_in, k_lags))
        v = materialized(self._convolve(self.v_sconv, v_pre, v_in, v_lags))
        k = round_to(l2_clip(k.reshape(kv_heads), config.qk_l2_clip_threshold), dtype)
        v = round_to(rms_normalize(v.reshape(kv_heads), config.rms_norm_eps), dtype)
        rel = self.rel_l2_clip(rel)
        if not self.sliding:
            tau = log_length_scale(positions, config.log_scaling_alpha, config.log_scaling_n_floor)
            tau = tau[:, :, None, None]
            q = round_to(q.astype(jnp.float32) * tau, dtype)
            rel = round_to(rel.astype(jnp.float32) * tau, dtype)

        proj = self.rel_logits_proj.proj[...]
        scale, window = self.head_dim**-0.5, config.sliding_window_size if self.sliding else None
        if kv is None:
            out = relative_attention(q, k, v, rel, proj, sinks, positions, positions, scale=scale, window=window)
        else:
            kind = at.kind
            copies = (kv.sliding_k if self.sliding else kv.full_k).shape[2] // self.num_kv_heads
            if copies > 1:  # more devices than KV heads: each device's cache keeps the head its queries read
                k, v = jnp.repeat(k, copies, axis=2), jnp.repeat(v, copies, axis=2)
            if self.sliding:
                kv = dataclasses.replace(
                    kv,
                    sliding_k=write_ring(kv.sliding_k, kind, k, chunk),
                    sliding_v=write_ring(kv.sliding_v, kind, v, chunk),
                )
                (k, base), (v, _) = (all_layer_rings(rings, kind) for rings in (kv.sliding_k, kv.sliding_v))
                paged = False
            else:
                kv = dataclasses.replace(
                    kv, full_k=write_pages(kv.full_k, kind, k, chunk), full_v=write_pages(kv.full_v, kind, v, chunk)
                )
                (k, base), (v, _) = (all_layer_pages(pages, kind) for pages in (kv.full_k, kv.full_v))
                paged = True
            kv = advance_conv(advance_conv(kv, "k", k_pre, chunk), "v", v_pre, chunk)

            def attend(q, rel, sinks, kv_lens, query_lens, table, slots):  # base: the layer's first page or ring
                return cached_attention(
                    q,
                    k,
                    v,
                    kv_lens,
                    query_lens,
                    rel,
                    proj,
                    sinks,
                    page_table=table + base if paged else None,
                    scale=scale,
                    window=window,
                    ring_rows=None if paged else base + slots,
                )

            out = grouped_attention(chunk, attend, q, rel, sinks)
        gate = jax.nn.sigmoid(gate_logits.astype(jnp.float32))
        out = round_to(out.reshape(batch, length, -1).astype(jnp.float32) * gate, dtype)
        return self.o_proj(out), kv


def fuse_attention_projections(model: nnx.Module) -> nnx.Module:
    """`model` with every attention layer's projections fused (`Attention.fuse_projections`), in place."""
    layers = [module for _, module in nnx.iter_graph(model) if isinstance(module, Attention)]
    for layer in layers:
        if not hasattr(layer, "query_side"):
            layer.fuse_projections()
    return model
