"""Train a model of Inkling 2's architecture on the project's own tasks (`tools.default_tasks`) and grade it on
held-out ones: the way to the embedded default checkpoint that answers.

    python -m tools.train_default [--config configs/tiny.json] [--steps 3000] [--batch 64] [--length 352]
        [--learning-rate 3e-3] [--examples 60000] [--held-out 240] [--seed 0] [--report OUT.json]

Builds the config's model with random weights (plain experts) and the synthetic tokenizer of its vocabulary,
trains every parameter with AdamW on the model's turns (`tools.default_examples`), then decodes greedily after
each held-out prompt (every run of the model's turns, a calculator call's result fed back from the task) and
prints the share it answers exactly, by kind. The model is differentiated through the kernels' references
(`pallas_kernels.backends.references_only`). Reproducible from its seed on one device kind."""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from inkling_jax.chat import DEFAULT_TEMPLATE, ChatTemplate
from inkling_jax.checkpoint.dummy import random_model
from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import load_config
from inkling_jax.model.text import CausalLM
from inkling_jax.sharding import make_mesh
from inkling_jax.tokenizer import Tokenizer
from pallas_kernels.backends import references_only
from tools.default_examples import encode, learned_spans
from tools.default_tasks import Task, tasks

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"


def padded(encoded: list[tuple[np.ndarray, np.ndarray]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N, length] int32, learned [N, length] bool) of the examples that fit, zero-padded."""
    fits = [(ids, learned) for ids, learned in encoded if len(ids) <= length]
    ids, learned = np.zeros((len(fits), length), np.int32), np.zeros((len(fits), length), bool)
    for row, (i, m) in enumerate(fits):
        ids[row, : len(i)], learned[row, : len(m)] = i, m
    return ids, learned


def loss(model: CausalLM, ids: jax.Array, learned: jax.Array) -> jax.Array:
    """Mean cross-entropy of the learned tokens [B, T], each predicted from the ones before it."""
    logits = model(ids[:, :-1])
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)[..., 0]
    weight = learned[:, 1:].astype(jnp.float32)
    return -jnp.sum(picked * weight) / jnp.maximum(jnp.sum(weight), 1.0)


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def train_step(model: CausalLM, optimizer: nnx.Optimizer, ids: jax.Array, learned: jax.Array) -> jax.Array:
    value, grads = nnx.value_and_grad(loss)(model, ids, learned)
    optimizer.update(model, grads)
    return value


@nnx.jit
def next_tokens(model: CausalLM, ids: jax.Array, at: jax.Array) -> jax.Array:
    """The greedy token after position `at` [N] of each row of ids [N, T]."""
    logits = model(ids)
    return jnp.argmax(jnp.take_along_axis(logits, at[:, None, None], axis=1)[:, 0], axis=-1).astype(jnp.int32)


def greedy_runs(model: CausalLM, prompts: list[list[int]], limit: int, length: int, eos: int) -> list[list[int]]:
    """Each prompt's greedy continuation through the EOS token (at most `limit` tokens), in one batch of rows
    padded to `length` (causal: the padding after a row's last token never reaches it)."""
    ids = np.zeros((len(prompts), length), np.int32)
    ends = np.asarray([len(p) for p in prompts])
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    out, done = [[] for _ in prompts], np.zeros(len(prompts), bool)
    for _ in range(limit):
        if done.all() or ends.max() >= length:
            break
        chosen = np.asarray(next_tokens(model, jnp.asarray(ids), jnp.asarray(ends - 1)))
        for row in np.flatnonzero(~done):
            out[row].append(int(chosen[row]))
            ids[row, ends[row]] = chosen[row]
            done[row] = chosen[row] == eos
        ends = ends + ~done
    return out


def grade(model: CausalLM, held_out: list[tuple[Task, np.ndarray, np.ndarray]], eos: int, length: int) -> dict:
    """The share of held-out tasks (each with its encoded ids and learned mask) whose every run of model turns the
    model gives exactly, by kind and in all. A run is decoded after the task's own conversation up to it (a
    calculator's result comes from the task)."""
    runs = [learned_spans(learned) for _, _, learned in held_out]
    right = [True] * len(held_out)
    for number in range(max(len(r) for r in runs)):
        now = [i for i, r in enumerate(runs) if number < len(r)]
        prompts = [held_out[i][1][: runs[i][number][0]].tolist() for i in now]
        expected = [held_out[i][1][slice(*runs[i][number])].tolist() for i in now]
        got = greedy_runs(model, prompts, max(len(e) for e in expected), length, eos)
        for i, want, given in zip(now, expected, got, strict=True):
            right[i] &= given == want
    by_kind = collections.defaultdict(list)
    for (task, _, _), ok in zip(held_out, right, strict=True):
        by_kind[task.kind].append(ok)
    return {"all": float(np.mean(right))} | {k: float(np.mean(v)) for k, v in sorted(by_kind.items())}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=352, help="tokens per training row (longer examples dropped)")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--examples", type=int, default=60_000, help="training conversations generated")
    parser.add_argument("--held-out", type=int, default=240, help="held-out conversations graded")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, help="write the losses and grades here (JSON)")
    args = parser.parse_args(argv)

    config = load_config(args.config)
    tokenizer = Tokenizer(build_tokenizer(config.text))
    template = ChatTemplate(DEFAULT_TEMPLATE.read_text())
    start = time.perf_counter()
    train_ids, train_learned = padded(
        [encode(task, template, tokenizer) for task in tasks(args.seed, args.examples, "train")], args.length
    )
    held_out = [(task, *encode(task, template, tokenizer)) for task in tasks(args.seed, args.held_out, "held_out")]
    held_out = [example for example in held_out if len(example[1]) <= args.length]
    print(f"{len(train_ids)} training rows of {args.length} tokens in {time.perf_counter() - start:.1f} s", flush=True)

    mesh = make_mesh("tp1", config.text)
    model = random_model(config, jnp.float32, mesh, [None] * config.text.num_hidden_layers, args.seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, args.steps // 20, args.steps)
    optimizer = nnx.Optimizer(
        model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)), wrt=nnx.Param
    )
    rng = np.random.default_rng(args.seed)
    losses = []
    with references_only():
        start = time.perf_counter()
        for step in range(args.steps):
            rows = rng.choice(len(train_ids), args.batch, replace=False)
            losses.append(float(train_step(model, optimizer, jnp.asarray(train_ids[rows]), train_learned[rows])))
            if step % 100 == 0 or step == args.steps - 1:
                print(f"step {step}: loss {losses[-1]:.4f}, {time.perf_counter() - start:.0f} s", flush=True)
        trained_s = time.perf_counter() - start
        grades = grade(model, held_out, tokenizer.eos_token_id, args.length)
    print(f"{len(held_out)} held-out tasks answered exactly:", json.dumps(grades), flush=True)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "train_s": trained_s,
        "losses": losses[::10],
        "grades": grades,
    }
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
