"""Continuous batching over the engine's fixed slots, on a thread of its own.

Every step mixes decoding (one token for each running sequence) with chunks of prompts (at most
`prefill_budget` prompt tokens per step, in pieces of at most the engine's chunk, within the engine's
`max_num_batched_tokens` and lanes per replica once the decoding slots have theirs). Pages are allocated
as sequences grow; when a replica runs out, its most recently admitted sequence is preempted (its
pages freed) and later recomputed: its prompt and the tokens it had produced are fed again (the
latter counted as its output, so penalties and its seeded random stream continue exactly) and
generation resumes where it stopped.

A request with images gets rows of the engine's image-feature pool for the tiles of the images it computes when it
is admitted (it waits, first come first served, until they are free; images wholly inside the pages it takes from
the prefix cache are never read, so neither encoded nor given rows), and those images are encoded into them then,
one by one, before the step that prefills their placeholders; it keeps them until it finishes, so a preempted
request's recomputed prompt reads the same features, however its chunks cut the placeholder runs (one that comes
back with less of its prompt cached gets the images it now computes).

With speculation (`--speculative dspark`), a decoding sequence whose request allows it runs a DSpark
round each step (up to γ + 1 tokens at once, the same distribution as plain decoding); it decodes
plainly when one token is all it still needs, or when a verify pass would run past the pages one
sequence can hold (near the end of its context).

The loop never waits on the host: a decoding slot's next input is the last token the previous step
emitted for it, read on device, so step N + 1 is dispatched before step N's tokens are read; reading
them, checking stop conditions and handing deltas to the streams happen while the device computes. The
host does not know how many tokens an unread round emits, so it gives the sequence pages for the most
it can. A sequence that stops (EOS, stop token, max_tokens, cancellation) may have one more step in
flight; its result is dropped. A constrained sequence's mask needs its last token, which may still be in flight:
its steps defer its sample (`Engine.resample`), and the host reads the step before, advances the matcher and
computes the mask while the step runs, then draws the sample under it (every constrained token so, whatever
else the step holds: its bits do not depend on the batch). A constrained sequence speculates too (at most ROUND_ROWS
a replica a step, the others decode as above): a step verifies the drafts the state kept for it under the masks of
each position, which the host computed along those drafts after reading the step before, and drafts its next round
after what it emits; while such a sequence runs, the loop reads each step before planning the next (the host's
time between steps is the price of the round's tokens). Its first round verifies no draft. Detokenizing and stop
strings happen in the consumers' threads (the server's) or in their `on_delta` callbacks (the batch runner's), through
`inkling_jax.runtime.text_stream`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from inkling_jax.cache import PAGE_SIZE, ROUND_ROWS
from inkling_jax.runtime.constraints import ConstraintError, Grammars, Matcher
from inkling_jax.runtime.engine import Engine, pages_for
from inkling_jax.runtime.images import RequestImage, placeholder_runs
from inkling_jax.runtime.kv_events import KvEvents, Removed, Stored, block_hash
from inkling_jax.runtime.prefix_cache import Hit, PrefixIndex, image_digest, page_keys
from inkling_jax.runtime.requests import Code, Delta, Rejected, Request, TopLogprob, validate
from inkling_jax.step import Emitted, StepBatch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Stats:
    waiting: int
    running: int
    pages_used: int
    pages_total: int
    preemptions: int  # cumulative
    generated_tokens: int  # cumulative
    prompt_tokens: int  # cumulative, counted at admission
    speculative_rounds: int  # cumulative
    speculative_tokens: int  # cumulative: tokens those rounds emitted
    image_rows_used: int = 0  # rows of the image feature pool the admitted requests hold
    image_rows_total: int = 0  # rows in the pool (0: the engine takes no images)
    cached_tokens: int = 0  # cumulative: prompt tokens admissions took from the prefix cache
    cached_pages: int = 0  # pages the prefix cache holds
    evicted_pages: int = 0  # cumulative


@dataclasses.dataclass(eq=False)
class _Sequence:
    request: Request
    on_delta: Callable[[Delta], None]
    arrival: int  # admission order: the lowest is served first and preempted last
    outputs: list[int] = dataclasses.field(default_factory=list)
    fed: int = 0  # prompt (and replayed) tokens sent to the decode state since admission
    decoding: bool = False  # caught up: each step feeds its newest token and emits at least one more
    in_flight: int = 0  # dispatched steps that emit for it, not read yet
    bound: int = 0  # the most tokens those steps can emit
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    replay_until: int = 0  # positions below this that are outputs are fed again after a preemption
    finished: bool = False
    rounds: int = 0  # speculative rounds read, and the tokens they emitted
    round_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()  # the tokens that end it: its stop ids, and EOS unless ignored
    prompt_rows: np.ndarray | None = None  # [prompt] each prompt token's image-feature pool row, -1 for text
    image_runs: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # its images' placeholder runs
    matcher: Matcher | None = None  # its constraint's place after the outputs read so far
    drafts: list[int] | None = None  # a constrained round's drafts the state keeps for its slot (None: none)
    round_row: int = 0  # and the row of its replica's ROUND_ROWS that keeps them
    shared: list[bytes] = dataclasses.field(default_factory=list)  # keys of the cached pages it reads
    landed: int = 0  # the last page boundary its state landed on (where the prefix cache can save it)
    junction: int = 0  # where it leaves a cached chain with no snapshot there (saved when it lands; 0: none)
    cached: int = 0  # prompt tokens its first admission took from the prefix cache
    keys: list[bytes] = dataclasses.field(default_factory=list)  # its first pages' prefix-cache keys

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def known(self) -> int:
        """Tokens the host holds: the prompt and the outputs read so far."""
        return len(self.prompt) + len(self.outputs)

    def token(self, position: int) -> int:
        return self.prompt[position] if position < len(self.prompt) else self.outputs[position - len(self.prompt)]

    def tokens(self, page: int) -> tuple[int, ...]:
        """The tokens of its full page `page`."""
        return tuple(self.token(p) for p in range(page * PAGE_SIZE, (page + 1) * PAGE_SIZE))

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per speculative round (0 before any)."""
        return self.round_tokens / self.rounds if self.rounds else 0.0


@dataclasses.dataclass
class _Plan:
    """One step: its host batch, the sequence of each slot whose output is kept, the device's outputs."""

    batch: StepBatch
    sequences: dict[int, _Sequence]  # slot -> sequence
    bounds: dict[int, int]  # slot -> the most tokens the step can emit for it
    deferred: list[int] = dataclasses.field(default_factory=list)  # constrained slots: sampled by `_resample`
    rounds: dict[int, tuple[int, bool, np.ndarray]] = dataclasses.field(default_factory=dict)  # constrained rounds
    junctions: list[_Sequence] = dataclasses.field(default_factory=list)  # sequences the step lands on theirs
    emitted: Emitted | None = None


class Scheduler:
    def __init__(self, engine: Engine, *, prefill_budget: int | None = None, max_waiting: int = 4096):
        self.engine = engine
        self.text = engine.text
        self.prefill_budget = prefill_budget or 2 * engine.chunk
        self.max_waiting = max_waiting
        eos = self.text.eos_token_id
        self.eos = frozenset(eos if isinstance(eos, tuple) else (eos,))
        self._grammars: Grammars | None = None  # the constraints' compiler, built at warm-up (with a tokenizer)
        self._lock = threading.Condition()
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._waiting: list[_Sequence] = []
        self._slots: list[_Sequence | None] = [None] * self.engine.slots
        self._free_pages = [list(range(self.engine.pages_per_replica)) for _ in range(self.engine.replicas)]
        snapshots = engine.snapshots_per_replica  # a prefix cache per replica, where the engine saves snapshots
        self.kv_events = KvEvents() if snapshots else None  # the caches' changes, for routers (None: no cache)
        self._prefix = None
        if snapshots:
            self._prefix = [
                PrefixIndex(snapshots, functools.partial(self._evicted, replica)) for replica in range(engine.replicas)
            ]
        limits = engine.image_limits
        self._free_rows = list(range(limits.pool_rows)) if limits is not None else []  # of the image-feature pool
        self._ids: dict[str, _Sequence] = {}  # every unfinished request
        self._arrivals = itertools.count()
        self._counters = collections.Counter()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.ready = False
        self.draining = False

    @property
    def capacity(self) -> int:
        """The most requests it holds at once: one in each slot and a full waiting queue."""
        return self.engine.slots + self.max_waiting

    # --- the consumer side (any thread) ---

    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens, prompt and output, one sequence can hold (`Engine.max_context`)."""
        return self.engine.max_context

    def submit(self, request: Request, on_delta: Callable[[Delta], None]) -> None:
        """Queue a request; `on_delta` receives its deltas from the scheduler thread (it must not block).
        Raises Rejected when the request is invalid (`validate`), can never be served or the scheduler is not
        accepting."""
        if not self.ready or self.draining:
            raise Rejected(Code.UNAVAILABLE, "the server is warming up" if not self.ready else "the server is draining")
        validate(request, self.text, self.engine.image_limits)
        matcher = self._matcher(request)
        tiles = sum(image.tiles for image in request.images)
        if request.images and tiles > self.engine.image_limits.pool_rows:
            raise Rejected(
                Code.RESOURCE_EXHAUSTED,
                f"the images' {tiles} tiles can never fit this server's image feature pool of "
                f"{self.engine.image_limits.pool_rows} rows",
            )
        needed = len(request.prompt_token_ids) + request.max_tokens
        if needed > self.engine.max_context:  # within the model's context (validated): past the cache's
            raise Rejected(
                Code.RESOURCE_EXHAUSTED,
                f"prompt + max_tokens needs {pages_for(needed)} pages; one sequence can hold at most "
                f"{self.engine.max_context} tokens in this server's cache",
            )
        # each image's placeholder run (start, length), found once: admission and the page keys read them
        runs = []
        if request.images:
            runs = placeholder_runs(request.prompt_token_ids, self.engine.image_limits.image_token_id)
        with self._lock:
            if request.id in self._ids:
                raise Rejected(Code.INVALID_ARGUMENT, f"request id {request.id!r} is already in flight")
            if len(self._waiting) + len(self._inbox) >= self.max_waiting:
                raise Rejected(Code.RESOURCE_EXHAUSTED, f"the queue is full ({self.max_waiting} waiting requests)")
            stop_ids = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else self.eos)
            sequence = _Sequence(
                request, on_delta, next(self._arrivals), stop_ids=stop_ids, matcher=matcher, image_runs=runs
            )
            self._ids[request.id] = sequence
            self._inbox.append(("submit", sequence))
            self._lock.notify()

    def prepare(self, request: Request) -> None:
        """Compile the request's constraint, if any (kept for its submission): what may take a second, on the
        caller's thread rather than in `submit`. Rejected when it does not compile."""
        self._matcher(request)

    def _matcher(self, request: Request) -> Matcher | None:
        """A matcher at the start of the request's constraint (None without one), its grammar compiled here, on
        the submitting thread, or found compiled; Rejected when it cannot be."""
        if request.constraint is None:
            return None
        if self._grammars is None:
            raise Rejected(Code.INVALID_ARGUMENT, "a constraint needs the checkpoint's tokenizer, and it has none")
        try:
            frame = self._grammars.frame(request.constraint, request.prompt_token_ids)
            return self._grammars.matcher(request.constraint, frame)
        except ConstraintError as error:
            raise Rejected(Code.INVALID_ARGUMENT, f"constraint: {error}") from None

    def cancel(self, request_id: str) -> None:
        """Stop a request (idempotent); its stream ends with finish_reason "abort"."""
        with self._lock:
            self._inbox.append(("cancel", request_id))
            self._lock.notify()

    def warm_up(self) -> None:
        """Compile every step shape (`Engine.widths`) and build the constraints' token tables; then accept
        requests."""
        start = time.perf_counter()
        self.engine.warm_up()
        logger.info("warm-up compiled and ran every step shape in %.1f s", time.perf_counter() - start)
        if self.engine.tokenizer is not None:
            start = time.perf_counter()
            self._grammars = Grammars(self.engine.tokenizer, self.text.unpadded_vocab_size, sorted(self.eos))
            self.engine.warm_up_resample()
            logger.info("structured outputs' token tables and programs built in %.1f s", time.perf_counter() - start)
        self.ready = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()

    def drain(self, timeout: float | None = None) -> None:
        """Refuse new requests and wait (up to `timeout` seconds) for the in-flight ones to finish."""
        self.draining = True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._ids:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._lock.wait(left)

    def stop(self) -> None:
        """End the loop; requests still in flight end with finish_reason "abort"."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    def stats(self) -> Stats:
        with self._lock:
            running = sum(s is not None for s in self._slots)
            free = sum(len(pool) for pool in self._free_pages)
            rows = self.engine.image_limits.pool_rows if self.engine.image_limits is not None else 0
            return Stats(
                waiting=len(self._waiting) + sum(kind == "submit" for kind, _ in self._inbox),
                running=running,
                pages_used=self.engine.num_pages - free,
                pages_total=self.engine.num_pages,
                preemptions=self._counters["preemptions"],
                generated_tokens=self._counters["generated"],
                prompt_tokens=self._counters["prompt"],
                speculative_rounds=self._counters["rounds"],
                speculative_tokens=self._counters["round_tokens"],
                image_rows_used=rows - len(self._free_rows),
                image_rows_total=rows,
                cached_tokens=self._counters["cached"],
                cached_pages=sum(len(index) for index in self._prefix or ()),
                evicted_pages=sum(index.evicted_pages for index in self._prefix or ()),
            )

    # --- the scheduler thread ---

    def _run(self) -> None:
        pending: _Plan | None = None
        while True:
            with self._lock:
                if self._stopping:
                    break
                if pending is None and not self._inbox and not self._ids:
                    self._lock.wait()
                    continue
                self._take_inbox()
            try:
                if pending is not None and self._rounds_wanted():
                    self._read(pending)  # a constrained round's masks follow the tokens and drafts before it
                    pending = None
                plan = self._plan()
                if plan is not None:
                    plan.emitted = self.engine.step(plan.batch, rounds=plan.rounds or None)
                    self._save_junctions(plan.junctions)
                if pending is not None:
                    self._read(pending)  # overlaps the step just dispatched
                if plan is not None and plan.deferred:
                    self._resample(plan)
                pending = plan
            except Exception as error:  # a device or host failure: fail what is in flight, keep serving
                logger.exception("step failed")
                self._fail_all(f"the engine step failed: {error}")
                pending = None
        self._fail_all(None)

    def _take_inbox(self) -> None:
        """Apply queued submissions and cancellations (called with the lock held)."""
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "submit":
                self._waiting.append(item)
            else:
                sequence = self._ids.get(item)
                if sequence is not None:
                    self._finish(sequence, "abort")

    def _plan(self) -> _Plan | None:
        """Admit, allocate pages (preempting if needed) and build the next step's batch."""
        self._admit()
        engine, budget = self.engine, self.prefill_budget
        capacity = min(engine.pages_per_replica, engine.max_pages)  # pages one sequence can hold
        room = [engine.max_num_batched_tokens] * engine.replicas  # each replica's tokens left in the step
        lanes = [engine.lanes] * engine.replicas  # and its prompt lanes
        pieces: dict[int, tuple[_Sequence, list[int], int, bool]] = {}  # slot -> (sequence, tokens, width, speculate)
        order = self._by_priority()
        rounds: dict[int, _Sequence] = {}  # the step's constrained rounds
        for slot in order:  # decoding first: the step always has room for every decoding slot's tokens
            sequence = self._slots[slot]
            request = sequence.request
            if sequence.decoding:
                wanted = request.max_tokens - len(sequence.outputs) - sequence.in_flight  # at least this many more
                if wanted > 0:
                    held = sequence.known + sequence.bound - 1  # the most the state holds once in-flight steps land
                    speculate = (
                        engine.speculative
                        and request.speculative
                        and wanted > 1
                        and pages_for(held + engine.gamma + 1) <= capacity
                        and (sequence.matcher is None or self._takes_round(sequence, rounds, slot))
                    )
                    if sequence.matcher is not None and not speculate:
                        sequence.drafts = None  # its kept round, if any, no longer follows its last token
                    piece = [] if sequence.in_flight else [sequence.token(sequence.known - 1)]  # else on device
                    span = engine.gamma + 1 if speculate else 1
                    pieces[slot] = (sequence, piece, span, speculate)
                    room[engine.replica_of(slot)] -= span
        for slot in order:
            sequence, replica = self._slots[slot], engine.replica_of(slot)
            if not sequence.decoding and sequence.fed < sequence.known and budget > 0:  # the prompt, or outputs again
                boundary = len(sequence.prompt) if sequence.fed < len(sequence.prompt) else sequence.known
                most = min(engine.chunk, budget, room[replica], lanes[replica] * engine.lane_width)
                end = min(boundary, sequence.fed + most)
                # the state lands where the cache saves it: its junction, and the last page boundary before the end
                cuts = (sequence.junction, boundary // PAGE_SIZE * PAGE_SIZE) if self._prefix is not None else ()
                end = min([end, *(cut for cut in cuts if cut > sequence.fed)])
                if end <= sequence.fed:
                    continue
                piece = [sequence.token(p) for p in range(sequence.fed, end)]
                pieces[slot] = (sequence, piece, len(piece), False)
                budget -= len(piece)
                room[replica] -= len(piece)
                lanes[replica] -= -(-len(piece) // engine.lane_width)
        for slot, (sequence, _, span, _) in list(pieces.items()):
            if self._slots[slot] is sequence:
                start = sequence.known + sequence.bound - 1 if sequence.decoding else sequence.fed
                self._grow(sequence, start + span)
        pieces = {slot: piece for slot, piece in pieces.items() if self._slots[slot] is piece[0]}  # not preempted
        rounds = {slot: sequence for slot, sequence in rounds.items() if slot in pieces}
        if not pieces:
            return None
        slots = engine.slots
        tokens = np.zeros((slots, max(len(piece) for _, piece, *_ in pieces.values()) or 1), np.int32)
        image_rows = np.full(tokens.shape, -1, np.int32)
        counts = np.zeros(slots, np.int32)
        reset, is_prompt, emit, feedback, replay, speculate, defer = (np.zeros(slots, bool) for _ in range(7))
        table = np.zeros((slots, engine.max_pages), np.int32)
        sampling = [None] * slots
        kept: dict[int, _Sequence] = {}
        bounds: dict[int, int] = {}
        junctions: list[_Sequence] = []
        for slot, (sequence, piece, span, speculating) in pieces.items():
            tokens[slot, : len(piece)] = piece
            table[slot, : len(sequence.pages)] = sequence.pages
            sampling[slot] = sequence.request
            if sequence.decoding:
                counts[slot], feedback[slot], speculate[slot] = 1, not piece, speculating
            else:
                counts[slot], reset[slot] = len(piece), sequence.fed == 0
                is_prompt[slot] = sequence.fed < len(sequence.prompt)
                if is_prompt[slot] and sequence.prompt_rows is not None:
                    image_rows[slot, : len(piece)] = sequence.prompt_rows[sequence.fed : sequence.fed + len(piece)]
                replay[slot] = not is_prompt[slot] and sequence.fed < sequence.replay_until
                sequence.fed += len(piece)
                if sequence.fed % PAGE_SIZE == 0:
                    sequence.landed = sequence.fed
                if sequence.fed == sequence.junction:
                    junctions.append(sequence)
                sequence.decoding = sequence.fed == sequence.known  # caught up: the sample is its next token
            if sequence.decoding:
                emit[slot] = True
                kept[slot], bounds[slot] = sequence, span if speculating else 1
                sequence.in_flight += 1
                sequence.bound += bounds[slot]
        deferred = [slot for slot, sequence in kept.items() if sequence.matcher is not None and slot not in rounds]
        defer[deferred] = True  # constrained slots sample after the step (`_resample`), under masks computed meanwhile
        batch = engine.host_batch(
            tokens,
            counts,
            sampling,
            table,
            reset=reset,
            is_prompt=is_prompt,
            emit=emit,
            feedback=feedback,
            replay=replay,
            speculate=speculate,
            defer=defer,
            image_rows=image_rows if (image_rows >= 0).any() else None,
        )
        return _Plan(batch, kept, bounds, deferred, self._round_masks(rounds), junctions)

    def _rounds_wanted(self) -> bool:
        """Whether a constrained sequence may run a speculative round: the loop then reads each step before it plans
        the next, as a round's masks follow the tokens and drafts of the step before."""
        return self.engine.speculative and any(
            s is not None and s.decoding and s.matcher is not None and s.request.speculative for s in self._slots
        )

    def _takes_round(self, sequence: _Sequence, rounds: dict[int, _Sequence], slot: int) -> bool:
        """Whether a constrained sequence runs this step as a speculative round (its last step read, and a row of
        its replica's ROUND_ROWS free), recorded in `rounds`."""
        replica = self.engine.replica_of(slot)
        taken = sum(self.engine.replica_of(other) == replica for other in rounds)
        if sequence.in_flight or taken >= ROUND_ROWS:
            return False
        rounds[slot] = sequence
        return True

    def _round_masks(self, rounds: dict[int, _Sequence]) -> dict[int, tuple[int, bool, np.ndarray]]:
        """Each constrained round's (row, kept, masks [γ + 1, words]): the row that keeps its drafts (a sequence with
        drafts kept keeps its row, the others take free ones), whether it verifies kept drafts, and the masks after
        its last token and along those drafts (a first round verifies none: one mask)."""
        if not rounds:
            return {}
        taken = {  # the rows that keep some sequence's drafts
            (self.engine.replica_of(s.slot), s.round_row) for s in self._slots if s is not None and s.drafts is not None
        }
        for slot, sequence in rounds.items():
            if sequence.drafts is None:
                replica = self.engine.replica_of(slot)
                sequence.round_row = next(row for row in range(ROUND_ROWS) if (replica, row) not in taken)
                taken.add((replica, sequence.round_row))
        width = self.engine.gamma + 1
        allowed = np.full((len(rounds) * width, self.engine.mask_words), -1, np.int32)
        along = {
            index * width: (sequence.matcher, sequence.drafts or []) for index, sequence in enumerate(rounds.values())
        }
        self._grammars.fill_along(allowed, along)
        masks = allowed.reshape(len(rounds), width, -1)
        return {
            slot: (sequence.round_row, sequence.drafts is not None, masks[index])
            for index, (slot, sequence) in enumerate(rounds.items())
        }

    def _resample(self, plan: _Plan) -> None:
        """Draw the constrained samples of a dispatched step under their masks, now that the matchers have read
        the tokens before (a sequence that stopped meanwhile keeps its unconstrained sample: it is dropped)."""
        live = [slot for slot in plan.deferred if not plan.sequences[slot].finished]
        if not live:
            return
        allowed = np.empty((len(live), self.engine.mask_words), np.int32)
        self._grammars.fill(allowed, {row: plan.sequences[slot].matcher for row, slot in enumerate(live)})
        plan.emitted = self.engine.resample(plan.emitted, plan.batch, live, allowed)

    def _by_priority(self) -> list[int]:
        """Occupied slots, earliest admitted first."""
        occupied = [s for s in range(self.engine.slots) if self._slots[s] is not None]
        return sorted(occupied, key=lambda s: self._slots[s].arrival)

    def _admit(self) -> None:
        """Fill free slots from the waiting queue, first come first served, while the head's known tokens
        (and one more) fit in its replica's free pages."""
        self._waiting.sort(key=lambda s: s.arrival)
        for slot in range(self.engine.slots):
            if not self._waiting:
                return
            head = self._waiting[0]
            if head.in_flight:  # preempted with a token still to read: re-admit once it is read
                return
            replica = self.engine.replica_of(slot)
            pool = self._free_pages[replica]
            if self._slots[slot] is not None:
                continue
            keys, hit = self._cached(head, replica)
            unencoded = self._unencoded(head, hit.tokens)
            if sum(length for _, (_, length) in unencoded) > len(self._free_rows):
                return  # its images wait for feature rows
            free = len(pool) + (self._prefix[replica].evictable - len(hit.pages) if self._prefix else 0)
            if pages_for(head.known + 1) - len(hit.pages) <= free:
                self._waiting.pop(0)
                self._encode_images(head, unencoded)
                if head.replay_until == 0:  # first admission
                    self._counters["prompt"] += len(head.prompt)
                    head.cached = min(hit.tokens, len(head.prompt))
                    self._counters["cached"] += head.cached
                head.slot, head.fed, head.replay_until, head.drafts, head.landed = slot, 0, head.known, None, 0
                head.junction = hit.run * PAGE_SIZE if hit.run > len(hit.pages) else 0
                self._slots[slot] = head
                if hit.pages:
                    self._resume(head, keys[: len(hit.pages)], hit)

    def _unencoded(self, sequence: _Sequence, resume: int) -> list[tuple[RequestImage, tuple[int, int]]]:
        """The sequence's images not encoded yet with a placeholder at or after `resume`, where its computation
        starts (those wholly before it, in cached pages, are never read), each with its run (start, length)."""
        rows = sequence.prompt_rows
        return [
            (image, (start, length))
            for image, (start, length) in zip(sequence.request.images, sequence.image_runs, strict=True)
            if start + length > resume and (rows is None or rows[start] < 0)
        ]

    def _encode_images(self, sequence: _Sequence, images: list[tuple[RequestImage, tuple[int, int]]]) -> None:
        """Give these images of a sequence (`_unencoded`) rows of the image-feature pool and dispatch their encoding
        into them."""
        if sequence.prompt_rows is None and sequence.request.images:
            sequence.prompt_rows = np.full(len(sequence.prompt), -1, np.int32)
        for image, (start, length) in images:
            rows = np.asarray(self._free_rows[-length:], np.int32)
            del self._free_rows[-length:]
            sequence.prompt_rows[start : start + length] = rows
            self.engine.encode(image, rows)

    def _grow(self, sequence: _Sequence, tokens: int) -> None:
        """Give `sequence` pages for `tokens` tokens, preempting the latest-admitted sequences of its
        replica (last of all, itself) while the pool is empty."""
        replica = self.engine.replica_of(sequence.slot)
        pool = self._free_pages[replica]
        while sequence.slot is not None and len(sequence.pages) < pages_for(tokens):
            if not pool and self._prefix is not None:
                pool.extend(self._prefix[replica].evict(pages_for(tokens) - len(sequence.pages)))
            if pool:
                sequence.pages.append(pool.pop())
            else:
                self._preempt(self._latest_in_replica(replica))

    def _latest_in_replica(self, replica: int) -> _Sequence:
        running = [s for s in self._slots if s is not None and self.engine.replica_of(s.slot) == replica]
        return max(running, key=lambda s: s.arrival)

    def _preempt(self, sequence: _Sequence) -> None:
        self._publish(sequence)
        self._release(sequence)
        sequence.fed, sequence.decoding, sequence.drafts = 0, False, None
        self._waiting.append(sequence)
        self._counters["preemptions"] += 1
        logger.info("preempted %s (%d tokens) to free pages", sequence.request.id, sequence.known)

    def _cached(self, sequence: _Sequence, replica: int) -> tuple[list[bytes], Hit]:
        """The page keys of what the sequence holds (all but its last token: a step must feed one) and the
        prefix cache's longest hit among them."""
        if self._prefix is None:
            return [], Hit((), None)
        keys = self._keys(sequence, (sequence.known - 1) // PAGE_SIZE)
        return keys, self._prefix[replica].longest(keys)

    def _keys(self, sequence: _Sequence, pages: int) -> list[bytes]:
        """The keys of the sequence's first `pages` pages (kept: its tokens only grow)."""
        if len(sequence.keys) < pages:
            tokens, images = sequence.prompt + tuple(sequence.outputs), []
            if sequence.request.images:
                images = [
                    (*run, image_digest(image))
                    for run, image in zip(sequence.image_runs, sequence.request.images, strict=True)
                ]
            sequence.keys = page_keys(tokens, pages, images)
        return sequence.keys[:pages]

    def _resume(self, sequence: _Sequence, keys: list[bytes], hit: Hit) -> None:
        """Start an admitted sequence after its cached pages: read them, and restore the snapshot at their end."""
        index = self._prefix[self.engine.replica_of(sequence.slot)]
        sequence.pages, sequence.shared = index.acquire(keys), keys
        sequence.fed = sequence.landed = hit.tokens
        vocab = self.text.unpadded_vocab_size
        prompt_mask = np.zeros(vocab, bool)
        prompt_mask[list(sequence.prompt[: hit.tokens])] = True
        outputs = sequence.outputs[: max(0, hit.tokens - len(sequence.prompt))]
        counts = np.bincount(np.asarray(outputs, np.int64), minlength=vocab)[:vocab].astype(np.int32)
        self.engine.restore_snapshot(sequence.slot, hit.snapshot, hit.tokens, prompt_mask, counts)

    def _evicted(self, replica: int, keys: list[bytes]) -> None:
        self.kv_events.record(replica, [Removed(tuple(block_hash(key) for key in keys))])

    def _save_junctions(self, sequences: list[_Sequence]) -> None:
        """Save the state of each sequence the step just dispatched lands on its junction: the next sequence along
        the cached chain resumes there. Dispatched after the step, before any other: its window and the boundary's
        convolution states are still those of the junction."""
        for sequence in sequences:
            index = self._prefix[self.engine.replica_of(sequence.slot)]
            boundary, sequence.junction = sequence.junction, 0
            key = sequence.keys[boundary // PAGE_SIZE - 1]
            snapshot = index.save_snapshot(key) if key in index else None  # its page may have gone meanwhile
            if snapshot is not None:
                self.engine.save_snapshot(sequence.slot, snapshot, boundary)

    def _publish(self, sequence: _Sequence) -> None:
        """Hand the full pages of a sequence leaving its slot to the prefix cache, with a snapshot at the last page
        boundary it landed on; its cached pages stay with the cache, the rest `_release` frees."""
        if self._prefix is None or sequence.slot is None:
            return
        replica = self.engine.replica_of(sequence.slot)
        index = self._prefix[replica]
        held = sequence.known - 1 if sequence.decoding else sequence.fed  # tokens its steps wrote and kept
        full = min(held // PAGE_SIZE, len(sequence.pages))
        keys = self._keys(sequence, full)
        stored = [
            Stored(block_hash(key), block_hash(keys[page - 1]) if page else None, sequence.tokens(page))
            for page, key in enumerate(keys)
            if key not in index
        ]
        duplicates = index.publish(keys, sequence.pages[:full])
        self.kv_events.record(replica, stored)
        boundary = sequence.landed if PAGE_SIZE <= sequence.landed <= full * PAGE_SIZE else 0
        if boundary:
            snapshot = index.save_snapshot(keys[boundary // PAGE_SIZE - 1])
            if snapshot is not None:
                self.engine.save_snapshot(sequence.slot, snapshot, boundary)
        index.release(sequence.shared)
        self._free_pages[self.engine.replica_of(sequence.slot)].extend(duplicates)
        sequence.pages, sequence.shared = sequence.pages[full:], []

    def _release(self, sequence: _Sequence) -> None:
        """Free the sequence's slot and pages."""
        if sequence.slot is not None:
            self._free_pages[self.engine.replica_of(sequence.slot)].extend(sequence.pages)
            self._slots[sequence.slot] = None
        sequence.slot, sequence.pages = None, []

    def _read(self, plan: _Plan) -> None:
        """Read a step's tokens and hand each sequence's to its stream, finishing sequences that stop."""
        emitted = self.engine.fetch(plan.emitted)
        for slot, sequence in plan.sequences.items():
            sequence.in_flight -= 1
            sequence.bound -= plan.bounds[slot]
            if sequence.finished:
                continue  # stopped while this step was in flight
            count = int(emitted.count[slot])
            if slot in plan.rounds and sequence.slot == slot:
                sequence.drafts = emitted.drafts[slot].tolist()  # its next round's, after what it emits now
            if plan.batch.speculate[slot]:
                sequence.rounds += 1
                sequence.round_tokens += count
                self._counters["rounds"] += 1
                self._counters["round_tokens"] += count
            request = sequence.request
            reason, taken, refused = None, 0, None
            for token in emitted.tokens[slot, :count].tolist():
                if sequence.matcher is not None and not sequence.matcher.accept([token]):
                    refused = token  # sampled under its mask, so never: a fault, not a wrong answer
                    break
                sequence.outputs.append(token)
                taken += 1
                if token in sequence.stop_ids:
                    reason = "stop"
                elif len(sequence.outputs) >= request.max_tokens:
                    reason = "length"
                if reason is not None:
                    break
            self._counters["generated"] += taken
            logprobs, top = (), ()
            if request.logprobs is not None:
                n = request.logprobs
                logprobs = tuple(float(x) for x in emitted.logprobs[slot, :taken])
                top = tuple(
                    tuple(TopLogprob(int(i), float(p)) for i, p in zip(ids[:n], values[:n], strict=True))
                    for ids, values in zip(
                        emitted.top_ids[slot, :taken], emitted.top_logprobs[slot, :taken], strict=True
                    )
                )
            if sequence.decoding:  # every boundary a decoding sequence reaches it lands on (rounds end there)
                sequence.landed = max(sequence.landed, (sequence.known - 1) // PAGE_SIZE * PAGE_SIZE)
            delta = Delta(
                tuple(sequence.outputs[len(sequence.outputs) - taken :]),
                logprobs,
                top,
                reason,
                len(sequence.prompt),
                len(sequence.outputs),
                acceptance_length=sequence.acceptance_length,
                cached_tokens=sequence.cached,
            )
            if reason is not None:
                self._finish(sequence, reason, final=delta)
                continue
            self._deliver(sequence, delta)
            if refused is not None:
                self._finish(sequence, "error", error=f"the step sampled token {refused}, which the constraint refuses")

    def _finish(
        self,
        sequence: _Sequence,
        reason: str,
        *,
        final: Delta | None = None,
        error: str | None = None,
        publish: bool = True,
    ) -> None:
        """End a sequence; its pages go to the prefix cache when `publish` and it did not fail (a failed step may
        have left the device state unusable). Its last delta (`final`, or an empty one) is delivered after its id
        leaves the in-flight set, so a client may reuse the id as soon as it sees the finish."""
        sequence.finished = True
        if sequence in self._waiting:
            self._waiting.remove(sequence)
        if publish and error is None:
            self._publish(sequence)
        self._release(sequence)
        if sequence.prompt_rows is not None:  # its image features' rows
            self._free_rows.extend(sequence.prompt_rows[sequence.prompt_rows >= 0].tolist())
            sequence.prompt_rows = None
        with self._lock:
            self._ids.pop(sequence.request.id, None)
            self._lock.notify_all()
        if final is None:
            final = Delta(
                (),
                (),
                (),
                reason,
                len(sequence.prompt),
                len(sequence.outputs),
                error,
                sequence.acceptance_length,
                sequence.cached,
            )
        self._deliver(sequence, final)

    def _deliver(self, sequence: _Sequence, delta: Delta) -> None:
        try:
            sequence.on_delta(delta)
        except Exception:  # a consumer's failure must not stop the loop
            logger.exception("stream of %s failed", sequence.request.id)

    def _fail_all(self, error: str | None) -> None:
        for sequence in list(self._ids.values()):  # a failed step or the scheduler's end: nothing more runs
            self._finish(sequence, "error" if error else "abort", error=error, publish=False)
