"""Chat rendering: a checkpoint's chat template (`chat_template.jinja`, or tokenizer_config.json's
`chat_template`) applied to OpenAI-style messages, as transformers and the SMG gateway apply it (a sandboxed
Jinja environment with trimmed blocks and their `tojson`), so that a conversation becomes the same prompt here as
through the gateway. Synthetic checkpoints ship Inkling 2's framing (`inkling_jax/chat_template.jinja`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE = Path(__file__).resolve().parent / TEMPLATE_FILE


class ChatTemplateError(ValueError):
    """A checkpoint without a chat template, or a conversation its template cannot render."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatTemplateError(f"the chat template refuses these messages: {message}")


def _template_text(directory: Path) -> str | None:
    """The chat template a checkpoint directory ships, None if it ships none."""
    if (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    config = directory / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def load_template(checkpoint: str | Path) -> str:
    """The chat template a checkpoint directory ships; ChatTemplateError naming the files looked for if none."""
    template = _template_text(Path(checkpoint))
    if template is None:
        raise ChatTemplateError(
            f"{checkpoint} has no chat template ({TEMPLATE_FILE}, or 'chat_template' in tokenizer_config.json): "
            "send prompts or token ids instead of messages"
        )
    return template


def checkpoint_template(checkpoint: str | Path) -> ChatTemplate | None:
    """The chat template of a checkpoint directory, or None when it ships none (or is a config file)."""
    template = _template_text(Path(checkpoint)) if Path(checkpoint).is_dir() else None
    return None if template is None else ChatTemplate(template)


class ChatTemplate:
    """A compiled chat template: `render(messages, tools=None, add_generation_prompt=True, **variables)`."""

    def __init__(self, source: str):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"the chat template does not parse: {error}") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt text of a conversation (special tokens as their strings, to encode with them)."""
        if tools is not None:
            variables["tools"] = tools
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template cannot render these messages: {error}") from None
