"""Streamed text with stop strings: generated tokens in, text deltas out, never any part of a stop string.

Text arrives in pieces whose boundaries have nothing to do with the stop strings, so a stop string can
be split across tokens (or deltas). `StopStringMatcher` holds back the end of the text while it could
still be the start of a stop string, and releases it once it cannot; when a stop string is completed
(the first one to be, as generation has to stop there) the text ends just before it. `TextStream` puts
it behind an incremental detokenizer and tells which token completed the match, so the caller can stop
generation there. The gRPC server and the batch runner share both.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol


class StopStringMatcher:
    """Text pieces in, text safe to show out; finds the first occurrence of any stop string.

    One Aho-Corasick automaton over all the stop strings reads each character once, so the cost of a piece
    does not grow with the number of stop strings; its state is the longest end of the text that is still the
    start of one, which is exactly what must be held back."""

    def __init__(self, stop: Sequence[str]):
        if not all(stop):
            raise ValueError("stop strings must not be empty")
        self.stop = tuple(stop)
        self.matched: str | None = None  # the stop string found, once found
        self._held = ""  # end of the text that may be the start of a stop string
        self._state = 0
        self._next, self._fallback, self._depth, self._ends = _automaton(self.stop)

    def push(self, text: str) -> str:
        """The text now known to precede any stop string; nothing more once one has matched."""
        if self.matched is not None:
            return ""
        text, state = self._held + text, self._state
        nexts, fallback, ends = self._next, self._fallback, self._ends
        for position in range(len(self._held), len(text)):
            char = text[position]
            while state and char not in nexts[state]:
                state = fallback[state]
            state = nexts[state].get(char, 0)
            if ends[state]:  # the first stop string completed here; the longest of those ending here starts first
                start = position + 1 - ends[state]
                self.matched, self._held, self._state = text[start : position + 1], "", 0
                return text[:start]
        held = self._depth[state]
        self._held, self._state = text[len(text) - held :], state
        return text[: len(text) - held]

    def flush(self) -> str:
        """At the end of generation: the held-back text, which no stop string can complete any more."""
        held, self._held, self._state = self._held, "", 0
        return held


def _automaton(stop: Sequence[str]) -> tuple[list[dict[str, int]], list[int], list[int], list[int]]:
    """The stop strings' trie with its failure links: per state, the next state of each character, the state of
    its longest proper suffix in the trie, its depth (characters), and the length of the longest stop string that
    ends there (0: none)."""
    nexts, depth, ends = [{}], [0], [0]
    for string in stop:
        state = 0
        for char in string:
            if char not in nexts[state]:
                nexts.append({})
                depth.append(depth[state] + 1)
                ends.append(0)
                nexts[state][char] = len(nexts) - 1
            state = nexts[state][char]
        ends[state] = len(string)
    fallback = [0] * len(nexts)
    queue = collections.deque(nexts[0].values())
    while queue:  # breadth first: a state's fallback is settled before its children's
        state = queue.popleft()
        ends[state] = max(ends[state], ends[fallback[state]])
        for char, child in nexts[state].items():
            link = fallback[state]
            while link and char not in nexts[link]:
                link = fallback[link]
            fallback[child] = nexts[link].get(char, 0)
            queue.append(child)
    return nexts, fallback, depth, ends


class Decoder(Protocol):
    """Token ids in, finished text out (`inkling_jax.tokenizer.IncrementalDecoder`)."""

    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Piece:
    """What a batch of tokens adds: `tokens` of them were kept (all, unless a stop string matched) and
    `text` is the text safe to show; `stopped` once a stop string has matched (nothing follows)."""

    tokens: int
    text: str
    stopped: bool


class TextStream:
    """Detokenizes generated tokens one at a time and cuts the stream at the first stop string."""

    def __init__(self, decoder: Decoder, stop: Sequence[str] = ()):
        self._decoder = decoder
        self._matcher = StopStringMatcher(stop)

    @property
    def matched(self) -> str | None:
        return self._matcher.matched

    def push(self, token_ids: Iterable[int]) -> Piece:
        """Add generated tokens; on a match, the tokens after the one that completed it are dropped."""
        kept, text = 0, []
        for token in token_ids:
            if self._matcher.matched is not None:
                break
            kept += 1
            text.append(self._matcher.push(self._decoder.push([token])))
        return Piece(kept, "".join(text), self._matcher.matched is not None)

    def finish(self) -> str:
        """At the end of generation: the rest of the text (up to a stop string it completes)."""
        if self._matcher.matched is not None:
            return ""
        text = self._matcher.push(self._decoder.flush())
        return text if self._matcher.matched is not None else text + self._matcher.flush()
