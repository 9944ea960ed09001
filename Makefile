# Two entry points: `make run` (the main job on the embedded synthetic checkpoint) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
CHECKPOINT := out/tiny-checkpoint

.PHONY: setup run test lint fixtures

$(VENV)/.installed: pyproject.toml
	PYENV_VERSION=3.12.1 python3.12 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

$(CHECKPOINT)/config.json: configs/tiny.json | $(VENV)/.installed
	rm -rf $(CHECKPOINT)
	$(PY) -m inkling_jax.checkpoint.synthetic --config configs/tiny.json --out $(CHECKPOINT) --experts mixed

run: $(CHECKPOINT)/config.json
	$(PY) -m inkling_jax.generate --checkpoint $(CHECKPOINT) --input configs/demo_requests.jsonl --output out/demo_results.jsonl
	cat out/demo_results.jsonl

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest

# Regenerate the transformers parity fixtures (Python 3.11 + torch CPU + transformers 5.23.0).
fixtures:
	bash tests/parity/regenerate.sh
