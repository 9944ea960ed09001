"""Stacked layers: the decoder's attention-residual blocks grouped into segments, and parameters stacked per
place in a block, so that one `lax.scan` steps through a segment and compile time does not grow with depth.

A segment is a run of consecutive blocks whose layers match place by place (attention kind and expert format).
Position j of a segment holds the parameters of the j-th layer of each of its blocks on a leading [blocks] axis,
whose logical sharding axis is None (layers are never split across devices).

Checkpoints name parameters by layer (`model.layers.{i}.self_attn.q_proj.weight`); `layer_parameters` maps
each such name to the stacked parameter and row that hold it. The model's first layer has no attention-residual
input (no block is closed before it): its row of the stacked `attention_input.query` is a hole that no
checkpoint fills and the model never reads. The image tower's layers are one stack (`vision_tower.layers.*`,
checkpoints' `vision_tower.layers.{i}.*`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from inkling_jax.config import TextConfig

STACKED = re.compile(r"(?P<prefix>.*)segments\.(?P<segment>\d+)\.positions\.(?P<position>\d+)\.(?P<rest>.+)")
HOLE = "attention_input."  # layer 0's: never stored, never read
TOWER_LAYERS = "vision_tower.layers."  # the image tower's layers, stacked as one [layers] axis


@dataclasses.dataclass(frozen=True)
class Segment:
    """`blocks` consecutive attention-residual blocks from `first_block`, each of `size` layers in the model,
    `width` of them here (fewer only in a model's last, partial block)."""

    first_block: int
    blocks: int
    size: int
    width: int

    @property
    def layers(self) -> tuple[int, ...]:
        """The model's layer ids, block by block: row r's position j is layers[r * width + j]."""
        first = self.first_block * self.size
        return tuple(first + row * self.size + j for row in range(self.blocks) for j in range(self.width))


def layer_signature(config: TextConfig, expert_formats: Sequence[str | None], layer: int) -> tuple[bool, str | None]:
    """What a layer's parameters depend on: its attention kind and its expert format. Layers of one signature
    have the same parameters (names, shapes, dtypes, initialisers), so a segment can stack them and a random
    build (`inkling_jax.checkpoint.dummy`) can make them all with one program."""
    return config.is_sliding(layer), expert_formats[layer]


def plan_segments(config: TextConfig, expert_formats: Sequence[str | None]) -> tuple[Segment, ...]:
    """The fewest segments that cover the model's blocks in order."""
    size, count = config.n_layers_per_attn_res_block, config.num_hidden_layers

    def signature(block: int) -> tuple:
        layers = range(block * size, min(count, (block + 1) * size))
        return tuple(layer_signature(config, expert_formats, layer) for layer in layers)

    segments: list[Segment] = []
    for block in range(config.num_blocks):
        if segments and signature(block) == signature(segments[-1].first_block):
            segments[-1] = dataclasses.replace(segments[-1], blocks=segments[-1].blocks + 1)
        else:
            segments.append(Segment(block, 1, size, len(signature(block))))
    return tuple(segments)


def _variables(state: nnx.State) -> list[nnx.Variable]:
    return [variable for _, variable in nnx.to_flat_state(state)]


def stacked(make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs, count: int) -> nnx.Module:
    """`count` modules made by `make`, each initialised from its own key, as one module whose parameters carry a
    leading [count] axis (logical axis None)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    keys = jax.random.split(rngs.params(), count)
    state = jax.vmap(lambda key: nnx.split(make(nnx.Rngs(key)))[1])(keys)
    for variable in _variables(state):  # the metadata is one module's
        variable.set_metadata(out_sharding=(None, *variable.get_metadata()["out_sharding"]))
    return nnx.merge(graphdef, state)


def unstacked(module: nnx.Module, row: int) -> nnx.Module:
    """Row `row` of a stacked module, as a module of its own (its parameters copied out)."""
    graphdef, state = nnx.split(module)
    state = jax.tree.map(lambda value: value[row], state)
    for variable in _variables(state):
        variable.set_metadata(out_sharding=variable.get_metadata()["out_sharding"][1:])
    return nnx.merge(graphdef, state)


def stacked_rows(
    text: TextConfig, expert_formats: Sequence[str | None], paths: Sequence[str], tower_layers: int = 0
) -> dict[str, dict]:
    """For each stacked parameter path among `paths`: {row: the per-layer path it holds (`model.layers.{i}.…`,
    `vision_tower.layers.{i}.…`), or None for a hole}. tower_layers: the image tower's depth (0: no tower)."""
    segments = plan_segments(text, expert_formats)
    rows: dict[str, dict] = {}
    for path in paths:
        if tower_layers and path.startswith(TOWER_LAYERS):
            rest = path.removeprefix(TOWER_LAYERS)
            rows[path] = {row: f"{TOWER_LAYERS}{row}.{rest}" for row in range(tower_layers)}
            continue
        m = STACKED.fullmatch(path)
        if m is None:
            continue
        segment, position = segments[int(m["segment"])], int(m["position"])
        layers = segment.layers[position :: segment.width]
        rows[path] = {
            row: None if layer == 0 and m["rest"].startswith(HOLE) else f"{m['prefix']}layers.{layer}.{m['rest']}"
            for row, layer in enumerate(layers)
        }
    return rows


def layer_parameters(variables: dict[str, nnx.Variable], rows: dict[str, dict]) -> dict[str, jax.ShapeDtypeStruct]:
    """The parameters as checkpoints name them: every unstacked path as it is, and each filled row of a stacked
    parameter (`rows`: `stacked_rows` of these paths) under its layer's path, with that row's shape and dtype."""
    named = {path: jax.ShapeDtypeStruct(v.shape, v.dtype) for path, v in variables.items() if path not in rows}
    for path, by_row in rows.items():
        variable = variables[path]
        for layer_path in by_row.values():
            if layer_path is not None:
                named[layer_path] = jax.ShapeDtypeStruct(variable.shape[1:], variable.dtype)
    return named
