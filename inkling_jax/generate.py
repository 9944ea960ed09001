"""`python -m inkling_jax.generate`: batch generation of JSONL requests through the engine step.

    python -m inkling_jax.generate --checkpoint DIR --input IN.jsonl --output OUT.jsonl
        [--dtype float32|bfloat16] [--max-num-seqs N] [--chunk C] [--kv-cache-mib M] [--mesh tpN|dpMtpN]
        [--coordinator-address HOST:PORT|auto --num-processes N --process-id I]
        [--speculative none|dspark|dspark-greedy]

Input lines: {"id", "prompt_token_ids" | "prompt", "max_tokens", "temperature", "top_p", "top_k",
"min_p", "seed", "stop_token_ids", "speculative"} (all but id and the prompt optional; a text "prompt"
needs the checkpoint's tokenizer; "speculative": false opts a request out of speculation); output
lines, in input order: {"id", "token_ids", "finish_reason"} (+ "text" with a tokenizer, + "acceptance_length":
tokens emitted per speculative round, when it had any) with finish_reason "stop" (a stop token or the
model's end of sequence, included in token_ids) or "length". Requests share `max_num_seqs` slots per
data-parallel replica; prompts are prefilled in chunks of C tokens alongside other slots' decoding. The
engine's step shapes (`Engine.widths`) are compiled up front, and nothing after.
Multi-host: every process runs the same command (see `inkling_jax.distributed`); process 0 writes the
output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from inkling_jax import distributed
from inkling_jax.cache import PAGE_SIZE, CacheBudgetError
from inkling_jax.checkpoint import CheckpointError, load_model
from inkling_jax.config import ConfigError, TextConfig, load_config
from inkling_jax.distributed import DistributedError
from inkling_jax.engine import Engine, host_batch
from inkling_jax.model.draft import NoDraftError, require_draft
from inkling_jax.model.text import CausalLM
from inkling_jax.score import DTYPES, log_to_stderr
from inkling_jax.sharding import MeshError, make_mesh
from inkling_jax.speculative import SPECULATIVE_MODES, SpeculationError
from inkling_jax.step import StepBatch
from inkling_jax.token_ids import TokenIdError, validate_token_ids
from inkling_jax.tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerError


class RequestError(ValueError):
    """A request line that cannot be served; the message names the line and the field."""


@dataclasses.dataclass(frozen=True)
class Request:
    id: str | int
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    speculative: bool = True  # speculate when the run does (--speculative)


def read_line(line: str, number: int, fields: set[str], tokenizer: Tokenizer | None) -> dict:
    """A request line's JSON object with its id checked and its prompt as "prompt_token_ids" (a text
    "prompt" encoded with `tokenizer`); `fields` are the other fields allowed. RequestError names the line."""

    def fail(message: str) -> RequestError:
        return RequestError(f"line {number}: {message}")

    try:
        raw = json.loads(line)
    except json.JSONDecodeError as error:
        raise fail(f"not JSON ({error})") from error
    if not isinstance(raw, dict):
        raise fail("a request must be a JSON object")
    unknown = sorted(set(raw) - fields - {"id", "prompt", "prompt_token_ids"})
    if unknown:
        raise fail(f"unknown field(s) {', '.join(unknown)}")
    if "id" not in raw:
        raise fail("missing 'id'")
    if not isinstance(raw["id"], str | int) or isinstance(raw["id"], bool):
        raise fail("'id' must be a string or an integer")
    if ("prompt" in raw) == ("prompt_token_ids" in raw):
        raise fail("give exactly one of 'prompt' (text) and 'prompt_token_ids'")
    if "prompt" in raw:
        if tokenizer is None:
            raise fail("'prompt' (text) needs a tokenizer.json in the checkpoint; send prompt_token_ids")
        if not isinstance(raw["prompt"], str):
            raise fail("'prompt' must be a string")
        raw["prompt_token_ids"] = tokenizer.encode(raw.pop("prompt"))
    return raw


def parse_request(line: str, number: int, text: TextConfig, tokenizer: Tokenizer | None = None) -> Request:
    """One JSONL line -> Request, or RequestError naming the line; a text "prompt" needs `tokenizer`."""

    def fail(message: str) -> RequestError:
        return RequestError(f"line {number}: {message}")

    raw = read_line(line, number, {f.name for f in dataclasses.fields(Request)}, tokenizer)
    try:
        prompt = validate_token_ids(raw["prompt_token_ids"], text)
        stop = tuple(validate_token_ids(raw["stop_token_ids"], text)) if raw.get("stop_token_ids") else ()
    except TokenIdError as error:
        raise fail(str(error)) from error

    def number_field(name: str, kind: type, low: float, high: float, default: float) -> float:
        value = raw.get(name, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (kind is int and not isinstance(value, int))
        ):
            raise fail(f"{name!r} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if not (low <= value <= high) or (isinstance(value, float) and not math.isfinite(value)):
            raise fail(f"{name!r} must be within [{low}, {high}], got {value!r}")
        return kind(value)

    request = Request(
        id=raw["id"],
        prompt_token_ids=prompt,
        max_tokens=number_field("max_tokens", int, 1, text.max_position_embeddings, 16),
        temperature=number_field("temperature", float, 0.0, 100.0, 1.0),
        top_p=number_field("top_p", float, 1e-9, 1.0, 1.0),
        top_k=max(0, number_field("top_k", int, -1, text.unpadded_vocab_size, 0)),
        min_p=number_field("min_p", float, 0.0, 1.0, 0.0),
        seed=number_field("seed", int, 0, 2**32 - 1, 0),
        stop_token_ids=stop,
        speculative=raw.get("speculative", True),
    )
    if not isinstance(request.speculative, bool):
        raise fail(f"'speculative' must be true or false, got {request.speculative!r}")
    if len(request.prompt_token_ids) + request.max_tokens > text.max_position_embeddings:
        raise fail(f"prompt + max_tokens exceeds the model's {text.max_position_embeddings} positions")
    return request


@dataclasses.dataclass
class _Slot:
    index: int  # the request's position in the input
    request: Request
    prompted: int = 0  # prompt tokens already sent
    output: list[int] = dataclasses.field(default_factory=list)
    fresh: bool = True
    rounds: int = 0  # speculative rounds, and the tokens they emitted
    drafted: int = 0

    def pages(self, room: int) -> int:
        """Pages for the prompt, max_tokens and `room` positions a last verify pass may write beyond them."""
        return math.ceil((len(self.request.prompt_token_ids) + self.request.max_tokens + room) / PAGE_SIZE)


def generate(
    model: CausalLM,
    requests: Sequence[Request],
    max_num_seqs: int,
    chunk: int,
    budget_bytes: int | None = None,
    mesh: Mesh | None = None,
    speculative: str = "none",
) -> list[dict]:
    """Serve every request through the engine step; results in input order.

    Each data-parallel replica of the mesh (one without a mesh) has `max_num_seqs` slots and a page
    pool of its own. With a memory budget (per device) the pool is what fits after the slots' fixed
    state, and a request waits until a replica has pages free for its prompt and max_tokens; without
    one every slot gets room for the longest request. In a multi-process run every process calls this
    with the same requests and steps the same global batch. speculative: one of SPECULATIVE_MODES;
    decoding slots of requests that allow it then run DSpark rounds.
    """
    mesh = make_mesh("tp1", model.config) if mesh is None else mesh
    room = 0 if speculative == "none" else require_draft(model).block_size  # a verify pass's positions past the end
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) + room
    engine = Engine.create(model, mesh, max_num_seqs=max_num_seqs, chunk=chunk, max_context=longest,
                           budget_bytes=budget_bytes, speculative=speculative)  # fmt: skip
    return run_requests(engine, requests)


def _batch(engine: Engine, slots: Sequence[_Slot | None], page_table: np.ndarray) -> StepBatch:
    """The next step's host batch; advances each slot's prompt position."""
    count = len(slots)
    prefilling = any(slot and slot.prompted < len(slot.request.prompt_token_ids) for slot in slots)
    pieces: list[list[int]] = [[] for _ in range(count)]
    reset, prompt, emit, speculate = (np.zeros(count, bool) for _ in range(4))
    for s, slot in enumerate(slots):
        if slot is None:
            continue
        ids = slot.request.prompt_token_ids
        if slot.prompted < len(ids):
            pieces[s] = ids[slot.prompted : slot.prompted + engine.chunk]
            slot.prompted += len(pieces[s])
            prompt[s], emit[s] = True, slot.prompted == len(ids)
        else:
            pieces[s], emit[s] = slot.output[-1:], True
            # a round pays off only when more than one token is still wanted
            speculate[s] = (
                engine.speculative and slot.request.speculative and slot.request.max_tokens - len(slot.output) > 1
            )
        reset[s], slot.fresh = slot.fresh, False
    tokens = np.zeros((count, engine.width(prefilling, speculate.any())), np.int32)
    counts = np.zeros(count, np.int32)
    for s, piece in enumerate(pieces):
        tokens[s, : len(piece)], counts[s] = piece, len(piece)
    requests = [slot.request if slot else None for slot in slots]
    return host_batch(
        tokens, counts, requests, page_table, reset=reset, is_prompt=prompt, emit=emit, speculate=speculate
    )


def run_requests(engine: Engine, requests: Sequence[Request]) -> list[dict]:
    """Admit requests into free slots (first come, first served, pages permitting), step until all finish."""
    eos = engine.text.eos_token_id
    eos_ids = eos if isinstance(eos, tuple) else (eos,)
    free_pages = [list(range(engine.pages_per_replica)) for _ in range(engine.replicas)]  # replica-local ids
    table = np.zeros((engine.slots, engine.max_pages), np.int32)
    slots: list[_Slot | None] = [None] * engine.slots
    engine.warm_up()  # every step shape compiles before serving
    results: list[dict | None] = [None] * len(requests)
    waiting = [_Slot(index, request) for index, request in enumerate(requests)]
    while waiting or any(slots):
        for s in range(engine.slots):
            pool = free_pages[engine.replica_of(s)]
            if slots[s] is None and waiting and waiting[0].pages(engine.gamma) <= len(pool):
                table[s, : waiting[0].pages(engine.gamma)] = [pool.pop() for _ in range(waiting[0].pages(engine.gamma))]
                slots[s] = waiting.pop(0)
        batch = _batch(engine, slots, table)
        emitted = engine.fetch(engine.step(batch))
        for s, slot in enumerate(slots):
            if slot is None or not batch.emit[s]:
                continue
            slot.rounds += int(batch.speculate[s])
            slot.drafted += int(emitted.count[s]) if batch.speculate[s] else 0
            reason = None
            for token in emitted.tokens[s, : emitted.count[s]].tolist():
                slot.output.append(token)
                if token in slot.request.stop_token_ids or token in eos_ids:
                    reason = "stop"
                elif len(slot.output) >= slot.request.max_tokens:
                    reason = "length"
                if reason:
                    break
            if reason:
                results[slot.index] = {"id": slot.request.id, "token_ids": slot.output, "finish_reason": reason}
                if slot.rounds:
                    results[slot.index]["acceptance_length"] = slot.drafted / slot.rounds
                free_pages[engine.replica_of(s)].extend(table[s, : slot.pages(engine.gamma)].tolist())
                slots[s] = None
    return results


# Bad input of any kind: one line naming it, exit status 2.
_USER_ERRORS = (
    ConfigError, CheckpointError, TokenizerError, RequestError, CacheBudgetError, MeshError, DistributedError,
    NoDraftError, SpeculationError, OSError,
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inkling_jax.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input", required=True, help="JSONL requests")
    parser.add_argument("--output", required=True, help="JSONL results, in input order")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk (token bucket) width")
    parser.add_argument("--kv-cache-mib", type=float, help="decode-state budget; default: room for every slot")
    mesh_help = "tpN (tensor and expert parallel over N devices) or dpMtpN (M replicas of tpN)"
    parser.add_argument("--mesh", default="tp1", help=mesh_help)
    parser.add_argument("--speculative", choices=SPECULATIVE_MODES, default="none",
                        help="DSpark speculative decoding with the checkpoint's draft (dspark-greedy: drafts are the "
                             "draft's argmax); the output's distribution is the target's either way")  # fmt: skip
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    log_to_stderr()
    try:
        distributed.initialize(args)
        if args.max_num_seqs < 1 or args.chunk < 1:
            raise RequestError("--max-num-seqs and --chunk must be at least 1")
        if not Path(args.checkpoint, "config.json").is_file():
            raise CheckpointError(f"{args.checkpoint} is not a checkpoint directory (no config.json)")
        mesh = make_mesh(args.mesh, load_config(args.checkpoint).text)
        config, model = load_model(args.checkpoint, DTYPES[args.dtype], mesh)  # straight into its shards
        try:
            lines = Path(args.input).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise RequestError(f"cannot read {args.input}: {error}") from error
        tokenizer = (
            Tokenizer.from_checkpoint(args.checkpoint) if Path(args.checkpoint, TOKENIZER_FILE).is_file() else None
        )
        requests = [parse_request(line, n, config.text, tokenizer) for n, line in enumerate(lines, 1) if line.strip()]
        if not requests:
            raise RequestError(f"{args.input} holds no requests")
        budget = None if args.kv_cache_mib is None else int(args.kv_cache_mib * 2**20)
        results = generate(model, requests, args.max_num_seqs, args.chunk, budget, mesh, args.speculative)
        if tokenizer is not None:
            results = [{**r, "text": tokenizer.decode(r["token_ids"], skip_special_tokens=True)} for r in results]
        if jax.process_index() == 0:
            Path(args.output).write_text("".join(json.dumps(result) + "\n" for result in results))
    except _USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
