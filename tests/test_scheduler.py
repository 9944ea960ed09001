"""The continuous-batching scheduler on the tiny parity model: concurrent requests equal the offline
engine's outputs, preempted sequences resume exactly, cancelled ones free their slots and pages."""

import threading
from pathlib import Path

import numpy as np
import pytest

from inkling_jax import engine as core
from inkling_jax.cache import CacheLayout
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.generate import Request, generate
from inkling_jax.sharding import make_mesh
from serving.engine import Engine
from serving.requests import MAX_LOGPROBS, Code, EngineRequest, Options, Rejected
from serving.scheduler import Scheduler

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "parity" / "tiny_text" / "hf"
CHUNK = 8


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(FIXTURE, np.float32)[1]


def make_engine(model, slots: int, pages: int) -> Engine:
    layout = CacheLayout(slots, pages, 32, CHUNK)  # 32 pages of 128 tokens: the model's whole context
    engine = core.Engine(model, layout, make_mesh("tp1", model.config), num_top=MAX_LOGPROBS)
    return Engine(engine, None, str(FIXTURE), "tp1", "float32")


@pytest.fixture(scope="module")
def two_slots(model) -> Engine:
    """Two slots sharing 3 pages, compiled once for the tests that need few pages (each runs its own scheduler:
    admission resets a slot's state)."""
    return make_engine(model, slots=2, pages=3)


def make_scheduler(engine: Engine, **kwargs) -> Scheduler:
    scheduler = Scheduler(engine, **kwargs)
    scheduler.warm_up()
    scheduler.start()
    return scheduler


class Collector:
    """Streams of many requests: tokens and deltas per id, and an event when all have finished."""

    def __init__(self, count: int):
        self.tokens: dict[str, list[int]] = {}
        self.deltas: dict[str, list] = {}
        self.left = count
        self.done = threading.Event()

    def sink(self, request_id: str):
        self.tokens[request_id], self.deltas[request_id] = [], []

        def on_delta(delta):
            self.tokens[request_id].extend(delta.token_ids)
            self.deltas[request_id].append(delta)
            if delta.finish_reason is not None:
                self.left -= 1
                if self.left == 0:
                    self.done.set()

        return on_delta


def random_requests(rng, count: int, prompt_range=(1, 20), max_tokens=(1, 12)) -> list[Request]:
    return [
        Request(f"r{i}", rng.integers(0, 500, int(rng.integers(*prompt_range))).tolist(),
                max_tokens=int(rng.integers(*max_tokens)), temperature=float(rng.choice([0.0, 0.7, 1.2])),
                top_k=int(rng.choice([0, 20])), top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(0, 2**31)))
        for i in range(count)
    ]  # fmt: skip


def engine_request(request: Request, **options) -> EngineRequest:
    fields = {name: getattr(request, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed")}
    return EngineRequest(request.id, tuple(request.prompt_token_ids), Options(**fields, **options))


def run(scheduler: Scheduler, requests: list[Request], **options) -> Collector:
    collector = Collector(len(requests))
    for request in requests:
        scheduler.submit(engine_request(request, **options), collector.sink(request.id))
    assert collector.done.wait(300)
    return collector


def test_concurrent_requests_equal_the_offline_engine(model):
    requests = random_requests(np.random.default_rng(0), 12)
    offline = generate(model, requests, max_num_seqs=3, chunk=CHUNK)
    scheduler = make_scheduler(make_engine(model, slots=4, pages=8), prefill_budget=10)
    compiled = scheduler.core.compilations
    try:
        collector = run(scheduler, requests, logprobs=3)
    finally:
        scheduler.stop()
    assert scheduler.core.compilations == compiled  # warm-up compiled every shape the workload used
    for request, result in zip(requests, offline, strict=True):
        assert collector.tokens[request.id] == result["token_ids"]
        deltas = collector.deltas[request.id]
        assert deltas[-1].finish_reason == result["finish_reason"]
        assert deltas[-1].completion_tokens == len(result["token_ids"])
        assert all(len(d.logprobs) == len(d.token_ids) and len(d.top_logprobs[0]) == 3 for d in deltas)
        for delta in deltas:  # the chosen token's logprob is at most the best one's
            assert delta.logprobs[0] <= delta.top_logprobs[0][0].logprob + 1e-6
    stats = scheduler.stats()
    assert (
        stats.pages_used == 0
        and stats.running == 0
        and stats.generated_tokens == sum(len(r["token_ids"]) for r in offline)
    )


def test_preempted_sequences_resume_exactly(two_slots):
    """Two slots share 3 pages: long sequences need 2 pages past position 128, so the later one is
    preempted, recomputed (prompt and outputs fed again, penalties and seeded stream intact) once pages
    free, and ends exactly as when it ran alone."""
    rng = np.random.default_rng(1)
    requests = random_requests(rng, 3, prompt_range=(100, 120), max_tokens=(40, 50))
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2}
    scheduler = make_scheduler(two_slots)
    try:
        alone = {r.id: run(scheduler, [r], **penalties).tokens[r.id] for r in requests}
        assert scheduler.stats().preemptions == 0
        together = run(scheduler, requests, **penalties)
        assert scheduler.stats().preemptions >= 1
    finally:
        scheduler.stop()
    assert together.tokens == alone


def test_cancelled_and_refused_requests(two_slots):
    rng = np.random.default_rng(2)
    scheduler = make_scheduler(two_slots)
    try:
        request = random_requests(rng, 1, max_tokens=(300, 301))[0]
        collector = Collector(1)
        scheduler.submit(engine_request(request), collector.sink(request.id))
        while not collector.tokens[request.id]:
            threading.Event().wait(0.01)
        scheduler.cancel(request.id)
        assert collector.done.wait(60)
        assert collector.deltas[request.id][-1].finish_reason == "abort"
        stats = scheduler.stats()
        assert (stats.running, stats.pages_used) == (0, 0)
        bad = {
            Code.INVALID_ARGUMENT: EngineRequest("a", (1, 700), Options()),
            Code.OUT_OF_RANGE: EngineRequest("b", (1, 2), Options(max_tokens=5000)),
            Code.RESOURCE_EXHAUSTED: EngineRequest("c", tuple(range(400)), Options(max_tokens=200)),  # > 3 pages
        }
        for code, bad_request in bad.items():
            with pytest.raises(Rejected) as refused:
                scheduler.submit(bad_request, lambda delta: None)
            assert refused.value.code is code
        scheduler.drain(timeout=10)
        with pytest.raises(Rejected, match="draining"):
            scheduler.submit(engine_request(request), lambda delta: None)
    finally:
        scheduler.stop()
