"""The continuous-batching scheduler on the tiny parity model: concurrent requests equal the same requests run
one at a time, preempted sequences resume exactly, cancelled ones free their slots and pages."""

import dataclasses
import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from model_configs import four_layers
from paths import TINY_CONFIG
from xla_flags import OPTIMIZED_STEPS

from inkling_jax.cache import CacheLayout
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.runtime.constraints import Constraint
from inkling_jax.runtime.engine import Engine
from inkling_jax.runtime.requests import MAX_LOGPROBS, Code, Rejected, Request
from inkling_jax.runtime.scheduler import Scheduler
from inkling_jax.sharding import make_mesh
from inkling_jax.tokenizer import Tokenizer
from pallas_kernels.devices import on_hopper

CHUNK = 8
DRAFT = {  # a DSpark draft of the four-layer model: γ = 3
    "num_hidden_layers": 1,
    "block_size": 3,
    "target_layer_ids": [1, 3],
    "mask_token_id": 5,
    "markov_rank": 6,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 24,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model in four layers (float32): what the scheduler runs, not how deep it is, is under test. Seed 2:
    weights whose constrained answers end (the grammar's end, then the end of sequence) within the tests' budgets."""
    folder = tmp_path_factory.mktemp("scheduler")
    config = four_layers(TINY_CONFIG, folder / "config.json")
    return load_causal_lm(write_checkpoint(config, folder / "checkpoint", experts="fp32", seed=2), np.float32)[1]


def make_engine(model, slots: int, pages: int, speculative: str = "none") -> Engine:
    """Its tests run hundreds of steps: compiled with LLVM's optimisations."""
    layout = CacheLayout(slots, pages, 32, CHUNK)  # 32 pages of 128 tokens: the model's whole context
    mesh = make_mesh("tp1", model.config)
    tokenizer = Tokenizer(build_tokenizer(model.config))
    return Engine(
        model,
        layout,
        mesh,
        MAX_LOGPROBS,
        speculative,
        compiler_options=OPTIMIZED_STEPS,
        tokenizer=tokenizer,
        checkpoint="tiny, four layers",
    )


@pytest.fixture(scope="module")
def two_slots(model) -> Engine:
    """Two slots sharing 3 pages, compiled once for the file's one-device float32 tests (each runs its own
    scheduler: admission resets a slot's state)."""
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
        Request(
            f"r{i}",
            rng.integers(0, 500, int(rng.integers(*prompt_range))).tolist(),
            max_tokens=int(rng.integers(*max_tokens)),
            temperature=float(rng.choice([0.0, 0.7, 1.2])),
            top_k=int(rng.choice([0, 20])),
            top_p=float(rng.choice([1.0, 0.9])),
            seed=int(rng.integers(0, 2**31)),
        )
        for i in range(count)
    ]


def run(scheduler: Scheduler, requests: list[Request], **options) -> Collector:
    collector = Collector(len(requests))
    for request in requests:
        scheduler.submit(dataclasses.replace(request, **options), collector.sink(request.id))
    assert collector.done.wait(300)
    return collector


def alone_then_together(engine: Engine, requests: list[Request]) -> tuple[dict[str, list], Collector]:
    """Each request run alone, then all at once with a preemption at least: (each one's deltas alone, the run)."""
    scheduler = make_scheduler(engine)
    try:
        alone = {r.id: run(scheduler, [r]).deltas[r.id] for r in requests}
        together = run(scheduler, requests)
        assert scheduler.stats().preemptions >= 1
    finally:
        scheduler.stop()
    return alone, together


@pytest.mark.slow
def test_concurrent_requests_equal_running_alone(two_slots):
    """Twelve queued requests (each within a page) through both slots, prompt pieces of at most 10 tokens a step:
    each one's deltas are those it gets alone, and warm-up compiled every shape the workload used."""
    requests = random_requests(np.random.default_rng(0), 12)
    scheduler = make_scheduler(two_slots, prefill_budget=10)
    compiled = scheduler.engine.compilations
    try:
        alone = {r.id: run(scheduler, [r]).deltas[r.id] for r in requests}
        collector = run(scheduler, requests, logprobs=3)
    finally:
        scheduler.stop()
    assert scheduler.engine.compilations == compiled  # warm-up compiled every shape the workload used
    for request in requests:
        tokens = [t for delta in alone[request.id] for t in delta.token_ids]
        assert collector.tokens[request.id] == tokens
        deltas = collector.deltas[request.id]
        assert deltas[-1].finish_reason == alone[request.id][-1].finish_reason
        assert deltas[-1].completion_tokens == len(tokens)
        assert all(len(d.logprobs) == len(d.token_ids) and len(d.top_logprobs[0]) == 3 for d in deltas)
        for delta in deltas:  # the chosen token's logprob is at most the best one's
            assert delta.logprobs[0] <= delta.top_logprobs[0][0].logprob + 1e-6
            top = [t.logprob for t in delta.top_logprobs[0]]  # a distribution's best three, in order
            assert top == sorted(top, reverse=True) and sum(np.exp(top)) <= 1 + 1e-5
    stats = scheduler.stats()
    assert (
        stats.pages_used == 0
        and stats.running == 0
        and stats.generated_tokens == 2 * sum(len(tokens) for tokens in collector.tokens.values())
    )


@pytest.mark.slow
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


@pytest.mark.slow
def test_cancelled_and_refused_requests(two_slots):
    rng = np.random.default_rng(2)
    scheduler = make_scheduler(two_slots)
    try:
        request = random_requests(rng, 1, max_tokens=(300, 301))[0]
        collector = Collector(1)
        scheduler.submit(request, collector.sink(request.id))
        while not collector.tokens[request.id]:
            threading.Event().wait(0.01)
        scheduler.cancel(request.id)
        assert collector.done.wait(60)
        assert collector.deltas[request.id][-1].finish_reason == "abort"
        stats = scheduler.stats()
        assert (stats.running, stats.pages_used) == (0, 0)
        short = dataclasses.replace(request, max_tokens=3)
        again, reused = Collector(1), []

        def reuse_at_finish(delta):  # a client that sends the same id again as soon as it sees the finish
            if delta.finish_reason is not None:
                scheduler.submit(short, again.sink(short.id))
                reused.append(delta.finish_reason)

        scheduler.submit(short, reuse_at_finish)
        assert again.done.wait(60) and reused == ["length"]
        assert len(again.tokens[short.id]) == 3
        bad = {
            Code.INVALID_ARGUMENT: Request("a", (1, 700)),
            Code.OUT_OF_RANGE: Request("b", (1, 2), max_tokens=5000),
            Code.RESOURCE_EXHAUSTED: Request("c", tuple(range(400)), max_tokens=200),  # > 3 pages
        }
        for code, bad_request in bad.items():
            with pytest.raises(Rejected) as refused:
                scheduler.submit(bad_request, lambda delta: None)
            assert refused.value.code is code
        scheduler.drain(timeout=10)
        with pytest.raises(Rejected, match="draining"):
            scheduler.submit(request, lambda delta: None)
    finally:
        scheduler.stop()


@pytest.mark.slow
def test_a_constrained_slot_samples_its_allowed_tokens_and_leaves_its_neighbour_alone(two_slots):
    """engine.step's allowed-token masks: the constrained slot's greedy token is its best allowed one under the raw
    log-probabilities the step reports, and the unconstrained slot beside it emits what it emits with no mask."""
    engine, rng = two_slots, np.random.default_rng(4)
    vocab, words = engine.text.unpadded_vocab_size, engine.mask_words
    prompts = rng.integers(0, vocab, (2, 6), dtype=np.int32)
    table = np.zeros((2, engine.max_pages), np.int32)
    table[1] = 1
    asks = SimpleNamespace(logprobs=3)  # greedy, with the top log-probabilities

    def decode(masks: list[np.ndarray | None]) -> list:
        outputs, tokens, counts = [], prompts, np.full(2, prompts.shape[1], np.int32)
        emit = np.ones(2, bool)
        for number, allowed in enumerate(masks):
            first = np.full(2, number == 0)
            batch = engine.host_batch(tokens, counts, [asks, asks], table, reset=first, is_prompt=first, emit=emit)
            outputs.append(engine.fetch(engine.step(batch, allowed)))
            tokens, counts = outputs[-1].tokens[:, :1], np.ones(2, np.int32)
        return outputs

    keeps = [rng.random(vocab) < 0.1 for _ in range(5)]
    masks = []
    for keep in keeps:
        bits = np.zeros((2, words * 32), bool)
        bits[0, :vocab], bits[1] = keep, True
        masks.append((bits.reshape(2, words, 32) * (1 << np.arange(32, dtype=np.uint64))).sum(-1).astype(np.uint32))
    constrained = decode([mask.view(np.int32) for mask in masks])
    free = decode([None] * len(masks))
    for keep, out, alone in zip(keeps, constrained, free, strict=True):
        token = int(out.tokens[0, 0])
        assert keep[token]
        listed = [t for t in out.top_ids[0, 0].tolist() if keep[t]]  # the raw top log-probabilities' allowed ids
        assert token == listed[0] if listed else token not in out.top_ids[0, 0]
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(out, name)[1], getattr(alone, name)[1])


@pytest.mark.slow
def test_a_deferred_sample_drawn_under_its_mask_is_the_masked_steps(two_slots):
    """A step that defers a slot's sample (sampled unconstrained, whatever its row of the masks), then `Engine.resample`
    with the slot's mask, emits and leaves what the step given the mask does: the same tokens, top lists, penalty counts
    and next inputs (the chosen tokens' log-probabilities, computed in another program, to fp32 rounding), over steps
    that feed back on device (slot 0 seeded at temperature 0.9 with penalties, slot 1 greedy beside it)."""
    engine, rng = two_slots, np.random.default_rng(11)
    vocab, words = engine.text.unpadded_vocab_size, engine.mask_words
    engine.warm_up_resample()
    prompts = rng.integers(0, vocab, (2, 7), dtype=np.int32)
    table = np.zeros((2, engine.max_pages), np.int32)
    table[1] = 1
    sampled = SimpleNamespace(
        temperature=0.9, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4, seed=77, logprobs=3
    )
    masks = []
    for _ in range(6):
        bits = rng.random((2, words * 32)) < 0.2
        bits[:, vocab:] = False
        masks.append((bits.reshape(2, words, 32) * (1 << np.arange(32, dtype=np.uint64))).sum(-1).astype(np.uint32))

    def decode(deferring: bool) -> tuple[list, np.ndarray]:
        outputs, tokens, counts = [], prompts, np.full(2, prompts.shape[1], np.int32)
        for number, mask in enumerate(masks):
            first = np.full(2, number == 0)
            batch = engine.host_batch(
                tokens,
                counts,
                [sampled, None],
                table,
                reset=first,
                is_prompt=first,
                emit=np.ones(2, bool),
                feedback=~first,
                defer=np.asarray([deferring, False]),
            )
            allowed = mask.view(np.int32).copy()
            if deferring:
                emitted = engine.step(batch, allowed)
                emitted = engine.resample(emitted, batch, [0], mask.view(np.int32)[:1].copy())
            else:
                emitted = engine.step(batch, allowed)
            outputs.append(engine.fetch(emitted))
            tokens, counts = np.zeros((2, 1), np.int32), np.ones(2, np.int32)  # fed back on device
        return outputs, np.asarray(engine.state.output_counts)

    (masked, counts), (deferred, deferred_counts) = decode(False), decode(True)
    np.testing.assert_array_equal(counts, deferred_counts)
    for out, late, mask in zip(masked, deferred, masks, strict=True):
        assert all(mask[s, t // 32] >> (t % 32) & 1 for s, t in enumerate(out.tokens[:, 0].tolist()))
        for name in ("tokens", "count", "top_ids", "top_logprobs", "last"):
            np.testing.assert_array_equal(getattr(out, name), getattr(late, name))
        np.testing.assert_allclose(out.logprobs, late.logprobs, rtol=1e-6)
    assert len({int(out.tokens[0, 0]) for out in masked}) > 1


@pytest.mark.slow
def test_constrained_requests_match_and_resume_exactly(two_slots):
    """Constrained requests (a JSON schema with nesting, enums, bounds, a pattern and array sizes; a regex; a choice)
    on the random-weight model end in text that matches (or at max_tokens, in the match's first tokens), and give the
    same tokens alone as beside each other and an unconstrained request, preempted and recomputed (3 pages for two
    slots of 100-token prompts)."""
    rng, tokenizer = np.random.default_rng(6), two_slots.tokenizer
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "level": {"type": "integer", "minimum": -5, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
            "where": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        },
        "required": ["name", "level", "tags", "where"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    pattern, choices = r"[a-f]{3,8}( [0-9]{2}){1,3}", ("alpha", "beta", "gamma delta")
    constraints = [
        Constraint("json_schema", json.dumps(schema)),
        Constraint("regex", pattern),
        Constraint("choice", choices),
        Constraint("json_schema", json.dumps(schema)),
    ]
    requests = (
        [  # prompts of plain tokens (one ending in a framing token would frame the answer)
            dataclasses.replace(
                request, prompt_token_ids=(*request.prompt_token_ids[:-1], 65), max_tokens=120, constraint=constraint
            )
            for request, constraint in zip(random_requests(rng, 4, prompt_range=(100, 120)), constraints, strict=True)
        ]
        + [dataclasses.replace(random_requests(rng, 1, prompt_range=(100, 120), max_tokens=(40, 50))[0], id="free")]
    )
    short = dataclasses.replace(requests[0], id="short", max_tokens=4)  # cut by max_tokens mid-answer
    alone, together = alone_then_together(two_slots, [*requests, short])
    for request in [*requests, short]:
        tokens = [t for delta in alone[request.id] for t in delta.token_ids]
        assert together.tokens[request.id] == tokens
        if request.constraint is None or request is short:
            continue
        assert alone[request.id][-1].finish_reason == "stop" and tokens[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(tokens[:-1])
        if request.constraint.kind == "regex":
            assert re.fullmatch(pattern, text), text
        elif request.constraint.kind == "choice":
            assert text in choices
        else:
            value = json.loads(text)
            assert set(value) == {"name", "level", "tags", "where"} and re.fullmatch("[a-z]{1,6}", value["name"])
            assert type(value["level"]) is int and -5 <= value["level"] <= 120
            assert 1 <= len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
            assert isinstance(value["where"], dict) and type(value["where"]["ok"]) is bool
    assert alone["short"][-1].finish_reason == "length"
    assert together.tokens["short"] == together.tokens[requests[0].id][:4]


def assert_matches(tokenizer, constraint: Constraint, tokens: list[int]) -> None:
    """The text of `tokens` (ending in the end of sequence) matches the regex or is one of the choices."""
    assert tokens[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(tokens[:-1])
    assert re.fullmatch(constraint.spec, text) if constraint.kind == "regex" else text in constraint.spec, text


@pytest.mark.slow
def test_constrained_requests_speculate_exactly(tmp_path_factory, two_slots):
    """On an engine that speculates, constrained requests run DSpark rounds verified under each position's mask:
    greedy ones stream what plain constrained greedy decoding streams (the engine without a draft), through
    preemptions; seeded sampled ones give text that matches; an unconstrained one beside them that opts out is
    unchanged."""
    folder = tmp_path_factory.mktemp("drafted")
    config = four_layers(TINY_CONFIG, folder / "config.json")
    path = write_checkpoint(config, folder / "checkpoint", experts="fp32", seed=2, draft=DRAFT)
    drafted = make_engine(load_causal_lm(path, np.float32)[1], slots=2, pages=3, speculative="dspark")
    rng = np.random.default_rng(8)
    long, short = Constraint("regex", r"[a-f]{40,50}( [0-9]{2}){1,3}"), Constraint("choice", ("alpha", "gamma delta"))
    # the two long greedy answers first: admitted together, both outgrow their first page, and the later one is
    # preempted (3 pages) with its round's drafts kept; then sampled ones, and one that opts out of speculation
    requests = [
        dataclasses.replace(
            request,
            id=f"c{index}",
            prompt_token_ids=(*request.prompt_token_ids[:-1], 65),
            max_tokens=80,
            temperature=0.0 if index < 2 else 0.8,
            constraint=(long, long, short, long)[index],
        )
        for index, request in enumerate(random_requests(rng, 4, prompt_range=(100, 110)))
    ]
    free = random_requests(rng, 1, prompt_range=(100, 110), max_tokens=(30, 40))[0]
    requests.append(dataclasses.replace(free, speculative=False))  # the noise of plain decoding, speculating or not
    plain = run_all(two_slots, requests)
    scheduler = Scheduler(drafted)
    scheduler.warm_up()
    speculated = Collector(len(requests))
    for request in requests:  # all queued before the loop starts: the same admissions and preemptions every run
        scheduler.submit(request, speculated.sink(request.id))
    scheduler.start()
    try:
        assert speculated.done.wait(300)
        stats = scheduler.stats()
    finally:
        scheduler.stop()
    assert stats.preemptions >= 1 and stats.speculative_rounds > 0
    for request in requests:
        got = speculated.tokens[request.id]
        if request.constraint is None or request.temperature == 0:
            assert got == plain[request.id], request.id
        if request.constraint is not None:
            assert speculated.deltas[request.id][-1].finish_reason == "stop"
            assert_matches(drafted.tokenizer, request.constraint, got)


def run_all(engine: Engine, requests: list[Request]) -> dict[str, list[int]]:
    scheduler = make_scheduler(engine)
    try:
        return run(scheduler, requests).tokens
    finally:
        scheduler.stop()


@pytest.mark.slow
def test_64_constrained_and_unconstrained_streams_at_once(two_slots):
    """Half of 64 queued requests constrained (choices, regexes, JSON schemas, greedy and seeded): each constrained
    one ends in a match, and the unconstrained ones give what they give without constrained neighbours."""
    rng, tokenizer = np.random.default_rng(9), two_slots.tokenizer
    constraints = [
        Constraint("choice", ("yes", "no", "not sure")),
        Constraint("regex", r"[0-9]{1,3}(\.[0-9])?"),
        Constraint(
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {"n": {"type": "integer", "maximum": 9}},
                    "required": ["n"],
                    "additionalProperties": False,
                    "x-guidance": {"whitespace_flexible": False},
                }
            ),
        ),
    ]
    requests = [
        dataclasses.replace(request, id=f"s{i}", prompt_token_ids=(*request.prompt_token_ids[:-1], 65))
        for i, request in enumerate(random_requests(rng, 64, prompt_range=(2, 30), max_tokens=(8, 16)))
    ]
    constrained = {r.id: constraints[i % 3] for i, r in enumerate(requests[::2])}
    requests = [
        dataclasses.replace(r, constraint=constrained.get(r.id), max_tokens=r.max_tokens + 40 * (r.id in constrained))
        for r in requests
    ]
    free = [r for r in requests if r.constraint is None]
    scheduler = make_scheduler(two_slots)
    try:
        together = run(scheduler, requests)
        without = run(scheduler, free)
    finally:
        scheduler.stop()
    for request in free:
        assert together.tokens[request.id] == without.tokens[request.id]
    for request in requests:
        if request.constraint is None:
            continue
        tokens = together.tokens[request.id]
        assert together.deltas[request.id][-1].finish_reason == "stop" and tokens[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(tokens[:-1])
        if request.constraint.kind == "choice":
            assert text in request.constraint.spec
        elif request.constraint.kind == "regex":
            assert re.fullmatch(request.constraint.spec, text), text
        else:
            assert set(json.loads(text)) == {"n"} and json.loads(text)["n"] <= 9, text


@pytest.mark.slow
def test_constraints_are_refused_before_they_are_queued(two_slots, monkeypatch):
    scheduler = make_scheduler(two_slots)
    try:
        bad = {
            "does not compile": Constraint("regex", "(unclosed"),
            "not valid JSON": Constraint("json_schema", "{"),
            "1 to 1024 choices": Constraint("choice", ()),
        }
        for says, constraint in bad.items():
            with pytest.raises(Rejected, match=re.escape(says)) as refused:
                scheduler.submit(Request("bad", (1, 2, 3), constraint=constraint), lambda delta: None)
            assert refused.value.code is Code.INVALID_ARGUMENT
        with pytest.raises(Rejected, match="ignore_eos"):
            scheduler.submit(Request("x", (1, 2), ignore_eos=True, constraint=Constraint("regex", "a+")), print)
        assert scheduler.stats().waiting == 0
    finally:
        scheduler.stop()
    monkeypatch.setattr(two_slots, "tokenizer", None)  # a dummy model from a config has no tokenizer
    scheduler = make_scheduler(two_slots)
    try:
        with pytest.raises(Rejected, match="needs the checkpoint's tokenizer"):
            scheduler.submit(Request("x", (1, 2), constraint=Constraint("regex", "a+")), print)
    finally:
        scheduler.stop()


# The tiny model at widths the H200's kernels take (attention heads of 128, d_rel 16, experts of 256 over a hidden
# size of 512, a 128-token window; 4 query heads a KV head, so that two slots' decode rows are read in place): there
# every operation runs as a Mosaic GPU kernel or a cuBLAS gemm.
KERNEL_WIDTHS = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "swa_num_attention_heads": 8,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 128,
    "sliding_window_size": 128,
    "d_rel": 16,
    "rel_extent": 256,
    "moe_intermediate_size": 256,
}


def assert_batch_invariant(
    checkpoint: Path,
    compiler_options: dict | None,
    *,
    chunk: int = CHUNK,
    pages: int = 3,
    prompts: tuple[int, int] = (100, 120),
    outputs: tuple[int, int] = (30, 45),
) -> None:
    """Greedy and seeded requests over `checkpoint` in bfloat16 give the same tokens and log-probabilities, to the
    bit, alone (decode steps of one token), beside others (prompt chunks, other slots' decodes in the same step) and
    after a preemption (their tokens fed again as chunks): two slots share `pages` pages of 128 tokens, too few for
    both sequences of `prompts` + `outputs` tokens."""
    model = load_causal_lm(checkpoint, jnp.bfloat16)[1]
    vocab = model.config.unpadded_vocab_size
    layout = CacheLayout(2, pages, 32, chunk)
    engine = Engine(
        model,
        layout,
        make_mesh("tp1", model.config),
        num_top=MAX_LOGPROBS,
        checkpoint=str(checkpoint),
        compiler_options=compiler_options,
    )
    rng = np.random.default_rng()
    requests = [
        Request(
            f"r{i}",
            rng.integers(0, vocab, int(rng.integers(*prompts))).tolist(),
            max_tokens=int(rng.integers(*outputs)),
            temperature=float(temperature),
            seed=int(rng.integers(0, 2**31)),
            ignore_eos=True,
            logprobs=MAX_LOGPROBS,
        )
        for i, temperature in enumerate([0.0, 1.0, 0.0])
    ]
    alone, together = alone_then_together(engine, requests)

    def bits(deltas: list) -> list:  # every token with its log-probability and its top ones, as computed
        return [(t, p, top) for d in deltas for t, p, top in zip(d.token_ids, d.logprobs, d.top_logprobs, strict=True)]

    for request in requests:
        assert bits(together.deltas[request.id]) == bits(alone[request.id])


@pytest.mark.slow
def test_bfloat16_tokens_and_logprobs_do_not_depend_on_the_batch(tmp_path_factory):
    """The serving default: bfloat16 activations over the embedded tiny checkpoint's config (in four layers: a third of
    twelve layers' compile) with NVFP4 and MXFP8 experts, compiled as a user's run is (XLA's default optimization,
    whose dots and reductions sum in orders that change with the step's shape: without the model's fixed trees a
    request or two of three differ on most checkpoints); `assert_batch_invariant`."""
    checkpoint = tmp_path_factory.mktemp("tiny-mixed")
    config = four_layers(TINY_CONFIG, tmp_path_factory.mktemp("config") / "config.json")
    write_checkpoint(config, checkpoint, experts="mixed", seed=int(np.random.default_rng().integers(1 << 16)))
    assert_batch_invariant(checkpoint, {"xla_backend_optimization_level": 3})


@pytest.mark.skipif(not on_hopper(), reason="the H200's kernels: an sm90 GPU")
def test_bfloat16_on_the_gpu_kernels_does_not_depend_on_the_batch(tmp_path_factory):
    """`assert_batch_invariant` on an H200 at the kernels' widths, NVFP4 and MXFP8 experts, the engine's GPU step
    options: the projections (cuBLAS), the attention-residual, expert and attention kernels (decode tiles at every
    step width) and XLA's norms and sampler; 64-token chunks (several decode tiles a chunk), sequences of 2-3 pages
    (chunks straddling page boundaries) and past the sliding layers' 256-slot rings (which lap)."""
    folder = tmp_path_factory.mktemp("kernel-widths")
    config = folder / "config.json"
    config.write_text(json.dumps(json.loads(TINY_CONFIG.read_text()) | KERNEL_WIDTHS))
    checkpoint = folder / "checkpoint"
    write_checkpoint(config, checkpoint, experts="mixed", seed=int(np.random.default_rng().integers(1 << 16)))
    assert_batch_invariant(checkpoint, None, chunk=64, pages=5, prompts=(200, 240), outputs=(60, 80))
