"""What every gRPC service of the server shares: a call's error as a status, requests whose bytes do not parse,
and registering a service with parsers that hand such requests to the handler."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

from inkling_jax.runtime.requests import Code, Delta
from inkling_jax.runtime.text_stream import TextStream

STATUS_OF_CODE = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class CallError(Exception):
    """Ends a call with a gRPC status; the message says what is wrong."""

    def __init__(self, status: grpc.StatusCode, message: str):
        super().__init__(message)
        self.status = status


class Unparsable:
    """A request whose bytes are not a valid message of its type (a handler refuses it as INVALID_ARGUMENT)."""

    def __init__(self, message_type: str, error: DecodeError):
        self.message = f"the request is not a valid {message_type}: {error}"


def _parser(message_type: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as error:  # malformed bytes, or a string field that is not UTF-8
            return Unparsable(message_type.DESCRIPTOR.full_name, error)

    return parse


def add_service(servicer: Any, server: grpc.aio.Server, service: ServiceDescriptor, *messages: ModuleType) -> None:
    """Register `service` as its generated `add_*Servicer_to_server` does (its messages found in `messages`), with
    request parsers that hand an unparsable message to the handler (gRPC would answer UNKNOWN with a Python
    traceback's text)."""

    def message(name: str) -> Any:
        return next(getattr(module, name) for module in messages if hasattr(module, name))

    handlers = {}
    for method in service.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_parser(message(method.input_type.name)),
            response_serializer=message(method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def cut_at_stop_strings(text: TextStream | None, delta: Delta) -> tuple[int, str, bool]:
    """(how many of the delta's tokens to send, the text they add, whether a stop string ended the stream) for a
    call whose text is `text` (None: no stop strings to match)."""
    if text is None:
        return len(delta.token_ids), "", False
    pushed = text.push(delta.token_ids)
    kept, piece, stopped = pushed.tokens, pushed.text, pushed.stopped
    if not stopped and delta.finish_reason is not None:
        piece += text.finish()
        stopped = text.matched is not None
    return kept, piece, stopped
