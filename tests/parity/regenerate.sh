#!/usr/bin/env bash
# Regenerate tests/fixtures/parity/ from the PyTorch reference implementation.
#
#   bash tests/parity/regenerate.sh [make_fixtures.py args, e.g. --only tiny_text]
#
# Uses a Python 3.11 virtual environment with the pinned reference stack, created on first use in
# $REFVENV (default: <repo>/.refvenv, git-ignored). Set PYTHON to choose the interpreter that
# creates it (default: python3.11).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
REFVENV="${REFVENV:-$ROOT/.refvenv}"
PYTHON="${PYTHON:-python3.11}"
PINS=(torch==2.13.0 transformers==5.23.0 safetensors "ml_dtypes>=0.5")

if [[ ! -x "$REFVENV/bin/python" ]]; then
    echo "creating reference venv in $REFVENV" >&2
    "$PYTHON" -m venv "$REFVENV"
fi

if ! "$REFVENV/bin/python" - <<'EOF'
import sys

try:
    import ml_dtypes  # noqa: F401
    import safetensors  # noqa: F401
    import torch
    import transformers
except ImportError:
    sys.exit(1)
ok = transformers.__version__ == "5.23.0" and torch.__version__.split("+")[0] == "2.13.0"
sys.exit(0 if ok and sys.version_info[:2] == (3, 11) else 1)
EOF
then
    echo "installing ${PINS[*]} into $REFVENV" >&2
    "$REFVENV/bin/python" -m pip install --quiet "${PINS[@]}"
fi

exec "$REFVENV/bin/python" "$ROOT/tests/parity/make_fixtures.py" "$@"
