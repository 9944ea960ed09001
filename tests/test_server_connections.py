"""The server's connections: clients' keepalive pings, a second signal during the drain, a metrics port in use.
Over real loopback channels and processes, with test_server's fake engine and scheduler (no model, nothing
compiled)."""

from __future__ import annotations

import dataclasses
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server import CONFIG, FakeEngine, FakeScheduler, echo, request, token_ids_of, wait_until

from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import TextConfig, load_config
from inkling_jax.tokenizer import Tokenizer
from serving import main as server_main
from serving import server as server_module
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc
from serving.server import Server, serve

REPO = Path(__file__).resolve().parents[1]
# a client that pings every second, on idle connections too, and never stops for lack of data
PINGING = (("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
           ("grpc.http2.max_pings_without_data", 0))  # fmt: skip
QUIET_SECONDS = 5.0  # an idle connection, and a prefill that sends nothing, last this long: five pings
STEP_SECONDS = 0.1  # the fake scheduler's step in a serving.main process: a 1000-token stream takes a minute or more


# --- fixtures


@dataclasses.dataclass
class Model:
    checkpoint: str
    text: TextConfig
    tokenizer: Tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    directory = tmp_path_factory.mktemp("checkpoint")
    shutil.copy(CONFIG, directory / "config.json")
    text = load_config(CONFIG).text
    return Model(str(directory), text, Tokenizer(build_tokenizer(text)))


@pytest.fixture
def launch(model: Model) -> Iterator[Callable[..., tuple[Server, FakeScheduler]]]:
    """launch(scheduler_class=FakeScheduler) -> (server, scheduler)."""
    started: list[tuple[Server, FakeScheduler]] = []

    def launch_server(scheduler_class: type[FakeScheduler] = FakeScheduler) -> tuple[Server, FakeScheduler]:
        engine = FakeEngine(model.text, model.tokenizer, model.checkpoint)
        scheduler = scheduler_class(engine)
        started.append((serve(scheduler, engine, "127.0.0.1", 0), scheduler))
        return started[-1]

    yield launch_server
    for server, scheduler in started:
        server.stop(grace=0)
        scheduler.stop()


def health_check(channel: grpc.Channel, **call) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10, **call).status


# --- keepalive


class SlowPrefill(FakeScheduler):
    """The fake scheduler, whose requests start generating QUIET_SECONDS after they are submitted: like a long
    prefill, the server sends nothing on the call meanwhile."""

    def submit(self, request, on_delta) -> None:
        threading.Timer(QUIET_SECONDS, super().submit, (request, on_delta)).start()


def pinging_channel(port: int) -> tuple[grpc.Channel, list[grpc.ChannelConnectivity]]:
    """A channel to the port that pings every second, and every connectivity state it goes through."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=PINGING)
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=True)
    return channel, states


def after_ready(states: list[grpc.ChannelConnectivity]) -> list[grpc.ChannelConnectivity]:
    """The states after the channel was first READY (it reports them asynchronously: none yet, maybe)."""
    ready = grpc.ChannelConnectivity.READY
    return states[states.index(ready) + 1 :] if ready in states else []


def test_a_client_pinging_every_second_keeps_its_connection_idle_and_through_a_long_prefill(launch):
    server, _ = launch(SlowPrefill)
    channel, states = pinging_channel(server.port)
    with channel:
        wait_until(lambda: health_check(channel) == health_pb2.HealthCheckResponse.SERVING)
        time.sleep(QUIET_SECONDS)  # idle: pings, and nothing else
        responses = list(pb_grpc.InklingStub(channel).Generate(request([3, 4, 5], max_tokens=12), timeout=120))
        assert token_ids_of(responses) == echo([3, 4, 5], 12)
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert grpc.ChannelConnectivity.READY in states
        assert after_ready(states) == []  # never dropped (a GOAWAY turns the channel IDLE)


def test_without_the_keepalive_options_the_same_client_is_cut_off(launch, monkeypatch):
    """The control: with gRPC's defaults the server answers those pings with GOAWAY too_many_pings."""
    monkeypatch.setattr(server_module, "KEEPALIVE_OPTIONS", ())
    server, _ = launch()
    channel, states = pinging_channel(server.port)
    with channel:
        health_check(channel)
        wait_until(lambda: after_ready(states), timeout=60)
        assert after_ready(states)[0] == grpc.ChannelConnectivity.IDLE


# --- a second signal during the drain

# the child process: serving.main over the fakes, its tests directory on the path
CHILD = (
    f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; "
    "import test_server_connections as t; sys.exit(t.main_with_fakes(sys.argv[1:]))"
)


def main_with_fakes(argv: list[str]) -> int:
    """serving.main.main over test_server's fake engine (no tokenizer) and scheduler (a step every STEP_SECONDS):
    what the signal tests run as a process of its own."""
    text = load_config(CONFIG).text
    server_main.load_engine = lambda path, **_: FakeEngine(text, None, path)
    server_main.Scheduler = lambda engine: FakeScheduler(engine, ready=False, step_seconds=STEP_SECONDS)
    return server_main.main(argv)


class Lines:
    """A process's stderr, read line by line on a thread of its own."""

    def __init__(self, stream):
        self.seen: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, fragment: str, timeout: float = 120) -> str:
        """The next line holding `fragment` (the lines before it are kept in `seen`)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert line is not None, f"the process ended before logging {fragment!r}:\n" + "\n".join(self.seen)
            self.seen.append(line)
            if fragment in line:
                return line

    def rest(self) -> list[str]:
        while (line := self._lines.get(timeout=30)) is not None:
            self.seen.append(line)
        return self.seen


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_during_the_drain_aborts_the_requests_and_exits(model, second):
    argv = ["--checkpoint", model.checkpoint, "--port", "0", "--drain-timeout", "300", "--compilation-cache", "none"]
    child = subprocess.Popen([sys.executable, "-c", CHILD, *argv], stderr=subprocess.PIPE, text=True)
    lines = Lines(child.stderr)
    try:
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", lines.expect("listening on")).group(1))
        lines.expect("SERVING")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = pb_grpc.InklingStub(channel).Generate(request([1, 2], max_tokens=1000), timeout=300)
            responses = [next(stream)]
            child.send_signal(signal.SIGTERM)
            lines.expect("draining")
            responses.append(next(stream))  # the drain lets the stream go on
            child.send_signal(second)
            responses.extend(stream)
        code = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    logged = lines.rest()
    assert code == 128 + second
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    tokens = token_ids_of(responses)
    assert 0 < len(tokens) < 1000 and tokens == echo([1, 2], len(tokens))
    forced = [line for line in logged if "during the drain" in line]
    assert len(forced) == 1, logged
    assert f"{second.name} during the drain: exiting now, aborting the requests in flight (1)" in forced[0]
    assert not any("Traceback" in line for line in logged), logged


# --- start errors


def test_a_metrics_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "serving.main", "--port", "0", "--metrics-port", str(port)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: cannot serve metrics on 127.0.0.1:{port}: Address already in use"]
