"""The suite's file scheduler (tests/file_scheduling.py) ends a run whose workers crash, runs every other test
once, and reports each crashed test failed once; a replacement worker gets work only once it has reported what it
collected."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from file_scheduling import CrashSafeFileScheduling

TESTS = Path(__file__).resolve().parent.parent

CONFTEST = """
import pytest
from file_scheduling import CrashSafeFileScheduling

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return CrashSafeFileScheduling(config, log)
"""


@pytest.mark.slow
def test_a_run_with_crashing_workers_ends_and_runs_every_test_once(tmp_path: Path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # one line per test run, so a test run twice shows
    record = "def test_{n}():\n    open('ran.txt', 'a').write('{file}::{n}\\n')\n"
    crash = "def test_crash():\n    import os; os._exit(1)\n"
    files = {"early_crash": [0, "crash", 2, 3], "lone": [0], "late_crash": [0, 1, "crash"]}
    files |= {f"plain{i}": [0, 1, 2] for i in range(5)}
    for name, tests in files.items():
        body = [crash if n == "crash" else record.format(n=n, file=name) for n in tests]
        (tmp_path / f"test_{name}.py").write_text("\n".join(body))
    env = os.environ | {"PYTHONPATH": str(TESTS)}
    # -rN: no short summary, whose lines repeat the failure (untruncated where the terminal is wide)
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "--max-worker-restart", "4", "-p",
               "no:cacheprovider", "-rN"]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "2 failed" in run.stdout, run.stdout
    for name in ("early_crash", "late_crash"):
        assert run.stdout.count(f"crashed while running 'test_{name}.py::test_crash'") == 1, run.stdout
    ran = sorted((tmp_path / "ran.txt").read_text().split())
    expected = sorted(f"{name}::{n}" for name, tests in files.items() for n in tests if n != "crash")
    assert ran == expected


class FakeWorker:
    """What the scheduler asks of a worker: its name, whether it is shutting down, and the tests it is sent."""

    def __init__(self, name: str):
        self.gateway, self.shutting_down, self.sent = types.SimpleNamespace(id=name), False, []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


class FakeConfig:
    """Two workers; files in collection order."""

    option = types.SimpleNamespace(loadscopereorder=False)

    def getvalue(self, name: str) -> list[str]:
        assert name == "tx"
        return ["2*popen"]


def test_a_replacement_gets_work_once_it_has_collected():
    """Both workers crash; the first replacement to report its collection gets a file, and the other, not yet
    reported (xdist reschedules every node on each report), gets one when it reports."""
    collection = [f"test_{name}.py::test_{n}" for name in "abcdef" for n in range(3)]
    scheduler = CrashSafeFileScheduling(FakeConfig())
    first, second = FakeWorker("gw0"), FakeWorker("gw1")
    for worker in (first, second):
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    assert first.sent and second.sent
    for worker in (first, second):
        assert scheduler.remove_node(worker) is not None  # each died in its first test
    late, early = FakeWorker("gw2"), FakeWorker("gw3")
    scheduler.add_node(late)
    scheduler.add_node(early)
    scheduler.add_node_collection(early, collection)
    scheduler.schedule()  # reschedules every node, `late` too, which has collected nothing yet
    assert early.sent and not late.sent
    scheduler.add_node_collection(late, collection)
    scheduler.schedule()
    assert late.sent and not set(late.sent) & set(early.sent)
