"""Progress of a long checkpoint transfer (a load, an Orbax restore or save): tensors and bytes done, the rate
and the time left, so that a load of hundreds of GB is not minutes of silence.

With stderr a terminal (and the logger showing INFO) a tqdm bar; otherwise log lines, at most one every
INTERVAL_S seconds or every FRACTION of the bytes, whichever comes first. Either way a last line, once the
transfer has succeeded, gives the tensors, the bytes (exactly), the seconds and the rate. Every line's record
carries `tensors_done` and `bytes_done` (exact counts) for handlers that want them.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

from tqdm import tqdm

INTERVAL_S = 10.0  # at most one progress line per this many seconds...
FRACTION = 0.1  # ...unless this fraction of the bytes was done since the last one
GB = 1e9


def _unit(total: int) -> tuple[str, float]:
    """The unit every size of a transfer of `total` bytes is shown in."""
    for name, scale in (("GB", GB), ("MB", 1e6)):
        if total >= scale:
            return name, scale
    return "KB", 1e3


def _size(nbytes: float, unit: tuple[str, float]) -> str:
    return f"{nbytes / unit[1]:.2f}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:02.0f} min"


class Progress:
    """One transfer of `tensors` tensors (None: not counted) and `nbytes` bytes, announced as `what` (e.g.
    "loading DIR"); `advance` as parts are done; used as a context manager, whose exit closes the bar and, when
    no error is propagating, logs the last line."""

    def __init__(self, logger: logging.Logger, what: str, tensors: int | None, nbytes: int):
        self.logger, self.what, self.total_tensors, self.total_bytes = logger, what, tensors, nbytes
        self.tensors = self.bytes = 0
        self.unit = _unit(nbytes)
        self.start = self.logged_at = time.perf_counter()
        self.logged_bytes = 0
        terminal = sys.stderr.isatty() and logger.isEnabledFor(logging.INFO)
        self.bar = None
        if terminal:
            self.bar = tqdm(total=nbytes, desc=what, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, error_type: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.bar is not None:
            self.bar.close()
        if error_type is None:
            self._last_line()

    def advance(self, tensors: int, nbytes: int) -> None:
        """`tensors` more tensors and `nbytes` more bytes are done (nothing done: nothing shown)."""
        if not (tensors or nbytes):
            return
        self.tensors += tensors
        self.bytes += nbytes
        if self.bar is not None:
            if self.total_tensors is not None:
                self.bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors", refresh=False)
            self.bar.update(nbytes)
            return
        now = time.perf_counter()
        if now - self.logged_at >= INTERVAL_S or self.bytes - self.logged_bytes >= FRACTION * self.total_bytes:
            self.logged_at, self.logged_bytes = now, self.bytes
            self._line(now)

    def _counts(self) -> dict[str, int]:
        return {"tensors_done": self.tensors, "bytes_done": self.bytes}

    def _line(self, now: float) -> None:
        rate = self.bytes / max(now - self.start, 1e-9)
        left = _duration((self.total_bytes - self.bytes) / rate) if rate > 0 else "unknown time"
        tensors = f"{self.tensors}/{self.total_tensors} tensors, " if self.total_tensors is not None else ""
        self.logger.info(
            "%s: %s%s/%s %s (%.0f%%), %.3g GB/s, %s left",
            self.what,
            tensors,
            _size(self.bytes, self.unit),
            _size(self.total_bytes, self.unit),
            self.unit[0],
            100 * self.bytes / max(self.total_bytes, 1),
            rate / GB,
            left,
            extra=self._counts(),
        )

    def _last_line(self) -> None:
        seconds = time.perf_counter() - self.start
        tensors = f"{self.tensors} tensors, " if self.total_tensors is not None else ""
        self.logger.info(
            "%s: done, %s%s %s (%s bytes) in %.1f s, %.3g GB/s",
            self.what,
            tensors,
            _size(self.bytes, self.unit),
            self.unit[0],
            f"{self.bytes:,}",
            seconds,
            self.bytes / max(seconds, 1e-9) / GB,
            extra=self._counts(),
        )
