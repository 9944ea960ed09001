"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a Lark or GBNF grammar, a
choice of strings, or forced tool calls as SMG's structural tag) compiled by llguidance into a grammar over the
model's tokenizer, and a matcher per request that gives each step the tokens the constraint allows there, as a
packed bitmask row (bit t % 32 of word t // 32: token t), and follows the tokens the request is given.

The constraint is on the answer, and Inkling frames its answer: after a chat prompt's `<|message_model|>` the model
may think (`<|content_thinking|>` ... `<|end_message|><|message_model|>`), then writes `<|content_text|>`, the
answer and `<|end_message|>`, and ends the sequence. So the grammar is the constraint in that frame, chosen by the
prompt's last token (`FRAMES`; after a `<|content_thinking|>` or a `<|content_text|>` the frame's rest), the
thought left free (text without framing tokens); any other prompt (a plain completion) is constrained from the first
generated token, as is a constraint whose sender framed it already (`from_first_token`: SMG's
`grammar_from_first_token`). Once the grammar is complete only the end of sequence may follow.

Compiling a grammar takes milliseconds to a second, so `Grammars` compiles each constraint once, off the step
loop, and keeps the compiled matcher by constraint text and frame; every request then starts from a copy of it. A
constraint that does not compile is refused with llguidance's message, which names what is wrong."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import re
import threading
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from inkling_jax.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")
MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema, regex or grammar's UTF-8 length, or all choices' together
MAX_CHOICES = 1024
CACHED_GRAMMARS = 256  # compiled constraints kept, least recently used dropped first


class ConstraintError(ValueError):
    """A constraint that cannot be used: malformed, too large, or refused by the grammar compiler."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the generated text must match. `kind` is one of KINDS; `spec` the JSON schema's text, the regex, the
    grammar or the structural tag's JSON (empty for json_object), or for `choice` the strings of which the text must
    be one."""

    kind: str
    spec: str | tuple[str, ...] = ""
    from_first_token: bool = False  # framed by its sender: constrain the generated text as it comes

    def check(self) -> None:
        """Raise ConstraintError naming what is wrong with the constraint's form (not yet its grammar)."""
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.from_first_token, bool):
            raise ConstraintError(f"from_first_token must be true or false, got {self.from_first_token!r}")
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

    def grammar(self, frame: str | None, special_tokens: Iterable[str]) -> str:
        """The constraint in `frame` (a key of FRAMES, or None) as an llguidance grammar (its JSON form, or Lark);
        `special_tokens`: the tokenizer's, which a structural tag's framing text names."""
        if self.kind == "structural_tag":
            return tool_calls(self.spec, frame, special_tokens)
        return framed(self._body(), frame)

    def _body(self) -> str:
        """The constraint alone as an llguidance grammar."""
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
        if self.kind == "grammar":  # Lark, or GBNF / EBNF as llama.cpp writes it
            try:
                return llguidance.grammar_from("grammar", self.spec)
            except ValueError as error:
                raise ConstraintError(f"the grammar is neither Lark nor GBNF: {error}") from None
        return build.grammar_from_lark("start: " + " | ".join(json.dumps(choice) for choice in self.spec))


def constraint_from_json(value: object) -> Constraint:
    """A constraint as a JSON request gives it: an object of one kind and its spec, `{"json_schema": SCHEMA}` (an
    object or its text), `{"json_object": true}`, `{"regex": "..."}`, `{"grammar": "LARK"}` or
    `{"choice": ["...", ...]}`. ConstraintError naming what is wrong."""
    if not isinstance(value, dict) or len(value) != 1:
        raise ConstraintError(f"a constraint is an object with one of {', '.join(KINDS)}, got {value!r:.200}")
    ((kind, spec),) = value.items()
    if kind in ("json_schema", "structural_tag") and isinstance(spec, dict):
        spec = json.dumps(spec)
    elif kind == "json_object":
        if spec is not True:
            raise ConstraintError(f"json_object must be true, got {spec!r:.200}")
        spec = ""
    elif kind == "choice" and isinstance(spec, list):
        spec = tuple(spec)
    constraint = Constraint(kind, spec)
    constraint.check()
    return constraint


THOUGHT = "<|content_thinking|> THOUGHT_TEXT <|end_message|> <|message_model|>"
FRAMES = {  # Lark around the constraint (`@body`), by the prompt's last token
    "message": f"start: thought? answer\nthought: {THOUGHT}",  # after <|message_model|>: a thought, then the answer
    "thinking": "start: THOUGHT_TEXT <|end_message|> <|message_model|> answer",  # in the thought
    "text": "start: @body <|end_message|>",  # in the answer
}
ANSWER = "answer: <|content_text|> @body <|end_message|>\nTHOUGHT_TEXT: /(.|\n)*/"
FRAME_TOKENS = {"<|message_model|>", "<|content_thinking|>", "<|content_text|>", "<|end_message|>"}


def tool_calls(spec: str, frame: str | None, special_tokens: Iterable[str]) -> str:
    """The Lark grammar of a structural tag that forces tool calls, as SMG sends one for a required or named
    `tool_choice`: `{"format": {"type": "triggered_tags", "tags": [{"begin", "content", "end"}, ...], "at_least_one":
    true, "stop_after_first": ...}}` (xgrammar's form), each tag a call whose `begin` and `end` hold the call's framing
    tokens. In Inkling's framing each call may follow the function's name (its block's header) and later calls open
    blocks of their own (`<|message_model|>`); after a chat prompt a thought may come first. ConstraintError naming
    what the tag holds that is not that."""
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as error:
        raise ConstraintError(f"the structural tag is not valid JSON: {error}") from None
    form = tag.get("format", tag) if isinstance(tag, dict) else None
    if not isinstance(form, dict) or form.get("type") != "triggered_tags" or not form.get("tags"):
        raise ConstraintError("only a structural tag of triggered_tags (forced tool calls) is supported")
    if form.get("at_least_one") is not True:
        raise ConstraintError("a structural tag that does not force a call (at_least_one) is not supported")
    specials = sorted(special_tokens, key=len, reverse=True)

    def pieces(text: object, where: str) -> str:  # the text as Lark items, its special tokens as tokens
        if not isinstance(text, str):
            raise ConstraintError(f"the structural tag's {where} must be a string")
        items, rest = [], text
        while rest:
            at, token = min(((rest.find(t), t) for t in specials if t in rest), default=(len(rest), ""))
            if at:
                items.append(json.dumps(rest[:at]))
            if token:
                items.append(token)
            rest = rest[at + len(token) :]
        return " ".join(items)

    calls = []
    for i, call in enumerate(form["tags"]):
        if not isinstance(call, dict) or not isinstance(call.get("content"), dict):
            raise ConstraintError(f"the structural tag's tags[{i}] needs a begin, a content and an end")
        kind = call["content"].get("type")
        if kind != "json_schema":
            raise ConstraintError(f"the structural tag's tags[{i}] has content of type {kind!r} (json_schema only)")
        body = "%json " + json.dumps(call["content"].get("json_schema", {}))
        named = re.search(r'"name"\s*:\s*"([^"\\]+)"', call.get("begin") or "")
        header = f"{json.dumps(named.group(1))}? " if named else ""  # the call's block header: its function's name
        begin, end = pieces(call.get("begin"), "begin"), pieces(call.get("end"), "end")
        calls.append(f"call_{i}: {header}{begin} {body} {end}")
    more = "" if form.get("stop_after_first") else " (<|message_model|> call)*"
    starts = {
        "message": "start: thought? calls",
        "thinking": "start: THOUGHT_TEXT <|end_message|> <|message_model|> calls",
    }
    rules = [
        starts.get(frame, "start: calls"),
        f"calls: call{more}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(calls))),
        *calls,
        f"thought: {THOUGHT}",
        "THOUGHT_TEXT: /(.|\\n)*/",
    ]
    return "\n".join(rules)


def framed(body: str, frame: str | None) -> str:
    """The llguidance grammar of a constraint's `body` (an llguidance grammar: its JSON, or Lark text) in `frame`."""
    if frame is None:
        return body
    grammars = json.loads(body)["grammars"] if body.lstrip().startswith("{") else [{"lark_grammar": body}]
    if len(grammars) != 1:
        raise ConstraintError(f"a constraint of {len(grammars)} grammars cannot be framed")
    lark = FRAMES[frame] + ("" if frame == "text" else "\n" + ANSWER)
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**grammars[0], "name": "body"}]})


class Grammars:
    """Constraints compiled for one tokenizer and the model's vocabulary (`vocab_size` logits, of which the
    tokenizer's ids are the first), cached by constraint; a constrained text ends with one of the `eos` tokens.
    Safe to use from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: Sequence[int]):
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
        self.vocab_size = vocab_size
        self.eos = frozenset(eos)
        self.words = -(-vocab_size // 32)  # int32 words of a bitmask row
        self._tokenizer = llguidance.LLTokenizer(tokenizer.serialized(), n_vocab=vocab_size, eos_token=list(eos))
        self._compiled: collections.OrderedDict[tuple[Constraint, str | None], llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        names = tokenizer.special_tokens
        self._special_tokens = frozenset(names)
        framing = {"message": "<|message_model|>", "thinking": "<|content_thinking|>", "text": "<|content_text|>"}
        self._framing = {name: names[token] for name, token in framing.items() if FRAME_TOKENS <= names.keys()}
        self._compiling: dict[tuple[Constraint, str | None], concurrent.futures.Future] = {}  # by one thread each
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor()  # fills many slots' masks at once, on threads of its own

    def frame(self, constraint: Constraint, prompt: Sequence[int]) -> str | None:
        """The frame (a key of FRAMES) the constrained text takes after `prompt` (None: none, from the first
        generated token)."""
        if constraint.from_first_token or not prompt:
            return None
        return next((name for name, token in self._framing.items() if token == prompt[-1]), None)

    def compile(self, constraint: Constraint, frame: str | None = None) -> None:
        """Compile `constraint` in `frame` (or find it compiled); ConstraintError naming what is wrong if it does
        not. Seconds at worst for a large schema: call it where waiting holds up no step."""
        self._template(constraint, frame)

    def matcher(self, constraint: Constraint, frame: str | None = None) -> Matcher:
        """A matcher at the start of `constraint`'s text in `frame`."""
        return Matcher(self._template(constraint, frame).deep_copy(), self.eos)

    def fill(self, allowed: np.ndarray, matchers: dict[int, Matcher]) -> None:
        """Write each matcher's allowed tokens into its row of `allowed` ([S, words] int32, C-contiguous), all at
        once on the executor's threads (without the GIL): a 200K-token mask takes up to half a millisecond."""
        self._check(allowed)
        pairs = [(matcher._matcher, row) for row, matcher in matchers.items()]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, allowed)

    def fill_along(self, allowed: np.ndarray, matchers: dict[int, tuple[Matcher, Sequence[int]]]) -> None:
        """For each matcher and the draft tokens after it, write into rows row ... row + len(drafts) of `allowed`
        ([N, words] int32, C-contiguous, -1 where nothing is written) the tokens allowed after each prefix of the
        drafts: row + k after drafts[:k]. Rows past a draft the constraint refuses (or past its end) are not
        written. The matchers end where they started; all at once on the executor's threads."""
        self._check(allowed)
        triples = [(m._matcher, row, [int(t) for t in drafts]) for row, (m, drafts) in matchers.items() if len(drafts)]
        if triples:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, triples, allowed)
        first = {row: matcher for row, (matcher, drafts) in matchers.items() if not len(drafts)}
        if first:
            self.fill(allowed, first)

    def _check(self, allowed: np.ndarray) -> None:
        if allowed.ndim != 2 or allowed.shape[1] != self.words or allowed.dtype != np.int32:
            raise ValueError(f"masks are int32 [slots, {self.words}], got {allowed.dtype} {allowed.shape}")
        if not allowed.flags.c_contiguous:
            raise ValueError("the masks must be C-contiguous")

    def _template(self, constraint: Constraint, frame: str | None) -> llguidance.LLMatcher:
        """The compiled constraint, compiled once however many threads ask for it at once (the others wait for
        its compilation and get its result or error: requests that arrive together share a compile)."""
        key = (constraint, frame)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            compiling = self._compiling.get(key)
            if compiling is None:
                compiling = self._compiling[key] = concurrent.futures.Future()
                mine = True
            else:
                mine = False
        if not mine:
            return compiling.result()
        try:
            template = self._compile(constraint, frame)
        except BaseException as error:
            with self._lock:
                del self._compiling[key]
            compiling.set_exception(error)
            raise
        with self._lock:
            del self._compiling[key]
            self._compiled[key] = template
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        compiling.set_result(template)
        return template

    def _compile(self, constraint: Constraint, frame: str | None) -> llguidance.LLMatcher:
        constraint.check()
        grammar = constraint.grammar(frame, self._special_tokens)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ConstraintError(f"the {constraint.kind} constraint does not compile: {error.strip()}")
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ConstraintError(f"the {constraint.kind} constraint does not compile: {template.get_error()}")
        return template


class Matcher:
    """One request's place in its constraint, after the tokens it has been given (`Grammars.fill` writes the tokens
    allowed next)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: frozenset[int]):
        self._matcher = matcher
        self._eos = eos

    def accept(self, tokens: Iterable[int]) -> int:
        """Advance past `tokens` in order; how many the constraint allowed (the rest are not taken, and after a
        refused token the matcher allows nothing but the end of the sequence). The end of
        sequence that follows a complete match is allowed and ends it (it is not fed to the matcher, which takes
        nothing after a complete match)."""
        accepted = 0
        for token in tokens:
            if self.complete:
                return accepted + (int(token) in self._eos)
            if not self._matcher.consume_token(int(token)):
                break
            accepted += 1
        return accepted

    @property
    def complete(self) -> bool:
        """The text so far is a whole match: the constraint now allows only the end of the sequence."""
        return self._matcher.is_stopped()
