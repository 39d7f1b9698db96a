# Tandem: `make serve` runs the main job on the bundled tiny model (CPU); `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR := .models/tiny-kimi-linear

.PHONY: setup serve generate test lint bench model

setup: $(VENV)/.installed

# torch first, pinned: its CPU build lies on disk; an open range would pull a CUDA build.
# redis-server: the prefix-index tests start their own on a free port.
$(VENV)/.installed: pyproject.toml
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

model: setup
	@test -f $(MODEL_DIR)/config.json || $(BIN)/tandem make-tiny-model --arch kimi_linear --out $(MODEL_DIR)

# router + one prefill + one decode worker on localhost; Ctrl-C stops all three
serve: model
	$(BIN)/tandem serve --model $(MODEL_DIR)

generate: model
	$(BIN)/tandem generate --model $(MODEL_DIR) --max-tokens 32 \
		--prompt "The quick brown fox" --prompt "Once upon a time"

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest -q

bench: model
	$(BIN)/tandem bench offline --model $(MODEL_DIR)
