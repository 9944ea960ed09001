"""The gRPC server's Inkling service over a real loopback channel, driven by a fake scheduler (`fake_scheduler`: no
model, no JAX compiles, every expected output known exactly)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import math
import random
import shutil
import signal
import string
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from fake_scheduler import CONFIG, NUM_PAGES, PAGE_SIZE, FakeEngine, FakeScheduler, echo
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from paths import REPO

from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import TextConfig, load_config
from inkling_jax.runtime.constraints import Constraint
from inkling_jax.runtime.requests import (
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from inkling_jax.runtime.text_stream import StopStringMatcher, TextStream
from inkling_jax.tokenizer import IncrementalDecoder, Tokenizer
from serving import client as cli
from serving import main as server_main
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc
from serving.server import MAX_MESSAGE_BYTES, SERVICE_NAME, Server, serve

StatusCode = grpc.StatusCode


# --- fixtures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("checkpoint")
    shutil.copy(CONFIG, directory / "config.json")
    return str(directory)


@pytest.fixture(scope="module")
def text_config() -> TextConfig:
    return load_config(CONFIG).text


@pytest.fixture(scope="module")
def tokenizer(text_config: TextConfig) -> Tokenizer:
    return Tokenizer(build_tokenizer(text_config))


@dataclasses.dataclass
class Running:
    server: Server
    scheduler: FakeScheduler | None
    engine: FakeEngine
    channel: grpc.Channel
    stub: pb_grpc.InklingStub


@pytest.fixture
def start(checkpoint: str, text_config: TextConfig, tokenizer: Tokenizer) -> Iterator[Callable[..., Running]]:
    """start(tokenizer=True, attach=True, metrics_port=None, **scheduler options) -> a running server."""
    started: list[Running] = []

    def start_server(*, with_tokenizer: bool = True, attach: bool = True, metrics_port=None, **options) -> Running:
        engine = FakeEngine(text_config, tokenizer if with_tokenizer else None, checkpoint)
        scheduler = FakeScheduler(engine, **options) if attach else None
        server = serve(scheduler, engine if attach else None, "127.0.0.1", 0, metrics_port=metrics_port)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        started.append(Running(server, scheduler, engine, channel, pb_grpc.InklingStub(channel)))
        return started[-1]

    yield start_server
    for running in started:
        running.channel.close()
        running.server.stop(grace=0)
        if running.scheduler is not None:
            running.scheduler.stop()


def request(ids: list[int] | None = None, text: str | None = None, max_tokens: int = 8, **fields) -> pb.GenerateRequest:
    message = pb.GenerateRequest(**fields)
    if ids is not None:
        message.token_ids.ids.extend(ids)
    if text is not None:
        message.text = text
    message.stop.max_tokens = max_tokens
    return message


def token_ids_of(responses: list[pb.GenerateResponse]) -> list[int]:
    return [token for response in responses for token in response.token_ids]


def status_of(call: Callable[[], object]) -> tuple[StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code(), raised.value.details()


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# --- streaming


def test_token_ids_stream_ends_with_finish_reason_and_usage(start):
    running = start(with_tokenizer=False)
    prompt = [random.randrange(0, 499) for _ in range(5)]
    responses = list(running.stub.Generate(request(prompt, max_tokens=9, request_id="mine")))
    assert [list(r.token_ids) for r in responses if r.token_ids] != [echo(prompt, 9)]  # streamed in pieces
    assert token_ids_of(responses) == echo(prompt, 9)
    assert all(r.request_id == "mine" and not r.text for r in responses)
    assert [r.finish_reason for r in responses[:-1]] == [0] * (len(responses) - 1)
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 9)
    assert last.usage.acceptance_length == 1.5  # speculation is on unless the request opts out
    opted_out = request(prompt, max_tokens=3)
    opted_out.speculative = False
    assert list(running.stub.Generate(opted_out))[-1].usage.acceptance_length == 0.0


def test_text_stream_eos_and_special_tokens(start, tokenizer):
    running = start()
    prompt = [*tokenizer.encode("Hello, wörld! 中文"), tokenizer.eos_token_id]
    responses = list(running.stub.Generate(request(prompt, max_tokens=100)))
    ids = token_ids_of(responses)
    assert ids == prompt  # through EOS, which is included
    assert "".join(r.text for r in responses) == "Hello, wörld! 中文"  # special tokens left out by default
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    kept = list(running.stub.Generate(request(prompt, max_tokens=100, keep_special_tokens=True)))
    assert "".join(r.text for r in kept) == "Hello, wörld! 中文<|content_model_end_sampling|>"


def test_text_input_and_special_token_parsing(start, tokenizer):
    running = start()
    text = "hi <|content_model_end_sampling|>"
    plain = list(running.stub.Generate(request(text=text, max_tokens=40)))
    assert "".join(r.text for r in plain).startswith(text + text)  # the marker stays text: no EOS
    assert plain[-1].finish_reason == pb.FINISH_REASON_LENGTH
    parsed = list(running.stub.Generate(request(text=text, max_tokens=40, parse_special_tokens=True)))
    assert "".join(r.text for r in parsed) == "hi "
    assert parsed[-1].finish_reason == pb.FINISH_REASON_STOP
    assert parsed[-1].usage.prompt_tokens == len(tokenizer.encode(text, special_tokens=True))


def test_logprobs_only_when_asked(start):
    running = start(with_tokenizer=False)
    responses = list(running.stub.Generate(request([3, 4, 5], max_tokens=6, logprobs=2)))
    logprobs = [lp for r in responses for lp in r.logprobs]
    ids = token_ids_of(responses)
    assert [lp.logprob for lp in logprobs] == [-0.5 * (t % 3) for t in ids]
    assert [[(t.token_id, t.logprob) for t in lp.top] for lp in logprobs] == [[(t, 0.0), (t + 1, -1.0)] for t in ids]
    assert not any(r.logprobs for r in running.stub.Generate(request([3, 4, 5], max_tokens=6)))
    zero = [lp for r in running.stub.Generate(request([3, 4, 5], max_tokens=6, logprobs=0)) for lp in r.logprobs]
    assert len(zero) == 6 and not any(lp.top for lp in zero)


def test_stop_string_across_tokens_is_never_streamed(start, tokenizer):
    running = start()
    prompt = tokenizer.encode("abc STOP")
    assert len(prompt) > 2
    message = request(prompt, max_tokens=50, request_id="stopped")
    message.stop.stop.extend(["zzz", "Pab"])  # "Pab": the end of the prompt and the start of its echo
    responses = list(running.stub.Generate(message))
    text = "".join(r.text for r in responses)
    assert text == "abc STO"
    last = responses[-1]
    assert (last.finish_reason, last.matched_stop) == (pb.FINISH_REASON_STOP, "Pab")
    ids = token_ids_of(responses)
    assert ids == echo(prompt, len(ids)) and "Pab" in tokenizer.decode(ids) and "Pab" not in tokenizer.decode(ids[:-1])
    assert last.usage.completion_tokens == len(ids) < 50
    wait_until(lambda: "stopped" in running.scheduler.cancelled and running.scheduler.in_flight == 0)


def test_concurrent_streams_are_independent(start, tokenizer):
    running = start()  # 4 slots
    rng = random.Random()
    prompts = [[rng.randrange(0, 480) for _ in range(rng.randrange(1, 12))] for _ in range(64)]

    def generate(i: int):
        if i % 8 == 0:  # bad requests among the good ones
            return status_of(lambda: list(running.stub.Generate(request([600], max_tokens=4))))[0]
        responses = list(running.stub.Generate(request(prompts[i], max_tokens=20, request_id=f"r{i}")))
        return token_ids_of(responses), "".join(r.text for r in responses), responses[-1]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(generate, range(64)))
    for i, result in enumerate(results):
        if i % 8 == 0:
            assert result == StatusCode.INVALID_ARGUMENT
            continue
        ids, text, last = result
        assert ids == echo(prompts[i], 20)
        assert text == tokenizer.decode(ids)
        assert last.request_id == f"r{i}" and last.usage.completion_tokens == 20
    assert running.scheduler.stats().running == 0


# --- refusals


BAD_REQUESTS = {
    "no input": (lambda: pb.GenerateRequest(), StatusCode.INVALID_ARGUMENT, "token_ids"),
    "empty ids": (lambda: request([]), StatusCode.INVALID_ARGUMENT, "empty"),
    "empty text": (lambda: request(text=""), StatusCode.INVALID_ARGUMENT, "empty"),
    "id = vocab": (lambda: request([1, 500]), StatusCode.INVALID_ARGUMENT, "500"),
    "negative id": (lambda: request([-1]), StatusCode.INVALID_ARGUMENT, "-1"),
    "max_tokens 0": (lambda: request([1], max_tokens=0), StatusCode.INVALID_ARGUMENT, "max_tokens"),
    "temperature": (
        lambda: request([1], sampling=pb.SamplingParams(temperature=-1)), StatusCode.INVALID_ARGUMENT, "temperature",
    ),
    "nan": (
        lambda: request([1], sampling=pb.SamplingParams(temperature=math.nan)), StatusCode.INVALID_ARGUMENT, "finite",
    ),
    "top_p 0": (lambda: request([1], sampling=pb.SamplingParams(top_p=0)), StatusCode.INVALID_ARGUMENT, "top_p"),
    "top_k": (lambda: request([1], sampling=pb.SamplingParams(top_k=-2)), StatusCode.INVALID_ARGUMENT, "top_k"),
    "seed": (lambda: request([1], sampling=pb.SamplingParams(seed=2**32)), StatusCode.INVALID_ARGUMENT, "seed"),
    "penalty": (
        lambda: request([1], sampling=pb.SamplingParams(presence_penalty=3)), StatusCode.INVALID_ARGUMENT, "presence",
    ),
    "logprobs": (lambda: request([1], logprobs=21), StatusCode.INVALID_ARGUMENT, "logprobs"),
    "stop token": (
        lambda: request([1], stop=pb.StopConditions(max_tokens=4, stop_token_ids=[500])),
        StatusCode.INVALID_ARGUMENT, "stop_token_ids[0] is 500",
    ),
    "empty stop string": (
        lambda: request([1], stop=pb.StopConditions(max_tokens=4, stop=[""])), StatusCode.INVALID_ARGUMENT, "stop",
    ),
    "long request id": (lambda: request([1], request_id="x" * 300), StatusCode.INVALID_ARGUMENT, "request_id"),
    "past the context": (lambda: request([1] * 100, max_tokens=4000), StatusCode.OUT_OF_RANGE, "4096"),
    "prompt past the context": (
        lambda: request(random.choices(range(500), k=4097)), StatusCode.OUT_OF_RANGE, "prompt (4097 tokens)",
    ),
    "5 MiB of text": (lambda: request(text=_random_text_of(5 << 20)), StatusCode.OUT_OF_RANGE, "at least"),
    "over the message limit": (
        lambda: request(text=_random_text_of(MAX_MESSAGE_BYTES + 1)), StatusCode.RESOURCE_EXHAUSTED, "larger than",
    ),
    "too many stop strings": (
        lambda: request([1], stop=pb.StopConditions(max_tokens=4, stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)])),
        StatusCode.INVALID_ARGUMENT, f"more than the {MAX_STOP_STRINGS} allowed",
    ),
    "long stop string": (
        lambda: request([1], stop=pb.StopConditions(max_tokens=4, stop=["x" * (MAX_STOP_STRING_LENGTH + 1)])),
        StatusCode.INVALID_ARGUMENT, f"longer than {MAX_STOP_STRING_LENGTH}",
    ),
    "too many stop ids": (
        lambda: request([1], stop=pb.StopConditions(max_tokens=4, stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1))),
        StatusCode.INVALID_ARGUMENT, f"more than the {MAX_STOP_TOKEN_IDS} allowed",
    ),
    "past the cache": (lambda: request([1] * 100, max_tokens=1000), StatusCode.RESOURCE_EXHAUSTED, "pages"),
    "schema not JSON": (
        lambda: request([1], constraint=pb.Constraint(json_schema="{")), StatusCode.INVALID_ARGUMENT, "not valid JSON",
    ),
    "bad grammar": (
        lambda: request([1], constraint=pb.Constraint(grammar="start: nowhere")), StatusCode.INVALID_ARGUMENT,
        "nowhere",
    ),
    "no choices": (
        lambda: request([1], constraint=pb.Constraint(choice=pb.Choices())), StatusCode.INVALID_ARGUMENT, "choices",
    ),
    "constraint and ignore_eos": (
        lambda: request([1], stop=pb.StopConditions(max_tokens=4, ignore_eos=True),
                        constraint=pb.Constraint(regex="a+")),
        StatusCode.INVALID_ARGUMENT, "ignore_eos",
    ),
}  # fmt: skip


def _random_text_of(size: int) -> str:
    """`size` bytes of random ASCII words."""
    words = ["".join(random.choices(string.ascii_letters, k=random.randrange(1, 12))) for _ in range(1000)]
    text = " ".join(random.choices(words, k=size // 6 + 1))
    while len(text) < size:
        text += text
    return text[:size]


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_get_their_status_and_harm_nothing(start, name):
    running = start()
    make, code, fragment = BAD_REQUESTS[name]
    status, details = status_of(lambda: list(running.stub.Generate(make())))
    assert status == code and fragment in details
    responses = list(running.stub.Generate(request([7, 8], max_tokens=3)))
    assert token_ids_of(responses) == [7, 8, 7]


def test_a_constraint_reaches_the_scheduler(start):
    running = start()
    schema = '{"type": "string"}'
    kinds = {
        "json_schema": (pb.Constraint(json_schema=schema), Constraint("json_schema", schema)),
        "json_object": (pb.Constraint(json_object=True), Constraint("json_object")),
        "not json_object": (pb.Constraint(json_object=False), None),
        "regex": (pb.Constraint(regex="[0-9]+"), Constraint("regex", "[0-9]+")),
        "grammar": (pb.Constraint(grammar='start: "a" | "b"'), Constraint("grammar", 'start: "a" | "b"')),
        "choice": (pb.Constraint(choice=pb.Choices(choices=["x", "y z"])), Constraint("choice", ("x", "y z"))),
    }
    for message, want in kinds.values():
        list(running.stub.Generate(request([7, 8], max_tokens=2, constraint=message)))
        assert running.scheduler.submitted[-1].constraint == want


def test_tokenize_and_detokenize_refuse_what_cannot_fit_the_context(start):
    running = start()
    status, details = status_of(lambda: running.stub.Tokenize(pb.TokenizeRequest(text=_random_text_of(5 << 20))))
    assert status == StatusCode.OUT_OF_RANGE and "at least" in details and "4096 positions" in details
    ids = random.choices(range(500), k=4097)
    status, details = status_of(lambda: running.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)))
    assert status == StatusCode.OUT_OF_RANGE and "4097 ids" in details
    assert running.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids[:4096])).text


def test_bytes_that_are_not_a_request_are_invalid_argument(start):
    """Malformed bytes, and a text field that is not UTF-8 (field 2 of GenerateRequest, field 1 of
    TokenizeRequest), are refused as the client's error, naming the message type."""
    running = start()
    garbage = bytes(random.randrange(128, 256) for _ in range(16))  # varint continuation bytes that never end
    not_utf8 = bytes([0xFF, 0xFE, *random.choices(range(0x80, 0xC0), k=6)])
    for method, message, streaming, payload in (
        ("Generate", "GenerateRequest", True, garbage),
        ("Generate", "GenerateRequest", True, bytes([0x12, len(not_utf8)]) + not_utf8),
        ("Tokenize", "TokenizeRequest", False, bytes([0x0A, len(not_utf8)]) + not_utf8),
    ):
        path = f"/inkling.v1.Inkling/{method}"
        if streaming:
            call = running.channel.unary_stream(path)
            status, details = status_of(lambda call=call, payload=payload: list(call(payload)))
        else:
            call = running.channel.unary_unary(path)
            status, details = status_of(lambda call=call, payload=payload: call(payload))
        assert status == StatusCode.INVALID_ARGUMENT and f"not a valid inkling.v1.{message}" in details
    assert token_ids_of(list(running.stub.Generate(request([5, 6], max_tokens=2)))) == [5, 6]


def test_a_burst_past_capacity_is_resource_exhausted_and_the_rest_are_served(start):
    """1500 calls at once (past gRPC's default backlog of 1000 calls, beyond which it cancels calls at random):
    every call past the scheduler's capacity is RESOURCE_EXHAUSTED, none CANCELLED, and the others finish."""
    capacity = random.randrange(50, 150)
    running = start(capacity=capacity, step_seconds=0.02)
    prompts = [random.choices(range(499), k=random.randrange(1, 6)) for _ in range(1500)]  # 499: EOS

    async def burst() -> list[tuple[str, list[int]]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.server.port}") as channel:
            stub = pb_grpc.InklingStub(channel)

            async def one(prompt: list[int]) -> tuple[str, list[int]]:
                try:
                    return "OK", token_ids_of([r async for r in stub.Generate(request(prompt, max_tokens=3))])
                except grpc.aio.AioRpcError as error:
                    return error.code().name, [error.details()]

            return await asyncio.gather(*(one(prompt) for prompt in prompts))

    outcomes = asyncio.run(burst())
    codes = collections.Counter(code for code, _ in outcomes)
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"} and codes["OK"] >= capacity
    for prompt, (code, result) in zip(prompts, outcomes, strict=True):
        assert result == echo(prompt, 3) if code == "OK" else "at capacity" in result[0], result
    assert token_ids_of(list(running.stub.Generate(request([9, 8], max_tokens=2)))) == [9, 8]


def test_no_tokenizer_refuses_text_with_failed_precondition(start):
    running = start(with_tokenizer=False)
    for call in (
        lambda: list(running.stub.Generate(request(text="hello"))),
        lambda: list(running.stub.Generate(request([1], stop=pb.StopConditions(max_tokens=3, stop=["x"])))),
        lambda: running.stub.Tokenize(pb.TokenizeRequest(text="hello")),
        lambda: running.stub.Detokenize(pb.DetokenizeRequest(token_ids=[1])),
    ):
        status, details = status_of(call)
        assert status == StatusCode.FAILED_PRECONDITION and "tokenizer" in details
    assert not running.stub.GetModelInfo(pb.GetModelInfoRequest()).has_tokenizer


def test_duplicate_request_id_in_flight(start):
    running = start(step_seconds=0.01)
    first = running.stub.Generate(request([1, 2], max_tokens=1000, request_id="same"))
    next(first)
    status, details = status_of(lambda: list(running.stub.Generate(request([1], request_id="same"))))
    assert status == StatusCode.ALREADY_EXISTS and "same" in details
    first.cancel()
    wait_until(lambda: running.scheduler.in_flight == 0)
    wait_until(lambda: running.server.servicer.in_flight == 0)
    assert list(running.stub.Generate(request([1], max_tokens=2, request_id="same")))[-1].request_id == "same"


def test_scheduler_failures_become_internal_for_that_call_only(start):
    running = start()
    running.scheduler.fail_submit = RuntimeError("boom")
    status, details = status_of(lambda: list(running.stub.Generate(request([1, 2]))))
    assert status == StatusCode.INTERNAL and "boom" in details
    running.scheduler.fail_midway.add((9, 9, 9))
    status, details = status_of(lambda: list(running.stub.Generate(request([9, 9, 9], max_tokens=50))))
    assert status == StatusCode.INTERNAL and "fell over" in details
    assert [t for r in running.stub.Generate(request([4], max_tokens=2)) for t in r.token_ids] == [4, 4]


def test_unavailable_while_loading_warming_up_and_draining(start):
    loading = start(attach=False)
    for call in (
        lambda: list(loading.stub.Generate(request([1]))),
        lambda: loading.stub.GetModelInfo(pb.GetModelInfoRequest()),
        lambda: loading.stub.Tokenize(pb.TokenizeRequest(text="x")),
    ):
        status, details = status_of(call)
        assert status == StatusCode.UNAVAILABLE and "loading" in details
    warming = start(ready=False)
    status, details = status_of(lambda: list(warming.stub.Generate(request([1]))))
    assert status == StatusCode.UNAVAILABLE and "warming up" in details
    warming.scheduler.ready = True
    assert len(list(warming.stub.Generate(request([1], max_tokens=2)))) >= 1
    warming.server.drain(timeout=5)
    status, details = status_of(lambda: list(warming.stub.Generate(request([1]))))
    assert status == StatusCode.UNAVAILABLE and "draining" in details


# --- cancellation


def test_client_cancellation_cancels_the_request_and_frees_its_slot(start):
    running = start(step_seconds=0.005)
    stream = running.stub.Generate(request([1, 2, 3], max_tokens=1000, request_id="gone"))
    next(stream)
    assert running.scheduler.stats().running == 1
    stream.cancel()
    wait_until(lambda: running.scheduler.cancelled == ["gone"])
    wait_until(lambda: running.scheduler.stats().running == 0 and running.scheduler.stats().pages_used == 0)


def test_deadline_cancels_the_request_and_frees_its_slot(start):
    running = start(step_seconds=0.005)
    status, _ = status_of(
        lambda: list(running.stub.Generate(request([5], max_tokens=1000, request_id="t"), timeout=0.3))
    )
    assert status == StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: running.scheduler.cancelled == ["t"] and running.scheduler.in_flight == 0)


def test_drain_timeout_aborts_streams(start):
    running = start(step_seconds=0.005)
    stream = running.stub.Generate(request([1], max_tokens=1000))
    next(stream)
    running.scheduler.drain(timeout=0)  # what shutdown does when the drain timeout runs out
    assert [r for r in stream][-1].finish_reason == pb.FINISH_REASON_ABORT


# --- other calls


def test_model_info(start, checkpoint):
    info = start().stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_type, info.vocab_size, info.unpadded_vocab_size, info.max_context) == (
        "inkling2_text",
        512,
        500,
        4096,
    )
    assert list(info.eos_token_ids) == [499] and info.has_tokenizer and info.max_logprobs == 20
    assert (info.mesh, info.max_num_seqs, info.page_size, info.num_pages) == ("tp1", 4, PAGE_SIZE, NUM_PAGES)
    assert (info.dtype, info.checkpoint) == ("float32", Path(checkpoint).name)  # no path of the server's
    assert info.special_tokens["<|content_model_end_sampling|>"] == 499


def test_tokenize_and_detokenize(start, tokenizer):
    running = start()
    text = "Tokens, <|content_model_end_sampling|> and ümlauts"
    ids = list(running.stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)
    assert ids == tokenizer.encode(text) and 499 not in ids
    special = list(running.stub.Tokenize(pb.TokenizeRequest(text=text, parse_special_tokens=True)).token_ids)
    assert 499 in special
    assert running.stub.Detokenize(pb.DetokenizeRequest(token_ids=special)).text == text
    skipped = running.stub.Detokenize(pb.DetokenizeRequest(token_ids=special, skip_special_tokens=True)).text
    assert skipped == text.replace("<|content_model_end_sampling|>", "")
    status, details = status_of(lambda: running.stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 500])))
    assert status == StatusCode.INVALID_ARGUMENT and "500" in details


def test_health_follows_loading_warm_up_and_draining(start, text_config, checkpoint):
    running = start(attach=False)
    health = health_pb2_grpc.HealthStub(running.channel)

    def status(service: str = "") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service)).status

    assert status() == status(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
    engine = FakeEngine(text_config, None, checkpoint)
    scheduler = FakeScheduler(engine, ready=False)
    running.server.attach(engine, scheduler)
    time.sleep(0.2)
    assert status() == health_pb2.HealthCheckResponse.NOT_SERVING  # attached, still warming up
    scheduler.ready = True
    wait_until(lambda: status() == status(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING)
    running.server.drain(timeout=1)
    assert status() == status(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
    scheduler.stop()


def test_reflection_lists_and_describes_the_service(start):
    running = start()
    database = ProtoReflectionDescriptorDatabase(running.channel)
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(database.get_services())
    service = DescriptorPool(database).FindServiceByName(SERVICE_NAME)
    assert {m.name for m in service.methods} == {"Generate", "Tokenize", "Detokenize", "GetModelInfo"}
    assert service.methods_by_name["Generate"].server_streaming


def test_metrics_endpoint(start):
    running = start(metrics_port=0)
    list(running.stub.Generate(request([1, 2], max_tokens=5)))
    status_of(lambda: list(running.stub.Generate(request([600]))))
    running.server.metrics.sample_throughput()
    page = urllib.request.urlopen(f"http://127.0.0.1:{running.server.metrics_port}/metrics").read().decode()
    for name in (
        "inkling_time_to_first_token_seconds_bucket",
        "inkling_time_per_output_token_seconds_count",
        "inkling_requests_waiting",
        "inkling_requests_running",
        "inkling_kv_pages_used",
        "inkling_kv_pages_total",
        "inkling_kv_cache_usage_ratio",
        "inkling_preemptions_total",
        "inkling_prompt_tokens_total",
        "inkling_prefix_cache_hit_tokens_total",
        "inkling_prefix_cache_pages",
        "inkling_prefix_cache_evictions_total",
        "inkling_generation_tokens_total",
        "inkling_generation_tokens_per_second",
        "inkling_speculative_rounds_total",
        "inkling_speculative_tokens_total",
        "inkling_speculative_acceptance_length_bucket",
    ):
        assert f"\n{name}" in page, name
    assert 'inkling_requests_finished_total{finish_reason="length"} 1.0' in page
    assert 'inkling_requests_refused_total{code="invalid_argument"} 1.0' in page
    assert "inkling_generation_tokens_total 5.0" in page and "inkling_kv_pages_total 64.0" in page
    assert "inkling_speculative_acceptance_length_count 1.0" in page


# --- the client CLI


def test_client_streams_text_and_reports_errors(start, capsys):
    running = start()
    address = f"127.0.0.1:{running.server.port}"
    assert cli.main(["--address", address, "Hello there", "--max-tokens", "4", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello") and "[length; prompt" in err
    assert cli.main(["--address", address, "--info"]) == 0
    assert json.loads(capsys.readouterr().out)["max_context"] == 4096
    assert cli.main(["--address", address, "--token-ids", "1,600"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    running.server.stop(grace=0)
    assert cli.main(["--address", address, "x", "--timeout", "2"]) == 1
    assert "cannot reach a server" in capsys.readouterr().err


def test_client_sends_a_constraint_from_its_flags(start, tmp_path, capsys):
    running = start()
    address = f"127.0.0.1:{running.server.port}"
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "array", "maxItems": 2}')
    flags = {
        ("--json-schema", str(schema)): Constraint("json_schema", schema.read_text()),
        ("--json-object",): Constraint("json_object"),
        ("--regex", "[a-z]+"): Constraint("regex", "[a-z]+"),
        ("--choice", "left", "right"): Constraint("choice", ("left", "right")),
    }
    for given, want in flags.items():
        assert cli.main(["--address", address, "Pick", "--max-tokens", "2", *given]) == 0
        assert running.scheduler.submitted[-1].constraint == want
    capsys.readouterr()
    assert cli.main(["--address", address, "Pick", "--grammar", str(tmp_path / "missing.lark")]) == 2
    assert "cannot read --grammar" in capsys.readouterr().err


# --- a client with only the .proto


def test_python_client_from_the_proto_file_alone(start):
    """grpc.protos_and_services compiles the .proto at run time: no generated code involved."""
    protos, services = grpc.protos_and_services("serving/proto/inkling.proto")
    running = start(with_tokenizer=False)
    stub = services.InklingStub(running.channel)
    responses = list(stub.Generate(protos.GenerateRequest(token_ids=protos.TokenIds(ids=[2, 3]))))
    assert token_ids_of(responses) == echo([2, 3], 16)  # the default max_tokens


NODE_CLIENT = REPO / "tests" / "node_client"


@pytest.fixture(scope="module")
def node_client() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js (node and npm) is not installed")
    install = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=NODE_CLIENT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if install.returncode != 0:
        pytest.skip(f"npm install of @grpc/grpc-js failed (no registry access?): {install.stderr.strip()[-300:]}")
    return NODE_CLIENT / "client.js"


def test_node_client_that_knows_only_the_proto(start, node_client, tokenizer, tmp_path):
    running = start()
    prompt = tokenizer.encode("Node says hi")
    calls = [
        {"method": "GetModelInfo", "request": {}},
        {"method": "Generate", "request": {"token_ids": {"ids": prompt}, "stop": {"max_tokens": 7}, "logprobs": 1}},
        {"method": "Generate", "request": {"text": "Node says hi", "stop": {"max_tokens": 30, "stop": ["hiN"]}}},
        {"method": "Tokenize", "request": {"text": "Node says hi"}},
        {"method": "Generate", "request": {"token_ids": {"ids": [499, 500]}}},
        {"method": "Generate", "request": {"text": "x", "sampling": {"top_p": 0}}},
    ]
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    done = subprocess.run(
        ["node", str(node_client), f"127.0.0.1:{running.server.port}", str(tmp_path / "calls.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    info, stream, stopped, tokenized, bad_id, bad_param = json.loads(done.stdout)
    assert info["responses"][0]["unpadded_vocab_size"] == 500 and info["responses"][0]["has_tokenizer"]
    assert [t for r in stream["responses"] for t in r["token_ids"]] == echo(prompt, 7)
    assert len([lp for r in stream["responses"] for lp in r["logprobs"]]) == 7
    last = stream["responses"][-1]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH" and last["usage"]["completion_tokens"] == 7
    assert "".join(r["text"] for r in stopped["responses"]) == "Node says "
    assert stopped["responses"][-1]["finish_reason"] == "FINISH_REASON_STOP"
    assert tokenized["responses"][0]["token_ids"] == prompt
    assert bad_id["error"]["code"] == "INVALID_ARGUMENT" and "500" in bad_id["error"]["details"]
    assert bad_param["error"]["code"] == "INVALID_ARGUMENT" and "top_p" in bad_param["error"]["details"]


def test_committed_stubs_match_the_proto(tmp_path):
    """The committed *_pb2*.py are what `make proto` generates from the .proto today."""
    protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools (the dev extra) generates the stubs")
    args = ["protoc", f"-I{REPO}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    assert protoc.main([*args, str(REPO / "serving" / "proto" / "inkling.proto")]) == 0
    for name in ("inkling_pb2.py", "inkling_pb2.pyi", "inkling_pb2_grpc.py"):
        generated = (tmp_path / "serving" / "proto" / name).read_text()
        assert generated == (REPO / "serving" / "proto" / name).read_text(), f"{name} is stale: run make proto"


# --- text_stream


def _random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("ab é中") for _ in range(length))


def test_stop_matcher_never_leaks_any_part_of_a_stop_string():
    rng = random.Random()
    for _ in range(2000):
        text = _random_text(rng, rng.randrange(0, 30))
        stop = [_random_text(rng, rng.randrange(1, 5)) for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.5 and text:  # make a match likely
            start = rng.randrange(len(text))
            stop[0] = text[start : start + rng.randrange(1, 5)]
        ends = sorted((text.find(s) + len(s), text.find(s), s) for s in stop if s in text)  # first completed
        expected = text[: ends[0][1]] if ends else text
        matcher, emitted, position = StopStringMatcher(stop), "", 0
        while position < len(text):
            step = rng.randrange(1, 6)
            emitted += matcher.push(text[position : position + step])
            position += step
            seen = text[:position]
            assert expected.startswith(emitted)  # never past the first stop string, never a part of it
            if matcher.matched is None:  # and it holds back only an end of the text that may start a stop string
                assert [i for i in range(len(seen)) if any(s.startswith(seen[i:]) for s in stop)][:1] in (
                    [len(emitted)],
                    [],
                )
                assert len(emitted) == len(seen) or any(s.startswith(seen[len(emitted) :]) for s in stop)
        emitted += matcher.flush() if matcher.matched is None else ""
        assert emitted == expected
        assert matcher.matched == (ends[0][2] if ends else None)


def test_stop_matcher_with_many_overlapping_stop_strings_finds_the_first_completed():
    """Up to the request limit of stop strings over a two-letter alphabet, so that they overlap and nest: the
    matcher agrees with checking every stop string against every prefix of the text."""
    rng = random.Random()
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 40)))
        stop = list({"".join(rng.choice("ab") for _ in range(rng.randrange(2, 9))) for _ in range(MAX_STOP_STRINGS)})
        rng.shuffle(stop)
        first = next((end for end in range(1, len(text) + 1) if any(text[:end].endswith(s) for s in stop)), None)
        matched = None if first is None else max((s for s in stop if text[:first].endswith(s)), key=len)
        matcher, emitted, position = StopStringMatcher(stop), "", 0
        while position < len(text) and matcher.matched is None:
            step = rng.randrange(1, 4)
            emitted += matcher.push(text[position : position + step])
            position += step
        emitted += matcher.flush() if matcher.matched is None else ""
        assert matcher.matched == matched
        assert emitted == (text if first is None else text[: first - len(matched)])


def test_text_stream_cuts_at_the_token_that_completes_a_stop_string(tokenizer):
    rng = random.Random()
    words = ["héllo", " wörld", " 中文", " STOP", "!", " emoji 🎉", "\n", " the end"]
    for _ in range(200):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
        ids = tokenizer.encode(text)
        full = tokenizer.decode(ids)
        stop = [rng.choice(["STOP", "中", "d\nt", "🎉", "llo w", "never"])]
        stream = TextStream(IncrementalDecoder(tokenizer), stop)
        out, kept, position = "", 0, 0
        while position < len(ids):
            size = rng.randrange(1, 4)
            piece = stream.push(ids[position : position + size])
            out, kept, position = out + piece.text, kept + piece.tokens, position + size
            if piece.stopped:
                break
        else:
            out += stream.finish()
        cut = full.find(stop[0])
        assert out == (full[:cut] if cut != -1 else full)
        if cut != -1:  # the kept tokens end with the one whose text completes the stop string
            assert stop[0] in tokenizer.decode(ids[:kept]) and stop[0] not in tokenizer.decode(ids[: kept - 1])
        else:
            assert kept == len(ids)


# --- the server entry point


def test_main_serves_then_drains_on_sigterm(monkeypatch, checkpoint, text_config, tokenizer):
    """Health SERVING after warm-up; SIGTERM: NOT_SERVING, new calls UNAVAILABLE, the running stream
    finishes, exit 0."""
    servers, schedulers = [], []
    monkeypatch.setattr(server_main, "load_engine", lambda path, **_: FakeEngine(text_config, tokenizer, path))
    monkeypatch.setattr(server_main, "serve", lambda *a, **kw: servers.append(serve(*a, **kw)) or servers[-1])

    def scheduler(engine: FakeEngine) -> FakeScheduler:
        schedulers.append(FakeScheduler(engine, ready=False, step_seconds=0.005))
        return schedulers[-1]

    monkeypatch.setattr(server_main, "Scheduler", scheduler)
    seen, signalled, returned = {}, threading.Event(), threading.Event()

    def stop_main() -> None:
        """SIGTERM once main() listens (its handler is installed before it serves), never after it returned; sent
        to this thread, not the main one, as the kernel may route a process's signal (that once hung main())."""
        if signalled.is_set():
            return
        signalled.set()
        wait_until(lambda: servers or returned.is_set(), timeout=60)
        if not returned.is_set():
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    def client() -> None:
        wait_until(lambda: servers, timeout=60)
        channel = grpc.insecure_channel(f"127.0.0.1:{servers[0].port}")
        health = health_pb2_grpc.HealthStub(channel)

        def status() -> int:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=10).status

        wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=10)
        stub = pb_grpc.InklingStub(channel)
        stream = stub.Generate(request([1, 2], max_tokens=200), timeout=60)
        first = next(stream)
        stop_main()
        wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
        seen["refused"] = status_of(lambda: list(stub.Generate(request([1]), timeout=10)))[0]
        seen["tokens"] = token_ids_of([first, *stream])
        channel.close()

    def client_then_stop() -> None:
        """The client; whatever it raises, main() is still stopped (it would wait for SIGTERM forever)."""
        try:
            client()
        except BaseException as error:
            seen["error"] = error
        finally:
            stop_main()

    thread = threading.Thread(target=client_then_stop)
    thread.start()
    try:
        code = server_main.main(["--checkpoint", checkpoint, "--port", "0", "--drain-timeout", "20"])
    finally:
        returned.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert "error" not in seen, seen["error"]
    assert code == 0
    assert seen == {"refused": StatusCode.UNAVAILABLE, "tokens": echo([1, 2], 200)}
    assert schedulers[0].in_flight == 0


def test_main_refuses_bad_input_with_exit_2(tmp_path, capsys, monkeypatch):
    assert server_main.main(["--checkpoint", str(tmp_path), "--port", "0"]) == 2
    assert "no config.json" in capsys.readouterr().err.splitlines()[-1]
    config = json.loads(CONFIG.read_text())
    del config["dspark_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert server_main.main(["--checkpoint", str(tmp_path), "--port", "0", "--speculative", "dspark"]) == 2
    assert "has no DSpark draft" in capsys.readouterr().err.splitlines()[-1]
    longest = str(config["max_position_embeddings"] + 1)
    assert server_main.main(["--checkpoint", str(tmp_path), "--port", "0", "--max-model-len", longest]) == 2
    assert f"to the model's {int(longest) - 1} tokens, got {longest}" in capsys.readouterr().err.splitlines()[-1]
    monkeypatch.setattr(server_main, "DEFAULT_CONFIG", tmp_path / "configs" / "tiny.json")  # an installed package's
    assert server_main.main(["--port", "0"]) == 2
    assert "pass --checkpoint DIR" in capsys.readouterr().err.splitlines()[-1]
    for flags in (["--port", "70000"], ["--max-model-len", "0"]):
        with pytest.raises(SystemExit) as exited:
            server_main.main(flags)
        assert exited.value.code == 2
    taken = serve(None, None, "127.0.0.1", 0)
    try:
        assert server_main.main(["--port", str(taken.port)]) == 2
        assert "cannot listen" in capsys.readouterr().err
    finally:
        taken.stop()
