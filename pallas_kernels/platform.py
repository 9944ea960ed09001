"""Which accelerator the kernels run on, for the entry points' "auto" choice."""

from collections.abc import Callable

import jax


def on_hopper() -> bool:
    """Whether the default device is an sm90 GPU: the Mosaic GPU kernels use its wgmma, TMA and transaction-count
    barriers."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"


def hopper_takes(check: Callable[..., None], *operands) -> bool:
    """Whether `auto` runs a Mosaic GPU kernel: on an sm90 GPU, for operands its `check` accepts (raises no
    ValueError for)."""
    if not on_hopper():
        return False
    try:
        check(*operands)
    except ValueError:
        return False
    return True
