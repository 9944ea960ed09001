"""bench.e2e on the tiny config's dummy model (four layers), on CPU: one run prints and records every section (the
cold compile of each step shape the engine compiles, decode steps and the bytes they must read, the restart over the
cache the compile filled, its step programs read from the executable cache, the gRPC levels, long prompts among
decoding streams) with sane values, and --render gives the record back as markdown."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_configs import four_layers
from paths import REPO, TINY_CONFIG

from bench.e2e import main
from inkling_jax.config import load_config
from inkling_jax.param_count import count_parameters

pytestmark = pytest.mark.slow  # every test reads one whole run of the bench (a module fixture)

CONCURRENCY, LONG_PROMPTS, CHUNK = (1, 2), 2, 16


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return four_layers(TINY_CONFIG, tmp_path_factory.mktemp("config") / "config.json")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, config: Path) -> tuple[dict, str, Path]:
    """(the JSON record, stdout, the markdown file) of one whole run."""
    out = tmp_path_factory.mktemp("e2e")
    command = [sys.executable, "-m", "bench.e2e", "--config", str(config), "--concurrency", *map(str, CONCURRENCY),
               "--requests-per-level", "2", "--prompt-tokens", "8", "--max-tokens", "8", "--long-prompt-tokens", "64",
               "--long-prompts", str(LONG_PROMPTS), "--chunk", str(CHUNK), "--steps", "4", "--compilation-cache",
               str(out / "xla"), "--out", str(out / "e2e.json"), "--markdown", str(out / "e2e.md")]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads((out / "e2e.json").read_text()), done.stdout, out / "e2e.md"


def test_the_cold_compile_covers_every_step_shape(run):
    result, _, _ = run
    slots = max(CONCURRENCY) + LONG_PROMPTS
    lanes = -(-(slots + 2 * CHUNK) // min(CHUNK, 64))  # the default token budget: a token a slot and two chunks
    assert [shape["shape"] for shape in result["compile"]] == [
        f"{slots} tokens, width 1, 0 lanes",
        f"{slots + 2 * CHUNK} tokens, width 1, {lanes} lanes",
    ]
    for shape in result["compile"]:
        assert 0 < shape["lower_s"] and 0 < shape["compile_s"] and 0 < shape["first_run_s"]
        assert shape["compile_s"] + shape["first_run_s"] <= result["warm_up"]["seconds"]
    assert result["load"]["seconds"] > 0


def test_decode_steps_have_times_and_the_bytes_they_must_read(run, config):
    result, stdout, _ = run
    text = load_config(config).text
    experts, top_k = text.n_routed_experts, text.num_experts_per_tok
    assert [step["batch"] for step in result["decode"]] == list(CONCURRENCY)
    for step in result["decode"]:
        assert step["wall_ms"] > 0 and step["kernels_ms"] is None  # no GPU here
        assert 0 < step["host_ms"] and 0 <= step["wait_ms"] and step["host_ms"] + step["wait_ms"] <= step["wall_ms"]
        size = step["bytes"]
        assert all(size[part] > 0 for part in ("other_parameters", "embedding_rows", "routed_experts", "kv"))
        assert size["distinct_experts"] == pytest.approx(experts * (1 - (1 - top_k / experts) ** step["batch"]))
        assert step["roofline_ms"] == pytest.approx(size["total"] / 4.3e12 * 1e3)
        assert 0 < step["roofline_pct_of_wall"]
    # at batch 1 a token reads k of the E experts of each layer (the tiny config's are bf16)
    routed = count_parameters(load_config(config)).routed_experts * 2
    assert result["decode"][0]["bytes"]["routed_experts"] == pytest.approx(routed * top_k / experts)
    assert "n/a (no GPU)" in stdout


def test_the_restart_reads_every_program_from_the_cache(run):
    result, _, _ = run
    restart = result["restart"]
    assert "cold_start" not in result  # the engine phase filled the cache
    assert restart["cache_entries_before"] > 0 and restart["cache_entries_written"] == 0
    # every step shape the engine phase compiled came from the executable cache: no tracing, lowering or compile
    assert restart["steps_loaded"] == len(result["compile"]) and restart["steps_compiled"] == 0
    assert 0 < restart["load_s"] < restart["to_serving_s"] and restart["warm_up_s"] > 0
    assert restart["beyond_load_s"] == pytest.approx(restart["to_serving_s"] - restart["load_s"])


def test_grpc_levels_and_long_prompts(run):
    result, _, _ = run
    assert [level["concurrency"] for level in result["grpc"]] == list(CONCURRENCY)
    for level in result["grpc"]:
        assert 0 < level["tpot_ms"]["p50"] <= level["tpot_ms"]["p99"]
        assert 0 < level["ttft_ms"]["p50"] <= level["ttft_ms"]["p99"]
        assert level["output_tokens_per_s"] > 0
    long = result["long_prompts"]
    assert long["streams"] == max(CONCURRENCY) and long["prompts"] == LONG_PROMPTS
    assert 0 < long["ttft_ms"]["p50"] <= long["ttft_ms"]["max"]
    for tpot in (long["stream_tpot_ms_before"], long["stream_tpot_ms_during"]):
        assert 0 < tpot["p50"] <= tpot["p99"]
    assert long["streams_ended_early"] == 0


def test_the_record_renders_as_markdown(run, tmp_path, capsys):
    result, stdout, markdown = run
    text = markdown.read_text()
    assert text.startswith("# bench.e2e") and f"Commit: {result['setup']['commit']}" in text
    for title in (
        "Cold compile",
        "Decode step",
        "Restart over the filled cache",
        "gRPC",
        "decoding streams",
        "Side by side",
    ):
        assert title in text and title in stdout
    main(["--render", str(markdown.with_suffix(".json")), "--markdown", str(tmp_path / "again.md")])
    assert (tmp_path / "again.md").read_text() == text
    assert capsys.readouterr().out == text
