"""The prefix cache's index (`inkling_jax.runtime.prefix_cache`): page keys name contents and everything before
them, hits end at saved snapshots, shared pages are never freed, and eviction takes idle chain ends, least recently
used first."""

import numpy as np
import pytest

from inkling_jax.cache import PAGE_SIZE
from inkling_jax.runtime.images import RequestImage
from inkling_jax.runtime.prefix_cache import PrefixIndex, image_digest, page_keys


def random_tokens(rng: np.random.Generator, pages: float) -> list[int]:
    return rng.integers(0, 1000, int(pages * PAGE_SIZE)).tolist()


def test_keys_name_a_page_and_everything_before_it():
    rng = np.random.default_rng(0)
    tokens = random_tokens(rng, 4.5)
    keys = page_keys(tokens, 4)
    assert len(set(keys)) == 4
    assert page_keys([*tokens, 1, 2], 4) == keys  # what follows the last full page is no part of it
    changed = list(tokens)
    changed[2 * PAGE_SIZE + int(rng.integers(PAGE_SIZE))] += 1
    assert page_keys(changed, 4)[:2] == keys[:2]
    assert not set(page_keys(changed, 4)[2:]) & set(keys)  # the page changed, and every page after it
    with pytest.raises(ValueError, match="fill 4 pages, not 5"):
        page_keys(tokens, 5)


def test_images_enter_the_keys_of_the_pages_holding_their_placeholders():
    rng = np.random.default_rng(1)
    tokens = random_tokens(rng, 3)
    pixels = rng.uniform(-1, 1, (6, 8, 8, 3)).astype(np.float32)
    image, grid = RequestImage(pixels, np.array([[1, 2, 3]])), np.array([[1, 2, 3]])
    other = pixels.copy()
    other[3, 4, 5, 1] += 0.5
    start = PAGE_SIZE + 125  # its six placeholders straddle pages 1 and 2
    keys = page_keys(tokens, 3, [(start, 6, image_digest(image))])
    same = page_keys(tokens, 3, [(start, 6, image_digest(RequestImage(pixels.copy(), grid)))])
    changed = page_keys(tokens, 3, [(start, 6, image_digest(RequestImage(other, grid)))])
    assert same == keys
    assert changed[0] == keys[0] and not set(changed[1:]) & set(keys)
    assert page_keys(tokens, 3)[0] == keys[0] and page_keys(tokens, 3)[1] != keys[1]


def test_a_hit_ends_at_the_deepest_saved_snapshot_of_the_longest_cached_run():
    rng = np.random.default_rng(2)
    index = PrefixIndex(snapshots=4)
    tokens = random_tokens(rng, 5)
    keys = page_keys(tokens, 5)
    pages = rng.permutation(100)[:5].tolist()
    assert index.publish(keys, pages) == []
    assert index.longest(keys).pages == () and index.longest(keys).run == 5  # no snapshot: nowhere to resume
    assert keys[2] in index and page_keys(random_tokens(rng, 1), 1)[0] not in index
    first = index.save_snapshot(keys[1])
    third = index.save_snapshot(keys[3])
    assert index.save_snapshot(keys[3]) is None  # one per page
    hit = index.longest(keys)
    assert hit.pages == tuple(pages[:4]) and hit.snapshot == third and hit.tokens == 4 * PAGE_SIZE
    diverged = page_keys(tokens[: 3 * PAGE_SIZE] + random_tokens(rng, 2), 5)
    assert index.longest(diverged).pages == tuple(pages[:2]) and index.longest(diverged).snapshot == first
    assert index.longest(diverged).run == 3  # where it leaves the chain


def test_shared_pages_stay_and_idle_ones_go_least_recently_used_chain_ends_first():
    rng = np.random.default_rng(3)
    index = PrefixIndex(snapshots=2)
    prefix = random_tokens(rng, 2)
    a = page_keys(prefix + random_tokens(rng, 2), 4)
    b = page_keys(prefix + random_tokens(rng, 1), 3)
    assert a[:2] == b[:2]
    index.publish(a, [10, 11, 12, 13])
    index.acquire(b[:2])  # another sequence reads the shared two, and adds its own third page
    assert index.publish(b, [10, 11, 20]) == []
    index.release(b[:2])
    # a duplicate of a cached page (the same content computed again) is handed back
    assert index.publish(b, [30, 31, 32]) == [30, 31, 32]
    assert len(index) == 5 and index.evictable == 5
    index.acquire(a[:3])
    assert index.evictable == 2
    assert index.evict(5) == [13, 20]  # a's end, untouched since it was cached, then b's; a's first three are read
    index.release(a[:3])
    assert index.evict(1) == [12]
    assert sorted(index.evict(5)) == [10, 11] and len(index) == 0 and index.evicted_pages == 5


def test_snapshots_go_with_their_pages_or_to_a_newer_page():
    rng = np.random.default_rng(4)
    index = PrefixIndex(snapshots=2)
    keys = page_keys(random_tokens(rng, 3), 3)
    index.publish(keys, [0, 1, 2])
    saved = {index.save_snapshot(keys[0]), index.save_snapshot(keys[1])}
    assert saved == {0, 1}
    index.acquire(keys[1:2])
    index.release(keys[1:2])  # keys[1] is now newer than keys[0]
    taken = index.save_snapshot(keys[2])  # the pool is full: the least recently used page gives its snapshot up
    assert taken in saved and index.longest(keys).snapshot == taken
    assert index.longest(keys[:1]).pages == ()
    assert index.evict(1) == [2]  # and an evicted page's snapshot returns to the pool
    assert index.save_snapshot(keys[0]) == taken
