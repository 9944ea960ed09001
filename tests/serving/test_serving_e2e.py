"""The server end to end on the tiny synthetic checkpoint in four layers (with its tokenizer): 64 concurrent
gRPC streams each equal the batch runner's output for the same request; cancelled and timed-out
streams free their slots and pages; `python -m inkling_jax.offline` on text prompts and stop strings."""

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
from model_configs import four_layers
from paths import TINY_CONFIG
from test_gateway import free_port
from xla_flags import OPTIMIZED_STEPS

from inkling_jax import offline
from inkling_jax.chat import ChatTemplate, load_template
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.runtime.batch import run_requests
from inkling_jax.runtime.engine import load_engine
from inkling_jax.runtime.requests import Request
from inkling_jax.runtime.scheduler import Scheduler
from inkling_jax.tokenizer import Tokenizer
from serving.gateway import Gateway, gateway_command
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc
from serving.server import serve

pytestmark = pytest.mark.slow

WORDS = ["the", "model", "runs", "on", "TPU", "and", "GPU", "café", "数据", "🙂", "fast", "exact", "\n", "  "]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("served")
    return write_checkpoint(four_layers(TINY_CONFIG, folder / "config.json"), folder / "checkpoint", experts="mixed")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return load_engine(str(checkpoint), dtype="float32", max_num_seqs=8, chunk=8, compiler_options=OPTIMIZED_STEPS)


def random_requests(rng, count: int) -> list[tuple]:
    requests = []
    for i in range(count):
        if i % 2:
            prompt = tuple(int(t) for t in rng.integers(0, 480, int(rng.integers(1, 30))))
            text = None
        else:
            text = " ".join(rng.choice(WORDS, int(rng.integers(1, 12))))
            prompt = None
        options = Request(
            "",
            (),
            max_tokens=int(rng.integers(1, 24)),
            temperature=float(rng.choice([0.0, 0.8, 1.5])),
            top_k=int(rng.choice([0, 40])),
            top_p=float(rng.choice([1.0, 0.85])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            seed=int(rng.integers(0, 2**31)),
            stop=("e",) if i % 7 == 0 else (),
        )
        requests.append((f"q{i}", text, prompt, options))
    return requests


def as_engine_request(request, tokenizer) -> Request:
    request_id, text, prompt, options = request
    ids = tuple(tokenizer.encode(text)) if text is not None else prompt
    return dataclasses.replace(options, id=request_id, prompt_token_ids=ids)


def as_grpc_request(request) -> pb.GenerateRequest:
    request_id, text, prompt, o = request
    sampling = pb.SamplingParams(
        temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, repetition_penalty=o.repetition_penalty, seed=o.seed
    )
    stop = pb.StopConditions(max_tokens=o.max_tokens, stop=list(o.stop), ignore_eos=o.ignore_eos)
    if text is not None:
        return pb.GenerateRequest(request_id=request_id, text=text, sampling=sampling, stop=stop)
    return pb.GenerateRequest(
        request_id=request_id, token_ids=pb.TokenIds(ids=list(prompt)), sampling=sampling, stop=stop
    )


def stream(stub, request) -> dict:
    token_ids, text, reason = [], [], None
    for response in stub.Generate(as_grpc_request(request), timeout=300):
        token_ids += response.token_ids
        text.append(response.text)
        reason = response.finish_reason or reason
    return {"token_ids": token_ids, "text": "".join(text), "finish_reason": pb.FinishReason.Name(reason)}


def test_64_concurrent_streams_equal_the_batch_runner(engine):
    requests = random_requests(np.random.default_rng(0), 64)
    want = run_requests(engine, [as_engine_request(r, engine.tokenizer) for r in requests])
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    scheduler.start()
    server = serve(scheduler, engine)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InklingStub(channel)
            with ThreadPoolExecutor(64) as pool:
                got = list(pool.map(lambda r: stream(stub, r), requests))
        assert any(w["finish_reason"] == "stop" and w["text"] for w in want)  # a stop string really cut a text
        for result, expected in zip(got, want, strict=True):
            assert result["finish_reason"] == f"FINISH_REASON_{expected['finish_reason'].upper()}"
            assert (result["token_ids"], result["text"]) == (expected["token_ids"], expected["text"])

        long = Request("", (), max_tokens=3000, ignore_eos=True)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InklingStub(channel)
            with pytest.raises(grpc.RpcError) as timed_out:
                for _ in stub.Generate(as_grpc_request(("timed-out", None, (1, 2, 3), long)), timeout=1.0):
                    pass
            assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            call = stub.Generate(as_grpc_request(("cancelled", None, (4, 5, 6), long)))
            next(call)
            call.cancel()
        deadline = time.monotonic() + 30
        while scheduler.stats().running and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = scheduler.stats()
        assert (stats.running, stats.waiting, stats.pages_used) == (0, 0, 0)
    finally:
        server.stop()
        scheduler.stop()


def test_offline_cli_text_prompts_chats_stop_strings_resume_and_bad_lines(checkpoint, tmp_path, capsys):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the model runs"}]
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    rendered = tokenizer.encode(ChatTemplate(load_template(checkpoint)).render(messages), special_tokens=True)
    lines = [
        {"id": "a", "prompt": "the model runs", "max_tokens": 12, "temperature": 0},
        {"id": "b", "prompt_token_ids": [5, 6, 7], "max_tokens": 6, "temperature": 0.7, "seed": 3, "logprobs": 2},
        {"id": "c", "prompt": "café 数据", "max_tokens": 20, "temperature": 1.0, "seed": 9, "stop": ["a", "e"]},
        {"id": "d", "messages": messages, "max_tokens": 8, "temperature": 0.9, "seed": 4},
        {"id": "e", "prompt_token_ids": rendered, "max_tokens": 8, "temperature": 0.9, "seed": 4},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "out.jsonl"), "--dtype", "float32", "--chunk", "8", "--max-num-seqs", "8"]  # fmt: skip
    assert offline.main(args) == 0
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in results] == ["a", "b", "c", "d", "e"]
    assert results[0]["finish_reason"] in ("length", "stop") and len(results[1]["token_ids"]) <= 6
    assert len(results[1]["logprobs"]) == len(results[1]["token_ids"]) == len(results[1]["top_logprobs"])
    assert all(len(top) == 2 for top in results[1]["top_logprobs"])
    assert "a" not in results[2]["text"] and "e" not in results[2]["text"]
    assert results[3]["token_ids"] == results[4]["token_ids"]  # the chat is the template's rendering
    assert "requests in" in capsys.readouterr().err  # the throughput summary

    # an interrupted run: b finished (its line marked to tell it from a rerun), d's line cut short
    kept = {**results[1], "token_ids": [1, 2, 3]}
    (tmp_path / "out.jsonl").write_text(json.dumps(kept) + "\n" + json.dumps(results[3])[:20])
    assert offline.main([*args, "--resume"]) == 0
    resumed = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert resumed == [results[0], kept, results[2], results[3], results[4]]
    (tmp_path / "out.jsonl").write_text(json.dumps({**kept, "id": "zz"}) + "\n")
    assert offline.main([*args, "--resume"]) == 2
    assert "line 1 of" in capsys.readouterr().err
    for bad, message in [
        ({"id": 1}, "exactly one of 'prompt'"),
        ({"id": 1, "messages": "hi"}, "'messages' must be a list"),
        ({"id": 1, "prompt": "x", "tools": []}, "'tools' go with 'messages'"),
        ({"id": 1, "prompt": "x", "top_k": 1.5}, "integer"),
        ({"id": 1, "prompt": "x", "temperature": -1}, "temperature must be within"),
    ]:
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        assert offline.main([*args[:2], "--input", str(tmp_path / "bad.jsonl"), *args[4:]]) == 2
        assert message in capsys.readouterr().err


def test_stop_strings_and_max_tokens_end_constrained_requests(engine):
    """Constrained requests over gRPC on the real engine: a stop string cuts the matching text (finish STOP), a
    max_tokens below the match's length ends it (LENGTH), and a whole match ends with the end of sequence (STOP)."""
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    scheduler.start()
    server = serve(scheduler, engine)
    choices = pb.Constraint(choice=pb.Choices(choices=["alpha beta gamma", "delta beta"]))
    schema = pb.Constraint(json_schema=json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
    cases = {  # name: (constraint, stop strings, max_tokens)
        "cut": (choices, [" beta"], 30),
        "short": (schema, [], 2),
        "whole": (choices, [], 30),
    }
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InklingStub(channel)
            results = {}
            for name, (constraint, stop, max_tokens) in cases.items():
                request = pb.GenerateRequest(
                    request_id=name,
                    token_ids=pb.TokenIds(ids=[5, 77, 301, 42]),
                    sampling=pb.SamplingParams(temperature=0.9, seed=11),
                    stop=pb.StopConditions(max_tokens=max_tokens, stop=stop),
                    constraint=constraint,
                )
                responses = list(stub.Generate(request, timeout=300))
                results[name] = ("".join(r.text for r in responses), responses[-1].finish_reason)
    finally:
        server.stop()
        scheduler.stop()
    assert results["cut"] in {("alpha", pb.FINISH_REASON_STOP), ("delta", pb.FINISH_REASON_STOP)}
    assert results["short"][1] == pb.FINISH_REASON_LENGTH and results["short"][0].startswith("{")
    assert results["whole"] in {("alpha beta gamma", pb.FINISH_REASON_STOP), ("delta beta", pb.FINISH_REASON_STOP)}


def test_chats_through_the_smg_gateway_are_the_batch_runners(engine, checkpoint):
    """The real engine behind the SMG gateway and the openai client: a greedy chat and a seeded sampled one
    generate, every time, the tokens the batch runner generates from the chat template's rendering."""
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "the model runs on TPU"}]
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    prompt = tuple(tokenizer.encode(ChatTemplate(load_template(checkpoint)).render(messages), special_tokens=True))
    options = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8, "seed": 5}}
    want = run_requests(engine, [Request(name, prompt, max_tokens=12, **o) for name, o in options.items()])
    scheduler = Scheduler(engine)
    generated: dict[str, list[int]] = {}
    submit = scheduler.submit

    def recording(request: Request, on_delta) -> None:
        generated[request.id] = []

        def record(delta) -> None:
            generated[request.id].extend(delta.token_ids)
            on_delta(delta)

        submit(request, record)

    scheduler.submit = recording
    scheduler.warm_up()
    scheduler.start()
    server = serve(scheduler, engine, served_model_name="tiny")
    port = free_port()
    front = Gateway(gateway_command("127.0.0.1", server.port, str(checkpoint), "127.0.0.1", port))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
                break
            except openai.APIError:
                assert time.monotonic() < deadline, "the gateway did not serve the model"
                time.sleep(0.2)
        for _ in range(2):
            for (name, o), expected in zip(options.items(), want, strict=True):
                generated.clear()
                reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **o)
                [tokens] = generated.values()
                assert tokens == expected["token_ids"], name
                assert reply.usage.completion_tokens == len(tokens) and reply.usage.prompt_tokens == len(prompt)
    finally:
        front.stop()
        server.stop()
        scheduler.stop()
