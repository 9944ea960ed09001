"""`python -m inkling_jax.score`: float32 logits of one causal forward over a list of token ids.

    python -m inkling_jax.score --checkpoint DIR --input IDS.json --output LOGITS.npy [--dtype float32|bfloat16]

IDS.json is a JSON list of token ids; LOGITS.npy gets float32 [len(ids), unpadded_vocab_size].
"""

from __future__ import annotations

import logging
import sys

import jax.numpy as jnp
import numpy as np

from inkling_jax.checkpoint import CheckpointError, load_model
from inkling_jax.cli import argument_parser
from inkling_jax.config import ConfigError
from inkling_jax.forward import logits_fn
from inkling_jax.token_ids import TokenIdError, read_token_ids

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def log_to_stderr() -> None:
    """Show inkling_jax's progress lines (e.g. checkpoint bytes vs device bytes) on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("inkling_jax")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser("inkling_jax.score", __doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--input", required=True, help="JSON file holding a list of token ids")
    parser.add_argument("--output", required=True, help="where to write the float32 logits (.npy)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter/activation dtype")
    args = parser.parse_args(argv)
    log_to_stderr()
    try:
        config, model = load_model(args.checkpoint, DTYPES[args.dtype])
        ids = read_token_ids(args.input, config.text)
    except (ConfigError, CheckpointError, TokenIdError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logits = logits_fn(model)(jnp.asarray([ids], jnp.int32))[0]
    try:
        np.save(args.output, np.asarray(logits, np.float32))
    except OSError as error:
        print(f"error: cannot write {args.output}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
