"""What a prefix cache saves where a sequence landed on a page boundary and restores into another slot
(`inkling_jax.cache`): the sequence resumed there, reading the first one's pages, computes bit for bit what the first
one computed; restored without its convolution states (zeros, a bug other engines shipped) it does not."""

import dataclasses
import json
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_configs import four_layers
from paths import TINY_CONFIG
from step_driver import Driver
from xla_flags import OPTIMIZED_STEPS

from inkling_jax.cache import (
    PAGE_SIZE,
    CacheBudgetError,
    CacheLayout,
    init_snapshots,
    restore_snapshot,
    save_snapshot,
    snapshot_bytes,
)
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.runtime.engine import Engine
from inkling_jax.runtime.kv_events import Stored, block_hash
from inkling_jax.runtime.prefix_cache import page_keys
from inkling_jax.runtime.requests import Request
from inkling_jax.runtime.scheduler import Scheduler
from inkling_jax.sharding import make_mesh

WINDOW = 160  # over a page: the window before a boundary spans two pages, and before the first it starts before 0
WIDTH, LENGTH = 64, 300  # prefill pieces; a sequence of two pages and 44 tokens
save, restore = jax.jit(save_snapshot), jax.jit(restore_snapshot)
DRAFT = {"num_hidden_layers": 1, "block_size": 4, "target_layer_ids": [1, 3], "mask_token_id": 5, "markov_rank": 6,
         "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 24}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("window")
    config = json.loads(four_layers(TINY_CONFIG, folder / "four.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"sliding_window_size": WINDOW}))
    path = write_checkpoint(folder / "config.json", folder / "hf", experts="fp32", seed=3, draft=DRAFT)
    return load_causal_lm(path, np.float32)[1]


def feed(driver: Driver, slot: int, tokens: list[int], start: int, decode: int) -> list:
    """Feed `slot` tokens[start:] in pieces of WIDTH from `start`, then `decode` greedy tokens; each emitted step."""
    emitted = []
    for first in range(start, len(tokens), WIDTH):
        piece = tokens[first : first + WIDTH]
        last = first + WIDTH >= len(tokens)
        out = driver.run(
            {slot: piece}, reset=(slot,) if first == 0 else (), emit=(slot,) if last else (), prompt=(slot,)
        )
        if last:
            emitted.append(out)
    for _ in range(decode):
        emitted.append(driver.run({slot: [int(emitted[-1].tokens[slot, 0])]}, emit=(slot,)))
    return [jax.tree.map(lambda x, s=slot: np.asarray(x[s]), out) for out in emitted]


@pytest.mark.slow
@pytest.mark.parametrize("boundary", [PAGE_SIZE, 2 * PAGE_SIZE])
def test_a_sequence_resumed_at_a_saved_boundary_computes_as_the_one_that_ran_through_it(model, boundary):
    rng = np.random.default_rng(boundary)
    tokens = rng.integers(0, model.config.unpadded_vocab_size, LENGTH).tolist()
    driver = Driver(model, width=WIDTH, pages=3, boundaries=True)
    through = feed(driver, 0, tokens, 0, decode=3)  # slot 0 lands on both boundaries and runs 47 tokens past them
    snapshots = save(driver.state, init_snapshots(driver.state, model.config, 2), 0, 1, boundary)

    shared = boundary // PAGE_SIZE
    table = np.array(driver.page_table)
    table[1, :shared] = table[0, :shared]  # slot 1 reads slot 0's pages before the boundary, writes its own after
    driver.page_table = jnp.asarray(table)
    prompt = np.zeros(driver.state.prompt_mask.shape[1], bool)
    prompt[tokens[:boundary]] = True
    counts = np.zeros(driver.state.output_counts.shape[1], np.int32)
    before = driver.state
    driver.state = restore(before, snapshots, 1, 1, boundary, prompt, counts)
    resumed = feed(driver, 1, tokens, boundary, decode=3)
    for want, got in zip(through, resumed, strict=True):
        for field in dataclasses.fields(want):
            np.testing.assert_array_equal(getattr(got, field.name), getattr(want, field.name), field.name)

    no_conv = dataclasses.replace(
        snapshots,
        **{n: jnp.zeros_like(getattr(snapshots, n)) for n in ("conv_k", "conv_v", "conv_attention", "conv_mlp")},
    )
    driver.state = restore(before, no_conv, 2, 1, boundary, prompt, counts)
    table[2, :shared] = table[0, :shared]
    driver.page_table = jnp.asarray(table)
    zeroed = feed(driver, 2, tokens, boundary, decode=0)
    assert not np.array_equal(zeroed[0].logprobs, through[0].logprobs)


@pytest.mark.slow
def test_the_engine_saves_and_restores_within_a_replica(model):
    """On dp2tp2, a sequence of replica 1 saved at a boundary and restored into another slot of replica 1 samples
    (seeded, with penalties over the prompt and the outputs) what the first sampled, step for step."""
    engine = Engine(model, CacheLayout(2, 6, 3, WIDTH), make_mesh("dp2tp2", model.config), num_top=4, snapshots=2)
    engine.warm_up_snapshots()
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, model.config.unpadded_vocab_size, LENGTH).tolist()
    sampling = {"temperature": 0.9, "seed": 11, "repetition_penalty": 1.3, "presence_penalty": 0.5, "top_k": 20}
    request = Request("r", tuple(tokens), max_tokens=8, logprobs=3, **sampling)
    table = np.zeros((engine.slots, engine.max_pages), np.int32)
    table[2], table[3] = [0, 1, 2], [0, 1, 3]  # replica 1's pages; slot 3 reads slot 2's first two

    def run(slot: int, start: int, outputs: int) -> list[tuple]:
        """Feed `slot` the prompt from `start` and decode `outputs` tokens; each emitting step's outputs."""
        got, fed = [], start
        while fed < LENGTH:
            piece = tokens[fed : fed + WIDTH]
            emitted = step(slot, piece, reset=fed == 0, prompt=True, emit=fed + len(piece) == LENGTH)
            fed += len(piece)
        got.append(emitted)
        for _ in range(outputs):
            got.append(step(slot, [int(got[-1].tokens[slot, 0])], reset=False, prompt=False, emit=True))
        return [(e.tokens[slot, :1], e.logprobs[slot, :1], e.top_ids[slot, :1], e.top_logprobs[slot, :1]) for e in got]

    def step(slot: int, piece: list[int], reset: bool, prompt: bool, emit: bool):
        batch_tokens, counts = np.zeros((engine.slots, len(piece)), np.int32), np.zeros(engine.slots, np.int32)
        batch_tokens[slot], counts[slot] = piece, len(piece)
        flags = {
            name: np.arange(engine.slots) == slot if value else np.zeros(engine.slots, bool)
            for name, value in (("reset", reset), ("is_prompt", prompt), ("emit", emit))
        }
        sampling = [request if s == slot else None for s in range(engine.slots)]
        return engine.fetch(engine.step(engine.host_batch(batch_tokens, counts, sampling, table, **flags)))

    through = run(2, 0, outputs=4)
    boundary = 2 * PAGE_SIZE
    engine.save_snapshot(2, 1, boundary)
    prompt = np.zeros(model.config.unpadded_vocab_size, bool)
    prompt[tokens[:boundary]] = True
    engine.restore_snapshot(3, 1, boundary, prompt, np.zeros(model.config.unpadded_vocab_size, np.int32))
    resumed = run(3, boundary, outputs=4)
    for want, got in zip(through, resumed, strict=True):
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(b, a)


def serve(
    engine: Engine, requests: list[Request], one_by_one: bool = False
) -> tuple[dict[str, list[int]], object, dict[str, int]]:
    """Every request's tokens when all are queued at once (`one_by_one`: each once the one before finished), the
    scheduler's stats after and each request's cached prompt tokens, as its last delta reports them."""
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    tokens, cached, done = {r.id: [] for r in requests}, {}, threading.Semaphore(0)

    def sink(request_id: str):
        def on_delta(delta):
            tokens[request_id].extend(delta.token_ids)
            if delta.finish_reason is not None:
                cached[request_id] = delta.cached_tokens
                done.release()

        return on_delta

    queued = [] if one_by_one else requests  # all queued before the scheduler starts: one order of admission
    for request in queued:
        scheduler.submit(request, sink(request.id))
    scheduler.start()
    try:
        for request in requests:
            if one_by_one:
                scheduler.submit(request, sink(request.id))
            assert done.acquire(timeout=300)
        stats = scheduler.stats()
        assert sum(cached.values()) == stats.cached_tokens
        if scheduler.kv_events is not None:
            assert_events_follow_the_cache(scheduler, requests, tokens)
        return tokens, stats, cached
    finally:
        scheduler.stop()


def assert_events_follow_the_cache(scheduler: Scheduler, requests: list[Request], tokens: dict[str, list[int]]):
    """Every page the cache's events store is a full page of a request's prompt and outputs, named by its key and
    chained to the one before; every page they remove was stored; what they leave stored is what the cache holds."""
    pages = {}
    for request in requests:
        sequence = request.prompt_token_ids + tuple(tokens[request.id])
        keys = page_keys(sequence, len(sequence) // PAGE_SIZE)
        for page, key in enumerate(keys):
            parent = block_hash(keys[page - 1]) if page else None
            pages[block_hash(key)] = (parent, sequence[page * PAGE_SIZE : (page + 1) * PAGE_SIZE])
    held, removed = set(), 0
    for batch in scheduler.kv_events.subscribe(1, lambda: None).take():
        for event in batch.events:
            if isinstance(event, Stored):
                assert pages[event.block] == (event.parent, event.tokens) and event.block not in held
                held.add(event.block)
            else:
                assert set(event.blocks) <= held
                held -= set(event.blocks)
                removed += len(event.blocks)
    stats = scheduler.stats()
    assert (len(held), removed) == (stats.cached_pages, stats.evicted_pages)


@pytest.mark.slow
def test_served_requests_sharing_prefixes_give_what_they_give_without_the_cache(model):
    """Two slots and requests that share a 300-token beginning whole, in part (a page, and the window into the
    next), or not at all, greedy and seeded: the later ones resume from what the earlier ones left (the cache
    holds their pages and snapshots), a small pool makes them evict and preempt, and every request's tokens equal
    those of an engine without the cache."""
    rng = np.random.default_rng(12)
    vocab = model.config.unpadded_vocab_size
    shared = rng.integers(0, vocab, LENGTH).tolist()
    tail = [rng.integers(0, vocab, n).tolist() for n in (20, 70, 90, 140)]
    prompts = [shared + tail[0], shared[:200] + tail[1], shared + tail[2], tail[3], list(shared)]
    requests = [
        Request(
            f"r{i}",
            tuple(prompt),
            max_tokens=int(rng.integers(40, 140)),
            temperature=(0.0, 0.8)[i % 2],
            seed=i,
            presence_penalty=0.4,
        )
        for i, prompt in enumerate(prompts * 2)
    ]
    mesh = make_mesh("tp1", model.config)
    layout = CacheLayout(2, 7, 5, WIDTH)  # growing sequences outgrow it: some are preempted
    # most of the test's ~1,700 steps: LLVM's optimisations pay for their compile here (not for the speculating
    # engine's four programs and fewer steps below)
    plain_engine, engine = (
        Engine(model, layout, mesh, compiler_options=OPTIMIZED_STEPS),
        Engine(model, layout, mesh, snapshots=3, compiler_options=OPTIMIZED_STEPS),
    )
    plain, *_ = serve(plain_engine, requests)
    cached, stats, _ = serve(engine, requests)
    assert cached == plain
    assert stats.cached_tokens >= 3 * 2 * PAGE_SIZE and stats.preemptions > 0 and stats.evicted_pages > 0, stats

    # one at a time, each sharing two pages and more with the first, which ends two pages further: the second
    # leaves the first's chain where no snapshot is and saves one there (its junction), where the third resumes
    prompts = [tuple(shared + rng.integers(0, vocab, 20).tolist()) for _ in range(3)]
    branches = [
        Request(f"b{i}", prompt, max_tokens=70, temperature=0.0, ignore_eos=True) for i, prompt in enumerate(prompts)
    ]
    expected, *_ = serve(plain_engine, branches, one_by_one=True)
    given, _, taken = serve(engine, branches, one_by_one=True)
    assert given == expected
    assert taken == {"b0": 0, "b1": 0, "b2": 2 * PAGE_SIZE}, taken

    # speculating (its rounds end on page boundaries): greedy requests give plain greedy decoding's tokens
    greedy = [request for request in requests if request.temperature == 0]
    speculating = Engine(model, layout, mesh, speculative="dspark", snapshots=3)
    drafted, stats, _ = serve(speculating, greedy)
    assert drafted == {request.id: plain[request.id] for request in greedy}
    assert stats.cached_tokens >= 2 * PAGE_SIZE and stats.speculative_rounds > 0, stats

    # a request that goes on from a speculated one's prompt and outputs resumes at the last boundary its outputs
    # reached: the cache's keys hold the tokens it kept, never a draft the verify rejected (the random draft's are
    # mostly rejected; a bug other engines shipped); the draft proposes from the unpadded vocabulary, the target's
    # rows are padded (another one)
    assert model.config.vocab_size > vocab
    first = Request("first", tuple(shared + tail[0]), max_tokens=70, temperature=0.0, ignore_eos=True)
    kept = serve(plain_engine, [first])[0]["first"]
    assert (len(first.prompt_token_ids) + len(kept) - 1) // PAGE_SIZE * PAGE_SIZE == 3 * PAGE_SIZE
    tokens = first.prompt_token_ids + tuple(kept) + tuple(rng.integers(0, vocab, 30).tolist())
    follow = Request("follow", tokens, max_tokens=40, temperature=0.0)
    given, stats, taken = serve(speculating, [first, follow], one_by_one=True)
    assert given == {"first": kept, **serve(plain_engine, [follow])[0]}
    assert taken["follow"] == 3 * PAGE_SIZE and stats.speculative_rounds > 0, (taken, stats)


def test_default_snapshots_fit_a_quarter_of_the_budget_beside_one_whole_sequence(model, caplog):
    """Without a count, a budget gets one snapshot per slot, as many as a quarter of it holds, and fewer where one
    sequence of the whole context would not fit beside them."""
    mesh, slots, context = make_mesh("tp1", model.config), 6, 4096
    each = snapshot_bytes(model.config, jnp.float32, 1)

    def snapshots(budget: int, count: int | None = None) -> int:
        engine = Engine.create(
            model, mesh, max_num_seqs=slots, chunk=WIDTH, max_context=context, budget_bytes=budget, snapshots=count
        )
        return engine.snapshots_per_replica

    least = next(b for b in range(each, 4000 * each, each // 4) if can_create(snapshots, b))  # room for one
    roomy = least + 40 * each
    assert roomy // 4 // each > slots and snapshots(roomy) == slots
    assert least // 4 // each >= 2 and snapshots(least) == 1  # a quarter would hold more, one sequence fewer
    with pytest.raises(CacheBudgetError):
        snapshots(least, 2)
    with caplog.at_level(logging.WARNING, "inkling_jax.runtime.engine"):
        assert snapshots(least - each) == 0  # one sequence fits, no snapshot beside it: said, not silent
    assert "no prefix cache: the budget holds one 4096-token sequence" in caplog.text


def can_create(snapshots, budget: int) -> bool:
    try:
        snapshots(budget, 1)
    except CacheBudgetError:
        return False
    return True
