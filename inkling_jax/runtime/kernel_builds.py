"""A lowered program's Mosaic GPU kernels built ahead of its compile, many at once.

XLA:GPU builds each distinct Mosaic GPU kernel of a program (its MLIR to PTX, ptxas, a cubin) while it emits the
program's thunks, one kernel after another on the compiling thread: most of a step program's XLA compile. jaxlib
keeps every built kernel for the life of the process, keyed by the hash the lowering stamps on the kernel's custom
call (a digest of the kernel's module), and builds no kernel twice. So each kernel is taken out of the lowered
program as a program of that one custom call (the same attributes, so the same hash) and compiled on a pool of
threads (XLA's compile releases the GIL); the step's own compile then finds every kernel built.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import jax
from jax._src.interpreters import mlir
from jax._src.lib import xla_client
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func

TARGET = "mosaic_gpu_v2"  # the custom call a Mosaic GPU kernel lowers to


def kernel_programs(module: ir.Module) -> dict[bytes, bytes]:
    """Each distinct Mosaic GPU kernel the lowered `module` calls, by its hash: a program (MLIR bytecode) whose
    arguments go straight to that kernel's custom call and whose results are the call's."""
    calls: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == TARGET:
            calls.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    programs = {}
    with module.context, ir.Location.unknown():
        for call in calls:
            key = ir.StringAttr(ir.DictAttr(call.attributes["mhlo.backend_config"])["kernel_hash"]).value_bytes
            if key not in programs:
                programs[key] = _program_of(call)
    return programs


def _program_of(call: ir.Operation) -> bytes:
    program = ir.Module.create()
    with ir.InsertionPoint(program.body):
        main = func.FuncOp("main", ([x.type for x in call.operands], [y.type for y in call.results]))
        main.attributes["sym_visibility"] = ir.StringAttr.get("public")
        entry = main.add_entry_block()
        with ir.InsertionPoint(entry):
            kernel = call.clone()
            for i, argument in enumerate(entry.arguments):
                kernel.operands[i] = argument
            func.ReturnOp(kernel.results)
    return mlir.module_to_bytecode(program)


class KernelBuilder:
    """Builds Mosaic GPU kernels on a pool of threads, each kernel once for the builder's life (two programs that
    share a kernel wait on one build)."""

    def __init__(self, device: jax.Device, workers: int | None = None):
        self.device = device
        self._pool = ThreadPoolExecutor(workers or os.cpu_count() or 1, thread_name_prefix="kernel-build")
        self._builds: dict[bytes, Future] = {}
        self._lock = threading.Lock()

    def build(self, lowered: jax.stages.Lowered) -> int:
        """Build every kernel `lowered` calls that this builder has not, and wait for all it calls; returns how
        many this call started. A kernel that fails to build raises its error here."""
        programs = kernel_programs(lowered.compiler_ir("stablehlo"))
        with self._lock:
            new = {key: program for key, program in programs.items() if key not in self._builds}
            for key, program in new.items():
                self._builds[key] = self._pool.submit(self._compile, program)
            waits = [self._builds[key] for key in programs]
        for build in waits:
            build.result()
        return len(new)

    def _compile(self, program: bytes) -> None:
        backend = self.device.client
        backend.compile_and_load(program, xla_client.DeviceList((self.device,)), xla_client.CompileOptions())
