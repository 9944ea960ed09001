"""What a request to the engine is, where it is checked, what its stream receives, and how it is refused.

Every front door builds the same `Request` (the gRPC server from its message, the batch runner from a
JSONL line with `request_from_json`) and `validate` checks it against the model once, before anything
is queued: types, ranges and token ids, each error naming the field. The scheduler streams `Delta`s back.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Sequence
from pathlib import Path

from inkling_jax.chat import ChatTemplate, ChatTemplateError
from inkling_jax.config import TextConfig
from inkling_jax.image_processor import ImageProcessorSettings
from inkling_jax.runtime.constraints import Constraint, ConstraintError, constraint_from_json
from inkling_jax.runtime.images import (
    IMAGE_MARKER,
    ImageLimits,
    RequestImage,
    check_images,
    encode_marked,
    expand_after_markers,
    load_images,
)
from inkling_jax.tokenizer import Tokenizer

# How many top log-probabilities a request may ask for per token (the step computes this many always).
MAX_LOGPROBS = 20
# Stop conditions a request may carry: each generated token is checked against them.
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 1024  # characters


class Code(enum.Enum):
    """Why a request is refused (the server maps these to gRPC status codes)."""

    INVALID_ARGUMENT = (
        "invalid_argument"  # a field of the wrong type or out of range, a token id outside the vocabulary
    )
    OUT_OF_RANGE = "out_of_range"  # prompt + max_tokens past the model's context
    RESOURCE_EXHAUSTED = "resource_exhausted"  # could never fit the page pool, or the queue is full
    UNAVAILABLE = "unavailable"  # warming up or draining


class Rejected(ValueError):
    """A refused request; `code` says which kind, the message says what is wrong."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: the prompt as token ids, sampling and stopping. The defaults are neutral
    (temperature 1, no filtering, no penalties)."""

    id: str | int
    prompt_token_ids: Sequence[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()  # stop strings: the text ends before the first one (needs a tokenizer)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no log-probabilities; n: the chosen token's and the top n
    speculative: bool = True  # speculate when the engine does (--speculative); False: plain decoding
    images: Sequence[RequestImage] = ()  # one per run of image placeholders in the prompt, in order
    constraint: Constraint | None = None  # what the generated text must match (structured outputs)


# name: (integral, low, high, low open); every number field's one range
RANGES = {
    "max_tokens": (True, 1, math.inf, False),
    "temperature": (False, 0.0, 100.0, False),
    "top_p": (False, 0.0, 1.0, True),
    "top_k": (True, 0, math.inf, False),
    "min_p": (False, 0.0, 1.0, False),
    "repetition_penalty": (False, 0.0, 10.0, True),
    "presence_penalty": (False, -2.0, 2.0, False),
    "frequency_penalty": (False, -2.0, 2.0, False),
    "seed": (True, 0, 2**32 - 1, False),
    "logprobs": (True, 0, MAX_LOGPROBS, False),
}
FIELDS = frozenset(field.name for field in dataclasses.fields(Request))
NO_TOKENIZER = "the checkpoint has no tokenizer.json (a dummy model from a config file has none)"


def validate(request: Request, text: TextConfig, images: ImageLimits | None = None) -> None:
    """Raise Rejected naming the first field of the wrong type or out of range, a token id outside the
    vocabulary, or stop conditions past their limits; OUT_OF_RANGE when prompt + max_tokens runs past the model's
    context. Sizes are checked before contents, so an oversized request costs no step per entry. `images`: what
    the engine's image tower takes (None: no images), against which the request's images and the prompt's
    placeholder runs are checked (`images.check_images`)."""

    def refuse(message: str) -> Rejected:
        return Rejected(Code.INVALID_ARGUMENT, message)

    if isinstance(request.id, bool) or not isinstance(request.id, str | int):
        raise refuse(f"id must be a string or an integer, got {request.id!r}")
    for name, entries in (
        ("prompt_token_ids", "integers"),
        ("stop_token_ids", "integers"),
        ("stop", "strings"),
        ("images", "images"),
    ):
        if not isinstance(getattr(request, name), list | tuple):
            raise refuse(f"{name} must be a list of {entries}")
    prompt, context = len(request.prompt_token_ids), text.max_position_embeddings
    validate_sizes(prompt, len(request.stop_token_ids), len(request.stop), text)
    for name in ("prompt_token_ids", "stop_token_ids"):
        _check_token_ids(name, getattr(request, name), text.unpadded_vocab_size)
    if not request.prompt_token_ids:
        raise refuse("the prompt is empty")
    for name, (integral, low, high, low_open) in RANGES.items():
        value = getattr(request, name)
        if value is None and name == "logprobs":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (integral and not isinstance(value, int)):
            raise refuse(f"{name} must be {'an integer' if integral else 'a number'}, got {value!r}")
        if not math.isfinite(value):
            raise refuse(f"{name} must be a finite number, got {value!r}")
        if not (low < value if low_open else low <= value) or value > high:
            raise refuse(f"{name} must be {_bounds(low, high, low_open)}, got {value!r}")
    if not all(isinstance(s, str) and s for s in request.stop):
        raise refuse("stop must be a list of non-empty strings")
    if any(len(s) > MAX_STOP_STRING_LENGTH for s in request.stop):
        raise refuse(f"a stop string is longer than {MAX_STOP_STRING_LENGTH} characters")
    for name in ("ignore_eos", "speculative"):
        if not isinstance(getattr(request, name), bool):
            raise refuse(f"{name} must be true or false, got {getattr(request, name)!r}")
    if request.constraint is not None:
        if not isinstance(request.constraint, Constraint):
            raise refuse(f"constraint must be a Constraint, got {request.constraint!r}")
        if request.ignore_eos:
            raise refuse("ignore_eos cannot go with a constraint: the constrained text ends with the end of sequence")
        try:
            request.constraint.check()
        except ConstraintError as error:
            raise refuse(f"constraint: {error}") from None
    if prompt + request.max_tokens > context:
        raise Rejected(
            Code.OUT_OF_RANGE,
            f"prompt ({prompt} tokens) + max_tokens ({request.max_tokens}) exceeds the model's {context} positions",
        )
    if request.images and images is None:
        raise refuse("this model takes no images")
    if images is not None:
        problem = check_images(request.images, request.prompt_token_ids, images)
        if problem is not None:
            raise refuse(problem)


def validate_sizes(prompt: int, stop_token_ids: int, stop: int, text: TextConfig) -> None:
    """Rejected when a request's prompt (in tokens) cannot fit the context or its stop conditions are past their
    limits: what a front door checks from the lengths alone, before it copies the entries."""
    context = text.max_position_embeddings
    if prompt > context:
        raise Rejected(Code.OUT_OF_RANGE, f"the prompt ({prompt} tokens) exceeds the model's {context} positions")
    limits = (("stop_token_ids", stop_token_ids, MAX_STOP_TOKEN_IDS), ("stop", stop, MAX_STOP_STRINGS))
    for name, count, limit in limits:
        if count > limit:
            raise Rejected(Code.INVALID_ARGUMENT, f"{name} has {count} entries, more than the {limit} allowed")


def _check_token_ids(name: str, ids: Sequence[object], vocab: int) -> None:
    """Rejected naming the first entry of `ids` that is not an integer in [0, vocab)."""
    if all(type(token) is int for token in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return  # the common case, without a Python step per id
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise Rejected(Code.INVALID_ARGUMENT, f"{name}[{i}] is {token!r}, not an integer")
        if not 0 <= token < vocab:
            raise Rejected(Code.INVALID_ARGUMENT, f"{name}[{i}] is {token}, outside the vocabulary [0, {vocab})")


def _bounds(low: float, high: float, low_open: bool) -> str:
    if high == math.inf:
        return f"{'greater than' if low_open else 'at least'} {low}"
    return f"within {'(' if low_open else '['}{low}, {high}]"


PROMPTS = ("prompt", "prompt_token_ids", "messages")


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """How a JSONL line's "images" become a request's: paths resolve against `directory` and are processed with
    `settings`; the engine's `limits` check them."""

    directory: Path
    settings: ImageProcessorSettings
    limits: ImageLimits


def request_from_json(
    line: str,
    tokenizer: Tokenizer | None,
    text: TextConfig,
    chat: ChatTemplate | None = None,
    images: ImageSource | None = None,
) -> Request:
    """One JSON object -> a validated Request: {"id", "prompt_token_ids" | "prompt" (text, encoded with
    `tokenizer`) | "messages" (OpenAI-style, with optional "tools", rendered by the checkpoint's chat template
    `chat` as the SMG gateway renders them), optionally "images" (paths, read through `images`; None: the model
    takes none), and any other `Request` field}. With "prompt" or "messages", each image's place is an
    `<|content_image|>` marker (in the text, or rendered for a message's image part), which its run of placeholders
    follows; with "prompt_token_ids" the runs are there already. Rejected names what is wrong."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as error:
        raise Rejected(Code.INVALID_ARGUMENT, f"not JSON ({error})") from error
    if not isinstance(raw, dict):
        raise Rejected(Code.INVALID_ARGUMENT, "a request must be a JSON object")
    unknown = sorted(set(raw) - FIELDS - {"prompt", "messages", "tools"})
    if unknown:
        raise Rejected(Code.INVALID_ARGUMENT, f"unknown field(s) {', '.join(unknown)}")
    if "id" not in raw:
        raise Rejected(Code.INVALID_ARGUMENT, "missing 'id'")
    if sum(name in raw for name in PROMPTS) != 1:
        raise Rejected(Code.INVALID_ARGUMENT, "give exactly one of 'prompt' (text), 'prompt_token_ids' and 'messages'")
    if "tools" in raw and "messages" not in raw:
        raise Rejected(Code.INVALID_ARGUMENT, "'tools' go with 'messages'")
    if tokenizer is None and ("prompt" in raw or "messages" in raw or raw.get("stop")):
        field = "'prompt' (text)" if "prompt" in raw else "'messages'" if "messages" in raw else "'stop' strings"
        raise Rejected(Code.INVALID_ARGUMENT, f"{field} needs a tokenizer ({NO_TOKENIZER}); send token ids")
    given_ids = "prompt_token_ids" in raw  # already expanded: the runs are checked, not made
    if "images" in raw:
        if images is None:
            raise Rejected(Code.INVALID_ARGUMENT, "this model takes no images")
        if isinstance(raw["images"], list) and len(raw["images"]) > images.limits.max_images:
            count, most = len(raw["images"]), images.limits.max_images
            raise Rejected(Code.INVALID_ARGUMENT, f"{count} images, more than the {most} a request may carry")
        try:
            raw["images"] = load_images(raw["images"], images.directory, images.settings)
        except ValueError as error:
            raise Rejected(Code.INVALID_ARGUMENT, str(error)) from None
    if "prompt" in raw:
        if not isinstance(raw["prompt"], str):
            raise Rejected(Code.INVALID_ARGUMENT, "'prompt' must be a string")
        raw["prompt_token_ids"] = _text_prompt(raw.pop("prompt"), tokenizer, bool(raw.get("images")))
    if "messages" in raw:
        raw["prompt_token_ids"] = _chat_prompt(raw.pop("messages"), raw.pop("tools", None), tokenizer, chat)
        marked = raw["prompt_token_ids"].count(tokenizer.special_tokens.get(IMAGE_MARKER))
        if marked and not raw.get("images"):
            raise Rejected(Code.INVALID_ARGUMENT, f"'messages' hold {marked} image parts and no 'images' to fill them")
    if raw.get("images") and not given_ids:
        raw["prompt_token_ids"] = _expand(raw["prompt_token_ids"], raw["images"], tokenizer, images.limits)
    for name in ("prompt_token_ids", "stop_token_ids", "stop"):
        if isinstance(raw.get(name), list):
            raw[name] = tuple(raw[name])
    if raw.get("constraint") is not None:
        try:
            raw["constraint"] = constraint_from_json(raw["constraint"])
        except ConstraintError as error:
            raise Rejected(Code.INVALID_ARGUMENT, f"constraint: {error}") from None
    request = Request(**raw)
    validate(request, text, None if images is None else images.limits)
    return request


def _text_prompt(prompt: str, tokenizer: Tokenizer, with_images: bool) -> list[int]:
    """The ids of a text prompt (special-token strings stay text), each image marker (`<|content_image|>`) its
    token where the request carries images."""
    if not with_images:
        return tokenizer.encode(prompt)
    try:
        return encode_marked(tokenizer, prompt)
    except ValueError as error:
        raise Rejected(Code.INVALID_ARGUMENT, str(error)) from None


def _expand(ids: list[int], images: tuple[RequestImage, ...], tokenizer: Tokenizer, limits: ImageLimits) -> list[int]:
    """The prompt with each image marker followed by its image's run of placeholders."""
    if IMAGE_MARKER not in tokenizer.special_tokens:
        raise Rejected(Code.INVALID_ARGUMENT, f"the tokenizer has no {IMAGE_MARKER} token to place images with")
    marker = tokenizer.special_tokens[IMAGE_MARKER]
    try:
        return expand_after_markers(ids, marker, [image.tiles for image in images], limits.image_token_id)
    except ValueError as error:
        raise Rejected(Code.INVALID_ARGUMENT, str(error)) from None


def _chat_prompt(messages: object, tools: object, tokenizer: Tokenizer, chat: ChatTemplate | None) -> list[int]:
    """The ids of a conversation rendered by the chat template (its framing tokens as special tokens)."""
    if chat is None:
        raise Rejected(
            Code.INVALID_ARGUMENT,
            "'messages' needs the checkpoint's chat template (chat_template.jinja, or 'chat_template' in "
            "tokenizer_config.json), and it has none; send 'prompt' or 'prompt_token_ids'",
        )
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise Rejected(Code.INVALID_ARGUMENT, "'messages' must be a list of objects with a 'role'")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise Rejected(Code.INVALID_ARGUMENT, "'tools' must be a list of objects")
    try:
        return tokenizer.encode(chat.render(messages, tools=tools), special_tokens=True)
    except ChatTemplateError as error:
        raise Rejected(Code.INVALID_ARGUMENT, f"'messages': {error}") from None


@dataclasses.dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclasses.dataclass(frozen=True)
class Delta:
    """Newly generated tokens of one request, and at the end why it finished.

    finish_reason: None while running; "stop" (EOS, a stop token, included in token_ids, or a stop
    string), "length" (max_tokens), "abort" (cancelled) or "error" (message in `error`).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()  # of each token in token_ids, when asked for
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] = ()
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    error: str | None = None
    acceptance_length: float = 0.0  # tokens emitted per speculative round so far (0: none ran)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
