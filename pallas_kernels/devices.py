"""What the kernels know of the device they run on: queried from it where jax exposes it (a CUDA device's compute
capability, multiprocessors and shared memory per block, a TPU core's VMEM), the rest from a table of device kinds.

Off the device (CPU interpret mode, lowering for a device this process does not have) and for kinds the table does
not hold, the kernels' targets stand in: the H200 for GPUs, the v7x for TPUs. The GPU kernels' interpreter then
runs the H200's CTAs, and a program lowered here is the one an H200 or a v7x lowers.
"""

import dataclasses

import jax
from jax.experimental.pallas import tpu as pltpu


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU kind's facts that the Mosaic GPU kernels size their work by and the entry points choose by."""

    multiprocessors: int  # SMs: the CTAs of one wave (a device's `core_count`)
    smem_bytes: int  # shared memory one block may opt in to (a device's `shared_memory_per_block_optin`)
    own_windows_from: int  # routed experts: copies per expert (on average) from which each group's copies are
    # visited in windows of their own, below it in shared tiles (the whole call, measured)
    xla_mix_from_tokens: int  # attention residuals without the Mosaic GPU kernel: tokens from which XLA's
    # formulation beats the oracle's (measured)


H200 = Gpu(multiprocessors=132, smem_bytes=227 * 1024, own_windows_from=16, xla_mix_from_tokens=1024)
# own_windows_from, MXFP8 with shared tiles against own windows: 3.88 / 4.02 ms at 640 tokens (13.3 copies per
# expert), 4.15 / 4.03 at 768 (16), 4.73 / 4.09 at 1024 (bench/results/moe_threshold_h200.txt); NVFP4 taken to
# cross at the same count. xla_mix_from_tokens: XLA's formulation 3x the oracle at 4096 tokens, slower at 64.
GPUS = {"NVIDIA H200": H200}  # by `device_kind`


@dataclasses.dataclass(frozen=True)
class Tpu:
    """A TPU kind's facts that the Mosaic TPU kernels size their buffers by."""

    vmem_bytes: int  # VMEM per TensorCore


V7X = Tpu(vmem_bytes=64 << 20)


def on_hopper() -> bool:
    """Whether the default device is an sm90 GPU: the Mosaic GPU kernels use its wgmma, TMA and transaction-count
    barriers."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"


def gpu() -> Gpu:
    """The default device's facts: its multiprocessors and shared memory as it reports them, the rest by its kind
    (the H200's for a kind not in GPUS); the H200's off a GPU."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return H200
    kind = GPUS.get(device.device_kind, H200)
    return dataclasses.replace(
        kind,
        multiprocessors=device.core_count,
        smem_bytes=getattr(device, "shared_memory_per_block_optin", kind.smem_bytes),
    )


def tpu() -> Tpu:
    """The default device's facts as jax's table of TPU chips holds them for its kind; the v7x's off a TPU and for a
    kind jax does not know."""
    if jax.devices()[0].platform != "tpu":
        return V7X
    try:
        return Tpu(vmem_bytes=pltpu.get_tpu_info().vmem_capacity_bytes)
    except ValueError:  # a chip jax's table does not hold
        return V7X
