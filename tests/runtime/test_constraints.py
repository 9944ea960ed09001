"""Constraints compiled over the synthetic tokenizer: random walks through the allowed tokens end in text that
matches (JSON schemas with nesting, enums, bounded numbers, patterns and array sizes; regexes; choices), each mask
bit agrees with whether the token can be taken, rollback returns to the earlier masks, and malformed constraints
are refused with what is wrong."""

import json
import re

import numpy as np
import pytest
from paths import TINY_TEXT

from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import load_config
from inkling_jax.runtime.constraints import MAX_CONSTRAINT_BYTES, Constraint, ConstraintError, Grammars, Matcher
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
    return Grammars(tokenizer, vocab_size=tokenizer.vocab_size + 12)  # the model's logits pad the vocabulary


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    ids = np.arange(vocab_size)
    return ids[((row[ids // 32] >> (ids % 32)) & 1).astype(bool)]


def walk(matcher: Matcher, grammars: Grammars, tokenizer: Tokenizer, rng, limit: int = 300) -> list[int]:
    """Tokens taken uniformly at random among those allowed until the constraint is complete."""
    row, taken = np.zeros(grammars.words, np.int32), []
    for _ in range(limit):
        matcher.allowed(row)
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


def test_each_mask_bit_says_whether_the_token_can_be_taken(grammars, tokenizer):
    rng = np.random.default_rng(3)
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]+/ | NUMBER\n%import common.NUMBER'
    constraint = Constraint("grammar", lark)
    prefix = tokenizer.encode("(ab,12")
    row = np.zeros(grammars.words, np.int32)
    for cut in range(len(prefix) + 1):
        matcher = grammars.matcher(constraint)
        assert matcher.accept(prefix[:cut]) == cut
        matcher.allowed(row)
        allowed = set(allowed_ids(row, grammars.vocab_size).tolist())
        assert allowed and max(allowed) < tokenizer.vocab_size  # padding ids never
        for token in rng.choice(grammars.vocab_size, 60, replace=False).tolist() + sorted(allowed)[:20]:
            fresh = grammars.matcher(constraint)
            fresh.accept(prefix[:cut])
            assert (fresh.accept([token]) == 1) == (token in allowed), (cut, token)


def test_rollback_returns_to_the_earlier_masks(grammars, tokenizer):
    rng = np.random.default_rng(5)
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    rows = [np.zeros(grammars.words, np.int32) for _ in range(2)]
    taken = walk(grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA))), grammars, tokenizer, rng)
    cut = len(taken) // 2
    assert matcher.accept(taken[:cut]) == cut
    matcher.allowed(rows[0])
    assert matcher.accept(taken[cut:]) == len(taken) - cut and matcher.complete
    matcher.rollback(len(taken) - cut)
    matcher.allowed(rows[1])
    assert not matcher.complete and np.array_equal(rows[0], rows[1])
    wrong = next(t for t in range(tokenizer.vocab_size) if not (rows[1][t // 32] >> (t % 32)) & 1)
    assert matcher.accept([wrong, taken[cut]]) == 0  # a refused token is not taken, nor those after it


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("json_schema", '{"type": "object",'), "not valid JSON"),
        (Constraint("json_schema", '{"type": "objekt"}'), "objekt"),
        (Constraint("regex", "[a-"), "does not compile"),
        (Constraint("grammar", "start: missing_rule"), "missing_rule"),
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


def test_a_mask_row_of_the_wrong_form_is_refused(grammars):
    matcher = grammars.matcher(Constraint("regex", "a+"))
    with pytest.raises(ValueError, match="contiguous int32"):
        matcher.allowed(np.zeros(grammars.words, np.int64))
