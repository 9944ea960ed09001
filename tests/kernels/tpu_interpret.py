"""Pallas TPU kernels run in interpret mode on CPU, failing on any race between their DMAs and compute."""

from collections.abc import Callable

import jax
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu


def race_checked[T](run: Callable[[pltpu.InterpretParams], T]) -> T:
    """run(params) with every TPU Pallas call interpreted under `params` (race detection on, DMAs executed at
    their waits, uninitialised memory NaN); asserts that no race was found."""
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait", uninitialized_memory="nan")
    try:
        with pltpu.force_tpu_interpret_mode(params):
            out = jax.block_until_ready(run(params))
    finally:
        races = interpret_pallas_call.races
        pltpu.reset_tpu_interpret_mode_state()
    assert races is not None and not races.races_found
    return out
