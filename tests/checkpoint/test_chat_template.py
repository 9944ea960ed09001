"""Inkling 2's chat framing as synthetic checkpoints ship it (`chat_template.jinja`), rendered as the SMG gateway
and transformers render templates (`inkling_jax.chat`), and where a checkpoint's template is found."""

import json
import random

import pytest
from paths import TINY_CONFIG

from inkling_jax.chat import ChatTemplate, ChatTemplateError, load_template
from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer, write_tokenizer
from inkling_jax.config import load_config
from inkling_jax.runtime.requests import Rejected, request_from_json
from inkling_jax.tokenizer import Tokenizer

SYSTEM, USER, MODEL, TOOL = "<|message_system|>", "<|message_user|>", "<|message_model|>", "<|message_tool|>"
TEXT, END, EOS = "<|content_text|>", "<|end_message|>", "<|content_model_end_sampling|>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat")
    (directory / "config.json").write_text(TINY_CONFIG.read_text())
    write_tokenizer(directory, build_tokenizer(load_config(TINY_CONFIG).text))
    return directory


def words(rng: random.Random, count: int = 4) -> str:
    return " ".join(rng.choice(["paris", "rain", "a", "tool", "éclair", "42", "wind"]) for _ in range(count))


def test_a_conversation_with_tools_renders_in_inkling_framing(checkpoint):
    rng = random.Random()
    system, question, thought, result, follow_up = (words(rng) for _ in range(5))
    city = words(rng, 1)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": thought,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}],
        },
        {"role": "tool", "name": "get_weather", "content": result},
        {"role": "user", "content": [{"type": "text", "text": follow_up}, {"type": "image_url", "image_url": {}}]},
    ]
    rendered = ChatTemplate(load_template(checkpoint)).render(messages, tools=tools)
    declared = (
        '[{"description":"Weather now","name":"get_weather","parameters":'
        '{"properties":{"city":{"type":"string"}},"type":"object"},"type":"function"}]'
    )
    call = json.dumps({"name": "get_weather", "args": {"city": city}}, ensure_ascii=False, separators=(",", ":"))
    assert rendered == (
        f"{SYSTEM}tool_declare<|content_xml|>{declared}{END}"
        f"{SYSTEM}{TEXT}{system}{END}"
        f"{SYSTEM}{TEXT}Thinking effort level: 0.9{END}"
        f"{USER}{TEXT}{question}{END}"
        f"{MODEL}<|content_thinking|>{thought}{END}"
        f"{MODEL}get_weather<|content_invoke_tool_json|>{call}{END}{EOS}"
        f"{TOOL}get_weather{TEXT}{result}{END}"
        f"{USER}{TEXT}{follow_up}{END}"
        f"{USER}<|content_image|>{END}"
        f"{MODEL}"
    )
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    ids = tokenizer.encode(rendered, special_tokens=True)
    special = tokenizer.special_tokens
    assert ids[0] == special[SYSTEM] and ids[-1] == special[MODEL]
    assert ids.count(special[END]) == 9 and ids.count(special[EOS]) == 1


@pytest.mark.parametrize(("effort", "level"), [("none", "0"), ("low", "0.2"), ("max", "0.99"), (0.5, "0.5")])
def test_reasoning_effort_sets_the_thinking_level(checkpoint, effort, level):
    template = ChatTemplate(load_template(checkpoint))
    rendered = template.render([{"role": "user", "content": "hi"}], reasoning_effort=effort)
    assert rendered == f"{SYSTEM}{TEXT}Thinking effort level: {level}{END}{USER}{TEXT}hi{END}{MODEL}"
    closed = template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert closed.endswith(f"{USER}{TEXT}hi{END}")


def test_the_template_is_found_in_tokenizer_config_or_named_missing(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}!"}))
    assert ChatTemplate(load_template(tmp_path)).render([{"role": "user", "content": "yo"}]) == "yo!"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        load_template(tmp_path)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="refuses these messages: no tools here"):
        ChatTemplate("{{ raise_exception('no tools here') }}").render([])
    with pytest.raises(ChatTemplateError, match="cannot render"):
        ChatTemplate("{{ messages.pop() }}").render([{"role": "user"}])


def test_a_request_line_with_messages_needs_a_template_and_well_formed_messages(checkpoint):
    tokenizer, text = Tokenizer.from_checkpoint(checkpoint), load_config(TINY_CONFIG).text
    template = ChatTemplate(load_template(checkpoint))
    messages = [{"role": "user", "content": "the weather"}]
    line = json.dumps({"id": 1, "messages": messages, "tools": [], "max_tokens": 4})
    request = request_from_json(line, tokenizer, text, template)
    assert list(request.prompt_token_ids) == tokenizer.encode(template.render(messages, tools=[]), special_tokens=True)
    with pytest.raises(Rejected, match="needs the checkpoint's chat template"):
        request_from_json(line, tokenizer, text, None)
    for bad, message in [
        ({"messages": [{"content": "no role"}]}, "with a 'role'"),
        ({"messages": messages, "tools": "all"}, "'tools' must be a list"),
        ({"messages": messages, "prompt": "x"}, "exactly one of"),
    ]:
        with pytest.raises(Rejected, match=message):
            request_from_json(json.dumps({"id": 1, **bad}), tokenizer, text, template)
