"""Load generator over gRPC: a concurrency sweep of streamed Generate calls; TTFT, TPOT, tokens/s.

    python -m bench.serve [--address HOST:PORT | --checkpoint DIR [--mesh tp1 --dtype bfloat16 ...]
        [--kv-cache-mib M] [--load-format auto|dummy] [--compilation-cache DIR|none] [--max-num-batched-tokens N]
        [--speculative none|dspark|dspark-greedy] [--no-prefix-cache | --prefix-snapshots N]]
        [--concurrency 1 4 16 64] [--requests-per-level 64] [--prompt-tokens 64] [--max-tokens 32] [--out FILE]
        [--gateway] [--prefill-tiles] [--constraint any-text|json-object]

With --gateway (the gateway extra; an in-process server with a tokenizer) the SMG gateway runs in front of the
server and every level runs twice, over gRPC and through the gateway's OpenAI completions API, with the same
prompts as text (the gateway tokenizes it, the server does over gRPC) and the same seeds; the gateway's level
reports what it adds to TTFT and TPOT. With --prefill-tiles the in-process engine's GPU attention runs prefill
chunks on the kernel's prefill tiles (`invariant=False`), whose rows do not get their decode bits: beside a run
without it, what batch invariance costs. With --constraint every request carries a structured-output constraint
(any-text: a regex every text matches, so that only the masks' work differs from an unconstrained run; json-object:
any JSON object) and stops at the end of sequence instead of ignoring it: beside a run without it, what constrained
decoding costs (the server needs a tokenizer).

Without --address it starts the server in-process on the checkpoint (default: the tiny synthetic one,
written to a temporary directory; with --load-format dummy, --checkpoint may be a config file, default
configs/tiny_text.json, and random weights are built on the devices; --gateway then needs a directory with a
tokenizer, e.g. `inkling-synthetic --config configs/proxy_h200.json --out DIR --no-weights`). Each level keeps
`concurrency` streams open until `requests-per-level` have finished; every request has a fresh random prompt of
`prompt-tokens` token ids and runs to `max-tokens` (ignore_eos), sampled at temperature 1. Reported per level: time
to first token and time per output token (p50 / p90 / p99, ms), output tokens/s (also per device of the server's mesh)
and requests/s over the level.
"""

from __future__ import annotations

import argparse
import functools
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
from inkling_jax.runtime.engine import (
    add_batched_tokens_argument,
    add_load_format_argument,
    add_max_model_len_argument,
    add_prefix_cache_arguments,
)
from inkling_jax.sharding import parse_mesh
from inkling_jax.speculative import SPECULATIVE_MODES
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny_text.json"
WORDS = "the model runs on many chips and every token counts when a request waits for its turn".split()


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
    return {name: round(float(q), 2) for name, q in zip(("p50", "p90", "p99"), qs, strict=True)}


CONSTRAINTS = {"any-text": pb.Constraint(regex="(?s:.*)"), "json-object": pb.Constraint(json_object=True)}


def one_request(
    stub, prompt: list[int] | str, max_tokens: int, seed: int, constraint: pb.Constraint | None = None
) -> tuple[float, float | None, int]:
    """(TTFT, TPOT or None, output tokens) of one streamed call (token ids or text), in seconds."""
    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=1.0, seed=seed),
        stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=constraint is None),
        constraint=constraint,
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
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


def one_completion(client, model: str, prompt: str, max_tokens: int, seed: int) -> tuple[float, float | None, int]:
    """(TTFT, TPOT or None, output tokens) of one streamed OpenAI completion through the gateway, in seconds."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    tpot = (last - first) / (tokens - 1) if tokens > 1 and first is not None else None
    return (first or time.perf_counter()) - start, tpot, tokens


def token_prompts(seed: int, count: int, tokens: int, vocab: int) -> list[list[int]]:
    """`count` random prompts of `tokens` ids below `vocab`."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, tokens).tolist() for _ in range(count)]


def random_text(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, words))


def level(call, concurrency: int, count: int, prompts: list, max_tokens: int, seed: int) -> dict:
    """`count` calls of `call(prompt, max_tokens, seed)`, `concurrency` at a time."""
    results, lock = [], threading.Lock()

    def run(index: int) -> None:
        result = call(prompts[index], max_tokens, seed + index)
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
    if args.prefill_tiles:
        from inkling_jax.model import attention

        attention.ragged_paged_attention = functools.partial(attention.ragged_paged_attention, invariant=False)
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
        kv_cache_mib=args.kv_cache_mib,
        speculative=args.speculative,
        load_format=args.load_format,
        executable_cache=compilation_cache.executables(cache),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_context=args.max_model_len,
        prefix_snapshots=0 if args.no_prefix_cache else args.prefix_snapshots,
    )
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    scheduler.start()
    return serve(scheduler, engine), scheduler, str(checkpoint)


def start_gateway(grpc_port: int, checkpoint: str):
    """SMG in front of the server on `grpc_port`, serving (its process, an OpenAI client of it)."""
    import openai

    from serving.gateway import Gateway, free_port, gateway_command

    port = free_port("127.0.0.1")
    front = Gateway(gateway_command("127.0.0.1", grpc_port, checkpoint, "127.0.0.1", port))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            client.completions.create(model=Path(checkpoint).name, prompt="warm", max_tokens=1)
            return front, client
        except openai.APIError:
            time.sleep(0.5)
    front.stop()
    raise SystemExit("the gateway did not serve the model within 120 s")


def added(direct: dict, gateway: dict) -> dict:
    """What the gateway adds: TTFT and TPOT percentiles (ms), and TPOT's p50 as a share of the direct one."""
    out = {}
    for metric in ("ttft_ms", "tpot_ms"):
        for q in direct[metric]:
            out[f"{metric.removesuffix('_ms')}_{q}"] = round(gateway[metric][q] - direct[metric][q], 2)
    if direct["tpot_ms"]:
        out["tpot_p50_share"] = round(out["tpot_p50"] / direct["tpot_ms"]["p50"], 4)
    return out


def add_server_arguments(parser: argparse.ArgumentParser, *, max_num_seqs: int, chunk: int) -> None:
    """The in-process server's flags (`start_server`), as the benchmarks over gRPC take them."""
    parser.add_argument("--checkpoint", help="in-process server's checkpoint (default: tiny synthetic)")
    add_load_format_argument(parser)
    compilation_cache.add_argument(parser)
    parser.add_argument("--mesh", default="tp1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    parser.add_argument("--chunk", type=int, default=chunk)
    add_batched_tokens_argument(parser)
    add_max_model_len_argument(parser)
    kv_help = "decode state per device (default: every slot's whole context)"
    parser.add_argument("--kv-cache-mib", type=float, help=kv_help)
    parser.add_argument("--speculative", choices=SPECULATIVE_MODES, default="none")
    add_prefix_cache_arguments(parser)
    parser.add_argument("--prefill-tiles", action="store_true", help="the GPU attention's prefill tiles (see above)")


def command_line(module: str, args: argparse.Namespace) -> str:
    """The command that ran `module` with `args` (the flags given, defaults left out)."""
    given = {k: v for k, v in vars(args).items() if v not in (None, False) and k != "out"}
    flags = " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}")
        for k, v in given.items()
    )
    return f"python -m {module} {flags}"


def report(result: dict, out: Path | None) -> None:
    """Print the result as JSON, and write it to `out` if given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running server; default: start one in-process")
    add_server_arguments(parser, max_num_seqs=64, chunk=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-level", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gateway", action="store_true", help="also through the SMG gateway (see above)")
    parser.add_argument("--constraint", choices=sorted(CONSTRAINTS), help="constrain every request (see above)")
    args = parser.parse_args()
    for flag in ("gateway", "prefill_tiles"):
        if getattr(args, flag) and args.address is not None:
            parser.error(f"--{flag.replace('_', '-')} needs the in-process server: drop --address")
    if args.gateway and args.constraint:
        parser.error("--constraint runs over gRPC only: drop --gateway")
    server = scheduler = front = None
    address, checkpoint = args.address, args.checkpoint
    if address is None:
        server, scheduler, checkpoint = start_server(args)
        address = f"127.0.0.1:{server.port}"
    try:
        if args.gateway:
            front, client = start_gateway(server.port, checkpoint)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.InklingStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
            levels = []
            for c in args.concurrency:
                count = max(args.requests_per_level, c)
                if args.gateway:  # text: the gateway tokenizes it (its words are about a token each)
                    rng = np.random.default_rng(1000 * c)
                    prompts = [random_text(rng, args.prompt_tokens) for _ in range(count)]
                else:
                    prompts = token_prompts(1000 * c, count, args.prompt_tokens, info.unpadded_vocab_size)
                direct = functools.partial(one_request, stub, constraint=CONSTRAINTS.get(args.constraint))
                levels.append(level(direct, c, count, prompts, args.max_tokens, seed=1000 * c))
                if args.gateway:
                    through = functools.partial(one_completion, client, Path(checkpoint).name)
                    gateway = level(through, c, count, prompts, args.max_tokens, seed=1000 * c)
                    levels[-1]["gateway"] = gateway | {"added_ms": added(levels[-1], gateway)}
        devices = math.prod(parse_mesh(info.mesh))
        for each in levels:
            each["output_tokens_per_s_per_device"] = round(each["output_tokens_per_s"] / devices, 1)
    finally:
        if front is not None:
            front.stop()
        if server is not None:
            server.stop()
            scheduler.stop()
    result = {
        "command": command_line("bench.serve", args),
        "server": {"checkpoint": checkpoint, "mesh": info.mesh, "dtype": info.dtype, "max_num_seqs": info.max_num_seqs},
        "levels": levels,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
