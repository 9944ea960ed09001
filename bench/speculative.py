"""DSpark speculation on a small target: distill a draft, then measure acceptance length and tokens/s.

    python -m bench.speculative --out bench/results/speculative_cpu.json [--steps 3000 --sequences 1024]

1. A synthetic target with a DSpark draft (random weights; the LM head scaled by --sharpen so that the
   target's next-token law is peaked and depends on the context, as a trained model's is).
2. Training text: sequences sampled from the target at temperature 1 through the engine.
3. Distillation: the draft's own parameters (the target's embedding and LM head stay frozen) minimise
   the cross-entropy of the draft's block distributions against the target's at random anchors of the
   training text, the RNN head fed the real continuation (teacher forcing), with AdamW.
4. Measurement on fresh prompts, with the untrained and the trained draft: acceptance length (tokens
   emitted per speculative round) and per-user tokens/s with and without speculation, at batch 1 and 8,
   greedy and temperature 1. Every engine is warmed up (compiled) before it is timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.model.text import CausalLM
from inkling_jax.runtime.batch import run_requests
from inkling_jax.runtime.engine import Engine
from inkling_jax.runtime.requests import Request
from inkling_jax.sharding import make_mesh

TARGET = {
        "model_type": "inkling2_text", "vocab_size": 512, "unpadded_vocab_size": 500, "hidden_size": 64,
        "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16, "sliding_window_size": 16,
        "d_rel": 4, "rel_extent": 24, "log_scaling_n_floor": 32, "max_position_embeddings": 1024,
        "conv_kernel_size": 4, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "final_logit_softcapping": 30.0, "eos_token_id": 499,
}  # fmt: skip
DRAFT = {
    "num_hidden_layers": 2,
    "block_size": 7,
    "target_layer_ids": [1, 5, 10],
    "mask_token_id": 498,
    "markov_rank": 64,
    "intermediate_size": 256,
}


def build_target(root: Path, dtype: jnp.dtype, sharpen: float) -> CausalLM:
    (root / "config.json").write_text(json.dumps(TARGET))
    path = write_checkpoint(root / "config.json", root / "ckpt", seed=7, experts="bf16", draft=DRAFT)
    model = load_causal_lm(path, dtype)[1]
    model.lm_head.weight[...] = model.lm_head.weight[...] * sharpen
    return model


def prompts(rng: np.random.Generator, count: int, vocab: int, eos: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab, 8) if t != eos] or [1] for _ in range(count)]


def engine_for(model: CausalLM, slots: int, context: int, speculative: str) -> Engine:
    mesh = make_mesh("tp1", model.config)
    return Engine.create(model, mesh, max_num_seqs=slots, chunk=16, max_context=context, speculative=speculative)


def training_text(model: CausalLM, count: int, length: int, seed: int) -> np.ndarray:
    """[count, length] token ids sampled from the target at temperature 1 (sequences that end early are
    padded by repeating their prompt's tokens; a few such rows do not matter for distillation)."""
    text = model.config
    rng = np.random.default_rng(seed)
    requests = [
        Request(i, prompt, max_tokens=length - len(prompt), temperature=1.0, seed=seed * 100_000 + i)
        for i, prompt in enumerate(prompts(rng, count, text.unpadded_vocab_size, text.eos_token_id))
    ]
    results = run_requests(engine_for(model, 64, length + 8, "none"), requests)
    rows = [(r.prompt_token_ids + out["token_ids"]) for r, out in zip(requests, results, strict=True)]
    return np.asarray([np.resize(row, length) for row in rows], np.int32)


def target_outputs(model: CausalLM, text: np.ndarray, batch: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """The draft's inputs and teacher over `text` [N, T]: the target's layer outputs at the draft's target
    layers [N, T, m, d] and its logits [N, T, V], from whole-sequence forwards."""
    graphdef, state = nnx.split(model)
    layers = model.dspark.config.target_layer_ids

    @jax.jit
    def forward(state, tokens):
        target = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, _, features = target.model(tokens, positions, capture=layers)
        return features, target.logits(hidden)

    outputs = [forward(state, text[i : i + batch]) for i in range(0, len(text), batch)]
    return tuple(np.concatenate([np.asarray(o[k]) for o in outputs]) for k in (0, 1))


def distill(model: CausalLM, text: np.ndarray, steps: int, batch: int, anchors: int, lr: float, seed: int) -> dict:
    """Train model.dspark in place on `text` [N, T]; returns the loss curve and the time taken."""
    gamma = model.dspark.config.block_size
    start = time.perf_counter()
    features, teacher_logits = target_outputs(model, text)
    target_graphdef, target_state = nnx.split(model)
    draft_graphdef, draft_state = nnx.split(model.dspark)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, steps // 20, steps, lr / 20), weight_decay=0.0)
    opt_state = optimizer.init(draft_state)
    length = text.shape[1]

    def loss_fn(draft_state, target_state, tokens, features, teacher_logits, starts):
        target = nnx.merge(target_graphdef, target_state)  # frozen: its embedding and LM head
        draft = nnx.merge(draft_graphdef, draft_state)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
        context_k, context_v = draft.context_kv(draft.context_features(features), positions)  # [l, B, T, H, D]
        rows = jnp.repeat(jnp.arange(tokens.shape[0]), anchors)  # [R]: each sequence's anchors
        starts = starts.reshape(-1)  # [R]: anchor positions
        block = starts[:, None] + jnp.arange(gamma + 1)  # the anchor, then the γ positions to predict
        window = tokens[rows[:, None], block]  # [R, γ + 1]
        h = draft.block_hidden(
            window[:, 0], starts, context_k[:, rows], context_v[:, rows], positions[rows], target.model.embed_tokens
        )
        logits = target.logits(h) + draft.block_biases(window[:, 0], window[:, 1:], h)  # [R, γ, V]
        teacher = jax.nn.softmax(teacher_logits[rows[:, None], block[:, :-1]], axis=-1)  # [R, γ, V]
        return -jnp.mean(jnp.sum(teacher * jax.nn.log_softmax(logits, axis=-1), axis=-1))

    @jax.jit
    def train_step(draft_state, opt_state, target_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(draft_state, target_state, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, draft_state)
        return optax.apply_updates(draft_state, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    curve = []
    for step in range(steps):
        rows = rng.choice(len(text), batch, replace=False)
        starts = rng.integers(1, length - gamma - 1, (batch, anchors)).astype(np.int32)
        draft_state, opt_state, loss = train_step(
            draft_state, opt_state, target_state, text[rows], features[rows], teacher_logits[rows], starts
        )
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            curve.append((step, round(float(loss), 4)))
            print(f"  step {step}: loss {float(loss):.4f}", file=sys.stderr)
    nnx.update(model.dspark, draft_state)
    return {
        "steps": steps,
        "batch": batch,
        "anchors_per_sequence": anchors,
        "lr": lr,
        "loss": curve,
        "seconds": round(time.perf_counter() - start, 1),
    }


def measure(model: CausalLM, eval_prompts: list[list[int]], max_tokens: int, repeats: int) -> list[dict]:
    """Acceptance length and tokens/s, with and without speculation, at batch 1 and 8, greedy and T = 1."""
    rows = []
    context = max(len(p) for p in eval_prompts) + max_tokens + model.dspark.config.block_size + 1
    for slots in (1, 8):
        for mode in ("none", "dspark"):
            engine = engine_for(model, slots, context, mode)
            for temperature in (0.0, 1.0):
                requests = [
                    Request(i, prompt, max_tokens=max_tokens, temperature=temperature, seed=i)
                    for i, prompt in enumerate(eval_prompts[:slots])
                ]
                run_requests(engine, requests)  # compiles every shape
                times, results = [], None
                for _ in range(repeats):
                    start = time.perf_counter()
                    results = run_requests(engine, requests)
                    times.append(time.perf_counter() - start)
                seconds = float(np.median(times))
                generated = sum(len(r["token_ids"]) for r in results)
                lengths = [r["acceptance_length"] for r in results if "acceptance_length" in r]
                rows.append(
                    {
                        "batch": slots,
                        "speculative": mode,
                        "temperature": temperature,
                        "generated": generated,
                        "seconds": round(seconds, 4),
                        "tokens_per_s": round(generated / seconds, 1),
                        "per_user_tokens_per_s": round(generated / slots / seconds, 1),
                        "acceptance_length": round(float(np.mean(lengths)), 3) if lengths else None,
                    }
                )
                print(f"  {rows[-1]}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--sharpen", type=float, default=40.0, help="LM-head scale of the random target")
    parser.add_argument("--sequences", type=int, default=512, help="training sequences sampled from the target")
    parser.add_argument("--length", type=int, default=96, help="tokens per training sequence")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16, help="sequences per training step")
    parser.add_argument("--anchors", type=int, default=8, help="anchors (blocks) per sequence per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request when measuring")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (the median is kept)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    with tempfile.TemporaryDirectory() as root:
        model = build_target(Path(root), dtype, args.sharpen)
    text_config = model.config
    rng = np.random.default_rng(1)
    eval_prompts = prompts(rng, 8, text_config.unpadded_vocab_size, text_config.eos_token_id)
    print("untrained draft:", file=sys.stderr)
    untrained = measure(model, eval_prompts, args.max_tokens, 1)
    print("sampling training text:", file=sys.stderr)
    start = time.perf_counter()
    text = training_text(model, args.sequences, args.length, seed=2)
    sampled_in = time.perf_counter() - start
    print("distilling:", file=sys.stderr)
    training = distill(model, text, args.steps, args.batch, args.anchors, args.lr, seed=3)
    training["text"] = {"sequences": args.sequences, "length": args.length, "seconds": round(sampled_in, 1)}
    print("trained draft:", file=sys.stderr)
    trained = measure(model, eval_prompts, args.max_tokens, args.repeats)
    result = {
        "command": "python -m bench.speculative " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind),
            "host": platform.node(),
            "cpus": jax.local_device_count(),
        },
        "target": TARGET,
        "draft": DRAFT,
        "sharpen": args.sharpen,
        "dtype": args.dtype,
        "training": training,
        "untrained_draft": untrained,
        "trained_draft": trained,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
