"""SMG's vLLM engine protocol (`serving.vllm_engine`) over a real loopback channel, on the same port as the Inkling
service, driven by the fake scheduler's echo model (every expected output known exactly)."""

from __future__ import annotations

import hashlib
import io
import json
import random
import threading
import time
import zipfile
from collections.abc import Callable, Iterator

import grpc
import pytest
from fake_scheduler import CONFIG, NUM_PAGES, PAGE_SIZE, FakeEngine, FakeScheduler, echo, weightless_checkpoint
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from inkling_jax.config import load_config
from inkling_jax.runtime.constraints import Constraint
from inkling_jax.runtime.kv_events import KvEvents, Removed, Stored
from inkling_jax.tokenizer import Tokenizer
from serving.server import Server, serve
from serving.vllm_engine import MAX_CHOICES, SERVICE_NAME

StatusCode = grpc.StatusCode
TEXT = load_config(CONFIG).text  # vocabulary 500 (EOS 499), context 4096
EOS = 499


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return weightless_checkpoint(tmp_path_factory.mktemp("inkling-tiny"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint: str) -> Tokenizer:
    return Tokenizer.from_checkpoint(checkpoint)


class Running:
    def __init__(self, server: Server, scheduler: FakeScheduler | None, channel: grpc.Channel):
        self.server, self.scheduler, self.channel = server, scheduler, channel
        self.stub = vpb_grpc.VllmEngineStub(channel)


@pytest.fixture
def start(checkpoint: str, tokenizer: Tokenizer) -> Iterator[Callable[..., Running]]:
    """start(attach=True, with_tokenizer=True, served_model_name=None, **scheduler options) -> a running server."""
    started: list[Running] = []

    def start_server(
        *, attach: bool = True, with_tokenizer: bool = True, served_model_name: str | None = None, **options
    ) -> Running:
        engine = FakeEngine(TEXT, tokenizer if with_tokenizer else None, checkpoint)
        scheduler = FakeScheduler(engine, **options) if attach else None
        server = serve(scheduler, engine if attach else None, served_model_name=served_model_name)
        started.append(Running(server, scheduler, grpc.insecure_channel(f"127.0.0.1:{server.port}")))
        return started[-1]

    yield start_server
    for running in started:
        running.channel.close()
        running.server.stop(grace=0)
        if running.scheduler is not None:
            running.scheduler.stop()


def generate(prompt: list[int], *, stream: bool = True, request_id: str = "", **params) -> vpb.GenerateRequest:
    request = vpb.GenerateRequest(request_id=request_id, stream=stream, sampling_params=vpb.SamplingParams(**params))
    request.tokenized.input_ids.extend(prompt)
    return request


def random_prompt(length: int = 6) -> list[int]:
    return [random.randrange(0, EOS) for _ in range(length)]


def by_choice(responses: list[vpb.GenerateResponse]) -> dict[int, tuple[list[vpb.GenerateStreamChunk], list]]:
    """index -> (its chunks, its completes)."""
    out: dict[int, tuple[list, list]] = {}
    for response in responses:
        part = response.chunk if response.HasField("chunk") else response.complete
        chunks, completes = out.setdefault(part.index, ([], []))
        (chunks if response.HasField("chunk") else completes).append(part)
    return out


def status_of(call: Callable[[], object]) -> tuple[StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code(), raised.value.details()


def test_a_streamed_call_sends_new_tokens_in_chunks_then_one_complete(start):
    running = start()
    prompt = random_prompt()
    responses = list(running.stub.Generate(generate(prompt, max_tokens=9)))
    chunks, completes = by_choice(responses)[0]
    assert [t for c in chunks for t in c.token_ids] == echo(prompt, 9)
    assert all(c.completion_tokens == len(c.token_ids) > 0 and c.prompt_tokens == len(prompt) for c in chunks)
    assert len(completes) == 1 and responses[-1].HasField("complete")
    complete = completes[0]
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", len(prompt), 9)
    assert complete.cached_tokens == 0 and complete.WhichOneof("matched_stop") is None


def test_an_unstreamed_call_sends_one_complete_with_every_token_and_logprob(start):
    running = start()
    prompt = random_prompt()
    responses = list(running.stub.Generate(generate(prompt, stream=False, max_tokens=7, logprobs=3)))
    assert [r.WhichOneof("response") for r in responses] == ["complete"]
    complete = responses[0].complete
    assert list(complete.output_ids) == echo(prompt, 7) and complete.completion_tokens == 7
    logprobs = complete.output_logprobs
    assert list(logprobs.token_ids) == list(complete.output_ids)
    assert logprobs.token_logprobs == pytest.approx([-0.5 * (t % 3) for t in complete.output_ids])
    assert [len(top.values) for top in logprobs.top_logprobs] == [3] * 7
    assert [list(top.token_ids) for top in logprobs.top_logprobs] == [
        [(t + k) % 500 for k in range(3)] for t in complete.output_ids
    ]


def test_streamed_logprobs_follow_their_chunks(start):
    running = start()
    responses = list(running.stub.Generate(generate(random_prompt(), max_tokens=6, logprobs=0)))
    chunks, _ = by_choice(responses)[0]
    for chunk in chunks:
        assert list(chunk.output_logprobs.token_ids) == list(chunk.token_ids)
        assert len(chunk.output_logprobs.token_logprobs) == len(chunk.token_ids)
    assert sum(len(c.token_ids) for c in chunks) == 6


def test_n_choices_each_stream_under_their_index_with_seeds_in_turn(start):
    running = start()
    prompt = random_prompt()
    responses = list(running.stub.Generate(generate(prompt, max_tokens=5, n=3, seed=11, temperature=0.5)))
    choices = by_choice(responses)
    assert sorted(choices) == [0, 1, 2]
    for chunks, completes in choices.values():
        assert [t for c in chunks for t in c.token_ids] == echo(prompt, 5)
        assert len(completes) == 1 and completes[0].completion_tokens == 5
    submitted = running.scheduler.submitted
    assert [r.seed for r in submitted] == [11, 12, 13] and len({r.id for r in submitted}) == 3
    assert all(r.temperature == 0.5 for r in submitted)


def test_unset_fields_take_vllms_defaults(start):
    running = start()
    prompt = random_prompt(10)
    list(running.stub.Generate(generate(prompt, stream=False, ignore_eos=True)))
    request = running.scheduler.submitted[-1]
    assert (request.temperature, request.top_p, request.repetition_penalty) == (1.0, 1.0, 1.0)
    assert request.max_tokens == NUM_PAGES * PAGE_SIZE - len(prompt)  # up to what one sequence can hold
    assert request.logprobs is None and request.ignore_eos


def test_eos_stop_tokens_and_stop_strings_say_what_matched(start, tokenizer):
    running = start()
    prompt = [*random_prompt(3), EOS]
    [response] = running.stub.Generate(generate(prompt, stream=False, max_tokens=20))
    assert (response.complete.finish_reason, response.complete.matched_token_id) == ("stop", EOS)
    assert list(response.complete.output_ids) == prompt

    prompt = random_prompt(5)
    [response] = running.stub.Generate(generate(prompt, stream=False, max_tokens=20, stop_token_ids=[prompt[2]]))
    assert (response.complete.finish_reason, response.complete.matched_token_id) == ("stop", prompt[2])

    words = [tokenizer.encode(word) for word in ("alpha", " beta", " gamma", " delta")]
    prompt = [token for word in words for token in word]
    stop = tokenizer.decode(words[2])  # " gamma": completed by the third word's last token
    responses = list(running.stub.Generate(generate(prompt, request_id="stopped", max_tokens=200, stop=[stop])))
    chunks, [complete] = by_choice(responses)[0]
    sent = [t for c in chunks for t in c.token_ids]
    assert sent == prompt[: len(words[0]) + len(words[1]) + len(words[2])]  # through the token that completed it
    assert (complete.finish_reason, complete.matched_stop_str, complete.completion_tokens) == ("stop", stop, len(sent))
    assert "stopped" in running.scheduler.cancelled  # generation ends at the match


@pytest.mark.parametrize(
    ("params", "fields", "code", "message"),
    [
        ({"json_schema": '{"type": "objekt"}'}, {}, StatusCode.INVALID_ARGUMENT, "constraint: the json_schema"),
        ({"regex": "(a"}, {}, StatusCode.INVALID_ARGUMENT, "the regex constraint does not compile"),
        ({"structural_tag": "{}"}, {}, StatusCode.INVALID_ARGUMENT, "only a structural tag of triggered_tags"),
        ({"min_tokens": 3}, {}, StatusCode.INVALID_ARGUMENT, "min_tokens is not supported"),
        ({"logit_bias": {5: 1.0}}, {}, StatusCode.INVALID_ARGUMENT, "logit_bias is not supported"),
        ({"prompt_logprobs": 1}, {}, StatusCode.INVALID_ARGUMENT, "prompt_logprobs is not supported"),
        ({"logprobs": -1}, {}, StatusCode.INVALID_ARGUMENT, "logprobs -1"),
        ({"n": MAX_CHOICES + 1}, {}, StatusCode.INVALID_ARGUMENT, f"at most {MAX_CHOICES} choices"),
        ({"temperature": -1.0}, {}, StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"max_tokens": 5000}, {}, StatusCode.OUT_OF_RANGE, "4096"),
        ({"max_tokens": 1020}, {}, StatusCode.OUT_OF_RANGE, "the 1024 tokens one sequence can hold"),
        ({}, {"data_parallel_rank": 1}, StatusCode.INVALID_ARGUMENT, "data_parallel_rank 1"),
        ({}, {"media_refs": vpb.MediaRefs(items=[vpb.MediaRef(url="data:,x")])}, StatusCode.INVALID_ARGUMENT, "image"),
    ],
)
def test_what_the_engine_cannot_honour_is_refused_naming_the_field(start, params, fields, code, message):
    running = start()
    request = generate(random_prompt(), **params)
    for name, value in fields.items():
        getattr(request, name).CopyFrom(value) if hasattr(value, "CopyFrom") else setattr(request, name, value)
    got, details = status_of(lambda: list(running.stub.Generate(request)))
    assert got == code and message in details, details
    assert running.scheduler.submitted == []  # refused before the scheduler sees it


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({"json_schema": '{"type": "integer"}'}, Constraint("json_schema", '{"type": "integer"}')),
        ({"json_object": True}, Constraint("json_object")),
        ({"json_object": False}, None),
        ({"regex": "[ab]+", "grammar_from_first_token": True}, Constraint("regex", "[ab]+", from_first_token=True)),
        ({"grammar": 'root ::= "x" | "y"'}, Constraint("grammar", 'root ::= "x" | "y"')),
        ({"choice": vpb.ChoiceConstraint(choices=["a", "b c"])}, Constraint("choice", ("a", "b c"))),
    ],
)
def test_structured_output_constraints_reach_the_scheduler(start, params, want):
    running = start()
    request = generate(random_prompt(), stream=False, n=2, max_tokens=3)
    for name, value in params.items():
        field = getattr(request.sampling_params, name)
        field.CopyFrom(value) if hasattr(value, "CopyFrom") else setattr(request.sampling_params, name, value)
    list(running.stub.Generate(request))
    assert [r.constraint for r in running.scheduler.submitted] == [want, want]


def test_text_input_is_tokenized_and_stop_strings_need_a_tokenizer(start, tokenizer):
    running = start()
    request = vpb.GenerateRequest(text="hello there", stream=False, sampling_params=vpb.SamplingParams(max_tokens=4))
    [response] = running.stub.Generate(request)
    assert list(response.complete.output_ids) == echo(tokenizer.encode("hello there"), 4)
    bare = start(with_tokenizer=False)
    got, details = status_of(lambda: list(bare.stub.Generate(generate(random_prompt(), stop=["x"]))))
    assert got == StatusCode.FAILED_PRECONDITION and "a stop string needs a tokenizer" in details


def test_bytes_that_are_not_a_request_are_invalid_argument(start):
    running = start()
    call = running.channel.unary_stream(f"/{SERVICE_NAME}/Generate")
    got, details = status_of(lambda: list(call(b"\x0a\xff\xff")))
    assert got == StatusCode.INVALID_ARGUMENT and "vllm.grpc.engine.GenerateRequest" in details


def test_abort_ends_every_choice_and_unknown_ids_are_no_error(start):
    running = start(step_seconds=0.02)
    call = running.stub.Generate(generate(random_prompt(), request_id="long", max_tokens=900, n=2))
    first = next(call)
    assert first.HasField("chunk")
    running.stub.Abort(vpb.AbortRequest(request_ids=["long", "never-seen"]))
    rest = [first, *call]
    completes = [r.complete for r in rest if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1] and {c.finish_reason for c in completes} == {"abort"}
    assert {"long/0", "long/1"} <= set(running.scheduler.cancelled)


def test_a_cancelled_call_cancels_its_choices(start):
    running = start(step_seconds=0.02)
    call = running.stub.Generate(generate(random_prompt(), request_id="gone", max_tokens=900, n=2))
    next(call)
    call.cancel()
    deadline = time.monotonic() + 5
    while not {"gone/0", "gone/1"} <= set(running.scheduler.cancelled):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_health_is_unavailable_while_loading_and_unhealthy_while_draining(start):
    loading = start(attach=False)
    got, details = status_of(lambda: loading.stub.HealthCheck(vpb.HealthCheckRequest()))
    assert got == StatusCode.UNAVAILABLE and "loading" in details
    got, _ = status_of(lambda: loading.stub.GetModelInfo(vpb.GetModelInfoRequest()))
    assert got == StatusCode.UNAVAILABLE
    running = start()
    assert running.stub.HealthCheck(vpb.HealthCheckRequest()).healthy
    draining = threading.Thread(target=running.server.drain, args=(1.0,))
    draining.start()
    draining.join()
    assert not running.stub.HealthCheck(vpb.HealthCheckRequest()).healthy


def test_model_server_and_load_info(start, checkpoint):
    running = start(served_model_name="i2-small")
    info = running.stub.GetModelInfo(vpb.GetModelInfoRequest())
    assert info.is_generation and info.served_model_name == "i2-small"
    assert (info.max_context_length, info.vocab_size, list(info.eos_token_ids)) == (4096, 500, [EOS])
    assert info.model_type == "inkling2_text" and info.model_path == checkpoint.rsplit("/", 1)[-1]
    assert start().stub.GetModelInfo(vpb.GetModelInfoRequest()).served_model_name == info.model_path
    server = running.stub.GetServerInfo(vpb.GetServerInfoRequest())
    assert (server.block_size, server.max_num_seqs, server.data_parallel_size) == (PAGE_SIZE, 4, 1)
    call = running.stub.Generate(generate(random_prompt(), max_tokens=900))
    next(call)
    [load] = running.stub.GetLoads(vpb.GetLoadsRequest()).loads
    assert load.num_running_reqs + load.num_waiting_reqs == 1
    assert load.max_total_num_tokens == NUM_PAGES * PAGE_SIZE and 0 < load.token_usage < 1
    call.cancel()


def test_kv_events_stream_the_caches_pages_from_a_cleared_state(start):
    """A subscriber from 0 gets a cleared state, then each batch the cache records, numbered on, with each page's
    tokens, hash and parent; a resumed one gets the kept batches from its number; without a cache UNIMPLEMENTED."""
    running = start()
    assert status_of(lambda: next(running.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())))[0] == (
        StatusCode.UNIMPLEMENTED
    )
    events = running.scheduler.kv_events = KvEvents()
    rng = random.Random(5)
    pages = [tuple(rng.randrange(EOS) for _ in range(PAGE_SIZE)) for _ in range(3)]
    hashes = [rng.randrange(-(2**63), 2**63) for _ in pages]
    events.record(0, [Stored(hashes[0], None, pages[0])])
    stream = running.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0), timeout=30)
    first = next(stream)
    assert (first.sequence_number, first.HasField("dp_rank")) == (1, False)
    assert [e.WhichOneof("data") for e in first.events] == ["cleared"]
    events.record(1, [Stored(hashes[1], hashes[0], pages[1]), Stored(hashes[2], hashes[1], pages[2])])
    events.record(0, [Removed((hashes[2], hashes[1]))])
    stored, removed = next(stream), next(stream)
    stream.cancel()
    assert (stored.sequence_number, stored.dp_rank, removed.sequence_number, removed.dp_rank) == (2, 1, 3, 0)
    blocks = [(event.stored.parent_block_hash, *[(b.block_hash, tuple(b.token_ids), b.block_size)
                                                 for b in event.stored.blocks]) for event in stored.events]  # fmt: skip
    assert blocks == [(hashes[0], (hashes[1], pages[1], PAGE_SIZE)), (hashes[1], (hashes[2], pages[2], PAGE_SIZE))]
    assert list(removed.events[0].removed.block_hashes) == [hashes[2], hashes[1]]
    resumed = running.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=1))
    first = next(resumed)
    assert first.sequence_number == 1 and not first.events[0].stored.HasField("parent_block_hash")
    resumed.cancel()
    late = running.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=9))
    code, message = status_of(lambda: next(late))
    assert code == StatusCode.OUT_OF_RANGE and "batch 9 is not kept" in message


def test_the_tokenizer_bundle_is_the_checkpoints_files(start, checkpoint):
    running = start()
    chunks = list(running.stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert all(len(c.data) <= 64 << 10 for c in chunks) and not any(c.sha256 for c in chunks[:-1])
    bundle = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(bundle).hexdigest()
    with zipfile.ZipFile(io.BytesIO(bundle)) as files:
        assert {"tokenizer.json", "config.json"} <= set(files.namelist())
        with open(f"{checkpoint}/tokenizer.json", "rb") as original:
            assert files.read("tokenizer.json") == original.read()
        assert json.loads(files.read("config.json"))["vocab_size"] == 512
    bare = start(with_tokenizer=False)
    got, _ = status_of(lambda: list(bare.stub.GetTokenizer(common_pb2.GetTokenizerRequest())))
    assert got == StatusCode.FAILED_PRECONDITION
