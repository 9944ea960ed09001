"""The served model: a checkpoint loaded straight into its shards on a mesh, its tokenizer, and the
engine that steps it (`inkling_jax.engine.Engine`), sized for the model's whole context per slot or
for a per-device memory budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from inkling_jax import engine as core
from inkling_jax.cache import PAGE_SIZE
from inkling_jax.checkpoint import CheckpointError, load_model
from inkling_jax.config import TextConfig, load_config
from inkling_jax.model.draft import require_draft
from inkling_jax.score import DTYPES
from inkling_jax.sharding import make_mesh
from inkling_jax.speculative import SPECULATIVE_MODES, SpeculationError
from inkling_jax.tokenizer import Tokenizer, TokenizerError
from serving.requests import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class Engine:
    core: core.Engine
    tokenizer: Tokenizer | None
    checkpoint: str
    mesh_spec: str
    dtype: str

    @property
    def text(self) -> TextConfig:
        return self.core.text

    @property
    def max_num_seqs(self) -> int:
        """Slots over all data-parallel replicas."""
        return self.core.slots

    @property
    def num_pages(self) -> int:
        return self.core.pages_per_replica * self.core.replicas

    @property
    def page_size(self) -> int:
        return PAGE_SIZE


def load_engine(
    checkpoint: str,
    *,
    mesh: str = "tp1",
    dtype: str = "bfloat16",
    max_num_seqs: int = 8,
    chunk: int = 64,
    kv_cache_mib: float | None = None,
    speculative: str = "none",
) -> Engine:
    """Load `checkpoint` onto the mesh `mesh` and size the decode state; errors are ValueErrors naming
    what is wrong (config, checkpoint, tokenizer, mesh, cache budget, speculation without a draft).
    speculative: one of `inkling_jax.speculative.SPECULATIVE_MODES`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    if max_num_seqs < 1 or chunk < 1:
        raise ValueError("max_num_seqs and chunk must be at least 1")
    if not Path(checkpoint, "config.json").is_file():
        raise CheckpointError(f"{checkpoint} is not a checkpoint directory (no config.json)")
    if speculative not in SPECULATIVE_MODES:
        raise SpeculationError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {speculative!r}")
    config = load_config(checkpoint)
    if speculative != "none":
        require_draft(config, checkpoint)  # before loading anything
    device_mesh = make_mesh(mesh, config.text)
    config, model = load_model(checkpoint, DTYPES[dtype], device_mesh)
    tokenizer = None
    if Path(checkpoint, "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_checkpoint(checkpoint)
        try:
            tokenizer.check_against(config.text)
        except TokenizerError as error:
            raise CheckpointError(f"{checkpoint}: {error}") from error
    budget = None if kv_cache_mib is None else int(kv_cache_mib * 2**20)
    engine = core.Engine.create(
        model, device_mesh, max_num_seqs=max_num_seqs, chunk=chunk, max_context=config.text.max_position_embeddings,
        budget_bytes=budget, num_top=MAX_LOGPROBS, speculative=speculative,
    )  # fmt: skip
    return Engine(engine, tokenizer, str(checkpoint), mesh, dtype)
