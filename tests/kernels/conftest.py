"""The CPU runs of the Mosaic GPU and TPU kernels (Pallas's interpreters) hand their host callbacks the operands as
host arrays.

The interpreters simulate a kernel's memory and threads on the host: every load, store, copy and barrier is an
`io_callback`. JAX's callback puts each operand on the CPU device as a jax.Array before calling (a few milliseconds
a call, over half of an interpreted kernel's time), and the interpreters' callbacks read them back with np.array,
int or .item(). Here they get a host copy of each operand instead (the same values and dtypes); the one check that
wants a jax.Array (`MeshLocation`'s coordinates) takes a host scalar too. Where JAX's functions are not the ones
this was written against, nothing is replaced."""

import inspect

import jax
import numpy as np
import pytest
from jax._src import callback as jax_callback
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as gpu_memory

IO_CALLBACK_PARAMETERS = ["args", "result_avals", "callback", "sharding", "ordered"]


def io_callback_on_host(*args, result_avals, callback, sharding, ordered):
    """`jax._src.callback.io_callback_impl` with host copies of the operands."""
    del result_avals, sharding, ordered
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return jax.tree.map(np.asarray, callback(*(np.array(arg) for arg in args)))


def host_scalar_to_int(original):
    def to_int(x):
        return x.item() if isinstance(x, np.ndarray | np.generic) else original(x)

    return to_int


@pytest.fixture(scope="module", autouse=True)
def host_operands_in_interpreter_callbacks():
    replaceable = (
        list(inspect.signature(jax_callback.io_callback_impl).parameters) == IO_CALLBACK_PARAMETERS
        and "api.device_put(args, cpu_device)" in inspect.getsource(jax_callback.io_callback_impl)
        and callable(getattr(gpu_memory, "_to_int", None))
    )
    if not replaceable:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax_callback, "io_callback_impl", io_callback_on_host)
        patch.setattr(gpu_memory, "_to_int", host_scalar_to_int(gpu_memory._to_int))
        yield
