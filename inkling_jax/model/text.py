"""The Inkling 2 text stack and its causal-LM head.

Every layer: block attention residual -> (input norms) -> relative-bias attention -> static short
conv; the residual restarts at block boundaries (the layer input becomes a block source); block
attention residual -> norm -> MoE -> static short conv. After the last layer a final block attention
residual, RMSNorm, the unembedding, a logit softcap and the slice to the real vocabulary. A checkpoint
with a DSpark draft adds it as `CausalLM.dspark` (`inkling_jax.model.draft`); it reads the target's
layer outputs (`TextModel(..., capture=...)`) and shares its embedding and LM head. An `inkling2` checkpoint's image
tower is `CausalLM.vision_tower` (`inkling_jax.model.vision`); its features enter in place of the image
placeholders' embeddings (`CausalLM.embed`).

The layers run as scans over attention-residual blocks (`inkling_jax.model.stack`): consecutive blocks whose
layers match place by place (attention kind, expert format) form a segment, whose parameters are stacked on a
leading block axis; one `lax.scan` steps through a segment, its body one block's layers. The released model's 8
blocks make three segments (NVFP4 blocks 0-5, block 6 with its NVFP4/MXFP8 boundary, MXFP8 block 7), so the
compiled program holds three blocks' layers whatever the depth. The closed blocks' inputs travel through the
scan as one buffer [blocks, B, T, H] with a traced count of the real ones.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.cache import (
    ConvWindows,
    KVCache,
    advance_conv,
    conv_rows,
    layer_view,
    leave_view,
    put_conv_rows,
    record_windows,
)
from inkling_jax.config import DraftConfig, TextConfig, VisionConfig
from inkling_jax.model.attention import Attention, LayerIndex, write_draft_context
from inkling_jax.model.attn_res import BlockAttentionResidual
from inkling_jax.model.chunk import Chunk
from inkling_jax.model.draft import Draft
from inkling_jax.model.moe import SparseMoeBlock
from inkling_jax.model.norms import RMSNorm, softcap
from inkling_jax.model.params import Linear, normal, param
from inkling_jax.model.short_conv import ShortConvolution
from inkling_jax.model.stack import Segment, plan_segments, stacked, unstacked
from inkling_jax.model.vision import VisionModel, merge_image_features, place_image_features
from pallas_kernels.attn_res import attn_res_norm
from pallas_kernels.numerics import round_to


def mixed_norms(
    mix: BlockAttentionResidual,
    norms: list[RMSNorm],
    sources: jax.Array,
    closed: jax.Array | None,
    partial: jax.Array,
    dtype: jnp.dtype,
) -> jax.Array:
    """norms[q](mix_q) in `dtype` for each of the mix's queries: [Q, B, T, H], one fused kernel where the
    platform has one (`pallas_kernels.attn_res`). sources [blocks, B, T, H]: the closed blocks' inputs, the
    first `closed` of them real (None: all)."""
    gains = jnp.stack([norm.weight[...] for norm in norms])
    return attn_res_norm(sources, partial, mix.queries(), gains, eps=norms[0].eps, out_dtype=dtype, valid=closed)


class DecoderLayer(nnx.Module):
    """One decoder layer's parameters, built like `layer`'s (its attention kind, its expert format). The model
    keeps them stacked with those of the same place in other blocks (`inkling_jax.model.stack`); where a call
    runs (its block, its part of the decode state) comes with the call."""

    def __init__(
        self, rngs: nnx.Rngs, config: TextConfig, layer: int, dtype: jnp.dtype, expert_format: str | None = None
    ):
        self.sliding = config.is_sliding(layer)
        self.block_boundary = config.is_block_boundary(layer)
        hidden, eps, std = config.hidden_size, config.rms_norm_eps, config.initializer_range
        # every layer mixes its attention input, but the model's first (no block is closed yet: its input is normed
        # as it is, and its stacked query is never read nor stored in checkpoints)
        self.attention_input = BlockAttentionResidual(rngs, hidden, 1 if self.sliding else 3)
        self.mlp_input = BlockAttentionResidual(rngs, hidden)
        self.self_attn = Attention(rngs, config, layer, dtype)
        self.mlp = SparseMoeBlock(rngs, config, dtype, expert_format)
        if self.sliding:
            self.input_layernorm = RMSNorm(rngs, hidden, eps, dtype)
        else:
            self.q_input_layernorm = RMSNorm(rngs, hidden, eps, dtype)
            self.k_input_layernorm = RMSNorm(rngs, hidden, eps, dtype)
            self.v_input_layernorm = RMSNorm(rngs, hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(rngs, hidden, eps, dtype)
        self.post_attention_convolution = ShortConvolution(rngs, hidden, config.conv_kernel_size, "embed", std)
        self.post_mlp_convolution = ShortConvolution(rngs, hidden, config.conv_kernel_size, "embed", std)

    def __call__(
        self,
        x: jax.Array,
        sources: jax.Array,
        block: jax.Array,
        positions: jax.Array,
        kv: KVCache | None = None,
        chunk: Chunk | None = None,
        at: LayerIndex | None = None,
        row: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        """x [B, T, H] (activation dtype); sources [blocks, B, T, H]: the closed blocks' inputs, real before
        `block` (this layer's attention-residual block, int32) -> (x, sources, kv) after the layer: a block's
        first layer closes the previous block (its input joins the sources); the cache's part at `at` is
        updated when the tokens continue one. `row`: the experts are the whole stack of the layer's segment
        [blocks, E, ...] and this layer's are row `row` of it (None: the layer's own)."""
        dtype = x.dtype
        if self.sliding:
            norms = [self.input_layernorm]
        else:
            norms = [self.q_input_layernorm, self.k_input_layernorm, self.v_input_layernorm]
        closed = block if self.block_boundary else block + 1
        inputs = mixed_norms(self.attention_input, norms, sources, closed, x, dtype)
        if self.block_boundary:
            plain = jnp.stack([round_to(norm(x), dtype) for norm in norms])
            inputs = jnp.where(block == 0, plain, inputs)
        if self.sliding:
            h, kv = self.self_attn(inputs[0], inputs[0], inputs[0], positions, kv, chunk, at)
        else:
            h, kv = self.self_attn(*inputs, positions, kv, chunk, at)
        attention_out = h
        h = self.post_attention_convolution(h, None if kv is None else chunk.lags(h, kv.conv_attention[0]))
        h = h.astype(jnp.float32)

        if self.block_boundary:
            sources = jax.lax.dynamic_update_index_in_dim(sources, x, block, 0)
        else:
            h = x.astype(jnp.float32) + h
        residual = h = jax.lax.optimization_barrier(h)  # read by the mix below and the sum at the end: computed once
        mlp_in = mixed_norms(self.mlp_input, [self.post_attention_layernorm], sources, block + 1, h, dtype)[0]
        mlp_out = self.mlp(mlp_in, row, None if chunk is None else chunk.valid)
        h = self.post_mlp_convolution(mlp_out, None if kv is None else chunk.lags(mlp_out, kv.conv_mlp[0]))
        if kv is not None:
            kv = advance_conv(kv, "attention", attention_out, chunk)
            kv = advance_conv(kv, "mlp", mlp_out, chunk)
        # materialized once: XLA would otherwise fuse this layer's convolutions into each reader of its output,
        # the next layers' residual sums too, and recompute them there
        return jax.lax.optimization_barrier(round_to(residual + h, dtype)), sources, kv


def decoder_layer(
    config: TextConfig, layer: int, dtype: jnp.dtype, expert_formats: Sequence[str | None]
) -> Callable[[nnx.Rngs], DecoderLayer]:
    """How layer `layer` is made from its rngs: what `stacked` makes for each block at the layer's position."""
    return functools.partial(DecoderLayer, config=config, layer=layer, dtype=dtype, expert_format=expert_formats[layer])


def expert_weights(path: tuple, _: object) -> bool:
    """An nnx filter: the routed experts' weights (of every layer of a stack)."""
    return "experts" in path


class LayerStack(nnx.Module):
    """One segment's layers: `positions[j]` holds the parameters of the j-th layer of each of its blocks, stacked
    on a leading [blocks] axis."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        config: TextConfig,
        segment: Segment,
        dtype: jnp.dtype,
        expert_formats: Sequence[str | None],
    ):
        self.segment = segment
        self.positions = nnx.List(
            [
                stacked(decoder_layer(config, layer, dtype, expert_formats), rngs, segment.blocks)
                for layer in segment.layers[: segment.width]
            ]
        )
        # where each position's K/V sits among its kind's layers: first block's index, and the step per block
        kinds = [config.is_sliding(layer) for layer in range(config.num_hidden_layers)]
        first = segment.layers[: segment.width]
        self.kind_base = tuple(kinds[:layer].count(kinds[layer]) for layer in first)
        self.kind_step = tuple(kinds[first[0] : first[0] + segment.width].count(kinds[layer]) for layer in first)

    def __call__(
        self,
        x: jax.Array,
        sources: jax.Array,
        positions: jax.Array,
        kv: KVCache | None,
        chunk: Chunk | None,
        capture: Sequence[int],
    ) -> tuple[jax.Array, jax.Array, KVCache | None, dict[int, jax.Array]]:
        """The segment's layers over x [B, T, H] -> (x, sources, kv, {layer: its output} for the captured layers
        in this segment)."""
        segment = self.segment
        taps = [
            j for j in range(segment.width) if any(layer in capture for layer in segment.layers[j :: segment.width])
        ]
        # the expert weights stay whole, read in place by the kernels at the block's row; the rest is sliced
        graphdef, experts, params = nnx.split(self.positions, expert_weights, ...)

        first = segment.layers[0]
        convs = None if kv is None else conv_rows(kv, first, segment.blocks, segment.width, chunk.conv_slots)

        def block(carry: tuple, inputs: tuple) -> tuple[tuple, tuple]:
            x, sources, kv = carry
            row, params, convs = inputs
            index = segment.first_block + row
            outputs, states, windows = [], [], []
            for j, layer in enumerate(nnx.merge(graphdef, experts, params)):
                at = LayerIndex(self.kind_base[j] + row * self.kind_step[j])
                view = None if kv is None else layer_view(kv, tuple(c[j] for c in convs))
                x, sources, view = layer(x, sources, index, positions, view, chunk, at, row)
                if kv is not None:
                    kv, state, window = leave_view(view, kv)
                    states.append(state)
                    windows.append(window)
                if j in taps:
                    outputs.append(x)
            if kv is None:
                return (x, sources, kv), (outputs, None, None)
            stack = functools.partial(jax.tree.map, lambda *layers: jnp.stack(layers))
            return (x, sources, kv), (outputs, stack(*states), None if kv.windows is None else stack(*windows))

        rows = jnp.arange(segment.blocks, dtype=jnp.int32)
        (x, sources, kv), (outputs, states, windows) = jax.lax.scan(block, (x, sources, kv), (rows, params, convs))
        if kv is not None:
            kv = put_conv_rows(kv, first, states, windows, chunk.conv_slots)
        captured = {
            segment.layers[row * segment.width + j]: out[row]
            for j, out in zip(taps, outputs, strict=True)
            for row in range(segment.blocks)
            if segment.layers[row * segment.width + j] in capture
        }
        return x, sources, kv, captured

    def layer(self, index: int) -> DecoderLayer:
        """Layer `index` (one of this segment's) with its own parameters, sliced out of the stack."""
        row, position = divmod(self.segment.layers.index(index), self.segment.width)
        return unstacked(self.positions[position], row)


class NormedEmbedding(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: TextConfig, dtype: jnp.dtype):
        shape = (config.vocab_size, config.hidden_size)
        self.weight = param(rngs, shape, ("vocab", "embed"), dtype, normal(config.initializer_range))
        self.embed_norm = RMSNorm(rngs, config.hidden_size, config.rms_norm_eps, dtype)

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return self.embed_norm(jnp.take(self.weight[...], token_ids, axis=0))


class TextModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: TextConfig, dtype: jnp.dtype, expert_formats: Sequence[str | None]):
        self.config = config
        self.embed_tokens = NormedEmbedding(rngs, config, dtype)
        self.segments = nnx.List(
            [
                LayerStack(rngs, config, segment, dtype, expert_formats)
                for segment in plan_segments(config, expert_formats)
            ]
        )
        self.norm = RMSNorm(rngs, config.hidden_size, config.rms_norm_eps, dtype)
        self.final_input = BlockAttentionResidual(rngs, config.hidden_size)

    def __call__(
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        kv: KVCache | None = None,
        chunk: Chunk | None = None,
        capture: Sequence[int] = (),
        embeddings: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None] | tuple[jax.Array, KVCache | None, jax.Array]:
        """token_ids, positions [B, T] int32 -> final hidden states [B, T, H] (activation dtype), and
        the updated cache when the tokens continue one. `embeddings` [B, T, H]: the layers' input instead of
        the tokens' normed embeddings (image features merged in: `CausalLM.embed`).

        With `capture` (layer ids, e.g. the draft's `target_layer_ids`) also the outputs of those layers,
        stacked in that order: [B, T, len(capture), H]. A layer's output is the residual stream it hands
        to the next layer: the running partial sum of the current attention-residual block after layer i
        (the closed blocks reach later layers only as sources) -- what a forward hook on the decoder layer
        sees, as DeepSpec taps its targets. It is not normalised.
        """
        x = self.embed_tokens(token_ids) if embeddings is None else embeddings
        dtype = x.dtype
        sources = jnp.broadcast_to(jnp.zeros_like(x), (self.config.num_blocks, *x.shape))  # varies where x does
        captured: dict[int, jax.Array] = {}
        for stack in self.segments:
            x, sources, kv, outputs = stack(x, sources, positions, kv, chunk, capture)
            captured |= outputs
        hidden = mixed_norms(self.final_input, [self.norm], sources, None, x, dtype)[0]
        if not capture:
            return hidden, kv
        return hidden, kv, jnp.stack([captured[i] for i in capture], axis=2)

    def expert_formats(self) -> list[str | None]:
        """Each layer's expert format (None: plain)."""
        formats = {}
        for stack in self.segments:
            for i, layer in enumerate(stack.segment.layers):
                experts = stack.positions[i % stack.segment.width].mlp.experts
                weight = experts.gate_up_proj  # plain: a Param, whose array's `format` is its layout
                formats[layer] = None if isinstance(weight, nnx.Variable) else weight.format
        return [formats[layer] for layer in range(self.config.num_hidden_layers)]

    @property
    def layers(self) -> list[DecoderLayer]:
        """Every layer with its own parameters, in order (copies out of the stacks: for inspection and tests)."""
        return [self.layer(i) for i in range(self.config.num_hidden_layers)]

    def layer(self, index: int) -> DecoderLayer:
        """Layer `index`'s own parameters, taken out of its stack (a copy: for inspection and tests)."""
        for stack in self.segments:
            if index in stack.segment.layers:
                return stack.layer(index)
        raise IndexError(f"layer {index} of a {self.config.num_hidden_layers}-layer model")


class CausalLM(nnx.Module):
    """Inkling 2 text model with its (untied) unembedding; parameter names follow transformers'
    `Inkling2ForCausalLM` so its checkpoints load by name.

    expert_formats: per layer, None (experts in `dtype`) or "mxfp8" / "nvfp4" (kept quantized).
    draft: the DSpark draft's config; the model then holds the draft's own parameters as `dspark`
    (else `dspark` is None). Its embedding and LM head are this model's.
    vision: the image tower's config (`inkling2` checkpoints); the model then holds it as `vision_tower`
    (transformers' `model.vision_tower`), else `vision_tower` is None. Its features replace the embeddings of
    the `image_token_id` placeholders (`embed`).
    """

    def __init__(
        self,
        config: TextConfig,
        dtype: jnp.dtype = jnp.bfloat16,
        rngs: nnx.Rngs | None = None,
        expert_formats: Sequence[str | None] | None = None,
        draft: DraftConfig | None = None,
        vision: VisionConfig | None = None,
        image_token_id: int | None = None,
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        expert_formats = expert_formats if expert_formats is not None else [None] * config.num_hidden_layers
        if len(expert_formats) != config.num_hidden_layers:
            raise ValueError(f"{len(expert_formats)} expert formats for {config.num_hidden_layers} layers")
        self.config = config
        self.model = TextModel(rngs, config, dtype, expert_formats)
        self.lm_head = Linear(
            rngs, config.hidden_size, config.vocab_size, ("vocab", "embed"), dtype, config.initializer_range
        )
        self.dspark = Draft(rngs, draft, config, dtype) if draft is not None else None
        self.vision_tower = VisionModel(rngs, vision, dtype) if vision is not None else None
        self.image_token_id = image_token_id

    def __call__(
        self, token_ids: jax.Array, positions: jax.Array | None = None, image_features: jax.Array | None = None
    ) -> jax.Array:
        """token_ids [B, T] -> float32 logits [B, T, unpadded_vocab_size].

        positions [B, T]: each row's absolute positions, consecutive and increasing (default 0..T-1);
        they set causality, relative distances and tau. A row holds one sequence (no packing).
        image_features [N, H]: the tower's output (`vision_tower`) for the prompt's N image placeholders (`embed`).
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(token_ids.shape[-1], dtype=jnp.int32), token_ids.shape)
        embeddings = None if image_features is None else self.embed(token_ids, image_features)
        hidden, _ = self.model(token_ids, positions, embeddings=embeddings)
        return self.logits(hidden)

    def embed(self, token_ids: jax.Array, image_features: jax.Array) -> jax.Array:
        """The layers' input [B, T, H]: the tokens' normed embeddings, the image placeholders' rows (row-major
        order) replaced by `image_features` [N, H] (which skip the embedding norm)."""
        if self.vision_tower is None or self.image_token_id is None:
            raise ValueError("image features given to a model without an image tower")
        embeddings = self.model.embed_tokens(token_ids)
        return merge_image_features(embeddings, token_ids, image_features, self.image_token_id)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states [..., H] -> float32 logits [..., unpadded_vocab_size]."""
        logits = softcap(self.lm_head(hidden).astype(jnp.float32), self.config.final_logit_softcapping)
        return logits[..., : self.config.unpadded_vocab_size]

    def step(
        self,
        token_ids: jax.Array,
        kv: KVCache,
        chunk: Chunk,
        windows: bool = False,
        at: jax.Array | None = None,
        images: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, ConvWindows]:
        """Continue every slot's sequence by its span of the step's flat tokens: token_ids [T] (laid out as `chunk`
        says) -> float32 logits [S, vocab] at each slot's last token, and the updated cache.

        at [S, K]: flat indices to read logits at instead ([S, K, vocab]; a speculative verify pass reads all of
        its positions). With `windows`, also every layer's convolution windows of the narrow group (`ConvWindows`),
        from which `inkling_jax.cache.commit_conv` keeps the states of any prefix. With a draft and a draft pool
        in the cache, the step's positions also enter the draft's context. images: (pool [R, H], rows [T]): the
        tokens with a row >= 0 take that pool row (an image tile's features) as their embedding
        (`place_image_features`)."""
        if windows:
            kv = record_windows(kv, chunk.width)
        embeddings = None
        if images is not None:
            pool, rows = images
            embeddings = place_image_features(self.model.embed_tokens(token_ids[None]), pool, rows[None])
        hidden, kv = self._continue(token_ids[None], kv, chunk, embeddings)
        index = chunk.last[:, None] if at is None else at  # [S, K]
        logits = self.logits(hidden[0][index])
        logits = logits[:, 0] if at is None else logits
        if not windows:
            return logits, kv
        return logits, dataclasses.replace(kv, windows=None), kv.windows

    def _continue(
        self, token_ids: jax.Array, kv: KVCache, chunk: Chunk, embeddings: jax.Array | None = None
    ) -> tuple[jax.Array, KVCache]:
        """The target over a step's tokens [1, T] (or their `embeddings` [1, T, H]); with a draft pool, every real
        position's draft context K/V is stored too, so the draft can start from any step (prefill, plain decoding
        or speculation)."""
        if self.dspark is None or kv.draft_k is None:
            return self.model(token_ids, chunk.positions, kv, chunk, embeddings=embeddings)
        hidden, kv, features = self.model(
            token_ids, chunk.positions, kv, chunk, capture=self.dspark.config.target_layer_ids, embeddings=embeddings
        )
        k, v = self.dspark.context_kv(self.dspark.context_features(features), chunk.positions)
        return hidden, write_draft_context(kv, k, v, chunk)
