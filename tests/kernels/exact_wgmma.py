"""The Mosaic GPU interpreter's wgmma with each product rounded once to the accumulator's type.

The interpreter multiplies with numpy's float32 matmul, whose BLAS kernel (chosen for the CPU it runs on) may sum
an output element in another order for other operand shapes: on some CPUs two tiles that a GPU's wgmma computes
alike differ in the last bit. Exactly rounded products depend on an element's own row and column alone, as the
hardware's do, so bit-for-bit tests of a kernel's schedule hold on every CPU."""

import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks


class _ExactMatmul:
    """numpy, with `matmul` computed in float64 and rounded once."""

    def __getattr__(self, name: str) -> object:
        return getattr(np, name)

    @staticmethod
    def matmul(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64)).astype(dtype)


@pytest.fixture(scope="module", autouse=True)
def exact_wgmma():
    """Makes the interpreter's wgmma exactly rounded for the tests of the module that imports this fixture."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpu_callbacks, "np", _ExactMatmul())
        yield
