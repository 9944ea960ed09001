"""The prefix cache over gRPC: time to first token of long prompts that share their beginning, and a multi-turn chat.

    python -m bench.prefix_cache [--checkpoint DIR|CONFIG --load-format dummy ...] [--no-prefix-cache]
        [--prompt-tokens 4096] [--shared-tokens 3584] [--trials 8]
        [--conversations 8] [--turns 8] [--system-tokens 1024] [--turn-tokens 256] [--reply-tokens 128] [--out FILE]

The server runs in-process (bench.serve's flags; chunk 512 by default). Prompts are random token ids.

Shared beginnings: each trial draws a beginning of `shared-tokens` and sends three prompts of `prompt-tokens` that
start with it, one after the other: the first finds nothing cached; the second finds the first's pages but no
state saved where it leaves them (it saves one there); the third resumes there. Reported: time to first token of
each (p50 over the trials, ms), the first's over the third's, and the cached prompt tokens the third reports.

Chat: `conversations` concurrent conversations of `turns` turns; a turn's prompt is the conversation so far (a
system prompt of `system-tokens`, then each turn's `turn-tokens` and its reply) and `turn-tokens` new ones, its
reply `reply-tokens` long (ignore_eos, greedy). Reported: output tokens/s over the benchmark, time to first token
per turn (p50, ms) and the share of prompt tokens taken from the cache.

Run it twice, with and without --no-prefix-cache, for the cache's gain on each.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from bench.serve import add_server_arguments, command_line, report, start_server
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc


def generate(stub, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(time to first token in seconds, output tokens, cached prompt tokens) of one greedy streamed call."""
    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=0.0), stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True)
    )
    request.token_ids.ids.extend(prompt)
    start, first, tokens, cached = time.perf_counter(), None, [], 0
    for response in stub.Generate(request, timeout=600):
        if response.token_ids:
            first = first or time.perf_counter()
            tokens.extend(response.token_ids)
        if response.HasField("usage"):
            cached = response.usage.cached_tokens
    return first - start, tokens, cached


def shared_beginnings(stub, rng: np.random.Generator, vocab: int, args: argparse.Namespace) -> dict:
    """TTFT of the three prompts of each trial that share a beginning (see the module's docstring)."""
    ttft, cached = {"first": [], "second": [], "third": []}, []
    for _ in range(args.trials):
        shared = rng.integers(0, vocab, args.shared_tokens).tolist()
        for name in ttft:
            prompt = shared + rng.integers(0, vocab, args.prompt_tokens - args.shared_tokens).tolist()
            seconds, _, taken = generate(stub, prompt, max_tokens=2)
            ttft[name].append(seconds)
        cached.append(taken)
    p50 = {name: round(statistics.median(values) * 1e3, 2) for name, values in ttft.items()}
    return {
        "ttft_p50_ms": p50,
        "first_over_third": round(p50["first"] / p50["third"], 2),
        "third_cached_tokens": sorted(set(cached)),
    }


def chat(stub, rng: np.random.Generator, vocab: int, args: argparse.Namespace) -> dict:
    """Output tokens/s, TTFT per turn and the cached share of the concurrent conversations (see the docstring)."""
    ttft, prompt_tokens, cached_tokens, output_tokens = [], [], [], []
    lock = threading.Lock()
    beginnings = [rng.integers(0, vocab, args.system_tokens).tolist() for _ in range(args.conversations)]
    turns = [[rng.integers(0, vocab, args.turn_tokens).tolist() for _ in range(args.turns)] for _ in beginnings]

    def converse(history: list[int], messages: list[list[int]]) -> None:
        for message in messages:
            history = history + message
            seconds, reply, cached = generate(stub, history, args.reply_tokens)
            with lock:
                ttft.append(seconds)
                prompt_tokens.append(len(history))
                cached_tokens.append(cached)
                output_tokens.append(len(reply))
            history = history + reply

    threads = [threading.Thread(target=converse, args=pair) for pair in zip(beginnings, turns, strict=True)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return {
        "output_tokens_per_s": round(sum(output_tokens) / elapsed, 1),
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 2),
        "cached_share": round(sum(cached_tokens) / sum(prompt_tokens), 3),
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(parser, max_num_seqs=8, chunk=512)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--shared-tokens", type=int, default=3584)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--reply-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not 0 < args.shared_tokens < args.prompt_tokens:
        parser.error("--shared-tokens must be above 0 and below --prompt-tokens")
    server, scheduler, checkpoint = start_server(args)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InklingStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
            rng = np.random.default_rng(args.seed)
            result = {
                "command": command_line("bench.prefix_cache", args),
                "server": {"checkpoint": checkpoint, "mesh": info.mesh, "max_num_seqs": info.max_num_seqs},
                "shared_beginnings": shared_beginnings(stub, rng, info.unpadded_vocab_size, args),
                "chat": chat(stub, rng, info.unpadded_vocab_size, args),
            }
    finally:
        server.stop()
        scheduler.stop()
    report(result, args.out)


if __name__ == "__main__":
    main()
