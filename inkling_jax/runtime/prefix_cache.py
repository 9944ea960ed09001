"""The prefix cache's index: which full pages of earlier sequences hold a new sequence's beginning.

A full page (PAGE_SIZE tokens) is named by a key that hashes the key of the page before it, its tokens, and the
content digest and first position of every image whose placeholders it holds: two sequences with equal keys up to a
page hold equal contents up to that page's end, so the page's K/V (full-attention and the draft's context) is theirs
to share. Pages are shared whole and read only: a sequence writes from its first uncached page on, so no page is
ever copied on write.

A sequence can resume at a page boundary only where the state that does not live in pages was saved there: the
sliding layers' window and every layer's convolution state (a `snapshot`, held in a pool of its own). The index
keeps, per cached page, the snapshot at its end, if any, and answers with the longest cached run that ends at one.

Pages no running sequence reads (`refs` 0) stay cached until their pool needs them: then the least recently used
go first, always the end of a chain before the page it follows, so every cached page stays reachable. One index
serves one replica's page pool (page ids are numbered per replica)."""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from inkling_jax.cache import PAGE_SIZE
from inkling_jax.runtime.images import RequestImage


def image_digest(image: RequestImage) -> bytes:
    """A digest of an image's content: its pixel values and tile grid."""
    digest = hashlib.blake2b(digest_size=16)
    for array in (image.pixel_values, image.image_grid_thw):
        array = np.ascontiguousarray(array)
        digest.update(str((array.dtype.str, array.shape)).encode())
        digest.update(array.tobytes())
    return digest.digest()


def page_keys(tokens: Sequence[int], pages: int, images: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:
    """The keys of the first `pages` full pages of `tokens` (images: (start, length, digest) of each image's run of
    placeholders)."""
    if pages * PAGE_SIZE > len(tokens):
        raise ValueError(f"{len(tokens)} tokens fill {len(tokens) // PAGE_SIZE} pages, not {pages}")
    ids = np.asarray(tokens[: pages * PAGE_SIZE], np.int32)
    keys, previous = [], b""
    for page in range(pages):
        first, end = page * PAGE_SIZE, (page + 1) * PAGE_SIZE
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(ids[first:end].tobytes())
        for start, length, content in images:
            if start < end and start + length > first:
                digest.update(start.to_bytes(8, "little") + content)
        previous = digest.digest()
        keys.append(previous)
    return keys


@dataclasses.dataclass(eq=False)
class _Entry:
    page: int
    parent: bytes | None
    refs: int = 0  # running sequences that read the page
    children: int = 0  # cached pages that follow it
    used: int = 0  # when a sequence last took or published it (the index's clock)
    snapshot: int | None = None  # the snapshot saved at the page's end


@dataclasses.dataclass(frozen=True)
class Hit:
    """A cached run of pages a sequence resumes after: `pages` in order, and the snapshot saved at the end of the
    last (None for an empty hit); `run`: how many of its pages are cached, snapshot or not (where it leaves the
    cache's chain, a snapshot saved would let the next sequence along that chain resume further)."""

    pages: tuple[int, ...]
    snapshot: int | None
    run: int = 0

    @property
    def tokens(self) -> int:
        return len(self.pages) * PAGE_SIZE


class PrefixIndex:
    """The cached pages of one replica's pool and the snapshots saved at their ends (`snapshots`: the snapshot
    pool's size; `on_evict`, if given, receives the keys of each eviction's pages)."""

    def __init__(self, snapshots: int, on_evict: Callable[[list[bytes]], None] | None = None):
        self._on_evict = on_evict
        self._entries: dict[bytes, _Entry] = {}
        self._clock = itertools.count(1)
        self._idle: list[tuple[int, bytes]] = []  # (used, key) of pages nothing reads or follows; stale ones skipped
        self._free_snapshots = list(range(snapshots))
        self._snapshot_keys: dict[int, bytes] = {}  # snapshot -> the page it was saved at the end of
        self.evicted_pages = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def evictable(self) -> int:
        """Pages eviction can free: every cached page no running sequence reads."""
        return sum(entry.refs == 0 for entry in self._entries.values())

    def longest(self, keys: Sequence[bytes]) -> Hit:
        """The longest run of `keys` from the first that is cached and ends at a saved snapshot (nothing taken)."""
        depth, snapshot, run = 0, None, 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            run += 1
            if entry.snapshot is not None:
                depth, snapshot = run, entry.snapshot
        return Hit(tuple(self._entries[key].page for key in keys[:depth]), snapshot, run)

    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of `keys` (all cached), now read by one more sequence."""
        now = next(self._clock)
        pages = []
        for key in keys:
            entry = self._entries[key]
            entry.refs += 1
            entry.used = now
            pages.append(entry.page)
        return pages

    def release(self, keys: Sequence[bytes]) -> None:
        """One sequence fewer reads the pages of `keys`."""
        for key in keys:
            entry = self._entries[key]
            entry.refs -= 1
            self._maybe_idle(key, entry)

    def publish(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[int]:
        """Cache a sequence's full pages: `keys` from its first page on and `pages[i]`, the page that holds
        `keys[i]` (its own, or the cached one it read). Returns its own pages whose keys the cache held already, for
        the caller to free."""
        now, duplicates = next(self._clock), []
        for index, (key, page) in enumerate(zip(keys, pages, strict=True)):
            entry = self._entries.get(key)
            if entry is None:
                parent = keys[index - 1] if index else None
                self._entries[key] = entry = _Entry(page, parent)
                if parent is not None:
                    self._entries[parent].children += 1
            elif entry.page != page:
                duplicates.append(page)
            entry.used = now
            self._maybe_idle(key, entry)
        return duplicates

    def save_snapshot(self, key: bytes) -> int | None:
        """A snapshot for the end of the cached page `key` (freeing the least recently used other one if the pool is
        full; None if `key` has one already or there is no snapshot to take)."""
        entry = self._entries[key]
        if entry.snapshot is not None:
            return None
        if not self._free_snapshots:
            held = [k for k in self._snapshot_keys.values() if k != key]
            if not held:
                return None
            self._drop_snapshot(min(held, key=lambda k: self._entries[k].used))
        entry.snapshot = self._free_snapshots.pop()
        self._snapshot_keys[entry.snapshot] = key
        return entry.snapshot

    def evict(self, count: int) -> list[int]:
        """Free up to `count` pages, least recently used first and a chain's end before what it follows."""
        freed, keys = [], []
        while len(freed) < count and self._idle:
            used, key = heapq.heappop(self._idle)
            entry = self._entries.get(key)
            if entry is None or entry.used != used or entry.refs or entry.children:
                continue  # stale: taken, touched or followed since it was queued
            del self._entries[key]
            if entry.snapshot is not None:
                self._drop_snapshot(key, entry)
            if entry.parent is not None:
                parent = self._entries[entry.parent]
                parent.children -= 1
                self._maybe_idle(entry.parent, parent)
            freed.append(entry.page)
            keys.append(key)
        self.evicted_pages += len(freed)
        if keys and self._on_evict is not None:
            self._on_evict(keys)
        return freed

    def _maybe_idle(self, key: bytes, entry: _Entry) -> None:
        if entry.refs == 0 and entry.children == 0:
            heapq.heappush(self._idle, (entry.used, key))

    def _drop_snapshot(self, key: bytes, entry: _Entry | None = None) -> None:
        entry = entry or self._entries[key]
        del self._snapshot_keys[entry.snapshot]
        self._free_snapshots.append(entry.snapshot)
        entry.snapshot = None
