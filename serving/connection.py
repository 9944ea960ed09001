"""The connection side of the server: keepalive, TLS, the shared token, and what binding beyond loopback exposes.

Keepalive (`KEEPALIVE_OPTIONS`). gRPC servers by default take a client's ping sent less than 5 minutes after the
previous one, while the server sends nothing, as abuse, and the third such ping closes the connection (GOAWAY
ENHANCE_YOUR_CALM "too_many_pings"); a ping on a connection without calls is abuse unless permitted. The SMG
gateway pings its workers every 30 s whether or not calls are open (10 s timeout), and a long prefill or an idle
connection sends nothing, so with the defaults the gateway's connection would be cut in the middle of a prefill.
The server therefore permits pings without calls (as vLLM's gRPC server does) and takes pings as often as every
second: its floor is half that, as timer and scheduling jitter can bring two pings a second apart closer together
on arrival, and strikes add up for as long as the server sends nothing. gRPC's own limit of two strikes is kept,
so a client pinging faster than the floor is still cut off. The server pings each connection itself every 30 s
(gRPC's default: 2 hours) and closes it when no ack comes within 20 s (gRPC's default), also while it sends no
data (by default it stops pinging after two pings without data), so the streams of a client that vanished without
closing its connection (a dead host, a partition) are cancelled, and their slots freed, within a minute. The
option that sets the floor is `grpc.http2.min_ping_interval_without_data_ms`: gRPC core's C macro calls it
GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, but a `grpc.http2.min_recv_ping_interval_without_data_ms`
option (a name some servers pass) is no option of gRPC's and is silently ignored.

TLS (`load_tls`): a certificate chain and its unencrypted private key in PEM, checked to load and to match before
anything is served; the gRPC port and the metrics endpoint serve them.

The shared token (`read_token`, `TokenInterceptor`): clients send the metadata `authorization: Bearer <token>`;
a call without it, or with another token, gets UNAUTHENTICATED, compared in constant time. grpc.health.v1 and
server reflection stay open, so that load balancers and probes work without the token; the metrics endpoint asks
for the same token (`token_matches`).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
)
# services any client may call without the token: health checks (load balancers, probes) and reflection
OPEN_SERVICES = frozenset((health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME))
TOKEN_HEADER = "authorization"
TOKEN_SCHEME = "bearer"


class ConnectionSetupError(Exception):
    """A TLS or token file that cannot be used; the message names the file and what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class Tls:
    """A server certificate chain and its private key (PEM), known to load and to match."""

    certificate_chain: bytes
    private_key: bytes = dataclasses.field(repr=False)  # never in a log line or a traceback
    context: ssl.SSLContext  # the same pair for HTTPS (the metrics endpoint)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)])


def read_file(path: str, flag: str) -> bytes:
    """The bytes of the file a flag names, or ConnectionSetupError naming the flag, the file and why not."""
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConnectionSetupError(f"{flag} {path}: cannot read it: {error.strerror or error}") from None


def read_certificates(path: str, flag: str) -> bytes:
    """The PEM certificates in `path` (a chain, or the CA certificates a client trusts)."""
    data = read_file(path, flag)
    try:
        ssl.create_default_context(cadata=data.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError):
        raise ConnectionSetupError(f"{flag} {path}: holds no PEM certificate") from None
    return data


def load_tls(cert_path: str, key_path: str) -> Tls:
    """The server's certificate chain and private key, or ConnectionSetupError naming the file at fault."""
    chain = read_certificates(cert_path, "--tls-cert")
    key = read_file(key_path, "--tls-key")

    def encrypted() -> bytes:
        raise ConnectionSetupError(f"--tls-key {key_path}: the key is encrypted; give it unencrypted")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_path, key_path, password=encrypted)
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            raise ConnectionSetupError(
                f"--tls-key {key_path}: the key does not match the certificate in --tls-cert {cert_path}"
            ) from None
        raise ConnectionSetupError(f"--tls-key {key_path}: holds no PEM private key") from None
    except OSError as error:  # a file replaced or removed since it was read
        raise ConnectionSetupError(f"--tls-cert / --tls-key: {error.strerror or error}") from None
    return Tls(chain, key, context)


def read_token(path: str) -> str:
    """The shared token in `path`: one line of printable ASCII without spaces (a final newline is dropped)."""
    data = read_file(path, "--auth-token-file")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConnectionSetupError(f"--auth-token-file {path}: the token must be ASCII") from None
    if not token:
        raise ConnectionSetupError(f"--auth-token-file {path}: the file is empty")
    if not all("!" <= character <= "~" for character in token):
        raise ConnectionSetupError(
            f"--auth-token-file {path}: the token must be one line of printable ASCII without spaces"
        )
    return token


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token`."""
    return ((TOKEN_HEADER, f"Bearer {token}"),)


def token_matches(value: str | None, token: bytes) -> bool:
    """Whether an authorization value (`Bearer <token>`, the scheme in any case) carries `token`; the tokens are
    compared in constant time."""
    scheme, _, given = (value or "").partition(" ")
    return scheme.lower() == TOKEN_SCHEME and hmac.compare_digest(given.strip().encode(), token)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the shared token (UNAUTHENTICATED), except to `OPEN_SERVICES`."""

    def __init__(self, token: str):
        self._token = token.encode()
        self._missing = _refusal(f"this server needs a token: send the metadata '{TOKEN_HEADER}: Bearer <token>'")
        self._wrong = _refusal("the token is not valid")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.removeprefix("/").partition("/")[0] in OPEN_SERVICES:
            return await continuation(details)
        values = [value for key, value in details.invocation_metadata or () if key == TOKEN_HEADER]
        if not values:
            return self._missing
        if not any(isinstance(value, str) and token_matches(value, self._token) for value in values):
            return self._wrong
        return await continuation(details)


def _refusal(message: str) -> grpc.RpcMethodHandler:
    """A handler that ends any call (unary or streaming: it reads no message) with UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(refuse)


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (127.0.0.0/8, ::1); unresolvable: no."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)


def exposure_warning(host: str, port: int, metrics_port: int | None, tls: bool, token: bool) -> str | None:
    """What serving on `host` exposes without TLS or a token, or None (loopback, or both configured)."""
    if (tls and token) or is_loopback(host):
        return None
    what = f"the gRPC API (port {port})"
    if metrics_port is not None:
        what += f" and the metrics endpoint (port {metrics_port})"
    missing = []
    if not token:
        missing.append("unauthenticated (anyone who reaches the port can run requests; give --auth-token-file)")
    if not tls:
        missing.append("unencrypted (prompts, outputs and tokens travel in clear; give --tls-cert and --tls-key)")
    return f"warning: {host} is beyond loopback, and {what} {'are' if metrics_port is not None else 'is'} " + (
        " and ".join(missing)
    )
