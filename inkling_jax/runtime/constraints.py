"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a Lark grammar or a choice
of strings) compiled by llguidance into a grammar over the model's tokenizer, and a matcher per request that gives
each step the tokens the constraint allows there, as a packed bitmask row (bit t % 32 of word t // 32: token t),
and follows the tokens the request is given.

Compiling a grammar takes milliseconds to a second, so `Grammars` compiles each constraint once, off the step
loop, and keeps the compiled matcher by constraint text; every request then starts from a copy of it. A
constraint that does not compile is refused with llguidance's message, which names what is wrong."""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Iterable

import llguidance
import llguidance.numpy
import numpy as np

from inkling_jax.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema, regex or grammar's UTF-8 length, or all choices' together
MAX_CHOICES = 1024
CACHED_GRAMMARS = 256  # compiled constraints kept, least recently used dropped first


class ConstraintError(ValueError):
    """A constraint that cannot be used: malformed, too large, or refused by the grammar compiler."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the generated text must match. `kind` is one of KINDS; `spec` the JSON schema's text, the regex or the
    Lark grammar (empty for json_object), or for `choice` the strings of which the text must be one."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def check(self) -> None:
        """Raise ConstraintError naming what is wrong with the constraint's form (not yet its grammar)."""
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "choice":
            if not isinstance(self.spec, tuple) or not all(isinstance(choice, str) for choice in self.spec):
                raise ConstraintError("a choice constraint needs a list of strings")
            if not self.spec or len(self.spec) > MAX_CHOICES:
                raise ConstraintError(f"a choice constraint needs 1 to {MAX_CHOICES} choices, got {len(self.spec)}")
            if any(not choice for choice in self.spec):
                raise ConstraintError("a choice constraint's choices must not be empty strings")
            size = sum(len(choice.encode("utf-8", errors="surrogatepass")) for choice in self.spec)
        else:
            if not isinstance(self.spec, str):
                raise ConstraintError(f"a {self.kind} constraint needs a string")
            if self.kind != "json_object" and not self.spec:
                raise ConstraintError(f"the {self.kind} constraint is empty")
            size = len(self.spec.encode("utf-8", errors="surrogatepass"))
        if size > MAX_CONSTRAINT_BYTES:
            raise ConstraintError(f"the {self.kind} constraint has {size} bytes, more than {MAX_CONSTRAINT_BYTES}")

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (its JSON form)."""
        build = llguidance.LLMatcher
        if self.kind == "json_schema":
            try:
                json.loads(self.spec)
            except json.JSONDecodeError as error:
                raise ConstraintError(f"the JSON schema is not valid JSON: {error}") from None
            return build.grammar_from_json_schema(self.spec)
        if self.kind == "json_object":
            return build.grammar_from_json_schema('{"type": "object"}')
        if self.kind == "regex":
            return build.grammar_from_regex(self.spec)
        if self.kind == "grammar":
            return build.grammar_from_lark(self.spec)
        return build.grammar_from_lark("start: " + " | ".join(json.dumps(choice) for choice in self.spec))


class Grammars:
    """Constraints compiled for one tokenizer and the model's vocabulary (`vocab_size` logits, of which the
    tokenizer's ids are the first), cached by constraint. Safe to use from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words of a bitmask row
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.serialized(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
        )
        self._compiled: collections.OrderedDict[Constraint, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> None:
        """Compile `constraint` (or find it compiled); ConstraintError naming what is wrong if it does not.
        Seconds at worst for a large schema: call it where waiting holds up no step."""
        self._template(constraint)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A matcher at the start of `constraint`'s text."""
        return Matcher(self._template(constraint).deep_copy(), self.words)

    def _template(self, constraint: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        constraint.check()
        grammar = constraint.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ConstraintError(f"the {constraint.kind} constraint does not compile: {error.strip()}")
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ConstraintError(f"the {constraint.kind} constraint does not compile: {template.get_error()}")
        with self._lock:
            self._compiled[constraint] = template
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return template


class Matcher:
    """One request's place in its constraint: the tokens allowed next, and the tokens given so far."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self._matcher = matcher
        self.words = words

    def allowed(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into `row` ([words] int32, C-contiguous): bit t % 32 of word t // 32 set
        for an allowed token t. Only the end-of-sequence token once the text is complete."""
        if row.shape != (self.words,) or row.dtype != np.int32 or not row.flags.c_contiguous:
            raise ValueError(f"a mask row is a contiguous int32 [{self.words}], got {row.dtype} {row.shape}")
        llguidance.numpy.fill_next_token_bitmask(self._matcher, row[None])

    def accept(self, tokens: Iterable[int]) -> int:
        """Advance past `tokens` in order; how many the constraint allowed (the rest are not taken)."""
        accepted = 0
        for token in tokens:
            if not self._matcher.consume_token(int(token)):
                break
            accepted += 1
        return accepted

    def rollback(self, count: int) -> None:
        """Go back `count` tokens (those of a rejected draft, or of a preempted sequence fed again)."""
        if count and not self._matcher.rollback(count):
            raise RuntimeError(f"the matcher cannot go back {count} tokens: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The text so far is a whole match: the constraint now allows only the end of the sequence."""
        return self._matcher.is_stopped()
