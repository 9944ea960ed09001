"""Streamed text with stop strings: generated tokens in, text deltas out, never any part of a stop string.

Text arrives in pieces whose boundaries have nothing to do with the stop strings, so a stop string can
be split across tokens (or deltas). `StopStringMatcher` holds back the end of the text while it could
still be the start of a stop string, and releases it once it cannot; when a stop string is completed
(the first one to be, as generation has to stop there) the text ends just before it. `TextStream` puts
it behind an incremental detokenizer and tells which token completed the match, so the caller can stop
generation there. The gRPC server and the batch runner share both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol


class StopStringMatcher:
    """Text pieces in, text safe to show out; finds the first occurrence of any stop string."""

    def __init__(self, stop: Sequence[str]):
        if not all(stop):
            raise ValueError("stop strings must not be empty")
        self.stop = tuple(stop)
        self.matched: str | None = None  # the stop string found, once found
        self._held = ""  # end of the text that may be the start of a stop string

    def push(self, text: str) -> str:
        """The text now known to precede any stop string; nothing more once one has matched."""
        if self.matched is not None:
            return ""
        text = self._held + text
        start, matched = self._first_match(text)
        if matched is not None:
            self.matched, self._held = matched, ""
            return text[:start]
        held = self._partial_match_length(text)
        self._held = text[len(text) - held :]
        return text[: len(text) - held]

    def flush(self) -> str:
        """At the end of generation: the held-back text, which no stop string can complete any more."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str | None]:
        """Where the first stop string to be completed in `text` starts, and which it is.

        "First completed" (earliest end; of those ending together, the earliest start) is what a token by
        token check sees, so the result does not depend on how the text was split into pieces."""
        found = [(start + len(s), start, s) for s in self.stop if (start := text.find(s)) != -1]
        if not found:
            return len(text), None
        _, start, matched = min(found)
        return start, matched

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest end of `text` that is the start (not the whole) of a stop string."""
        longest = 0
        for candidate in self.stop:
            for length in range(min(len(candidate) - 1, len(text)), longest, -1):
                if text.endswith(candidate[:length]):
                    longest = length
                    break
        return longest


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
