"""`python -m inkling_jax.generate` (the batch runner over the scheduler) on the tiny parity model's config in four
layers with random weights: what the runner does, not the model's depth, is under test (a step program of four
layers compiles in a third of twelve layers' time); the parity checkpoint itself for transformers' greedy tokens
through the runner and for the refused inputs (it has no tokenizer)."""

import json
from pathlib import Path

import numpy as np
import pytest
from model_configs import four_layers, without_tokenizer
from paths import TINY_TEXT

from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.forward import greedy_continuation
from inkling_jax.generate import main

REFERENCE = dict(np.load(TINY_TEXT / "reference.npz"))
PROMPT = REFERENCE["greedy_prompt"].tolist()
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The parity model's config (window 8, relative extent 12) in four layers, random fp32 weights, no tokenizer."""
    folder = tmp_path_factory.mktemp("four_layers")
    config = four_layers(TINY_TEXT / "hf" / "config.json", folder / "config.json")
    return without_tokenizer(write_checkpoint(config, folder / "checkpoint", experts="fp32", seed=5))


@pytest.fixture(scope="module")
def greedy(checkpoint) -> list[int]:
    """The greedy continuation of PROMPT by whole-sequence forwards (no decode state)."""
    return greedy_continuation(load_causal_lm(checkpoint, np.float32)[1], PROMPT, GREEDY_TOKENS)


def run(checkpoint: Path, tmp_path: Path, lines: list, *options: str) -> tuple[int, list[dict]]:
    (tmp_path / "in.jsonl").write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    code = main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--dtype", "float32", *options])  # fmt: skip
    out = tmp_path / "out.jsonl"
    return code, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def mixed_requests(greedy: list[int]) -> list[dict]:
    """Greedy, greedy with a stop token (the fourth greedy token), and sampled requests (top-p, top-k, seeded) of
    random prompts."""
    rng = np.random.default_rng(0)
    requests = [
        {"id": "greedy", "prompt_token_ids": PROMPT, "max_tokens": GREEDY_TOKENS, "temperature": 0},
        {"id": "stop", "prompt_token_ids": PROMPT, "max_tokens": 16, "temperature": 0, "stop_token_ids": [greedy[3]]},
    ]
    for i in range(4):
        requests.append(
            {
                "id": i,
                "prompt_token_ids": rng.integers(0, 500, int(rng.integers(1, 15))).tolist(),
                "max_tokens": int(rng.integers(1, 9)),
                "temperature": 0.8,
                "top_p": 0.9,
                "top_k": 50,
                "seed": 11 + i,
            }
        )
    return requests


@pytest.fixture(scope="module")
def batched(tmp_path_factory, checkpoint, greedy) -> list[dict]:
    """mixed_requests() through two slots of one device, in steps of 4 tokens: the result lines."""
    code, results = run(
        checkpoint, tmp_path_factory.mktemp("tp1"), mixed_requests(greedy), "--max-num-seqs", "2", "--chunk", "4"
    )
    assert code == 0
    return results


@pytest.mark.slow
def test_batched_requests_match_running_alone_and_stop_tokens_end_them(tmp_path, checkpoint, greedy, batched):
    requests = mixed_requests(greedy)
    assert [r["id"] for r in batched] == [r["id"] for r in requests]
    assert batched[0] == {"id": "greedy", "token_ids": greedy, "finish_reason": "length"}
    stopped = greedy[: greedy.index(greedy[3]) + 1]
    assert batched[1] == {"id": "stop", "token_ids": stopped, "finish_reason": "stop"}
    code, alone = run(checkpoint, tmp_path, requests[2:], "--max-num-seqs", "1", "--chunk", "8")  # one at a time
    assert code == 0 and alone == batched[2:]
    # steps of 5 tokens: beside two decoding slots, prompt pieces of up to 3 tokens, each in a lane of 4
    code, narrow = run(
        checkpoint, tmp_path, requests, "--max-num-seqs", "2", "--chunk", "4", "--max-num-batched-tokens", "5"
    )
    assert code == 0 and narrow == batched
    for request, result in zip(requests[2:], batched[2:], strict=True):
        assert len(result["token_ids"]) == request["max_tokens"]


@pytest.mark.slow
def test_the_parity_checkpoint_gives_transformers_greedy_tokens(tmp_path):
    """The parity checkpoint (twelve layers) through the runner: transformers' greedy generation, token for token."""
    greedy = {"id": "greedy", "prompt_token_ids": PROMPT, "max_tokens": GREEDY_TOKENS, "temperature": 0}
    code, results = run(TINY_TEXT / "hf", tmp_path, [greedy], "--max-num-seqs", "1", "--chunk", "8")
    assert code == 0
    assert results == [{"id": "greedy", "token_ids": REFERENCE["greedy_ids"].tolist(), "finish_reason": "length"}]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not JSON"),
        ({"prompt_token_ids": [1]}, "line 2: missing 'id'"),
        ({"id": 1, "prompt_token_ids": [1], "temprature": 0.5}, "line 2: unknown field(s) temprature"),
        ({"id": 1, "prompt_token_ids": [1], "temperature": -1}, "line 2: temperature must be within [0.0, 100.0]"),
        ({"id": 1, "prompt_token_ids": [1, 600]}, "line 2: prompt_token_ids[1] is 600, outside the vocabulary"),
        ({"id": 1, "prompt_token_ids": [1], "max_tokens": 0}, "line 2: max_tokens must be at least 1"),
        ({"id": 1, "prompt_token_ids": [1], "top_k": 1.5}, "line 2: top_k must be an integer"),
        ({"id": 1, "prompt_token_ids": [1], "max_tokens": 5000}, "line 2: prompt (1 tokens) + max_tokens (5000)"),
        ({"id": 0, "prompt_token_ids": [1]}, "line 2: id 0 is already used on line 1"),
        ({"id": 1, "prompt": "hello"}, "line 2: 'prompt' (text) needs a tokenizer"),
        ({"id": 1, "messages": [{"role": "user", "content": "hi"}]}, "line 2: 'messages' needs a tokenizer"),
    ],
)
def test_malformed_lines_are_named(tmp_path, capsys, line, message):  # the parity checkpoint: no tokenizer
    code, results = run(TINY_TEXT / "hf", tmp_path, [{"id": 0, "prompt_token_ids": [1, 2]}, line])
    assert code == 2 and results == []
    assert message in capsys.readouterr().err


def test_a_step_budget_without_room_for_a_prompt_token_is_refused(tmp_path, capsys):
    code, results = run(
        TINY_TEXT / "hf",
        tmp_path,
        [{"id": 0, "prompt_token_ids": [1, 2]}],
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "4",
    )
    assert code == 2 and results == []
    assert "max_num_batched_tokens 4 leaves no prompt token beside the 4 decode tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_a_small_budget_makes_requests_wait_for_pages(tmp_path, checkpoint):
    """Three slots but pages for two sequences: the third request waits, and nothing changes."""
    from inkling_jax.cache import CacheLayout, init_state
    from inkling_jax.runtime.batch import generate
    from inkling_jax.runtime.requests import Request

    _, model = load_causal_lm(checkpoint, np.float32)
    rng = np.random.default_rng(4)
    requests = [Request(i, rng.integers(0, 500, 10).tolist(), max_tokens=6, temperature=0.7, seed=i) for i in range(4)]
    unlimited = generate(model, requests, max_num_seqs=3, chunk=4)
    budget = init_state(model.config, CacheLayout(3, 2, 1, 4), np.float32).nbytes
    assert generate(model, requests, max_num_seqs=3, chunk=4, budget_bytes=budget) == unlimited
    code, _ = run(checkpoint, tmp_path, [{"id": 0, "prompt_token_ids": [1, 2]}], "--kv-cache-mib", "0.01")
    assert code == 2


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["tp4", "dp2tp2", "dp2tp1"])
def test_sharded_generation_matches_one_device(tmp_path, checkpoint, greedy, batched, spec):
    """8 simulated CPU devices (tests/conftest.py): the same tokens as tp1, greedy and sampled (tp4 keeps a copy of
    one of the 2 KV heads per device and splits the vocabulary that top-k and top-p filter); dp2 splits the requests
    over two replicas of max-num-seqs slots each (with tp1, each replica runs the experts whole)."""
    code, sharded = run(
        checkpoint, tmp_path, mixed_requests(greedy), "--max-num-seqs", "2", "--chunk", "4", "--mesh", spec
    )
    assert code == 0
    assert sharded == batched
