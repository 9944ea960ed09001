"""Constraints compiled over the synthetic tokenizer: random walks through the allowed tokens end in text that
matches (JSON schemas with nesting, enums, bounded numbers, patterns and array sizes; regexes; choices; GBNF), each
mask bit agrees with whether the token can be taken, a chat answer is constrained in its frame, and malformed
constraints are refused with what is wrong."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from paths import TINY_TEXT

from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import load_config
from inkling_jax.runtime.constraints import MAX_CONSTRAINT_BYTES, Constraint, ConstraintError, Grammars, Matcher
from inkling_jax.runtime.requests import Rejected, request_from_json
from inkling_jax.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "level": {"type": "integer", "minimum": -5, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "ox"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "level", "kind", "tags", "where"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer(load_config(TINY_TEXT / "original" / "config.json").text))


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    padded = tokenizer.vocab_size + 12  # the model's logits pad the vocabulary
    return Grammars(tokenizer, padded, [tokenizer.eos_token_id])


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    ids = np.arange(vocab_size)
    return ids[((row[ids // 32] >> (ids % 32)) & 1).astype(bool)]


def mask(grammars: Grammars, matcher: Matcher) -> np.ndarray:
    """The matcher's allowed tokens as one packed row, in the third of four slots' masks."""
    rows = np.zeros((4, grammars.words), np.int32)
    grammars.fill(rows, {2: matcher})
    assert not rows[[0, 1, 3]].any()
    return rows[2]


def walk(matcher: Matcher, grammars: Grammars, tokenizer: Tokenizer, rng, limit: int = 300) -> list[int]:
    """Tokens taken uniformly at random among those allowed until the constraint is complete."""
    taken = []
    for _ in range(limit):
        row = mask(grammars, matcher)
        choices = allowed_ids(row, grammars.vocab_size)
        assert choices.size, tokenizer.decode(taken)
        if matcher.complete:
            assert choices.tolist() == [tokenizer.eos_token_id]
            return taken
        token = int(rng.choice(choices))
        if token == tokenizer.eos_token_id:  # the text may end here (a complete match that could go on)
            return taken
        assert matcher.accept([token]) == 1
        taken.append(token)
    raise AssertionError(f"no complete match after {limit} tokens: {tokenizer.decode(taken)!r}")


def satisfies(value: dict) -> bool:
    return (
        set(value) == set(SCHEMA["properties"])
        and re.fullmatch("[a-z]{1,6}", value["name"]) is not None
        and type(value["level"]) is int
        and -5 <= value["level"] <= 120
        and value["kind"] in ("cat", "dog", "ox")
        and 1 <= len(value["tags"]) <= 3
        and set(value["tags"]) <= {"a", "b"}
        and set(value["where"]) == {"x", "ok"}
        and type(value["where"]["x"]) is int
        and 0 <= value["where"]["x"] <= 9
        and type(value["where"]["ok"]) is bool
    )


def test_random_walks_through_a_schema_give_json_that_validates(grammars, tokenizer):
    rng = np.random.default_rng(7)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    for _ in range(12):
        text = tokenizer.decode(walk(grammars.matcher(constraint), grammars, tokenizer, rng))
        assert satisfies(json.loads(text)), text


def test_random_walks_match_regexes_and_choices(grammars, tokenizer):
    rng = np.random.default_rng(11)
    for pattern in (r"[0-9]{3}-[a-c]{2,4}", r"(yes|no|maybe)!?", r"\(\d{1,2}(, \d{1,2}){0,3}\)"):
        for _ in range(8):
            text = tokenizer.decode(walk(grammars.matcher(Constraint("regex", pattern)), grammars, tokenizer, rng))
            assert re.fullmatch(pattern, text), (pattern, text)
    choices = ("red", "green", 'say "hi"', "über\n")
    seen = set()
    for _ in range(24):
        seen.add(tokenizer.decode(walk(grammars.matcher(Constraint("choice", choices)), grammars, tokenizer, rng)))
    assert seen <= set(choices) and len(seen) >= 3
    text = tokenizer.decode(walk(grammars.matcher(Constraint("json_object")), grammars, tokenizer, rng, limit=2000))
    assert isinstance(json.loads(text), dict)
    gbnf = 'root ::= "id-" [0-9] [0-9] ("," [a-c])?'  # llama.cpp's GBNF, taken as well as Lark
    for _ in range(6):
        text = tokenizer.decode(walk(grammars.matcher(Constraint("grammar", gbnf)), grammars, tokenizer, rng))
        assert re.fullmatch("id-[0-9]{2}(,[a-c])?", text), text


def test_each_mask_bit_says_whether_the_token_can_be_taken(grammars, tokenizer):
    rng = np.random.default_rng(3)
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]+/ | NUMBER\n%import common.NUMBER'
    constraint = Constraint("grammar", lark)
    prefix = tokenizer.encode("(ab,12")
    for cut in range(len(prefix) + 1):
        matcher = grammars.matcher(constraint)
        assert matcher.accept(prefix[:cut]) == cut
        row = mask(grammars, matcher)
        allowed = set(allowed_ids(row, grammars.vocab_size).tolist())
        assert allowed and max(allowed) < tokenizer.vocab_size  # padding ids never
        for token in rng.choice(grammars.vocab_size, 60, replace=False).tolist() + sorted(allowed)[:20]:
            fresh = grammars.matcher(constraint)
            fresh.accept(prefix[:cut])
            assert (fresh.accept([token]) == 1) == (token in allowed), (cut, token)


def test_a_refused_token_is_not_taken_and_only_the_end_follows_a_match(grammars, tokenizer):
    rng = np.random.default_rng(5)
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    taken = walk(grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA))), grammars, tokenizer, rng)
    cut = len(taken) // 2
    assert matcher.accept(taken[:cut]) == cut
    row = mask(grammars, matcher)
    wrong = next(t for t in range(tokenizer.vocab_size) if not (row[t // 32] >> (t % 32)) & 1)
    assert matcher.accept([wrong, taken[cut]]) == 0  # a refused token is not taken, nor those after it
    assert allowed_ids(mask(grammars, matcher), grammars.vocab_size).tolist() == [tokenizer.eos_token_id]
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    assert matcher.accept(taken) == len(taken) and matcher.complete
    other = next(t for t in range(tokenizer.vocab_size) if t != tokenizer.eos_token_id)
    assert matcher.accept([other]) == 0 and matcher.accept([tokenizer.eos_token_id, other]) == 1  # the end only


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("json_schema", '{"type": "object",'), "not valid JSON"),
        (Constraint("json_schema", '{"type": "objekt"}'), "objekt"),
        (Constraint("regex", "[a-"), "does not compile"),
        (Constraint("grammar", "start: missing_rule"), "missing_rule"),
        (Constraint("grammar", "root ::= (("), "neither Lark nor GBNF"),
        (Constraint("choice", ()), "1 to 1024 choices"),
        (Constraint("choice", ("a", "")), "empty strings"),
        (Constraint("regex", ""), "empty"),
        (Constraint("ebnf", "x"), "not one of"),
        (Constraint("regex", "a" * (MAX_CONSTRAINT_BYTES + 1)), "more than"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_problem(grammars, constraint, says):
    with pytest.raises(ConstraintError, match=re.escape(says)):
        grammars.compile(constraint)


def test_requests_that_arrive_together_share_one_compile(grammars, tokenizer, monkeypatch):
    """Eight threads asking for the same new constraint at once compile it once and all get matchers of it (random
    walks that match); a malformed one fails for every thread, and is not kept: asked again, it is compiled again."""
    rng = np.random.default_rng(5)
    letters = "".join(rng.choice(list("abcdef"), 3))
    good, bad = Constraint("regex", f"[{letters}]{{2,5}}-[0-9]{{1,3}}"), Constraint("regex", "[a-")
    compiled = []
    original = grammars._compile

    def slow_compile(constraint, frame):
        compiled.append(constraint)
        time.sleep(0.2)  # the other threads arrive while it compiles
        return original(constraint, frame)

    def refusal(_) -> str:
        with pytest.raises(ConstraintError) as refused:
            grammars.compile(bad)
        return str(refused.value)

    monkeypatch.setattr(grammars, "_compile", slow_compile)
    with ThreadPoolExecutor(8) as pool:
        matchers = list(pool.map(lambda _: grammars.matcher(good), range(8)))
        refusals = list(pool.map(refusal, range(8)))
    assert compiled == [good, bad]
    assert all("does not compile" in refusal for refusal in refusals)
    for matcher in matchers:
        text = tokenizer.decode(walk(matcher, grammars, tokenizer, rng))
        assert re.fullmatch(f"[{letters}]{{2,5}}-[0-9]{{1,3}}", text), text
    with pytest.raises(ConstraintError):
        grammars.compile(bad)
    assert compiled == [good, bad, bad]


def test_masks_of_the_wrong_form_are_refused(grammars):
    matcher = grammars.matcher(Constraint("regex", "a+"))
    for rows, says in (
        (np.zeros((2, grammars.words), np.int64), "int32"),
        (np.zeros((2, grammars.words + 1), np.int32), "int32"),
        (np.zeros((grammars.words, 2), np.int32).T, "C-contiguous"),
    ):
        with pytest.raises(ValueError, match=says):
            grammars.fill(rows, {0: matcher})


def test_a_chat_answer_is_constrained_in_its_frame(grammars, tokenizer):
    """After a chat prompt's <|message_model|> the constraint holds the answer between <|content_text|> and
    <|end_message|>, after a free thought or none; prompts that end elsewhere are constrained from the first token."""
    special = tokenizer.special_tokens
    message, thinking, text, end = (
        special[f"<|{name}|>"] for name in ("message_model", "content_thinking", "content_text", "end_message")
    )
    constraint = Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert grammars.frame(constraint, [5, 9, message]) == "message"
    assert grammars.frame(constraint, [5, thinking]) == "thinking" and grammars.frame(constraint, [text]) == "text"
    assert grammars.frame(constraint, [5, 9]) is None
    assert grammars.frame(Constraint("regex", "a+", from_first_token=True), [message]) is None
    answer = tokenizer.encode('{"a": 17}')
    thought = [thinking, *tokenizer.encode("Let me see.\n"), end, message]
    for frame, tokens in (
        ("message", [*thought, text, *answer, end]),
        ("message", [text, *answer, end]),
        ("thinking", [*tokenizer.encode("so: "), end, message, text, *answer, end]),
        ("text", [*answer, end]),
        (None, answer),
    ):
        matcher = grammars.matcher(constraint, frame)
        assert matcher.accept(tokens) == len(tokens), frame
        row = mask(grammars, matcher)
        assert matcher.complete and allowed_ids(row, grammars.vocab_size).tolist() == [tokenizer.eos_token_id]
    for frame, tokens, refused_at in (
        ("message", [*answer], 0),  # the answer's framing is not skipped
        ("message", [thinking, *tokenizer.encode("hm"), text], 3),  # no answer inside the thought
        ("text", [*answer, tokenizer.eos_token_id], len(answer)),  # the answer ends with <|end_message|>
    ):
        assert grammars.matcher(constraint, frame).accept(tokens) == refused_at, (frame, tokens)
    wrong = [text, *tokenizer.encode('{"a": "x"}')]  # a string where the schema wants an integer
    accepted = grammars.matcher(constraint, "message").accept(wrong)
    assert 0 < accepted < len(wrong) and '{"a": '.startswith(tokenizer.decode(wrong[1:accepted]))


def test_a_jsonl_request_carries_its_constraint(tokenizer):
    text = load_config(TINY_TEXT / "original" / "config.json").text
    line = {"id": "a", "prompt_token_ids": [5, 6], "constraint": {"json_schema": {"type": "integer"}}}
    assert request_from_json(json.dumps(line), tokenizer, text).constraint == Constraint(
        "json_schema", '{"type": "integer"}'
    )
    line["constraint"] = {"choice": ["x", "y"]}
    assert request_from_json(json.dumps(line), tokenizer, text).constraint == Constraint("choice", ("x", "y"))
    line["constraint"] = {"json_object": True}
    assert request_from_json(json.dumps(line), tokenizer, text).constraint == Constraint("json_object")
    for bad, says in (
        ({"regex": "a", "choice": ["b"]}, "an object with one of"),
        ({"json_object": False}, "json_object must be true"),
        ({"choice": "abc"}, "list of strings"),
        ({"xml": "<a/>"}, "not one of"),
    ):
        line["constraint"] = bad
        with pytest.raises(Rejected, match=re.escape(says)):
            request_from_json(json.dumps(line), tokenizer, text)


def forced_calls(stop_after_first: bool = False) -> Constraint:
    """The structural tag SMG sends for a required tool_choice over two tools (xgrammar's triggered tags)."""
    tools = {
        "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    }
    tags = [
        {
            "begin": f'<|content_invoke_tool_json|>{{"name":"{name}","args":',
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "}<|end_message|>",
        }
        for name, schema in tools.items()
    ]
    form = {"type": "triggered_tags", "triggers": ["<|content_invoke_tool_json|>"], "tags": tags, "at_least_one": True}
    return Constraint("structural_tag", json.dumps({"format": {**form, "stop_after_first": stop_after_first}}))


def test_forced_tool_calls_follow_the_structural_tag_in_inklings_framing(grammars, tokenizer):
    special = tokenizer.special_tokens
    message, thinking, text, end, invoke = (
        special[f"<|{name}|>"]
        for name in ("message_model", "content_thinking", "content_text", "end_message", "content_invoke_tool_json")
    )
    weather = [invoke, *tokenizer.encode('{"name":"get_weather","args":{"city":"Oslo"}}'), end]
    add = [*tokenizer.encode("add"), invoke, *tokenizer.encode('{"name":"add","args":{"a":1,"b":22}}'), end]
    thought = [thinking, *tokenizer.encode("Which tool?"), end, message]
    for frame, constraint, tokens in (
        ("message", forced_calls(), [*thought, *weather, message, *add]),
        ("message", forced_calls(), add),
        ("message", forced_calls(stop_after_first=True), [*thought, *weather]),
        (None, forced_calls(), [*weather, message, *weather]),
    ):
        matcher = grammars.matcher(constraint, frame)
        assert matcher.accept(tokens) == len(tokens)
        allowed = allowed_ids(mask(grammars, matcher), grammars.vocab_size).tolist()
        assert tokenizer.eos_token_id in allowed and (matcher.complete or message in allowed)
    matcher = grammars.matcher(forced_calls(stop_after_first=True), "message")
    assert matcher.accept(weather) == len(weather) and matcher.complete  # one call, then the end
    wrong_tool = [invoke, *tokenizer.encode('{"name":"sub"')]
    bad_args = [invoke, *tokenizer.encode('{"name":"add","args":{"a":"x"')]
    for tokens in ([text], wrong_tool, bad_args):  # an answer instead of a call, no such tool, args off the schema
        assert grammars.matcher(forced_calls(), "message").accept(tokens) < len(tokens)
    regex_tag = {"type": "triggered_tags", "at_least_one": True, "tags": [{"begin": "x", "content": {"type": "regex"}}]}
    for spec, says in (
        ({"format": {"type": "tags_with_separator", "tags": []}}, "only a structural tag of triggered_tags"),
        ({"format": {"type": "triggered_tags", "tags": [{"begin": "x", "content": {}, "end": "y"}]}}, "at_least_one"),
        ({"format": regex_tag}, "content of type 'regex'"),
    ):
        with pytest.raises(ConstraintError, match=re.escape(says)):
            grammars.compile(Constraint("structural_tag", json.dumps(spec)), "message")
