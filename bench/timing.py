"""Device time of a jitted call, shared by the benches."""

import collections
import statistics
import time
from collections.abc import Callable

import jax

CHAINED = 5  # calls per timed run on several devices


def _kernel_runs(fn, *args, repeats: int) -> list[list[tuple[str, float]]]:
    """Each of `repeats` runs of fn(*args) on the GPU as its kernels' (name, ms), by CUPTI, measured one by one: a
    program with conditionals launches the kernels of the branches each run takes."""
    from jax.experimental.mosaic.gpu import profiler

    return [profiler.measure(fn, aggregate=False, iterations=1)(*args)[1] for _ in range(repeats)]


def kernels_ms(fn, *args, repeats: int) -> list[tuple[str, float]]:
    """fn(*args)'s kernels on the GPU in launch order, each with its median device time in ms, over the runs that
    launched the most common sequence of kernels."""
    jax.block_until_ready(fn(*args))
    runs = _kernel_runs(fn, *args, repeats=repeats)
    sequences = collections.Counter(tuple(name for name, _ in run) for run in runs)
    common = sequences.most_common(1)[0][0]
    runs = [run for run in runs if tuple(name for name, _ in run) == common]
    return [(name, statistics.median(run[i][1] for run in runs)) for i, name in enumerate(common)]


class _AsItIs:
    """A call that CUPTI's `measure` runs unchanged instead of jitting it: measure jits whatever is not a
    `jax.stages.Wrapped`, and this has the protocol's methods (trace and lower are never called)."""

    def __init__(self, call: Callable[[], object]):
        self.call = call

    def __call__(self) -> object:
        return self.call()

    def trace(self, *args, **kwargs):
        raise NotImplementedError

    def lower(self, *args, **kwargs):
        raise NotImplementedError


def call_kernels_ms(call: Callable[[], object], repeats: int) -> list[tuple[str, float]]:
    """Like kernels_ms for a call that is not a function of fixed arguments: one that runs compiled programs and
    carries its own state from call to call (a step with its state donated, which cannot run twice on the same
    arguments, as `Engine.step` does). Each call must launch the same kernels."""
    return kernels_ms(_AsItIs(call), repeats=repeats)


def device_ms(fn, *args, repeats: int) -> tuple[float, float]:
    """Median device time of fn(*args) in ms, all kernels and the longest one alone (CUPTI on one GPU; wall
    clock elsewhere, both the same: on several GPUs CUPTI would add up every GPU's kernels, so there the time of
    CHAINED calls issued back to back, over their count, which takes the dispatch out and keeps the waits in
    collectives)."""
    devices = {device for leaf in jax.tree.leaves(jax.block_until_ready(fn(*args))) for device in leaf.devices()}
    if jax.default_backend() == "gpu" and len(devices) == 1:
        runs = _kernel_runs(fn, *args, repeats=repeats)
        totals = [sum(ms for _, ms in kernels) for kernels in runs]
        longest = [max(ms for _, ms in kernels) for kernels in runs]
        return statistics.median(totals), statistics.median(longest)
    calls = CHAINED if len(devices) > 1 else 1
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(times), statistics.median(times)
