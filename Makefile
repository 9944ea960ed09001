# Two entry points: `make run` (the main job on the embedded synthetic checkpoint) and `make test` (`make test-fast`:
# the same without the slow tests).
VENV := .venv
PY := $(VENV)/bin/python
CHECKPOINT := out/tiny-checkpoint

.PHONY: setup run serve-openai test test-fast lint fixtures proto

$(VENV)/.installed: pyproject.toml
	PYENV_VERSION=3.12.1 python3.12 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

$(CHECKPOINT)/tokenizer.json: configs/tiny.json inkling_jax/chat_template.jinja | $(VENV)/.installed
	rm -rf $(CHECKPOINT)
	$(PY) -m inkling_jax.checkpoint.synthetic --config configs/tiny.json --out $(CHECKPOINT) --experts mixed

# The gRPC server on the embedded checkpoint (Ctrl-C drains and stops it). In another shell:
#   .venv/bin/python -m serving.client "Hello, Inkling"
run: $(CHECKPOINT)/tokenizer.json
	$(PY) -m serving.main --checkpoint $(CHECKPOINT) --port 50051 --metrics-port 9090

# The same with the SMG gateway in front (OpenAI and Anthropic HTTP APIs on :8000). In another shell:
#   curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \
#       -d '{"model": "tiny-checkpoint", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}'
serve-openai: $(CHECKPOINT)/tokenizer.json
	$(PY) -m serving.main --checkpoint $(CHECKPOINT) --port 50051 --metrics-port 9090 --gateway-port 8000

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers (CI has two cores), each test file on one worker (its module fixtures compile once). A worker that
# crashes is replaced and the rest of its files run (tests/file_scheduling.py); the tests it crashed in run once
# more, alone, so only a failure that repeats fails the suite, and a crash never holds CI to its time limit.
PYTEST := $(PY) -m pytest -n 2 --dist loadfile --max-worker-restart 4

test: lint
	$(PYTEST) || { $(PY) -m pytest --last-failed --last-failed-no-failures none; code=$$?; [ $$code -eq 0 ] || [ $$code -eq 5 ]; }

# The edit loop: every area's tests but those marked slow (pyproject.toml), in under 3 minutes on two cores.
test-fast: lint
	$(PYTEST) -m "not slow"

# Regenerate the transformers parity fixtures (Python 3.11 + torch CPU + transformers 5.23.0).
fixtures:
	bash tests/parity/regenerate.sh

# Regenerate the committed gRPC stubs from serving/proto/inkling.proto (grpcio-tools pinned in the dev extra).
proto: setup
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. serving/proto/inkling.proto
