"""The prefix cache's changes as numbered batches of events, for a router that sends each request where its
beginning is cached (the SMG gateway's cache-aware policy subscribes to them: `serving.vllm_engine`).

A page that becomes cached is `Stored` with its tokens and the page before it (chains arrive parents first); a page
evicted is `Removed`. Pages are named by a 64-bit signed hash of their prefix-cache key. Batches are numbered from 1
without gaps across every replica's cache; the last KEPT are kept, so a subscriber that lost its stream resumes from
the number it saw last. A new subscriber starting from nothing first gets a `Cleared`: what it held from before is
stale, and it learns the pages cached from then on."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

KEPT = 1024  # batches kept for subscribers that resume
BACKLOG = 4096  # batches a subscriber may fall behind before its stream is ended


@dataclasses.dataclass(frozen=True)
class Stored:
    """A page now cached: its hash, the hash of the page before it (None for a sequence's first) and its tokens."""

    block: int
    parent: int | None
    tokens: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Removed:
    blocks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Cleared:
    pass


@dataclasses.dataclass(frozen=True)
class Batch:
    number: int
    timestamp: float  # seconds since the epoch
    replica: int  # the data-parallel replica whose cache changed (-1: none, for a Cleared)
    events: tuple[Stored | Removed | Cleared, ...]


class ResumeError(ValueError):
    """A subscriber asked to resume from a batch no longer kept."""


def block_hash(key: bytes) -> int:
    """A page's 64-bit signed name: the first 8 bytes of its key, big-endian."""
    return int.from_bytes(key[:8], "big", signed=True)


class Subscription:
    """One subscriber's batches not yet taken; `notify` is called (from the thread that records) when some arrive.
    It is `lost` when it fell too far behind or `notify` failed."""

    def __init__(self, notify: Callable[[], None]):
        self._notify = notify
        self._pending: deque[Batch] = deque()
        self._lock = threading.Lock()
        self.lost = False  # it fell more than BACKLOG batches behind: its stream must end

    def take(self) -> list[Batch]:
        with self._lock:
            batches = list(self._pending)
            self._pending.clear()
        return batches

    def _put(self, batches: Sequence[Batch]) -> None:
        with self._lock:
            self._pending.extend(batches)
            if len(self._pending) > BACKLOG:
                self._pending.clear()
                self.lost = True
        try:
            self._notify()
        except Exception:  # its reader is gone (say, its event loop closed): the recording side goes on
            self.lost = True


class KvEvents:
    """The batches recorded so far (the last KEPT) and their subscribers."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: deque[Batch] = deque(maxlen=KEPT)
        self._last = 0
        self._subscribers: list[Subscription] = []

    def record(self, replica: int, events: Sequence[Stored | Removed]) -> None:
        """One batch of a replica's changes (nothing when `events` is empty)."""
        if not events:
            return
        with self._lock:
            self._last += 1
            batch = Batch(self._last, time.time(), replica, tuple(events))
            self._kept.append(batch)
            subscribers = list(self._subscribers)
        for subscription in subscribers:
            subscription._put([batch])

    def subscribe(self, start: int, notify: Callable[[], None]) -> Subscription:
        """A subscription from batch `start` on (the kept ones from there first), or, for 0, from a Cleared numbered
        as the last batch recorded. ResumeError when batch `start` is neither kept nor the next (it is gone, or
        numbered by an earlier run of the server)."""
        subscription = Subscription(notify)
        with self._lock:
            if start == 0:
                replay = [Batch(self._last, time.time(), -1, (Cleared(),))]
            else:
                oldest = self._kept[0].number if self._kept else self._last + 1
                if not oldest <= start <= self._last + 1:
                    raise ResumeError(
                        f"batch {start} is not kept (kept: {oldest} to {self._last}, the next {self._last + 1}); "
                        "subscribe from 0"
                    )
                replay = [batch for batch in self._kept if batch.number >= start]
            subscription._put(replay)
            self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscribers.remove(subscription)
