"""A fake of `inkling_jax.runtime.scheduler.Scheduler` and its engine for tests of the gRPC services (no model, no
JAX compiles): an "echo model" whose continuation repeats the prompt's tokens, so every expected output is known
exactly; it honours max_tokens, EOS, stop tokens, cancellation, draining and its slot limit, and counts what it is
asked to do."""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

from paths import REPO

from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.config import TextConfig
from inkling_jax.runtime.constraints import ConstraintError, Grammars
from inkling_jax.runtime.kv_events import KvEvents
from inkling_jax.runtime.requests import Code, Delta, Rejected, Request, TopLogprob
from inkling_jax.runtime.scheduler import Stats
from inkling_jax.tokenizer import Tokenizer

CONFIG = REPO / "configs" / "tiny_text.json"  # vocabulary 500 (EOS 499), context 4096
PAGE_SIZE, NUM_PAGES = 16, 64  # the fake cache holds 1024 tokens


@dataclasses.dataclass
class FakeEngine:
    text: TextConfig
    tokenizer: Tokenizer | None
    checkpoint: str
    mesh_spec: str = "tp1"
    max_num_seqs: int = 4
    num_pages: int = NUM_PAGES
    page_size: int = PAGE_SIZE
    dtype: str = "float32"
    image_limits: None = None  # the echo model takes no images

    @property
    def max_context(self) -> int:
        return self.text.max_position_embeddings


@dataclasses.dataclass
class Sequence:
    request: Request
    on_delta: Callable[[Delta], None]
    generated: int = 0
    cancelled: bool = False


class FakeScheduler:
    """The scheduler interface over the echo model: token i of a continuation is prompt[i % len(prompt)].

    Each step every running sequence makes one or two tokens (alternately), so deltas differ in size.
    `fail_submit` makes the next submit raise it; prompts in `fail_midway` end in an error delta after
    their first delta; with a `script`, the continuation repeats the script instead of the prompt.
    """

    def __init__(self, engine: FakeEngine, *, ready: bool = True, step_seconds: float = 0.001, capacity: int = 4096):
        self.engine, self.ready, self.draining, self.step_seconds = engine, ready, False, step_seconds
        self.capacity = capacity
        self.fail_submit: Exception | None = None
        self.kv_events: KvEvents | None = None  # no prefix cache unless a test gives it one
        self.script: list[int] | None = None  # when set, every continuation is these tokens, repeated
        self.fail_midway: set[tuple[int, ...]] = set()
        self.cancelled: list[str] = []
        self.submitted: list[Request] = []
        self.preemptions = self.generated_tokens = self.prompt_tokens = 0
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: dict[str, Sequence] = {}
        self._lock = threading.Condition()
        self._stopped = False
        self._step = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def warm_up(self) -> None:
        self.ready = True

    def start(self) -> None:
        """The step loop runs from construction."""

    def prepare(self, request: Request) -> None:
        """The real grammar compiler over the checkpoint's tokenizer (the echo model ignores the constraint)."""
        if request.constraint is None:
            return
        if self.engine.tokenizer is None:
            raise Rejected(Code.INVALID_ARGUMENT, "a constraint needs the checkpoint's tokenizer, and it has none")
        text = self.engine.text
        grammars = Grammars(self.engine.tokenizer, text.unpadded_vocab_size, [text.eos_token_id])
        try:
            grammars.compile(request.constraint)
        except ConstraintError as error:
            raise Rejected(Code.INVALID_ARGUMENT, f"constraint: {error}") from None

    def submit(self, request: Request, on_delta: Callable[[Delta], None]) -> None:
        if self.fail_submit is not None:
            error, self.fail_submit = self.fail_submit, None
            raise error
        if not self.ready:
            raise Rejected(Code.UNAVAILABLE, "the scheduler is warming up")
        if self.draining:
            raise Rejected(Code.UNAVAILABLE, "the server is draining")
        pages = math.ceil((len(request.prompt_token_ids) + request.max_tokens) / PAGE_SIZE)
        if pages > NUM_PAGES:
            raise Rejected(Code.RESOURCE_EXHAUSTED, f"needs {pages} pages, the cache has {NUM_PAGES}")
        with self._lock:
            assert request.id not in self._running and all(s.request.id != request.id for s in self._waiting)
            self._waiting.append(Sequence(request, on_delta))
            self.submitted.append(request)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled.append(request_id)
            for sequence in [*self._waiting, *self._running.values()]:
                if sequence.request.id == request_id:
                    sequence.cancelled = True

    def drain(self, timeout: float | None = None) -> None:
        self.draining = True
        with self._lock:
            if not self._lock.wait_for(lambda: not self._waiting and not self._running, timeout):
                for sequence in [*self._waiting, *self._running.values()]:
                    sequence.cancelled = True

    def stop(self) -> None:
        self.drain(timeout=0)
        with self._lock:
            self._lock.wait_for(lambda: not self._waiting and not self._running, 5)
            self._stopped = True
        self._thread.join()

    def stats(self) -> Stats:
        with self._lock:
            used = sum(
                math.ceil((len(s.request.prompt_token_ids) + s.generated) / PAGE_SIZE) for s in self._running.values()
            )
            return Stats(
                len(self._waiting),
                len(self._running),
                used,
                NUM_PAGES,
                self.preemptions,
                self.generated_tokens,
                self.prompt_tokens,
                0,
                0,
            )

    @property
    def max_sequence_tokens(self) -> int:
        return min(self.engine.text.max_position_embeddings, NUM_PAGES * PAGE_SIZE)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._running)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                deltas = self._step_all()
                self._lock.notify_all()
            for on_delta, delta in deltas:
                on_delta(delta)
            time.sleep(self.step_seconds)

    def _step_all(self) -> list[tuple[Callable[[Delta], None], Delta]]:
        deltas = []
        for sequence in list(self._waiting):
            if sequence.cancelled:
                self._waiting.remove(sequence)
                deltas.append((sequence.on_delta, Delta((), finish_reason="abort")))
        while self._waiting and len(self._running) < self.engine.max_num_seqs:
            sequence = self._waiting.popleft()
            self._running[sequence.request.id] = sequence
            self.prompt_tokens += len(sequence.request.prompt_token_ids)
        self._step += 1
        for sequence in list(self._running.values()):
            delta = self._advance(sequence)
            if delta.finish_reason is not None:
                del self._running[sequence.request.id]
            deltas.append((sequence.on_delta, delta))
        return deltas

    def _advance(self, sequence: Sequence) -> Delta:
        request = options = sequence.request
        prompt = request.prompt_token_ids
        usage = {"prompt_tokens": len(prompt)}
        if sequence.cancelled:
            return Delta((), finish_reason="abort", completion_tokens=sequence.generated, **usage)
        if sequence.generated and prompt in self.fail_midway:
            return Delta((), finish_reason="error", error="the device fell over", **usage)
        tokens, finish = [], None
        for _ in range(1 + self._step % 2):
            source = prompt if self.script is None else self.script
            token = source[sequence.generated % len(source)]
            tokens.append(token)
            sequence.generated += 1
            if token in options.stop_token_ids or (token == self.engine.text.eos_token_id and not options.ignore_eos):
                finish = "stop"
            elif sequence.generated == options.max_tokens:
                finish = "length"
            if finish:
                break
        self.generated_tokens += len(tokens)
        logprobs, top = (), ()
        if options.logprobs is not None:
            logprobs = tuple(-0.5 * (token % 3) for token in tokens)
            top = tuple(
                tuple(TopLogprob((token + k) % 500, -float(k)) for k in range(options.logprobs)) for token in tokens
            )
        accepted = 1.5 if options.speculative else 0.0  # as if every round emitted 1.5 tokens
        return Delta(
            tuple(tokens),
            logprobs,
            top,
            finish,
            completion_tokens=sequence.generated,
            acceptance_length=accepted,
            **usage,
        )


def echo(prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    """The echo model's continuation: the prompt repeated, up to max_tokens or through EOS."""
    out = []
    while len(out) < max_tokens:
        out.append(prompt[len(out) % len(prompt)])
        if out[-1] == eos:
            break
    return out


def weightless_checkpoint(directory: Path) -> str:
    """`directory` as a checkpoint of the tiny config with its tokenizer and chat template, and no weights (the
    fake engine reads none)."""
    return str(write_checkpoint(CONFIG, directory, weights=False))
