"""Dummy weights (`--load-format dummy`): a random model of any config, built directly on the devices.

Nothing is read but the config: every parameter is initialised under `jax.jit` straight into the shards
`inkling_jax.sharding.parameter_shardings` gives it, so a model of any size builds at device speed with no
host copy. The routed experts take the formats the config's `quantization_config` states (plain, MXFP8,
NVFP4, or mixed per layer, as the checkpoint would hold them), the DSpark draft is built when the config
has a `dspark_config` and the image tower when it has a `vision_config`. For measuring and testing the serving
paths at full size: the output is noise.

A build is compile-bound, so it runs as small programs that repeat (`plan_build`): one per layer signature
(`inkling_jax.model.stack.layer_signature`: every layer of a signature, in any segment, is made by the same
program from its own key, and a stacked position's layers are concatenated by a stack program per signature and
depth), one for the draft's layers and one for everything else. The random bits come from `HASH_PRNG`, a
counter-based hash that compiles to a few integer ops per draw and per key derivation, where threefry's twenty
rounds make the proxy's build programs take 2-2.5x longer to compile on XLA:CPU (`bench/random_build.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.extend.random import define_prng_impl
from jax.sharding import Mesh

from inkling_jax.checkpoint.quantized import configured_expert_formats
from inkling_jax.config import ModelConfig
from inkling_jax.model.draft import draft_layer
from inkling_jax.model.stack import layer_signature, plan_segments
from inkling_jax.model.text import CausalLM, decoder_layer
from inkling_jax.sharding import parameter_shardings


def _mix(x: jax.Array) -> jax.Array:
    """Wellons' lowbias32: a bijection of uint32 in which every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _hash(key: jax.Array, hi: jax.Array, lo: jax.Array) -> jax.Array:
    """32 random bits for each 64-bit counter (hi, lo) under `key` (two uint32 words)."""
    return _mix(_mix(_mix(lo ^ key[0]) + (hi ^ key[1])) ^ key[0])


def _counters(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Each element's index as two uint32 words (hi, lo): lo over the trailing dimensions that fit in 32 bits, hi
    over the others. Made of iotas, so a sharded draw computes only its own elements and every element's value is
    the same under any sharding."""
    split = len(shape)
    while split and math.prod(shape[split - 1 :]) < 2**32:
        split -= 1
    if math.prod(shape[:split]) >= 2**32:
        raise ValueError(f"random draw of shape {shape}: its elements' indices do not fit two 32-bit words")

    def index(dims: range) -> jax.Array:
        out, stride = jnp.zeros(shape, jnp.uint32), 1
        for dim in reversed(dims):
            out = out + lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
            stride *= shape[dim]
        return out

    return index(range(split)), index(range(split, len(shape)))


def _derive(key: jax.Array, salt: int, data: jax.Array) -> jax.Array:
    """A key [..., 2] for each uint32 in `data`: one Feistel-like round (the words swap, one of them mixed) with the
    salted data in both words, so that distinct data give distinct keys, split and fold_in (other salts) differ,
    and folding in a then b is not folding in b then a."""
    d = data * np.uint32(0x9E3779B9) + np.uint32(salt)
    return jnp.stack([key[1] + d, _mix(key[0] ^ d)], axis=-1)


def _seed(seed: jax.Array) -> jax.Array:
    """The key of an integer seed (its low 32 bits)."""
    words = jnp.asarray(seed).astype(jnp.uint32)
    return _derive(jnp.zeros(2, jnp.uint32), 0x5EED, words)


def _split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return _derive(key, 0x5B117, jnp.arange(math.prod(shape), dtype=jnp.uint32)).reshape(*shape, 2)


def _fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
    return _derive(key, 0xF01D, jnp.asarray(data).astype(jnp.uint32))


def _random_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    """The top `bit_width` bits of each element's hash."""
    if bit_width not in (8, 16, 32):
        raise ValueError(f"random bits of width {bit_width}: 8, 16 or 32 only")
    bits = _hash(key, *_counters(shape))
    return (bits >> (32 - bit_width)).astype(f"uint{bit_width}")


# a key implementation for jax.random (key, split, fold_in, bits, normal, ...): random weights' generator
HASH_PRNG = define_prng_impl(
    key_shape=(2,), seed=_seed, split=_split, random_bits=_random_bits, fold_in=_fold_in, name="inkling_hash"
)


def dummy_model(config: ModelConfig, dtype: jnp.dtype, mesh: Mesh, seed: int = 0, source: str = "") -> CausalLM:
    """A random CausalLM of `config` (with its draft, experts in the configured formats), each parameter
    created in its shards on `mesh`. `source` names the config in errors."""
    formats = configured_expert_formats(source or "config", config.quantization, config.text.num_hidden_layers)
    return random_model(config, dtype, mesh, formats, seed)


def random_model(
    config: ModelConfig, dtype: jnp.dtype, mesh: Mesh, expert_formats: Sequence[str | None], seed: int = 0
) -> CausalLM:
    """A random CausalLM of `config` with the given per-layer expert formats (None: plain), and its draft when
    the config has one, built under jit straight into the shards `parameter_shardings` gives each parameter.

    Each layer is drawn from the seed folded with its layer id, the draft's layers and the other parameters from
    the seed folded with ids past the layers' (`plan_build`): a build is reproducible, and a parameter's values
    depend neither on the mesh nor on how the layers are grouped into segments."""
    plan = plan_build(config, dtype, mesh, expert_formats)
    programs = compile_programs(plan.programs)
    values = {}
    for part in plan.parts:
        states = [programs[part.program](np.uint32(seed), np.uint32(id)) for id in part.ids]
        state = programs[part.stack](*states) if part.stack else states[0]
        values |= {(*part.prefix, *path): variable[...] for path, variable in nnx.to_flat_state(state)}
    state = nnx.from_flat_state(
        [(path, variable.replace(values.pop(path))) for path, variable in nnx.to_flat_state(plan.state)]
    )
    assert not values, f"built parameters the model does not have: {sorted(values)}"
    return nnx.merge(plan.graphdef, state)


@dataclasses.dataclass(frozen=True)
class Part:
    """The parameters under `prefix` in the model's state: `program` run on the seed and each of `ids`, the
    results stacked by the `stack` program when there are several."""

    prefix: tuple
    program: tuple
    ids: tuple[int, ...]
    stack: tuple | None = None


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """How a random model is built: the lowered `programs` make the `parts`, which together hold every parameter
    of `state` (the abstract model's, split from `graphdef`)."""

    graphdef: nnx.GraphDef
    state: nnx.State
    programs: dict[tuple, jax.stages.Lowered]
    parts: list[Part]


def plan_build(config: ModelConfig, dtype: jnp.dtype, mesh: Mesh, expert_formats: Sequence[str | None]) -> BuildPlan:
    """The programs (traced and lowered, not compiled) and parts of a random build of `config` on `mesh`.

    A layer program makes one layer of a signature (`layer_signature`) with a leading block axis of one, from the
    seed and the layer's id; a stacked position of several blocks concatenates its layers' with a stack program
    (one per signature and depth). The draft's layers (ids past the layers') share a program, and a model of no
    layers with a draft of no layers holds the other parameters, the image tower's included (id: the layer
    count)."""
    text, draft = config.text, config.draft
    vision, image_token_id = config.vision, config.image_token_id
    abstract = nnx.eval_shape(lambda: CausalLM(text, dtype, nnx.Rngs(0), expert_formats, draft, vision, image_token_id))
    graphdef, state = nnx.split(abstract)
    shardings = parameter_shardings(abstract, mesh)
    programs: dict[tuple, jax.stages.Lowered] = {}
    parts: list[Part] = []
    scalar = jax.ShapeDtypeStruct((), jnp.uint32)

    def add(program: tuple, make: Callable[[nnx.Rngs], nnx.Module], out: nnx.State, leading: bool = False) -> None:
        """Lower `program` (unless done): `make`'s state from the seed and an id, in the `out` shardings (with a
        leading axis of one when `leading`)."""
        if program in programs:
            return

        def build(seed: jax.Array, id: jax.Array) -> nnx.State:
            state = nnx.split(make(nnx.Rngs(jax.random.fold_in(jax.random.key(seed, impl=HASH_PRNG), id))))[1]
            return jax.tree.map(lambda value: value[None], state) if leading else state

        programs[program] = jax.jit(build, out_shardings=out).lower(scalar, scalar)

    outside = dataclasses.replace(text, num_hidden_layers=0, layer_types=())
    outside_draft = None if draft is None else dataclasses.replace(draft, num_hidden_layers=0)

    def make_outside(rngs: nnx.Rngs) -> CausalLM:
        return CausalLM(outside, dtype, rngs, [], outside_draft, vision, image_token_id)

    add(("outside",), make_outside, parameter_shardings(nnx.eval_shape(make_outside, nnx.Rngs(0)), mesh))
    parts.append(Part((), ("outside",), (text.num_hidden_layers,)))
    for index, segment in enumerate(plan_segments(text, expert_formats)):
        for position, first in enumerate(segment.layers[: segment.width]):
            prefix = ("model", "segments", index, "positions", position)
            signature = layer_signature(text, expert_formats, first)
            program, stack = ("layer", signature), ("stack", signature, segment.blocks)
            add(program, decoder_layer(text, first, dtype, expert_formats), _at(shardings, prefix), leading=True)
            if segment.blocks > 1 and stack not in programs:
                programs[stack] = jax.jit(
                    lambda *rows: jax.tree.map(lambda *values: jnp.concatenate(values), *rows),
                    out_shardings=_at(shardings, prefix),
                ).lower(*[programs[program].out_info] * segment.blocks)
            parts.append(
                Part(prefix, program, segment.layers[position :: segment.width], stack if segment.blocks > 1 else None)
            )
    for index in range(0 if draft is None else draft.num_hidden_layers):
        prefix = ("dspark", "layers", index)
        add(("draft layer",), draft_layer(draft, text, dtype), _at(shardings, prefix))
        parts.append(Part(prefix, ("draft layer",), (text.num_hidden_layers + 1 + index,)))
    return BuildPlan(graphdef, state, programs, parts)


def compile_programs(programs: dict[tuple, jax.stages.Lowered]) -> dict[tuple, jax.stages.Compiled]:
    """Each of `programs` compiled (JAX's persistent compilation cache applies, when it is on)."""
    return {name: lowered.compile() for name, lowered in programs.items()}


def _at(state: nnx.State, path: tuple) -> nnx.State:
    """The part of `state` at `path`."""
    for name in path:
        state = state[name]
    return state
