"""What a multiprocessor of the Mosaic GPU expert kernels can do with no memory traffic: the ceilings their
measured rates are read against.

- `wgmma`: each CTA's compute warpgroups multiply a [64, 64] bf16 weight block (registers, "RS", as the kernels
  do; or SMEM, "SS") by a [64, N] SMEM activation block (`gpu_work.WGMMA_K`), one wgmma left in flight, ITERS x 2
  blocks per warpgroup.
- `body`: the kernels' pipeline step itself (`gpu_work.multiply_step`: decode of the stage's weight rows, then
  wgmma) over SMEM stage buffers that never change: 3 compute warpgroups of 64 weight rows, `tm` activation rows,
  K steps of `kc`; no TMA, no pipeline, no epilogue.
- `stream`: the other side, the kernels' stage streaming with no compute: each CTA's pipeline (one TMA warpgroup, 3
  compute warpgroups that release each stage at once) over ITEMS items of an expert's column tile of 192 rows and
  K = 4608 in steps of 128 (the weight rows and their scales, `tm` activation rows, or both, in the kernels' block
  shapes and swizzles), the experts' weights in HBM (one expert per CTA: 2.8 GB MXFP8), the activations
  L2-resident.

One CTA per multiprocessor; TFLOP/s (or TB/s) over all of them (the buffers are never written: the values are
whatever SMEM held, the time is not).

    python -m bench.moe_ceilings [--wgmma-wgs 3 2] [--wgmma-n 64 96 128 192 256] [--body-formats plain mxfp8 nvfp4]
                                 [--body-tm 96 128] [--body-kc 128 256] [--stream-formats mxfp8 nvfp4]
                                 [--stream-tm 112] [--stream-operands weights activations both]

Off the GPU the kernels run once in Mosaic GPU's interpreter (a check that they build; SS wgmma only, 2 CTAs, small
streams).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.timing import kernels_ms
from pallas_kernels import devices
from pallas_kernels.moe import gpu_work as work
from pallas_kernels.moe.gpu_decode import LANES, TABLE_ENTRIES
from pallas_kernels.quantized import MXFP8, NVFP4

WGS = 3  # the kernels' compute warpgroups
DATA = {"plain": jnp.bfloat16, MXFP8: jnp.uint32, NVFP4: jnp.uint32}  # a stage's weight items
SCALES = {MXFP8: jnp.uint8, NVFP4: jnp.uint32}
ITEMS, STREAM_K = 70, 4608  # `stream`: items per CTA (prefill's gate_up at 4096 tokens: ~9.2K over 132 CTAs), K


def _kernel(body, wgs: int, n: int, scratch: list, interpret: bool):
    """A kernel of one CTA per multiprocessor and `wgs` warpgroups; body(out_smem, *scratch) leaves each
    warpgroup's [64, n] fp32 products, stored as [n, 64] bf16 per (CTA, warpgroup)."""
    ctas = 2 if interpret else devices.gpu().multiprocessors

    def kernel(out_gmem, o_smem, *refs):
        wg = lax.axis_index("wg")
        acc = pl.run_scoped(lambda acc_ref: body(wg, acc_ref, *refs)[...], plgpu.ACC((LANES, n), jnp.float32))
        acc = plgpu.layout_cast(acc.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
        o_smem.at[wg].transpose((1, 0))[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[lax.axis_index("sm"), wg])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((ctas, wgs, n, LANES), jnp.bfloat16),
        grid=(ctas,),
        grid_names=("sm",),
        num_threads=wgs,
        thread_name="wg",
        scratch_types=[plgpu.SMEM((wgs, n, LANES), jnp.bfloat16), *scratch],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def wgmma_kernel(n: int, registers: bool, wgs: int, iters: int, interpret: bool):
    """wgmma alone: [64, 64] weights (registers or SMEM) x [64, n] activations, `iters` x 2 blocks per warpgroup."""

    def body(wg, acc_ref, a_smem, b_smem):
        @pl.loop(0, iters)
        def _(i):
            for j in range(128 // work.WGMMA_K):
                cols = pl.ds(j * work.WGMMA_K, work.WGMMA_K)
                a = a_smem.at[wg, :, cols]
                if registers:
                    a = plgpu.load(a, layout=plgpu.Layout.WGMMA)
                plgpu.wgmma(acc_ref, a, b_smem.at[:, cols].transpose((1, 0)))
                plgpu.wgmma_wait(0 if interpret else 1)

        return acc_ref

    scratch = [
        plgpu.SMEM((wgs, LANES, 128), jnp.bfloat16, transforms=work.X_TRANSFORMS),
        plgpu.SMEM((n, 128), jnp.bfloat16, transforms=work.X_TRANSFORMS),
    ]
    return _kernel(body, wgs, n, scratch, interpret)


def body_kernel(fmt: str, tm: int, kc: int, iters: int, interpret: bool):
    """`iters` pipeline steps of the expert kernels' compute warpgroups on fixed stage buffers."""
    rows, item = WGS * LANES, jnp.dtype(DATA[fmt]).itemsize
    tabled = fmt == NVFP4 and not interpret

    def body(wg, acc_ref, data_smem, x_smem, *refs):
        refs = list(refs)
        scale_refs = [refs.pop(0) for _ in range({"plain": 0, MXFP8: 1, NVFP4: 2}[fmt])]
        tables = refs.pop(0) if tabled else None
        a_smem = refs.pop(0) if interpret else None
        mma = work.multiply_step(fmt, kc, item, wg, tables, a_smem, interpret)

        @pl.loop(0, iters)
        def _(i):
            mma(i, data_smem, x_smem, scale_refs, acc_ref)

        return acc_ref

    scratch = [
        plgpu.SMEM(
            (rows, kc // work.VALUES_PER_ITEM[fmt]), DATA[fmt], transforms=work.weight_transforms(fmt, kc, item)
        ),
        plgpu.SMEM((tm, kc), jnp.bfloat16, transforms=work.X_TRANSFORMS),
    ]
    if fmt != "plain":
        scratch.append(plgpu.SMEM((kc // work.BLOCK[fmt], rows), SCALES[fmt]))
    if fmt == NVFP4:
        scratch.append(plgpu.SMEM((1, rows), jnp.float32))
    if tabled:
        scratch.append(plgpu.SMEM((WGS, TABLE_ENTRIES, 4), jnp.uint32))
    if interpret:
        scratch.append(plgpu.SMEM((WGS, LANES, work.WGMMA_K), jnp.bfloat16, transforms=work.X_TRANSFORMS))
    return _kernel(body, WGS, tm, scratch, interpret)


def stream_kernel(fmt: str, tm: int, operands: str, interpret: bool):
    """The kernels' stage streaming alone: (weights [E, N, K / items], scales [E, K / block, N], x [R, K]) -> an
    unwritten output; CTA c's item i streams expert c's column tile (c + i) % 24 and activation rows (c + i) % 36
    (NVFP4's per-step copy of the tile's global scales, 768 bytes, left out)."""
    ctas = 2 if interpret else devices.gpu().multiprocessors
    rows, kc = WGS * LANES, 128
    items, steps = (2, 3) if interpret else (ITEMS, STREAM_K // kc)
    item = jnp.dtype(DATA[fmt]).itemsize

    def kernel(w_gmem, s_gmem, x_gmem, out_gmem):
        c = lax.axis_index("sm")
        e = c % w_gmem.shape[0]
        weight_specs = [
            plgpu.BlockSpec(
                (rows, kc // work.VALUES_PER_ITEM[fmt]),
                lambda i, kk: ((c + i) % 24, kk),
                transforms=work.weight_transforms(fmt, kc, item),
            ),
            plgpu.BlockSpec((kc // work.BLOCK[fmt], rows), lambda i, kk: (kk, (c + i) % 24)),
        ]
        x_spec = plgpu.BlockSpec((tm, kc), lambda i, kk: ((c + i) % 36, kk), transforms=work.X_TRANSFORMS)
        specs = {"weights": weight_specs, "activations": [x_spec], "both": [*weight_specs, x_spec]}[operands]
        refs = {"weights": [w_gmem.at[e], s_gmem.at[e]], "activations": [x_gmem]}
        refs["both"] = [*refs["weights"], x_gmem]

        def release(indices, *stage):
            pass

        pipeline = plgpu.emit_pipeline_warp_specialized(
            release,
            grid=(items, steps),
            memory_registers=40,
            in_specs=specs,
            wg_axis="wg",
            num_compute_wgs=WGS,
            max_concurrent_steps=3,
        )
        pipeline(*refs[operands])

    return items * steps, plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(ctas,),
        grid_names=("sm",),
        num_threads=WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def stream_rate(fmt: str, tm: int, operands: str, interpret: bool) -> str:
    """`stream_kernel`'s bytes per second over all CTAs."""
    experts = 2 if interpret else devices.gpu().multiprocessors
    k = 3 * 128 if interpret else STREAM_K
    per_item = work.VALUES_PER_ITEM[fmt]
    keys = jax.random.split(jax.random.key(0), 3)
    w = jax.random.bits(keys[0], (experts, 4608, k // per_item), DATA[fmt])
    s = jax.random.bits(keys[1], (experts, k // work.BLOCK[fmt], 4608), SCALES[fmt])
    x = jax.random.normal(keys[2], (36 * tm, k), jnp.bfloat16)
    steps, kernel = stream_kernel(fmt, tm, operands, interpret)
    kernel = jax.jit(kernel)
    if interpret:
        jax.block_until_ready(kernel(w, s, x))
        return "ran in the interpreter (untimed)"
    ms = sum(ms for _, ms in kernels_ms(kernel, w, s, x, repeats=5))
    weight_bytes = WGS * LANES * 128 * (w.dtype.itemsize / per_item + s.dtype.itemsize / work.BLOCK[fmt])
    step_bytes = {"weights": weight_bytes, "activations": tm * 256, "both": weight_bytes + tm * 256}[operands]
    total = devices.gpu().multiprocessors * steps * step_bytes
    return f"{total / ms / 1e9:.2f} TB/s ({ms * 1e3:.0f} us)"


def tflops(kernel, flops_per_cta: float, interpret: bool) -> float | None:
    """The kernel's rate over all CTAs (None in the interpreter: run once, untimed)."""
    if interpret:
        jax.block_until_ready(kernel())
        return None
    ms = sum(ms for _, ms in kernels_ms(kernel, repeats=5))
    return devices.gpu().multiprocessors * flops_per_cta / ms / 1e9


def _rate(tflop_s: float | None) -> str:
    return "ran in the interpreter (untimed)" if tflop_s is None else f"{tflop_s:.0f} TFLOP/s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wgmma-wgs", type=int, nargs="*", default=[3, 2])
    parser.add_argument("--wgmma-n", type=int, nargs="*", default=[64, 96, 128, 192, 256])
    parser.add_argument("--body-formats", nargs="*", default=["plain", MXFP8, NVFP4])
    parser.add_argument("--body-tm", type=int, nargs="*", default=[96, 128])
    parser.add_argument("--body-kc", type=int, nargs="*", default=[128, 256])
    parser.add_argument("--stream-formats", nargs="*", default=[MXFP8, NVFP4], choices=[MXFP8, NVFP4])
    parser.add_argument("--stream-tm", type=int, nargs="*", default=[112])
    parser.add_argument("--stream-operands", nargs="*", default=["weights", "activations", "both"])
    args = parser.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    iters = 2 if interpret else 4000
    for wgs in args.wgmma_wgs:
        for n in args.wgmma_n:
            for registers in [False] if interpret else [True, False]:
                kernel = jax.jit(wgmma_kernel(n, registers, wgs, iters, interpret))
                rate = tflops(kernel, wgs * iters * LANES * n * 128 * 2, interpret)
                print(f"wgmma: {wgs} warpgroups, N {n}, {'RS' if registers else 'SS'}: {_rate(rate)}", flush=True)
    iters = 2 if interpret else 3000
    for fmt in args.body_formats:
        for tm in args.body_tm:
            for kc in args.body_kc:
                kernel = jax.jit(body_kernel(fmt, tm, kc, iters, interpret))
                rate = tflops(kernel, WGS * iters * LANES * tm * kc * 2, interpret)
                print(f"body: {fmt}, tm {tm}, kc {kc}: {_rate(rate)}", flush=True)
    for fmt in args.stream_formats:
        for tm in args.stream_tm:
            for operands in args.stream_operands:
                print(f"stream: {fmt}, tm {tm}, {operands}: {stream_rate(fmt, tm, operands, interpret)}", flush=True)


if __name__ == "__main__":
    main()
