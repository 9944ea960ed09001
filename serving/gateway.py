"""The Shepherd Model Gateway (SMG, PyPI `smg`) run beside the server (`serving.main --gateway-port P`): OpenAI
(chat, completions, responses) and Anthropic (messages) HTTP clients in front of this server's vLLM engine
protocol, with SMG's inkling reasoning and tool-call parsers. It starts once the engine serves (so it registers
the worker at once), is restarted if it exits, and stops with the server."""

from __future__ import annotations

import importlib.util
import logging
import socket
import subprocess
import sys
import threading
import time

log = logging.getLogger("serving")

RESTARTS = 3  # a gateway that keeps exiting is given up on (the gRPC server keeps serving)
RESTART_DELAY_SECONDS = 1.0
STOP_SECONDS = 10.0


class GatewayError(RuntimeError):
    """The gateway cannot be run with these options."""


def check_available() -> None:
    if importlib.util.find_spec("smg") is None:
        raise GatewayError("--gateway-port needs the SMG gateway: pip install -e '.[gateway]'")


def free_port(host: str) -> int:
    """A TCP port free on `host` now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def gateway_command(grpc_host: str, grpc_port: int, checkpoint: str, host: str, port: int) -> list[str]:
    """`smg launch` in front of the gRPC server at grpc_host:grpc_port, reading the checkpoint's tokenizer and chat
    template, serving HTTP on host:port (its own metrics on a free port beside it)."""
    worker = "127.0.0.1" if grpc_host in ("0.0.0.0", "::", "") else grpc_host
    worker = f"[{worker}]" if ":" in worker else worker
    return [
        sys.executable, "-m", "smg", "launch",
        "--worker-urls", f"grpc://{worker}:{grpc_port}",
        "--model-path", checkpoint,
        "--reasoning-parser", "inkling",
        "--tool-call-parser", "inkling",
        "--block-size", "128",
        "--host", host,
        "--port", str(port),
        "--prometheus-host", host,
        "--prometheus-port", str(free_port(host)),
        "--log-level", "warn",
    ]  # fmt: skip


class Gateway:
    """The gateway process, restarted (up to RESTARTS times) when it exits on its own."""

    def __init__(self, command: list[str]):
        self.command = command
        self.restarts = 0
        self._stopping = threading.Event()
        self._process = self._start()
        self._watcher = threading.Thread(target=self._watch, name="gateway", daemon=True)
        self._watcher.start()

    def _start(self) -> subprocess.Popen:
        # a session of its own: a terminal's Ctrl-C reaches the server, which drains, then stops the gateway
        return subprocess.Popen(self.command, start_new_session=True)

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def _watch(self) -> None:
        while True:
            code = self._process.wait()
            if self._stopping.is_set():
                return
            if self.restarts == RESTARTS:
                log.error("the gateway exited (status %d) %d times: not restarting it", code, RESTARTS + 1)
                return
            self.restarts += 1
            log.warning("the gateway exited (status %d): restarting it (%d of %d)", code, self.restarts, RESTARTS)
            if self._stopping.wait(RESTART_DELAY_SECONDS):
                return
            self._process = self._start()

    def stop(self) -> None:
        """Stop the gateway (SIGTERM, then SIGKILL after STOP_SECONDS). Idempotent."""
        self._stopping.set()
        process = self._process
        if process.poll() is None:
            process.terminate()
            deadline = time.monotonic() + STOP_SECONDS
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if process.poll() is None:
                process.kill()
                process.wait()
        self._watcher.join(STOP_SECONDS)
        if self._process.poll() is None:  # started by a restart under way as stop began
            self._process.kill()
            self._process.wait()
