"""Where the tests' inputs live: the repository, its configs and the transformers parity fixtures."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "tiny_text.json"  # the embedded checkpoint's text model (configs/tiny.json), no tower
PARITY = REPO / "tests" / "fixtures" / "parity"
TINY_TEXT = PARITY / "tiny_text"  # a tiny random checkpoint: original/ and hf/ (transformers') layouts
IMAGES = REPO / "tests" / "fixtures" / "images"  # encoded images and transformers' pixel values for each
