"""Which accelerator the kernels run on, for the entry points' "auto" choice."""

import jax


def on_hopper() -> bool:
    """Whether the default device is an sm90 GPU: the Mosaic GPU kernels use its wgmma, TMA and transaction-count
    barriers."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"
