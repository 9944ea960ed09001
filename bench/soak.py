"""Soak test of the gRPC server: a long randomized mixed load on loopback, and the checks that must hold throughout.

    python -m bench.soak [--minutes 30] [--dtype float32|bfloat16] [--out bench/results/soak_tiny_cpu.md]
        [--checkpoint DIR] [--seed N] [--reference-minutes M] [--kv-pages 32] [--max-num-seqs 8]
        [--rss-tolerance-mb 32] [--log FILE]

It starts `python -m serving.main` as a subprocess (default: the embedded tiny synthetic checkpoint) on free ports,
with a KV page pool of `--kv-pages` pages (32: the fewest that hold one sequence of the tiny model's whole context),
so that concurrent long sequences must be preempted, and drives it over several gRPC channels for `--minutes`, in
rounds of random length and concurrency. Each worker of a round sends calls of random kinds: streams with text or
token-id prompts of random lengths, greedy or sampled with an explicit seed, stop strings and stop ids, log-probs
sometimes; streams the client cancels after some tokens or at a random time (queued, prefilling or decoding);
streams with a tight deadline; bad requests of many kinds (each with the status it must get); a request id reused
while its first call is in flight; Tokenize, Detokenize and GetModelInfo. Rounds may open with a burst of short
streams, or of long prompts that overfill the page pool. Meanwhile health is polled, the server's RSS sampled
(/proc/PID/status) and its metrics scraped.

Checks (the report lists each; the exit status is 1 when any fails):
- every call ends once, with its expected status; an OK stream ends with exactly one finish message, its last;
  every message carries the call's request id; usage counts the prompt ids and the tokens received; LENGTH means
  max_tokens tokens; STOP means a matched stop string or a stop token (a stop id, or EOS unless ignored) at the end;
  no stop token earlier and no stop string in the text; log-probs one per token with n top entries, descending;
  refusals carry a message;
- nothing lost, duplicated or misordered: after the load, streams are run again alone, one at a time, through the
  same server (those that were preempted first, then a random sample, within `--reference-minutes`): an OK stream's
  token ids, text, finish reason, stop and usage must equal the reference's; a cancelled or timed-out stream's tokens
  must equal the same request's cut at that many tokens; each mismatch is reported with its request, where the
  tokens first differ and the 5 most likely tokens alone there (a near tie: arithmetic that depends on the batch);
- the server's counters agree with the client's calls (finished stop / length and refused by code equal; cancelled
  between the cancelled streams that had tokens and all cancelled or timed-out ones; no abort, no error);
- idle after every round: the metrics' running and waiting requests and used pages return to 0;
- preemptions happened (else the run did not exercise them);
- memory flat: the least-squares slope of RSS over the load's second half fails when the fitted rise over that half
  exceeds `--rss-tolerance-mb` and the slope is more than 3 standard errors above 0;
- health answers SERVING to every poll (the slowest answer is reported); Tokenize -> Detokenize round trips; the
  model info stays the same; no traceback in the server's log; the server exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from inkling_jax.cache import CacheBudgetError, layout_for_budget
from inkling_jax.config import load_config
from inkling_jax.score import DTYPES
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
# About 4.4 tokens a word with the synthetic tokenizer; the special token's text is parsed with parse_special_tokens.
WORDS = (
    "the", "model", "runs", "on", "TPU", "and", "GPU", "café", "数据", "🙂", "fast", "exact", "\n", "  ", "naïve",
    "Straße", "données", "модель", "σύστημα", "テスト", "한국어", "مرحبا", "1234", "3.14", "(x)", "don't", "—", "…",
    "<|end_message|>",
)  # fmt: skip
LIKELY_STOPS = ("e", "a", "o", " ", "in", "\n", "数", "🙂")
UNLIKELY_STOPS = ("zebra crossing", "ǂǂǂ", "the model runs on TPU", "<|end_message|>")
CONCURRENCY = (1, 2, 4, 8, 12, 16, 24, 32)
KINDS = {"generate": 52, "cancel": 10, "deadline": 6, "bad": 16, "unary": 12, "duplicate id": 4}  # weights
CHANNELS = 4
HEALTH_EVERY_S = 0.25
METRICS_EVERY_S = 5.0
IDLE_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 600.0  # an OK call's deadline: far beyond any call's time, so that a hang ends as a failure
CANCEL_MARGIN = 400  # tokens a stream cancelled after some tokens still wants then: it cannot finish first
BUSY = ("inkling_requests_running", "inkling_requests_waiting", "inkling_kv_pages_used")
PREEMPTED = re.compile(r"preempted (\S+) \(\d+ tokens\)")
OK = "OK"
Samples = dict[tuple[str, tuple], float]  # the metrics' samples: (name, sorted labels) -> value


@dataclasses.dataclass
class Settings:
    minutes: float = 30.0
    dtype: str = "float32"
    checkpoint: str | None = None  # None: the server's embedded synthetic checkpoint
    seed: int | None = None  # None: a random one (reported)
    reference_minutes: float | None = None  # None: half of `minutes`
    kv_pages: int = 32
    max_num_seqs: int = 8
    round_seconds: tuple[float, float] = (20.0, 60.0)
    concurrency: tuple[int, ...] = CONCURRENCY  # the workers a round may have (each round picks one at random)
    rss_every_s: float = 2.0
    rss_tolerance_mb: float = 32.0
    log: str | None = None  # the server's log file (None: a temporary one)


@dataclasses.dataclass(eq=False)
class Call:
    """One call: what it is, the status it must end with, and what came back."""

    kind: str  # its row in the report
    expected: str  # a grpc.StatusCode name
    method: str = "Generate"
    request: pb.GenerateRequest | None = None  # a Generate call's message (None: sent as raw bytes)
    outcome: str = ""  # the status it ended with
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)
    finish: int = 0
    finishes: int = 0  # messages with a finish reason
    usage: pb.Usage | None = None
    matched_stop: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.request.request_id})" if self.request is not None else self.kind

    def absorb(self, response: pb.GenerateResponse) -> None:
        """Take one streamed message, noting what breaks the stream's rules."""
        if self.finishes:
            self.problems.append("a message after the finish message")
        if response.request_id != self.request.request_id:
            self.problems.append(f"a message for request {response.request_id!r}")
        self.token_ids += response.token_ids
        self.text.append(response.text)
        if self.request.HasField("logprobs"):
            if len(response.logprobs) != len(response.token_ids):
                self.problems.append(f"{len(response.logprobs)} log-probs for {len(response.token_ids)} tokens")
            for entry in response.logprobs:
                tops = [top.logprob for top in entry.top]
                if len(tops) != self.request.logprobs or tops != sorted(tops, reverse=True):
                    self.problems.append(f"top log-probs {tops} for n = {self.request.logprobs}")
            self.logprobs += response.logprobs
        if response.finish_reason:
            self.finishes += 1
            self.finish, self.usage, self.matched_stop = response.finish_reason, response.usage, response.matched_stop


@dataclasses.dataclass
class Mismatch:
    """A stream whose output differs from the same request's alone."""

    call: Call
    reference: Call
    preempted: bool
    top_alone: list[tuple[int, float]]  # the 5 most likely tokens alone where the tokens first differ

    def describe(self) -> dict:
        got, alone = self.call.token_ids, self.reference.token_ids
        first = first_difference(got, alone)
        entry = {
            "id": self.call.request.request_id,
            "kind": self.call.kind,
            "preempted": self.preempted,
            "first_difference": first,
            "got": got[max(0, first - 2) : first + 6],
            "alone": alone[max(0, first - 2) : first + 6],
            "lengths": [len(got), len(alone)],
            "finish": [pb.FinishReason.Name(c.finish) for c in (self.call, self.reference)],
            "top_alone_at_difference": self.top_alone,
            "reference_outcome": self.reference.outcome,
            "request": json_format.MessageToDict(self.reference.request),
        }
        if first < min(len(self.call.logprobs), len(self.reference.logprobs)):
            entry["logprob_at_difference"] = [self.call.logprobs[first].logprob, self.reference.logprobs[first].logprob]
        return entry


def first_difference(got: list[int], alone: list[int]) -> int:
    """The first position where two token lists differ (the shorter one's length when one is a prefix)."""
    return next((i for i, (a, b) in enumerate(zip(got, alone, strict=False)) if a != b), min(len(got), len(alone)))


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# --- the server


class ServerProcess:
    """`python -m serving.main` in a subprocess on free ports, its output in a log file."""

    def __init__(self, settings: Settings):
        self.log = Path(settings.log or tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
        self.command = [
            sys.executable, "-m", "serving.main", "--port", "0", "--metrics-port", "0", "--dtype", settings.dtype,
            "--max-num-seqs", str(settings.max_num_seqs), "--kv-cache-mib", f"{kv_cache_mib(settings):g}",
        ]  # fmt: skip
        if settings.checkpoint:
            self.command += ["--checkpoint", settings.checkpoint]
        path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                self.command, cwd=REPO, env={**os.environ, "PYTHONPATH": path}, stdout=log, stderr=subprocess.STDOUT
            )
        self.address = self.metrics_url = ""

    def wait_serving(self, timeout: float = 1800.0) -> float:
        """Seconds until health says SERVING (the ports are read from the log); RuntimeError when the process exits
        or `timeout` passes first."""
        start = time.monotonic()
        while not (self.address and self.metrics_url):
            self._alive(start, timeout)
            text = self.log_text()
            if address := re.search(r"listening on (\S+):(\d+) ", text):
                self.address = f"{address[1]}:{address[2]}"
            if metrics := re.search(r"metrics on (http://\S+/metrics)", text):
                self.metrics_url = metrics[1]
            time.sleep(0.2)
        serving = health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=30).status != serving:
                self._alive(start, timeout)
                time.sleep(0.5)
        return time.monotonic() - start

    def _alive(self, start: float, timeout: float) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_text()[-3000:]}")
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"the server did not serve within {timeout:g} s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def rss_mb(self) -> float | None:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024

    def metrics(self) -> Samples:
        with urllib.request.urlopen(self.metrics_url, timeout=30) as response:
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM, then the exit status (None: still running after `timeout`, then killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def kv_cache_mib(settings: Settings) -> float:
    """The smallest --kv-cache-mib (a multiple of 1/64) whose page pool holds `settings.kv_pages` pages."""
    text = load_config(settings.checkpoint or REPO / "configs" / "tiny.json").text
    mib = 1 / 64
    while True:
        try:
            layout = layout_for_budget(
                text,
                int(mib * 2**20),
                max_num_seqs=settings.max_num_seqs,
                max_context=text.max_position_embeddings,
                max_chunk=64,
                dtype=DTYPES[settings.dtype],
            )
            if layout.num_pages >= settings.kv_pages:
                return mib
        except CacheBudgetError:
            pass
        mib += 1 / 64


class Watchers:
    """Health polls, RSS samples and metrics scrapes, each on a thread of its own until `close`."""

    def __init__(self, server: ServerProcess, settings: Settings):
        self.server = server
        self.health_polls = 0
        self.health_failures: list[str] = []
        self.slowest_health = 0.0
        self.rss: list[tuple[float, float]] = []  # (seconds since the load began, MB), until `close`
        self.load_seconds = 0.0  # when the load ended (`load_ended`)
        self.peaks: collections.Counter[str] = collections.Counter()  # the largest busy gauges seen
        self.scrape_failures: list[str] = []
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll_health, daemon=True),
            threading.Thread(target=self._every, args=(settings.rss_every_s, self._sample_rss), daemon=True),
            threading.Thread(target=self._every, args=(METRICS_EVERY_S, self._scrape), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _poll_health(self) -> None:
        with grpc.insecure_channel(self.server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not self._stop.wait(HEALTH_EVERY_S):
                start = time.perf_counter()
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
                    if status != health_pb2.HealthCheckResponse.SERVING:
                        self.health_failures.append(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
                except grpc.RpcError as error:
                    self.health_failures.append(error.code().name)
                self.slowest_health = max(self.slowest_health, time.perf_counter() - start)
                self.health_polls += 1

    def _every(self, seconds: float, sample: Callable[[], None]) -> None:
        sample()
        while not self._stop.wait(seconds):
            sample()

    def _sample_rss(self) -> None:
        rss = self.server.rss_mb()
        if rss is not None:
            self.rss.append((time.monotonic() - self._start, rss))

    def _scrape(self) -> None:
        try:
            samples = self.server.metrics()
        except OSError as error:
            self.scrape_failures.append(str(error))
            return
        for name in BUSY:
            self.peaks[name] = max(self.peaks[name], metric(samples, name))

    def load_ended(self) -> None:
        self.load_seconds = time.monotonic() - self._start

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


# --- the load


class Load:
    """The randomized calls, their records, and the rounds that send them."""

    def __init__(self, server: ServerProcess, info: pb.ModelInfo, rng: random.Random, settings: Settings):
        self.server, self.info, self.rng, self.settings = server, info, rng, settings
        self.vocab, self.context = info.unpadded_vocab_size, info.max_context
        self.calls: list[Call] = []
        self.rounds = self.bursts = self.long_bursts = 0
        self.concurrency_levels: set[int] = set()
        self.idle_checks: list[float] = []  # seconds each took to see the server idle
        self.idle_failures: list[str] = []
        self._ids = 0
        self._channels: list[grpc.aio.Channel] = []

    # requests

    def _new_id(self) -> str:
        self._ids += 1
        return f"s{self._ids}"

    def _ids_of(self, count: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(count)]

    def _text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def _size(self, short: tuple[int, int], medium: tuple[int, int], long: tuple[int, int]) -> int:
        roll = self.rng.random()
        return self.rng.randint(*(short if roll < 0.7 else medium if roll < 0.92 else long))

    def _sampling(self) -> pb.SamplingParams:
        seed = self.rng.randrange(2**32)
        if self.rng.random() < 0.35:
            return pb.SamplingParams(temperature=0.0, seed=seed)
        sampling = pb.SamplingParams(
            temperature=self.rng.choice((0.5, 0.8, 1.0, 1.3)),
            seed=seed,
            top_k=self.rng.choice((0, 0, 5, 40)),
            top_p=self.rng.choice((1.0, 0.9, 0.7)),
            min_p=self.rng.choice((0.0, 0.0, 0.05)),
        )
        if self.rng.random() < 0.3:
            sampling.repetition_penalty = self.rng.choice((1.1, 1.3, 0.9))
            sampling.presence_penalty = self.rng.uniform(-1, 1)
            sampling.frequency_penalty = self.rng.uniform(-1, 1)
        return sampling

    def _request(self, words: int, text: bool | None = None) -> pb.GenerateRequest:
        """A request with a fresh id and random sampling; its prompt text of `words` words or 4 ids a word (`text`
        None: either, at random)."""
        request = pb.GenerateRequest(request_id=self._new_id(), sampling=self._sampling())
        if text is None:
            text = self.rng.random() < 0.5
        if text:
            request.text = self._text(words)
            request.parse_special_tokens = self.rng.random() < 0.1
        else:
            request.token_ids.ids[:] = self._ids_of(4 * words)
        if self.rng.random() < 0.25:
            request.logprobs = self.rng.randint(0, 20)
        return request

    def ordinary(self, short: bool = False, text: bool | None = None) -> pb.GenerateRequest:
        """A stream that must end OK: a prompt of random size (of text or ids: `_request`), random stop conditions."""
        words = self.rng.randint(1, 8) if short else self._size((1, 15), (15, 120), (120, 500))
        request = self._request(words, text)
        request.stop.max_tokens = self.rng.randint(1, 24) if short else self._size((1, 64), (64, 256), (256, 600))
        if self.rng.random() < 0.25:
            pool = LIKELY_STOPS if self.rng.random() < 0.7 else UNLIKELY_STOPS
            request.stop.stop[:] = self.rng.sample(pool, self.rng.randint(1, 3))
        if self.rng.random() < 0.2:
            request.stop.stop_token_ids[:] = self._ids_of(self.rng.randint(1, 8))
        request.stop.ignore_eos = self.rng.random() < 0.05
        request.keep_special_tokens = self.rng.random() < 0.1
        return request

    def unending(self, words: int, max_tokens: int) -> pb.GenerateRequest:
        """A stream that cannot end by itself in the time it is given (max_tokens, ignore_eos, no stop)."""
        request = self._request(words)
        request.stop.max_tokens, request.stop.ignore_eos = max_tokens, True
        return request

    def bad_requests(self) -> list[tuple[str, str, Callable[[], tuple[str, object]]]]:
        """(name, expected status, build) of every kind of bad request; build gives (method, message or bytes)."""
        vocab, context = self.vocab, self.context
        invalid, out_of_range = "INVALID_ARGUMENT", "OUT_OF_RANGE"

        def generate(prompt: bool = True, **fields: object) -> Callable[[], tuple[str, object]]:
            """A Generate message of these fields (a callable is called for its value), with a short prompt of ids
            unless `prompt` is false."""

            def build() -> tuple[str, object]:
                values = {name: value() if callable(value) else value for name, value in fields.items()}
                if prompt:
                    values["token_ids"] = pb.TokenIds(ids=self._ids_of(self.rng.randint(1, 16)))
                return "Generate", pb.GenerateRequest(**{"request_id": self._new_id(), **values})

            return build

        def raw(method: str, data: bytes | Callable[[], bytes]) -> Callable[[], tuple[str, object]]:
            return lambda: (method, data() if callable(data) else data)

        def ids(count: int) -> Callable[[], pb.TokenIds]:
            return lambda: pb.TokenIds(ids=self._ids_of(count))

        return [
            ("temperature below 0", invalid, generate(sampling=pb.SamplingParams(temperature=-0.5))),
            ("temperature above 100", invalid, generate(sampling=pb.SamplingParams(temperature=101.0))),
            ("temperature NaN", invalid, generate(sampling=pb.SamplingParams(temperature=math.nan))),
            ("top_p 0", invalid, generate(sampling=pb.SamplingParams(top_p=0.0))),
            ("top_p above 1", invalid, generate(sampling=pb.SamplingParams(top_p=1.5))),
            ("top_k negative", invalid, generate(sampling=pb.SamplingParams(top_k=-3))),
            ("min_p above 1", invalid, generate(sampling=pb.SamplingParams(min_p=1.5))),
            ("repetition_penalty 0", invalid, generate(sampling=pb.SamplingParams(repetition_penalty=0.0))),
            ("presence_penalty above 2", invalid, generate(sampling=pb.SamplingParams(presence_penalty=2.5))),
            ("frequency_penalty below -2", invalid, generate(sampling=pb.SamplingParams(frequency_penalty=-3.0))),
            ("seed 2^32", invalid, generate(sampling=pb.SamplingParams(seed=2**32))),
            ("seed negative", invalid, generate(sampling=pb.SamplingParams(seed=-1))),
            ("logprobs 21", invalid, generate(logprobs=21)),
            ("logprobs negative", invalid, generate(logprobs=-1)),
            ("max_tokens 0", invalid, generate(stop=pb.StopConditions(max_tokens=0))),
            ("prompt id = vocabulary size", invalid, generate(False, token_ids=pb.TokenIds(ids=[1, vocab, 2]))),
            ("prompt id negative", invalid, generate(False, token_ids=pb.TokenIds(ids=[-1]))),
            ("prompt id in the padded rows", invalid,
             generate(False, token_ids=pb.TokenIds(ids=[self.info.vocab_size - 1]))),
            ("stop id outside the vocabulary", invalid, generate(stop=pb.StopConditions(stop_token_ids=[vocab + 7]))),
            ("empty token ids", invalid, generate(False, token_ids=pb.TokenIds())),
            ("empty text", invalid, generate(False, text="")),
            ("no prompt", invalid, generate(False)),
            ("65 stop strings", invalid, generate(stop=pb.StopConditions(stop=[f"s{i}" for i in range(65)]))),
            ("stop string of 1025 characters", invalid, generate(stop=pb.StopConditions(stop=["x" * 1025]))),
            ("empty stop string", invalid, generate(stop=pb.StopConditions(stop=[""]))),
            ("1025 stop ids", invalid, generate(stop=pb.StopConditions(stop_token_ids=[3] * 1025))),
            ("request id of 257 characters", invalid, generate(request_id="r" * 257)),
            ("context + 1 prompt ids", out_of_range, generate(False, token_ids=ids(context + 1))),
            ("prompt + max_tokens past the context", out_of_range,
             generate(False, token_ids=ids(context - 96), stop=pb.StopConditions(max_tokens=200))),
            ("text longer than any context (bytes)", out_of_range, generate(False, text="x" * (40 * context))),
            ("text past the context once tokenized", out_of_range,
             generate(False, text=lambda: self._text(context // 4))),
            ("undecodable bytes", invalid, raw("Generate", bytes([0x12, 4, 0xFF, 0xFE, 0xFD, 0xFC]))),
            ("text not UTF-8", invalid, raw("Generate", bytes([0x12, 2, 0xC3, 0x28]))),
            ("Tokenize: text longer than any context", out_of_range,
             raw("Tokenize", pb.TokenizeRequest(text="x" * (40 * context)).SerializeToString())),
            ("Tokenize: not UTF-8", invalid, raw("Tokenize", bytes([0x0A, 2, 0xC3, 0x28]))),
            ("Detokenize: id outside the vocabulary", invalid,
             raw("Detokenize", pb.DetokenizeRequest(token_ids=[1, vocab]).SerializeToString())),
            ("Detokenize: negative id", invalid,
             raw("Detokenize", pb.DetokenizeRequest(token_ids=[-2]).SerializeToString())),
            ("Detokenize: context + 1 ids", out_of_range,
             raw("Detokenize", lambda: pb.DetokenizeRequest(token_ids=self._ids_of(context + 1)).SerializeToString())),
        ]  # fmt: skip

    # calls

    def _channel(self) -> grpc.aio.Channel:
        return self.rng.choice(self._channels)

    async def send(self, call: Call, **options: object) -> Call:
        """Record the call, then stream it (`stream`'s options)."""
        self.calls.append(call)
        return await stream(pb_grpc.InklingStub(self._channel()), call, **options)

    async def generate(self, text: bool | None = None) -> None:
        request = self.ordinary(text=text)
        await self.send(
            Call("Generate: text" if request.HasField("text") else "Generate: token ids", OK, request=request)
        )

    async def cancel(self, at_a_time: bool | None = None) -> None:
        if at_a_time is None:
            at_a_time = self.rng.random() < 0.4
        if not at_a_time:
            after = self.rng.randint(1, 48)
            request = self.unending(self._size((1, 15), (15, 120), (120, 400)), after + CANCEL_MARGIN)
            await self.send(
                Call("Generate: cancelled after some tokens", "CANCELLED", request=request), cancel_after_tokens=after
            )
        else:  # often while queued or prefilling a long prompt
            request = self.unending(self._size((1, 15), (120, 400), (400, 600)), 1000)
            await self.send(
                Call("Generate: cancelled at a random time", "CANCELLED", request=request),
                cancel_after_s=self.rng.uniform(0.0, 1.5),
            )

    async def deadline(self) -> None:
        request = self.unending(self._size((1, 15), (15, 120), (120, 300)), self.rng.randint(1500, 2500))
        await self.send(
            Call("Generate: tight deadline", "DEADLINE_EXCEEDED", request=request), timeout=self.rng.uniform(0.05, 3.0)
        )

    async def duplicate_id(self) -> None:
        """A second call with the request id of a stream in flight: ALREADY_EXISTS; then the first is cancelled."""
        first = Call("Generate: duplicate id, the first call", "CANCELLED", request=self.unending(4, 2000))
        self.calls.append(first)
        stub = pb_grpc.InklingStub(self._channel())
        rpc = stub.Generate(first.request, timeout=CALL_TIMEOUT_S)

        async def second_then_cancel() -> None:
            request = self.ordinary(short=True)
            request.request_id = first.request.request_id
            await self.send(Call("Generate: duplicate id, the second call", "ALREADY_EXISTS", request=request))
            rpc.cancel()

        duplicate = None
        try:
            async for response in rpc:
                first.absorb(response)
                if duplicate is None and first.token_ids:
                    duplicate = asyncio.ensure_future(second_then_cancel())
        except asyncio.CancelledError:
            if not rpc.cancelled():
                raise
        except grpc.aio.AioRpcError:
            pass
        if duplicate is not None:
            await duplicate
        first.outcome = (await rpc.code()).name

    async def bad(self, index: int | None = None) -> None:
        """One of `bad_requests` (`index` None: any)."""
        bad = self.bad_requests()
        name, expected, build = bad[self.rng.randrange(len(bad)) if index is None else index]
        method, payload = build()
        if isinstance(payload, pb.GenerateRequest):
            await self.send(Call(f"bad: {name}", expected, request=payload))
            return
        call = Call(f"bad: {name}", expected, method=method)
        self.calls.append(call)
        channel = self._channel()
        path = f"/{pb.DESCRIPTOR.services_by_name['Inkling'].full_name}/{method}"
        if method == "Generate":
            rpc = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S)
        else:
            rpc = channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S)
        try:
            if method == "Generate":
                async for _ in rpc:
                    call.problems.append("a message on a refused call")
            else:
                await rpc
        except grpc.aio.AioRpcError:
            pass
        await ended(rpc, call)

    async def unary(self, kind: int | None = None) -> None:
        """Tokenize then Detokenize (0), Detokenize (1) or GetModelInfo (2); `kind` None: any."""
        stub = pb_grpc.InklingStub(self._channel())
        kind = self.rng.randrange(3) if kind is None else kind
        call = Call(("Tokenize, then Detokenize", "Detokenize", "GetModelInfo")[kind], OK, method="unary")
        self.calls.append(call)
        try:
            if kind == 0:
                text = self._text(self.rng.randint(1, 200))
                ids = (await stub.Tokenize(pb.TokenizeRequest(text=text), timeout=CALL_TIMEOUT_S)).token_ids
                back = (await stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=CALL_TIMEOUT_S)).text
                if back != text:
                    call.problems.append(f"Detokenize(Tokenize(text)) differs: {text[:60]!r} -> {back[:60]!r}")
            elif kind == 1:
                ids = self._ids_of(self.rng.randint(0, 300))
                skip = self.rng.random() < 0.5
                await stub.Detokenize(
                    pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip), timeout=CALL_TIMEOUT_S
                )
            elif await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S) != self.info:
                call.problems.append("the model info changed")
            call.outcome = OK
        except grpc.aio.AioRpcError as error:
            call.outcome = error.code().name

    # rounds

    async def worker(self, until: float) -> None:
        kinds = {
            "generate": self.generate,
            "cancel": self.cancel,
            "deadline": self.deadline,
            "bad": self.bad,
            "unary": self.unary,
            "duplicate id": self.duplicate_id,
        }
        while time.monotonic() < until:
            await kinds[self.rng.choices(list(KINDS), list(KINDS.values()))[0]]()

    def every_kind(self) -> list[Awaitable[None]]:
        """One call of every kind and variant, every bad request included."""
        return [
            self.generate(text=True),
            self.generate(text=False),
            self.cancel(at_a_time=False),
            self.cancel(at_a_time=True),
            self.deadline(),
            self.duplicate_id(),
            *(self.unary(k) for k in range(3)),
            *(self.bad(i) for i in range(len(self.bad_requests()))),
        ]

    def burst(self) -> list[Awaitable[Call]]:
        """16-64 short streams at once."""
        self.bursts += 1
        return [
            self.send(Call("Generate: burst", OK, request=self.ordinary(short=True)))
            for _ in range(self.rng.randint(16, 64))
        ]

    def long_burst(self) -> list[Awaitable[Call]]:
        """Slots to 2x slots prompts of 400-700 ids at once, each decoding past the end of the page its prompt ends
        in (ignore_eos): more than the page pool holds, and the sequences the pool admits all grow, so some are
        preempted."""
        self.long_bursts += 1
        calls = []
        for _ in range(self.rng.randint(self.settings.max_num_seqs, 2 * self.settings.max_num_seqs)):
            request = pb.GenerateRequest(request_id=self._new_id(), sampling=self._sampling())
            request.token_ids.ids[:] = self._ids_of(self.rng.randint(400, 700))
            request.stop.max_tokens = self.info.page_size + self.rng.randint(1, 32)
            request.stop.ignore_eos = True
            if self.rng.random() < 0.25:
                request.logprobs = self.rng.randint(0, 20)
            calls.append(self.send(Call("Generate: long-prompt burst", OK, request=request)))
        return calls

    async def run(self, seconds: float) -> None:
        """Rounds until `seconds` have passed, each followed by an idle check; the first opens with a burst of long
        prompts and one call of every kind."""
        self._channels = [grpc.aio.insecure_channel(self.server.address) for _ in range(CHANNELS)]
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                until = min(end, time.monotonic() + self.rng.uniform(*self.settings.round_seconds))
                concurrency = self.rng.choice(self.settings.concurrency)
                self.concurrency_levels.add(concurrency)
                tasks = [self.worker(until) for _ in range(concurrency)]
                if self.rounds == 0:
                    tasks += self.long_burst() + self.every_kind()
                elif self.rng.random() < 0.25:
                    tasks += self.long_burst()
                if self.rng.random() < 0.3:
                    tasks += self.burst()
                self.rounds += 1
                await asyncio.gather(*tasks)
                await asyncio.get_running_loop().run_in_executor(None, self.check_idle)
        finally:
            for channel in self._channels:
                await channel.close()

    def check_idle(self) -> None:
        """With no call in flight: the server's running and waiting requests and used pages return to 0."""
        start = time.monotonic()
        while True:
            try:
                busy = {name: metric(self.server.metrics(), name) for name in BUSY}
            except OSError as error:
                self.idle_failures.append(f"after round {self.rounds}: metrics failed: {error}")
                return
            if not any(busy.values()):
                self.idle_checks.append(time.monotonic() - start)
                return
            if time.monotonic() - start > IDLE_TIMEOUT_S:
                self.idle_failures.append(f"after round {self.rounds}, {IDLE_TIMEOUT_S:g} s without a call: {busy}")
                return
            time.sleep(0.1)

    # references

    async def references(self, seconds: float, preempted: set[str]) -> tuple[list[Call], list[Mismatch]]:
        """Streams run again alone, one at a time: the preempted first, then the others in random order, until
        `seconds` have passed. Returns the streams checked and the mismatches."""
        candidates = [
            c
            for c in self.calls
            if c.request is not None
            and c.outcome == c.expected
            and (c.outcome == OK or c.token_ids)
            and c.outcome in (OK, "CANCELLED", "DEADLINE_EXCEEDED")
        ]
        self.rng.shuffle(candidates)
        candidates.sort(key=lambda c: c.request.request_id not in preempted)
        checked, mismatches = [], []
        end = time.monotonic() + seconds
        async with grpc.aio.insecure_channel(self.server.address) as channel:
            stub = pb_grpc.InklingStub(channel)
            for call in candidates:
                if time.monotonic() >= end:
                    break
                request = pb.GenerateRequest()
                request.CopyFrom(call.request)
                request.request_id = f"alone-{call.request.request_id}"
                if call.outcome != OK:  # the same request, cut where the stream ended
                    request.stop.max_tokens = len(call.token_ids)
                reference = await stream(stub, Call(call.kind, OK, request=request))
                checked.append(call)
                if reference.outcome != OK or reference.problems or not same_output(call, reference):
                    top = await top_at(stub, request, first_difference(call.token_ids, reference.token_ids))
                    mismatches.append(Mismatch(call, reference, call.request.request_id in preempted, top))
        return checked, mismatches


async def top_at(stub: pb_grpc.InklingStub, request: pb.GenerateRequest, position: int) -> list[tuple[int, float]]:
    """The 5 most likely tokens (id, log-probability) at `position` of the request's output alone: at a mismatch, a
    near tie there points to arithmetic that depends on the batch, not to a lost or misordered token."""
    probe = pb.GenerateRequest()
    probe.CopyFrom(request)
    probe.request_id, probe.logprobs = f"{request.request_id}-top", 5
    result = await stream(stub, Call("top", OK, request=probe))
    if position >= len(result.logprobs):
        return []
    return [(top.token_id, round(top.logprob, 4)) for top in result.logprobs[position].top]


async def stream(
    stub: pb_grpc.InklingStub,
    call: Call,
    *,
    timeout: float = CALL_TIMEOUT_S,
    cancel_after_tokens: int | None = None,
    cancel_after_s: float | None = None,
) -> Call:
    """Send a Generate call and read it to its end, or cancel it after that many tokens or seconds."""
    rpc = stub.Generate(call.request, timeout=timeout)
    timer = None if cancel_after_s is None else asyncio.get_running_loop().call_later(cancel_after_s, rpc.cancel)
    try:
        async for response in rpc:
            call.absorb(response)
            if cancel_after_tokens is not None and len(call.token_ids) >= cancel_after_tokens:
                rpc.cancel()
    except asyncio.CancelledError:
        if not rpc.cancelled():
            raise
    except grpc.aio.AioRpcError:
        pass
    finally:
        if timer is not None:
            timer.cancel()
    await ended(rpc, call)
    return call


async def ended(rpc: grpc.aio.Call, call: Call) -> None:
    """Record the call's status; a refusal must say why."""
    call.outcome = (await rpc.code()).name
    if call.outcome not in (OK, "CANCELLED") and not await rpc.details():
        call.problems.append(f"{call.outcome} without a message")


def same_output(call: Call, reference: Call) -> bool:
    """An OK stream's output equals its reference's; a cancelled stream's tokens equal its cut reference's."""
    if call.outcome != OK:
        return call.token_ids == reference.token_ids
    return (call.token_ids, "".join(call.text), call.finish, call.matched_stop, call.usage) == (
        reference.token_ids,
        "".join(reference.text),
        reference.finish,
        reference.matched_stop,
        reference.usage,
    )


def stream_problems(call: Call, eos: set[int]) -> list[str]:
    """What an ended Generate call broke of the stream's rules, with what `Call.absorb` noted."""
    problems = list(call.problems)
    request, tokens = call.request, call.token_ids
    if request is None or call.outcome != call.expected:
        return problems
    max_tokens = request.stop.max_tokens if request.stop.HasField("max_tokens") else 16
    if len(tokens) > max_tokens:
        problems.append(f"{len(tokens)} tokens for max_tokens {max_tokens}")
    if call.outcome != OK:
        if call.finishes:
            problems.append(f"a finish message on a {call.outcome} call")
        return problems
    if call.finishes != 1:
        return [*problems, f"{call.finishes} finish messages"]
    stops = set(request.stop.stop_token_ids) | (set() if request.stop.ignore_eos else eos)
    if any(token in stops for token in tokens[:-1]):
        problems.append("a stop token before the last token")
    if any(stop in "".join(call.text) for stop in request.stop.stop):
        problems.append("a stop string in the text")
    if call.finish == pb.FINISH_REASON_LENGTH and (len(tokens) != max_tokens or call.matched_stop):
        problems.append(f"LENGTH after {len(tokens)} of {max_tokens} tokens")
    elif call.finish == pb.FINISH_REASON_STOP:
        if not (call.matched_stop in request.stop.stop or (tokens and tokens[-1] in stops)):
            problems.append("STOP without a stop string or stop token")
    elif call.finish != pb.FINISH_REASON_LENGTH:
        problems.append(f"finish reason {pb.FinishReason.Name(call.finish)}")
    if call.usage.completion_tokens != len(tokens):
        problems.append(f"usage.completion_tokens {call.usage.completion_tokens} for {len(tokens)} tokens received")
    if request.HasField("token_ids") and call.usage.prompt_tokens != len(request.token_ids.ids):
        problems.append(f"usage.prompt_tokens {call.usage.prompt_tokens} for {len(request.token_ids.ids)} ids")
    return problems


def server_counters_agree(calls: list[Call], samples: Samples) -> list[str]:
    """Differences between the server's finished / refused counters and the client's Generate calls."""
    generate = [c for c in calls if c.method == "Generate"]
    finished = collections.Counter(pb.FinishReason.Name(c.finish) for c in generate if c.outcome == OK)
    refused = collections.Counter(
        c.outcome.lower() for c in generate if c.outcome not in (OK, "CANCELLED", "DEADLINE_EXCEEDED")
    )
    problems = []
    for reason in ("stop", "length"):
        server = metric(samples, "inkling_requests_finished_total", finish_reason=reason)
        client = finished[f"FINISH_REASON_{reason.upper()}"]
        if server != client:
            problems.append(f"finished {reason}: server {server:g}, client {client}")
    for reason in ("abort", "error"):
        if server := metric(samples, "inkling_requests_finished_total", finish_reason=reason):
            problems.append(f"finished {reason}: server {server:g}")
    codes = {dict(labels)["code"] for name, labels in samples if name == "inkling_requests_refused_total"}
    for code in sorted(codes | set(refused)):
        if (server := metric(samples, "inkling_requests_refused_total", code=code)) != refused[code]:
            problems.append(f"refused {code}: server {server:g}, client {refused[code]}")
    cancelled = metric(samples, "inkling_requests_finished_total", finish_reason="cancelled")
    streamed = sum(c.outcome == "CANCELLED" and bool(c.token_ids) for c in generate)
    ended = sum(c.outcome in ("CANCELLED", "DEADLINE_EXCEEDED") for c in generate)
    if not streamed <= cancelled <= ended:
        problems.append(f"finished cancelled: server {cancelled:g}, client {streamed} .. {ended}")
    return problems


def rss_trend(samples: list[tuple[float, float]], end: float) -> tuple[float, float, float]:
    """(slope in MB per hour, its standard error, fitted rise in MB) of the least-squares line through the samples
    (seconds, MB) of the second half of [0, end]."""
    half = [s for s in samples if end / 2 <= s[0] <= end]
    n = len(half)
    if n < 3:
        return 0.0, math.inf, 0.0
    mean_t, mean_m = sum(t for t, _ in half) / n, sum(m for _, m in half) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in half)
    slope = sum((t - mean_t) * (m - mean_m) for t, m in half) / sxx
    residual = sum((m - mean_m - slope * (t - mean_t)) ** 2 for t, m in half) / (n - 2)
    return slope * 3600, math.sqrt(residual / sxx) * 3600, slope * (half[-1][0] - half[0][0])


# --- the report


@dataclasses.dataclass
class Results:
    """What a run observed."""

    settings: Settings
    command: str
    seed: int
    started: str
    server: ServerProcess
    info: pb.ModelInfo
    warm_up_s: float
    load: Load
    watchers: Watchers
    counters: list[str]  # server_counters_agree's differences
    preemptions: int
    preempted: set[str]  # ids of the streams preempted
    checked: list[Call]  # streams run again alone
    mismatches: list[Mismatch]
    exit_status: int | None


@dataclasses.dataclass
class Report:
    text: str
    failures: list[str]
    counts: dict[str, collections.Counter[str]]  # kind of call -> outcome -> calls
    preemptions: int
    references: int
    mismatches: list[dict]


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if git("status", "--porcelain") else "")


def machine() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    return f"{os.cpu_count()}-core CPU ({model}), load average {os.getloadavg()[0]:.1f} at the start"


def make_report(results: Results) -> Report:
    """The markdown report and the checks that failed."""
    r, load, watchers = results, results.load, results.watchers
    eos = set(r.info.eos_token_ids)
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    expected: dict[str, str] = {}
    unexpected, broken = [], []
    for call in load.calls:
        outcome = call.outcome
        if call.request is not None and outcome == OK:
            outcome = f"OK {pb.FinishReason.Name(call.finish).removeprefix('FINISH_REASON_')}"
        counts[call.kind][outcome] += 1
        expected[call.kind] = call.expected
        if call.outcome != call.expected:
            unexpected.append(f"{call.label}: {call.outcome}, not {call.expected}")
        broken += [f"{call.label}: {problem}" for problem in stream_problems(call, eos)]
    slope, error, rise = rss_trend(watchers.rss, watchers.load_seconds)
    rss = [mb for _, mb in watchers.rss]
    checked, preempted = r.checked, r.preempted
    checks = [
        ("every call ended once, with its expected status", not unexpected,
         f"{len(load.calls)} calls, {len(unexpected)} unexpected"),
        ("streams kept their rules (one finish message, last; usage; stop and length; log-probs)", not broken,
         f"{len(broken)} broken"),
        ("tokens equal the same request's alone", bool(checked) and not r.mismatches,
         f"{len(checked)} streams run again alone ({sum(c.outcome == OK for c in checked)} OK, "
         f"{sum(c.outcome != OK for c in checked)} cancelled or timed out, cut where they ended; "
         f"{sum(c.request.request_id in preempted for c in checked)} of them preempted); "
         f"{len(r.mismatches)} mismatches"),
        ("the server's counters agree with the client's", not r.counters, "; ".join(r.counters) or "they agree"),
        ("idle after every round: running = waiting = used pages = 0",
         bool(load.idle_checks) and not load.idle_failures,
         f"{len(load.idle_checks)} checks, slowest {max(load.idle_checks, default=0):.1f} s to idle"
         + "".join(f"; {failure}" for failure in load.idle_failures)),
        ("preemptions exercised", r.preemptions > 0, f"{r.preemptions} preemptions of {len(preempted)} streams"),
        ("memory flat (server RSS)", bool(rss) and not (rise > r.settings.rss_tolerance_mb and slope > 3 * error),
         f"start {rss[0]:.0f} MB, end {rss[-1]:.0f} MB, max {max(rss):.0f} MB; the load's second half "
         f"{slope:+.1f} ± {error:.1f} MB/h, fitted rise {rise:+.1f} MB (tolerance {r.settings.rss_tolerance_mb:g} MB)"
         if rss else "no samples"),
        ("health SERVING throughout", watchers.health_polls > 0 and not watchers.health_failures,
         f"{watchers.health_polls} polls, slowest {watchers.slowest_health * 1e3:.0f} ms, "
         f"{len(watchers.health_failures)} failed {sorted(set(watchers.health_failures))}"),
        ("metrics scraped", not watchers.scrape_failures, f"{len(watchers.scrape_failures)} failed scrapes"),
        ("no traceback in the server's log", "Traceback" not in r.server.log_text(), str(r.server.log)),
        ("the server exits 0 on SIGTERM", r.exit_status == 0, f"exit status {r.exit_status}"),
    ]  # fmt: skip
    info, peaks = r.info, watchers.peaks
    lines = [
        "# Soak: randomized mixed load on loopback",
        "",
        f"Command: `{r.command}`  ",
        f"Machine: {machine()}; started {r.started}  ",
        f"Commit: {git_commit()}  ",
        f"Server: `python {' '.join(r.server.command[1:])}` ({info.checkpoint}, {info.dtype}, mesh {info.mesh}, "
        f"{info.max_num_seqs} slots, {info.num_pages} KV pages of {info.page_size} tokens), serving after "
        f"{r.warm_up_s:.0f} s  ",
        f"Load: {r.settings.minutes:g} min in {load.rounds} rounds (concurrency levels "
        f"{sorted(load.concurrency_levels)}), {load.bursts} bursts of short streams, {load.long_bursts} bursts of long "
        f"prompts; seed {r.seed}; peaks seen: {peaks[BUSY[0]]:.0f} running, {peaks[BUSY[1]]:.0f} waiting, "
        f"{peaks[BUSY[2]]:.0f} pages used",
        "",
        "| call | expected | calls | outcomes |",
        "|---|---|---|---|",
        *(
            f"| {kind} | {expected[kind]} | {sum(counts[kind].values())} | "
            f"{', '.join(f'{name} {n}' for name, n in sorted(counts[kind].items()))} |"
            for kind in sorted(counts, key=lambda k: (k.startswith("bad: "), k))
        ),
        f"| all | | {len(load.calls)} | {len(unexpected)} unexpected |",
        "",
        "| check | result | detail |",
        "|---|---|---|",
        *(f"| {name} | {'pass' if passed else 'FAIL'} | {detail} |" for name, passed, detail in checks),
    ]
    described = [m.describe() for m in r.mismatches]
    sections = (
        ("Mismatches (a stream against the same request alone)", [json.dumps(d) for d in described]),
        ("Unexpected outcomes", unexpected),
        ("Broken stream rules", broken),
    )
    for title, entries in sections:
        if entries:
            lines += ["", f"{title}, {len(entries)} (the first 20):", "", *(f"- {entry}" for entry in entries[:20])]
    failures = [f"{name}: {detail}" for name, passed, detail in checks if not passed]
    return Report("\n".join(lines) + "\n", failures, dict(counts), r.preemptions, len(checked), described)


# --- the run


def run(settings: Settings, command: str = "python -m bench.soak") -> Report:
    """Start the server, drive the load for `settings.minutes`, run streams again alone, stop the server: the
    report."""
    seed = settings.seed if settings.seed is not None else random.randrange(2**31)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    server = ServerProcess(settings)
    try:
        warm_up = server.wait_serving()
        with grpc.insecure_channel(server.address) as channel:
            info = pb_grpc.InklingStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        load = Load(server, info, random.Random(seed), settings)
        watchers = Watchers(server, settings)
        try:
            asyncio.run(load.run(settings.minutes * 60))
            watchers.load_ended()
            final = server.metrics()
            counters = server_counters_agree(load.calls, final)
            preempted = set(PREEMPTED.findall(server.log_text()))
            minutes = settings.minutes / 2 if settings.reference_minutes is None else settings.reference_minutes
            checked, mismatches = asyncio.run(load.references(minutes * 60, preempted))
        finally:
            watchers.close()
    finally:
        exit_status = server.stop()
    return make_report(Results(
        settings, command, seed, started, server, info, warm_up, load, watchers, counters,
        int(metric(final, "inkling_preemptions_total")), preempted, checked, mismatches, exit_status,
    ))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of load (default 30)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the server's dtype (default float32, the recorded run's)",
    )
    parser.add_argument("--out", help="write the report (markdown) here")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the server's embedded synthetic one)")
    parser.add_argument("--seed", type=int, help="the load's random seed (default: a random one, reported)")
    parser.add_argument(
        "--reference-minutes",
        type=float,
        help="at most this long running streams again alone (default: half of --minutes)",
    )
    parser.add_argument("--kv-pages", type=int, default=32, help="KV pages in the server's pool (default 32)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the server's slots (default 8)")
    parser.add_argument(
        "--rss-tolerance-mb",
        type=float,
        default=32.0,
        help="RSS rise over the load's second half past which a trend fails (default 32)",
    )
    parser.add_argument("--log", help="the server's log file (default: a temporary file, named in the report)")
    args = parser.parse_args(argv)
    settings = Settings(
        minutes=args.minutes,
        dtype=args.dtype,
        checkpoint=args.checkpoint,
        seed=args.seed,
        reference_minutes=args.reference_minutes,
        kv_pages=args.kv_pages,
        max_num_seqs=args.max_num_seqs,
        rss_tolerance_mb=args.rss_tolerance_mb,
        log=args.log,
    )
    report = run(settings, " ".join(["python -m bench.soak", *(sys.argv[1:] if argv is None else argv)]))
    print(report.text, end="")
    if args.out:
        Path(args.out).write_text(report.text)
    for failure in report.failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
