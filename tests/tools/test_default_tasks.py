"""The default model's tasks (`tools.default_tasks`): reproducible, split by problem, every answer right (each
recomputed here from the question's text, with this file's own tables), framed as Inkling 2's chat template renders
a model's turns."""

import calendar
import json
import random
import re
import string

import pytest

from inkling_jax.chat import DEFAULT_TEMPLATE, ChatTemplate
from tools.default_tasks import KINDS, split_of, tasks

SECONDS = {"seconds": 1, "minutes": 60, "hours": 3600, "days": 86400, "weeks": 604800}
GRAMS = {"grams": 1, "kilograms": 1000}
CENTIMETERS = {"centimeters": 1, "meters": 100, "kilometers": 100_000}


@pytest.fixture(scope="module")
def seed() -> int:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return seed


@pytest.fixture(scope="module")
def held_out(seed):
    return tasks(seed, 240, "held_out")


@pytest.fixture(scope="module")
def train(seed):
    return tasks(seed + 1, 3000, "train")


def test_tasks_come_again_from_their_seed_and_not_from_another(seed):
    assert tasks(seed, 60, "train") == tasks(seed, 60, "train")
    assert tasks(seed, 60, "train") != tasks(seed + 2, 60, "train")


def test_no_held_out_problem_is_trained_on(train, held_out):
    assert {task.kind for task in train} == {task.kind for task in held_out} == set(KINDS)
    assert not {task.problem for task in train} & {task.problem for task in held_out}
    assert len({task.problem for task in held_out}) == len(held_out)
    assert all(split_of(task.problem) == "train" for task in train)
    # a tenth of all problems is held out, whichever draws them
    rng = random.Random(0)
    share = sum(split_of(str(rng.random())) == "held_out" for _ in range(20_000)) / 20_000
    assert 0.09 < share < 0.11


def test_bad_requests_are_named():
    with pytest.raises(ValueError, match="split must be one of"):
        tasks(0, 1, "test")
    with pytest.raises(ValueError, match="no new continuation problem"):
        tasks(0, 6 * 2000, "held_out")  # more distinct continuations than the sequences hold


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def expected_answer(task) -> str:
    """The answer recomputed from the user's question alone."""
    question = task.messages[0]["content"]
    if task.kind == "sum":
        a, op, b = re.search(r"(\d+) ([+-]) (\d+)", question).groups()
        return str(int(a) + int(b) if op == "+" else int(a) - int(b))
    if task.kind == "reasoned_sum":
        return str(sum(numbers(question)))
    if task.kind == "calculator":
        a, b = numbers(question)
        return str(a * b)
    if task.kind == "units":
        (count,) = numbers(question)
        asked, given = re.search(r"How many (\w+) are (?:in )?\d+ (\w+)\?", question).groups()
        table = next(t for t in (SECONDS, GRAMS, CENTIMETERS) if asked in t and given in t)
        exact = count * table[given] / table[asked]
        assert exact == int(exact), question
        return str(int(exact))
    if task.kind == "json":
        schema_text, facts = question.removeprefix("Reply with JSON following this schema: ").split("\n")
        schema = json.loads(schema_text)
        value = json.loads(task.answer)
        assert list(value) == schema["required"] == list(schema["properties"])
        types = {"string": str, "integer": int, "boolean": bool}
        for key, spec in schema["properties"].items():
            assert type(value[key]) is types[spec["type"]], (key, value)
            if spec["type"] != "boolean":
                assert str(value[key]) in facts
        assert ("not paid" in facts) == (value.get("paid") is False)
        return json.dumps(value, separators=(",", ":"))
    given = question.split(": ")[1].split(", ")
    for cycle in (list(calendar.day_name), list(calendar.month_name)[1:], list(string.ascii_uppercase)):
        if given[0] in cycle:
            start = cycle.index(given[0])
            sequence = [cycle[(start + i) % len(cycle)] for i in range(6)]
            break
    else:
        first, second = int(given[0]), int(given[1])
        sequence = [str(first + i * (second - first)) for i in range(6)]
    assert sequence[:3] == given
    return ", ".join(sequence[3:])


def test_every_answer_is_right(train, held_out):
    for task in train[:600] + held_out:
        final = task.messages[-1]
        assert final == {"role": "assistant", "content": task.answer} or (
            task.kind == "reasoned_sum" and final["content"] == task.answer
        ), task
        assert task.answer == expected_answer(task), task


def test_reasoning_adds_column_by_column(held_out):
    for task in (t for t in held_out if t.kind == "reasoned_sum"):
        reasoning = task.messages[-1]["reasoning_content"]
        written = "".join(re.findall(r"write (?:the carry )?(\d)", reasoning))
        assert written[::-1] == task.answer and reasoning.endswith(f"Read backwards: {task.answer}.")
        a, b = numbers(task.messages[0]["content"])
        width = max(len(str(a)), len(str(b)))
        columns = zip(str(a).zfill(width)[::-1], str(b).zfill(width)[::-1], strict=True)
        for step, (x, y) in zip(reasoning.split("; ")[:width], columns, strict=True):
            assert step.startswith(f"{x} + {y}"), (step, a, b)


def test_tool_calls_compute_the_answer(held_out):
    """Products and the unit conversions by factors other than powers of ten call the calculator on the question's
    numbers; its result (recomputed here) is the answer."""
    called = [t for t in held_out if t.tools]
    assert {t.kind for t in called} == {"calculator", "units"}
    for task in called:
        user, call, result, final = task.messages
        (tool_call,) = call["tool_calls"]
        assert tool_call["function"]["name"] == "calculator" == task.tools[0]["function"]["name"]
        expression = json.loads(tool_call["function"]["arguments"])["expression"]
        a, op, b = re.fullmatch(r"(\d+)([*/])(\d+)", expression).groups()
        value = int(a) * int(b) if op == "*" else int(a) / int(b)
        assert value == int(value) and str(int(value)) == result["content"] == final["content"] == task.answer
        assert result["tool_call_id"] == tool_call["id"] and int(a) in numbers(user["content"])
        if task.kind == "calculator":
            assert (int(a), int(b)) == tuple(numbers(user["content"])) and op == "*"


def test_the_template_frames_the_models_turns(held_out):
    template = ChatTemplate(DEFAULT_TEMPLATE.read_text())
    for task in held_out[:60]:
        text = template.render(list(task.messages), tools=list(task.tools) or None, add_generation_prompt=False)
        prompt = template.render(task.prompt, tools=list(task.tools) or None)
        assert text.startswith(prompt) and text.endswith(
            f"<|message_model|><|content_text|>{task.answer}<|end_message|><|content_model_end_sampling|>"
        )
        if task.kind == "reasoned_sum":
            assert f"<|content_thinking|>{task.messages[-1]['reasoning_content']}<|end_message|>" in text
        if task.tools:
            expression = json.loads(task.messages[1]["tool_calls"][0]["function"]["arguments"])["expression"]
            call = (
                f'calculator<|content_invoke_tool_json|>{{"name":"calculator","args":{{"expression":"{expression}"}}}}'
            )
            assert f"{prompt}{call}<|end_message|><|content_model_end_sampling|><|message_tool|>calculator" in text
