"""Shared test setup: CPU JAX with 8 host devices (multi-device tests), compiled without LLVM's optimisations
(the tests' programs are tiny and compile-bound: a quarter off the suite; IEEE semantics are the same) and without
XLA's verifier between its passes.

A test still running after HANG_SECONDS (set-up included) writes every thread's stack and ends its process: a hang
fails the suite in minutes and says where, instead of holding CI to its limit. Under xdist, whose workers' own output
is dropped, the stacks go to .pytest-hangs/ and the controller prints them after the run.

No persistent compilation cache: few programs repeat across test files, and writing each one to a cache (which
serializes the executable, re-running part of XLA's pipeline) cost more than the repeats it saved."""

import faulthandler
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from file_scheduling import CrashSafeFileScheduling
from xla_flags import DEVICES, UNOPTIMIZED, UNVERIFIED

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), DEVICES, UNOPTIMIZED, UNVERIFIED]).strip()

# the command-line entry points tests run (in this process or as subprocesses) leave JAX's cache settings alone
# and never write into the home directory (`inkling_jax.runtime.compilation_cache`)
os.environ["INKLING_JAX_COMPILATION_CACHE"] = "none"

HANG_SECONDS = 900  # the slowest module's first test compiles for ~2 min on 2 cores
HANGS = Path(__file__).resolve().parent.parent / ".pytest-hangs"
TERMINAL = pytest.StashKey[int]()  # stderr as the run began, before pytest captures it
GUARD = pytest.StashKey[tuple[float, object]]()  # a running test's deadline and where its stacks go


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist: an earlier run's logs go
        shutil.rmtree(HANGS, ignore_errors=True)
        config.stash[TERMINAL] = os.dup(2)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> CrashSafeFileScheduling | None:
    return CrashSafeFileScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    worker = getattr(item.config, "workerinput", {}).get("workerid")
    if worker is None:
        log = item.config.stash[TERMINAL]
    else:
        HANGS.mkdir(exist_ok=True)
        log = open(HANGS / f"{worker}.log", "w")
        log.write(f"{item.nodeid} still running after {HANG_SECONDS} s:\n")
        log.flush()
    item.stash[GUARD] = (time.monotonic() + HANG_SECONDS, log)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=log)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if worker is not None:
            log.close()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that hung is not run again: a replaced worker, or the Makefile's second pass, would start it anew."""
    for log in HANGS.glob("*.log"):
        text = log.read_text(errors="replace")
        if text.startswith(f"{item.nodeid} still running") and "most recent call first" in text:
            pytest.fail(f"hung in an earlier attempt: its stacks are in {log}", pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node: pytest.Item | pytest.Collector) -> None:
    """Re-arms the guard for the test's remaining time: pytest's faulthandler plugin cancels it when a phase
    raises, which would leave a failed test's teardown unguarded."""
    if GUARD in node.stash:
        deadline, log = node.stash[GUARD]
        faulthandler.dump_traceback_later(max(deadline - time.monotonic(), 1.0), exit=True, file=log)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for log in sorted(HANGS.glob("*.log")):
        text = log.read_text()
        if "most recent call first" in text:
            terminalreporter.write_sep("=", f"hung: {log.stem}")
            terminalreporter.write(text)


@pytest.fixture(scope="module", autouse=True)
def no_programs_across_files():
    """The programs a test file compiled (its engines' shared step programs, JAX's caches of jitted functions) end
    with it, so a worker keeps only one file's programs in memory: an XLA:CPU program holds hundreds to thousands of
    memory mappings, and a worker that kept every file's passed half of the 65,530 Linux allows a process."""
    yield
    engine = sys.modules.get("inkling_jax.runtime.engine")  # none where the file built no engine
    if engine is not None:
        engine.STEP_PROGRAMS.clear()
        engine.RESAMPLERS.clear()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


@pytest.fixture(autouse=True)
def no_programs_across_patches(request: pytest.FixtureRequest):
    """A test that monkeypatches may build an engine over patched code (a broken step, another kernel): it neither
    takes the step programs other engines of the process compiled (`STEP_PROGRAMS`, keyed by what decides a
    program, which a patch is not) nor leaves its own to later tests."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    from inkling_jax.runtime.engine import STEP_PROGRAMS

    STEP_PROGRAMS.clear()
    yield
    STEP_PROGRAMS.clear()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding slow tests run first: the last files xdist hands out are then quick ones, and neither worker
    waits long for the other at the end of the run."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
