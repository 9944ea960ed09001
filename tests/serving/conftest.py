"""The serving tests' shared set-up."""

import logging
import signal
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def restore_process_state() -> Iterator[None]:
    """serving.main's main() installs signal handlers and stderr log handlers (bound to pytest's captured stderr):
    undo both after every test that may have run it."""
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    loggers = [logging.getLogger(name) for name in ("serving", "inkling_jax")]
    saved = [(logger, list(logger.handlers), logger.level, logger.propagate) for logger in loggers]
    yield
    for number, handler in handlers.items():
        signal.signal(number, handler)
    for logger, logger_handlers, level, propagate in saved:
        logger.handlers[:], logger.level, logger.propagate = logger_handlers, level, propagate
