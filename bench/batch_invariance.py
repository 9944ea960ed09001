"""Which of the model's operations give a row the same bits whatever else is computed with it, on this platform.

    python -m bench.batch_invariance [--sizes 8 16 64 68 196] [--markdown FILE.md]

Batch invariance (the proto's promise: the same request and seed give the same tokens whatever runs beside them)
holds end to end only if every operation a token's row goes through does. Each case here computes one operation
on the rows of a step of each size (the engine's step shapes; the first rows the same in all) with the options
the engine compiles its steps with, and counts the elements of the shared rows that differ from the smallest
size's, bit for bit, at Inkling 2 Small's widths (hidden 4608, 48 query and 8 KV heads of 128, 16 experts of
2304, top 8):
- dense projections (`numerics.einsum`, bf16 in, fp32 sums rounded once): the query side, K / V, the output
  projection and the LM head, at each size's token count;
- `rms_normalize` and `log_softmax` over the vocabulary;
- the router (`model.moe.Router`: sigmoid scores, top 8 of 16 with the selection bias, normalised weights) and the
  attention-residual mix with its RMSNorm (`attn_res_norm`, 8 blocks, 3 queries), at each token count;
- the routed experts (the platform's kernels, NVFP4 and MXFP8) at each token count, the first tokens' routing the
  same;
- attention decode (`ragged_paged_attention` over the page pool, full and sliding-window): one sequence's row
  beside as many other decoding sequences as the size;
- attention, one position decoded against the same position as the last row of an 8-row speculative verify pass
  and of a 64-token prefill chunk, and each row of a verify pass that straddles a KV block boundary against its
  position decoded alone.

With `--engine PATH` (a checkpoint, or with `--load-format dummy` a config file) it also checks the whole step end
to end, where each operation sits in the step program's fusions: a random sequence decoded token by token after
its prompt, then the same tokens fed again as one chunk (as a preempted request's outputs are), must leave the same
decode state, bit for bit. It prints, for each state array (each kind of layer's K and V, the convolutions'
histories), the first model layer and position that differ, and whether the chunk's last row emits what the
decode step did. `--reference OP ...` runs those ops' pure-jnp references instead of their kernels, to find
which part of a step breaks the equality.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.moe_experts import CAPS, routing_case, stored_experts
from inkling_jax.config import TextConfig
from inkling_jax.model.moe import Router
from inkling_jax.runtime.engine import GPU_STEP, Engine, load_engine
from inkling_jax.runtime.requests import MAX_LOGPROBS
from pallas_kernels import attn_res, moe, numerics
from pallas_kernels import ragged_paged_attention as paged_attention
from pallas_kernels.attn_res import attn_res_norm
from pallas_kernels.moe import moe_experts
from pallas_kernels.moe.layouts import for_gpu_experts
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

HIDDEN, HEADS, KV_HEADS, DIM, D_REL, EXTENT = 4608, 48, 8, 128, 16, 1024
EXPERTS, INTER, VOCAB, PAGE, CONTEXT = 16, 2304, 200058, 128, 1000
STRADDLE = 1028  # keys of a verify pass whose positions straddle the block boundary at 1024
SHARED = 8  # rows compared (the first of every size)


def compiled(fn: Callable, *args) -> Callable:
    """fn jitted with the engine's step options on this platform."""
    options = dict(GPU_STEP) if jax.default_backend() == "gpu" else {}
    return jax.jit(fn).lower(*args).compile(options or None)


def differing(outputs: dict[int, np.ndarray]) -> dict[str, int]:
    """Per size: how many elements of the shared rows differ from the smallest size's."""
    first = outputs[min(outputs)]
    return {str(size): int((out[: len(first)] != first).sum()) for size, out in outputs.items()}


def rows_of(fn: Callable, make: Callable[[int], tuple], sizes: list[int]) -> dict[int, np.ndarray]:
    """fn's first SHARED output rows for inputs of each size."""
    outputs = {}
    for size in sizes:
        args = make(size)
        outputs[size] = np.asarray(compiled(fn, *args)(*args)).astype(np.float32)[:SHARED]
    return outputs


def normal(key: int, shape: tuple[int, ...], std: float = 1.0) -> jax.Array:
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * std).astype(jnp.bfloat16)


def projections(sizes: list[int]) -> dict[str, dict[int, np.ndarray]]:
    tokens = normal(1, (max(sizes), 6144))
    cases = {
        "query side": (13104, HIDDEN),
        "K and V": (2 * KV_HEADS * DIM, HIDDEN),
        "output": (HIDDEN, 6144),
        "LM head": (201024, HIDDEN),
    }
    # the GPU scheduler test's model (tests/runtime/test_scheduler.py: hidden 512, 8 query and 2 KV heads of 128)
    cases |= {
        "test widths, query side": (2184, 512),
        "test widths, K and V": (512, 512),
        "test widths, full layer's K": (256, 512),
        "test widths, dynamic taps": (8, 512),
        "test widths, output": (512, 1024),
        "test widths, LM head": (512, 512),
    }
    found = {}
    for name, (out, inner) in cases.items():
        weight = normal(out, (out, inner), 0.02)
        x = tokens[:, :inner]
        found[f"projection: {name} [{out}, {inner}]"] = rows_of(
            lambda a, w: numerics.einsum("ti,oi->to", a, w), lambda m, x=x, w=weight: (x[:m], w), sizes
        )
    return found


def reductions(sizes: list[int]) -> dict[str, dict[int, np.ndarray]]:
    x = normal(2, (max(sizes), HIDDEN)).astype(jnp.float32)
    logits = jax.random.normal(jax.random.key(3), (max(sizes), VOCAB), jnp.float32) * 3
    return {
        "rms_normalize [4608]": rows_of(lambda a: numerics.rms_normalize(a, 1e-6), lambda m: (x[:m],), sizes),
        "log_softmax [200058]": rows_of(numerics.log_softmax, lambda m: (logits[:m],), sizes),
    }


def mixing(sizes: list[int]) -> dict[str, dict[int, np.ndarray]]:
    """The router's weights and ids, and the attention-residual mix with its norm, of each size's tokens."""
    router = Router(nnx.Rngs(4), dataclasses.replace(TextConfig(), n_routed_experts=EXPERTS, hidden_size=HIDDEN))
    router.e_score_correction_bias[...] = jax.random.normal(jax.random.key(5), (EXPERTS,)) * 0.01
    x = normal(6, (max(sizes), HIDDEN))
    blocks, queries = 8, 3
    sources = normal(7, (blocks, max(sizes), HIDDEN))
    mix = (normal(8, (queries, HIDDEN)).astype(jnp.float32), normal(9, (queries, HIDDEN)))

    def residual(sources, partial, query, gain):
        return attn_res_norm(sources, partial, query, gain, eps=1e-6, out_dtype=jnp.bfloat16, valid=5)

    return {
        "router [16 experts, top 8]: weights": rows_of(lambda a: router(a)[1], lambda m: (x[:m],), sizes),
        "router [16 experts, top 8]: expert ids": rows_of(lambda a: router(a)[0], lambda m: (x[:m],), sizes),
        "attention-residual mix and norm [5 of 8 blocks, 3 queries]": rows_of(
            lambda *a: residual(*a).transpose(1, 0, 2), lambda m: (sources[:, :m], x[:m], *mix), sizes
        ),
    }


def experts(sizes: list[int]) -> dict[str, dict[int, np.ndarray]]:
    found = {}
    x, ids, weights = routing_case(max(sizes), 3, EXPERTS, HIDDEN)
    for fmt in ("nvfp4", "mxfp8"):
        gate_up, down, _ = stored_experts(EXPERTS, HIDDEN, INTER, fmt)
        laid = for_gpu_experts(gate_up, down) if jax.default_backend() == "gpu" else (gate_up, down)

        def run(x, ids, weights, gate_up, down):
            return moe_experts(x, gate_up, down, ids, weights, distinct_ids=True, **CAPS)

        found[f"experts {fmt}"] = rows_of(run, lambda m, laid=laid: (x[:m], ids[:m], weights[:m], *laid), sizes)
    return found


def attention_inputs(slots: int, width: int) -> dict:
    """Random bf16 step inputs for up to `slots` sequences of `width` query rows over a page pool (each sequence's
    pages its own, in order): the inputs of fewer sequences are the leading ones of these."""
    pages = slots * (-(-2 * CONTEXT // PAGE) + 1)
    return {
        "q": normal(10, (slots, width, HEADS, DIM)),
        "rel": normal(11, (slots, width, HEADS, D_REL)),
        "sinks": normal(12, (slots, width, HEADS)),
        "rel_proj": normal(13, (D_REL, EXTENT)),
        "k": normal(14, (pages, KV_HEADS, PAGE, DIM)),
        "v": normal(15, (pages, KV_HEADS, PAGE, DIM)),
        "table": jnp.arange(pages, dtype=jnp.int32).reshape(slots, -1),
    }


def attend(inputs: dict, slots: int, kv_lens: list[int], query_lens: list[int], window: int | None) -> np.ndarray:
    """The first `slots` sequences' attention [S, C, Hq, D] (all the pool's pages in reach)."""

    def run(q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, page_table):
        return ragged_paged_attention(
            q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, page_table=page_table, scale=DIM**-0.5, window=window
        )

    lead = {name: inputs[name][:slots] for name in ("q", "rel", "sinks", "table")}
    lens = jnp.asarray(kv_lens, jnp.int32), jnp.asarray(query_lens, jnp.int32)
    args = (lead["q"], inputs["k"], inputs["v"], *lens, lead["rel"], inputs["rel_proj"], lead["sinks"], lead["table"])
    return np.asarray(compiled(run, *args)(*args)).astype(np.float32)


def attention(sizes: list[int]) -> dict[str, dict[int, np.ndarray]]:
    found = {}
    decoding = attention_inputs(max(sizes), 1)
    others = np.random.default_rng(0).integers(1, 2 * CONTEXT, max(sizes)).tolist()
    prefill = attention_inputs(1, 64)
    last = {name: prefill[name][:, -1:] for name in ("q", "rel", "sinks")}  # the chunk's last row, decoded
    verify = {name: prefill[name][:, -8:] for name in ("q", "rel", "sinks")}  # its last 8 rows, a verify pass
    # a verify pass at positions 1020 ... 1027 (KV blocks 7 and 8) and each of its rows decoded alone
    straddle = {name: jnp.concatenate([verify[name][:, c : c + 1] for c in range(8)]) for name in verify}
    straddle["table"] = jnp.repeat(prefill["table"], 8, axis=0)
    decoded_lens = [STRADDLE - 7 + c for c in range(8)]
    for window in (None, 1024):
        name = "full" if window is None else f"window {window}"
        found[f"attention decode, {name}: one sequence among as many as the size"] = {
            n: attend(decoding, n, [CONTEXT, *others[1:n]], [1] * n, window)[:1] for n in sizes
        }
        found[
            f"attention, {name}: a position decoded (size 1), as an 8-row verify pass's last (8) and as a 64-row"
            " prefill chunk's last (64)"
        ] = {
            1: attend(prefill | last, 1, [CONTEXT], [1], window)[:, -1:],
            8: attend(prefill | verify, 1, [CONTEXT], [8], window)[:, -1:],
            64: attend(prefill, 1, [CONTEXT], [64], window)[:, -1:],
        }
        found[
            f"attention, {name}: each row of an 8-row verify pass straddling a KV block boundary (8) against its"
            " position decoded (1)"
        ] = {
            1: attend(prefill | straddle, 8, decoded_lens, [1] * 8, window)[:, 0],
            8: attend(prefill | verify, 1, [STRADDLE], [8], window)[0],
        }
    return found


KERNELS = {"attention": paged_attention, "moe": moe, "attn_res": attn_res}  # --reference's ops


def engine_step(engine: Engine, tokens: list[int], **flags: bool) -> tuple:
    """Slot 0 brings `tokens` (its pages 0, 1, ...; the other slots idle); what it emits: (token, its log-probability,
    the top ids, their log-probabilities)."""
    slots = engine.slots
    ids, counts = np.zeros((slots, len(tokens)), np.int32), np.zeros(slots, np.int32)
    ids[0], counts[0] = tokens, len(tokens)
    table = np.zeros((slots, engine.max_pages), np.int32)
    table[0] = np.arange(engine.max_pages)
    first = {name: (np.arange(slots) == 0) & value for name, value in flags.items()}
    asks = [SimpleNamespace(logprobs=MAX_LOGPROBS)] + [None] * (slots - 1)  # slot 0 returns the top ones
    out = engine.fetch(engine.step(engine.host_batch(ids, counts, asks, table, **first)))
    return tuple(np.asarray(a[0, 0]).tolist() for a in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs))


def fed(engine: Engine, tokens: list[int], *, prompt: bool) -> tuple:
    """`tokens` fed as chunks (prompt tokens from a fresh sequence, or earlier outputs fed again); the last emit."""
    for start in range(0, len(tokens), engine.chunk):
        piece = tokens[start : start + engine.chunk]
        last = engine_step(engine, piece, reset=prompt and start == 0, is_prompt=prompt, replay=not prompt, emit=True)
    return last


def differing_positions(name: str, decoded: np.ndarray, refed: np.ndarray, length: int) -> tuple[np.ndarray, ...]:
    """Slot 0's entries of a KVCache array that differ: (index among the array's layers, position) pairs."""
    if name.startswith("full"):  # [layers, pages, heads, page, dim]: slot 0 holds pages 0, 1, ...
        differs = (decoded != refed).any(axis=(2, 4)).reshape(decoded.shape[0], -1)
        positions = np.arange(differs.shape[1])
    elif name.startswith("sliding"):  # [layers, slots, heads, ring, dim]: position p at ring slot p % ring
        differs = (decoded[:, 0] != refed[:, 0]).any(axis=(1, 3))
        ring = differs.shape[1]
        positions = length - 1 - (length - 1 - np.arange(ring)) % ring
    else:  # convolution histories [layers, slots, K - 1, channels]: the last K - 1 positions
        differs = (decoded[:, 0] != refed[:, 0]).any(axis=-1)
        positions = length - differs.shape[1] + np.arange(differs.shape[1])
    layers, tokens = np.nonzero(differs & (positions < length)[None])
    return layers, positions[tokens]


def first_difference(engine: Engine, name: str, decoded: np.ndarray, refed: np.ndarray, length: int) -> str:
    """Where slot 0's copies of a KVCache array first differ: the earliest position, its first model layer, and how
    many (layer, position) entries differ."""
    text = engine.text
    layers = list(range(text.num_hidden_layers))
    if name.startswith(("full", "sliding")):
        layers = [layer for layer in layers if text.is_sliding(layer) == name.startswith("sliding")]
    index, positions = differing_positions(name, decoded, refed, length)
    if not positions.size:
        return "equal"
    position, layer = min(zip(positions.tolist(), (layers[i] for i in index.tolist()), strict=True))
    return f"position {position}, layer {layer} ({positions.size} layer-positions)"


def refeed(engine: Engine, prompt: int, outputs: int, seed: int) -> dict[str, str]:
    """One random sequence: its `prompt` tokens as chunks and `outputs` more decoded one by one, against the same
    tokens with the outputs fed again as chunks. Per KVCache array, where the two states first differ."""
    tokens = np.random.default_rng(seed).integers(0, engine.text.unpadded_vocab_size, prompt + outputs).tolist()
    fed(engine, tokens[:prompt], prompt=True)
    for token in tokens[prompt:]:
        decoded_last = engine_step(engine, [token], emit=True)
    decoded = {name: np.asarray(value) for name, value in vars(engine.state.kv).items() if value is not None}
    fed(engine, tokens[:prompt], prompt=True)
    refed_last = fed(engine, tokens[prompt:], prompt=False)
    found = {"last row emits the same": str(refed_last == decoded_last)}
    for name, value in vars(engine.state.kv).items():
        if value is not None:
            found[name] = first_difference(engine, name, decoded[name], np.asarray(value), prompt + outputs)
    return found


def engine_states(args: argparse.Namespace) -> None:
    """The end-to-end check (`--engine`), one line per sequence."""
    with contextlib.ExitStack() as stack:
        for op in args.reference:
            stack.enter_context(mock.patch.dict(KERNELS[op].IMPLEMENTATIONS.kernels, clear=True))
        engine = load_engine(
            args.engine,
            load_format=args.load_format,
            max_num_seqs=2,
            chunk=args.chunk,
            max_context=args.prompt + args.outputs,
        )
        for seed in range(args.sequences):
            print(json.dumps({"sequence": seed} | refeed(engine, args.prompt, args.outputs, seed)), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 64, 68, 196])
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--commit", default="")
    parser.add_argument("--engine", help="a checkpoint (or config file, --load-format dummy): the end-to-end check")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--reference", nargs="*", default=[], choices=sorted(KERNELS), help="ops run by reference")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=240)
    parser.add_argument("--outputs", type=int, default=60)
    parser.add_argument("--sequences", type=int, default=4)
    args = parser.parse_args(argv)
    if args.engine:
        engine_states(args)
        return
    sizes = sorted(args.sizes)
    table = {}
    for group in (projections, reductions, mixing, experts, attention):
        for name, outputs in group(sizes).items():
            table[name] = differing(outputs)
            print(json.dumps({name: table[name]}), flush=True)
    if args.markdown:
        columns = sorted({int(size) for row in table.values() for size in row})
        lines = [
            "# bench.batch_invariance: elements of the shared rows that differ from the smallest size's",
            "",
            f"Command: `python -m bench.batch_invariance {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
            f"Machine: {jax.devices()[0].device_kind} ({jax.default_backend()}), JAX {jax.__version__}  ",
            f"Commit: {args.commit}",
            "",
            "| operation | " + " | ".join(f"size {c}" for c in columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for name, row in table.items():
            lines.append(f"| {name} | " + " | ".join(str(row.get(str(c), "")) for c in columns) + " |")
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
