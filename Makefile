# dflash-pipeline developer entry points. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
VENV_STAMP := $(VENV)/.stamp
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
BENCH_ARGS ?=
# Where the environment builds write their output (pip's notes on every package, which a person need not read).
# `make V=1 ...` streams it instead.
LOGS := build/logs
V ?=

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

# ---------------------------------------------------------------- tools
# uv, pinned, in the project's own tool environment (.tools, gitignored): nothing is installed into the machine's
# Python, and every machine builds .venv with the same uv. A uv already on PATH is not used on its own: its
# version is whatever that machine has. `make UV=/path/to/uv ...` picks one explicitly (then .tools is not made).
UV_VERSION := 0.13.9
TOOLS := .tools
TOOLS_UV_STAMP := $(TOOLS)/.uv-$(UV_VERSION)
UV ?= $(TOOLS)/bin/uv
UV_DEP := $(if $(filter $(TOOLS)/bin/uv,$(UV)),$(TOOLS_UV_STAMP))

$(TOOLS_UV_STAMP):
	@mkdir -p $(LOGS)
	@echo "tools: uv $(UV_VERSION) into $(TOOLS) (log: $(LOGS)/tools.log)"
	@{ [ -x $(TOOLS)/bin/python ] || $(PYTHON) -m venv $(TOOLS); } > $(LOGS)/tools.log 2>&1 \
	  && $(TOOLS)/bin/python -m pip install --disable-pip-version-check --quiet uv==$(UV_VERSION) \
	     >> $(LOGS)/tools.log 2>&1 \
	  || { cat $(LOGS)/tools.log >&2; exit 1; }
	@rm -f $(TOOLS)/.uv-*
	@touch $@

tools: $(UV_DEP) ## Install the pinned uv into .tools (every target that needs it does this itself)

# ---------------------------------------------------------------- environments
# logged NAME, COMMAND: runs COMMAND with its output in $(LOGS)/NAME.log, then prints the log's last line (the
# script's own summary); on failure, its last 40 lines and the path. V=1 streams the output instead.
define logged
	@mkdir -p $(LOGS)
	@if [ -n "$(V)" ]; then $(2); else \
	  echo "$(1): log in $(LOGS)/$(1).log"; \
	  if $(2) > $(LOGS)/$(1).log 2>&1; then tail -n 1 $(LOGS)/$(1).log; \
	  else status=$$?; tail -n 40 $(LOGS)/$(1).log >&2; echo "$(1): FAILED, full log: $(LOGS)/$(1).log" >&2; \
	    exit $$status; fi; \
	fi
endef

# The torch-free environment (shared library, tokenize stage, pipeline and image tests), rebuilt whenever its
# lock, requirements or a project file changes. Installed from the lock (requirements/dev.lock, made by `make lock`
# from requirements/dev.in) with hashes required and nothing resolved here: `uv pip sync` makes the environment
# exactly the lock, then the project's own packages go in editable and without dependencies (the lock holds
# theirs). (uv is an order-only prerequisite: a new uv does not rebuild the environment.)
DEV_LOCK := requirements/dev.lock
$(VENV_STAMP): $(DEV_LOCK) requirements/dev.in shared/pyproject.toml jobs/pipeline/pyproject.toml jobs/tokenize/pyproject.toml \
		jobs/generate/pyproject.toml jobs/train/pyproject.toml | $(UV_DEP)
	$(call logged,venv,{ $(UV) venv --allow-existing -p $(PYTHON) $(VENV) \
	  && VIRTUAL_ENV=$(VENV) $(UV) pip sync --require-hashes $(DEV_LOCK) \
	  && VIRTUAL_ENV=$(VENV) $(UV) pip install --no-deps -r <($(PYTHON) scripts/locks.py editables requirements/dev.in) \
	  && echo "venv: $(VENV) holds exactly $(DEV_LOCK) and the project's packages (editable)"; })
	@touch $@

venv: $(VENV_STAMP) ## Create the development environment (.venv)

venv-generate: ## Create .venv-generate (vLLM on CPU) for the generate stage
	$(call logged,venv-generate,bash scripts/venv-generate.sh)

venv-train: ## Create .venv-train (PyTorch on CPU) for the train stage
	$(call logged,venv-train,bash scripts/venv-train.sh)

image-tools: ## Install podman/buildah/debootstrap when missing
	bash docker/build-images.sh --ensure-tools

# ---------------------------------------------------------------- the pipeline
demo: $(VENV_STAMP) venv-generate venv-train ## Run the whole pipeline on CPU with a tiny model (reruns resume)
	$(PY) demo/run_demo.py

demo-pilot: $(VENV_STAMP) venv-generate venv-train ## The demo run's pilot (full shape, reduced counts), its report, and the re-plan from it
	$(PY) demo/run_demo.py --pilot

# ---------------------------------------------------------------- tests and checks
test: $(VENV_STAMP) venv-generate venv-train image-tools ## Run the test suite (what CI runs; `gpu` tests skip without a CUDA device, PYTEST_ARGS='-m gpu' runs only them)
	bash scripts/run-tests.sh $(PYTEST_ARGS)

test-all: $(VENV_STAMP) venv-generate venv-train image-tools ## The test suite plus the `extended` tests
	DFLASH_TESTS=all bash scripts/run-tests.sh $(PYTEST_ARGS)

test-fast: $(VENV_STAMP) ## Unit tests only: no image builds, no vLLM, no long runs
	$(PY) -m pytest -m "not slow and not image and not e2e" --ignore=tests/generate --ignore=tests/train \
		--ignore=tests/evaluate $(PYTEST_ARGS)

test-images: $(VENV_STAMP) image-tools ## Build the images and run the image tests
	$(PY) -m pytest -m image tests/images $(PYTEST_ARGS)

test-cuda-images: $(VENV_STAMP) venv-train image-tools ## Build the CUDA images (generator, trainer) and smoke-test them on CPU; not part of `make test` (see docs/benchmarks.md)
	$(PY) -m pytest -m cuda_image tests/images/test_cuda_images.py $(PYTEST_ARGS)

lint: $(VENV_STAMP) check-locks ## ruff over the tree, mypy over the shared library and the orchestration, zizmor and the schema over the CI workflows, the locks
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy shared/src/dflash_shared jobs/pipeline/src/dflash_pipeline
	$(VENV)/bin/zizmor --offline --no-progress .github/workflows
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml

docs: $(VENV_STAMP) ## Regenerate the generated parts of README.md and docs/: configuration and run file references, demo figures
	$(PY) scripts/update_readme.py

schemas: $(VENV_STAMP) ## Export the JSON Schema of every manifest kind to schemas/
	$(PY) -m dflash_shared.schemas schemas

k8s-base: $(VENV_STAMP) ## Regenerate k8s/base (and the namespace setup, k8s/namespace) from the example run config
	$(PY) -m dflash_pipeline render --config k8s/example-run.toml --out k8s/base
	$(PY) -m dflash_pipeline render --setup --config k8s/example-run.toml --out k8s/namespace

# ---------------------------------------------------------------- images
build-images: ## Build every image under docker/ (docker or podman)
	bash docker/build-images.sh

build-image: ## Build one image: make build-image IMAGE=tokenizer
	bash docker/build-images.sh $(IMAGE)

dockerfiles: ## Copy the parts every image shares (docker/common) into each docker/<image>/Dockerfile
	$(PYTHON) scripts/render_dockerfiles.py

base-image: ## Build the local debootstrap base image (used where no registry is reachable)
	bash docker/base/make-local-base.sh

# `make lock LOCKS="generate dev"` renews only those (stages and environments by name).
LOCKS ?=
lock: | $(UV_DEP) ## Regenerate every hash-pinned lock: the images' (jobs/<stage>/*.lock) and the environments' (requirements/*.lock)
	UV=$(UV) PYTHON=$(PYTHON) bash docker/lock.sh $(LOCKS)

check-locks: ## Fail if a lock is older than its inputs (offline: the input hash in each lock's header; also in the tests)
	$(PYTHON) scripts/locks.py check

# ---------------------------------------------------------------- benchmarks
bench-tokenize: $(VENV_STAMP) ## Tokenize-stage throughput against the tokenizer library's limit
	$(PY) bench/bench_tokenize.py

bench-import: $(VENV_STAMP) ## Import throughput on one JSONL file: one worker, striped over two, a pilot's sample, counting prompt tokens
	$(PY) bench/bench_import.py

bench-eval: venv-generate ## Offline tau, engine tau and their gap (tiny CPU setting)
	.venv-generate/bin/python bench/bench_eval.py

bench-quality: venv-generate ## The trained drafter against vLLM's n-gram speculation and the untrained drafter, on a target that speaks
	.venv-generate/bin/python bench/bench_quality.py $(BENCH_ARGS)

bench-learnability: venv-train ## The learnability gate against each defect it exists for, on both target families
	.venv-train/bin/python bench/bench_learnability.py

bench-numerics: venv-train ## How often bfloat16 rounding parts speculative from greedy output, and the lossy verifiers the policy catches
	.venv-train/bin/python bench/bench_numerics.py

bench-train: venv-train ## Train-stage CPU figures: step throughput and memory, drafter shapes and compilations, data loader rate, target features per packing
	.venv-train/bin/python bench/bench_train_step.py
	.venv-train/bin/python bench/bench_train_shapes.py
	.venv-train/bin/python bench/bench_train_data.py
	.venv-train/bin/python bench/bench_target_features.py

.PHONY: help tools demo demo-pilot venv venv-generate venv-train image-tools test test-fast test-images test-cuda-images lint docs k8s-base schemas build-images \
	build-image dockerfiles base-image lock check-locks bench-tokenize bench-import bench-train bench-eval bench-learnability bench-numerics bench-quality
