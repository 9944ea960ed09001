"""The soak harness (`bench.soak`): half a minute of its randomized mixed load against a `serving.main` process on
the tiny synthetic checkpoint (float32, four layers), with every check the 30-minute run makes; and its checks
themselves, on streams broken on purpose."""

import random

import pytest
from model_configs import four_layers
from paths import TINY_CONFIG
from xla_flags import optimized_environment

from bench import soak
from inkling_jax.checkpoint.synthetic import write_checkpoint
from serving.proto import inkling_pb2 as pb

EOS = 499


@pytest.mark.slow
def test_half_a_minute_of_mixed_load_passes_every_check(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", optimized_environment()["XLA_FLAGS"])  # the server's time goes to running steps
    config = four_layers(TINY_CONFIG, tmp_path / "config.json")
    checkpoint = write_checkpoint(config, tmp_path / "checkpoint", experts="mixed")
    settings = soak.Settings(
        minutes=0.5,
        reference_minutes=0.15,
        round_seconds=(5.0, 12.0),
        concurrency=(2, 4, 8),  # a round ends when its calls do: 32 workers queue two minutes of work
        rss_every_s=1.0,
        checkpoint=str(checkpoint),
        log=str(tmp_path / "server.log"),
    )
    report = soak.run(settings)
    assert report.failures == [], report.text
    assert report.preemptions > 0 and report.references > 0 and report.mismatches == []
    kinds = {
        "Generate: text",
        "Generate: token ids",
        "Generate: long-prompt burst",
        "Generate: cancelled after some tokens",
        "Generate: cancelled at a random time",
        "Generate: tight deadline",
        "Generate: duplicate id, the first call",
        "Generate: duplicate id, the second call",
        "Tokenize, then Detokenize",
        "Detokenize",
        "GetModelInfo",
    }  # the first round sends every kind, every bad request included
    assert kinds <= set(report.counts), report.text
    info = pb.ModelInfo(vocab_size=512, unpadded_vocab_size=500, max_context=4096)
    bad = {f"bad: {name}" for name, _, _ in soak.Load(None, info, random.Random(0), settings).bad_requests()}
    assert bad <= set(report.counts), report.text


def ok_stream(rng: random.Random) -> soak.Call:
    """A well-formed OK stream of random tokens (no stop token among them), ended by LENGTH."""
    max_tokens = rng.randint(4, 40)
    request = pb.GenerateRequest(request_id=f"r{rng.randrange(1000)}", token_ids=pb.TokenIds(ids=[1, 2, 3]))
    request.stop.max_tokens = max_tokens
    request.stop.stop_token_ids[:] = [rng.randrange(480, 490)]
    call = soak.Call("Generate: token ids", soak.OK, request=request, outcome=soak.OK)
    tokens = [rng.randrange(480) for _ in range(max_tokens)]
    for start in range(0, max_tokens, 3):
        response = pb.GenerateResponse(request_id=request.request_id, token_ids=tokens[start : start + 3], text="x")
        if start + 3 >= max_tokens:
            response.finish_reason = pb.FINISH_REASON_LENGTH
            response.usage.prompt_tokens, response.usage.completion_tokens = 3, max_tokens
        call.absorb(response)
    return call


@pytest.mark.parametrize("seed", range(3))
def test_the_checks_catch_broken_streams(seed):
    rng = random.Random(seed)
    assert soak.stream_problems(ok_stream(rng), {EOS}) == []

    duplicated = ok_stream(rng)
    again = pb.GenerateResponse(request_id=duplicated.request.request_id, finish_reason=pb.FINISH_REASON_STOP)
    duplicated.absorb(again)
    assert "a message after the finish message" in soak.stream_problems(duplicated, {EOS})

    lost = ok_stream(rng)
    lost.token_ids.pop(rng.randrange(len(lost.token_ids)))
    assert any(p.startswith("usage.completion_tokens") for p in soak.stream_problems(lost, {EOS}))

    early_stop = ok_stream(rng)
    early_stop.token_ids[rng.randrange(len(early_stop.token_ids) - 1)] = early_stop.request.stop.stop_token_ids[0]
    assert "a stop token before the last token" in soak.stream_problems(early_stop, {EOS})

    foreign = ok_stream(rng)
    foreign.absorb(pb.GenerateResponse(request_id="another", token_ids=[5]))
    assert "a message for request 'another'" in soak.stream_problems(foreign, {EOS})

    call, reference = ok_stream(rng), ok_stream(rng)
    reference.token_ids, reference.text = list(call.token_ids), list(call.text)
    reference.usage, reference.finish = call.usage, call.finish
    assert soak.same_output(call, reference)
    swapped = list(call.token_ids)
    i = next(i for i in range(len(swapped) - 1) if swapped[i] != swapped[i + 1])
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    reference.token_ids = swapped  # misordered
    assert not soak.same_output(call, reference)


@pytest.mark.parametrize("seed", range(3))
def test_the_memory_trend_separates_a_leak_from_noise(seed):
    rng = random.Random(seed)
    noise = [(t, 600 + rng.gauss(0, 20)) for t in range(0, 1800, 2)]
    leak = [(t, mb + 0.05 * t) for t, mb in noise]  # 180 MB an hour
    slope, error, rise = soak.rss_trend(noise, 1800)
    assert abs(slope) < 3 * error and abs(rise) < 32
    slope, error, rise = soak.rss_trend(leak, 1800)
    assert slope > 3 * error and rise > 32 and abs(slope - 180) < 3 * error
