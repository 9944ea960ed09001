"""`python -m inkling_jax.complete`: greedy continuation of token ids (the project's smoke run).

    python -m inkling_jax.complete --checkpoint DIR --prompt-ids 1,2,3 [--max-tokens 16] [--dtype ...]

Prints the continuation's token ids as a JSON list.
"""

from __future__ import annotations

import json
import sys

from inkling_jax.checkpoint import CheckpointError, load_model
from inkling_jax.cli import argument_parser
from inkling_jax.config import ConfigError
from inkling_jax.forward import greedy_continuation
from inkling_jax.score import DTYPES, log_to_stderr
from inkling_jax.token_ids import TokenIdError, validate_token_ids


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser("inkling_jax.complete", __doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory")
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter and activation dtype")
    args = parser.parse_args(argv)
    log_to_stderr()
    try:
        config, model = load_model(args.checkpoint, DTYPES[args.dtype])
        try:
            ids = [int(part) for part in args.prompt_ids.split(",")]
        except ValueError as error:
            raise TokenIdError(f"--prompt-ids must be comma-separated integers: {error}") from error
        validate_token_ids(ids, config.text)
        if args.max_tokens < 1:
            raise TokenIdError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    except (ConfigError, CheckpointError, TokenIdError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(greedy_continuation(model, ids, args.max_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
