"""What the kernels' Mosaic runtimes need in a process: how Mosaic GPU lowers them, and what their custom calls need
when a program runs."""

import functools
import importlib

import jax


def import_kernel_runtimes() -> None:
    """Import what the kernels' custom calls need when a program runs, for a program that was not lowered in this
    process (read back from the executable cache): on a GPU, Mosaic GPU's module, which points its custom call at
    the CUDA tools and the runtime library it compiles and loads the kernels with (MOSAIC_GPU_CUDA_ROOT,
    MOSAIC_GPU_RUNTIME_LIB_PATH). Mosaic TPU kernels are compiled into the program: nothing to import."""
    if jax.devices()[0].platform != "gpu":
        return
    try:
        importlib.import_module("jax.experimental.mosaic.gpu")
    except ImportError:  # no CUDA plugin: no Mosaic GPU kernel in any program here
        pass


def ask_ptxas_once() -> None:
    """Make Mosaic GPU ask ptxas for its PTX ISA version once per process. jax 0.11 asks it again at every
    conversion to or from a type of 8 bits or fewer that a kernel lowers (about a millisecond each; the expert
    kernels' FP4/FP8 decoding makes some 20,000 of them in the model's step, a third of its lowering time), and
    the answer cannot change while the process runs."""
    try:
        from jax._src.lib import mosaic_gpu
    except ImportError:  # no CUDA plugin: nothing lowers for a GPU here
        return
    extension = getattr(mosaic_gpu, "_mosaic_gpu_ext", None)
    asked = getattr(extension, "_get_ptxas_isa_version", None)
    if asked is not None and not hasattr(asked, "cache_info"):
        extension._get_ptxas_isa_version = functools.cache(asked)
