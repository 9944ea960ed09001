"""End to end: the serving runtime on one model, from a cold compile to tokens over gRPC, side by side.

    python -m bench.e2e [--config configs/proxy_h200.json] [--mesh tp1] [--concurrency 1 8 64]
        [--requests-per-level 16] [--prompt-tokens 512] [--max-tokens 128] [--long-prompt-tokens 2048]
        [--long-prompts 4] [--context N] [--max-num-seqs S] [--chunk 64] [--kv-cache-mib M] [--steps 32]
        [--repeats 5] [--bandwidth 4.3e12] [--compilation-cache DIR] [--skip-engine] [--skip-restart]
        [--skip-grpc] [--commit HASH] [--out FILE.json] [--markdown FILE.md]
    python -m bench.e2e --render PART.json [PART.json ...] --markdown FILE.md    # one record from split runs

The model is the config's with random weights built on the devices (`--load-format dummy`), in the engine
`python -m serving.main` builds: `--max-num-seqs` slots (default: the largest concurrency plus the long prompts,
so that those arrive among that many decoding streams), `--chunk`, and a decode state of `--kv-cache-mib` per
device (default: what this run's sequences need and at least one sequence of the model's whole context, which the
server requires of its pool). The phases, each printed as it finishes:

1. engine, in a child process (`--only-engine`; the device's memory is free again for the server after it):
   the weights' build, then every step shape the engine compiles at start-up (`Engine.shapes`), compiled as its
   warm-up does, into an empty compilation cache: per shape the lowering (tracing and lowering to StableHLO) and
   XLA compile seconds, from JAX's compile events. Then the decode step at each `--concurrency` level B: B slots
   prefilled with `--context` tokens (default: a gRPC request's mean, prompt + max_tokens / 2), the other slots
   empty; the engine's loop as the scheduler runs it (`Engine.step`, then `Engine.fetch` of the step before,
   `--steps` steps), wall time per step and, of it, the host's own work (building and dispatching the batch) and
   its time blocked on the device's results; the step's kernels by CUPTI (GPU only); the bytes a step must read per
   device (every parameter but the draft's, read once: the embedding's rows of the B tokens, of the routed experts
   the expected distinct ones E * (1 - (1 - k / E)^B) of each layer as stored, quantized data and scales; per
   sequence its visible K/V and its convolution state) and the time that takes at `--bandwidth` bytes/s.
2. restart: `python -m serving.main` started over the cache phase 1 filled (with --skip-engine and an empty
   cache, after a cold start first): time from process start to health SERVING; the weights' build and the
   warm-up from its log lines, stamped as they arrive; what is left beyond loading; the step programs it loaded
   from the executable cache and those it compiled (its log lines); the cache entries it wrote (0: every program
   came from the cache).
3. gRPC, against that server: `bench.serve.level` per concurrency level (fresh random prompts of
   `--prompt-tokens`, `--max-tokens` each, ignore_eos, temperature 1): time per output token p50 / p99, time to
   first token, output tokens/s.
4. long prompts: max(--concurrency) streams decoding (ignore_eos, cancelled at the end), then `--long-prompts`
   prompts of `--long-prompt-tokens` sent at once: their time to first token (p50, max), and the decoding streams'
   time per output token before and while those prefill.

The closing table puts, per level, the step's roofline, its kernels, the engine loop's wall time and gRPC's time
per token side by side. Parts of it in separate commands (e.g. 10-minute machine calls), on the same machine:
`--skip-restart --skip-grpc --compilation-cache out/e2e-xla --out a.json`, then `--skip-engine
--compilation-cache out/e2e-xla --out b.json`, and `--render a.json b.json --markdown bench/results/e2e_h200.md`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import jax
import numpy as np

from bench.timing import call_kernels_ms
from inkling_jax.cache import PAGE_SIZE, bytes_per_sequence, conv_state_bytes, kv_bytes_per_token, ring_size
from inkling_jax.config import TextConfig, load_config
from inkling_jax.runtime import compilation_cache
from inkling_jax.runtime.engine import Engine, load_engine, pages_for
from inkling_jax.sharding import MODEL

if TYPE_CHECKING:
    from serving.proto import inkling_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
PROXY = REPO / "configs" / "proxy_h200.json"
DTYPE = "bfloat16"  # serving.main's default
RECORD = "E2E "  # the engine child's result lines on stdout: this prefix, then one JSON object
SAMPLED = SimpleNamespace(temperature=1.0)  # the decode steps sample as the gRPC requests do
WARM_STEPS = 3  # decode steps before the timed ones
BASELINE_TOKENS = 16  # tokens each decoding stream gets before the long prompts are sent
SAMPLING_BYTES_PER_TOKEN = 5  # a slot's sampling state per vocabulary entry (int32 counts, bool prompt mask)
START_TIMEOUT_S = 1800.0  # a cold start of the proxy compiles for minutes
# serving.main's log lines that open the phases of its start
LOADING = re.compile(r" loading \S+ on mesh ")
WARMING_UP = re.compile(r" warming up: compiling every step shape")
SERVING = re.compile(r" SERVING \S+ on ")
LISTENING = re.compile(r" listening on (\S+):(\d+) ")
# the engine's line per step program at start-up (`Engine._program`)
STEP_LOADED = re.compile(r"^step \[.*\]: loaded from the executable cache in ")
STEP_COMPILED = re.compile(r"^step \[.*\]: compiled in ")


# --- sizes ---


def state_budget_mib(text: TextConfig, slots: int, chunk: int, tokens: int) -> int:
    """A decode-state budget (MiB per device, enough at any tp) holding `slots` sequences of `tokens` tokens and,
    as serving.main's engine requires of its pool, one of the model's whole context: every slot's fixed state
    (sliding rings, convolution and sampling state) and the full-attention pages, 1% to spare."""
    fixed = bytes_per_sequence(text, ring_size(text, chunk), max_chunk=chunk)
    per_slot = fixed["sliding_window_kv"] + fixed["conv_states"] + SAMPLING_BYTES_PER_TOKEN * text.unpadded_vocab_size
    page = max(bytes_per_sequence(text, PAGE_SIZE, max_chunk=chunk)["full_attention_kv"], 1)
    pages = max(pages_for(text.max_position_embeddings), slots * pages_for(tokens))
    return math.ceil((slots * per_slot + pages * page) * 1.01 / 2**20)


def stream_tokens(args: argparse.Namespace, text: TextConfig) -> int:
    """max_tokens of the long-prompt phase's decoding streams, ample for them to outlast it (they are cancelled at
    its end): four times the scheduler steps all its prompts' prefill takes (at the scheduler's default budget of
    two chunks a step), plus 16 times the baseline for the time the client takes to send the long prompts."""
    prompts = max(args.concurrency) * args.prompt_tokens + args.long_prompts * args.long_prompt_tokens
    steps = -(-prompts // (2 * args.chunk))
    return min(4 * steps + 16 * BASELINE_TOKENS, text.max_position_embeddings - args.prompt_tokens)


def decode_bytes(engine: Engine, batch: int, context: int) -> dict[str, float]:
    """The bytes one device must read for a decode step of `batch` sequences holding `context` tokens each, by
    part: the parameters read whole (the draft's excepted: plain steps never run it), the embedding's rows of the
    batch's tokens, the expected distinct routed experts of every layer as stored (quantized data and scales)
    under uniform routing, and per sequence the K/V its queries see and its convolution state."""
    text = engine.text
    experts, top_k = text.n_routed_experts, text.num_experts_per_tok
    distinct = experts * (1 - (1 - top_k / experts) ** batch)
    parts: dict[str, float] = collections.Counter()
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.params)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        size = leaf.addressable_shards[0].data.nbytes
        if name.startswith("dspark."):
            continue
        if ".mlp.experts." in name:
            parts["routed_experts"] += size * distinct / experts
        elif name.startswith("model.embed_tokens.weight"):
            parts["embedding_rows"] += size * batch / leaf.shape[0]
        else:
            parts["other_parameters"] += size
    tp = engine.mesh.shape[MODEL]
    for layer in range(text.num_hidden_layers):
        sliding = text.is_sliding(layer)
        keys = min(context, text.sliding_window_size) if sliding else context
        parts["kv"] += batch * keys * kv_bytes_per_token(text, sliding, engine.dtype, tp)
    parts["conv_state"] = batch * conv_state_bytes(text, engine.dtype, tp)
    return {**parts, "total": sum(parts.values()), "distinct_experts": distinct}


# --- phase 1: the engine, in a child process ---


def prefill_random(
    engine: Engine, active: np.ndarray, context: int, table: np.ndarray, sampling: list, rng: np.random.Generator
) -> None:
    """Fill each `active` slot with a random prompt of `context` tokens (its last chunk samples a kept token), in
    steps the engine's shapes hold (`max_num_batched_tokens` and lanes a replica); the first step clears every
    slot, so the others stay empty."""
    slots, fed, first = engine.slots, np.zeros(engine.slots, int), True
    while first or (fed[active] < context).any():
        counts = np.zeros(slots, np.int32)
        room = [engine.max_num_batched_tokens] * engine.replicas
        lanes = [engine.lanes] * engine.replicas
        for slot in np.flatnonzero(active & (fed < context)):
            replica = engine.replica_of(slot)
            count = min(engine.chunk, context - fed[slot], room[replica], lanes[replica] * engine.lane_width)
            counts[slot] = count
            room[replica] -= count
            lanes[replica] -= -(-count // engine.lane_width)
        tokens = rng.integers(0, engine.text.unpadded_vocab_size, (slots, max(counts.max(), 1)), dtype=np.int32)
        emit = active & (fed + counts >= context) & (counts > 0)
        reset = np.full(slots, first) | (active & (fed == 0) & (counts > 0))
        engine.fetch(
            engine.step(
                engine.host_batch(tokens, counts, sampling, table, reset=reset, is_prompt=counts > 0, emit=emit)
            )
        )
        fed += counts
        first = False


def decode_step_ms(engine: Engine, batch: int, context: int, steps: int, repeats: int) -> dict[str, float | None]:
    """One decode step of `batch` slots holding `context` tokens, the other slots empty, in ms: `wall`, `steps`
    steps of the engine's loop as the scheduler runs it (a host batch built per step, step N + 1 dispatched
    before step N's tokens are fetched); of that, `host` the host's own work a step (building the batch and
    dispatching it) and `wait` its time blocked on the device's results; `kernels`, CUPTI's sum over one step,
    median of `repeats`, of the engine's own (state-donating) step (None off GPU)."""
    slots = engine.slots
    active = np.arange(slots) < batch
    pages = pages_for(context + WARM_STEPS + steps + repeats + 4)
    if batch * pages > engine.num_pages or pages > engine.max_pages:
        raise ValueError(f"{batch} slots of {context} tokens do not fit the state's {engine.num_pages} pages")
    table = np.zeros((slots, engine.max_pages), np.int32)
    table[:batch, :pages] = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    sampling = [SAMPLED if on else None for on in active]
    prefill_random(engine, active, context, table, sampling, np.random.default_rng(batch))

    def decode() -> object:
        counts = active.astype(np.int32)
        zeros = np.zeros((slots, 1), np.int32)
        return engine.step(engine.host_batch(zeros, counts, sampling, table, feedback=active, emit=active))

    for _ in range(WARM_STEPS):
        engine.fetch(decode())
    host = wait = 0.0
    start, pending = time.perf_counter(), None
    for _ in range(steps):
        begun = time.perf_counter()
        emitted = decode()
        dispatched = time.perf_counter()
        if pending is not None:
            engine.fetch(pending)
        host, wait = host + dispatched - begun, wait + time.perf_counter() - dispatched
        pending = emitted
    engine.fetch(pending)
    times = {
        "wall": (time.perf_counter() - start) / steps * 1e3,
        "host": host / steps * 1e3,
        "wait": wait / steps * 1e3,
        "kernels": None,
    }
    if jax.default_backend() == "gpu":
        times["kernels"] = sum(ms for _, ms in call_kernels_ms(decode, repeats=repeats))
    return times


def devices() -> str:
    """This process's devices, e.g. 'NVIDIA H200 x1 (gpu)'."""
    every = jax.devices()
    return f"{every[0].device_kind} x{len(every)} ({jax.default_backend()})"


def engine_phase(args: argparse.Namespace, record: Callable[[dict], None]) -> None:
    """Phase 1 in this process: build the engine serving.main would, compile its step shapes cold into
    `--compilation-cache` (which must be empty), then time decode steps at each concurrency level; each result
    goes to `record` as it is known."""
    cache = compilation_cache.enable(str(args.compilation_cache))
    record({"section": "device", "device": devices()})
    start = time.perf_counter()
    engine = load_engine(
        str(args.config),
        mesh=args.mesh,
        dtype=DTYPE,
        max_num_seqs=args.max_num_seqs,
        chunk=args.chunk,
        kv_cache_mib=args.kv_cache_mib,
        load_format="dummy",
        executable_cache=compilation_cache.executables(cache),
    )
    record({"section": "load", "seconds": time.perf_counter() - start})
    start = time.perf_counter()
    engine.warm_up()
    record({"section": "warm_up", "seconds": time.perf_counter() - start})
    for shape in engine.shapes:
        record({"section": "compile", "shape": str(shape), **engine.program_times[shape]})
    for batch in sorted(args.concurrency):
        times = decode_step_ms(engine, batch, args.context, args.steps, args.repeats)
        wall, kernels = times["wall"], times["kernels"]
        size = decode_bytes(engine, batch, args.context)
        roofline = size["total"] / args.bandwidth * 1e3
        record({"section": "decode", "batch": batch, "context": args.context, "wall_ms": wall, "kernels_ms": kernels,
                "host_ms": times["host"], "wait_ms": times["wait"],
                "wall_over_kernels": wall / kernels if kernels else None, "bytes": size, "roofline_ms": roofline,
                "roofline_pct_of_kernels": 100 * roofline / kernels if kernels else None,
                "roofline_pct_of_wall": 100 * roofline / wall})  # fmt: skip


def run_engine_child(args: argparse.Namespace, record: Callable[[dict], None]) -> None:
    """Phase 1 in a child process (`--only-engine`), its results recorded as its lines arrive."""
    flags = ["--config", args.config, "--mesh", args.mesh, "--max-num-seqs", args.max_num_seqs, "--chunk",
             args.chunk, "--kv-cache-mib", args.kv_cache_mib, "--context", args.context, "--steps", args.steps,
             "--repeats", args.repeats, "--bandwidth", args.bandwidth, "--compilation-cache",
             args.compilation_cache, "--concurrency", *args.concurrency]  # fmt: skip
    command = [sys.executable, "-m", "bench.e2e", "--only-engine", *map(str, flags)]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True) as child:
        for line in child.stdout:
            if line.startswith(RECORD):
                record(json.loads(line.removeprefix(RECORD)))
            else:
                print(line, end="", flush=True)
    if child.returncode:
        raise RuntimeError(f"the engine phase failed (exit {child.returncode}); its log is above")


# --- phase 2: serving.main's start ---


def cache_entries(directory: Path) -> set[str]:
    """The programs in a compilation cache directory: JAX's entries, and the executable cache's step programs."""
    executables = directory / compilation_cache.EXECUTABLES
    return {path.name for path in directory.glob("*-cache")} | {
        f"{executables.name}/{path.name}" for path in executables.glob("*.exe")
    }


class ServerProcess:
    """`python -m serving.main` on the dummy model in a child process, its log lines stamped as they arrive."""

    def __init__(self, args: argparse.Namespace):
        command = [sys.executable, "-m", "serving.main", "--checkpoint", str(args.config), "--load-format", "dummy",
                   "--mesh", args.mesh, "--dtype", DTYPE, "--max-num-seqs", str(args.max_num_seqs), "--chunk",
                   str(args.chunk), "--kv-cache-mib", str(args.kv_cache_mib), "--compilation-cache",
                   str(args.compilation_cache), "--port", "0", "--drain-timeout", "5"]  # fmt: skip
        self.lines: list[tuple[float, str]] = []  # (seconds since start, line)
        self.start = time.perf_counter()
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.perf_counter() - self.start, line.rstrip()))
            print(f"  server| {line.rstrip()}", file=sys.stderr, flush=True)

    def stamp(self, pattern: re.Pattern) -> float:
        """Seconds from process start to the first log line matching `pattern`."""
        found = [(seconds, line) for seconds, line in self.lines if pattern.search(line)]
        if not found:
            raise RuntimeError(f"serving.main logged no line matching {pattern.pattern!r}")
        return found[0][0]

    def count(self, pattern: re.Pattern) -> int:
        """Log lines matching `pattern` so far."""
        return sum(bool(pattern.search(line)) for _, line in self.lines)

    def wait_serving(self) -> tuple[str, float]:
        """(address, seconds from process start) once health answers SERVING."""
        deadline = time.perf_counter() + START_TIMEOUT_S
        while not (listening := [m for _, line in self.lines if (m := LISTENING.search(line))]):
            self._still_starting(deadline)
        address = "{}:{}".format(*listening[0].groups())
        import grpc  # the server phases' imports: the engine phase runs where no gRPC is installed
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    answer = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return address, time.perf_counter() - self.start
                except grpc.RpcError:
                    pass
                self._still_starting(deadline)

    def _still_starting(self, deadline: float) -> None:
        """Wait a moment; raise if the process has exited or the deadline has passed."""
        if self.process.poll() is not None:
            raise RuntimeError(f"serving.main exited ({self.process.returncode}) before SERVING; its log is above")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"serving.main was not SERVING within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (serving.main drains and exits), then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(args: argparse.Namespace) -> tuple[ServerProcess, str, dict]:
    """Start serving.main over the cache; (server, address, its start's timings)."""
    before = cache_entries(args.compilation_cache)
    server = ServerProcess(args)
    try:
        address, serving = server.wait_serving()
    except BaseException:
        server.stop()
        raise
    loading, warming_up = server.stamp(LOADING), server.stamp(WARMING_UP)
    load = warming_up - loading
    written = cache_entries(args.compilation_cache) - before
    timings = {
        "to_serving_s": serving,
        "before_load_s": loading,
        "load_s": load,
        "warm_up_s": server.stamp(SERVING) - warming_up,
        "beyond_load_s": serving - load,
        "cache_entries_before": len(before),
        "cache_entries_written": len(written),
        "steps_loaded": server.count(STEP_LOADED),
        "steps_compiled": server.count(STEP_COMPILED),
    }
    return server, address, timings


# --- phases 3 and 4: gRPC ---


def _wait_until(done: Callable[[], bool], workers: list[Future], timeout: float) -> float:
    """perf_counter() once `done()` holds; a worker's failure is raised, and so is a timeout."""
    deadline = time.perf_counter() + timeout
    while not done():
        for worker in workers:
            if worker.done() and worker.exception() is not None:
                raise worker.exception()
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the decoding streams did not get there within {timeout:.0f} s")
        time.sleep(0.005)
    return time.perf_counter()


def _gaps(arrivals: list[list[tuple[float, int]]], start: float, end: float) -> list[float]:
    """Seconds per token between consecutive messages of each stream, for the messages arriving in (start, end]."""
    pairs = (pair for stream in arrivals for pair in itertools.pairwise(stream))
    return [(b - a) / tokens for (a, _), (b, tokens) in pairs if start < b <= end]


def long_prompts(stub: pb_grpc.InklingStub, args: argparse.Namespace, vocab: int, text: TextConfig) -> dict:
    """Phase 4: max(--concurrency) streams decoding, then --long-prompts prompts of --long-prompt-tokens sent at
    once; their time to first token and the streams' time per output token before and while they prefill."""
    import grpc

    from bench.serve import one_request, percentiles
    from serving.proto import inkling_pb2 as pb

    streams, rng = max(args.concurrency), np.random.default_rng(2048)
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(streams)]
    budget = stream_tokens(args, text)

    def follow(index: int, call: Iterator[pb.GenerateResponse]) -> None:
        try:
            for response in call:
                if response.token_ids:
                    arrivals[index].append((time.perf_counter(), len(response.token_ids)))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                raise

    calls = []
    with ThreadPoolExecutor(streams) as pool:
        workers = []
        try:
            for index in range(streams):
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=rng.integers(0, vocab, args.prompt_tokens).tolist()),
                    sampling=pb.SamplingParams(temperature=1.0, seed=index),
                    stop=pb.StopConditions(max_tokens=budget, ignore_eos=True),
                )
                calls.append(stub.Generate(request, timeout=START_TIMEOUT_S))
                workers.append(pool.submit(follow, index, calls[-1]))
            decoding = _wait_until(lambda: all(arrivals), workers, START_TIMEOUT_S)
            sent = _wait_until(lambda: all(len(a) > BASELINE_TOKENS for a in arrivals), workers, START_TIMEOUT_S)
            prompts = [rng.integers(0, vocab, args.long_prompt_tokens).tolist() for _ in range(args.long_prompts)]
            with ThreadPoolExecutor(args.long_prompts) as senders:
                firsts = list(senders.map(lambda i: one_request(stub, prompts[i], 1, seed=i)[0], range(len(prompts))))
            done = time.perf_counter()
        finally:
            for call in calls:
                call.cancel()
    for worker in workers:
        worker.result()
    during = _gaps(arrivals, sent, done)
    return {
        "streams": streams,
        "prompts": args.long_prompts,
        "prompt_tokens": args.long_prompt_tokens,
        "ttft_ms": {"p50": percentiles(firsts)["p50"], "max": round(max(firsts) * 1e3, 2)},
        "stream_tpot_ms_before": percentiles(_gaps(arrivals, decoding, sent)),
        "stream_tpot_ms_during": {**percentiles(during), "max": round(max(during, default=0.0) * 1e3, 2)},
        "streams_ended_early": sum(sum(n for _, n in a) >= budget and a[-1][0] < done for a in arrivals),
    }


# --- the record ---


def _number(value: float | None, digits: int = 2, missing: str = "n/a") -> str:
    return missing if value is None else f"{value:.{digits}f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table, its columns aligned."""
    cells = [headers, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |" for row in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)


def _kernels(result: dict, ms: float | None) -> str:
    """A kernel time, or why there is none."""
    return _number(ms, 3, "n/a" if "(gpu)" in result.get("device", "") else "n/a (no GPU)")


def compile_section(result: dict) -> str:
    keys = ("lower_s", "kernels_s", "compile_s", "first_run_s")
    shapes = result["compile"]
    rows = [[s["shape"]] + [_number(s.get(key), 1) for key in keys] for s in shapes]
    warm_up = _number(result["warm_up"]["seconds"], 1)
    rows.append(["warm-up, wall (lowered in turn, compiled at once, then each run)", "", "", "", warm_up])
    head = f"## Cold compile of every step shape (empty cache; weights built in {result['load']['seconds']:.1f} s)"
    return (
        head
        + "\n\n"
        + _table(["step shape (per replica)", "lower s", "kernels built s", "XLA compile s", "first run s"], rows)
    )


def start_section(title: str, start: dict) -> str:
    rows = [
        ["process start -> health SERVING", _number(start["to_serving_s"], 1)],
        ["  of which before loading (imports, JAX, port)", _number(start["before_load_s"], 1)],
        ["  of which the weights' build (load)", _number(start["load_s"], 1)],
        ["  of which warm-up (every step shape)", _number(start["warm_up_s"], 1)],
        ["beyond loading (SERVING - load)", _number(start["beyond_load_s"], 1)],
        ["step programs loaded from the executable cache", str(start.get("steps_loaded", "n/a"))],
        ["step programs compiled", str(start.get("steps_compiled", "n/a"))],
        ["compilation cache: entries before", str(start["cache_entries_before"])],
        ["compilation cache: entries written", str(start["cache_entries_written"])],
    ]
    return f"## {title}\n\n" + _table(["serving.main", "s"], rows)


def decode_section(result: dict) -> str:
    rows = []
    for d in result["decode"]:
        size = d["bytes"]
        rows.append(
            [
                str(d["batch"]),
                _kernels(result, d["kernels_ms"]),
                _number(d["wall_ms"], 3),
                _number(d.get("host_ms"), 3),
                _number(d.get("wait_ms"), 3),
                _number(d["wall_over_kernels"]),
                _number(size["total"] / 1e9, 3),
                _number(size["total"] / d["batch"] / 1e9, 4),
                _number(size["distinct_experts"], 1),
                _number(d["roofline_ms"], 3),
                _number(d["roofline_pct_of_kernels"], 1),
                _number(d["roofline_pct_of_wall"], 1),
            ]
        )
    headers = ["batch", "kernels ms", "engine loop wall ms", "of which host ms", "of which waiting ms",
               "wall / kernels", "GB a step reads", "GB a token reads",
               "experts a layer", "roofline ms", "% of roofline (kernels)", "% of roofline (wall)"]  # fmt: skip
    last = result["decode"][-1]
    parts = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in last["bytes"].items() if k not in ("total", "distinct_experts"))
    return (
        f"## Decode step, {last['context']} tokens a sequence; roofline: the bytes at "
        f"{result['setup']['bandwidth'] / 1e12:.2f} TB/s per device\n\n{_table(headers, rows)}\n\n"
        f"GB at batch {last['batch']}: {parts}. Kernels ms: the sum of the step's kernel durations (CUPTI); kernels "
        "that run side by side overlap in it, so a step's wall can be below it."
    )


def grpc_section(result: dict) -> str:
    rows = []
    for g in result["grpc"]:
        tpot, ttft = g["tpot_ms"], g["ttft_ms"]
        rows.append(
            [
                str(g["concurrency"]),
                str(g["requests"]),
                _number(tpot.get("p50")),
                _number(tpot.get("p99")),
                _number(ttft.get("p50")),
                _number(ttft.get("p99")),
                _number(g["output_tokens_per_s"], 1),
            ]
        )
    setup = result["setup"]
    head = f"## gRPC: {setup['prompt_tokens']}-token prompts, {setup['max_tokens']} output tokens each"
    headers = ["concurrency", "requests", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 ms", "TTFT p99 ms", "output tokens/s"]
    return head + "\n\n" + _table(headers, rows)


def long_section(result: dict) -> str:
    long = result["long_prompts"]
    ttft, before, during = long["ttft_ms"], long["stream_tpot_ms_before"], long["stream_tpot_ms_during"]
    rows = [
        [f"TTFT of the {long['prompt_tokens']}-token prompts", _number(ttft["p50"]), "", _number(ttft["max"])],
        ["decoding streams' TPOT before them", _number(before.get("p50")), _number(before.get("p99")), ""],
        ["decoding streams' TPOT while they prefill", *(_number(during.get(key)) for key in ("p50", "p99", "max"))],
    ]
    return (
        f"## {long['prompts']} prompts of {long['prompt_tokens']} tokens among {long['streams']} decoding streams\n\n"
        f"{_table(['', 'p50 ms', 'p99 ms', 'max ms'], rows)}\n\n"
        f"Streams that ended before the prompts' first tokens: {long['streams_ended_early']}."
    )


def side_by_side(result: dict) -> str:
    decode = {d["batch"]: d for d in result.get("decode", [])}
    served = {g["concurrency"]: g for g in result.get("grpc", [])}
    rows = []
    for batch in sorted(decode.keys() | served.keys()):
        step, tpot = decode.get(batch), served.get(batch, {}).get("tpot_ms", {})
        roofline = step["roofline_ms"] if step else None
        rows.append(
            [
                str(batch),
                _number(roofline, 3),
                _kernels(result, step["kernels_ms"]) if step else "n/a",
                _number(step["wall_ms"] if step else None, 3),
                _number(tpot.get("p50")),
                _number(tpot.get("p99")),
                _number(served.get(batch, {}).get("output_tokens_per_s"), 1),
                _number(100 * roofline / tpot["p50"] if roofline and tpot.get("p50") else None, 1),
            ]
        )
    headers = [
        "batch = concurrency",
        "roofline ms",
        "kernels ms",
        "engine loop ms",
        "gRPC TPOT p50 ms",
        "gRPC TPOT p99 ms",
        "gRPC output tokens/s",
        "% of roofline (gRPC p50)",
    ]
    title = "## Side by side: a decode step from the bytes it must read to a token over gRPC"
    return f"{title}\n\n{_table(headers, rows)}"


def markdown(result: dict) -> str:
    """The whole record as markdown: command, machine and commit, then every section the run has."""
    setup = result["setup"]
    lines = [
        "# bench.e2e: the serving runtime end to end",
        "",
        f"Command: `{setup['command']}`  ",
        f"Machine: {result.get('device', 'unknown')}  ",
        f"Commit: {setup['commit']}  ",
        f"Model: {setup['config']} (dummy weights, {DTYPE}), mesh {setup['mesh']}, {setup['max_num_seqs']} slots, "
        f"chunk {setup['chunk']}, decode state {setup['kv_cache_mib']} MiB per device",
    ]
    sections = {
        "compile": compile_section,
        "decode": decode_section,
        "cold_start": lambda r: start_section("Cold start (empty cache)", r["cold_start"]),
        "restart": lambda r: start_section("Restart over the filled cache", r["restart"]),
        "grpc": grpc_section,
        "long_prompts": long_section,
    }
    lines += [f"\n{render(result)}" for key, render in sections.items() if key in result]
    if "decode" in result or "grpc" in result:
        lines.append(f"\n{side_by_side(result)}")
    return "\n".join(lines) + "\n"


def commit() -> str:
    """`git rev-parse --short HEAD`, marked +dirty when tracked files differ from it; 'unknown' outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# --- the run ---


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=PROXY)
    parser.add_argument("--mesh", default="tp1")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 64],
        help="gRPC concurrency levels, and the decode batches the engine phase measures",
    )
    parser.add_argument("--requests-per-level", type=int, default=16, help="at least the level's concurrency")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--long-prompt-tokens", type=int, default=2048)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument(
        "--context",
        type=int,
        help="tokens per sequence in the timed decode steps "
        "(default: prompt-tokens + max-tokens / 2, a gRPC request's mean)",
    )
    parser.add_argument("--max-num-seqs", type=int, help="the engine's slots (default: max concurrency + long prompts)")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--kv-cache-mib", type=int, help="decode state per device (default: what this run needs)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps of the engine loop")
    parser.add_argument("--repeats", type=int, default=5, help="CUPTI runs of a decode step")
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s per device (H200: measured copy)")
    parser.add_argument(
        "--compilation-cache",
        type=Path,
        help="JAX's compilation cache for the run: empty unless --skip-engine (default: a fresh temporary directory)",
    )
    parser.add_argument("--skip-engine", action="store_true", help="no compile, decode step or bytes phase")
    parser.add_argument("--skip-restart", action="store_true", help="no timed server start (gRPC still starts one)")
    parser.add_argument("--skip-grpc", action="store_true", help="no gRPC or long-prompt phase")
    parser.add_argument("--commit", help="the code's commit, for a copy of the tree without git (default: git's)")
    parser.add_argument("--out", type=Path, help="the results as JSON (rewritten as each one comes)")
    parser.add_argument("--markdown", type=Path, help="the results as markdown, e.g. bench/results/e2e_h200.md")
    parser.add_argument("--render", type=Path, nargs="+", help="measure nothing: merge these runs' JSON files")
    parser.add_argument(
        "--only-engine",
        action="store_true",
        help="phase 1 here, results as JSON lines (what a full run starts as its child process)",
    )
    args = parser.parse_args(argv)
    if args.render or args.only_engine:  # the engine child is given every size
        return args
    text = load_config(args.config).text
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency) + args.long_prompts
    args.context = args.context or args.prompt_tokens + args.max_tokens // 2
    if min(args.concurrency) < 1 or max(args.concurrency) + args.long_prompts > args.max_num_seqs:
        parser.error(f"--concurrency must be 1 .. --max-num-seqs ({args.max_num_seqs}) - --long-prompts")
    tokens = max(
        args.context + WARM_STEPS + args.steps + args.repeats + 4,
        args.long_prompt_tokens + 1,
        args.prompt_tokens + max(args.max_tokens, stream_tokens(args, text)),
    )
    if tokens > text.max_position_embeddings:
        parser.error(f"a sequence needs {tokens} tokens; the model's context is {text.max_position_embeddings}")
    args.kv_cache_mib = args.kv_cache_mib or state_budget_mib(text, args.max_num_seqs, args.chunk, tokens)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render:
        result: dict = {}
        for part in args.render:
            loaded = json.loads(part.read_text())
            command = " ; ".join(filter(None, (result.get("setup", {}).get("command"), loaded["setup"]["command"])))
            result |= loaded
            result["setup"] = {**loaded["setup"], "command": command}
        text = markdown(result)
        print(text, end="", flush=True)
        if args.markdown:
            args.markdown.write_text(text)
        return
    if args.only_engine:
        engine_phase(args, lambda record: print(RECORD + json.dumps(record), flush=True))
        return
    given = sys.argv[1:] if argv is None else argv
    temporary = None
    if args.compilation_cache is None:
        temporary = tempfile.TemporaryDirectory(prefix="e2e-xla-")
        args.compilation_cache = Path(temporary.name)
    args.compilation_cache.mkdir(parents=True, exist_ok=True)
    if not args.skip_engine and cache_entries(args.compilation_cache):
        sys.exit(
            f"error: {args.compilation_cache} holds compiled programs: the engine phase's compile would not be "
            "cold (give an empty directory, or --skip-engine)"
        )
    result: dict = {
        "setup": {
            "command": " ".join(["python -m bench.e2e", *given]), "commit": args.commit or commit(),
            "config": str(args.config),
            **{key: getattr(args, key) for key in ("mesh", "max_num_seqs", "chunk", "kv_cache_mib", "context",
                                                   "prompt_tokens", "max_tokens", "requests_per_level",
                                                   "long_prompt_tokens", "long_prompts", "bandwidth")},
        },
    }  # fmt: skip

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    def say(line: str) -> None:
        print(line, flush=True)

    def record(item: dict) -> None:
        section = item.pop("section")
        if section in ("compile", "decode"):
            result.setdefault(section, []).append(item)
        elif section == "device":
            result["device"] = item["device"]
        else:
            result[section] = item
        save()
        if section == "compile":
            say(
                f"compile {item['shape']}: lower {item.get('lower_s', 0):.1f} s, "
                f"kernels {item.get('kernels_s', 0):.1f} s, "
                f"XLA {item.get('compile_s', 0):.1f} s, "
                f"first run {item.get('first_run_s', 0):.1f} s"
            )
        elif section == "decode":
            kernels = _kernels(result, item["kernels_ms"]) + " ms" * (item["kernels_ms"] is not None)
            say(
                f"decode batch {item['batch']}: wall {item['wall_ms']:.3f} ms (host {item['host_ms']:.3f}, waiting "
                f"{item['wait_ms']:.3f}), kernels {kernels}, "
                f"roofline {item['roofline_ms']:.3f} ms"
            )
        elif section == "load":
            say(f"weights built in {item['seconds']:.1f} s")
        elif section == "warm_up":
            say(f"warm-up (every step shape compiled and run once) in {item['seconds']:.1f} s")

    say(
        f"bench.e2e: {args.config} mesh {args.mesh}, {args.max_num_seqs} slots, chunk {args.chunk}, decode state "
        f"{args.kv_cache_mib} MiB, cache {args.compilation_cache}, commit {result['setup']['commit']}"
    )
    try:
        if not args.skip_engine:
            run_engine_child(args, record)
            say("\n" + compile_section(result) + "\n\n" + decode_section(result) + "\n")
        if not (args.skip_restart and args.skip_grpc):
            server_phases(args, result, save, say)
    finally:
        if "device" not in result:
            result["device"] = devices()  # every child has exited: the devices are free
        save()
        if args.markdown:
            args.markdown.write_text(markdown(result))
        if temporary is not None:
            temporary.cleanup()
    if "decode" in result or "grpc" in result:
        say("\n" + side_by_side(result))


def server_phases(args: argparse.Namespace, result: dict, save: Callable[[], None], say: Callable[[str], None]) -> None:
    """Phases 2 to 4 into `result`: serving.main's start over the cache (after a cold one if the cache is empty and
    the restart is timed), then the gRPC levels and the long prompts against it."""
    if not args.skip_restart and not cache_entries(args.compilation_cache):
        server, _, result["cold_start"] = start_server(args)
        server.stop()
        save()
        say("\n" + start_section("Cold start (empty cache)", result["cold_start"]) + "\n")
    server, address, started = start_server(args)
    try:
        if not args.skip_restart:
            result["restart"] = started
            save()
            say("\n" + start_section("Restart over the filled cache", started) + "\n")
        if args.skip_grpc:
            return
        import grpc

        from bench.serve import level, one_request, token_prompts
        from serving.proto import inkling_pb2 as pb
        from serving.proto import inkling_pb2_grpc as pb_grpc

        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.InklingStub(channel)
            vocab = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).unpadded_vocab_size
            for concurrency in args.concurrency:
                count = max(args.requests_per_level, concurrency)
                prompts = token_prompts(1000 * concurrency, count, args.prompt_tokens, vocab)
                call = functools.partial(one_request, stub)
                served = level(call, concurrency, count, prompts, args.max_tokens, 1000 * concurrency)
                result.setdefault("grpc", []).append(served)
                save()
                say(
                    f"gRPC concurrency {concurrency}: TPOT p50 {served['tpot_ms'].get('p50')} ms, p99 "
                    f"{served['tpot_ms'].get('p99')} ms, {served['output_tokens_per_s']} output tokens/s"
                )
            say("\n" + grpc_section(result) + "\n")
            result["long_prompts"] = long_prompts(stub, args, vocab, load_config(args.config).text)
            save()
            say("\n" + long_section(result) + "\n")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
