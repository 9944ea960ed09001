"""The default model's training examples (`tools.default_examples`): the ids are the whole conversation's, and
the learned ones are exactly the model's turns, each run ending where sampling ends."""

import random

import pytest
from paths import TINY_CONFIG

from inkling_jax.chat import DEFAULT_TEMPLATE, ChatTemplate
from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import load_config
from inkling_jax.tokenizer import Tokenizer
from tools.default_examples import encode, learned_spans
from tools.default_tasks import tasks


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer(load_config(TINY_CONFIG).text))


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(DEFAULT_TEMPLATE.read_text())


@pytest.fixture(scope="module")
def sample():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return tasks(seed, 60, "train")


def test_the_ids_are_the_whole_conversations(sample, template, tokenizer):
    for task in sample:
        ids, learned = encode(task, template, tokenizer)
        whole = template.render(list(task.messages), tools=list(task.tools) or None, add_generation_prompt=False)
        assert ids.tolist() == tokenizer.encode(whole, special_tokens=True) and len(learned) == len(ids)


def test_the_model_learns_its_turns_and_nothing_else(sample, template, tokenizer):
    model, end = tokenizer.special_tokens["<|message_model|>"], tokenizer.eos_token_id
    for task in sample:
        ids, learned = encode(task, template, tokenizer)
        spans = learned_spans(learned)
        assert len(spans) == (2 if task.tools else 1), task
        for first, last in spans:
            assert ids[first - 1] == model and ids[last - 1] == end  # after the generation prompt, to sampling's end
        own = tokenizer.decode(ids[spans[-1][0] : spans[-1][1]].tolist())
        assert own.endswith(f"<|content_text|>{task.answer}<|end_message|><|content_model_end_sampling|>")
        given = tokenizer.decode(ids[~learned].tolist())
        prompt = template.render(task.prompt, tools=list(task.tools) or None)
        if task.tools:  # the call is the model's, the result the tool's
            call = tokenizer.decode(ids[spans[0][0] : spans[0][1]].tolist())
            assert call.startswith("calculator<|content_invoke_tool_json|>")
            prompt += f"<|message_tool|>calculator<|content_text|>{task.answer}<|end_message|><|message_model|>"
        assert given == prompt
