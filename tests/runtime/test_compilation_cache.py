"""`--compilation-cache DIR`: a second batch job in a fresh process reads every program it compiles from the cache
the first one filled: the engine's step programs from the executable cache in DIR/executables (neither traced,
lowered nor compiled), every other program from JAX's persistent compilation cache."""

import json
import os
import subprocess
import sys

import pytest
from model_configs import four_layers
from paths import REPO, TINY_CONFIG

from inkling_jax.runtime import compilation_cache

# generate on a dummy model of the tiny text config in four layers (what is cached, not the model's depth, is under
# test: a third of twelve layers' compile), counting JAX's persistent-cache events in its process
SCRIPT = """
import collections, json, sys
import jax.monitoring
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kwargs: events.update([name]))
from inkling_jax.generate import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "hits": events["/jax/compilation_cache/cache_hits"],
                  "misses": events["/jax/compilation_cache/cache_misses"]}))
"""


@pytest.mark.slow
def test_a_second_process_compiles_from_the_cache(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 0, "prompt_token_ids": [3, 1, 4, 1, 5], "max_tokens": 4}))
    cache = tmp_path / "xla"
    config = four_layers(TINY_CONFIG, tmp_path / "config.json")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}

    def run(output: str) -> tuple[dict, str]:
        command = [sys.executable, "-c", SCRIPT, "--checkpoint", str(config),
                   "--load-format", "dummy", "--dtype", "float32", "--input", str(tmp_path / "in.jsonl"),
                   "--output", str(tmp_path / output), "--quiet", "--compilation-cache", str(cache)]  # fmt: skip
        done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1]), done.stderr

    first, log = run("first.jsonl")
    assert first["code"] == 0 and first["hits"] == 0 and first["misses"] > 0
    assert len(list(cache.glob("*-cache"))) >= first["misses"]  # every program written
    steps = log.count("]: compiled in ")
    assert steps == 2 and len(list((cache / "executables").glob("*.exe"))) == steps  # decode, prompt chunks
    second, log = run("second.jsonl")
    assert second["code"] == 0 and second["misses"] == 0 and second["hits"] == first["misses"]
    assert log.count("]: loaded from the executable cache in ") == steps and "]: compiled in " not in log
    assert (tmp_path / "second.jsonl").read_text() == (tmp_path / "first.jsonl").read_text()


def test_the_default_directory_is_the_users_cache_and_none_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation_cache.ENVIRONMENT, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_directory() == str(tmp_path / "inkling_jax" / "xla")
    monkeypatch.setenv(compilation_cache.ENVIRONMENT, "none")
    assert compilation_cache.default_directory() == "none"
    assert compilation_cache.enable("none") is None
    assert compilation_cache.executables(None) is None  # and so is the executable cache
