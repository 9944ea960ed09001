"""The conversations the embedded default model learns from and is graded on, generated from a seed by the project
itself (no downloaded data: the model trained on them is the project's to redistribute).

Six kinds of chat in Inkling 2's framing (`inkling_jax/chat_template.jinja`), each ending with the model's turns:
small sums answered at once; longer sums answered after a reasoning section that adds column by column; products
too long to do by heart, answered by calling the `calculator` tool and repeating its result; unit conversions (by a
power of ten at once, by other factors through the calculator); facts returned as JSON that follows a schema the
prompt gives; continuations of well-known sequences (days, months, letters, counting in steps of 1, 2, 5 or 10).
A task's split is a hash of its problem (not of its wording), so a held-out problem is never trained on, whatever
the seed or count."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable

KINDS = ("sum", "reasoned_sum", "calculator", "units", "json", "continuation")
SPLITS = ("train", "held_out")
HELD_OUT_EVERY = 10  # one problem in ten is held out
GIVE_UP_AFTER = 20_000  # draws without a new task: the kind has no more problems of the split

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression, e.g. 12*(3+4)"}},
            "required": ["expression"],
        },
    },
}


@dataclasses.dataclass(frozen=True)
class Task:
    """A conversation whose last turns are the model's (`messages`, OpenAI-style dicts), the text of its final
    answer (graded by exact match) and the tools the prompt declares."""

    kind: str
    problem: str  # what the split hashes: the problem, whatever its wording
    messages: tuple[dict, ...]
    answer: str
    tools: tuple[dict, ...] = ()

    @property
    def prompt(self) -> list[dict]:
        """The messages before the model's first turn."""
        first = next(i for i, message in enumerate(self.messages) if message["role"] == "assistant")
        return list(self.messages[:first])


def split_of(problem: str) -> str:
    """'held_out' for one problem in HELD_OUT_EVERY, by a hash of it; 'train' otherwise."""
    digest = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big")
    return "held_out" if digest % HELD_OUT_EVERY == 0 else "train"


def tasks(seed: int, count: int, split: str) -> list[Task]:
    """`count` tasks of `split`, the kinds in turn, reproducible from `seed`. Held-out problems are distinct (each
    graded once); training problems may repeat, worded anew (the small kinds hold a few hundred)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng, seen, out, misses = random.Random(seed), set(), [], 0
    while len(out) < count:
        kind = KINDS[len(out) % len(KINDS)]
        task = MAKERS[kind](rng)
        if split_of(task.problem) == split and not (split == "held_out" and task.problem in seen):
            seen.add(task.problem)
            out.append(task)
            misses = 0
        elif (misses := misses + 1) > GIVE_UP_AFTER:
            raise ValueError(f"{count} {split} tasks: no new {kind} problem of that split after {misses} draws")
    return out


def _chat(question: str, *model_turns: dict) -> tuple[dict, ...]:
    return ({"role": "user", "content": question}, *model_turns)


def _answer(text: str, reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    return message if reasoning is None else {**message, "reasoning_content": reasoning}


def sum_task(rng: random.Random) -> Task:
    a, b = rng.randrange(21), rng.randrange(21)
    op = rng.choice("+-")
    a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
    result = str(a + b if op == "+" else a - b)
    wording = rng.choice(("What is {}?", "Compute {}.", "{} = ?", "Quick: {}"))
    return Task("sum", f"{a}{op}{b}", _chat(wording.format(f"{a} {op} {b}"), _answer(result)), result)


def column_sum(a: int, b: int) -> str:
    """a + b worked column by column, ones first, with the carries: the reasoning the model learns to write."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    steps, carry, written = [], 0, []
    for i in range(max(len(digits_a), len(digits_b))):
        x, y = int(digits_a[i]) if i < len(digits_a) else 0, int(digits_b[i]) if i < len(digits_b) else 0
        total = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry, digit = divmod(total, 10)
        written.append(str(digit))
        steps.append(f"{terms} = {total}, write {digit}" + (f", carry {carry}" if carry else ""))
    if carry:
        written.append(str(carry))
        steps.append(f"write the carry {carry}")
    return "; ".join(steps) + f". Read backwards: {''.join(reversed(written))}."


def reasoned_sum_task(rng: random.Random) -> Task:
    a, b = rng.randrange(100, 10000), rng.randrange(100, 10000)
    result = str(a + b)
    wording = rng.choice(("Add {} and {}. Think it through.", "Work out {} + {} carefully.", "What is {} plus {}?"))
    question = wording.format(a, b)
    return Task("reasoned_sum", f"{a}+{b}", _chat(question, _answer(result, column_sum(a, b))), result)


def _with_calculator(question: str, expression: str, result: str) -> tuple[dict, ...]:
    """A chat whose model calls the calculator on `expression`, reads `result` and answers with it."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression}, separators=(",", ":"))},
    }
    return _chat(
        question,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": result},
        _answer(result),
    )


def calculator_task(rng: random.Random) -> Task:
    a, b = rng.randrange(100, 1000), rng.randrange(11, 100)
    expression, result = f"{a}*{b}", str(a * b)
    wording = rng.choice(("What is {} times {}?", "Multiply {} by {}.", "Calculate {} x {}."))
    return Task(
        "calculator", expression, _with_calculator(wording.format(a, b), expression, result), result, (CALCULATOR,)
    )


UNITS = {  # (larger, smaller): how many smaller make one larger
    ("kilometers", "meters"): 1000,
    ("meters", "centimeters"): 100,
    ("kilograms", "grams"): 1000,
    ("hours", "minutes"): 60,
    ("minutes", "seconds"): 60,
    ("days", "hours"): 24,
    ("weeks", "days"): 7,
}


def units_task(rng: random.Random) -> Task:
    """A conversion: by a power of ten answered at once (zeros written or dropped), by another factor through the
    calculator."""
    (large, small), factor = rng.choice(sorted(UNITS.items()))
    count = rng.randrange(2, 200)
    if rng.random() < 0.5:
        question, expression, result = f"How many {small} are in {count} {large}?", f"{count}*{factor}", count * factor
    else:
        question, expression, result = (
            f"How many {large} are {count * factor} {small}?",
            f"{count * factor}/{factor}",
            count,
        )
    if factor in (10, 100, 1000):
        return Task("units", question, _chat(question, _answer(str(result))), str(result))
    return Task("units", question, _with_calculator(question, expression, str(result)), str(result), (CALCULATOR,))


NAMES = ("Ada", "Alan", "Grace", "Linus", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Margaret", "Tim", "Radia")
CITIES = ("Paris", "London", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Seoul", "Rome", "Austin")
ITEMS = ("apples", "pencils", "books", "cups", "lamps", "chairs", "stamps", "keys", "candles", "maps")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
ORDER = {
    "type": "object",
    "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}, "paid": {"type": "boolean"}},
    "required": ["item", "quantity", "paid"],
}


def json_task(rng: random.Random) -> Task:
    if rng.random() < 0.5:
        schema, name, age, city = PERSON, rng.choice(NAMES), rng.randrange(18, 91), rng.choice(CITIES)
        facts, value = f"{name} is {age} years old and lives in {city}.", {"name": name, "age": age, "city": city}
    else:
        schema, item, quantity, paid = ORDER, rng.choice(ITEMS), rng.randrange(1, 100), rng.random() < 0.5
        facts = f"An order of {quantity} {item}, {'already paid' if paid else 'not paid yet'}."
        value = {"item": item, "quantity": quantity, "paid": paid}
    question = f"Reply with JSON following this schema: {json.dumps(schema, separators=(',', ':'))}\n{facts}"
    result = json.dumps(value, separators=(",", ":"))
    return Task("json", facts, _chat(question, _answer(result)), result)


DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")  # fmt: skip
LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def continuation_task(rng: random.Random) -> Task:
    kind = rng.randrange(4)
    if kind < 3:
        cycle = (DAYS, MONTHS, LETTERS)[kind]
        start = rng.randrange(len(cycle))
        sequence = [cycle[(start + i) % len(cycle)] for i in range(6)]
    else:
        first, step = rng.randrange(100), rng.choice((1, 2, 5, 10))
        sequence = [str(first + i * step) for i in range(6)]
    given, rest = ", ".join(sequence[:3]), ", ".join(sequence[3:])
    question = f"Continue the sequence with the next three: {given}"
    return Task("continuation", given, _chat(question, _answer(rest)), rest)


MAKERS: dict[str, Callable[[random.Random], Task]] = {
    "sum": sum_task,
    "reasoned_sum": reasoned_sum_task,
    "calculator": calculator_task,
    "units": units_task,
    "json": json_task,
    "continuation": continuation_task,
}
