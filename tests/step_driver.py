"""A minimal host loop over the engine step (`Driver`) and the whole-sequence log-probabilities its steps are
checked against: shared by the step's tests and the kernels' tests that run it."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.cache import CacheLayout, init_state
from inkling_jax.forward import logits_fn
from inkling_jax.sampling import SamplingParams
from inkling_jax.step import StepBatch, pack_spans, step

SLOTS, WIDTH, MAX_PAGES = 3, 8, 1  # 128-token pages: one per slot holds these short sequences


NO_PREVIOUS = jnp.zeros(SLOTS, jnp.int32)


class Driver:
    """A minimal host loop: slots, fixed page tables, one step per call. Each step is SLOTS * width flat tokens;
    with `lanes` every slot that brings more than one token is read through lanes of 3 (chunks straddle them), else
    all slots are one narrow group of `width`."""

    def __init__(self, model, width=WIDTH, lanes=False, tokens=None, pages=MAX_PAGES, boundaries=False):
        self.graphdef, self.params = nnx.split(model)
        self.text, self.width, self.tokens = model.config, width, tokens or SLOTS * width
        self.layout = (
            dict(width=1, lane_width=3, lanes=-(-SLOTS * width // 3) + SLOTS)
            if lanes
            else dict(width=width, lane_width=1, lanes=0)
        )
        layout = CacheLayout(SLOTS, SLOTS * pages, pages, width, boundaries=boundaries)
        self.state = init_state(self.text, layout, jnp.float32)
        self.page_table = jnp.arange(SLOTS * pages, dtype=jnp.int32).reshape(SLOTS, pages)

    def run(self, chunks, reset=(), emit=(), prompt=(), sampling=None, num_top=0):
        """chunks: {slot: token list (at most width)}; returns the step's Emitted (one token per slot)."""
        tokens = np.zeros((SLOTS, self.width), np.int32)
        counts = np.zeros(SLOTS, np.int32)
        for slot, chunk in chunks.items():
            tokens[slot, : len(chunk)] = chunk
            counts[slot] = len(chunk)
        groups = {
            "reset": reset,
            "emit": emit,
            "is_prompt": prompt,
            "feedback": (),
            "replay": (),
            "speculate": (),
            "defer": (),
        }
        flags = {name: jnp.asarray([s in group for s in range(SLOTS)]) for name, group in groups.items()}
        layout = self.layout
        token_ids, starts, *lanes = pack_spans(tokens, counts, np.zeros(SLOTS, bool), tokens=self.tokens, **layout)
        batch = StepBatch(
            jnp.asarray(token_ids),
            jnp.asarray(counts),
            jnp.asarray(starts),
            *map(jnp.asarray, lanes),
            page_table=self.page_table,
            sampling=sampling or SamplingParams.neutral(SLOTS, logprobs=num_top),
            **flags,
        )
        out, self.state = step(
            self.graphdef,
            self.params,
            self.state,
            batch,
            NO_PREVIOUS,
            num_top=num_top,
            width=layout["width"],
            lane_width=layout["lane_width"],
        )
        return out


def full_logprobs(model, ids):
    logits = np.asarray(logits_fn(model)(jnp.asarray([ids], jnp.int32))[0], np.float64)
    return (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )


def prefill(driver, slot, ids, sizes, vocab):
    """Feed ids to `slot` in chunks of the given sizes; returns the log-probabilities after each chunk."""
    seen, results, first = 0, [], True
    for size in sizes:
        out = driver.run({slot: ids[seen : seen + size]}, reset={slot} if first else (), prompt={slot}, num_top=vocab)
        seen, first = seen + size, False
        order = np.argsort(np.asarray(out.top_ids[slot, 0]))
        results.append((seen - 1, np.asarray(out.top_logprobs[slot, 0])[order]))
    return results
