"""SMG's vLLM engine protocol (`vllm.grpc.engine.VllmEngine`, PyPI `smg-grpc-proto`) over the same scheduler as
`inkling.v1`, on the same port: the Shepherd Model Gateway (SMG) finds this server by probing each engine
protocol's HealthCheck, registers it as a vLLM-protocol worker, and serves OpenAI and Anthropic clients in front
of it (`smg launch --worker-urls grpc://HOST:PORT --model-path DIR --reasoning-parser inkling
--tool-call-parser inkling`).

The gateway renders the chat template, tokenizes and detokenizes: a request arrives as token ids and the answer
carries token ids only. A streamed call sends each choice's new tokens as chunks and ends each choice with a
`complete`; an unstreamed call sends one `complete` a choice holding all its tokens. Stop strings are matched here
as well as in the gateway (which neither ends generation at its own match nor un-bills the tokens past it), so
generation stops at the first one; the ids sent run through the token that completed it and the gateway trims
the text. Structured-output constraints (json_schema, json_object, regex, grammar, choice, and the structural tag of
forced tool calls that a required or named tool_choice becomes) constrain the answer in Inkling's chat framing
(`inkling_jax.runtime.constraints`), or run from the first generated token where the gateway shaped the constraint
itself (`grammar_from_first_token`). What the engine cannot do yet (images preprocessed by the gateway, min_tokens,
logit_bias, prompt log-probabilities) is refused as INVALID_ARGUMENT naming the field, which SMG answers with HTTP
400.

Images come as `media_refs` (GetServerInfo advertises `mm_processor="inprocess"`): data:, http: and https: URLs in
prompt order, with `tokenized` input ids holding one `<|content_image|>` per image (as the chat template renders an
image part); the server fetches each URL (`serving.media`: at most MAX_IMAGE_BYTES, within FETCH_TIMEOUT_SECONDS)
on its image threads, checks and decodes it, and puts its run of placeholders after its marker. SMG sends
media_refs only to a model that matches none of its own processors' specs: its Inkling spec takes every model
whose name contains "inkling", so serve the model under another name (`--served-model-name`).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import io
import json
import logging
import secrets
import time
import zipfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from inkling_jax.config import load_config
from inkling_jax.runtime.constraints import Constraint
from inkling_jax.runtime.engine import Engine
from inkling_jax.runtime.kv_events import Batch, Cleared, Removed, ResumeError, Stored
from inkling_jax.runtime.requests import MAX_LOGPROBS, Delta, Rejected, Request, validate, validate_sizes
from inkling_jax.runtime.scheduler import Scheduler
from inkling_jax.runtime.text_stream import TextStream
from serving.calls import STATUS_OF_CODE, CallError, Unparsable, cut_at_stop_strings
from serving.media import URL_SCHEMES, EncodedImage, check_count, expand, fetch, tiles_of, url_scheme

if TYPE_CHECKING:
    from serving.server import InklingServicer

log = logging.getLogger("serving")
SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
MAX_CHOICES = 16  # n: each choice is a sequence of its own in the scheduler
TOKENIZER_CHUNK_BYTES = 64 << 10  # the gateway's limit on one GetTokenizer message
# the files of a checkpoint directory the gateway reads to render chat and detokenize (its tokenizer bundle)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)


@dataclass
class Choice:
    """One of a call's n sequences: its engine request and what it has emitted."""

    index: int
    request: Request
    text: TextStream | None
    deltas: asyncio.Queue[Delta] | None = None
    emitted: list[int] = field(default_factory=list)
    logprobs: vpb.OutputLogProbs = field(default_factory=vpb.OutputLogProbs)


def _refuse(message: str) -> None:
    raise CallError(grpc.StatusCode.INVALID_ARGUMENT, message)


def checked_fields(request: vpb.GenerateRequest) -> None:
    """Refuse the fields this engine does not honour (a silently ignored constraint or image would be wrong)."""
    params = request.sampling_params
    if request.HasField("mm_inputs") or len(request.extra_mm_inputs):
        _refuse(
            "mm_inputs: images processed by the gateway are not supported; this engine processes them itself "
            "(media_refs), which SMG sends for a served model name without 'inkling'"
        )
    refs = request.media_refs.items
    if refs and request.WhichOneof("input") != "tokenized":
        _refuse("media_refs need tokenized input: input_ids with one <|content_image|> per image")
    for i, ref in enumerate(refs):
        if ref.modality not in (common_pb2.MODALITY_UNSPECIFIED, common_pb2.IMAGE):
            _refuse(
                f"media_refs[{i}]: modality {common_pb2.Modality.Name(ref.modality)} is not supported (images only)"
            )
        url_scheme(f"media_refs[{i}]", ref.url)
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        _refuse("kv_transfer_params: KV transfer (disaggregated prefill) is not supported by this engine")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        _refuse(f"data_parallel_rank {request.data_parallel_rank}: this engine has one rank (0)")
    if params.min_tokens:
        _refuse("sampling_params.min_tokens is not supported by this engine yet")
    if params.logit_bias:
        _refuse("sampling_params.logit_bias is not supported by this engine yet")
    if params.HasField("prompt_logprobs"):
        _refuse("sampling_params.prompt_logprobs is not supported by this engine yet")
    if params.HasField("truncate_prompt_tokens"):
        _refuse("sampling_params.truncate_prompt_tokens is not supported by this engine")
    if params.HasField("logprobs") and not 0 <= params.logprobs <= MAX_LOGPROBS:
        _refuse(f"sampling_params.logprobs {params.logprobs}: give 0 to {MAX_LOGPROBS} top log-probabilities")
    if not 0 <= params.n <= MAX_CHOICES:
        _refuse(f"sampling_params.n {params.n}: at most {MAX_CHOICES} choices a request")


def engine_requests(request: vpb.GenerateRequest, request_id: str, prompt: tuple[int, ...], room: int) -> list[Request]:
    """The call's n engine requests (not validated yet), vLLM's defaults for unset fields: temperature 1, top_p 1
    and repetition_penalty 1 when zero, max_tokens up to the `room` one sequence has (the context, or less where
    the cache is smaller), a random seed when none is given (choice i samples from seed + i)."""
    params = request.sampling_params
    n = params.n or 1
    seed = params.seed if params.HasField("seed") else secrets.randbelow(2**32)
    max_tokens = params.max_tokens if params.HasField("max_tokens") else max(room - len(prompt), 1)
    constraint = request_constraint(params)
    return [
        Request(
            id=request_id if n == 1 else f"{request_id}/{i}",
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            temperature=params.temperature if params.HasField("temperature") else 1.0,
            top_p=params.top_p or 1.0,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty or 1.0,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            seed=(seed + i) % 2**32,
            stop_token_ids=tuple(params.stop_token_ids),
            stop=tuple(params.stop),
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs if params.HasField("logprobs") else None,
            constraint=constraint,
        )
        for i in range(n)
    ]


def request_constraint(params: vpb.SamplingParams) -> Constraint | None:
    """The structured-output constraint of the call (None without one, or for json_object false): framed by the
    engine after the prompt's chat framing unless the gateway shaped it from the first token."""
    kind = params.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not params.json_object):
        return None
    first = params.grammar_from_first_token
    if kind == "json_object":
        return Constraint("json_object", from_first_token=first)
    spec = tuple(params.choice.choices) if kind == "choice" else getattr(params, kind)
    return Constraint(kind, spec, from_first_token=first)


def output_logprobs(delta: Delta, count: int) -> vpb.OutputLogProbs:
    """The chosen tokens' log-probabilities of the delta's first `count` tokens, with their top ones."""
    tops = delta.top_logprobs or ((),) * len(delta.logprobs)
    return vpb.OutputLogProbs(
        token_logprobs=delta.logprobs[:count],
        token_ids=delta.token_ids[:count],
        top_logprobs=[
            vpb.TopLogProbs(values=[t.logprob for t in top], token_ids=[t.token_id for t in top])
            for top in tops[:count]
        ],
    )


def tokenizer_bundle(directory: Path) -> bytes:
    """The checkpoint's tokenizer files as the ZIP the gateway unpacks (GetTokenizer)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name in TOKENIZER_FILES:
            if (directory / name).is_file():
                bundle.write(directory / name, name)
    return buffer.getvalue()


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    """The vLLM engine protocol over the Inkling servicer's engine, scheduler, admission and metrics."""

    def __init__(
        self,
        inkling: InklingServicer,
        served_model_name: str | None = None,
        allowed_media_domains: Sequence[str] | None = None,
    ):
        self.inkling = inkling
        self.served_model_name = served_model_name
        # hosts media_refs' http(s) URLs may name (None: any)
        self.allowed_hosts = (
            None if allowed_media_domains is None else frozenset(h.lower() for h in allowed_media_domains)
        )
        self.started = time.time()
        self._calls: dict[str, list[str]] = {}  # call's request id -> its choices' engine ids; on the loop only
        self._bundle: tuple[bytes, str] | None = None  # the tokenizer ZIP and its sha256, made once

    def _name(self, engine: Engine) -> str:
        return self.served_model_name or Path(engine.checkpoint).name

    def _prepare(
        self, request: vpb.GenerateRequest, engine: Engine, scheduler: Scheduler, images: list[EncodedImage]
    ) -> list[Request]:
        """The call's validated engine requests (on the servicer's pool: it may tokenize text), their prompt with
        the `images`' placeholders after their markers (the images still to decode)."""
        params = request.sampling_params
        ids = request.tokenized.input_ids if request.WhichOneof("input") == "tokenized" else ()
        try:
            validate_sizes(len(ids), len(params.stop_token_ids), len(params.stop), engine.text)
        except Rejected as rejected:
            raise CallError(STATUS_OF_CODE[rejected.code], str(rejected)) from None
        match request.WhichOneof("input"):
            case "tokenized":
                prompt = tuple(request.tokenized.input_ids)
            case "text":
                prompt = tuple(self.inkling._encode(engine, request.text, False, "text input"))
            case _:
                _refuse("give the prompt as tokenized.input_ids or text")
        if images:
            setup = self.inkling.image_setup
            prompt = tuple(expand(prompt, [tiles_of(image, setup) for image in images], setup))
        request_id = self.inkling._request_id(request.request_id)
        requests = engine_requests(request, request_id, prompt, scheduler.max_sequence_tokens)
        if params.stop:
            self.inkling._tokenizer(engine, "a stop string")
        try:
            for engine_request in requests:
                validate(engine_request, engine.text)
            scheduler.prepare(requests[0])  # its choices share the constraint: compiled once, here on the pool
        except Rejected as rejected:
            raise CallError(STATUS_OF_CODE[rejected.code], str(rejected)) from None
        room = scheduler.max_sequence_tokens
        if len(prompt) + requests[0].max_tokens > room:
            raise CallError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"prompt ({len(prompt)} tokens) + max_tokens ({requests[0].max_tokens}) exceeds the {room} tokens one "
                "sequence can hold in this server",
            )
        return requests

    async def Generate(
        self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vpb.GenerateResponse]:
        self.inkling._calls += 1
        try:
            async for response in self._generate(request, context):
                yield response
        finally:
            self.inkling._calls -= 1

    async def _generate(
        self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vpb.GenerateResponse]:
        metrics, choices, call_id = self.inkling.metrics, [], None
        try:
            if isinstance(request, Unparsable):
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            engine, scheduler = self.inkling._loaded()
            self.inkling._admit(scheduler)
            loop = asyncio.get_running_loop()
            checked_fields(request)
            images = await self._fetched(request.media_refs.items)
            requests = await loop.run_in_executor(
                self.inkling.prepare, self._prepare, request, engine, scheduler, images
            )
            requests = await self.inkling.with_images(requests, images)
            skip = request.sampling_params.skip_special_tokens
            choices = [
                Choice(i, r, self.inkling._text_stream(engine, r.stop, skip) if r.stop else None)
                for i, r in enumerate(requests)
            ]
            call_id = request.request_id or requests[0].id
            if call_id in self._calls:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {call_id!r} is already in flight")
            self._calls[call_id] = [choice.request.id for choice in choices]
            for choice in choices:
                choice.deltas = self._submit(scheduler, choice.request)
        except CallError as error:
            self._forget(call_id, choices, scheduler if choices else None)
            metrics.requests_refused.labels(code=error.status.name.lower()).inc()
            await context.abort(error.status, str(error))
        except Exception as error:
            self._forget(call_id, choices, None)
            log.exception("vLLM-protocol Generate failed before submission")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
        outcome = "cancelled"
        try:
            async for response, finish in self._stream(scheduler, choices, request.stream):
                outcome = finish or outcome
                yield response
        except CallError as error:
            outcome = "error"
            await context.abort(error.status, str(error))
        except Exception as error:
            outcome = "error"
            log.exception("vLLM-protocol Generate %s failed", call_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
        finally:
            self._forget(call_id, choices, scheduler if outcome in ("cancelled", "error") else None)
            metrics.requests_finished.labels(finish_reason=outcome).inc()

    async def _fetched(self, refs: Sequence[vpb.MediaRef]) -> list[EncodedImage]:
        """The images of the call's media_refs (at most --max-images), fetched at once on the image threads."""
        check_count(len(refs), self.inkling.image_setup)
        loop, threads = asyncio.get_running_loop(), self.inkling.image_threads
        fetches = [
            loop.run_in_executor(threads, fetch, f"media_refs[{i}]", ref.url, self.allowed_hosts)
            for i, ref in enumerate(refs)
        ]
        return list(await asyncio.gather(*fetches))

    def _submit(self, scheduler: Scheduler, request: Request) -> asyncio.Queue[Delta]:
        try:
            return self.inkling._submit(scheduler, request)
        except CallError as error:
            if error.status == grpc.StatusCode.ALREADY_EXISTS:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
            raise

    def _forget(self, call_id: str | None, choices: list[Choice], scheduler: Scheduler | None) -> None:
        """Drop the call's record; with a scheduler, cancel its choices that were submitted."""
        if call_id is not None and self._calls.get(call_id) == [c.request.id for c in choices]:
            del self._calls[call_id]
        if scheduler is not None:
            for choice in choices:
                if choice.deltas is not None:
                    scheduler.cancel(choice.request.id)

    async def _stream(
        self, scheduler: Scheduler, choices: list[Choice], stream: bool
    ) -> AsyncIterator[tuple[vpb.GenerateResponse, str | None]]:
        """(response, the call's outcome once every choice has finished) from the choices' deltas, merged."""
        merged: asyncio.Queue[tuple[Choice, Delta]] = asyncio.Queue()

        async def forward(choice: Choice) -> None:
            while True:
                delta = await choice.deltas.get()
                merged.put_nowait((choice, delta))
                if delta.finish_reason is not None:
                    return

        tasks = [asyncio.create_task(forward(choice)) for choice in choices]
        try:
            running = len(choices)
            while running:
                choice, delta = await merged.get()
                if delta.finish_reason == "error":
                    raise CallError(grpc.StatusCode.INTERNAL, f"generation failed: {delta.error}")
                kept, _, stopped = cut_at_stop_strings(choice.text, delta)
                if stopped and delta.finish_reason is None:
                    scheduler.cancel(choice.request.id)
                new = delta.token_ids[:kept]
                choice.emitted.extend(new)
                logprobs = output_logprobs(delta, kept) if choice.request.logprobs is not None else None
                prompt = len(choice.request.prompt_token_ids)
                if stream and new:
                    chunk = vpb.GenerateStreamChunk(
                        token_ids=new, prompt_tokens=prompt, completion_tokens=len(new), index=choice.index
                    )
                    if logprobs is not None:
                        chunk.output_logprobs.CopyFrom(logprobs)
                    yield vpb.GenerateResponse(chunk=chunk), None
                elif logprobs is not None:
                    choice.logprobs.MergeFrom(logprobs)
                if stopped or delta.finish_reason is not None:
                    running -= 1
                    reason = "stop" if stopped else delta.finish_reason
                    emitted = new if stream else choice.emitted
                    complete = self._complete(choice, emitted, reason, prompt, delta.cached_tokens, stream)
                    yield vpb.GenerateResponse(complete=complete), reason if not running else None
                    if not running:
                        return
        finally:
            for task in tasks:
                task.cancel()

    @staticmethod
    def _complete(
        choice: Choice, ids: list[int], reason: str, prompt: int, cached: int, stream: bool
    ) -> vpb.GenerateComplete:
        complete = vpb.GenerateComplete(
            output_ids=ids,
            finish_reason=reason,
            prompt_tokens=prompt,
            completion_tokens=len(choice.emitted),
            cached_tokens=cached,
            index=choice.index,
        )
        if not stream and choice.request.logprobs is not None:
            complete.output_logprobs.CopyFrom(choice.logprobs)
        if choice.text is not None and choice.text.matched is not None:
            complete.matched_stop_str = choice.text.matched
        elif reason == "stop" and choice.emitted:
            complete.matched_token_id = choice.emitted[-1]
        return complete

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext) -> vpb.AbortResponse:
        """Cancel the calls named (unknown or finished ids are no error)."""
        scheduler = self.inkling.scheduler
        for call_id in request.request_ids:
            for engine_id in self._calls.get(call_id, ()):
                if scheduler is not None:
                    scheduler.cancel(engine_id)
        return vpb.AbortResponse()

    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vpb.HealthCheckResponse:
        """UNAVAILABLE while the model loads (the gateway retries registration); unhealthy while draining."""
        scheduler = self.inkling.scheduler
        if scheduler is None or not scheduler.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading the model; retry shortly")
        if self.inkling.draining or scheduler.draining:
            return vpb.HealthCheckResponse(healthy=False, message="draining")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def _loaded(self, context: grpc.aio.ServicerContext) -> tuple[Engine, Scheduler]:
        try:
            return self.inkling._loaded()
        except CallError as error:
            await context.abort(error.status, str(error))

    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetModelInfoResponse:
        engine, _ = await self._loaded(context)
        text, config = engine.text, load_config(engine.checkpoint)
        eos = text.eos_token_id
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        info = vpb.GetModelInfoResponse(
            model_path=Path(engine.checkpoint).name,
            is_generation=True,
            max_context_length=engine.max_context,
            vocab_size=text.unpadded_vocab_size,
            supports_vision=engine.image_limits is not None,
            served_model_name=self._name(engine),
            model_type=config.model_type,
            architectures=_architectures(engine.checkpoint),
            eos_token_ids=eos_ids,
            max_req_input_len=engine.max_context - 1,
        )
        defaults = _generation_defaults(engine.checkpoint)
        if defaults:
            info.default_sampling_params_json = json.dumps(defaults, separators=(",", ":"))
        return info

    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetServerInfoResponse:
        engine, scheduler = await self._loaded(context)
        limits = engine.image_limits
        images = {}
        if limits is not None:  # SMG's gateway sends an image model's images as URLs for this server to fetch
            images = {
                "mm_processor": "inprocess",
                "mm_media_ref_schemes": ",".join(URL_SCHEMES),
                "mm_item_limits": f"image={limits.max_images}",
            }
        return vpb.GetServerInfoResponse(
            active_requests=self.inkling.in_flight,
            is_paused=self.inkling.draining or scheduler.draining,
            last_receive_timestamp=time.time(),
            uptime_seconds=time.time() - self.started,
            server_type="inkling-jax-grpc",
            data_parallel_size=1,
            kv_cache_dtype=str(engine.dtype),
            block_size=engine.page_size,
            attention_backend="ragged_paged_attention",
            model_dtype=str(engine.dtype),
            max_num_seqs=engine.max_num_seqs,
            constrained_decoding_start="after_reasoning",  # the engine frames a constraint after the thought
            **images,
        )

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> vpb.GetLoadsResponse:
        engine, scheduler = await self._loaded(context)
        stats, page = scheduler.stats(), engine.page_size
        total = stats.pages_total * page
        load = vpb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=stats.running,
            num_waiting_reqs=stats.waiting,
            num_total_reqs=stats.running + stats.waiting,
            num_used_tokens=stats.pages_used * page,
            max_total_num_tokens=total,
            token_usage=stats.pages_used / stats.pages_total if stats.pages_total else 0.0,
            max_running_requests=engine.max_num_seqs,
        )
        return vpb.GetLoadsResponse(timestamp=_timestamp(), version="1", dp_rank_count=1, loads=[load])

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The checkpoint's tokenizer files as a ZIP, in chunks; the last one carries the whole ZIP's sha256."""
        engine, _ = await self._loaded(context)
        if engine.tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{Path(engine.checkpoint).name} has no tokenizer")
        if self._bundle is None:
            directory = Path(engine.checkpoint)
            bundle = await asyncio.get_running_loop().run_in_executor(
                self.inkling.prepare, tokenizer_bundle, directory if directory.is_dir() else directory.parent
            )
            self._bundle = bundle, hashlib.sha256(bundle).hexdigest()
        bundle, digest = self._bundle
        starts = range(0, len(bundle), TOKENIZER_CHUNK_BYTES)
        for start in starts:
            last = start == starts[-1]
            yield common_pb2.GetTokenizerChunk(
                data=bundle[start : start + TOKENIZER_CHUNK_BYTES], sha256=digest if last else ""
            )

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's changes (`inkling_jax.runtime.kv_events`), as they happen, for the gateway's
        cache-aware routing: pages of 128 tokens, with their token ids; UNIMPLEMENTED without a prefix cache,
        OUT_OF_RANGE for a batch no longer kept, DATA_LOSS for a subscriber that fell too far behind."""
        _, scheduler = await self._loaded(context)
        if scheduler.kv_events is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the prefix cache is off (--no-prefix-cache)")
        loop, arrived = asyncio.get_running_loop(), asyncio.Event()
        try:
            subscription = scheduler.kv_events.subscribe(
                request.start_sequence_number, lambda: loop.call_soon_threadsafe(arrived.set)
            )
        except ResumeError as error:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(error))
        try:
            await context.send_initial_metadata(())
            while True:
                arrived.clear()
                batches = subscription.take()
                if subscription.lost:
                    await context.abort(grpc.StatusCode.DATA_LOSS, "fell too far behind the cache's events")
                for batch in batches:
                    yield kv_event_batch(batch)
                if not batches:
                    await arrived.wait()
        finally:
            scheduler.kv_events.unsubscribe(subscription)

    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext) -> vpb.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this engine serves a generative model, not embeddings")


def kv_event_batch(batch: Batch) -> common_pb2.KvEventBatch:
    """A batch of the prefix cache's events as the gateway's protocol has it."""
    out = common_pb2.KvEventBatch(sequence_number=batch.number, timestamp=batch.timestamp)
    if batch.replica >= 0:
        out.dp_rank = batch.replica
    for event_id, event in enumerate(batch.events):
        message = out.events.add(event_id=event_id)
        match event:
            case Stored():
                stored = message.stored
                stored.blocks.add(block_hash=event.block, token_ids=event.tokens, block_size=len(event.tokens))
                if event.parent is not None:
                    stored.parent_block_hash = event.parent
            case Removed():
                message.removed.block_hashes.extend(event.blocks)
            case Cleared():
                message.cleared.SetInParent()
    return out


def _architectures(checkpoint: str | Path) -> list[str]:
    path = Path(checkpoint)
    config = path / "config.json" if path.is_dir() else path
    return list(json.loads(config.read_text()).get("architectures", []))


def _generation_defaults(checkpoint: str | Path) -> dict[str, float | int]:
    """generation_config.json's sampling defaults, which the gateway applies to fields a client leaves unset."""
    path = Path(checkpoint) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: config[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in config}


def _timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()
