"""Prometheus metrics of the server, on an HTTP port of their own (`--metrics-port`).

The endpoint serves HTTPS with the gRPC port's certificate when the server has TLS, and asks for the gRPC port's
token (`Authorization: Bearer <token>`, 401 otherwise) when it has one: a scraper configured for one port is
configured for both.

Per-request latencies (time to first token, time per output token) and finished / refused request
counts are observed by the servicer as requests run. The scheduler's state (queue length, running
sequences, KV pages, preemptions, token counters) is read from `Scheduler.stats()` on every scrape, so
it is never stale; generated tokens per second is the rate over the last `THROUGHPUT_WINDOW` seconds of
the samples the server takes once a second.
"""

from __future__ import annotations

import collections
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.connection import token_matches

THROUGHPUT_WINDOW = 10.0  # seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
ACCEPTANCE_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0)
CONNECTION_TIMEOUT = 10.0  # seconds a metrics client may take over a TLS handshake, or over one read


class Stats(Protocol):
    """What `Scheduler.stats()` returns (`inkling_jax.runtime.scheduler.Stats`)."""

    waiting: int
    running: int
    pages_used: int
    pages_total: int
    preemptions: int
    generated_tokens: int
    prompt_tokens: int
    speculative_rounds: int
    speculative_tokens: int
    image_rows_used: int
    image_rows_total: int


class StatsSource(Protocol):
    def stats(self) -> Stats: ...


class Metrics:
    """The server's metrics registry; the scheduler's part appears once `attach` gives it a scheduler."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "inkling_time_to_first_token_seconds",
            "From receiving a Generate call to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "inkling_time_per_output_token_seconds",
            "Mean time between a request's generated tokens after the first (one observation per request)",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.acceptance_length = Histogram(
            "inkling_speculative_acceptance_length",
            "Tokens emitted per speculative round (accepted drafts + 1), one observation per request that ran rounds",
            buckets=ACCEPTANCE_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            "inkling_requests_finished",
            "Generate calls that ran, by how they ended (stop, length, abort, cancelled, error)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.requests_refused = Counter(
            "inkling_requests_refused",
            "Generate calls refused before generating, by gRPC status code",
            ["code"],
            registry=self.registry,
        )
        self._throughput = _Throughput(THROUGHPUT_WINDOW)
        self._scheduler: StatsSource | None = None
        self.registry.register(_SchedulerCollector(self))
        self._http = None

    def attach(self, scheduler: StatsSource) -> None:
        self._scheduler = scheduler

    def stats(self) -> Stats | None:
        return self._scheduler.stats() if self._scheduler is not None else None

    def sample_throughput(self) -> None:
        """Record the generated-token counter now (the server calls this once a second)."""
        stats = self.stats()
        if stats is not None:
            self._throughput.add(time.monotonic(), stats.generated_tokens)

    def tokens_per_second(self) -> float:
        return self._throughput.rate()

    def serve_http(self, host: str, port: int, tls: ssl.SSLContext | None = None, token: str | None = None) -> int:
        """Serve /metrics on host:port (0: a free port), over HTTPS with `tls`, only to requests bearing `token`
        when one is given; returns the port bound. OSError when the address cannot be bound."""
        app = make_wsgi_app(self.registry)
        if token is not None:
            app = _bearer_only(app, token.encode())
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsServer", (_MetricsServer,), {"address_family": family, "tls": tls})
        self._http = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection; with `tls`, each connection's handshake runs in its thread, within
    CONNECTION_TIMEOUT, so that no client holds up the others."""

    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(CONNECTION_TIMEOUT)
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        try:
            secure = self.tls.wrap_socket(request, server_side=True)
        except OSError:  # a client that does not speak TLS, or not in time: nothing to answer
            return
        with secure:
            super().finish_request(secure, client_address)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


def _bearer_only(app: Callable[..., Iterable[bytes]], token: bytes) -> Callable[..., Iterable[bytes]]:
    """The WSGI app, for requests whose Authorization header carries `token`; 401 for the others."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if token_matches(environ.get("HTTP_AUTHORIZATION"), token):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")])
        return [b"this endpoint needs a token: send the header 'Authorization: Bearer <token>'\n"]

    return guarded


class _Throughput:
    """Rate of a growing counter over a sliding window of timed samples."""

    def __init__(self, window: float):
        self.window = window
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, now: float, count: int) -> None:
        with self._lock:
            self._samples.append((now, count))
            while self._samples and self._samples[0][0] < now - self.window:
                self._samples.popleft()

    def rate(self) -> float:
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            (start, first), (end, last) = self._samples[0], self._samples[-1]
        return (last - first) / (end - start) if end > start else 0.0


class _SchedulerCollector(Collector):
    """The scheduler's gauges and counters, read fresh on each scrape."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self._metrics.stats()
        if stats is None:
            return
        yield GaugeMetricFamily("inkling_requests_waiting", "Requests queued for a slot", value=stats.waiting)
        yield GaugeMetricFamily("inkling_requests_running", "Sequences holding a slot", value=stats.running)
        yield GaugeMetricFamily("inkling_kv_pages_used", "KV-cache pages in use", value=stats.pages_used)
        yield GaugeMetricFamily("inkling_kv_pages_total", "KV-cache pages in the pool", value=stats.pages_total)
        usage = stats.pages_used / stats.pages_total if stats.pages_total else 0.0
        yield GaugeMetricFamily("inkling_kv_cache_usage_ratio", "Fraction of KV-cache pages in use", value=usage)
        yield GaugeMetricFamily(
            "inkling_image_feature_rows_used",
            "Image feature pool rows the admitted requests hold",
            value=stats.image_rows_used,
        )
        yield GaugeMetricFamily(
            "inkling_image_feature_rows_total", "Image feature pool rows (0: no images)", value=stats.image_rows_total
        )
        yield CounterMetricFamily("inkling_preemptions", "Sequences preempted to free pages", value=stats.preemptions)
        yield CounterMetricFamily("inkling_prompt_tokens", "Prompt tokens prefilled", value=stats.prompt_tokens)
        yield CounterMetricFamily(
            "inkling_prefix_cache_hit_tokens",
            "Prompt tokens taken from the prefix cache (hit rate: over inkling_prompt_tokens)",
            value=stats.cached_tokens,
        )
        yield GaugeMetricFamily(
            "inkling_prefix_cache_pages", "KV-cache pages the prefix cache holds", value=stats.cached_pages
        )
        yield CounterMetricFamily(
            "inkling_prefix_cache_evictions", "Cached pages evicted for new ones", value=stats.evicted_pages
        )
        yield CounterMetricFamily("inkling_generation_tokens", "Tokens generated", value=stats.generated_tokens)
        yield CounterMetricFamily(
            "inkling_speculative_rounds", "Speculative rounds (draft, verify) run", value=stats.speculative_rounds
        )
        yield CounterMetricFamily(
            "inkling_speculative_tokens",
            "Tokens emitted by speculative rounds (over the rounds: the mean acceptance length)",
            value=stats.speculative_tokens,
        )
        yield GaugeMetricFamily(
            "inkling_generation_tokens_per_second",
            f"Tokens generated per second over the last {THROUGHPUT_WINDOW:g} s",
            value=self._metrics.tokens_per_second(),
        )
