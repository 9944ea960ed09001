"""OpenAI and Anthropic clients through the real SMG gateway (`python -m smg launch`) in front of the server's
vLLM engine protocol, with the official `openai` client, on loopback. The engine is the fake scheduler
(`fake_scheduler`) playing a script of Inkling-framed tokens, so that what the gateway's inkling parsers make of
them (text, reasoning, tool calls) is known exactly; the prompts the gateway sends are checked against this
repository's own rendering of the checkpoint's chat template."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from fake_scheduler import CONFIG, FakeEngine, FakeScheduler, weightless_checkpoint

from inkling_jax.chat import ChatTemplate, load_template
from inkling_jax.config import load_config
from inkling_jax.runtime.constraints import Grammars
from inkling_jax.tokenizer import Tokenizer
from serving import gateway as gateway_process
from serving import main as server_main
from serving.server import serve

TEXT = load_config(CONFIG).text
MODEL = "tiny-inkling-test"
START_SECONDS = 90  # the gateway registers a worker within a few seconds; CI machines are slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Gateway:
    """The fake engine's server, and SMG in front of it."""

    def __init__(self, directory: str, tokenizer: Tokenizer, loaded: bool = True):
        self.tokenizer = tokenizer
        self.template = ChatTemplate(load_template(directory))
        self.scheduler = FakeScheduler(FakeEngine(TEXT, tokenizer, directory), step_seconds=0.002)
        engine = self.scheduler.engine if loaded else None
        self.server = serve(self.scheduler if loaded else None, engine, served_model_name=MODEL)
        self.port = free_port()
        command = [sys.executable, "-m", "smg", "launch", "--worker-urls", f"grpc://127.0.0.1:{self.server.port}"]
        command += ["--model-path", directory, "--reasoning-parser", "inkling", "--tool-call-parser", "inkling"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warn"]
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        command += ["--worker-startup-check-interval", "1"]  # a loading worker is asked again each second, not 30
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)

    def wait_until_serving(self) -> None:
        """Until a completion goes through: the gateway lists the model before its tokenizer is registered."""
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stderr.read()
            try:
                self.client.completions.create(model=MODEL, prompt="ready?", max_tokens=1)
                return
            except openai.APIError:
                time.sleep(0.2)
        raise AssertionError(f"the gateway did not serve {MODEL} within {START_SECONDS} s")

    def play(self, framed: str) -> list[int]:
        """Make the engine answer every request with `framed` (special tokens as their strings)."""
        self.scheduler.script = self.tokenizer.encode(framed, special_tokens=True)
        return self.scheduler.script

    def prompt_of(self, messages: list[dict], **variables) -> list[int]:
        return self.tokenizer.encode(self.template.render(messages, **variables), special_tokens=True)

    def post(self, path: str, body: dict | None) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a POST, or of a GET without a body."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data, {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.server.stop(grace=0)
        self.scheduler.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return weightless_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def gateway(checkpoint: str) -> Iterator[Gateway]:
    running = Gateway(checkpoint, Tokenizer.from_checkpoint(checkpoint))
    try:
        running.wait_until_serving()
        yield running
    finally:
        running.close()


ANSWER = "<|message_model|><|content_text|>The sky is clear.<|end_message|><|content_model_end_sampling|>"
THOUGHT_AND_CALL = (
    "<|message_model|><|content_thinking|>I need the weather.<|end_message|>"
    '<|message_model|>get_weather<|content_invoke_tool_json|>{"name":"get_weather","args":{"city":"Paris"}}'
    "<|end_message|><|content_model_end_sampling|>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_a_chat_reaches_the_engine_as_the_template_renders_it(gateway):
    gateway.play(ANSWER)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How is the sky?"}]
    reply = gateway.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=64)
    [choice] = reply.choices
    assert (choice.message.content, choice.finish_reason) == ("The sky is clear.", "stop")
    request = gateway.scheduler.submitted[-1]
    assert list(request.prompt_token_ids) == gateway.prompt_of(messages)
    assert (request.temperature, request.max_tokens) == (0.0, 64)
    assert reply.usage.prompt_tokens == len(request.prompt_token_ids)
    assert reply.usage.completion_tokens == len(gateway.tokenizer.encode(ANSWER, special_tokens=True))


def test_sampling_parameters_reach_the_engine(gateway):
    gateway.play(ANSWER)
    gateway.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0.7,
        top_p=0.9,
        seed=1234,
        max_tokens=40,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    request = gateway.scheduler.submitted[-1]
    assert (request.temperature, request.top_p, request.seed, request.max_tokens) == pytest.approx((0.7, 0.9, 1234, 40))
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, 0.25)


def test_a_stream_carries_the_text_and_usage(gateway):
    gateway.play(ANSWER)
    stream = gateway.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The sky is clear."
    assert chunks[-1].usage.completion_tokens == len(gateway.tokenizer.encode(ANSWER, special_tokens=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_stop_string_ends_the_text_and_the_engines_generation(gateway):
    gateway.play("<|message_model|><|content_text|>one two three four five six seven eight nine ten")
    reply = gateway.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=200, stop=["four"]
    )
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("one two three ", "stop")
    assert reply.usage.completion_tokens < 20  # the engine stopped at the match, not at max_tokens
    assert gateway.scheduler.submitted[-1].id in gateway.scheduler.cancelled


def test_logprobs_of_each_token_with_the_top_ones(gateway):
    gateway.play(ANSWER)
    reply = gateway.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=64, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert content and all(len(token.top_logprobs) == 2 for token in content)
    assert gateway.scheduler.submitted[-1].logprobs == 2


def test_reasoning_and_a_tool_call_round_trip(gateway):
    script = gateway.play(THOUGHT_AND_CALL)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = gateway.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=len(script))
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == "I need the weather."
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert list(gateway.scheduler.submitted[-1].prompt_token_ids) == gateway.prompt_of(messages, tools=TOOLS)

    gateway.play(ANSWER)
    history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
        },
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "sunny, 21 C"},
    ]
    final = gateway.client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=64)
    assert final.choices[0].message.content == "The sky is clear."
    prompt = gateway.tokenizer.decode(gateway.scheduler.submitted[-1].prompt_token_ids)
    assert "<|message_tool|>get_weather<|content_text|>sunny, 21 C<|end_message|>" in prompt
    assert '<|content_invoke_tool_json|>{"name":"get_weather","args":{"city"' in prompt


def test_the_anthropic_messages_endpoint(gateway):
    gateway.play(THOUGHT_AND_CALL.replace("get_weather<|content_invoke_tool_json|>", "<|content_text|>"))
    status, body = gateway.post(
        "/v1/messages", {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert status == 200, body
    kinds = {block["type"]: block for block in body["content"]}
    assert kinds["thinking"]["thinking"] == "I need the weather."
    assert json.loads(kinds["text"]["text"]) == {"name": "get_weather", "args": {"city": "Paris"}}
    assert body["stop_reason"] == "end_turn"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 5000}, "exceeds the model's 4096 positions"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}},
            "the json_schema constraint does not compile",
        ),
        ({"logit_bias": {"5": 1.0}, "max_tokens": 4}, None),  # the gateway drops it on chat: no error
    ],
)
def test_engine_refusals_are_http_400_naming_the_problem(gateway, body, message):
    gateway.play(ANSWER)
    status, answer = gateway.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    )
    if message is None:
        assert status == 200, answer
    else:
        assert status == 400 and message in answer["error"]["message"], answer


def test_response_formats_reach_the_engine_as_constraints(gateway):
    schema = {"type": "object", "properties": {"sky": {"enum": ["clear", "grey"]}}, "required": ["sky"]}
    gateway.play('<|content_text|>{"sky": "clear"}<|end_message|><|content_model_end_sampling|>')
    formats = {
        "json_schema": ({"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}, schema),
        "json_object": ({"type": "json_object"}, {"type": "object"}),
    }
    for response_format, want in formats.values():
        reply = gateway.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Sky?"}], response_format=response_format
        )
        assert json.loads(reply.choices[0].message.content) == {"sky": "clear"}
        constraint = gateway.scheduler.submitted[-1].constraint
        assert constraint.kind == "json_schema" and json.loads(constraint.spec) == want


def test_a_required_tool_call_reaches_the_engine_as_a_structural_tag_it_can_follow(gateway):
    script = gateway.play(THOUGHT_AND_CALL)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = gateway.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=len(script)
    )
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    request = gateway.scheduler.submitted[-1]
    assert request.constraint.kind == "structural_tag" and not request.constraint.from_first_token
    grammars = Grammars(gateway.tokenizer, TEXT.unpadded_vocab_size, [TEXT.eos_token_id])
    matcher = grammars.matcher(request.constraint, grammars.frame(request.constraint, request.prompt_token_ids))
    answer = gateway.tokenizer.encode(THOUGHT_AND_CALL.removeprefix("<|message_model|>"), special_tokens=True)
    assert matcher.accept(answer) == len(answer)  # the model's thought and call, then the end of sequence


def test_a_client_that_goes_away_frees_the_engines_slot(gateway):
    gateway.play("<|message_model|><|content_text|>" + " and on" * 200)
    stream = gateway.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "never stop"}], max_tokens=900, stream=True
    )
    next(iter(stream))
    request_id = gateway.scheduler.submitted[-1].id
    stream.close()
    deadline = time.monotonic() + 30
    while request_id not in gateway.scheduler.cancelled:
        assert time.monotonic() < deadline, "the engine's request was not cancelled"
        time.sleep(0.05)


@pytest.mark.slow
def test_loading_and_draining_are_503_and_a_loaded_engine_is_registered(checkpoint):
    """While the model loads the gateway has no model to offer (503) and retries the worker; once loaded it is
    served; while the engine drains, requests are 503 (which clients and the gateway retry)."""
    loading = Gateway(checkpoint, Tokenizer.from_checkpoint(checkpoint), loaded=False)
    try:
        time.sleep(3)
        status, body = loading.post("/v1/models", None)
        assert status == 503 and body["error"]["code"] == "no_models_available", body
        loading.server.attach(loading.scheduler.engine, loading.scheduler)
        loading.wait_until_serving()
        loading.play(ANSWER)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
        assert loading.post("/v1/chat/completions", chat)[0] == 200
        loading.server.drain(0.1)
        status, body = loading.post("/v1/chat/completions", chat)
        assert status == 503 and "draining" in body["error"]["message"], body
    finally:
        loading.close()


def test_serving_main_runs_the_gateway_in_front_of_the_engine(monkeypatch, checkpoint):
    """`serving.main --gateway-port P` over the fake engine: once it serves, OpenAI clients chat through P; SIGTERM
    stops the gateway with the server."""
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    monkeypatch.setattr(server_main, "load_engine", lambda path, **_: FakeEngine(TEXT, tokenizer, path))
    schedulers: list[FakeScheduler] = []

    def scheduler(engine: FakeEngine) -> FakeScheduler:
        schedulers.append(FakeScheduler(engine, ready=False, step_seconds=0.002))
        schedulers[-1].script = tokenizer.encode(ANSWER, special_tokens=True)
        return schedulers[-1]

    monkeypatch.setattr(server_main, "Scheduler", scheduler)
    port, seen, returned = free_port(), {}, threading.Event()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    def chat_then_stop() -> None:
        try:
            deadline = time.monotonic() + START_SECONDS
            while time.monotonic() < deadline and "reply" not in seen:
                try:
                    messages = [{"role": "user", "content": "hi"}]
                    seen["reply"] = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30)
                except openai.APIError:
                    time.sleep(0.2)
        finally:
            if not returned.is_set():
                signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    thread = threading.Thread(target=chat_then_stop)
    thread.start()
    try:
        argv = ["--checkpoint", checkpoint, "--port", "0", "--gateway-port", str(port), "--served-model-name", MODEL]
        code = server_main.main(argv)
    finally:
        returned.set()
        thread.join(60)
    assert code == 0 and seen["reply"].choices[0].message.content == "The sky is clear."
    with pytest.raises(openai.APIConnectionError):  # the gateway stopped with the server
        client.models.list()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--tls-cert", "c.pem", "--tls-key", "k.pem"], "drop --tls-cert"),
        (["--checkpoint", str(CONFIG), "--load-format", "dummy"], "has no tokenizer.json"),
        (["--gateway-port", "70000"], "--gateway-port must be within"),
    ],
)
def test_serving_main_refuses_a_gateway_it_cannot_run(capsys, options, message):
    with pytest.raises(SystemExit) as exited:
        server_main.main(["--gateway-port", "8000", *options])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_a_gateway_that_keeps_exiting_is_restarted_then_given_up(monkeypatch):
    monkeypatch.setattr(gateway_process, "RESTART_DELAY_SECONDS", 0.05)
    front = gateway_process.Gateway([sys.executable, "-c", "import sys; sys.exit(3)"])
    deadline = time.monotonic() + 30
    while front.restarts < gateway_process.RESTARTS or front.running:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    front.stop()
    lasting = gateway_process.Gateway([sys.executable, "-c", "import time; time.sleep(60)"])
    assert lasting.running
    lasting.stop()
    assert not lasting.running and lasting.restarts == 0
