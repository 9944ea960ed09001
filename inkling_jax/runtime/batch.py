"""Batch generation through the scheduler: JSONL requests in, one result line per request out, each written as
it finishes and all in input order once the run ends (`--resume` keeps an interrupted run's results).

`python -m inkling_jax.generate` and `python -m inkling_jax.offline` are this runner (`main`); `generate` and
`run_requests` are its library form. Input lines are `Request`s as JSON ({"id", "prompt_token_ids" | "prompt"
(text, with the checkpoint's tokenizer) | "messages" (with optional "tools", rendered by the checkpoint's chat
template as the SMG gateway renders them: `inkling_jax.chat`), and optionally "max_tokens", "temperature",
"top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
"stop_token_ids", "stop" (strings), "ignore_eos", "logprobs", "speculative", "images"}), every line checked
(`requests.validate`) before the model loads. "images" (image models) are file paths, relative to the JSONL file's
directory or absolute, one per image: with "prompt" each goes at an `<|content_image|>` marker in the text, with
"messages" at a content part of type "image", and its run of placeholders (one per tile) follows the marker; with
"prompt_token_ids" the runs must be there already (`requests.request_from_json`).
Output lines: {"id", "token_ids", "finish_reason": "stop" | "length"} plus "text" (with a tokenizer; special
tokens left out, cut before the first stop string), "logprobs" and "top_logprobs" (when asked for) and
"acceptance_length" (tokens emitted per speculative round, when the request ran any).

All requests are queued before the first step, and every decision of the scheduler follows from them and the
replicated sampled tokens, so on a pod every process runs the same command and the processes step the same
global batch in lockstep; the `data` axis of the mesh holds the replicas. Process 0 writes the output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from inkling_jax import distributed
from inkling_jax.cache import CacheBudgetError
from inkling_jax.chat import ChatTemplateError, checkpoint_template
from inkling_jax.checkpoint import CheckpointError
from inkling_jax.cli import argument_parser
from inkling_jax.config import ConfigError
from inkling_jax.distributed import DistributedError
from inkling_jax.image_processor import ImageProcessorSettings
from inkling_jax.model.draft import NoDraftError, require_draft
from inkling_jax.model.text import CausalLM
from inkling_jax.runtime import compilation_cache
from inkling_jax.runtime.engine import (
    BatchedTokensError,
    Checkpoint,
    Engine,
    add_batched_tokens_argument,
    add_image_arguments,
    add_load_format_argument,
    add_prefix_cache_arguments,
    engine_options,
    load_engine,
    open_checkpoint,
)
from inkling_jax.runtime.images import (
    DEFAULT_MAX_IMAGE_TILES,
    ImageLimits,
    ImageOptionsError,
    encode_programs_for,
    image_limits,
)
from inkling_jax.runtime.requests import MAX_LOGPROBS, Delta, ImageSource, Rejected, Request, request_from_json
from inkling_jax.runtime.scheduler import Scheduler
from inkling_jax.runtime.text_stream import TextStream
from inkling_jax.score import DTYPES, log_to_stderr
from inkling_jax.sharding import MeshError, make_mesh
from inkling_jax.speculative import SPECULATIVE_MODES, SpeculationError
from inkling_jax.tokenizer import IncrementalDecoder, TokenizerError


class RequestError(ValueError):
    """An input that cannot be run; the message names the line (or request) and the field."""


@dataclasses.dataclass
class _Result:
    """One request's output, filled from the scheduler thread."""

    request: Request
    stream: TextStream | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[dict]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    acceptance_length: float = 0.0

    def line(self) -> dict:
        out = {"id": self.request.id, "token_ids": self.token_ids, "finish_reason": self.finish_reason}
        if self.stream is not None:
            out["text"] = "".join(self.text)
        if self.request.logprobs is not None:
            out |= {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}
        return {**out, "acceptance_length": self.acceptance_length} if self.acceptance_length else out


class _Run:
    """Queues every request, then counts them off as they finish."""

    def __init__(
        self, scheduler: Scheduler, requests: Sequence[Request], on_result: Callable[[dict], None] | None = None
    ):
        self.scheduler, self.on_result = scheduler, on_result
        tokenizer = scheduler.engine.tokenizer
        self.results = [
            _Result(r, tokenizer and TextStream(IncrementalDecoder(tokenizer, skip_special_tokens=True), r.stop))
            for r in requests
        ]
        self.done = threading.Event()
        self.finished = 0
        self.generated = 0

    def submit_all(self) -> None:
        for result in self.results:
            try:
                self.scheduler.submit(result.request, lambda delta, result=result: self._on_delta(result, delta))
            except Rejected as error:
                raise RequestError(f"request {result.request.id!r}: {error}") from error
        if not self.results:
            self.done.set()

    def _on_delta(self, result: _Result, delta: Delta) -> None:
        """Runs on the scheduler thread, so a stop string cancels at the same step on every process."""
        if result.finish_reason is not None:
            return
        tokens, result.acceptance_length = delta.token_ids, delta.acceptance_length
        if result.stream is not None:
            piece = result.stream.push(tokens)
            tokens = tokens[: piece.tokens]
            result.text.append(piece.text)
            if piece.stopped:
                self.scheduler.cancel(result.request.id)
                result.finish_reason = "stop"
        result.token_ids.extend(tokens)
        result.logprobs.extend(delta.logprobs[: len(tokens)])
        result.top_logprobs.extend(
            [{"token_id": t.token_id, "logprob": t.logprob} for t in top] for top in delta.top_logprobs[: len(tokens)]
        )
        self.generated += len(tokens)
        if result.finish_reason is None and delta.finish_reason is not None:
            result.finish_reason = delta.finish_reason if delta.error is None else f"error: {delta.error}"
            if result.stream is not None:
                result.text.append(result.stream.finish())
        if result.finish_reason is not None:
            self.finished += 1
            if self.on_result is not None:
                self.on_result(result.line())
            if self.finished == len(self.results):
                self.done.set()


def run_requests(
    engine: Engine,
    requests: Sequence[Request],
    *,
    prefill_budget: int | None = None,
    progress: bool = False,
    on_result: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Every request through a scheduler over `engine` (warmed up first); result lines in input order, each also
    handed to `on_result` as its request finishes (on the scheduler's thread). With `progress`, a progress line
    and a throughput summary go to stderr. RequestError names a request that can never be served (e.g. larger
    than the page pool)."""
    scheduler = Scheduler(engine, prefill_budget=prefill_budget, max_waiting=max(len(requests), 1))
    scheduler.warm_up()
    run = _Run(scheduler, requests, on_result)
    start = time.perf_counter()
    try:
        run.submit_all()
        scheduler.start()
        while not run.done.wait(0.5):
            if progress:
                rate = run.generated / (time.perf_counter() - start)
                print(
                    f"\r{run.finished}/{len(requests)} requests, {rate:.1f} tokens/s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        scheduler.stop()
    if progress:
        elapsed, stats = time.perf_counter() - start, scheduler.stats()
        rates = f"{run.generated / elapsed:.1f} tokens/s, {len(requests) / elapsed:.2f} requests/s"
        rounds = stats.speculative_rounds
        accepted = f", acceptance length {stats.speculative_tokens / rounds:.2f}" if rounds else ""
        print(
            f"\r{len(requests)} requests in {elapsed:.2f} s: {stats.prompt_tokens} prompt tokens, "
            f"{run.generated} generated ({rates}), {stats.preemptions} preemptions{accepted}",
            file=sys.stderr,
        )
    return [result.line() for result in run.results]


def generate(
    model: CausalLM,
    requests: Sequence[Request],
    max_num_seqs: int,
    chunk: int,
    budget_bytes: int | None = None,
    mesh: Mesh | None = None,
    speculative: str = "none",
) -> list[dict]:
    """Run `requests` on `model` (no tokenizer: token ids only); result lines in input order.

    Each data-parallel replica of the mesh (tp1 without one) has `max_num_seqs` slots and a page pool of its
    own: what fits the per-device `budget_bytes`, or room for the longest request in every slot.
    speculative: one of SPECULATIVE_MODES."""
    mesh = make_mesh("tp1", model.config) if mesh is None else mesh
    room = require_draft(model).block_size if speculative != "none" else 0  # a last verify pass's positions
    engine = Engine.create(
        model,
        mesh,
        max_num_seqs=max_num_seqs,
        chunk=chunk,
        max_context=_longest(requests) + room,
        budget_bytes=budget_bytes,
        num_top=MAX_LOGPROBS,
        speculative=speculative,
        **encode_programs_for(requests, DEFAULT_MAX_IMAGE_TILES),
    )
    return run_requests(engine, requests)


def _longest(requests: Sequence[Request]) -> int:
    return max(len(r.prompt_token_ids) + r.max_tokens for r in requests)


def read_requests(path: str | Path, checkpoint: Checkpoint, limits: ImageLimits | None = None) -> list[Request]:
    """The JSONL file's requests, each validated against the checkpoint's config and the engine's image `limits`
    (None: the model takes no images), its images read (relative paths from the file's directory) and processed
    with the checkpoint's image processor settings (RequestError names the line and the field); ids must be
    unique."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise RequestError(f"cannot read {path}: {error}") from error
    requests, lines_of = [], {}
    try:
        chat = checkpoint_template(checkpoint.path) if checkpoint.tokenizer is not None else None
    except ChatTemplateError as error:
        raise RequestError(f"{checkpoint.path}: {error}") from error
    images = None
    if limits is not None:
        settings = ImageProcessorSettings.from_checkpoint(checkpoint.path)
        if (settings.tile_height, settings.tile_width) != limits.tile_shape[:2]:
            raise RequestError(
                f"{checkpoint.path}: the image processor's {settings.tile_height}x{settings.tile_width} tiles are not "
                f"the image tower's {limits.tile_shape[0]}x{limits.tile_shape[1]}"
            )
        images = ImageSource(Path(path).parent, settings, limits)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = request_from_json(line, checkpoint.tokenizer, checkpoint.config.text, chat, images)
        except Rejected as error:
            raise RequestError(f"line {number}: {error}") from error
        if request.id in lines_of:
            raise RequestError(f"line {number}: id {request.id!r} is already used on line {lines_of[request.id]}")
        lines_of[request.id] = number
        requests.append(request)
    if not requests:
        raise RequestError(f"{path} holds no requests")
    return requests


class Output:
    """The output file of a run: process 0 appends each result as its request finishes (so an interrupted run
    keeps what it finished) and, at the end, rewrites the file with every result in input order. With `resume`
    the results the file already holds are kept and their requests skipped; every process skips the same ones
    (process 0 reads the file and tells the others)."""

    def __init__(self, path: str | Path, requests: Sequence[Request], resume: bool):
        self.path, self.requests = Path(path), list(requests)
        self.writer = jax.process_index() == 0
        kept = self._kept() if resume and self.writer else {}
        done = [_key(r.id) in kept for r in self.requests]
        if jax.process_count() > 1:
            done = [bool(d) for d in multihost_utils.broadcast_one_to_all(np.asarray(done, bool))]
        self.done, self.lines = done, kept
        self._file = None
        self._lock = threading.Lock()

    def _kept(self) -> dict[str, dict]:
        """The finished results the file holds, by id (a line cut short by the interruption is dropped)."""
        if not self.path.is_file():
            return {}
        ids = {_key(r.id) for r in self.requests}
        kept = {}
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(result, dict) or _key(result.get("id")) not in ids:
                raise RequestError(f"--resume: line {number} of {self.path} is no result of a request in the input")
            if result.get("finish_reason") in ("stop", "length"):
                kept[_key(result["id"])] = result
        return kept

    def remaining(self) -> list[Request]:
        return [r for r, done in zip(self.requests, self.done, strict=True) if not done]

    def __enter__(self) -> Output:
        return self

    def write(self, result: dict) -> None:
        """Append a finished request's result (the file is rewritten with the kept ones at the first)."""
        if not self.writer:
            return
        with self._lock:
            if self._file is None:
                self._file = self.path.open("w")
                self._file.writelines(json.dumps(kept) + "\n" for kept in self.lines.values())
            self.lines[_key(result["id"])] = result
            self._file.write(json.dumps(result) + "\n")
            self._file.flush()

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> None:
        if not self.writer:
            return
        if self._file is not None:
            self._file.close()
        if kind is None:  # every request finished: the results in input order
            ordered = "".join(json.dumps(self.lines[_key(r.id)]) + "\n" for r in self.requests)
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text(ordered)
            os.replace(partial, self.path)


def _key(request_id: object) -> str:
    return json.dumps(request_id)


# Bad input of any kind: one line naming it, exit status 2.
_USER_ERRORS = (
    ConfigError,
    CheckpointError,
    TokenizerError,
    RequestError,
    CacheBudgetError,
    MeshError,
    DistributedError,
    NoDraftError,
    SpeculationError,
    BatchedTokensError,
    ImageOptionsError,
    OSError,
)


def main(argv: list[str] | None, module: str) -> int:
    """The batch runner's command line (`module` names the entry point); 0, or 2 after one line on bad input."""
    parser = argument_parser(module, "Batch generation of JSONL requests")
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint directory (with --load-format dummy: or a config JSON file)"
    )
    parser.add_argument("--input", required=True, help="JSONL requests")
    parser.add_argument(
        "--output", required=True, help="JSONL results: each written as it finishes, in input order at the end"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the results --output already holds (an interrupted run's) and run only the other requests",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="parameter and activation dtype")
    parser.add_argument(
        "--mesh", default="tp1", help="tpN (tensor and expert parallel over N devices) or dpMtpN (M replicas of tpN)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=8, help="slots per data-parallel replica")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens per slot per step)")
    add_batched_tokens_argument(parser)
    add_prefix_cache_arguments(parser)
    add_image_arguments(parser)
    parser.add_argument(
        "--kv-cache-mib",
        type=float,
        help="decode-state budget per device; default: room for the longest request in every slot",
    )
    parser.add_argument("--prefill-budget", type=int, help="prompt tokens per step (default: 2 chunks)")
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default="none",
        help="DSpark speculative decoding with the checkpoint's draft (dspark-greedy: drafts are the "
        "draft's argmax); the output's distribution is the target's either way",
    )
    add_load_format_argument(parser)
    compilation_cache.add_argument(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress line or summary on stderr")
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    log_to_stderr()
    try:
        distributed.initialize(args)
        cache = compilation_cache.enable(args.compilation_cache)
        if args.max_num_seqs < 1 or args.chunk < 1:
            raise RequestError("--max-num-seqs and --chunk must be at least 1")
        checkpoint = open_checkpoint(args.checkpoint, args.load_format)
        config = checkpoint.config
        limits = image_limits(
            config.vision, config.image_token_id, args.max_images, args.max_image_tiles, args.image_feature_tokens
        )
        requests = read_requests(args.input, checkpoint, limits)  # every line checked before the model loads
        output = Output(args.output, requests, args.resume)
        remaining = output.remaining()
        with output:
            if remaining:
                draft = checkpoint.config.draft
                room = draft.block_size if args.speculative != "none" and draft is not None else 0
                options = engine_options(args) | {"max_context": _longest(remaining) + room}
                options |= encode_programs_for(remaining, args.max_image_tiles, args.image_feature_tokens)
                engine = load_engine(
                    checkpoint,
                    **options,
                    executable_cache=compilation_cache.executables(cache),
                )
                progress = not args.quiet and jax.process_index() == 0
                run_requests(
                    engine, remaining, prefill_budget=args.prefill_budget, progress=progress, on_result=output.write
                )
    except _USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
