"""`python -m serving.main`: serve a checkpoint over gRPC.

    python -m serving.main [--checkpoint DIR] [--mesh tp1] [--host 127.0.0.1] [--port 50051]
        [--dtype bfloat16] [--max-num-seqs 8] [--chunk 64] [--max-num-batched-tokens N] [--kv-cache-mib M]
        [--max-model-len N] [--metrics-port P] [--gateway-port P] [--served-model-name NAME]
        [--speculative none|dspark|dspark-greedy] [--load-format auto|dummy] [--compilation-cache DIR|none]
        [--allowed-media-domains HOST ...] [--drain-timeout 30]
        [--coordinator-address HOST:PORT|auto --num-processes N --process-id I]
        [--tls-cert FILE --tls-key FILE] [--auth-token-file FILE]

The port is bound first and answers health checks (NOT_SERVING) while the model loads and every step
shape compiles; health turns SERVING when warm-up is done. SIGTERM or SIGINT drains: health goes
NOT_SERVING, new requests get UNAVAILABLE, in-flight ones finish (up to --drain-timeout seconds, then
they are aborted), and the process exits 0. A second SIGTERM or SIGINT during the drain aborts the
in-flight requests at once (their streams end with finish reason ABORT) and exits with 128 + the signal's
number. Bad flags, config, checkpoint, TLS or token files, or a port in use: one line on stderr, exit 2.

--tls-cert and --tls-key (PEM, the key unencrypted) make the gRPC port and the metrics endpoint serve
TLS; --auth-token-file makes both ask for the token the file holds (clients send `authorization: Bearer
<token>`; grpc.health.v1 and server reflection stay open for load balancers and probes). Serving beyond
loopback (e.g. --host 0.0.0.0) without both logs a warning. Keepalive: `serving.connection`.
Without --checkpoint the embedded synthetic checkpoint (configs/tiny.json, random weights) is served,
written to out/tiny-checkpoint first if it is not there. With --load-format dummy, --checkpoint may be a
config JSON file: random weights are built on the devices from it (no tokenizer: token-id prompts only), or a
directory whose tokenizer then serves text too.

The same port serves SMG's vLLM engine protocol (`serving.vllm_engine`), so the Shepherd Model Gateway finds the
server by itself; --gateway-port also runs the gateway (`serving.gateway`): OpenAI and Anthropic HTTP APIs on
that port, once the model serves. Clients name the model --served-model-name (default: the checkpoint
directory's name).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import jax

from inkling_jax import distributed
from inkling_jax.cache import CacheBudgetError
from inkling_jax.chat import TEMPLATE_FILE
from inkling_jax.checkpoint import CheckpointError
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.cli import argument_parser
from inkling_jax.config import ConfigError
from inkling_jax.distributed import DistributedError
from inkling_jax.model.draft import NoDraftError
from inkling_jax.runtime import compilation_cache
from inkling_jax.runtime.engine import (
    BatchedTokensError,
    add_batched_tokens_argument,
    add_image_arguments,
    add_load_format_argument,
    add_max_model_len_argument,
    add_prefix_cache_arguments,
    engine_options,
    load_engine,
)
from inkling_jax.runtime.images import ImageOptionsError
from inkling_jax.runtime.scheduler import Scheduler
from inkling_jax.score import DTYPES, log_to_stderr
from inkling_jax.sharding import MeshError
from inkling_jax.speculative import SPECULATIVE_MODES, SpeculationError
from inkling_jax.tokenizer import TOKENIZER_FILE, TokenizerError
from serving import gateway
from serving.connection import ConnectionSetupError, exposure_warning, load_tls, read_token
from serving.server import ServeError, serve

log = logging.getLogger("serving")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "tiny.json"
DEFAULT_CHECKPOINT = REPO / "out" / "tiny-checkpoint"
LOAD_ERRORS = (
    ConfigError,
    CheckpointError,
    MeshError,
    CacheBudgetError,
    TokenizerError,
    DistributedError,
    NoDraftError,
    SpeculationError,
    BatchedTokensError,
    ImageOptionsError,
    OSError,
)
# A process-directed signal may land on any thread; its Python handler then runs only when the main thread next
# executes bytecode, which a wait without a timeout never lets it do. The main thread waits in slices this long.
SIGNAL_POLL_SECONDS = 0.2


class ShutdownRequested(Exception):
    """SIGTERM or SIGINT arrived before the server was serving: stop loading and exit."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argument_parser("serving.main", "Serve Inkling 2 over gRPC")
    parser.add_argument(
        "--checkpoint",
        help=f"checkpoint directory, or with --load-format dummy a config JSON file "
        f"(default: the synthetic {DEFAULT_CHECKPOINT})",
    )
    parser.add_argument("--mesh", default="tp1", help="device mesh: tpN or dpMtpN")
    host_help = "address to bind, gRPC and metrics (0.0.0.0 for all: see security below)"
    parser.add_argument("--host", default="127.0.0.1", help=host_help)
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="parameter and activation dtype")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens per slot per step)")
    add_batched_tokens_argument(parser)
    add_max_model_len_argument(parser)
    add_prefix_cache_arguments(parser)
    add_image_arguments(parser)
    parser.add_argument("--kv-cache-mib", type=float, help="memory for the decode state (default: what fits)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics over HTTP(S) on this port")
    parser.add_argument(
        "--gateway-port",
        type=int,
        help="also run the SMG gateway (the gateway extra) on this port: OpenAI and Anthropic HTTP APIs with "
        "Inkling's reasoning and tool-call parsers, in front of this server",
    )
    parser.add_argument(
        "--served-model-name",
        help="the model's name to OpenAI-style clients through the SMG gateway (default: the checkpoint "
        "directory's name)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        metavar="HOST",
        help="the only hosts whose http(s) image URLs the server fetches for the SMG gateway's clients, redirects "
        "included (default: any host the URL names)",
    )
    speculative_help = (
        "DSpark speculative decoding with the checkpoint's draft (dspark-greedy: the draft proposes its argmax); "
        "requests may opt out; outputs follow the model's distribution either way"
    )
    parser.add_argument("--speculative", choices=SPECULATIVE_MODES, default="none", help=speculative_help)
    add_load_format_argument(parser)
    compilation_cache.add_argument(parser)
    drain_help = "seconds to let requests finish on SIGTERM / SIGINT (a second signal aborts them)"
    parser.add_argument("--drain-timeout", type=float, default=30.0, help=drain_help)
    security = parser.add_argument_group(
        "security",
        "the gRPC API and the metrics endpoint take the same certificate and token; grpc.health.v1 and "
        "server reflection stay open, so that load balancers and probes need no token",
    )
    security.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this PEM certificate chain")
    security.add_argument("--tls-key", metavar="FILE", help="the certificate's PEM private key, unencrypted")
    security.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="refuse calls (UNAUTHENTICATED; metrics: 401) that do not send the token this file "
        "holds as 'authorization: Bearer <token>'",
    )
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together: give both or neither")
    if args.gateway_port is not None:
        if args.tls_cert is not None or args.auth_token_file is not None:
            parser.error(
                "--gateway-port runs the gateway over plain loopback gRPC: drop --tls-cert and "
                "--auth-token-file, or run smg yourself"
            )
        if args.checkpoint is not None and not (Path(args.checkpoint) / TOKENIZER_FILE).is_file():
            parser.error(
                f"--gateway-port needs the checkpoint's tokenizer and chat template; {args.checkpoint} has no "
                f"{TOKENIZER_FILE} (for dummy weights: inkling-synthetic --no-weights writes a config's tokenizer)"
            )
        try:
            gateway.check_available()
        except gateway.GatewayError as error:
            parser.error(str(error))
    for name in ("port", "metrics_port", "gateway_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 65536:
            parser.error(f"--{name.replace('_', '-')} must be within 0 .. 65535, got {value}")
    if args.max_num_seqs < 1 or args.chunk < 1:
        parser.error("--max-num-seqs and --chunk must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error(f"--max-model-len must be at least 1, got {args.max_model_len}")
    if args.drain_timeout < 0:
        parser.error("--drain-timeout must not be negative")
    return args


def default_checkpoint() -> Path:
    """The embedded synthetic checkpoint, written (atomically) as `make run` writes it when it is missing or
    predates synthetic tokenizers, chat templates or the current configs/tiny.json (e.g. its DSpark draft)."""
    if not DEFAULT_CONFIG.is_file():
        raise CheckpointError(
            f"no --checkpoint given, and the embedded checkpoint's config {DEFAULT_CONFIG} is missing: it comes with"
            " a clone of the repository, not with an installed package; pass --checkpoint DIR"
        )
    if not _default_is_current():
        log.info("writing the synthetic checkpoint %s from %s", DEFAULT_CHECKPOINT, DEFAULT_CONFIG)
        DEFAULT_CHECKPOINT.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=".tiny-checkpoint-", dir=DEFAULT_CHECKPOINT.parent))
        try:
            write_checkpoint(DEFAULT_CONFIG, partial, experts="mixed")
            shutil.rmtree(DEFAULT_CHECKPOINT, ignore_errors=True)
            os.replace(partial, DEFAULT_CHECKPOINT)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return DEFAULT_CHECKPOINT


def _default_is_current() -> bool:
    if not all((DEFAULT_CHECKPOINT / name).is_file() for name in ("config.json", "tokenizer.json", TEMPLATE_FILE)):
        return False
    written, wanted = (
        json.loads(Path(path).read_text()) for path in (DEFAULT_CHECKPOINT / "config.json", DEFAULT_CONFIG)
    )
    return all(written.get(key) == value for key, value in wanted.items())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_to_stderr()
    _log_serving_to_stderr()
    try:
        tls = load_tls(args.tls_cert, args.tls_key) if args.tls_cert is not None else None
        token = read_token(args.auth_token_file) if args.auth_token_file is not None else None
    except ConnectionSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stopping, ready, forced = threading.Event(), threading.Event(), threading.Event()
    signals: list[int] = []  # the shutdown signals received, in order

    def on_signal(signum: int, frame: object) -> None:
        signals.append(signum)
        if len(signals) == 1:
            log.info("%s: shutting down", signal.Signals(signum).name)
            stopping.set()
            if not ready.is_set():
                raise ShutdownRequested
        elif ready.is_set():
            forced.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server = serve(
            None,
            None,
            args.host,
            args.port,
            args.metrics_port,
            tls,
            token,
            served_model_name=args.served_model_name,
            max_images=args.max_images,
            allowed_media_domains=args.allowed_media_domains,
        )
    except ServeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    log.info("listening on %s:%d (NOT_SERVING until the model is loaded and warmed up)", args.host, server.port)
    if server.metrics_port is not None:
        log.info("metrics on %s://%s:%d/metrics", "https" if tls else "http", args.host, server.metrics_port)
    warning = exposure_warning(args.host, server.port, server.metrics_port, tls is not None, token is not None)
    if warning is not None:
        log.warning(warning)
    scheduler = None
    try:
        distributed.initialize(args)
        cache = compilation_cache.enable(args.compilation_cache)
        if jax.process_count() > 1:  # every process would need the same requests in the same order
            raise DistributedError(
                "serving from several processes is not available yet: serve from one host (tpN over its "
                "devices); pods run batch jobs with python -m inkling_jax.offline"
            )
        checkpoint = args.checkpoint or str(default_checkpoint())
        log.info("loading %s on mesh %s (%s)", checkpoint, args.mesh, args.dtype)
        engine = load_engine(
            checkpoint,
            **engine_options(args),
            load_format=args.load_format,
            executable_cache=compilation_cache.executables(cache),
        )
        scheduler = Scheduler(engine)
        log.info("warming up: compiling every step shape")
        scheduler.warm_up()
        scheduler.start()
        server.attach(engine, scheduler)
        if engine.image_limits is not None and args.allowed_media_domains is None:
            log.warning(
                "images the SMG gateway forwards as http(s) URLs are fetched from any host they name; "
                "--allowed-media-domains limits them"
            )
        ready.set()
    except (ShutdownRequested, *LOAD_ERRORS) as error:
        if scheduler is not None:
            scheduler.stop()
        server.stop()
        if isinstance(error, ShutdownRequested):
            return 0
        print(f"error: {error}", file=sys.stderr)
        return 2
    log.info("SERVING %s on %s:%d", checkpoint, args.host, server.port)
    front = None
    if args.gateway_port is not None:
        command = gateway.gateway_command(args.host, server.port, checkpoint, args.host, args.gateway_port)
        front = gateway.Gateway(command)
        log.info("gateway: OpenAI and Anthropic APIs on http://%s:%d/v1", args.host, args.gateway_port)
    while not stopping.wait(SIGNAL_POLL_SECONDS):
        pass
    log.info("draining: up to %g s for in-flight requests (a second signal aborts them)", args.drain_timeout)
    drain = threading.Thread(target=server.drain, args=(args.drain_timeout,), name="drain", daemon=True)
    drain.start()
    while drain.is_alive() and not forced.wait(SIGNAL_POLL_SECONDS):
        pass
    if forced.is_set():
        second = signals[1]
        log.warning(
            "%s during the drain: exiting now, aborting the requests in flight (%d)",
            signal.Signals(second).name,
            server.servicer.in_flight,
        )
        scheduler.stop()  # every request still in flight ends with finish reason ABORT
        drain.join()  # returns as the scheduler is empty now; the server's loop stays open until it has
        if front is not None:
            front.stop()
        server.stop()
        return 128 + second
    if front is not None:
        front.stop()
    scheduler.stop()
    server.stop()
    log.info("stopped")
    return 0


def _log_serving_to_stderr() -> None:
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


if __name__ == "__main__":
    sys.exit(main())
