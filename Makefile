# dflash-pipeline developer entry points. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
VENV_STAMP := $(VENV)/.stamp
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

# The dev environment is rebuilt whenever a requirements or project file changes.
$(VENV_STAMP): requirements/dev.in shared/pyproject.toml jobs/tokenize/pyproject.toml
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet uv
	uv venv --quiet --allow-existing -p $(PYTHON) $(VENV)
	VIRTUAL_ENV=$(VENV) uv pip install --quiet -r requirements/dev.in
	@touch $@

venv: $(VENV_STAMP) ## Create the development environment (.venv)

test: $(VENV_STAMP) ## Run the whole test suite (what CI runs)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(VENV_STAMP) ## Run the tests that need no image build, no vLLM and no long run
	$(PY) -m pytest -m "not slow and not image and not e2e" $(PYTEST_ARGS)

lint: $(VENV_STAMP) ## ruff over the tree, mypy over the shared library
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy shared/src/dflash_shared

schemas: $(VENV_STAMP) ## Export the JSON Schema of every manifest kind to schemas/
	$(PY) -m dflash_shared.schemas schemas

build-images: ## Build every image under docker/ (docker or podman)
	bash docker/build-images.sh

build-image: ## Build one image: make build-image IMAGE=tokenizer
	bash docker/build-images.sh $(IMAGE)

.PHONY: help venv test test-fast lint schemas build-images build-image
