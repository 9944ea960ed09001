"""`python -m inkling_jax.generate`: batch generation of JSONL requests through the scheduler.

    python -m inkling_jax.generate --checkpoint DIR --input IN.jsonl --output OUT.jsonl
        [--dtype float32|bfloat16] [--max-num-seqs N] [--chunk C] [--kv-cache-mib M] [--mesh tpN|dpMtpN]
        [--max-num-batched-tokens N] [--prefill-budget T] [--speculative none|dspark|dspark-greedy]
        [--max-images 16] [--max-image-tiles 4096] [--image-feature-tokens N]
        [--load-format auto|dummy]
        [--compilation-cache DIR|none] [--quiet]
        [--coordinator-address HOST:PORT|auto --num-processes N --process-id I]

The lines in and out are described in `inkling_jax.runtime.batch`; `python -m inkling_jax.offline` is the
same runner.
"""

from __future__ import annotations

import sys

from inkling_jax.runtime import batch


def main(argv: list[str] | None = None) -> int:
    return batch.main(argv, module="inkling_jax.generate")


if __name__ == "__main__":
    sys.exit(main())
