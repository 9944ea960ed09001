"""What a request to the engine is, what its stream receives, and how it can be refused.

The server and the offline runner turn their inputs into `EngineRequest`s (prompts already tokenized,
parameters already range-checked by `validate_options`); the scheduler streams `Delta`s back.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from inkling_jax.config import TextConfig

# How many top log-probabilities a request may ask for per token (the step computes this many always).
MAX_LOGPROBS = 20


class Code(enum.Enum):
    """Why a request is refused (the server maps these to gRPC status codes)."""

    INVALID_ARGUMENT = "invalid_argument"  # a parameter out of range, a token id outside the vocabulary
    OUT_OF_RANGE = "out_of_range"  # prompt + max_tokens past the model's context
    RESOURCE_EXHAUSTED = "resource_exhausted"  # could never fit the page pool, or the queue is full
    UNAVAILABLE = "unavailable"  # warming up or draining


class Rejected(Exception):
    """A refused request; `code` says which kind, the message says what is wrong."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class Options:
    """Per-request sampling and stopping; the defaults are neutral (greedy off: temperature 1)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no log-probabilities; n: the chosen token's and the top n
    speculative: bool = True  # speculate when the server does (--speculative); False: plain decoding


def validate_options(options: Options, text: TextConfig, prompt_length: int) -> None:
    """Raise Rejected naming the first field out of range."""

    def check(ok: bool, message: str, code: Code = Code.INVALID_ARGUMENT) -> None:
        if not ok:
            raise Rejected(code, message)

    def finite(name: str) -> float:
        value = getattr(options, name)
        check(isinstance(value, int | float) and math.isfinite(value), f"{name} must be a finite number")
        return value

    check(prompt_length > 0, "the prompt is empty")
    check(options.max_tokens >= 1, f"max_tokens must be at least 1, got {options.max_tokens}")
    check(0.0 <= finite("temperature") <= 100.0, f"temperature must be within [0, 100], got {options.temperature}")
    check(0.0 < finite("top_p") <= 1.0, f"top_p must be within (0, 1], got {options.top_p}")
    check(options.top_k >= 0, f"top_k must be 0 (all tokens) or positive, got {options.top_k}")
    check(0.0 <= finite("min_p") <= 1.0, f"min_p must be within [0, 1], got {options.min_p}")
    check(0.0 < finite("repetition_penalty") <= 10.0, "repetition_penalty must be within (0, 10]")
    check(-2.0 <= finite("presence_penalty") <= 2.0, "presence_penalty must be within [-2, 2]")
    check(-2.0 <= finite("frequency_penalty") <= 2.0, "frequency_penalty must be within [-2, 2]")
    check(0 <= options.seed < 2**32, f"seed must be within [0, 2^32), got {options.seed}")
    for token in options.stop_token_ids:
        check(0 <= token < text.unpadded_vocab_size, f"stop token id {token} is outside the vocabulary")
    check(all(options.stop), "stop strings must not be empty")
    if options.logprobs is not None:
        check(0 <= options.logprobs <= MAX_LOGPROBS, f"logprobs must be within [0, {MAX_LOGPROBS}]")
    context = text.max_position_embeddings
    check(
        prompt_length + options.max_tokens <= context,
        f"prompt ({prompt_length} tokens) + max_tokens ({options.max_tokens}) exceeds the model's {context} positions",
        Code.OUT_OF_RANGE,
    )


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    id: str
    prompt_token_ids: tuple[int, ...]
    options: Options


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
