"""The gRPC server: the `inkling.v1.Inkling` service, SMG's vLLM engine protocol (`serving.vllm_engine`),
grpc.health.v1, server reflection and metrics.

`serve(scheduler, engine, host, port)` starts it on a thread of its own (a `grpc.aio` server on its
own event loop, so hundreds of concurrent streams cost a coroutine each) and returns a `Server` handle
that can attach a model later, drain and stop. Until a scheduler is attached and ready, health says
NOT_SERVING and calls are refused with UNAVAILABLE; while draining, health says NOT_SERVING again.

Each Generate call becomes one `inkling_jax.runtime.requests.Request`: text is tokenized with the
checkpoint's tokenizer, ids and parameters are checked (`requests.validate`), and the scheduler's deltas
are streamed back as they come, detokenized incrementally and cut at the first stop string
(`inkling_jax.runtime.text_stream`). A call that
is cancelled or runs past its deadline cancels its request, which frees its slot. Every refusal is a
gRPC status with a message; an unexpected error fails only its own call (INTERNAL).

No request can hold up the others: messages are limited in size, text that cannot fit the context is refused
from its length before it is tokenized, and tokenizing, detokenizing and checking ids run on a small pool of
threads (the tokenizer releases the GIL), never on the event loop that carries every stream and health check.
Images (`serving.media`) are checked from their headers with the prompt there, and their pixels decoded on a pool
of their own, so that a large image holds up no text request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inkling_jax.config import load_config
from inkling_jax.runtime.constraints import Constraint
from inkling_jax.runtime.engine import Engine
from inkling_jax.runtime.images import encode_marked
from inkling_jax.runtime.requests import (
    MAX_LOGPROBS,
    NO_TOKENIZER,
    Delta,
    Rejected,
    Request,
    validate,
    validate_sizes,
)
from inkling_jax.runtime.scheduler import Scheduler
from inkling_jax.runtime.text_stream import TextStream
from inkling_jax.token_ids import TokenIdError, validate_token_ids
from inkling_jax.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError
from serving.calls import STATUS_OF_CODE, CallError, Unparsable, add_service, cut_at_stop_strings
from serving.connection import KEEPALIVE_OPTIONS, Tls, TokenInterceptor
from serving.media import (
    IMAGE_MESSAGE_BYTES,
    EncodedImage,
    ImageSetup,
    check_count,
    decode,
    expand,
    image_setup,
    tiles_of,
)
from serving.metrics import Metrics
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc
from serving.vllm_engine import SERVICE_NAME as VLLM_SERVICE_NAME
from serving.vllm_engine import VllmEngineServicer, common_pb2, vpb

log = logging.getLogger("serving")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inkling"].full_name
MAX_REQUEST_ID_LENGTH = 256
HEALTH_POLL_SECONDS = 0.05
THROUGHPUT_SAMPLE_SECONDS = 1.0

# A message holds a prompt of the 1M-token context as ids (at most 5 bytes each) or as text at up to 32 bytes a
# token (text averages about 4), and IMAGE_MESSAGE_BYTES for each image a request may carry (`max_message_bytes`);
# larger ones are refused by gRPC before they are read.
MAX_MESSAGE_BYTES = 32 << 20
SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),  # a port already in use is an error, not a second server sharing it
    # gRPC's own backlog of calls not yet handed to a handler cancels calls at random past 1000 (CANCELLED, which
    # clients rarely retry): calls reach the handler, which refuses those past capacity as RESOURCE_EXHAUSTED
    ("grpc.server.max_pending_requests", 1 << 20),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
)
PREPARE_THREADS = 4  # tokenizing and checking requests, off the event loop
IMAGE_THREADS = 2  # decoding images (and fetching the vLLM protocol's media_refs), off the event loop
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def max_message_bytes(max_images: int) -> int:
    """The largest message the server reads: a prompt of the whole context and `max_images` images."""
    return MAX_MESSAGE_BYTES + max(max_images, 0) * IMAGE_MESSAGE_BYTES


def request_from_message(request: pb.GenerateRequest, request_id: str, prompt: tuple[int, ...], seed: int) -> Request:
    """The call's Request (not validated yet): its sampling and stopping, unset fields at their defaults
    (`seed` when it has none)."""
    sampling, stop = request.sampling, request.stop
    defaults = Request("", ())

    def value(message: Any, name: str, default: Any) -> Any:
        return getattr(message, name) if message.HasField(name) else default

    return Request(
        id=request_id,
        prompt_token_ids=prompt,
        max_tokens=value(stop, "max_tokens", defaults.max_tokens),
        temperature=value(sampling, "temperature", defaults.temperature),
        top_p=value(sampling, "top_p", defaults.top_p),
        top_k=value(sampling, "top_k", defaults.top_k),
        min_p=value(sampling, "min_p", defaults.min_p),
        repetition_penalty=value(sampling, "repetition_penalty", defaults.repetition_penalty),
        presence_penalty=value(sampling, "presence_penalty", defaults.presence_penalty),
        frequency_penalty=value(sampling, "frequency_penalty", defaults.frequency_penalty),
        seed=value(sampling, "seed", seed),
        stop_token_ids=tuple(stop.stop_token_ids),
        stop=tuple(stop.stop),
        ignore_eos=stop.ignore_eos,
        logprobs=value(request, "logprobs", None),
        speculative=value(request, "speculative", defaults.speculative),
        constraint=constraint_from_message(request.constraint) if request.HasField("constraint") else None,
    )


def constraint_from_message(message: pb.Constraint) -> Constraint | None:
    """The request's constraint (None for json_object false or no kind set)."""
    kind = message.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not message.json_object):
        return None
    if kind == "json_object":
        return Constraint("json_object")
    return Constraint(kind, tuple(message.choice.choices) if kind == "choice" else getattr(message, kind))


def model_info(engine: Engine) -> pb.ModelInfo:
    """The model's facts; the checkpoint by its directory's name alone (clients learn nothing of the server's
    filesystem)."""
    text, tokenizer = engine.text, engine.tokenizer
    eos = text.eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return pb.ModelInfo(
        model_type=load_config(engine.checkpoint).model_type,
        vocab_size=text.vocab_size,
        unpadded_vocab_size=text.unpadded_vocab_size,
        max_context=engine.max_context,
        eos_token_ids=eos_ids,
        mesh=engine.mesh_spec,
        max_num_seqs=engine.max_num_seqs,
        page_size=engine.page_size,
        num_pages=engine.num_pages,
        has_tokenizer=tokenizer is not None,
        dtype=str(engine.dtype),
        checkpoint=Path(engine.checkpoint).name,
        max_logprobs=MAX_LOGPROBS,
        special_tokens=dict(tokenizer.special_tokens) if tokenizer is not None else {},
    )


def _copied(ids: Any, piece: int = 1 << 16) -> list[int]:
    """A message's repeated ids as a list, copied a piece at a time: one copy of a million ids would hold the GIL
    for ~0.1 s, stalling every stream."""
    copy: list[int] = []
    for start in range(0, len(ids), piece):
        copy.extend(ids[start : start + piece])
    return copy


def logprobs_of(delta: Delta, count: int) -> list[pb.TokenLogprob]:
    """The log-probabilities of the delta's first `count` tokens (and their top ones, when asked for)."""
    tops = delta.top_logprobs or ((),) * len(delta.logprobs)
    return [
        pb.TokenLogprob(logprob=logprob, top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in top])
        for logprob, top in zip(delta.logprobs[:count], tops[:count], strict=True)
    ]


def _unary(method: Callable[..., Any]) -> Callable[..., Any]:
    """A unary handler, run on the servicer's pool of threads, whose CallError, or any unexpected error, becomes
    the call's status."""

    @functools.wraps(method)
    async def handle(self: InklingServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, Unparsable):
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await asyncio.get_running_loop().run_in_executor(self.prepare, method, self, request, context)
        except CallError as error:
            await context.abort(error.status, str(error))
        except Exception as error:
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")

    return handle


class InklingServicer(pb_grpc.InklingServicer):
    """The Inkling service over an engine and its scheduler, both attached once the model is loaded."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self._model_info: pb.ModelInfo | None = None
        self._in_flight: set[str] = set()  # request ids the scheduler may still hold; touched on the loop only
        self._calls = 0  # Generate calls admitted and not ended; touched on the loop only
        self.draining = False  # set on the loop, before health turns NOT_SERVING: no new request after that
        self.prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="request-prepare")
        self.image_threads = ThreadPoolExecutor(IMAGE_THREADS, thread_name_prefix="image-prepare")
        self.image_setup: ImageSetup | None = None

    def attach(self, engine: Engine, scheduler: Scheduler) -> None:
        self._model_info = model_info(engine)
        self.image_setup = image_setup(engine)
        self.engine, self.scheduler = engine, scheduler
        self.metrics.attach(scheduler)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _loaded(self) -> tuple[Engine, Scheduler]:
        if self.engine is None or self.scheduler is None:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the server is loading the model; retry shortly")
        return self.engine, self.scheduler

    def _tokenizer(self, engine: Engine, what: str) -> Tokenizer:
        if engine.tokenizer is None:
            raise CallError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} needs a tokenizer, and {engine.checkpoint} has none ({NO_TOKENIZER}); send token ids",
            )
        return engine.tokenizer

    def _encode(self, engine: Engine, text: str, special_tokens: bool, what: str, marked: bool = False) -> list[int]:
        """The ids of `text` (`marked`: each `<|content_image|>` its token, where images go), refused as
        OUT_OF_RANGE without encoding it when its length alone shows that it cannot fit the model's context."""
        tokenizer, context = self._tokenizer(engine, what), engine.text.max_position_embeddings
        fewest = tokenizer.fewest_tokens(text)
        if fewest > context:
            raise CallError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"the text ({len(text)} characters) makes at least {fewest} tokens, more than the model's {context} "
                "positions",
            )
        if marked:
            return encode_marked(tokenizer, text, special_tokens)
        return tokenizer.encode(text, special_tokens=special_tokens)

    def _prompt(self, request: pb.GenerateRequest, engine: Engine) -> tuple[int, ...]:
        match request.WhichOneof("input"):
            case "text":
                marked = bool(request.images)
                ids = self._encode(engine, request.text, request.parse_special_tokens, "text input", marked)
            case "token_ids":
                ids = _copied(request.token_ids.ids)
            case _:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, "give the prompt as text or token_ids")
        return tuple(ids)

    def _request_id(self, requested: str) -> str:
        if not requested:
            return uuid.uuid4().hex
        if len(requested) > MAX_REQUEST_ID_LENGTH:
            raise CallError(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters"
            )
        return requested

    def _engine_request(
        self, request: pb.GenerateRequest, engine: Engine, scheduler: Scheduler
    ) -> tuple[Request, list[EncodedImage]]:
        """The call's validated Request (run on the pool: it may tokenize a long prompt, compile a constraint), its
        images' placeholders in the prompt, and the images still to decode. Sizes are checked before anything is
        copied out of the message, images from their headers before the prompt is tokenized."""
        try:
            stop, ids = request.stop, request.token_ids.ids if request.WhichOneof("input") == "token_ids" else ()
            validate_sizes(len(ids), len(stop.stop_token_ids), len(stop.stop), engine.text)
        except Rejected as rejected:
            raise CallError(STATUS_OF_CODE[rejected.code], str(rejected)) from None
        setup = check_count(len(request.images), self.image_setup)
        images = [
            EncodedImage(f"images[{i}]", image.data, image.media_type or None) for i, image in enumerate(request.images)
        ]
        tiles = [tiles_of(image, setup) for image in images]
        prompt = self._prompt(request, engine)
        if images:
            prompt = tuple(expand(prompt, tiles, setup))
        engine_request = request_from_message(
            request, self._request_id(request.request_id), prompt, seed=secrets.randbelow(2**32)
        )
        if engine_request.stop:
            self._tokenizer(engine, "stop strings")
        try:
            validate(engine_request, engine.text)
            scheduler.prepare(engine_request)
        except Rejected as rejected:
            raise CallError(STATUS_OF_CODE[rejected.code], str(rejected)) from None
        return engine_request, images

    async def with_images(self, requests: list[Request], images: list[EncodedImage]) -> list[Request]:
        """The requests carrying `images`, decoded on the image threads (each image on a thread of its own)."""
        if not images:
            return requests
        loop = asyncio.get_running_loop()
        decoded = await asyncio.gather(
            *(loop.run_in_executor(self.image_threads, decode, image, self.image_setup) for image in images)
        )
        return [dataclasses.replace(request, images=tuple(decoded)) for request in requests]

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._calls += 1  # until the call ends, however it ends
        try:
            async for response in self._generate(request, context):
                yield response
        finally:
            self._calls -= 1

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        received = time.monotonic()
        try:
            if isinstance(request, Unparsable):
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            engine, scheduler = self._loaded()
            self._admit(scheduler)
            loop = asyncio.get_running_loop()
            engine_request, images = await loop.run_in_executor(
                self.prepare, self._engine_request, request, engine, scheduler
            )
            (engine_request,) = await self.with_images([engine_request], images)
            deltas = self._submit(scheduler, engine_request)
        except CallError as error:
            self.metrics.requests_refused.labels(code=error.status.name.lower()).inc()
            await context.abort(error.status, str(error))
        except Exception as error:
            log.exception("Generate failed before submission")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
        outcome = "cancelled"
        try:
            text = self._text_stream(engine, engine_request.stop, not request.keep_special_tokens)
            async for response in self._stream(scheduler, engine_request, deltas, text, received):
                if response.finish_reason:
                    outcome = pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
                yield response
        except CallError as error:
            outcome = "error"
            await context.abort(error.status, str(error))
        except Exception as error:
            outcome = "error"
            log.exception("Generate %s failed", engine_request.id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
        finally:
            if outcome in ("cancelled", "error"):
                scheduler.cancel(engine_request.id)
            self.metrics.requests_finished.labels(finish_reason=outcome).inc()

    def _admit(self, scheduler: Scheduler) -> None:
        """Refuse the call at once when the scheduler could not hold it with the calls before it (before its
        prompt is tokenized: a burst past capacity costs the server little)."""
        if self._calls > scheduler.capacity:
            raise CallError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is at capacity ({scheduler.capacity} requests running or waiting); retry later",
            )

    def _submit(self, scheduler: Scheduler, request: Request) -> asyncio.Queue[Delta]:
        """Hand the request to the scheduler; its deltas arrive on the returned queue, on this loop.

        The request id stays reserved until the scheduler's last delta, even when the call ends earlier,
        so that a reused id never meets the old request's cancellation."""
        if self.draining:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the server is draining")
        if request.id in self._in_flight:
            raise CallError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.id!r} is already in flight")
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()

        def receive(delta: Delta) -> None:
            deltas.put_nowait(delta)
            if delta.finish_reason is not None:
                self._in_flight.discard(request.id)

        def on_delta(delta: Delta) -> None:  # on the scheduler's thread: hand over, never block
            try:
                loop.call_soon_threadsafe(receive, delta)
            except RuntimeError:  # the server's loop has closed: nobody is listening any more
                pass

        try:
            scheduler.submit(request, on_delta)
        except Rejected as rejected:
            raise CallError(STATUS_OF_CODE[rejected.code], str(rejected)) from None
        self._in_flight.add(request.id)
        return deltas

    @staticmethod
    def _text_stream(engine: Engine, stop: tuple[str, ...], skip_special_tokens: bool) -> TextStream | None:
        """The request's detokenized text, cut at its stop strings (None: no tokenizer, token ids only)."""
        if engine.tokenizer is None:
            return None
        return TextStream(IncrementalDecoder(engine.tokenizer, skip_special_tokens=skip_special_tokens), stop)

    async def _stream(
        self,
        scheduler: Scheduler,
        request: Request,
        deltas: asyncio.Queue[Delta],
        text: TextStream | None,
        received: float,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The call's responses, from the scheduler's deltas up to the last (finish reason and usage)."""
        completion, first_token_at = 0, None
        while True:
            delta = await deltas.get()
            if delta.finish_reason == "error":
                raise CallError(grpc.StatusCode.INTERNAL, f"generation failed: {delta.error}")
            kept, piece, stopped = cut_at_stop_strings(text, delta)
            if stopped and delta.finish_reason is None:
                scheduler.cancel(request.id)
            finish = pb.FINISH_REASON_STOP if stopped else FINISH_REASONS.get(delta.finish_reason, 0)
            now = time.monotonic()
            if kept and first_token_at is None:
                first_token_at = now
                self.metrics.time_to_first_token.observe(now - received)
            completion += kept
            response = pb.GenerateResponse(
                request_id=request.id,
                token_ids=delta.token_ids[:kept],
                text=piece,
                logprobs=logprobs_of(delta, kept) if request.logprobs is not None else (),
                finish_reason=finish,
            )
            if finish:
                response.usage.prompt_tokens = len(request.prompt_token_ids)
                response.usage.completion_tokens = completion
                response.usage.acceptance_length = delta.acceptance_length
                response.usage.cached_tokens = delta.cached_tokens
                if delta.acceptance_length:
                    self.metrics.acceptance_length.observe(delta.acceptance_length)
                response.matched_stop = (text.matched if text is not None else None) or ""
                if completion > 1:
                    self.metrics.time_per_output_token.observe((now - first_token_at) / (completion - 1))
            if kept or piece or finish:
                yield response
            if finish:
                return

    @_unary
    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        engine, _ = self._loaded()
        return pb.TokenizeResponse(
            token_ids=self._encode(engine, request.text, request.parse_special_tokens, "Tokenize")
        )

    @_unary
    def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        engine, _ = self._loaded()
        tokenizer, context = self._tokenizer(engine, "Detokenize"), engine.text.max_position_embeddings
        if len(request.token_ids) > context:
            raise CallError(
                grpc.StatusCode.OUT_OF_RANGE, f"{len(request.token_ids)} ids, more than the model's {context} positions"
            )
        ids = list(request.token_ids)
        try:
            if ids:
                validate_token_ids(ids, engine.text)
            text = tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
        except (TokenIdError, TokenizerError) as error:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        return pb.DetokenizeResponse(text=text)

    @_unary
    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        self._loaded()
        return self._model_info


class ServeError(RuntimeError):
    """The server could not start (e.g. the port is taken)."""


class Server:
    """A running server: gRPC (and optionally metrics over HTTP) on a thread with its own event loop.

    Create with `serve`. `port` and `metrics_port` are the ports actually bound. With `tls` both ports serve
    TLS; with `auth_token` both ask for the token (`serving.connection`: health and reflection stay open).
    Connections take clients' keepalive pings as `serving.connection.KEEPALIVE_OPTIONS` sets out.
    """

    def __init__(
        self,
        host: str,
        port: int,
        metrics_port: int | None,
        tls: Tls | None = None,
        auth_token: str | None = None,
        served_model_name: str | None = None,
        max_images: int = 0,
        allowed_media_domains: Sequence[str] | None = None,
    ):
        self.metrics = Metrics()
        self.max_message_bytes = max_message_bytes(max_images)
        self.servicer = InklingServicer(self.metrics)
        self.vllm = VllmEngineServicer(self.servicer, served_model_name, allowed_media_domains)
        self._health = health_async.HealthServicer()
        self._draining = False
        self._grpc: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-server", daemon=True)
        self._thread.start()
        try:
            self.port = self._call(self._start(host, port, tls, auth_token))
            self.metrics_port = None
            if metrics_port is not None:
                self.metrics_port = self._serve_metrics(host, metrics_port, tls, auth_token)
        except BaseException:
            self.stop()
            raise

    def _call(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _serve_metrics(self, host: str, port: int, tls: Tls | None, auth_token: str | None) -> int:
        try:
            return self.metrics.serve_http(host, port, tls.context if tls else None, auth_token)
        except OSError as error:
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise ServeError(f"cannot serve metrics on {address}: {error.strerror or error}") from None

    async def _start(self, host: str, port: int, tls: Tls | None, auth_token: str | None) -> int:
        interceptors = [TokenInterceptor(auth_token)] if auth_token is not None else None
        options = (*SERVER_OPTIONS, ("grpc.max_receive_message_length", self.max_message_bytes), *KEEPALIVE_OPTIONS)
        self._grpc = grpc.aio.server(interceptors=interceptors, options=options)
        add_service(self.servicer, self._grpc, pb.DESCRIPTOR.services_by_name["Inkling"], pb)
        add_service(self.vllm, self._grpc, vpb.DESCRIPTOR.services_by_name["VllmEngine"], vpb, common_pb2)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                VLLM_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._grpc,
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is not None:
                bound = self._grpc.add_secure_port(address, tls.grpc_credentials())
            else:
                bound = self._grpc.add_insecure_port(address)
        except RuntimeError as error:
            raise ServeError(f"cannot listen on {address}: {error}") from None
        if not bound:
            raise ServeError(f"cannot listen on {address}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._grpc.start()
        self._tasks = [self._loop.create_task(self._watch_health()), self._loop.create_task(self._sample())]
        return bound

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME, VLLM_SERVICE_NAME):
            await self._health.set(service, status)

    async def _watch_health(self) -> None:
        """SERVING exactly while a scheduler is attached, ready and not draining."""
        current = None
        while True:
            scheduler = self.servicer.scheduler
            serving = scheduler is not None and scheduler.ready and not scheduler.draining and not self._draining
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            if status != current:
                await self._set_health(status)
                current = status
            await asyncio.sleep(HEALTH_POLL_SECONDS)

    async def _sample(self) -> None:
        while True:
            self.metrics.sample_throughput()
            await asyncio.sleep(THROUGHPUT_SAMPLE_SECONDS)

    def attach(self, engine: Engine, scheduler: Scheduler) -> None:
        """Serve this engine's scheduler (health turns SERVING once the scheduler is ready)."""
        self._call(self._attach(engine, scheduler))

    async def _attach(self, engine: Engine, scheduler: Scheduler) -> None:
        self.servicer.attach(engine, scheduler)

    def drain(self, timeout: float | None = None) -> None:
        """Refuse new requests, turn health NOT_SERVING, and wait (up to `timeout` s) for in-flight ones."""
        self._call(self._refuse_then_say_not_serving())
        if self.servicer.scheduler is not None:
            self.servicer.scheduler.drain(timeout)

    async def _refuse_then_say_not_serving(self) -> None:
        """On the loop, where calls are admitted: refuse new requests, then tell health checks (a client that
        sees NOT_SERVING and retries elsewhere never lands a request here)."""
        self.servicer.draining = self._draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving: calls still running get `grace` seconds, then are cancelled. Idempotent."""
        if self._loop.is_closed():
            return
        self._call(self._shutdown(grace))
        self.servicer.prepare.shutdown(wait=False, cancel_futures=True)
        self.servicer.image_threads.shutdown(wait=False, cancel_futures=True)
        self.metrics.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _shutdown(self, grace: float | None) -> None:
        for task in self._tasks:
            task.cancel()
        await self._health.enter_graceful_shutdown()
        if self._grpc is not None:
            await self._grpc.stop(grace)


def serve(
    scheduler: Scheduler | None,
    engine: Engine | None,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    tls: Tls | None = None,
    auth_token: str | None = None,
    served_model_name: str | None = None,
    max_images: int = 0,
    allowed_media_domains: Sequence[str] | None = None,
) -> Server:
    """Start serving on host:port (port 0: a free one, see `Server.port`); metrics on `metrics_port`; over TLS
    with `tls`, to callers bearing `auth_token` when one is given (see `Server`); the vLLM engine protocol names
    the model `served_model_name` (default: the checkpoint directory's name). Messages may be as large as a
    prompt of the whole context and `max_images` images (`max_message_bytes`; `serving.main` passes the engine's
    --max-images); the images SMG's gateway forwards as http(s) URLs are fetched from `allowed_media_domains`
    only (None: any host).

    With no scheduler and engine yet (the model still loading) calls get UNAVAILABLE until `attach`.
    """
    server = Server(host, port, metrics_port, tls, auth_token, served_model_name, max_images, allowed_media_domains)
    if scheduler is not None and engine is not None:
        server.attach(engine, scheduler)
    return server
