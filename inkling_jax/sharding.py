"""Meshes and partitioning: `tp4`, `dp2tp4`, ... over the available devices (axes `data`, `model`).

Tensor and expert parallelism share the `model` axis: query heads, experts and the vocabulary split
across it; KV heads split too while tp divides them; beyond, the K/V projections are replicated and
each device's cache keeps only the KV head its query heads read; norms, block-residual queries, the
router and the residual stream are replicated. The image tower splits like the text model where tp divides its
sizes: attention heads, MLP width and the projector's hidden width on `model` (each replicated otherwise),
the rest replicated. Data-parallel replicas on `data` each own a share of the
decode state's slots and pages. Parameters say which logical axes they have (`inkling_jax.model.params`); these rules
map them onto the mesh.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from inkling_jax.cache import DecodeState, KVCache, Snapshots, kv_split
from inkling_jax.config import TextConfig, VisionConfig
from inkling_jax.model.params import logical_axes

DATA, MODEL = "data", "model"


class MeshError(ValueError):
    """A mesh that does not fit the devices or the model; the message says which."""


def parse_mesh(spec: str) -> tuple[int, int]:
    """ "tp4" -> (1, 4); "dp2tp4" -> (2, 4)."""
    match = re.fullmatch(r"(?:dp(\d+))?tp(\d+)", spec)
    if match is None:
        raise MeshError(f"mesh {spec!r} is not of the form tpN or dpMtpN (e.g. tp4, dp2tp4)")
    dp, tp = int(match.group(1) or 1), int(match.group(2))
    if dp < 1 or tp < 1:
        raise MeshError(f"mesh {spec!r}: sizes must be at least 1")
    return dp, tp


def check_model_fits(text: TextConfig, tp: int) -> None:
    """tp must divide the query heads of both layer kinds, the experts and the vocabulary, and the KV
    heads unless it is a multiple of them (then they are replicated)."""
    for name in ("num_attention_heads", "swa_num_attention_heads", "n_routed_experts", "vocab_size"):
        if getattr(text, name) % tp:
            raise MeshError(f"tp{tp} does not divide {name} ({getattr(text, name)})")
    for name in ("num_key_value_heads", "swa_num_key_value_heads"):
        heads = getattr(text, name)
        if heads % tp and tp % heads:
            raise MeshError(f"tp{tp} neither divides nor is a multiple of {name} ({heads})")


def make_mesh(spec: str, text: TextConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh `spec` names, over the first dp * tp devices."""
    dp, tp = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    if dp * tp > len(devices):
        raise MeshError(f"mesh {spec!r} needs {dp * tp} devices, {len(devices)} are available")
    check_model_fits(text, tp)
    return Mesh(np.asarray(devices[: dp * tp]).reshape(dp, tp), (DATA, MODEL))


def logical_rules(text: TextConfig, tp: int, vision: VisionConfig | None = None) -> dict[str, str | None]:
    """Logical axis -> mesh axis (with `vision`, the image tower's axes too)."""
    rules = {
        "heads": MODEL,
        "kv_heads": MODEL if kv_split(text, tp) else None,
        "experts": MODEL,
        "vocab": MODEL,
        "embed": None,
        "expert_mlp": None,
    }
    if vision is not None:
        sizes = {
            "vision_heads": vision.num_attention_heads,
            "vision_mlp": vision.intermediate_size,
            "vision_proj": vision.projection_hidden_dim,
        }
        rules |= {axis: MODEL if size % tp == 0 else None for axis, size in sizes.items()}
    return rules


def parameter_shardings(model: nnx.Module, mesh: Mesh) -> nnx.State:
    """A NamedSharding for every parameter of `model`, from its logical axes."""
    vision = None if getattr(model, "vision_tower", None) is None else model.vision_tower.config
    rules = logical_rules(model.config, mesh.shape[MODEL], vision)

    def sharding(variable: nnx.Variable) -> NamedSharding:
        spec = PartitionSpec(*(rules.get(axis) if axis else None for axis in logical_axes(variable)))
        return NamedSharding(mesh, spec)

    state = nnx.state(model, nnx.Param)
    return jax.tree.map(sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replica_specs(state: DecodeState) -> DecodeState:
    """How a decode state splits into data-parallel replicas: by slot, and the page pool by page
    (every array is [slots, ...] or [layers, slots or pages, ...])."""
    by_slot, by_layer_then_slot = PartitionSpec(DATA), PartitionSpec(None, DATA)
    specs = jax.tree.map(lambda _: by_slot, state)
    by_layer = {name: jax.tree.map(lambda _: by_layer_then_slot, getattr(state, name)) for name in ("kv", "boundaries")}
    return dataclasses.replace(specs, **by_layer)


def state_specs(state: DecodeState, text: TextConfig, tp: int) -> DecodeState:
    """How a decode state (`init_state(..., tp)`) lies on a mesh: slots and pages split over `data`
    replicas; within a replica K/V split by head, one head or more per device, the K/V conv states like
    the projections that fill them, the draft's context K/V by head while tp divides its KV heads (else
    whole on every device), everything else replicated."""
    conv_axis = logical_rules(text, tp)["kv_heads"]
    # the dims after (layer, slot or page): K/V [heads, ...]; conv states [taps, channels]
    trailing = {name: (MODEL,) for name in ("full_k", "full_v", "sliding_k", "sliding_v")}
    trailing |= {"conv_k": (None, conv_axis), "conv_v": (None, conv_axis)}
    if state.kv.draft_k is not None:
        draft_axis = MODEL if state.kv.draft_k.shape[2] % tp == 0 else None  # [layers, pages, heads, page, dim]
        trailing |= {"draft_k": (draft_axis,), "draft_v": (draft_axis,)}

    def kv_spec(name: str, spec: PartitionSpec | None) -> PartitionSpec | None:
        return PartitionSpec(*spec, *trailing[name]) if name in trailing else spec

    specs = replica_specs(state)
    kv = KVCache(**{f.name: kv_spec(f.name, getattr(specs.kv, f.name)) for f in dataclasses.fields(KVCache)})
    boundaries = specs.boundaries
    if boundaries is not None:  # [layers, slots, 2, taps, channels]: the K/V channels as the conv states'
        channels = PartitionSpec(None, DATA, None, None, conv_axis)
        boundaries = dataclasses.replace(boundaries, k=channels, v=channels)
    return dataclasses.replace(specs, kv=kv, boundaries=boundaries)


def snapshot_shardings(snapshots: Snapshots, text: TextConfig, mesh: Mesh) -> Snapshots:
    """How a prefix cache's snapshot pool (`init_snapshots` of a state on `mesh`) lies on it: split by replica, and
    within one like the state it is copied from (K/V and the K/V convolution states by head)."""
    conv_axis = logical_rules(text, mesh.shape[MODEL])["kv_heads"]
    conv = PartitionSpec(DATA, None, None, conv_axis)
    specs = Snapshots(
        sliding_k=PartitionSpec(DATA, None, MODEL),
        sliding_v=PartitionSpec(DATA, None, MODEL),
        conv_k=conv,
        conv_v=conv,
        conv_attention=PartitionSpec(DATA),
        conv_mlp=PartitionSpec(DATA),
    )
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def state_shardings(state: DecodeState, text: TextConfig, mesh: Mesh) -> DecodeState:
    """`state_specs` on `mesh`."""
    specs = state_specs(state, text, mesh.shape[MODEL])
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """`model` with every parameter placed on `mesh` by the rules."""
    graphdef, state = nnx.split(model)
    shardings = parameter_shardings(model, mesh)
    placed = jax.tree.map(
        lambda variable, target: variable.replace(jax.device_put(variable[...], target)),
        state,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.merge(graphdef, placed)
