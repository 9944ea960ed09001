"""Multi-host: two processes on localhost joined by `jax.distributed` (CPU collectives over gloo) run a
batch job (`python -m inkling_jax.offline`: the scheduler in lockstep on every process) and agree with a
single process, on the tiny parity model's config in four layers with random weights (a third of twelve layers'
compile in each process). The parity checkpoint's greedy tokens through the batch runner:
tests/runtime/test_generate.py."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from model_configs import four_layers, without_tokenizer
from paths import REPO, TINY_TEXT

from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.distributed import DistributedError, add_arguments, initialize
from inkling_jax.forward import greedy_continuation
from inkling_jax.runtime.batch import generate
from inkling_jax.runtime.requests import Request

REFERENCE = dict(np.load(TINY_TEXT / "reference.npz"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests() -> list[dict]:
    rng = np.random.default_rng(21)
    sampled = [
        {
            "id": f"s{i}",
            "prompt_token_ids": rng.integers(0, 500, 5 + 4 * i).tolist(),
            "max_tokens": 6,
            "temperature": 0.9,
            "top_k": 40,
            "seed": 100 + i,
        }
        for i in range(3)
    ]
    greedy = {
        "id": "greedy",
        "prompt_token_ids": REFERENCE["greedy_prompt"].tolist(),
        "max_tokens": 16,
        "temperature": 0,
    }
    return [greedy, *sampled]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("four_layers")
    config = four_layers(TINY_TEXT / "hf" / "config.json", folder / "config.json")
    return without_tokenizer(write_checkpoint(config, folder / "checkpoint", experts="fp32", seed=3))


@pytest.fixture(scope="module")
def one_process(checkpoint) -> tuple[list[dict], list[int]]:
    """The requests' results in this process, and the greedy request's tokens by whole-sequence forwards."""
    _, model = load_causal_lm(checkpoint, np.float32)
    greedy = requests()[0]
    want = greedy_continuation(model, greedy["prompt_token_ids"], greedy["max_tokens"])
    return generate(model, [Request(**r) for r in requests()], max_num_seqs=2, chunk=4), want


@pytest.mark.slow
def test_two_processes_agree_with_one(tmp_path, checkpoint, one_process):
    """Two devices per process and a tp4 mesh over both: attention's and the experts' collectives cross
    processes."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests()))
    # two devices each, compiled without LLVM's optimisations like the rest of the suite (tests/conftest.py)
    flags = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "PYTHONPATH": str(REPO)}
    address = f"127.0.0.1:{free_port()}"

    def command(rank: int) -> list[str]:
        return [sys.executable, "-m", "inkling_jax.offline", "--checkpoint", str(checkpoint), "--quiet",
                "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"out{rank}.jsonl"),
                "--dtype", "float32", "--max-num-seqs", "2", "--chunk", "4", "--mesh", "tp4",
                "--coordinator-address", address, "--num-processes", "2", "--process-id", str(rank)]  # fmt: skip

    processes = [
        subprocess.Popen(command(rank), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    results = [json.loads(line) for line in (tmp_path / "out0.jsonl").read_text().splitlines()]
    assert not (tmp_path / "out1.jsonl").exists()  # process 0 writes the results
    assert results == one_process[0]
    assert results[0]["token_ids"] == one_process[1]


@pytest.mark.parametrize(
    ("flags", "environment", "message"),
    [
        (["--num-processes", "2", "--process-id", "0"], {}, "need --coordinator-address"),
        (["--coordinator-address", "host:1", "--num-processes", "2"], {}, "give both"),
        (["--coordinator-address", "host:1", "--num-processes", "2", "--process-id", "2"], {}, "not within 0 .. 1"),
        (["--coordinator-address", "nowhere"], {}, "is not HOST:PORT"),
        (["--coordinator-address", "host:1"], {"JAX_NUM_PROCESSES": "x", "JAX_PROCESS_ID": "0"}, "must be an integer"),
    ],
)
def test_bad_multi_host_settings_are_named(monkeypatch, flags, environment, message):
    import argparse

    for variable in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(DistributedError, match=message):
        initialize(parser.parse_args(flags))
