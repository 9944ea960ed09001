"""A lowered program's Mosaic GPU kernels taken out as programs of one custom call each: one per distinct kernel
hash, each calling its kernel with the same attributes (the same hash, so jaxlib's kernel cache serves the
program's compile) on arguments of the call's types. On a GPU the builder compiles them, once each, and the
program they came from still computes the kernel's result."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from test_attn_res_gpu import EPS, HIDDEN, case

from inkling_jax.runtime.kernel_builds import TARGET, KernelBuilder, kernel_programs
from pallas_kernels.attn_res import attn_res_norm, gpu

CPU = jax.default_backend() == "cpu"


def mixes(a: dict, b: dict) -> list[jax.Array]:
    """The kernel called three times (a's shapes twice, b's once), the first two in a scan (lowered once)."""

    def body(carry: None, x: jax.Array) -> tuple[None, jax.Array]:
        return carry, gpu.attn_res_norm(**{**a, "partial": x}, eps=EPS, out_dtype=jnp.float32)

    _, outs = jax.lax.scan(body, None, jnp.stack([a["partial"], 2 * a["partial"]]))
    again = gpu.attn_res_norm(**a, eps=EPS, out_dtype=jnp.float32)
    return [outs, again, gpu.attn_res_norm(**b, eps=EPS, out_dtype=jnp.float32)]


def operands() -> tuple[dict, dict]:
    return case(1, 3, 1, (5, HIDDEN), jnp.float32), case(2, 2, 3, (4, HIDDEN), jnp.float32)


def kernel_calls(module: ir.Module) -> list[ir.Operation]:
    calls = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "stablehlo.custom_call":
            calls.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return calls


def test_each_distinct_kernel_becomes_a_program_of_its_call():
    a, b = operands()
    lowered = jax.jit(mixes).trace(a, b).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count(f"custom_call @{TARGET}(") == 3
    assert len(set(re.findall(r'kernel_hash = ("(?:[^"\\]|\\.)*")', text))) == 3  # each call a kernel of its own

    programs = kernel_programs(lowered.compiler_ir("stablehlo"))
    assert len(programs) == 3
    originals = {
        ir.StringAttr(ir.DictAttr(call.attributes["mhlo.backend_config"])["kernel_hash"]).value_bytes: call
        for call in kernel_calls(lowered.compiler_ir("stablehlo"))
    }
    for key, program in programs.items():
        with mlir.make_ir_context():
            module = ir.Module.parse(program)
            (call,) = kernel_calls(module)
            original = originals[key]
            for name in ("mhlo.backend_config", "call_target_name", "api_version", "operand_layouts", "result_layouts"):
                assert str(call.attributes[name]) == str(original.attributes[name]), name
            main = module.body.operations[0]
            arguments = [str(argument.type) for argument in main.regions[0].blocks[0].arguments]
            assert arguments == [str(x.type) for x in original.operands]
            assert [str(x.type) for x in call.results] == [str(y.type) for y in original.results]
            assert [str(x) for x in call.operands] == [
                str(argument) for argument in main.regions[0].blocks[0].arguments
            ]


@pytest.mark.skipif(CPU, reason="builds kernels with ptxas: needs a GPU")
def test_builder_builds_each_kernel_once_and_the_program_still_computes():
    a, b = operands()
    lowered = jax.jit(mixes).trace(a, b).lower()
    builder = KernelBuilder(jax.devices()[0], workers=2)
    assert builder.build(lowered) == 3
    assert builder.build(lowered) == 0
    scanned, again, other = lowered.compile()(a, b)
    twice = {**a, "partial": 2 * a["partial"]}
    for out, x in ((scanned[0], a), (scanned[1], twice), (again, a), (other, b)):
        want = attn_res_norm(**x, eps=EPS, out_dtype=jnp.float32, backend="reference")
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
