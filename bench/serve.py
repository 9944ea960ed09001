"""Load generator over gRPC: a concurrency sweep of streamed Generate calls; TTFT, TPOT, tokens/s.

    python -m bench.serve [--address HOST:PORT | --checkpoint DIR [--mesh tp1 --dtype bfloat16 ...]
        [--load-format auto|dummy] [--compilation-cache DIR|none]]
        [--concurrency 1 4 16 64] [--requests-per-level 64] [--prompt-tokens 64] [--max-tokens 32] [--out FILE]

Without --address it starts the server in-process on the checkpoint (default: the tiny synthetic one,
written to a temporary directory; with --load-format dummy, --checkpoint may be a config file, default
configs/tiny.json, and random weights are built on the devices). Each level keeps `concurrency` streams open until
`requests-per-level` have finished; every request has a fresh random prompt of `prompt-tokens` token
ids and runs to `max-tokens` (ignore_eos), sampled at temperature 1. Reported per level: time to first
token and time per output token (p50 / p90 / p99, ms), output tokens/s (also per device of the server's mesh)
and requests/s over the level.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from inkling_jax.runtime import compilation_cache
from inkling_jax.runtime.engine import add_load_format_argument
from inkling_jax.sharding import parse_mesh
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.json"


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
    return {name: round(float(q), 2) for name, q in zip(("p50", "p90", "p99"), qs, strict=True)}


def one_request(stub, prompt: list[int], max_tokens: int, seed: int) -> tuple[float, float | None, int]:
    """(TTFT, TPOT or None, output tokens) of one streamed call, in seconds."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=1.0, seed=seed),
        stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    first = last = None
    tokens = 0
    for response in stub.Generate(request, timeout=600):
        if response.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += len(response.token_ids)
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return first - start, tpot, tokens


def level(stub, concurrency: int, count: int, prompt_tokens: int, max_tokens: int, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(count)]
    results, lock = [], threading.Lock()

    def run(index: int) -> None:
        result = one_request(stub, prompts[index], max_tokens, seed + index)
        with lock:
            results.append(result)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run, range(count)))
    elapsed = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    return {
        "concurrency": concurrency,
        "requests": count,
        "ttft_ms": percentiles([r[0] for r in results]),
        "tpot_ms": percentiles([r[1] for r in results if r[1] is not None]),
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "requests_per_s": round(count / elapsed, 2),
        "mean_ttft_ms": round(statistics.mean(r[0] for r in results) * 1e3, 2),
    }


def start_server(args: argparse.Namespace):
    """An in-process server on the checkpoint (or a fresh tiny synthetic one); (server, scheduler, info)."""
    from inkling_jax.checkpoint.synthetic import write_checkpoint
    from inkling_jax.runtime.engine import load_engine
    from inkling_jax.runtime.scheduler import Scheduler
    from serving.server import serve

    cache = compilation_cache.enable(args.compilation_cache)
    if args.checkpoint:
        checkpoint = args.checkpoint
    elif args.load_format == "dummy":
        checkpoint = TINY
    else:
        checkpoint = write_checkpoint(TINY, Path(tempfile.mkdtemp()) / "tiny", experts="mixed")
    engine = load_engine(
        str(checkpoint),
        mesh=args.mesh,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        chunk=args.chunk,
        load_format=args.load_format,
        executable_cache=compilation_cache.executables(cache),
    )
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    scheduler.start()
    return serve(scheduler, engine), scheduler, str(checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running server; default: start one in-process")
    parser.add_argument("--checkpoint", help="in-process server's checkpoint (default: tiny synthetic)")
    add_load_format_argument(parser)
    compilation_cache.add_argument(parser)
    parser.add_argument("--mesh", default="tp1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-level", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    server = scheduler = None
    address, checkpoint = args.address, args.checkpoint
    if address is None:
        server, scheduler, checkpoint = start_server(args)
        address = f"127.0.0.1:{server.port}"
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.InklingStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
            levels = [
                level(
                    stub,
                    c,
                    max(args.requests_per_level, c),
                    args.prompt_tokens,
                    args.max_tokens,
                    info.unpadded_vocab_size,
                    seed=1000 * c,
                )
                for c in args.concurrency
            ]
        devices = math.prod(parse_mesh(info.mesh))
        for each in levels:
            each["output_tokens_per_s_per_device"] = round(each["output_tokens_per_s"] / devices, 1)
    finally:
        if server is not None:
            server.stop()
            scheduler.stop()
    given = {k: v for k, v in vars(args).items() if v is not None and k != "out"}
    flags = " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in given.items()
    )
    result = {
        "command": f"python -m bench.serve {flags}",
        "server": {"checkpoint": checkpoint, "mesh": info.mesh, "dtype": info.dtype, "max_num_seqs": info.max_num_seqs},
        "levels": levels,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
