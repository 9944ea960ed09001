"""The engine: parameters and decode state on a mesh, and the jitted step fed from host batches.

The scheduler (`inkling_jax.runtime.scheduler`) drives it for every front door (the gRPC server, the batch
runner): it decides what each slot does; the engine sizes the state, places it, runs steps and hands
results back on every process (they come back replicated). `load_engine` makes one from a checkpoint (or,
with `load_format="dummy"`, from a config alone: random weights built on the devices), with its tokenizer.

Slots and pages: the state has `slots` slots, `slots_per_replica` for each data-parallel replica, and
each replica a pool of `pages_per_replica` pages; page tables hold replica-local page ids.

Step shapes (`StepShape`): a step's tokens are one flat run (`inkling_jax.model.chunk`), each slot's a
contiguous span. A decode step holds one token per slot (`slots_per_replica` tokens a replica); a step with
prompt chunks holds `max_num_batched_tokens` a replica, the chunks read by attention through lanes of
`lane_width` tokens, so a decoding slot costs one token there too. With speculation (`--speculative dspark`),
a step in which some slot speculates leaves γ + 1 tokens to each speculating slot, in programs of their own.
`shapes` lists them; `warm_up` compiles them all (a shape first seen later is compiled then). Each is lowered
and compiled explicitly and kept as its executable, which the engines of one process share (`STEP_PROGRAMS`, the
latest eight: an engine built again, or another over the same model's form and mesh, compiles nothing); with an
executable cache directory (`inkling_jax.runtime.executable_cache`) each is read from there when a program of the
same key was stored, and stored there when compiled.

Images (a model with an image tower): the engine keeps a pool of `image_feature_tokens` feature rows on the
device (one row for a text-only model), which the steps read (`StepBatch.image_rows`), and one encode program per
tile bucket (`inkling_jax.runtime.images`), compiled at warm-up with the steps: `encode` writes one image's
features into the rows the scheduler gave it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from inkling_jax.cache import (
    PAGE_SIZE,
    ROUND_ROWS,
    CacheBudgetError,
    CacheLayout,
    DecodeState,
    init_snapshots,
    init_state,
    layout_for_budget,
    snapshot_bytes,
)
from inkling_jax.checkpoint import CheckpointError, load_model
from inkling_jax.checkpoint.dummy import dummy_model
from inkling_jax.config import ConfigError, ModelConfig, load_config
from inkling_jax.model.attention import fuse_attention_projections
from inkling_jax.model.draft import require_draft
from inkling_jax.model.moe import lay_out_experts
from inkling_jax.model.text import CausalLM
from inkling_jax.runtime.executable_cache import ExecutableCache, ProgramTable, program_key
from inkling_jax.runtime.images import (
    DEFAULT_MAX_IMAGE_TILES,
    DEFAULT_MAX_IMAGES,
    RequestImage,
    encode_fn,
    image_buckets,
    image_limits,
    padded_image,
)
from inkling_jax.runtime.kernel_builds import KernelBuilder
from inkling_jax.runtime.packed_batch import BatchLayout
from inkling_jax.runtime.requests import MAX_LOGPROBS
from inkling_jax.sampling import SamplingParams
from inkling_jax.score import DTYPES
from inkling_jax.sharding import DATA, MODEL, make_mesh, shard_model, snapshot_shardings, state_shardings
from inkling_jax.speculative import SPECULATIVE_MODES, SpeculationError
from inkling_jax.step import (
    Emitted,
    Redraw,
    Redrawn,
    Rounds,
    SnapshotMove,
    StepBatch,
    pack_spans,
    resample_fn,
    restore_fn,
    save_fn,
    step_fn,
)
from inkling_jax.tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerError
from pallas_kernels import import_kernel_runtimes
from pallas_kernels.moe import kernel_platform

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")  # auto: the checkpoint's weights; dummy: random weights from its config alone


def add_load_format_argument(parser: argparse.ArgumentParser) -> None:
    """`--load-format`, as every command that loads a model takes it (vLLM's name)."""
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="dummy: random weights built on the devices from the config alone (a directory's tokenizer is used)",
    )


# What an idle slot samples with (its token is discarded), and each parameter's neutral value.
NEUTRAL_SAMPLING = {
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "seed": 0,
    "logprobs": 0,
}
_SAMPLING_DTYPES = {"top_k": np.int32, "seed": np.uint32, "logprobs": np.int32}


def sampling_columns(sampling: Sequence[object | None]) -> SamplingParams:
    """Host SamplingParams [S] from each slot's object with the sampling fields (None, or a field it lacks or
    leaves None: the neutral value)."""

    def value(slot: object | None, name: str) -> object:
        found = None if slot is None else getattr(slot, name, None)
        return NEUTRAL_SAMPLING[name] if found is None else found

    def column(name: str) -> np.ndarray:
        return np.asarray([value(s, name) for s in sampling], _SAMPLING_DTYPES.get(name, np.float32))

    return SamplingParams(**{name: column(name) for name in NEUTRAL_SAMPLING})


LANE = 64  # prompt tokens per attention lane: the GPU kernel's query-row tile
STEP_PROGRAMS = ProgramTable(8)  # the process's latest step programs, by `program_key`: its engines share them
RESAMPLERS = ProgramTable(4)  # the process's latest resample programs, by their arguments' form
RESAMPLE_ROWS = (8,)  # the rows of a resample program below one per slot: a step's few constrained slots sample
# over few rows (each a whole vocabulary)
FEW_TOKENS = 8  # a plain decode step of at most this many tokens (per replica) compiles as a shape of its own, when
# there are more slots: its token-wise work shrinks, the GPU expert kernels take their few-token path (no sort of
# the copies by expert), and attention and sampling read only the slots that bring tokens (`Chunk.busy`)


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """A compiled step's shape, per data-parallel replica: its flat tokens, its narrow group's queries per slot
    (1, or γ + 1 when some slot speculates) and its prompt lanes."""

    tokens: int
    width: int
    lanes: int
    speculative: bool

    def __str__(self) -> str:
        return f"{self.tokens} tokens, width {self.width}, {self.lanes} lanes" + (", speculative" * self.speculative)

    @property
    def label(self) -> str:
        """Its name in the executable cache."""
        return f"step-{self.tokens}x{self.width}-{self.lanes}" + ("-speculative" if self.speculative else "")


class Engine:
    """The step over `mesh`; create with `Engine.create` or `load_engine`. It fuses the model's attention
    projections (and on TPU and on Hopper GPUs re-lays its experts for the expert kernels), in place: save
    checkpoints from a model no engine has taken. Its steps read the parameters' arrays as they were when it was
    made (later changes to the model do not reach them), one step at a time (not thread-safe)."""

    def __init__(
        self,
        model: CausalLM,
        replica: CacheLayout,
        mesh: Mesh,
        num_top: int = 0,
        speculative: str = "none",
        compiler_options: dict[str, object] | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        checkpoint: str = "",
        executable_cache: str | Path | None = None,
        max_num_batched_tokens: int | None = None,
        max_images: int = DEFAULT_MAX_IMAGES,
        max_image_tiles: int = DEFAULT_MAX_IMAGE_TILES,
        image_feature_tokens: int | None = None,
        snapshots: int = 0,
    ):
        """speculative: one of SPECULATIVE_MODES; anything but "none" needs the model's DSpark draft
        (NoDraftError) and a chunk of at least γ + 1 tokens (SpeculationError). compiler_options: XLA's, for
        the step's programs (jax.jit's argument; e.g. a test that runs many large steps on a backend set to
        compile fast asks for optimised code). tokenizer and checkpoint (its directory or config file) are
        what the front doors report and encode text with. executable_cache: a directory for the compiled step
        programs (`inkling_jax.runtime.executable_cache`; None: compile every one). max_num_batched_tokens: a
        replica's tokens in a step with prompt chunks (decoding, verifying and prompt tokens; default: every
        slot's decode tokens and two chunks); at least every slot's decode tokens and one more (BatchedTokensError).
        max_images, max_image_tiles: what one request may carry (images; 0: none) and one image (tiles);
        image_feature_tokens: the feature pool's rows (default: four images of max_image_tiles), at least
        max_image_tiles (ImageOptionsError); a model without an image tower ignores them. snapshots: the states
        a prefix cache saves at page boundaries, per replica (`save_snapshot`; 0: none, and no state kept for
        them)."""
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
        self.tokenizer, self.checkpoint = tokenizer, checkpoint
        self.dtype = model.model.embed_tokens.weight.dtype
        self.replicas = mesh.shape[DATA]
        self.slots_per_replica, self.pages_per_replica = replica.max_num_seqs, replica.num_pages
        self.slots, self.max_pages, self.chunk = (
            replica.max_num_seqs * self.replicas,
            replica.max_pages_per_seq,
            replica.max_chunk,
        )
        self.max_num_batched_tokens = batched_tokens(
            max_num_batched_tokens, self.slots_per_replica, self.gamma, self.chunk
        )
        self.lane_width = min(LANE, self.chunk)
        self.lanes = -(-self.max_num_batched_tokens // self.lane_width)
        self.snapshots_per_replica = snapshots
        layout = dataclasses.replace(
            replica, max_num_seqs=self.slots, num_pages=replica.num_pages * self.replicas, boundaries=snapshots > 0
        )
        with jax.set_mesh(mesh):
            if platform := kernel_platform():  # the expert kernels' layout, made once here (in place)
                lay_out_experts(model, platform)
            fuse_attention_projections(model)  # one gemm for the projections of each input (in place)
            self.graphdef, params = nnx.split(shard_model(model, mesh))
            # the step takes the parameters' arrays as a flat list: no pytree of Variables to flatten per step
            self._param_leaves, self._param_tree = jax.tree.flatten(params)
            draft = model.dspark.config if self.speculative else None  # its context pool only when speculating
            make_state = functools.partial(
                init_state, self.text, layout, self.dtype, mesh.shape[MODEL], draft, self.replicas
            )
            abstract = jax.eval_shape(make_state)
            shardings = state_shardings(abstract, self.text, mesh)
            self.state = jax.jit(make_state, out_shardings=shardings)()  # built in place, shard by shard
            self._snapshots = None
            if snapshots:
                make_snapshots = functools.partial(init_snapshots, abstract, self.text, snapshots * self.replicas)
                snapshot_places = snapshot_shardings(jax.eval_shape(make_snapshots), self.text, mesh)
                self._snapshots = jax.jit(make_snapshots, out_shardings=snapshot_places)()
                between = {**(compiler_options or {}), **between_steps_options(jax.default_backend())}
                self._save = jax.jit(
                    save_fn, donate_argnames="snapshots", out_shardings=snapshot_places, compiler_options=between
                )
                self._restore = jax.jit(
                    restore_fn, donate_argnames="state", out_shardings=shardings, compiler_options=between
                )
        # each step returns the state exactly as it took it, so one compilation per width serves all steps
        num_top, greedy_draft = min(num_top, self.text.unpadded_vocab_size), speculative == "dspark-greedy"
        out_shardings = (NamedSharding(mesh, P()), shardings)
        self._step = jax.jit(
            functools.partial(
                _flat_step,
                self.graphdef,
                self._param_tree,
                num_top=num_top,
                greedy_draft=greedy_draft,
                lane_width=self.lane_width,
            ),
            static_argnames=("speculative", "width", "layout", "rounds_layout"),
            donate_argnames="state",
            out_shardings=out_shardings,
            compiler_options=compiler_options,
        )
        self._resample = jax.jit(
            _packed_resample,
            static_argnames="layout",
            donate_argnames="state",
            out_shardings=out_shardings,
            compiler_options=compiler_options,
        )
        self._resamplers: dict[int, jax.stages.Compiled] = {}  # by rows
        self._redraw_layouts: dict[int, BatchLayout] = {}  # the packed `Redraw`'s, by rows
        self._layouts: dict[StepShape, BatchLayout] = {}
        # what the executable cache's key needs beyond the arguments, the mesh and the graph definition
        self._options = {
            "num_top": num_top,
            "greedy_draft": greedy_draft,
            "donate": "state",
            "lane_width": self.lane_width,
            "compiler_options": repr(sorted((compiler_options or {}).items())),
            "out_shardings": repr(out_shardings),
        }
        self._executables = ExecutableCache(executable_cache) if executable_cache is not None else None
        self._programs: dict[StepShape, jax.stages.Compiled] = {}
        # lower_s, kernels_s and compile_s, or loaded_s; first_run_s
        self.program_times: dict[StepShape, dict[str, float]] = {}
        local = next(device for device in mesh.devices.flat if device.process_index == jax.process_index())
        self._kernels = KernelBuilder(local) if local.platform == "gpu" else None
        self.by_slot = NamedSharding(mesh, P(DATA))
        self.previous = jax.device_put(np.zeros(self.slots, np.int32), NamedSharding(mesh, P()))
        self.mask_words = -(-self.text.unpadded_vocab_size // 32)  # int32 words of a slot's allowed-token bits
        # what a step without constrained slots reads for them: every token allowed, never sent again
        self._any_token = jax.device_put(np.full((self.slots, self.mask_words), -1, np.int32), self.by_slot)
        # a speculative step's constrained rounds, packed (`Rounds`); the none a step without any reads, sent once
        self._rounds_layout = BatchLayout.of(self._host_rounds({}), self.replicas) if self.speculative else None
        self._no_rounds = None
        if self._rounds_layout is not None:
            self._no_rounds = jax.device_put(self._rounds_layout.pack(self._host_rounds({})), self.by_slot)
        self._set_up_images(model, max_images, max_image_tiles, image_feature_tokens)

    def _set_up_images(
        self, model: CausalLM, max_images: int, max_image_tiles: int, image_feature_tokens: int | None
    ) -> None:
        """The image feature pool (replicated on the mesh) and, for a model with a tower that takes images, its
        limits and the encode programs' function."""
        tower = model.vision_tower
        self.vision = None if tower is None else tower.config  # the tower's VisionConfig (None: text only)
        self.image_limits = image_limits(
            self.vision, model.image_token_id, max_images, max_image_tiles, image_feature_tokens
        )
        self._encoders: dict[int, jax.stages.Compiled] = {}
        if self.image_limits is not None:
            self._tower = nnx.state(nnx.merge(self.graphdef, self.params).vision_tower)
            self._encode = jax.jit(
                functools.partial(encode_fn, nnx.graphdef(tower)),
                donate_argnames="pool",
                out_shardings=NamedSharding(self.mesh, P()),
            )
        rows = 1 if self.image_limits is None else self.image_limits.pool_rows
        pool = np.zeros((rows, self.text.hidden_size), self.dtype)
        self.image_pool = jax.device_put(pool, NamedSharding(self.mesh, P()))

    @property
    def image_buckets(self) -> tuple[int, ...]:
        """The tile counts of the encode programs (none without an image tower)."""
        return () if self.image_limits is None else image_buckets(self.image_limits.max_tiles)

    def encode(self, image: RequestImage, rows: np.ndarray) -> None:
        """Dispatch the encoding of one image into pool rows `rows` [tiles] (returns at once; the next step reads
        them). The image is checked already (`requests.validate`)."""
        bucket = next(b for b in self.image_buckets if b >= image.tiles)
        inputs = padded_image(image, bucket, rows, self.image_limits.pool_rows)
        replicated = NamedSharding(self.mesh, P())  # on every device of every process, as the pool is
        on_mesh = [jax.make_array_from_callback(x.shape, replicated, lambda index, x=x: x[index]) for x in inputs]
        program = self._encoders.get(bucket) or self._encoder(bucket, self._lowered_encoder(bucket))
        self.image_pool = program(self._tower, self.image_pool, *on_mesh)

    def _lowered_encoder(self, bucket: int) -> jax.stages.Lowered:
        """The encode program of a bucket, lowered."""
        pixels, grid, rows = padded_image(self._blank_image(), bucket, np.zeros(1, np.int32), 0)
        with jax.set_mesh(self.mesh):
            return self._encode.lower(self._tower, self.image_pool, pixels, grid, rows)

    def _encoder(self, bucket: int, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """A bucket's lowered encode program compiled and kept (once: `warm_up` makes them all)."""
        start = time.perf_counter()
        program = lowered.compile()
        logger.info("encode [%d tiles]: compiled in %.1f s", bucket, time.perf_counter() - start)
        self._encoders[bucket] = program
        return program

    def _blank_image(self) -> RequestImage:
        """A one-tile image of zeros (what compiling an encode program runs on)."""
        return RequestImage(np.zeros((1, *self.image_limits.tile_shape), np.float32), np.ones((1, 3), np.int32))

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
        tokenizer: Tokenizer | None = None,
        checkpoint: str = "",
        executable_cache: str | Path | None = None,
        max_num_batched_tokens: int | None = None,
        max_images: int = DEFAULT_MAX_IMAGES,
        max_image_tiles: int = DEFAULT_MAX_IMAGE_TILES,
        image_feature_tokens: int | None = None,
        compiler_options: dict[str, object] | None = None,
        snapshots: int | None = 0,
    ) -> Engine:
        """`max_num_seqs` slots per replica. With a per-device memory budget the page pool is what fits
        after the slots' fixed state and the prefix cache's `snapshots` (CacheBudgetError if not even one
        `max_context` sequence fits); without one every slot gets room for `max_context` tokens. snapshots None:
        one per slot, as many of them as fit a quarter of the budget beside one `max_context` sequence."""
        pages, dtype, tp = pages_for(max_context), model.model.embed_tokens.weight.dtype, mesh.shape[MODEL]
        if budget_bytes is None:
            snapshots = max_num_seqs if snapshots is None else snapshots
            replica = CacheLayout(max_num_seqs, max_num_seqs * pages, pages, chunk)
        else:
            layout = functools.partial(
                layout_for_budget,
                model.config,
                budget_bytes,
                max_num_seqs=max_num_seqs,
                max_context=max_context,
                max_chunk=chunk,
                dtype=dtype,
                tp=tp,
                draft=require_draft(model) if speculative != "none" else None,
            )
            if snapshots is None:
                snapshots = min(max_num_seqs, budget_bytes // 4 // snapshot_bytes(model.config, dtype, tp))
                while snapshots and not _fits(layout, snapshots):
                    snapshots -= 1
                if not snapshots:
                    logger.warning(
                        "no prefix cache: the budget holds one %d-token sequence and no snapshot beside it (raise "
                        "--kv-cache-mib or lower --max-model-len for one)",
                        max_context,
                    )
            replica = layout(snapshots=snapshots)
        return cls(
            model,
            replica,
            mesh,
            num_top,
            speculative,
            compiler_options,
            tokenizer=tokenizer,
            checkpoint=checkpoint,
            executable_cache=executable_cache,
            max_num_batched_tokens=max_num_batched_tokens,
            max_images=max_images,
            max_image_tiles=max_image_tiles,
            image_feature_tokens=image_feature_tokens,
            snapshots=snapshots,
        )

    @property
    def params(self) -> nnx.State:
        """The parameters the steps read, as the model's state."""
        return jax.tree.unflatten(self._param_tree, self._param_leaves)

    @property
    def programs_loaded(self) -> int:
        """The step programs read from the executable cache."""
        return sum("loaded_s" in times for times in self.program_times.values())

    @property
    def compilations(self) -> int:
        """Step and encode programs compiled or loaded so far (warm-up makes one per step shape and tile bucket;
        serving must add none)."""
        return len(self._programs) + len(self._encoders)

    @property
    def max_num_seqs(self) -> int:
        """Slots over all data-parallel replicas."""
        return self.slots

    @property
    def num_pages(self) -> int:
        """Pages over all data-parallel replicas."""
        return self.pages_per_replica * self.replicas

    @property
    def page_size(self) -> int:
        return PAGE_SIZE

    @property
    def mesh_spec(self) -> str:
        """The mesh as `--mesh` spells it: tpN or dpMtpN."""
        tp = self.mesh.shape[MODEL]
        return f"dp{self.replicas}tp{tp}" if self.replicas > 1 else f"tp{tp}"

    @property
    def shapes(self) -> tuple[StepShape, ...]:
        """Every step shape this engine runs."""
        few = (self.shape(False, False, FEW_TOKENS),) if self.slots_per_replica > FEW_TOKENS else ()
        return few + tuple(
            self.shape(prefill, speculative)
            for speculative in (False, True)[: 1 + self.speculative]
            for prefill in (False, True)
        )

    def shape(self, prefill: bool, speculative: bool, tokens: int | None = None) -> StepShape:
        """The shape of a step with prompt chunks (`prefill`) or a speculating slot, or neither; a plain decode
        step of at most FEW_TOKENS `tokens` (a replica's) has a shape of its own."""
        width = self.gamma + 1 if speculative else 1
        if prefill:
            return StepShape(self.max_num_batched_tokens, width, self.lanes, speculative)
        if not speculative and tokens is not None and tokens <= FEW_TOKENS < self.slots_per_replica:
            return StepShape(FEW_TOKENS, 1, 0, False)
        return StepShape(self.slots_per_replica * width, width, 0, speculative)

    @property
    def max_context(self) -> int:
        """The most tokens, prompt and output, one sequence can hold: the model's context, or less where the page
        table or the pool is smaller."""
        pages = min(self.pages_per_replica, self.max_pages)
        return min(self.text.max_position_embeddings, pages * self.page_size)

    def replica_of(self, slot: int) -> int:
        return slot // self.slots_per_replica

    def host_batch(
        self,
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
        defer: np.ndarray | None = None,
        image_rows: np.ndarray | None = None,
    ) -> StepBatch:
        """A host StepBatch of each slot's tokens[s, :counts[s]] (tokens: [S, any width] on the host), laid out
        flat in the smallest shape that holds them: a slot that brings more than the narrow width goes through
        lanes, a speculating slot gets γ + 1 tokens. `sampling[s]`: any object with the sampling fields (or None:
        idle values). defer: the decoding slots whose sample `resample` draws again after the step. image_rows [S,
        tokens' width]: each token's image-feature pool row, -1 for text (None: all text). ValueError when a
        replica's tokens or lanes do not fit a step."""
        slots = self.slots
        reset, is_prompt, emit, feedback, replay, speculate, defer = flags = [
            np.zeros(slots, bool) if flag is None else flag
            for flag in (reset, is_prompt, emit, feedback, replay, speculate, defer)
        ]
        speculating = speculate & (counts > 0)
        width = self.gamma + 1 if speculating.any() else 1
        busiest = int(np.asarray(counts).reshape(self.replicas, -1).sum(axis=1).max())
        shape = self.shape(bool(np.any(counts > width)), bool(speculating.any()), busiest)
        spans = pack_spans(
            tokens,
            counts,
            speculating,
            width=width,
            lane_width=self.lane_width,
            tokens=shape.tokens,
            lanes=shape.lanes,
            replicas=self.replicas,
        )
        flat_rows = np.full(spans[0].shape[0], -1, np.int32)
        if image_rows is not None:
            offsets = np.arange(self.slots) // self.slots_per_replica * shape.tokens + spans[1]
            for slot in np.flatnonzero((np.asarray(image_rows) >= 0).any(axis=1)):  # the slots bringing image tokens
                count = int(counts[slot])
                flat_rows[offsets[slot] : offsets[slot] + count] = image_rows[slot, :count]
        return StepBatch(
            spans[0],
            np.asarray(counts, np.int32),
            *spans[1:],
            *flags,
            page_table.copy(),
            sampling_columns(sampling),
            flat_rows,
        )

    def step(
        self,
        batch: StepBatch,
        allowed: np.ndarray | None = None,
        rounds: Mapping[int, tuple[int, bool, np.ndarray]] | None = None,
    ) -> Emitted:
        """Dispatch one step on a host batch (`host_batch`); returns at once with the device's outputs (`fetch`
        waits for them). Slots with `feedback` set start from the last token emitted for them by the previous
        step, which the host need not have read yet. The step is speculative when any slot has `speculate` set.
        allowed [S, mask_words] int32: the tokens each slot may sample, as packed bits (a row of -1: any; None:
        no slot is constrained, and nothing is sent for them). rounds: the speculating slots whose round runs under
        a constraint, each with (row, kept, masks [γ + 1, mask_words]): its row of its replica's ROUND_ROWS, where
        the state keeps its drafts from round to round; whether it verifies the drafts kept there (`Emitted.drafts`
        of its last round; else none); and each position's allowed tokens after the anchor and the drafts before it
        (`inkling_jax.step.Rounds`)."""
        if not self.speculative and np.any(batch.speculate):
            raise SpeculationError("a slot asks to speculate but this engine runs without --speculative")
        if np.any(batch.speculate & batch.defer) or (
            allowed is not None and np.any(batch.speculate & np.any(allowed != -1, axis=1))
        ):
            raise SpeculationError("a speculating slot's masks come in rounds, not allowed, and it defers no sample")
        if rounds and not all(batch.speculate[slot] for slot in rounds):
            raise SpeculationError("a constrained round's slot must speculate")
        shape, args = self.arguments(batch, allowed, rounds)
        program = self._programs.get(shape)
        if program is None:
            program = self._program(shape, args)
        emitted, self.state = program(*args)
        self.previous = emitted.last
        return emitted

    def resample(self, emitted: Emitted, batch: StepBatch, slots: Sequence[int], allowed: np.ndarray) -> Resampled:
        """Dispatch the deferred samples of the last step (`step` of a batch that defers these `slots`) under their
        masks, allowed [len(slots), mask_words] (`inkling_jax.step.resample_fn`, over the fewest rows of RESAMPLE_ROWS
        or the slots that hold them, its `Redraw` sent packed); returns the step's outputs with those samples in, for
        `fetch`. The next step starts from them."""
        count, words = len(slots), self.mask_words
        if allowed.shape != (count, words) or allowed.dtype != np.int32:
            raise ValueError(f"allowed must be int32 [{count}, {words}], got {allowed.dtype} {allowed.shape}")
        bucket = self._resample_rows(count)
        rows = np.full(bucket, self.slots, np.int32)
        rows[:count] = slots
        masks = np.full((bucket, words), -1, np.int32)
        masks[:count] = allowed
        at = np.minimum(rows, self.slots - 1)
        redraw = Redraw(rows, masks, jax.tree.map(lambda column: np.asarray(column)[at], batch.sampling))
        if bucket not in self._redraw_layouts:
            self._redraw_layouts[bucket] = BatchLayout.of(redraw, 1)
        layout = self._redraw_layouts[bucket]
        packed = layout.pack(redraw)
        replicated = NamedSharding(self.mesh, P())  # one transfer; each process sends the same host values
        on_mesh = jax.make_array_from_callback(packed.shape, replicated, lambda index: packed[index])
        args = (self.state, emitted.last, emitted.count, on_mesh)
        program = self._resamplers.get(bucket) or self._resampler(bucket, args, layout)
        redrawn, self.state = program(*args)
        self.previous = redrawn.last
        return Resampled(emitted, tuple(slots), redrawn)

    def _resample_rows(self, count: int) -> int:
        """The rows of the resample program that takes `count` deferred slots."""
        return next((rows for rows in RESAMPLE_ROWS if count <= rows < self.slots), self.slots)

    def _resampler(self, bucket: int, args: tuple, layout: BatchLayout) -> jax.stages.Compiled:
        """The resample program of `bucket` rows: compiled, or taken from an engine of this process that compiled
        it for arguments of the same shapes, dtypes and shardings (the program is the same function of them)."""
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple((x.shape, x.dtype, x.sharding) for x in leaves), layout, self._options["compiler_options"])
        program = RESAMPLERS.get(key)
        if program is None:
            with jax.set_mesh(self.mesh):
                options = between_steps_options(jax.default_backend())
                program = RESAMPLERS.put(key, self._resample.lower(*args, layout=layout).compile(options or None))
        self._resamplers[bucket] = program
        return program

    def save_snapshot(self, slot: int | None, index: int = 0, boundary: int = 0) -> None:
        """Dispatch the save of what `slot` kept at the page `boundary` (the last one its length landed on, or the
        one before) into its replica's snapshot `index` (`inkling_jax.cache.save_snapshot`; None: save nothing)."""
        with jax.set_mesh(self.mesh):  # the program splits by replica on the mesh
            self._snapshots = self._save(self.state, self._snapshots, self._move(slot, index, boundary))

    def restore_snapshot(
        self, slot: int | None, index: int, boundary: int, prompt_mask: np.ndarray, output_counts: np.ndarray
    ) -> None:
        """Dispatch the restore of its replica's snapshot `index`, saved at the page `boundary`, into `slot`, with
        the sampling state there (prompt_mask [vocab] bool, output_counts [vocab] int32): the slot's next step
        resumes the sequence at the boundary (the pages before it in its page table), not from a reset (None:
        restore nothing)."""
        vocab, replica = self.text.unpadded_vocab_size, -1 if slot is None else self.replica_of(slot)
        if prompt_mask.shape != (vocab,) or output_counts.shape != (vocab,):
            raise ValueError(
                f"prompt_mask and output_counts must be [{vocab}], got {prompt_mask.shape}, {output_counts.shape}"
            )
        masks, counts = np.zeros((self.replicas, vocab), bool), np.zeros((self.replicas, vocab), np.int32)
        if slot is not None:
            masks[replica], counts[replica] = prompt_mask, output_counts
        by_replica = (jax.device_put(x, self.by_slot) for x in (masks, counts))
        with jax.set_mesh(self.mesh):
            self.state = self._restore(self.state, self._snapshots, self._move(slot, index, boundary), *by_replica)

    def _move(self, slot: int | None, index: int = 0, boundary: int = 0) -> SnapshotMove:
        """A `SnapshotMove` for `slot`'s replica alone (None: for none), on the mesh."""
        if self._snapshots is None:
            raise ValueError("this engine keeps no snapshots (snapshots=0)")
        if slot is not None and not (0 <= index < self.snapshots_per_replica and boundary % PAGE_SIZE == 0):
            raise ValueError(f"snapshot {index} of {self.snapshots_per_replica} at boundary {boundary}")
        replicas = self.replicas
        valid = np.arange(replicas) == (self.replica_of(slot) if slot is not None else -1)
        move = SnapshotMove(
            np.full(replicas, (slot or 0) % self.slots_per_replica, np.int32),
            np.full(replicas, index, np.int32),
            np.full(replicas, boundary, np.int32),
            valid,
        )
        return jax.tree.map(lambda x: jax.device_put(x, self.by_slot), move)

    def warm_up_snapshots(self) -> None:
        """Compile the snapshot programs (run once, moving nothing), so that serving with a prefix cache never
        compiles."""
        if self._snapshots is not None:
            self.save_snapshot(None)
            vocab = self.text.unpadded_vocab_size
            self.restore_snapshot(None, 0, 0, np.zeros(vocab, bool), np.zeros(vocab, np.int32))

    def warm_up_resample(self) -> None:
        """Compile `resample` for each count of rows (an idle step's outputs, resampled with every token allowed), so
        that constrained serving never compiles."""
        batch = self.idle_batch(self.shape(False, False, 1))
        for bucket in sorted({self._resample_rows(count) for count in (*RESAMPLE_ROWS, self.slots)}):
            if bucket not in self._resamplers:
                allowed = np.full((bucket, self.mask_words), -1, np.int32)
                self.fetch(self.resample(self.step(batch), batch, range(bucket), allowed))

    def arguments(
        self,
        batch: StepBatch,
        allowed: np.ndarray | None = None,
        rounds: Mapping[int, tuple[int, bool, np.ndarray]] | None = None,
    ) -> tuple[StepShape, tuple]:
        """The shape of the step program that runs a host batch, and the program's arguments: the parameters'
        arrays, the state, the batch packed into one int32 buffer on the mesh (split by replica: one transfer),
        the previous step's tokens, the image features, the allowed tokens and a speculative step's constrained
        rounds, packed (`step`). They hold the engine's state, which the next step donates: good for one call."""
        speculative = bool(np.any(batch.speculate))
        shape = StepShape(
            batch.token_ids.shape[0] // self.replicas,
            self.gamma + 1 if speculative else 1,
            batch.lane_slot.shape[0] // self.replicas,
            speculative,
        )
        packed = self._layout(shape).pack(batch)
        on_mesh = jax.make_array_from_callback(packed.shape, self.by_slot, lambda index: packed[index])
        if allowed is None:
            masks = self._any_token
        else:
            if allowed.shape != (self.slots, self.mask_words) or allowed.dtype != np.int32:
                raise ValueError(
                    f"allowed must be int32 [{self.slots}, {self.mask_words}], got {allowed.dtype} {allowed.shape}"
                )
            masks = jax.make_array_from_callback(allowed.shape, self.by_slot, lambda index: allowed[index])
        constrained = None
        if speculative and rounds:
            host = self._rounds_layout.pack(self._host_rounds(rounds))
            constrained = jax.make_array_from_callback(host.shape, self.by_slot, lambda index: host[index])
        elif speculative:
            constrained = self._no_rounds
        return shape, (self._param_leaves, self.state, on_mesh, self.previous, self.image_pool, masks, constrained)

    def _host_rounds(self, rounds: Mapping[int, tuple[int, bool, np.ndarray]]) -> Rounds:
        """The constrained rounds as `Rounds`, each at its row of its replica's ROUND_ROWS (its slot numbered in its
        replica)."""
        per, words = self.slots_per_replica, self.mask_words
        slot = np.full((self.replicas, ROUND_ROWS), per, np.int32)
        kept = np.zeros((self.replicas, ROUND_ROWS), bool)
        allowed = np.full((self.replicas, ROUND_ROWS, self.gamma + 1, words), -1, np.int32)
        for index, (row, keep, masks) in rounds.items():
            replica = self.replica_of(index)
            if not 0 <= row < ROUND_ROWS or slot[replica, row] != per:
                raise SpeculationError(f"round row {row} is not a free one of a replica's {ROUND_ROWS}")
            if masks.shape != (self.gamma + 1, words) or masks.dtype != np.int32:
                want = f"int32 [{self.gamma + 1}, {words}]"
                raise ValueError(f"a round's masks are {want}, got {masks.dtype} {masks.shape}")
            slot[replica, row], kept[replica, row], allowed[replica, row] = index % per, keep, masks
        return Rounds(slot.reshape(-1), kept.reshape(-1), allowed.reshape(-1, self.gamma + 1, words))

    def _layout(self, shape: StepShape) -> BatchLayout:
        """Where a host batch of `shape`'s arrays lie in its packed buffer (the same for every batch of it)."""
        if shape not in self._layouts:
            self._layouts[shape] = BatchLayout.of(self.idle_batch(shape), self.replicas)
        return self._layouts[shape]

    def _program(self, shape: StepShape, args: tuple) -> jax.stages.Compiled:
        """The step program of `shape`: another engine's of this process, or read from the executable cache, else
        lowered and compiled (and stored there); kept for the engine's life."""
        key = self._loaded(shape, args)
        return self._programs.get(shape) or self._compiled(shape, *self._lowered(shape, args), key)

    def _loaded(self, shape: StepShape, args: tuple) -> str:
        """Take the step program of `shape` into the engine's programs from an engine of this process that has it
        (the same key: the same program), else from the executable cache, where it is there; returns its key."""
        start = time.perf_counter()
        key = program_key(shape.label, self.mesh, self.program_options(shape), self.graphdef, args)
        compiled = STEP_PROGRAMS.get(key)
        if compiled is not None:
            logger.info("step [%s]: taken from another engine of this process", shape)
            self.program_times[shape] = {"shared_s": time.perf_counter() - start}
        elif self._executables is not None:
            import_kernel_runtimes()  # what its kernels' custom calls need, with no kernel lowered here
            compiled = self._executables.load(key, args, list(self.mesh.devices.flat))
            if compiled is not None:
                logger.info("step [%s]: loaded from the executable cache in %.1f s", shape, time.perf_counter() - start)
                self.program_times[shape] = {"loaded_s": time.perf_counter() - start}
                STEP_PROGRAMS.put(key, compiled)
        if compiled is not None:
            self._programs[shape] = compiled
        return key

    def _lowered(self, shape: StepShape, args: tuple) -> tuple[jax.stages.Lowered, float]:
        """The step's lowering for `shape` and the seconds it took."""
        start = time.perf_counter()
        lowered = self._lower(args, shape)
        return lowered, time.perf_counter() - start

    def _compiled(self, shape: StepShape, lowered: jax.stages.Lowered, lower_s: float, key: str) -> jax.stages.Compiled:
        """A lowered step program compiled by XLA with its shape's options (and stored in the executable cache),
        its Mosaic GPU kernels built first on many threads (`kernel_builds`; XLA builds them one by one)."""
        shape_options = shape_compiler_options(jax.default_backend(), shape)
        building = time.perf_counter()
        built = self._kernels.build(lowered) if self._kernels is not None else 0
        compiling = time.perf_counter()
        if self._executables is None:
            compiled = lowered.compile(shape_options or None)
        else:
            compiled = self._executables.compile(lowered, shape_options)
        done = time.perf_counter()
        line = (
            f"step [{shape}]: compiled in {lower_s + done - building:.1f} s (lowered {lower_s:.1f} s, {built} "
            f"kernels built in {compiling - building:.1f} s, XLA {done - compiling:.1f} s)"
        )
        if self._executables is not None and self._executables.store(key, compiled):
            line += f", stored in the executable cache in {time.perf_counter() - done:.1f} s"
        logger.info(line)
        self.program_times[shape] = {
            "lower_s": lower_s,
            "kernels_s": compiling - building,
            "compile_s": done - compiling,
        }
        self._programs[shape] = STEP_PROGRAMS.put(key, compiled)
        return compiled

    def program_options(self, shape: StepShape) -> dict[str, object]:
        """What keys the step program of this shape in the executable cache beyond its arguments, the mesh and the
        graph definition: the step's options, the XLA options it compiles with and its packed batch's layout."""
        shape_options = shape_compiler_options(jax.default_backend(), shape)
        return {
            **self._options,
            "shape": dataclasses.asdict(shape),
            "shape_options": shape_options,
            "layout": repr(self._layout(shape)),
        }

    def _lower(self, args: tuple, shape: StepShape) -> jax.stages.Lowered:
        """Trace and lower the step for `args` (what a restart over the executable cache skips)."""
        with jax.set_mesh(self.mesh):
            return self._step.lower(
                *args,
                speculative=shape.speculative,
                width=shape.width,
                layout=self._layout(shape),
                rounds_layout=self._rounds_layout if shape.speculative else None,
            )

    @staticmethod
    def fetch(emitted: Emitted | Resampled) -> Emitted:
        """The step's outputs as numpy arrays, on every process (they are replicated); a resampled step's with its
        redrawn samples in."""
        parts = (emitted.emitted, emitted.redrawn) if isinstance(emitted, Resampled) else (emitted,)
        local = jax.tree.map(lambda x: x.addressable_data(0), parts)
        for shard in jax.tree.leaves(local):
            shard.copy_to_host_async()  # every copy in flight before the first is waited for
        host = jax.tree.map(np.asarray, local)
        if not isinstance(emitted, Resampled):
            return host[0]
        step, redrawn = host
        slots, count = list(emitted.slots), len(emitted.slots)
        tokens, logprobs = step.tokens.copy(), step.logprobs.copy()
        tokens[slots, 0], logprobs[slots, 0] = redrawn.tokens[:count], redrawn.logprobs[:count]
        return dataclasses.replace(step, tokens=tokens, logprobs=logprobs, last=redrawn.last)

    def idle_batch(self, shape: StepShape) -> StepBatch:
        """A batch of `shape` in which no slot does anything (for compiling a shape)."""
        replicas, slots = self.replicas, self.slots
        tokens, lanes = np.zeros(replicas * shape.tokens, np.int32), np.zeros(replicas * shape.lanes, np.int32)
        flags = [np.zeros(slots, bool) for _ in range(5)]
        speculate = np.full(
            slots, shape.speculative
        )  # with counts 0 nothing runs, but the program is the speculative one
        zeros = np.zeros(slots, np.int32)
        return StepBatch(
            tokens,
            zeros,
            zeros,
            lanes,
            lanes,
            lanes,
            *flags,
            speculate,
            np.zeros(slots, bool),
            np.zeros((slots, self.max_pages), np.int32),
            sampling_columns([None] * slots),
            np.full(replicas * shape.tokens, -1, np.int32),
        )

    def warm_up(self) -> None:
        """Compile or load (and run once) every step shape, and compile the encode program of every tile bucket
        and the snapshot programs, so serving never compiles. The executable cache is read for every shape at once
        (a thread each); lowering is Python (one at a time under the GIL), XLA's compile is not: the shapes not in
        the cache are lowered one after the other, most tokens first (the longest XLA compile starts first), then
        the encode programs, each handed to a thread of its own for XLA as soon as it is lowered; then a first run
        of each step, one after the other. Logs each program's time to ready: its compilation and a step's first
        run."""
        missing = sorted((shape for shape in self.shapes if shape not in self._programs), key=lambda s: -s.tokens)
        buckets = [bucket for bucket in self.image_buckets if bucket not in self._encoders]
        if missing or buckets:
            arguments = {shape: self.arguments(self.idle_batch(shape))[1] for shape in missing}
            with ThreadPoolExecutor(len(missing) + len(buckets), thread_name_prefix="step-compile") as pool:
                loads = pool.map(lambda shape: self._loaded(shape, arguments[shape]), missing)
                keys = dict(zip(missing, loads, strict=True))
                compiling = [
                    pool.submit(self._compiled, shape, *self._lowered(shape, arguments[shape]), keys[shape])
                    for shape in missing
                    if shape not in self._programs
                ]
                compiling += [pool.submit(self._encoder, bucket, self._lowered_encoder(bucket)) for bucket in buckets]
                for program in compiling:
                    program.result()
        for shape in self.shapes:
            start = time.perf_counter()
            self.fetch(self.step(self.idle_batch(shape)))
            self.program_times[shape]["first_run_s"] = time.perf_counter() - start
            logger.info("step [%s]: first run in %.1f s", shape, time.perf_counter() - start)
        self.warm_up_snapshots()


class BatchedTokensError(ValueError):
    """A step's token budget (`--max-num-batched-tokens`) that leaves no room for a prompt token."""


def batched_tokens(asked: int | None, slots: int, gamma: int, chunk: int) -> int:
    """A replica's tokens in a step with prompt chunks: `asked`, or by default every slot's decode tokens (γ + 1
    each when speculating) and two chunks. BatchedTokensError when `asked` leaves no room for a prompt token."""
    decode_tokens = slots * (gamma + 1)
    if asked is None:
        return decode_tokens + 2 * chunk
    if asked <= decode_tokens:
        raise BatchedTokensError(
            f"max_num_batched_tokens {asked} leaves no prompt token beside the {decode_tokens} decode tokens of "
            f"{slots} slots{' speculating' * bool(gamma)}: it must be at least {decode_tokens + 1}"
        )
    return asked


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """The image limits and feature pool, as every command that runs the engine takes them."""
    parser.add_argument(
        "--max-images",
        type=int,
        default=DEFAULT_MAX_IMAGES,
        help="images one request may carry (image models; 0: take no images, compile no image program)",
    )
    parser.add_argument(
        "--max-image-tiles",
        type=int,
        default=DEFAULT_MAX_IMAGE_TILES,
        help="tiles (image tokens) one image may have; the encode programs are compiled for powers of two up to it",
    )
    parser.add_argument(
        "--image-feature-tokens",
        type=int,
        help="rows of the device pool holding the admitted requests' image features (default: four images of "
        "--max-image-tiles); a request waits until its images' tiles fit",
    )


def add_batched_tokens_argument(parser: argparse.ArgumentParser) -> None:
    """`--max-num-batched-tokens`, as every command that runs the engine takes it (vLLM's name)."""
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens of a step with prompt chunks, per data-parallel replica (decoding, verifying and prompt tokens; "
        "default: every slot's decode tokens and two chunks)",
    )


def add_max_model_len_argument(parser: argparse.ArgumentParser) -> None:
    """`--max-model-len`, as every command that runs the engine takes it (vLLM's name)."""
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="tokens one sequence may hold, prompt and output, rounded up to whole pages of 128 (default: the model's "
        "context); requests past it are refused, and --kv-cache-mib need only hold one sequence this long",
    )


def add_prefix_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The prefix cache's flags, as every command that runs the engine takes them."""
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute every prompt whole (by default a request resumes after the pages of an earlier one it starts "
        "with)",
    )
    parser.add_argument(
        "--prefix-snapshots",
        type=int,
        help="states the prefix cache saves at page boundaries, where later requests resume, per data-parallel replica "
        "(default: one per slot, within a quarter of --kv-cache-mib; each holds the sliding window's K/V and the "
        "convolution states)",
    )


GPU_STEP = {
    "xla_gpu_dot_merger_threshold_mb": 0,
    "xla_gpu_autotune_level": 0,
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_enable_dynamic_slice_fusion": True,
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE",
}


def between_steps_options(platform: str) -> dict[str, object]:
    """The XLA options a program the loop runs between steps adds on `platform` (a resample, a prefix snapshot's
    save or restore): a plain decode step's. On a GPU their conditionals and loops (the sampler's branches and its
    top-p search, a save a replica skips) then run in command buffers, decided on the device; outside them the host
    waits for each predicate, that is for the step before to end, and the loop no longer runs ahead of the device
    (bench/results/serve_constraints_proxy_h100.md)."""
    return shape_compiler_options(platform, StepShape(1, 1, 0, False))


def shape_compiler_options(platform: str, shape: StepShape) -> dict[str, object]:
    """The XLA options a step program of this shape adds on `platform` to the engine's.

    GPU, every shape: no merging of dots that share an input (XLA would concatenate a scanned layer's q, k and v
    weights, out of their stacks, on every step), and the matmuls in cuBLAS, untuned, reading each layer's weights
    in place in their stacks (dynamic-slice fusion): untuned Triton gemms' default tiles read the weights many
    times over, and no autotuning lengthens a cold start. The command buffers run kernels that do not depend on
    each other side by side (a layer's small norms, clips and cache writes). They also hold the step's
    conditionals and loops, so that a branch the step skips (sampling in a greedy batch, clearing the rows of new
    sequences) is decided on the device: a conditional outside them makes the host wait for its predicate. Each
    option's effect on the proxy's decode step is measured in bench/results/README.md (step_profile). Plain decode
    steps (one token per slot) on TPU: small gathers stay off SparseCore (jax 0.11 offloads them
    there, and batch-1 decode runs at half speed)."""
    decode = not (shape.lanes or shape.speculative)
    if platform == "gpu":
        return dict(GPU_STEP)
    if platform == "tpu" and decode:
        return {"xla_tpu_offload_gather_to_sparsecore": False}
    return {}


@dataclasses.dataclass(frozen=True)
class Resampled:
    """A step's outputs and the samples `Engine.resample` drew again for some of its slots (`Engine.fetch` reads
    them as one `Emitted`)."""

    emitted: Emitted
    slots: tuple[int, ...]
    redrawn: Redrawn


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A model source with its config and tokenizer read and no weights yet: what the front doors check
    requests against before the expensive load."""

    path: str
    config: ModelConfig
    tokenizer: Tokenizer | None
    load_format: str


def open_checkpoint(path: str | Path, load_format: str = "auto") -> Checkpoint:
    """Read the config (and tokenizer) of `path`: a checkpoint directory, or for `load_format="dummy"` also a
    config JSON file. A dummy model takes the directory's tokenizer when it has one (vLLM's dummy loading does the
    same), so a directory of config and tokenizer alone serves text. CheckpointError / ConfigError /
    TokenizerError name what is wrong."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    path = Path(path)
    if not (path / "config.json").is_file() and not (load_format == "dummy" and path.is_file()):
        wanted = "a checkpoint directory (no config.json)"
        raise CheckpointError(f"{path} is not {wanted}" + (" nor a config file" if load_format == "dummy" else ""))
    config = load_config(path)
    tokenizer = None
    if (path / TOKENIZER_FILE).is_file():
        tokenizer = Tokenizer.from_checkpoint(path)
        try:
            tokenizer.check_against(config.text)
        except TokenizerError as error:
            raise CheckpointError(f"{path}: {error}") from error
    return Checkpoint(str(path), config, tokenizer, load_format)


def engine_options(args: argparse.Namespace) -> dict:
    """`load_engine`'s options from the flags the command-line front ends share (mesh, dtype, slots, chunk, page
    budget, speculation, token budget, context where the command takes it, image limits and pool, prefix cache)."""
    names = ("mesh", "dtype", "max_num_seqs", "chunk", "kv_cache_mib", "speculative", "max_num_batched_tokens")
    names += ("max_images", "max_image_tiles", "image_feature_tokens", "prefix_snapshots")
    options = {name: getattr(args, name) for name in names} | {"max_context": getattr(args, "max_model_len", None)}
    return options | ({"prefix_snapshots": 0} if args.no_prefix_cache else {})


def load_engine(
    checkpoint: str | Path | Checkpoint,
    *,
    mesh: str = "tp1",
    dtype: str = "bfloat16",
    max_num_seqs: int = 8,
    chunk: int = 64,
    kv_cache_mib: float | None = None,
    speculative: str = "none",
    load_format: str = "auto",
    max_context: int | None = None,
    executable_cache: str | Path | None = None,
    max_num_batched_tokens: int | None = None,
    max_images: int = DEFAULT_MAX_IMAGES,
    max_image_tiles: int = DEFAULT_MAX_IMAGE_TILES,
    image_feature_tokens: int | None = None,
    compiler_options: dict[str, object] | None = None,
    prefix_snapshots: int | None = None,
) -> Engine:
    """The model of `checkpoint` on the mesh `mesh` (read straight into its shards, or with `load_format`
    "dummy" random weights built there from the config alone) and its decode state: `max_num_seqs` slots per
    replica, each with room for `max_context` tokens (default: the model's context) or, with `kv_cache_mib`,
    the page pool that fits that many MiB per device. Errors are ValueErrors naming what is wrong (config,
    checkpoint, tokenizer, mesh, cache budget, speculation without a draft), raised before any weight is read
    where they can be. speculative: one of SPECULATIVE_MODES. executable_cache: a directory for the compiled step
    programs (None: compile every one). max_num_batched_tokens, the image options and compiler_options: see
    `Engine`. prefix_snapshots: the prefix cache's snapshots per replica (None: one per slot, within a quarter of
    a budget; 0: no prefix cache)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    if max_num_seqs < 1 or chunk < 1:
        raise ValueError("max_num_seqs and chunk must be at least 1")
    if prefix_snapshots is not None and prefix_snapshots < 0:
        raise ValueError(f"prefix_snapshots must be at least 0 (0: no prefix cache), got {prefix_snapshots}")
    source = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, load_format)
    if speculative not in SPECULATIVE_MODES:
        raise SpeculationError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {speculative!r}")
    context = source.config.text.max_position_embeddings
    if max_context is not None and not 1 <= max_context <= context:
        raise ConfigError(f"the longest sequence must be 1 to the model's {context} tokens, got {max_context}")
    gamma = 0
    if speculative != "none":
        gamma = require_draft(source.config, source.path).block_size  # before loading anything
    device_mesh = make_mesh(mesh, source.config.text)
    batched_tokens(max_num_batched_tokens, max_num_seqs, gamma, chunk)
    if source.load_format == "dummy":
        model = dummy_model(source.config, DTYPES[dtype], device_mesh, source=source.path)
    else:
        _, model = load_model(source.path, DTYPES[dtype], device_mesh)  # straight into its shards
    return Engine.create(
        model,
        device_mesh,
        max_num_seqs=max_num_seqs,
        chunk=chunk,
        max_context=max_context or context,
        budget_bytes=None if kv_cache_mib is None else int(kv_cache_mib * 2**20),
        num_top=MAX_LOGPROBS,
        speculative=speculative,
        tokenizer=source.tokenizer,
        checkpoint=source.path,
        executable_cache=executable_cache,
        max_num_batched_tokens=max_num_batched_tokens,
        max_images=max_images,
        max_image_tiles=max_image_tiles,
        image_feature_tokens=image_feature_tokens,
        compiler_options=compiler_options,
        snapshots=prefix_snapshots,
    )


def _fits(layout: Callable[..., CacheLayout], snapshots: int) -> bool:
    try:
        layout(snapshots=snapshots)
    except CacheBudgetError:
        return False
    return True


def _flat_step(
    graphdef: nnx.GraphDef,
    param_tree: jax.tree_util.PyTreeDef,
    param_leaves: list[jax.Array],
    state: DecodeState,
    packed: jax.Array,
    previous: jax.Array,
    image_pool: jax.Array,
    allowed: jax.Array,
    rounds: jax.Array | None,
    *,
    layout: BatchLayout,
    rounds_layout: BatchLayout | None,
    **static: object,
) -> tuple[Emitted, DecodeState]:
    """`step_fn` over the parameters' arrays (in `param_tree`'s order), a packed host batch (`layout`) and a
    speculative step's packed constrained rounds (`rounds_layout`)."""
    params = jax.tree.unflatten(param_tree, param_leaves)
    batch, rounds = layout.unpack(packed), None if rounds_layout is None else rounds_layout.unpack(rounds)
    return step_fn(graphdef, params, state, batch, previous, image_pool, allowed, rounds, **static)


def _packed_resample(
    state: DecodeState, last: jax.Array, count: jax.Array, packed: jax.Array, *, layout: BatchLayout
) -> tuple[Redrawn, DecodeState]:
    """`resample_fn` over its `Redraw` packed into one int32 buffer (`layout`)."""
    return resample_fn(state, last, count, layout.unpack(packed))
