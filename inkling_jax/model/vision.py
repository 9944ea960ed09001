"""The Inkling 2 image tower: a ViT over 2x2-patch tiles whose merged patches become text-width features.

Input: `pixel_values` [tiles, M*P, M*P, C] (M = spatial_merge_size, P = patch_size; 2 and 20 in the release, so
40x40 tiles), every image's tiles in raster order, images one after another; `image_grid_thw` [images, 3] =
(frames, rows, columns) of each image in tiles (one tile per language-model token). Per image:
- each tile is cut into M x M patches (row-major), each patch flattened (row, column, channel) and projected by
  a bias-free linear; a learned G x G position table (G = posemb_grid_size) is resampled bilinearly to the
  image's patch grid (rows*M, columns*M), with half-pixel centres and edge clamping (`F.interpolate`,
  align_corners=False, no antialiasing), and added;
- a class token (class embedding + its position embedding) goes in front of the image's patches; LayerNorm;
- pre-LayerNorm layers: x += lambda_1 * attention(LN(x)); x += lambda_2 * MLP(LN(x)), exact GELU, biases
  everywhere; attention sees only the tokens of its own image (block-diagonal over images), scale
  head_dim^-0.5, with axial 2D RoPE: head_dim/4 frequencies, the width angles then the height angles, each
  angle rotating one interleaved channel pair; a patch sits at (row + 1, column + 1), the class token at (0, 0);
- no final norm: the class token is dropped and each tile's M*M patch states (row-major) are concatenated and
  projected to the text width by linear_1 -> GELU -> linear_2.

Parameter names follow transformers' `Inkling2VisionModel` (`inkling_jax.checkpoint.names` maps both layouts); the
layers' are stacked (`layers.*` [layers, ...], rows named `layers.{i}.*` in checkpoints: `stack.stacked_rows`) and
run as one `lax.scan`, so compile time does not grow with depth.
Matmuls accumulate in fp32 and round to the activation dtype (the parameters'); LayerNorm, RoPE, the softmax and
the position table's resampling compute in fp32, as the reference does.

The merge (`merge_image_features`): the features, in order, replace the text embeddings (already RMS-normed:
features skip `embed_norm`) of the placeholder tokens, which take ordinary positions and causal attention. The
engine's step reads them from a pool of feature rows instead (`place_image_features`), by a row per token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.config import VisionConfig
from inkling_jax.model.params import normal, ones, param, zeros
from inkling_jax.model.stack import stacked
from pallas_kernels.numerics import einsum, round_to, softmax, total


class ImageInputError(ValueError):
    """Images that do not fit the model or the prompt (shapes, grids, placeholder counts); the message says how."""


class BiasedLinear(nnx.Module):
    """y = x @ weight.T + bias with weight [out, in], accumulated in fp32 and rounded once to x's dtype."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        in_features: int,
        out_features: int,
        axes: tuple[str | None, str | None],
        dtype: jnp.dtype,
        std: float,
        bias: bool = True,
    ):
        self.weight = param(rngs, (out_features, in_features), axes, dtype, normal(std))
        self.bias = param(rngs, (out_features,), axes[:1], dtype, zeros) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = einsum("...i,oi->...o", x, round_to(self.weight[...], x.dtype), out_dtype=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return round_to(y, x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with gain and bias over the last axis, in fp32; returns the input dtype."""

    def __init__(self, rngs: nnx.Rngs, size: int, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.weight = param(rngs, (size,), ("embed",), dtype, ones)
        self.bias = param(rngs, (size,), ("embed",), dtype, zeros)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)
        mean = total(y, -1, keepdims=True) / y.shape[-1]
        centred = y - mean
        variance = total(jnp.square(centred), -1, keepdims=True) / y.shape[-1]
        y = centred * jax.lax.rsqrt(variance + self.eps)
        return round_to(y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32), x.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU in fp32, returned in x's dtype."""
    return round_to(jax.nn.gelu(x.astype(jnp.float32), approximate=False), x.dtype)


class ImageLayout(NamedTuple):
    """Where every token of the tower's sequence comes from (`image_layout`). S = patches + images.

    patch_index [patches]: each patch's place in the sequence (its image's class token comes first);
    segments [S]: each token's image; positions [S, 2]: each token's (row, column) for RoPE;
    taps [patches, 4], weights [patches, 4] (fp32): the position-table rows and weights resampled to each patch.
    """

    patch_index: jax.Array
    segments: jax.Array
    positions: jax.Array
    taps: jax.Array
    weights: jax.Array


def image_layout(grid: jax.Array, patches: int, merge: int, table_side: int) -> ImageLayout:
    """The layout of `patches` patches from the grids [images, 3]; traceable, its shapes depend only on the patch
    and image counts (one compiled program serves any grids of those counts)."""
    grid = grid.astype(jnp.int32)
    images = grid.shape[0]
    per_image = grid[:, 0] * grid[:, 1] * grid[:, 2] * merge * merge  # patches of each image
    ends = jnp.cumsum(per_image)
    index = jnp.arange(patches, dtype=jnp.int32)
    image = jnp.minimum(jnp.searchsorted(ends, index, side="right"), images - 1).astype(jnp.int32)
    rows, columns = grid[image, 1] * merge, grid[image, 2] * merge  # the image's patch grid
    within = (index - (ends - per_image)[image]) % (rows * columns)  # a frame's patches repeat its positions
    # patches come tile by tile (raster order), each tile's M x M patches row-major
    tile, inner = within // (merge * merge), within % (merge * merge)
    row = tile // (columns // merge) * merge + inner // merge
    column = tile % (columns // merge) * merge + inner % merge
    patch_index = index + image + 1
    cls_index = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]]) + jnp.arange(images, dtype=jnp.int32)
    length = patches + images
    segments = jnp.zeros(length, jnp.int32).at[patch_index].set(image).at[cls_index].set(jnp.arange(images))
    positions = jnp.zeros((length, 2), jnp.int32).at[patch_index].set(jnp.stack([row + 1, column + 1], axis=-1))
    row_taps, row_weights = _resampling(row, rows, table_side)
    column_taps, column_weights = _resampling(column, columns, table_side)
    taps = (row_taps[:, :, None] * table_side + column_taps[:, None, :]).reshape(patches, 4)
    weights = (row_weights[:, :, None] * column_weights[:, None, :]).reshape(patches, 4)
    return ImageLayout(patch_index, segments, positions, taps, weights)


def _resampling(index: jax.Array, size: jax.Array, side: int) -> tuple[jax.Array, jax.Array]:
    """Bilinear taps [N, 2] into a `side`-long table and their fp32 weights, for target positions `index` on an
    axis of `size` (half-pixel centres, taps clamped to the edge)."""
    source = (index.astype(jnp.float32) + 0.5) * side / size.astype(jnp.float32) - 0.5
    floor = jnp.floor(source)
    offsets = jnp.arange(2, dtype=jnp.float32)
    taps = jnp.clip(floor.astype(jnp.int32)[:, None] + jnp.arange(2, dtype=jnp.int32), 0, side - 1)
    weights = jnp.maximum(1.0 - jnp.abs(source[:, None] - floor[:, None] - offsets), 0.0)
    return taps, weights


def axial_rope(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [S, head_dim] (fp32) for (row, column) positions [S, 2]: head_dim/4 frequencies per axis, the
    column (width) angles first, each angle repeated for its interleaved channel pair."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [S, 2, head_dim/4]
    angles = jnp.repeat(jnp.concatenate([angles[:, 1], angles[:, 0]], axis=-1), 2, axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on interleaved pairs: x [S, H, D] in fp32, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); x's dtype."""
    y = x.astype(jnp.float32)
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(y.shape)
    return round_to(y * cos[:, None] + rotated * sin[:, None], x.dtype)


def image_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, scale: float) -> jax.Array:
    """Softmax attention of q, k, v [S, H, D] within each image (`segments` [S]): [S, H, D] in q's dtype. On a GPU
    in 16-bit activations, fused (`fused_image_attention`); elsewhere `reference_image_attention`, the reference's
    arithmetic."""
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        return fused_image_attention(q, k, v, segments, scale)
    return reference_image_attention(q, k, v, segments, scale)


def fused_image_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, scale: float) -> jax.Array:
    """`image_attention` as cuDNN's flash attention (`jax.nn.dot_product_attention`), the images kept apart by a
    mask: no [H, S, S] scores in memory. Its softmax reads the scores unrounded, so it agrees with the reference
    to the activation dtype's rounding, not to the bit."""
    same = segments[:, None] == segments[None, :]
    out = jax.nn.dot_product_attention(
        q[None], k[None], v[None], mask=same[None, None], scale=scale, implementation="cudnn"
    )
    return out[0]


def reference_image_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, scale: float) -> jax.Array:
    """`image_attention` as the reference's eager attention computes it: scores round to q's dtype before and
    after the scale, the softmax runs in fp32 and its weights round back."""
    dtype = q.dtype
    scores = round_to(einsum("qhd,khd->hqk", q, k).astype(jnp.float32) * scale, dtype).astype(jnp.float32)
    same = segments[:, None] == segments[None, :]
    weights = round_to(softmax(jnp.where(same, scores, -jnp.inf), axis=-1), dtype)
    return einsum("hqk,khd->qhd", weights, v)


class VisionAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: VisionConfig, dtype: jnp.dtype):
        width, std = config.hidden_size, config.initializer_range
        self.num_heads = config.num_attention_heads
        self.head_dim = width // self.num_heads
        self.q_proj = BiasedLinear(rngs, width, width, ("vision_heads", "embed"), dtype, std)
        self.k_proj = BiasedLinear(rngs, width, width, ("vision_heads", "embed"), dtype, std)
        self.v_proj = BiasedLinear(rngs, width, width, ("vision_heads", "embed"), dtype, std)
        self.out_proj = BiasedLinear(rngs, width, width, ("embed", "vision_heads"), dtype, std)

    def __call__(self, x: jax.Array, layout: ImageLayout, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [S, width] -> [S, width]."""
        heads = (x.shape[0], self.num_heads, self.head_dim)
        q = rotate(self.q_proj(x).reshape(heads), cos, sin)
        k = rotate(self.k_proj(x).reshape(heads), cos, sin)
        v = self.v_proj(x).reshape(heads)
        out = image_attention(q, k, v, layout.segments, self.head_dim**-0.5)
        return self.out_proj(out.reshape(x.shape))


class VisionMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: VisionConfig, dtype: jnp.dtype):
        width, inner, std = config.hidden_size, config.intermediate_size, config.initializer_range
        self.fc1 = BiasedLinear(rngs, width, inner, ("vision_mlp", "embed"), dtype, std)
        self.fc2 = BiasedLinear(rngs, inner, width, ("embed", "vision_mlp"), dtype, std)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(gelu(self.fc1(x)))


def _scaled_residual(residual: jax.Array, scale: nnx.Param, branch: jax.Array) -> jax.Array:
    """residual + scale * branch, each operation rounding to the activation dtype."""
    scaled = round_to(scale[...].astype(jnp.float32) * branch.astype(jnp.float32), branch.dtype)
    return round_to(residual.astype(jnp.float32) + scaled.astype(jnp.float32), residual.dtype)


class VisionLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: VisionConfig, dtype: jnp.dtype):
        width, eps = config.hidden_size, config.layer_norm_eps
        init = lambda key, shape, dtype: jnp.full(shape, config.layer_scale_init_value, dtype)  # noqa: E731
        self.layernorm_before = LayerNorm(rngs, width, eps, dtype)
        self.self_attn = VisionAttention(rngs, config, dtype)
        self.lambda_1 = param(rngs, (width,), ("embed",), dtype, init)
        self.layernorm_after = LayerNorm(rngs, width, eps, dtype)
        self.mlp = VisionMLP(rngs, config, dtype)
        self.lambda_2 = param(rngs, (width,), ("embed",), dtype, init)

    def __call__(self, x: jax.Array, layout: ImageLayout, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = _scaled_residual(x, self.lambda_1, self.self_attn(self.layernorm_before(x), layout, cos, sin))
        return _scaled_residual(x, self.lambda_2, self.mlp(self.layernorm_after(x)))


class Embedding(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, rows: int, width: int, dtype: jnp.dtype, std: float):
        self.weight = param(rngs, (rows, width), (None, "embed"), dtype, normal(std))


class VisionEmbeddings(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: VisionConfig, dtype: jnp.dtype):
        width, std = config.hidden_size, config.initializer_range
        patch = config.num_channels * config.patch_size**2
        self.patch_embedding = BiasedLinear(rngs, patch, width, ("embed", None), dtype, std, bias=False)
        self.position_embedding = Embedding(rngs, config.posemb_grid_size**2, width, dtype, std)
        self.class_embedding = param(rngs, (width,), ("embed",), dtype, normal(std))
        self.cls_position_embedding = param(rngs, (width,), ("embed",), dtype, normal(std))

    def __call__(self, patches: jax.Array, layout: ImageLayout) -> jax.Array:
        """patches [N, P*P*C] (parameter dtype) -> the sequence [S, width]: each image's class token, then its
        patches with their resampled positions."""
        x = self.patch_embedding(patches)
        table = self.position_embedding.weight[...][layout.taps].astype(jnp.float32)  # [N, 4, width]
        position = round_to(total(table * layout.weights[..., None], 1), x.dtype)
        x = round_to(x.astype(jnp.float32) + position.astype(jnp.float32), x.dtype)
        cls = self.class_embedding[...].astype(jnp.float32) + self.cls_position_embedding[...].astype(jnp.float32)
        sequence = jnp.broadcast_to(round_to(cls, x.dtype), (layout.segments.shape[0], x.shape[-1]))
        return sequence.at[layout.patch_index].set(x)


class VisionMerger(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: VisionConfig, dtype: jnp.dtype):
        merged = config.spatial_merge_size**2 * config.hidden_size
        inner, std, bias = config.projection_hidden_dim, config.initializer_range, config.projector_bias
        self.linear_1 = BiasedLinear(rngs, merged, inner, ("vision_proj", None), dtype, std, bias)
        self.linear_2 = BiasedLinear(rngs, inner, config.text_hidden_size, ("embed", "vision_proj"), dtype, std, bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(gelu(self.linear_1(x)))


class VisionModel(nnx.Module):
    """The tower and its projector: `pixel_values`, `image_grid_thw` -> one text-width feature per tile."""

    def __init__(self, rngs: nnx.Rngs, config: VisionConfig, dtype: jnp.dtype):
        self.rope_theta = float((config.rope_parameters or {}).get("rope_theta", 10000.0))
        self.config = dataclasses.replace(config, rope_parameters=None)  # hashable, as static attributes must be
        self.embeddings = VisionEmbeddings(rngs, config, dtype)
        self.pre_layernorm = LayerNorm(rngs, config.hidden_size, config.layer_norm_eps, dtype)
        # the layers' parameters stacked on a leading [layers] axis, stepped through by one scan
        self.layers = stacked(
            functools.partial(VisionLayer, config=config, dtype=dtype), rngs, config.num_hidden_layers
        )
        self.merger = VisionMerger(rngs, config, dtype)

    def __call__(self, pixel_values: jax.Array, image_grid_thw: jax.Array) -> jax.Array:
        """pixel_values [tiles, M*P, M*P, C] (fp32, in [-1, 1]), image_grid_thw [images, 3] int -> features
        [tiles, text_hidden] in the parameter dtype, the images' tiles in order (`check_image_inputs` first:
        the grids must count the tiles)."""
        config = self.config
        merge, patch = config.spatial_merge_size, config.patch_size
        dtype = self.embeddings.class_embedding.dtype
        tiles, channels = pixel_values.shape[0], pixel_values.shape[-1]
        # [tiles, M, P, M, P, C] -> [tiles, M, M, P, P, C]: each tile's patches row-major, each flattened (row, col, C)
        patches = pixel_values.reshape(tiles, merge, patch, merge, patch, channels).transpose(0, 1, 3, 2, 4, 5)
        patches = round_to(patches.reshape(tiles * merge * merge, -1), dtype)
        layout = image_layout(image_grid_thw, patches.shape[0], merge, config.posemb_grid_size)
        x = self.pre_layernorm(self.embeddings(patches, layout))
        cos, sin = axial_rope(layout.positions, config.hidden_size // config.num_attention_heads, self.rope_theta)
        graphdef, params = nnx.split(self.layers)

        def layer(x: jax.Array, params: nnx.State) -> tuple[jax.Array, None]:
            return nnx.merge(graphdef, params)(x, layout, cos, sin), None

        x, _ = jax.lax.scan(layer, x, params)
        merged = x[layout.patch_index].reshape(tiles, merge * merge * config.hidden_size)
        return self.merger(merged)


def check_image_inputs(pixel_values: np.ndarray, image_grid_thw: np.ndarray, config: VisionConfig) -> None:
    """ImageInputError unless `pixel_values` are [tiles, M*P, M*P, C] and the grids are positive (frames, rows,
    columns) triples that count exactly those tiles."""
    side = config.spatial_merge_size * config.patch_size
    pixels, grid = np.asarray(pixel_values), np.asarray(image_grid_thw)
    if pixels.ndim != 4 or pixels.shape[1:] != (side, side, config.num_channels):
        raise ImageInputError(
            f"pixel_values must be [tiles, {side}, {side}, {config.num_channels}], got {list(pixels.shape)}"
        )
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
        raise ImageInputError(f"image_grid_thw must be [images, 3] with at least one image, got {list(grid.shape)}")
    if not np.issubdtype(grid.dtype, np.integer) or (grid < 1).any():
        raise ImageInputError(f"image_grid_thw must hold positive integers, got {grid.tolist()}")
    counted = int(np.prod(grid, axis=1).sum())
    if counted != pixels.shape[0]:
        raise ImageInputError(f"image_grid_thw counts {counted} tiles, pixel_values holds {pixels.shape[0]}")


def placeholder_runs(token_ids: Sequence[int] | np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of the image placeholder in `token_ids`, in order: one image each."""
    placeholder = np.concatenate([[False], np.asarray(token_ids) == image_token_id, [False]])
    edges = np.flatnonzero(placeholder[1:] != placeholder[:-1])  # starts and ends alternate
    return [(int(start), int(end - start)) for start, end in zip(edges[::2], edges[1::2], strict=True)]


def check_placeholders(token_ids: np.ndarray, features: int, image_token_id: int) -> None:
    """ImageInputError unless the prompt holds exactly one image placeholder per image feature."""
    placeholders = int((np.asarray(token_ids) == image_token_id).sum())
    if placeholders != features:
        raise ImageInputError(
            f"the prompt holds {placeholders} image placeholders (token {image_token_id}), the images give "
            f"{features} features: each image needs one placeholder per tile, contiguous"
        )


def merge_image_features(
    embeddings: jax.Array, token_ids: jax.Array, features: jax.Array, image_token_id: int
) -> jax.Array:
    """embeddings [B, T, H] with the rows of placeholder tokens (`token_ids` [B, T] == image_token_id), in
    row-major order, replaced by `features` [N, H] in order (cast to the embeddings' dtype). The counts must
    agree (`check_placeholders`); under jit they cannot be checked here."""
    if not isinstance(token_ids, jax.core.Tracer):
        check_placeholders(np.asarray(token_ids), features.shape[0], image_token_id)
    placeholder = (token_ids == image_token_id).reshape(-1)
    index = jnp.clip(jnp.cumsum(placeholder) - 1, 0, features.shape[0] - 1)
    rows = features.astype(embeddings.dtype)[index].reshape(embeddings.shape)
    return jnp.where(placeholder.reshape(*token_ids.shape, 1), rows, embeddings)


def place_image_features(embeddings: jax.Array, pool: jax.Array, rows: jax.Array) -> jax.Array:
    """embeddings [..., H] with each token whose `rows` [...] entry is a row of `pool` [R, H] (image features
    written there ahead of the step) taking that row instead (cast to the embeddings' dtype); -1: the token's own
    embedding. The engine's form of `merge_image_features`: features skip `embed_norm` there too."""
    features = pool.astype(embeddings.dtype)[jnp.clip(rows, 0, pool.shape[0] - 1)]
    return jnp.where((rows >= 0)[..., None], features, embeddings)
