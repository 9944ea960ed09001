"""The prefix cache's event batches (`inkling_jax.runtime.kv_events`): numbered without gaps, replayed to a
subscriber that resumes, a Cleared for one that starts from nothing, and the end of a subscriber that falls behind."""

import threading

import numpy as np
import pytest

from inkling_jax.runtime import kv_events
from inkling_jax.runtime.kv_events import Cleared, KvEvents, Removed, ResumeError, Stored, block_hash


def stored(rng: np.random.Generator) -> Stored:
    return Stored(int(rng.integers(-(2**63), 2**63 - 1)), None, tuple(rng.integers(0, 1000, 4).tolist()))


def test_block_hashes_are_signed_64_bit_names_of_keys():
    rng = np.random.default_rng(0)
    keys = [rng.bytes(16) for _ in range(64)]
    hashes = [block_hash(key) for key in keys]
    assert all(-(2**63) <= h < 2**63 for h in hashes) and min(hashes) < 0 < max(hashes)
    assert len(set(hashes)) == 64 and hashes == [block_hash(bytes(key)) for key in keys]


def test_batches_are_numbered_and_resumed_from_any_kept_one():
    rng = np.random.default_rng(1)
    events, woken = KvEvents(), threading.Semaphore(0)
    first = events.subscribe(0, woken.release)
    assert [(b.number, b.replica, b.events) for b in first.take()] == [(0, -1, (Cleared(),))]
    recorded = [(int(rng.integers(0, 2)), [stored(rng), stored(rng)]) for _ in range(5)]
    recorded.append((1, [Removed((recorded[0][1][0].block,))]))
    for replica, batch in recorded:
        events.record(replica, batch)
    events.record(0, [])  # nothing changed: no batch
    taken = first.take()
    assert [(b.number, b.replica, list(b.events)) for b in taken] == [
        (n, replica, batch) for n, (replica, batch) in enumerate(recorded, 1)
    ]
    assert woken.acquire(timeout=1)
    resumed = events.subscribe(4, lambda: None)
    assert [b.number for b in resumed.take()] == [4, 5, 6]
    later = events.subscribe(0, lambda: None)
    assert [(b.number, b.events) for b in later.take()] == [(6, (Cleared(),))]  # the next is 7, as it expects
    events.unsubscribe(first)
    events.record(0, [stored(rng)])
    assert first.take() == [] and [b.number for b in later.take()] == [7]


def test_a_batch_not_kept_or_not_yet_recorded_cannot_be_resumed(monkeypatch):
    monkeypatch.setattr(kv_events, "KEPT", 3)
    rng = np.random.default_rng(2)
    events = KvEvents()
    for _ in range(5):
        events.record(0, [stored(rng)])
    assert [b.number for b in events.subscribe(3, lambda: None).take()] == [3, 4, 5]
    assert events.subscribe(6, lambda: None).take() == []  # the next one
    for start in (2, 7):
        with pytest.raises(ResumeError, match=f"batch {start} is not kept"):
            events.subscribe(start, lambda: None)


def test_a_subscriber_that_falls_too_far_behind_is_lost(monkeypatch):
    monkeypatch.setattr(kv_events, "BACKLOG", 4)
    rng = np.random.default_rng(3)
    events = KvEvents()
    slow, quick = events.subscribe(1, lambda: None), events.subscribe(1, lambda: None)
    for _ in range(5):
        events.record(0, [stored(rng)])
        assert len(quick.take()) == 1
    assert slow.lost and slow.take() == [] and not quick.lost


def test_a_subscriber_whose_reader_is_gone_does_not_stop_the_recording():
    rng = np.random.default_rng(4)
    events = KvEvents()

    def closed() -> None:
        raise RuntimeError("Event loop is closed")

    gone, other = events.subscribe(1, closed), events.subscribe(1, lambda: None)
    events.record(0, [stored(rng)])
    assert gone.lost and not other.lost and [b.number for b in other.take()] == [1]
