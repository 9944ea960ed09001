"""`python -m serving.offline`: batch generation of a JSONL file through the serving scheduler.

    python -m serving.offline --checkpoint DIR --input IN.jsonl --output OUT.jsonl [--mesh tp4 | dp2tp4]
        [--dtype bfloat16] [--max-num-seqs 8] [--chunk 64] [--kv-cache-mib M] [--prefill-budget T]
        [--coordinator-address HOST:PORT|auto --num-processes N --process-id I] [--quiet]
        [--speculative none|dspark|dspark-greedy]

Input lines are those of `python -m inkling_jax.generate` ({"id", "prompt_token_ids", "max_tokens",
"temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids"}) plus "prompt" (text, with the
checkpoint's tokenizer), "stop" (strings), "repetition_penalty", "presence_penalty",
"frequency_penalty" and "ignore_eos"; output lines, in input order: {"id", "token_ids", "text" (with
a tokenizer; special tokens left out, as the server streams it), "finish_reason"} and, when the request
ran speculative rounds (`--speculative dspark`), "acceptance_length". Unlike
`inkling_jax.generate` it allocates pages as sequences grow and
preempts instead of waiting. A progress line and a throughput summary go to stderr.

On a pod every process runs the same command: all requests are queued before the first step and
every decision is a function of them and of the (replicated) sampled tokens, so the processes step the
same global batch in lockstep; the `data` axis of the mesh holds the replicas. Process 0 writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import threading
import time
from pathlib import Path

import jax

from inkling_jax import distributed
from inkling_jax.generate import RequestError, read_line
from inkling_jax.speculative import SPECULATIVE_MODES
from inkling_jax.tokenizer import IncrementalDecoder, Tokenizer
from serving.engine import load_engine
from serving.requests import Delta, EngineRequest, Options, Rejected, validate_options
from serving.scheduler import Scheduler
from serving.text_stream import TextStream

_OPTION_TYPES = {field.name: field.type for field in dataclasses.fields(Options)}


def parse_line(line: str, number: int, tokenizer: Tokenizer | None) -> EngineRequest:
    """One JSONL line -> EngineRequest (ranges are checked later, against the model)."""

    def fail(message: str) -> RequestError:
        return RequestError(f"line {number}: {message}")

    raw = read_line(line, number, set(_OPTION_TYPES), tokenizer)
    prompt = raw["prompt_token_ids"]
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise fail("'prompt_token_ids' must be a list of integers")
    options = {name: _option(name, value, fail) for name, value in raw.items() if name in _OPTION_TYPES}
    if options.get("stop") and tokenizer is None:
        raise fail("'stop' strings need a tokenizer.json in the checkpoint; use stop_token_ids")
    return EngineRequest(str(raw["id"]), tuple(prompt), Options(**options))


def _option(name: str, value: object, fail) -> object:
    kind = _OPTION_TYPES[name]
    if name in ("stop_token_ids", "stop"):
        element = int if name == "stop_token_ids" else str
        if not isinstance(value, list) or not all(isinstance(v, element) and not isinstance(v, bool) for v in value):
            raise fail(f"{name!r} must be a list of {'integers' if element is int else 'strings'}")
        return tuple(value)
    if name in ("ignore_eos", "speculative"):
        if not isinstance(value, bool):
            raise fail(f"{name!r} must be true or false")
        return value
    integral = kind in ("int", "int | None")
    if isinstance(value, bool) or not isinstance(value, int | float) or (integral and not isinstance(value, int)):
        raise fail(f"{name!r} must be {'an integer' if integral else 'a number'}, got {value!r}")
    if not integral and not math.isfinite(value):
        raise fail(f"{name!r} must be finite")
    return value if integral else float(value)


@dataclasses.dataclass
class _Result:
    """One request's output, filled from the scheduler thread."""

    request: EngineRequest
    stream: TextStream | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    acceptance_length: float = 0.0

    def line(self, with_text: bool) -> dict:
        out = {"id": self.request.id, "token_ids": self.token_ids}
        if with_text:
            out["text"] = "".join(self.text)
        out["finish_reason"] = self.finish_reason
        return {**out, "acceptance_length": self.acceptance_length} if self.acceptance_length else out


class _Run:
    """Queues every request, then counts them off as they finish."""

    def __init__(self, scheduler: Scheduler, requests: list[EngineRequest], tokenizer: Tokenizer | None):
        self.scheduler = scheduler
        self.results = [_Result(r, tokenizer and TextStream(IncrementalDecoder(tokenizer, skip_special_tokens=True),
                                                            r.options.stop)) for r in requests]  # fmt: skip
        self.done = threading.Event()
        self.finished = 0
        self.generated = 0

    def submit_all(self) -> None:
        for result in self.results:
            try:
                self.scheduler.submit(result.request, lambda delta, result=result: self._on_delta(result, delta))
            except Rejected as error:
                raise RequestError(f"request {result.request.id!r}: {error}") from error

    def _on_delta(self, result: _Result, delta: Delta) -> None:
        """Runs on the scheduler thread, so a stop string cancels at the same step on every process."""
        if result.finish_reason is not None:
            return
        tokens, result.acceptance_length = delta.token_ids, delta.acceptance_length
        if result.stream is not None:
            piece = result.stream.push(tokens)
            tokens, stopped = tokens[: piece.tokens], piece.stopped
            result.text.append(piece.text)
            if stopped:
                self.scheduler.cancel(result.request.id)
                result.finish_reason = "stop"
        result.token_ids.extend(tokens)
        self.generated += len(tokens)
        if result.finish_reason is None and delta.finish_reason is not None:
            result.finish_reason = delta.finish_reason if delta.error is None else f"error: {delta.error}"
            if result.stream is not None:
                result.text.append(result.stream.finish())
        if result.finish_reason is not None:
            self.finished += 1
            if self.finished == len(self.results):
                self.done.set()


def run(scheduler: Scheduler, requests: list[EngineRequest], tokenizer: Tokenizer | None, progress: bool) -> list:
    """Generate every request; results in input order, and the summary numbers."""
    run = _Run(scheduler, requests, tokenizer)
    start = time.perf_counter()
    run.submit_all()
    scheduler.start()
    while not run.done.wait(0.5):
        if progress:
            elapsed = time.perf_counter() - start
            print(f"\r{run.finished}/{len(requests)} requests, {run.generated / elapsed:.1f} tokens/s",
                  end="", file=sys.stderr, flush=True)  # fmt: skip
    elapsed = time.perf_counter() - start
    if progress:
        stats = scheduler.stats()
        rates = f"{run.generated / elapsed:.1f} tokens/s, {len(requests) / elapsed:.2f} requests/s"
        rounds = stats.speculative_rounds
        accepted = f", acceptance length {stats.speculative_tokens / rounds:.2f}" if rounds else ""
        print(f"\r{len(requests)} requests in {elapsed:.2f} s: {stats.prompt_tokens} prompt tokens, "
              f"{run.generated} generated ({rates}), {stats.preemptions} preemptions{accepted}",
              file=sys.stderr)  # fmt: skip
    return [result.line(tokenizer is not None) for result in run.results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.offline", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input", required=True, help="JSONL requests")
    parser.add_argument("--output", required=True, help="JSONL results, in input order")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--mesh", default="tp1", help="tpN or dpMtpN (M data-parallel replicas)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="slots per data-parallel replica")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk (token bucket) width")
    parser.add_argument("--kv-cache-mib", type=float, help="decode-state budget per device")
    parser.add_argument("--prefill-budget", type=int, help="prompt tokens per step (default: 2 chunks)")
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default="none",
        help="DSpark speculative decoding with the checkpoint's draft (dspark-greedy: argmax drafts)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line or summary")
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        distributed.initialize(args)
        engine = load_engine(
            args.checkpoint, mesh=args.mesh, dtype=args.dtype, max_num_seqs=args.max_num_seqs, chunk=args.chunk,
            kv_cache_mib=args.kv_cache_mib, speculative=args.speculative,
        )  # fmt: skip
        try:
            lines = Path(args.input).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise RequestError(f"cannot read {args.input}: {error}") from error
        requests = []
        for number, line in enumerate(lines, 1):
            if line.strip():
                request = parse_line(line, number, engine.tokenizer)
                try:
                    validate_options(request.options, engine.text, len(request.prompt_token_ids))
                except Rejected as error:
                    raise RequestError(f"line {number}: {error}") from error
                requests.append(request)
        if not requests:
            raise RequestError(f"{args.input} holds no requests")
        if len({r.id for r in requests}) != len(requests):
            raise RequestError(f"{args.input}: request ids must be unique")
        scheduler = Scheduler(engine, prefill_budget=args.prefill_budget, max_waiting=len(requests))
        scheduler.warm_up()
        try:
            results = run(scheduler, requests, engine.tokenizer, not args.quiet and jax.process_index() == 0)
        finally:
            scheduler.stop()
        if jax.process_index() == 0:
            Path(args.output).write_text("".join(json.dumps(result) + "\n" for result in results))
    except (ValueError, OSError) as error:  # bad input of any kind (config, checkpoint, mesh, lines)
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
