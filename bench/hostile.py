"""Hostile requests against a running server, and what they cost everyone else.

    python -m bench.hostile --address HOST:PORT [--streams 4] [--out FILE.md]

While `--streams` ordinary streams decode (token-id prompts, ignore_eos, long max_tokens) and health is polled
every 20 ms, each hostile call is sent in turn: 5 MiB of text to Generate and to Tokenize, 2.2M ids to
Detokenize and to Generate, 200,000 stop strings, 2M stop token ids, and undecodable bytes, from a process of
its own (building and sending a large message holds its process's GIL). Reported for each: its status and how
long it took to be answered, the slowest health answer and the longest gap between two tokens of the ordinary
streams from its sending until a second after its answer (the baseline row: the same with no hostile call).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import string
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc

HEALTH_EVERY_S = 0.02
SETTLE_S = 1.0  # quiet time measured after each hostile call


def random_text(size: int) -> str:
    words = ["".join(random.choices(string.ascii_letters, k=random.randrange(1, 12))) for _ in range(1000)]
    text = " ".join(random.choices(words, k=size // 6 + 1))
    return (text * (size // len(text) + 1))[:size]


CALLS = (
    "baseline (no hostile call)",
    "Generate, 5 MiB of text",
    "Tokenize, 5 MiB of text",
    "Detokenize, 2.2M ids",
    "Generate, 2.2M ids",
    "Generate, 200,000 stop strings",
    "Generate, 2M stop ids",
    "Generate, undecodable bytes",
)


def hostile_call(channel: grpc.Channel, vocab: int, name: str) -> Callable[[], object]:
    """The hostile call `name` (one of CALLS), built and ready to send."""
    stub = pb_grpc.InklingStub(channel)

    def generate(**fields) -> Callable[[], object]:
        message = pb.GenerateRequest(**fields)
        message.stop.max_tokens = message.stop.max_tokens or 4
        return lambda: list(stub.Generate(message, timeout=120))

    ids = [1, 2]
    match CALLS.index(name):
        case 0:
            return lambda: None
        case 1:
            return generate(text=random_text(5 << 20))
        case 2:
            text = random_text(5 << 20)
            return lambda: stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120)
        case 3:
            many = random.choices(range(vocab), k=2_200_000)
            return lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=many), timeout=120)
        case 4:
            return generate(token_ids=pb.TokenIds(ids=random.choices(range(vocab), k=2_200_000)))
        case 5:
            stop = [f"s{i}" for i in range(200_000)]
            return generate(token_ids=pb.TokenIds(ids=ids), stop=pb.StopConditions(max_tokens=4, stop=stop))
        case 6:
            stop = pb.StopConditions(max_tokens=4, stop_token_ids=[3] * 2_000_000)
            return generate(token_ids=pb.TokenIds(ids=ids), stop=stop)
        case _:
            raw = channel.unary_stream("/inkling.v1.Inkling/Generate")
            return lambda: list(raw(bytes([0x12, 4, 0xFF, 0xFE, 0xFD, 0xFC]), timeout=120))


def send(address: str, vocab: int, name: str, ready: multiprocessing.Event) -> tuple[str, float]:
    """In a child process: build the hostile call `name`, signal `ready`, send it; (status, seconds to answer)."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
    call = hostile_call(channel, vocab, name)
    ready.set()
    start = time.perf_counter()
    try:
        call()
        status = "OK"
    except grpc.RpcError as error:
        status = f"{error.code().name}: {error.details()[:60]}"
    return status, time.perf_counter() - start


class Watch:
    """Health polls and ordinary streams in the background; `window()` gives the worst of both since it was last
    called."""

    def __init__(self, channel: grpc.Channel, streams: int, vocab: int):
        self._health = health_pb2_grpc.HealthStub(channel)
        self._stub = pb_grpc.InklingStub(channel)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._worst_health = self._worst_gap = 0.0
        self._vocab = vocab
        self._threads = [threading.Thread(target=self._poll, daemon=True)]
        self._threads += [threading.Thread(target=self._stream, daemon=True) for _ in range(streams)]
        for thread in self._threads:
            thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            self._health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            with self._lock:
                self._worst_health = max(self._worst_health, time.perf_counter() - start)
            time.sleep(HEALTH_EVERY_S)

    def _stream(self) -> None:
        while not self._stop.is_set():
            message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=random.choices(range(self._vocab), k=8)))
            message.stop.max_tokens, message.stop.ignore_eos = 400, True
            last = None
            for response in self._stub.Generate(message, timeout=600):
                now = time.perf_counter()
                if response.token_ids and last is not None:
                    with self._lock:
                        self._worst_gap = max(self._worst_gap, now - last)
                last = now if response.token_ids else last
                if self._stop.is_set():
                    break

    def window(self) -> tuple[float, float]:
        with self._lock:
            worst = self._worst_health, self._worst_gap
            self._worst_health = self._worst_gap = 0.0
        return worst

    def close(self) -> None:
        self._stop.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--out", help="write the table (markdown) here")
    args = parser.parse_args(argv)
    channel = grpc.insecure_channel(args.address)
    info = pb_grpc.InklingStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    vocab = info.unpadded_vocab_size
    watch = Watch(channel, args.streams, vocab)
    time.sleep(2 * SETTLE_S)  # the streams are decoding
    rows = []
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(1) as pool:
        for name in CALLS:
            ready = manager.Event()
            result = pool.apply_async(send, (args.address, vocab, name, ready))
            ready.wait()
            watch.window()
            status, answered = result.get()
            time.sleep(SETTLE_S)
            health, gap = watch.window()
            rows.append(f"| {name} | {status} | {answered * 1e3:.0f} | {health * 1e3:.0f} | {gap * 1e3:.0f} |")
            print(rows[-1], flush=True)
    watch.close()
    table = "\n".join(
        [
            f"Server: {args.address} ({info.checkpoint}, {info.dtype}, mesh {info.mesh}),"
            f" {args.streams} ordinary streams",
            "",
            "| hostile call | status | answered in ms | slowest health ms | longest token gap ms |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    if args.out:
        with open(args.out, "w") as out:
            out.write(table + "\n")


if __name__ == "__main__":
    main()
