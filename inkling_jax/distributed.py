"""Multi-host start-up: the processes of a TPU pod slice or a multi-node GPU job join one JAX runtime.

Every process runs the same command. Where the coordinator is, how many processes there are and which
one this is come from flags, else from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID); `--coordinator-address auto` leaves all three to JAX's cluster detection (TPU pods,
SLURM, Open MPI, Kubernetes). With none of them the run is single-process. After start-up
`jax.devices()` lists every process's devices, so meshes span hosts.
"""

from __future__ import annotations

import argparse
import os

import jax

AUTO = "auto"


class DistributedError(ValueError):
    """Multi-host settings that cannot work; the message names the flag or variable."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-host")
    group.add_argument("--coordinator-address", help="HOST:PORT of process 0, or 'auto' to detect the cluster")
    group.add_argument("--num-processes", type=int, help="processes in the run")
    group.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")


def _setting(value: object, variable: str) -> str | None:
    return str(value) if value is not None else os.environ.get(variable)


def _integer(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name} must be an integer, got {value!r}") from None


def initialize(args: argparse.Namespace) -> None:
    """Join the multi-host runtime the flags or environment describe; nothing when they describe none."""
    address = _setting(args.coordinator_address, "JAX_COORDINATOR_ADDRESS")
    processes = _integer(_setting(args.num_processes, "JAX_NUM_PROCESSES"), "--num-processes / JAX_NUM_PROCESSES")
    process = _integer(_setting(args.process_id, "JAX_PROCESS_ID"), "--process-id / JAX_PROCESS_ID")
    if address is None:
        if processes is not None or process is not None:
            raise DistributedError("--num-processes and --process-id need --coordinator-address (HOST:PORT or auto)")
        return
    if address == AUTO:
        jax.distributed.initialize()
        return
    if (processes is None) != (process is None):
        raise DistributedError("give both --num-processes and --process-id, or neither (to detect them)")
    if processes is not None and not (processes >= 1 and 0 <= process < processes):
        raise DistributedError(f"--process-id {process} is not within 0 .. {processes - 1} (--num-processes)")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"--coordinator-address {address!r} is not HOST:PORT")
    jax.distributed.initialize(address, processes, process)
