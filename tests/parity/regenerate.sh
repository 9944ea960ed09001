#!/usr/bin/env bash
# Regenerate tests/fixtures/parity/ from the PyTorch reference implementation, or with --images
# tests/fixtures/images/ from its image processor.
#
#   bash tests/parity/regenerate.sh [make_fixtures.py args, e.g. --only tiny_text]
#   bash tests/parity/regenerate.sh --images [make_image_fixtures.py args]
#
# Uses a Python 3.11 virtual environment with the pinned reference stack, created on first use in
# $REFVENV (default: <repo>/.refvenv, git-ignored). Set PYTHON to choose the interpreter that
# creates it (default: python3.11).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
REFVENV="${REFVENV:-$ROOT/.refvenv}"
PYTHON="${PYTHON:-python3.11}"
PINS=(torch==2.13.0 transformers==5.23.0 safetensors "ml_dtypes>=0.5" pillow==13.0.0)
SCRIPT=make_fixtures.py
export REQUIRED="ml_dtypes safetensors PIL"  # beside torch and transformers
if [[ "${1:-}" == "--images" ]]; then
    shift
    PINS=(torch==2.13.0 transformers==5.23.0 torchvision==0.28.0 pillow==13.0.0)
    SCRIPT=make_image_fixtures.py
    REQUIRED="torchvision PIL"
fi

if [[ ! -x "$REFVENV/bin/python" ]]; then
    echo "creating reference venv in $REFVENV" >&2
    "$PYTHON" -m venv "$REFVENV"
fi

if ! "$REFVENV/bin/python" - <<'EOF'
import importlib.util
import os
import sys

try:
    import torch
    import transformers
except ImportError:
    sys.exit(1)
if any(importlib.util.find_spec(name) is None for name in os.environ["REQUIRED"].split()):
    sys.exit(1)
ok = transformers.__version__ == "5.23.0" and torch.__version__.split("+")[0] == "2.13.0"
sys.exit(0 if ok and sys.version_info[:2] == (3, 11) else 1)
EOF
then
    echo "installing ${PINS[*]} into $REFVENV" >&2
    "$REFVENV/bin/python" -m pip install --quiet "${PINS[@]}"
fi

exec "$REFVENV/bin/python" "$ROOT/tests/parity/$SCRIPT" "$@"
