"""The server's connections: clients' keepalive pings, a second signal during the drain, TLS, the shared token,
serving beyond loopback, and start errors (bad TLS or token files, a metrics port in use). Over real loopback
channels and processes, with test_server's fake engine and scheduler (no model, nothing compiled)."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import queue
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from paths import REPO
from test_server import (
    CONFIG,
    FakeEngine,
    FakeScheduler,
    echo,
    request,
    status_of,
    token_ids_of,
    wait_until,
)

from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import TextConfig, load_config
from inkling_jax.tokenizer import Tokenizer
from serving import client as cli
from serving import main as server_main
from serving import server as server_module
from serving.connection import Tls, exposure_warning, load_tls, token_metadata
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc
from serving.server import SERVICE_NAME, Server, serve

StatusCode = grpc.StatusCode
TOKEN = "s3cret-token_0123456789"
# a client that pings every second, on idle connections too, and never stops for lack of data
PINGING = (
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
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


@dataclasses.dataclass
class Files:
    cert: str  # self-signed, for 127.0.0.1 and localhost
    key: str
    other_cert: str  # another self-signed pair
    other_key: str
    encrypted_key: str  # `key`, encrypted
    token: str  # holds TOKEN and a newline


def _self_signed(directory: Path, name: str) -> tuple[Path, Path, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path, key


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    directory = tmp_path_factory.mktemp("tls")
    cert, key, private = _self_signed(directory, "server")
    other_cert, other_key, _ = _self_signed(directory, "other")
    encrypted = directory / "encrypted.key"
    encryption = serialization.BestAvailableEncryption(b"passphrase")
    pkcs8 = serialization.PrivateFormat.PKCS8
    encrypted.write_bytes(private.private_bytes(serialization.Encoding.PEM, pkcs8, encryption))
    (directory / "token").write_text(TOKEN + "\n")
    return Files(*(str(path) for path in (cert, key, other_cert, other_key, encrypted, directory / "token")))


@pytest.fixture
def launch(model: Model) -> Iterator[Callable[..., tuple[Server, FakeScheduler]]]:
    """launch(scheduler_class=FakeScheduler, tls=None, auth_token=None, metrics_port=None) -> (server, scheduler)."""
    started: list[tuple[Server, FakeScheduler]] = []

    def launch_server(
        scheduler_class: type[FakeScheduler] = FakeScheduler,
        *,
        tls: Tls | None = None,
        auth_token: str | None = None,
        metrics_port: int | None = None,
    ) -> tuple[Server, FakeScheduler]:
        engine = FakeEngine(model.text, model.tokenizer, model.checkpoint)
        scheduler = scheduler_class(engine)
        started.append((serve(scheduler, engine, "127.0.0.1", 0, metrics_port, tls, auth_token), scheduler))
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}, {str(REPO / 'tests' / 'serving')!r}]; "
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


@pytest.mark.slow
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


# --- TLS


def test_tls_serves_grpc_and_metrics_with_the_certificate(launch, files):
    server, _ = launch(tls=load_tls(files.cert, files.key), metrics_port=0)
    credentials = grpc.ssl_channel_credentials(Path(files.cert).read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{server.port}", credentials) as channel:
        responses = list(pb_grpc.InklingStub(channel).Generate(request([7, 8, 9], max_tokens=5)))
        assert token_ids_of(responses) == echo([7, 8, 9], 5)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as plain:
        assert status_of(lambda: health_check(plain))[0] == StatusCode.UNAVAILABLE
    untrusted = grpc.ssl_channel_credentials(Path(files.other_cert).read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{server.port}", untrusted) as channel:
        assert status_of(lambda: health_check(channel))[0] == StatusCode.UNAVAILABLE
    context = ssl.create_default_context(cafile=files.cert)
    page = urllib.request.urlopen(f"https://127.0.0.1:{server.metrics_port}/metrics", context=context, timeout=10)
    assert "inkling_generation_tokens_total 5.0" in page.read().decode()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)


# --- the token


def test_the_token_is_asked_of_every_call_but_health_and_reflection(launch):
    server, scheduler = launch(auth_token=TOKEN, metrics_port=0)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.InklingStub(channel)
        good = token_metadata(TOKEN)
        responses = list(stub.Generate(request([5, 6], max_tokens=4), metadata=good))
        assert token_ids_of(responses) == echo([5, 6], 4)
        lower_case = (("authorization", f"bearer {TOKEN}"),)  # the scheme in any case
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=lower_case).has_tokenizer
        prompts_seen = scheduler.stats().prompt_tokens
        for metadata, fragment in [
            ((), "needs a token"),
            (token_metadata(TOKEN + "x"), "not valid"),
            (token_metadata(TOKEN[:-1]), "not valid"),
            ((("authorization", f"Basic {TOKEN}"),), "not valid"),
            ((("x-token", TOKEN),), "needs a token"),
        ]:
            for call in (
                lambda sent: list(stub.Generate(request([5, 6], max_tokens=4), metadata=sent)),
                lambda sent: stub.Tokenize(pb.TokenizeRequest(text="hello"), metadata=sent),
                lambda sent: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=sent),
            ):
                status, details = status_of(lambda: call(metadata))  # noqa: B023 (called at once)
                assert status == StatusCode.UNAUTHENTICATED and fragment in details, (metadata, details)
        assert scheduler.stats().prompt_tokens == prompts_seen  # refused before reaching the scheduler
        wait_until(lambda: health_check(channel) == health_pb2.HealthCheckResponse.SERVING)  # no token needed
        assert SERVICE_NAME in ProtoReflectionDescriptorDatabase(channel).get_services()
        assert DescriptorPool(ProtoReflectionDescriptorDatabase(channel)).FindServiceByName(SERVICE_NAME).methods
    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(metrics, timeout=10)
    assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(urllib.request.Request(metrics, headers={"Authorization": "Bearer nope"}), timeout=10)
    assert wrong.value.code == 401
    page = urllib.request.urlopen(urllib.request.Request(metrics, headers={"Authorization": f"Bearer {TOKEN}"}))
    assert "inkling_generation_tokens_total 4.0" in page.read().decode()


def test_client_cli_with_tls_and_a_token(launch, files, tmp_path, capsys):
    server, _ = launch(tls=load_tls(files.cert, files.key), auth_token=TOKEN)
    address = ["--address", f"127.0.0.1:{server.port}"]
    secured = ["--tls-ca", files.cert, "--auth-token-file", files.token]
    assert cli.main([*address, *secured, "Hi", "--max-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hi") and "[length; prompt" in err
    assert cli.main([*address, *secured, "--info"]) == 0
    assert '"max_context": 4096' in capsys.readouterr().out
    assert cli.main([*address, "--tls-ca", files.cert, "Hi"]) == 1
    assert "UNAUTHENTICATED: this server needs a token" in capsys.readouterr().err
    assert cli.main([*address, "--tls-ca", files.other_cert, "--auth-token-file", files.token, "Hi"]) == 1
    assert "no TLS connection" in capsys.readouterr().err
    for flags, fragment in [
        (["--tls-ca", files.key], f"--tls-ca {files.key}: holds no PEM certificate"),
        (["--auth-token-file", str(tmp_path / "missing")], "cannot read it"),
    ]:
        assert cli.main([*address, *flags, "Hi"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines


# --- start errors and the warning


def test_bad_tls_and_token_files_are_one_line_and_exit_2(files, tmp_path, capsys):
    missing, empty, spaced = tmp_path / "missing", tmp_path / "empty", tmp_path / "spaced"
    empty.write_text("\n")
    spaced.write_text("two words\n")
    tls = ["--tls-cert", files.cert, "--tls-key"]
    for argv, fragment in [
        (["--tls-cert", str(missing), "--tls-key", files.key], f"--tls-cert {missing}: cannot read it"),
        (["--tls-cert", files.key, "--tls-key", files.key], f"--tls-cert {files.key}: holds no PEM certificate"),
        ([*tls, files.other_key], f"--tls-key {files.other_key}: the key does not match the certificate"),
        ([*tls, files.cert], f"--tls-key {files.cert}: holds no PEM private key"),
        ([*tls, files.encrypted_key], f"--tls-key {files.encrypted_key}: the key is encrypted"),
        (["--auth-token-file", str(missing)], f"--auth-token-file {missing}: cannot read it"),
        (["--auth-token-file", str(empty)], "the file is empty"),
        (["--auth-token-file", str(spaced)], "one line of printable ASCII without spaces"),
    ]:
        assert server_main.main(["--port", "0", *argv]) == 2, argv
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (argv, lines)
    with pytest.raises(SystemExit) as exited:
        server_main.main(["--port", "0", "--tls-cert", files.cert])
    assert exited.value.code == 2 and "give both or neither" in capsys.readouterr().err


def test_a_metrics_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "serving.main", "--port", "0", "--metrics-port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: cannot serve metrics on 127.0.0.1:{port}: Address already in use"]


def test_serving_beyond_loopback_warns_unless_tls_and_a_token(files, tmp_path, capsys):
    no_model = ["--checkpoint", str(tmp_path), "--port", "0"]  # starts, listens, then fails to load: exit 2
    assert server_main.main([*no_model, "--host", "0.0.0.0"]) == 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "0.0.0.0 is beyond loopback" in warnings[0]
    assert "unauthenticated" in warnings[0] and "unencrypted" in warnings[0]
    secured = ["--tls-cert", files.cert, "--tls-key", files.key, "--auth-token-file", files.token]
    for argv in ([*no_model, "--host", "0.0.0.0", *secured], [*no_model, "--host", "127.0.0.1"]):
        assert server_main.main(argv) == 2
        err = capsys.readouterr().err
        assert "no config.json" in err and "warning:" not in err
    assert exposure_warning("localhost", 1, None, False, False) is None
    assert exposure_warning("::1", 1, 2, False, False) is None
    token_only = exposure_warning("0.0.0.0", 50051, 9090, False, True)
    assert "the gRPC API (port 50051) and the metrics endpoint (port 9090) are unencrypted" in token_only
    assert "unauthenticated" not in token_only
    tls_only = exposure_warning("::", 50051, None, True, False)
    assert "the gRPC API (port 50051) is unauthenticated" in tls_only and "unencrypted" not in tls_only
