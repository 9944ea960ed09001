"""Device time of a jitted call, shared by the benches."""

import statistics
import time

import jax


def _kernel_runs(fn, *args, repeats: int) -> list[list[tuple[str, float]]]:
    """Each of `repeats` runs of fn(*args) on the GPU as its kernels' (name, ms), by CUPTI."""
    from jax.experimental.mosaic.gpu import profiler

    return profiler.measure(fn, aggregate=False, iterations=repeats)(*args)[1]


def kernels_ms(fn, *args, repeats: int) -> list[tuple[str, float]]:
    """fn(*args)'s kernels on the GPU in launch order, each with its median device time in ms."""
    jax.block_until_ready(fn(*args))
    runs = _kernel_runs(fn, *args, repeats=repeats)
    return [(name, statistics.median(run[i][1] for run in runs)) for i, (name, _) in enumerate(runs[0])]


def device_ms(fn, *args, repeats: int) -> tuple[float, float]:
    """Median device time of fn(*args) in ms, all kernels and the longest one alone (CUPTI on GPU; wall
    clock after a sync elsewhere, both the same)."""
    jax.block_until_ready(fn(*args))
    if jax.default_backend() == "gpu":
        runs = _kernel_runs(fn, *args, repeats=repeats)
        totals = [sum(ms for _, ms in kernels) for kernels in runs]
        longest = [max(ms for _, ms in kernels) for kernels in runs]
        return statistics.median(totals), statistics.median(longest)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), statistics.median(times)
