# Two entry points: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# DeepSpeed JIT-builds its CPU Adam op on first use; keep the build in one stable place.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions
# The CPU build of torch. An unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
DEEPSPEED_PIN ?= deepspeed==0.19.8

.PHONY: setup demo test lint typecheck pytest docs bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)" ninja
	$(BIN)/python -m pip install --quiet --no-build-isolation "$(DEEPSPEED_PIN)" "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[dev,uvloop,deepspeed,lightning,docs,bench]" "$(TORCH_PIN)"
	@# DeepSpeed JIT-builds its CPU ops on first use (a minute or two on 2 cores): build them
	@# here, so that the first test or benchmark to use them does not pay for it.
	$(BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; \
	[a().create_op_builder(n).load() for n in ('CPUAdamBuilder', 'ShareMemCommBuilder')]"
	touch $@

demo: setup
	$(BIN)/python examples/train_with_checkpoints.py

lint: setup
	$(BIN)/ruff check
	$(BIN)/ruff format --check

typecheck: setup
	$(BIN)/mypy

pytest: setup
	$(BIN)/python -m pytest

# The site, with its API reference from the docstrings; strict: a broken link fails it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: lint typecheck pytest

bench: setup
	$(BIN)/python -m aoffload.bench all

clean:
	rm -rf $(VENV) .torch_extensions .mypy_cache .ruff_cache .pytest_cache site
