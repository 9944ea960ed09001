"""`python -m inkling_jax.offline`: the batch runner of `python -m inkling_jax.generate` (the same flags, lines
and outputs; see `inkling_jax.runtime.batch`), under the name offline jobs on pods use.
"""

from __future__ import annotations

import sys

from inkling_jax.runtime import batch


def main(argv: list[str] | None = None) -> int:
    return batch.main(argv, module="inkling_jax.offline")


if __name__ == "__main__":
    sys.exit(main())
