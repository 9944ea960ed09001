"""`python -m serving.client`: send a prompt to a running server and stream the continuation to stdout.

    python -m serving.client [--address 127.0.0.1:50051] "prompt text" [--max-tokens 64] [--temperature 0] ...
    python -m serving.client --token-ids 1,2,3 [...]     # token ids in (a checkpoint without a tokenizer)
    python -m serving.client "What is this?" --image a.png [--image b.jpg ...]   # an image model
    python -m serving.client --info                      # what the server runs (GetModelInfo)
    python -m serving.client --tls-ca CA.pem --auth-token-file TOKEN ...   # a server with TLS and a token

Each --image goes at a `<|content_image|>` marker of the prompt, in order: in the text where it has them, else
one marker per image is put in front of the text; with --token-ids the ids hold the markers' id. The media type
is the file's extension's (the server checks it against the bytes).

Text is printed as it arrives; when the stream carries no text (a server without a tokenizer) the
generated token ids are printed instead. A summary line (finish reason, token counts) goes to stderr.
A refused request prints the server's status and message and exits 1; bad flags, or a CA, token or image file
that cannot be used, exit 2.
"""

from __future__ import annotations

import argparse
import json
import mimetypes
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from inkling_jax.cli import argument_parser
from inkling_jax.runtime.images import IMAGE_MARKER
from serving.connection import ConnectionSetupError, read_certificates, read_token, token_metadata
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be integers separated by commas, got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argument_parser("serving.client", "Stream a generation")
    parser.add_argument("prompt", nargs="?", help="prompt text")
    parser.add_argument("--address", default="127.0.0.1:50051", help="server HOST:PORT")
    parser.add_argument("--token-ids", type=_token_ids, help="prompt as token ids: 1,2,3")
    parser.add_argument("--info", action="store_true", help="print the server's model info and exit")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help=f"an image file (PNG, JPEG, WebP, GIF) at the prompt's next {IMAGE_MARKER} (repeatable)",
    )
    parser.add_argument("--request-id", default="")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--presence-penalty", type=float)
    parser.add_argument("--frequency-penalty", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-ids", type=_token_ids, default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, help="print the chosen and top-N log-probabilities to stderr")
    parser.add_argument("--parse-special-tokens", action="store_true", help="special-token strings in the prompt")
    parser.add_argument("--keep-special-tokens", action="store_true", help="show special tokens in the text")
    parser.add_argument("--no-speculative", action="store_true", help="decode plainly on a speculating server")
    constrained = parser.add_mutually_exclusive_group()  # structured output: the answer matches one of these
    constrained.add_argument("--json-schema", metavar="FILE", help="the answer is JSON the schema in FILE admits")
    constrained.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    constrained.add_argument("--regex", help="the answer matches this regular expression")
    constrained.add_argument("--grammar", metavar="FILE", help="the answer follows the Lark or GBNF grammar in FILE")
    constrained.add_argument("--choice", nargs="+", help="the answer is one of these strings")
    parser.add_argument("--timeout", type=float, help="deadline in seconds")
    parser.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's root certificates")
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="connect over TLS, trusting the PEM certificates in FILE (a self-signed server certificate is its own CA)",
    )
    parser.add_argument(
        "--auth-token-file", metavar="FILE", help="send the token FILE holds, as the server's --auth-token-file does"
    )
    args = parser.parse_args(argv)
    if not args.info and (args.prompt is None) == (args.token_ids is None):
        parser.error("give a prompt or --token-ids (one of them)")
    return args


class InputFileError(ValueError):
    """An --image, --json-schema or --grammar file that cannot be read."""


def read_image(path: str) -> pb.Image:
    """The file's bytes, with the media type its extension names (empty when it names none)."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise InputFileError(f"cannot read --image {path}: {error.strerror or error}") from None
    media_type, _ = mimetypes.guess_type(path)
    return pb.Image(data=data, media_type=media_type if media_type and media_type.startswith("image/") else "")


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    """The Generate request the flags describe (InputFileError for an input file that cannot be read)."""
    request = pb.GenerateRequest(
        request_id=args.request_id,
        parse_special_tokens=args.parse_special_tokens,
        keep_special_tokens=args.keep_special_tokens,
    )
    if args.token_ids is not None:
        request.token_ids.ids.extend(args.token_ids)
    else:
        marked = IMAGE_MARKER in args.prompt or not args.image
        request.text = args.prompt if marked else IMAGE_MARKER * len(args.image) + args.prompt
    request.images.extend(read_image(path) for path in args.image)
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
    ):
        if getattr(args, name) is not None:
            setattr(request.sampling, name, getattr(args, name))
    if args.max_tokens is not None:
        request.stop.max_tokens = args.max_tokens
    request.stop.stop.extend(args.stop)
    request.stop.stop_token_ids.extend(args.stop_token_ids)
    request.stop.ignore_eos = args.ignore_eos
    if args.logprobs is not None:
        request.logprobs = args.logprobs
    if args.no_speculative:
        request.speculative = False
    if args.json_schema is not None:
        request.constraint.json_schema = read_text(args.json_schema, "--json-schema")
    elif args.grammar is not None:
        request.constraint.grammar = read_text(args.grammar, "--grammar")
    elif args.json_object:
        request.constraint.json_object = True
    elif args.regex is not None:
        request.constraint.regex = args.regex
    elif args.choice is not None:
        request.constraint.choice.choices.extend(args.choice)
    return request


def read_text(path: str, flag: str) -> str:
    """A constraint file's text (InputFileError when it cannot be read)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InputFileError(f"cannot read {flag} {path}: {getattr(error, 'strerror', None) or error}") from None


def open_channel(args: argparse.Namespace) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]]:
    """The channel to the server (TLS with --tls / --tls-ca) and the metadata every call sends (the token)."""
    metadata = token_metadata(read_token(args.auth_token_file)) if args.auth_token_file is not None else ()
    if args.tls or args.tls_ca is not None:
        roots = read_certificates(args.tls_ca, "--tls-ca") if args.tls_ca is not None else None
        return grpc.secure_channel(args.address, grpc.ssl_channel_credentials(root_certificates=roots)), metadata
    return grpc.insecure_channel(args.address), metadata


def generate(
    stub: pb_grpc.InklingStub,
    request: pb.GenerateRequest,
    timeout: float | None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """Stream the continuation: text to stdout as it arrives, the summary (and log-probabilities) to stderr."""
    token_ids, printed_text = [], False
    for response in stub.Generate(request, timeout=timeout, metadata=metadata):
        token_ids.extend(response.token_ids)
        if response.text:
            sys.stdout.write(response.text)
            sys.stdout.flush()
            printed_text = True
        for token, logprob in zip(response.token_ids, response.logprobs, strict=False):
            top = ", ".join(f"{t.token_id}: {t.logprob:.3f}" for t in logprob.top)
            print(f"[{token}: {logprob.logprob:.3f}{'; top ' + top if top else ''}]", file=sys.stderr)
        if response.finish_reason:
            if not printed_text:
                sys.stdout.write(json.dumps(token_ids))
            sys.stdout.write("\n")
            reason = pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
            matched = f", stop string {response.matched_stop!r}" if response.matched_stop else ""
            usage = response.usage
            accepted = f", acceptance length {usage.acceptance_length:.2f}" if usage.acceptance_length else ""
            print(
                f"[{reason}{matched}; prompt {usage.prompt_tokens} tokens, "
                f"completion {usage.completion_tokens} tokens{accepted}]",
                file=sys.stderr,
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        request = None if args.info else build_request(args)
        channel, metadata = open_channel(args)
    except (InputFileError, ConnectionSetupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with channel:
        stub = pb_grpc.InklingStub(channel)
        try:
            if args.info:
                info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout or 10.0, metadata=metadata)
                print(
                    json.dumps(
                        json_format.MessageToDict(
                            info, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
                        ),
                        indent=2,
                    )
                )
            else:
                generate(stub, request, args.timeout, metadata)
        except grpc.RpcError as error:
            sys.stdout.flush()
            print(f"\nerror: {describe(error, args.address)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # closing the channel cancels the call, which frees its slot on the server
            return 130
    return 0


def describe(error: grpc.RpcError, address: str) -> str:
    """One line for a failed call: the status and the server's message, or why the server was not reached."""
    code, details = error.code(), error.details()
    if code == grpc.StatusCode.UNAVAILABLE and "handshake" in details.lower():
        return f"no TLS connection to {address} (a server without TLS, or a certificate not trusted): {details}"
    if code == grpc.StatusCode.UNAVAILABLE and ("connect" in details.lower() or "connection" in details.lower()):
        return f"cannot reach a server at {address} (is it running?): {details}"
    return f"{code.name}: {details}"


if __name__ == "__main__":
    sys.exit(main())
