"""The default model's tasks (`tools.default_tasks`) as training examples: a conversation's token ids and which of
them the model learns to emit.

A conversation is encoded as serving sees it: each prompt (the conversation so far, rendered by the chat template
with the generation prompt `<|message_model|>`) and each run of the model's turns (what it generates after that
prompt, through `<|content_model_end_sampling|>`, the token that ends sampling) encoded on its own and joined. The
pieces meet at special tokens, so the ids are those of the whole rendered conversation; the model is trained on its
runs only, never on the prompts (the user's and the tools' words)."""

from __future__ import annotations

import numpy as np

from inkling_jax.chat import ChatTemplate
from inkling_jax.tokenizer import Tokenizer
from tools.default_tasks import Task


def _turn_runs(task: Task) -> list[tuple[int, int]]:
    """(first, end) message indices of each run of consecutive model turns."""
    runs, start = [], None
    for i, message in enumerate((*task.messages, {"role": "end"})):
        if message["role"] == "assistant" and start is None:
            start = i
        elif message["role"] != "assistant" and start is not None:
            runs.append((start, i))
            start = None
    return runs


def encode(task: Task, template: ChatTemplate, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids [T] int32, learned [T] bool): the conversation's ids and the model's own among them."""
    tools = list(task.tools) or None
    messages = list(task.messages)
    ids: list[int] = []
    learned: list[bool] = []
    rendered = ""
    for first, end in _turn_runs(task):
        prompt = template.render(messages[:first], tools=tools)
        through = template.render(messages[:end], tools=tools, add_generation_prompt=False)
        if not (prompt.startswith(rendered) and through.startswith(prompt)):
            raise ValueError(f"the chat template renders a {task.kind} conversation's turns out of order")
        for text, own in ((prompt[len(rendered) :], False), (through[len(prompt) :], True)):
            piece = tokenizer.encode(text, special_tokens=True)
            ids += piece
            learned += [own] * len(piece)
        rendered = through
    return np.asarray(ids, np.int32), np.asarray(learned, bool)


def learned_spans(learned: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of learned tokens in a mask `encode` made: one per run of the model's turns."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], learned.astype(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))
