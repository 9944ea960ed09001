"""The engine: parameters and decode state on a mesh, and the jitted step fed from host batches.

Batch generation (`inkling_jax.generate`) and the server's scheduler (`serving.scheduler`) both drive it:
they decide what each slot does; the engine sizes the state, places it, runs steps and hands results
back on every process (they come back replicated).

Slots and pages: the state has `slots` slots, `slots_per_replica` for each data-parallel replica, and
each replica a pool of `pages_per_replica` pages; page tables hold replica-local page ids.

Step shapes: a plain step is 1 token wide (decoding only) or `chunk` wide (with prefill); with
speculation (`--speculative dspark`), a step in which some slot speculates is γ + 1 wide (decoding
only) or `chunk` wide, in its own program. `widths` lists them; `warm_up` compiles them all.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from inkling_jax.cache import PAGE_SIZE, CacheLayout, init_state, layout_for_budget
from inkling_jax.model.draft import require_draft
from inkling_jax.model.moe import kernel_platform, lay_out_experts
from inkling_jax.model.text import CausalLM
from inkling_jax.sampling import SamplingParams
from inkling_jax.sharding import DATA, MODEL, shard_model, state_shardings
from inkling_jax.speculative import SPECULATIVE_MODES, SpeculationError
from inkling_jax.step import Emitted, StepBatch, step_fn

# What an idle slot samples with (its token is discarded), and each parameter's neutral value.
NEUTRAL_SAMPLING = {
    "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0,
}  # fmt: skip
_SAMPLING_DTYPES = {"top_k": np.int32, "seed": np.uint32}


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


class Engine:
    """The step over `mesh`; create with `Engine.create`. Use it inside `with jax.set_mesh(engine.mesh)`. On TPU and
    on Hopper GPUs it re-lays the model's experts for the expert kernels, in place: save checkpoints from a model
    no engine has taken."""

    def __init__(
        self,
        model: CausalLM,
        replica: CacheLayout,
        mesh: Mesh,
        num_top: int = 0,
        speculative: str = "none",
        compiler_options: dict[str, object] | None = None,
    ):
        """speculative: one of SPECULATIVE_MODES; anything but "none" needs the model's DSpark draft
        (NoDraftError) and a chunk of at least γ + 1 tokens (SpeculationError). compiler_options: XLA's, for
        the step's programs (jax.jit's argument; e.g. a test that runs many large steps on a backend set to
        compile fast asks for optimised code)."""
        if speculative not in SPECULATIVE_MODES:
            raise SpeculationError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {speculative!r}")
        self.speculative = speculative != "none"
        self.gamma = require_draft(model).block_size if self.speculative else 0
        if replica.max_chunk < self.gamma + 1:
            raise SpeculationError(
                f"chunk {replica.max_chunk} is narrower than a verify pass: speculation needs at least "
                f"{self.gamma + 1} (the anchor and {self.gamma} drafts)"
            )
        self.text, self.mesh = model.config, mesh
        self.dtype = model.model.embed_tokens.weight.dtype
        self.replicas = mesh.shape[DATA]
        self.slots_per_replica, self.pages_per_replica = replica.max_num_seqs, replica.num_pages
        self.slots, self.max_pages, self.chunk = (
            replica.max_num_seqs * self.replicas,
            replica.max_pages_per_seq,
            replica.max_chunk,
        )
        layout = dataclasses.replace(replica, max_num_seqs=self.slots, num_pages=replica.num_pages * self.replicas)
        with jax.set_mesh(mesh):
            if platform := kernel_platform():  # the expert kernels' layout, made once here (in place)
                lay_out_experts(model, platform)
            self.graphdef, self.params = nnx.split(shard_model(model, mesh))
            draft = model.dspark.config if self.speculative else None  # its context pool only when speculating
            make_state = functools.partial(init_state, self.text, layout, self.dtype, mesh.shape[MODEL], draft)
            shardings = state_shardings(jax.eval_shape(make_state), self.text, mesh)
            self.state = jax.jit(make_state, out_shardings=shardings)()  # built in place, shard by shard
        # each step returns the state exactly as it took it, so one compilation per width serves all steps
        self._step = jax.jit(
            functools.partial(step_fn, self.graphdef, num_top=min(num_top, self.text.unpadded_vocab_size),
                              greedy_draft=speculative == "dspark-greedy"),
            static_argnames="speculative", donate_argnames="state", out_shardings=(NamedSharding(mesh, P()), shardings),
            compiler_options=compiler_options,
        )  # fmt: skip
        self.by_slot = NamedSharding(mesh, P(DATA))
        self.previous = jax.device_put(np.zeros(self.slots, np.int32), NamedSharding(mesh, P()))

    @classmethod
    def create(
        cls,
        model: CausalLM,
        mesh: Mesh,
        *,
        max_num_seqs: int,
        chunk: int,
        max_context: int,
        budget_bytes: int | None = None,
        num_top: int = 0,
        speculative: str = "none",
    ) -> Engine:
        """`max_num_seqs` slots per replica. With a per-device memory budget the page pool is what fits
        after the slots' fixed state (CacheBudgetError if not even one `max_context` sequence fits);
        without one every slot gets room for `max_context` tokens."""
        pages = pages_for(max_context)
        if budget_bytes is None:
            replica = CacheLayout(max_num_seqs, max_num_seqs * pages, pages, chunk)
        else:
            replica = layout_for_budget(
                model.config, budget_bytes, max_num_seqs=max_num_seqs, max_context=max_context, max_chunk=chunk,
                dtype=model.model.embed_tokens.weight.dtype, tp=mesh.shape[MODEL],
                draft=require_draft(model) if speculative != "none" else None,
            )  # fmt: skip
        return cls(model, replica, mesh, num_top, speculative)

    @property
    def compilations(self) -> int:
        """Step programs compiled so far (warm-up compiles one per shape; serving must add none)."""
        return self._step._cache_size()

    @property
    def widths(self) -> tuple[tuple[int, bool], ...]:
        """Every step shape this engine runs: (width, speculative)."""
        plain = ((1, False), (self.chunk, False))
        return plain + (((self.gamma + 1, True), (self.chunk, True)) if self.speculative else ())

    def width(self, prefill: bool, speculating: bool) -> int:
        """The width of a step that holds a prompt chunk (`prefill`) or a speculating slot, or neither."""
        return self.chunk if prefill else self.gamma + 1 if speculating else 1

    def replica_of(self, slot: int) -> int:
        return slot // self.slots_per_replica

    def step(self, batch: StepBatch) -> Emitted:
        """Dispatch one step on a host batch ([S, ...] numpy leaves); returns at once with the device's
        outputs (`fetch` waits for them). Slots with `feedback` set start from the last token emitted
        for them by the previous step, which the host need not have read yet. The step is speculative
        when any slot has `speculate` set."""
        speculative = bool(np.any(batch.speculate))
        if speculative and not self.speculative:
            raise SpeculationError("a slot asks to speculate but this engine runs without --speculative")
        on_mesh = jax.tree.map(
            lambda host: jax.make_array_from_callback(host.shape, self.by_slot, lambda index: host[index]), batch
        )
        with jax.set_mesh(self.mesh):
            emitted, self.state = self._step(self.params, self.state, on_mesh, self.previous, speculative=speculative)
        self.previous = emitted.last
        return emitted

    @staticmethod
    def fetch(emitted: Emitted) -> Emitted:
        """The step's outputs as numpy arrays, on every process (they are replicated)."""
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), emitted)

    def idle_batch(self, width: int, speculative: bool = False) -> StepBatch:
        """A batch in which no slot does anything (for compiling a shape)."""
        tokens, table = np.zeros((self.slots, width), np.int32), np.zeros((self.slots, self.max_pages), np.int32)
        speculate = np.full(
            self.slots, speculative
        )  # with counts 0 nothing runs, but the program is the speculative one
        return host_batch(tokens, np.zeros(self.slots, np.int32), [None] * self.slots, table, speculate=speculate)

    def warm_up(self) -> None:
        """Compile (and run once) every step shape, so serving never compiles."""
        for width, speculative in self.widths:
            self.fetch(self.step(self.idle_batch(width, speculative)))


def host_batch(
    tokens: np.ndarray,
    counts: np.ndarray,
    sampling: Sequence[object | None],
    page_table: np.ndarray,
    *,
    reset: np.ndarray | None = None,
    is_prompt: np.ndarray | None = None,
    emit: np.ndarray | None = None,
    feedback: np.ndarray | None = None,
    replay: np.ndarray | None = None,
    speculate: np.ndarray | None = None,
) -> StepBatch:
    """A host StepBatch; `sampling[s]` is any object with the sampling fields (or None: idle values)."""
    slots = tokens.shape[0]
    flags = [
        np.zeros(slots, bool) if flag is None else flag
        for flag in (reset, is_prompt, emit, feedback, replay, speculate)
    ]

    def column(name: str) -> np.ndarray:
        values = [NEUTRAL_SAMPLING[name] if s is None else getattr(s, name, NEUTRAL_SAMPLING[name]) for s in sampling]
        return np.asarray(values, _SAMPLING_DTYPES.get(name, np.float32))

    params = SamplingParams(**{name: column(name) for name in NEUTRAL_SAMPLING})
    return StepBatch(tokens, counts, *flags, page_table.copy(), params)
