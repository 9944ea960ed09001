"""The server's connections: clients' keepalive pings. Over real loopback channels, with test_server's fake engine
and scheduler (no model, nothing compiled)."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server import CONFIG, FakeEngine, FakeScheduler, echo, request, token_ids_of, wait_until

from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import TextConfig, load_config
from inkling_jax.tokenizer import Tokenizer
from serving import server as server_module
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc
from serving.server import Server, serve

# a client that pings every second, on idle connections too, and never stops for lack of data
PINGING = (("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
           ("grpc.http2.max_pings_without_data", 0))  # fmt: skip
QUIET_SECONDS = 5.0  # an idle connection, and a prefill that sends nothing, last this long: five pings


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
