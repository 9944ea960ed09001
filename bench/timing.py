"""Device time of a jitted call, shared by the benches."""

import statistics
import time

import jax


def device_ms(fn, *args, repeats: int) -> tuple[float, float]:
    """Median device time of fn(*args) in ms, all kernels and the longest one alone (CUPTI on GPU; wall
    clock after a sync elsewhere, both the same)."""
    jax.block_until_ready(fn(*args))
    if jax.default_backend() == "gpu":
        from jax.experimental.mosaic.gpu import profiler

        _, runs = profiler.measure(fn, aggregate=False, iterations=repeats)(*args)
        totals = [sum(ms for _, ms in kernels) for kernels in runs]
        longest = [max(ms for _, ms in kernels) for kernels in runs]
        return statistics.median(totals), statistics.median(longest)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), statistics.median(times)
