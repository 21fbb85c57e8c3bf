# Set-up is part of every target: a fresh clone needs nothing but python3 (3.10+) and make.
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate, and the mayor signed it the next morning.

.PHONY: demo test test-slow peers clean

# pip reads torch==2.13.0 from pyproject.toml: the CPU build, never a multi-GB CUDA one.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,bench,serve,ray]'
	touch $@

# Fetches SmolLM2 (first run only) and generates with n-gram speculation; stats follow the text.
demo: $(VENV)/.installed
	$(VENV)/bin/specdecode generate --chat --max-new-tokens 96 "$(PROMPT)"

# Unit tests on tiny random models + integration tests on the real SmolLM2 (fetched once, cached), on two
# pytest-xdist workers (most tests run one thread; the tests that start a Ray cluster share one worker). The
# kernels' builds compile first, at once (about 100 s on a fresh machine, a few seconds once compiled).
test: $(VENV)/.installed
	$(PY) -m specdecode.models.native
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup

# The Qwen pair (0.5B drafting for 1.5B, 1.6 GB download) and other long checks.
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m slow

# llama.cpp's own tools (llama-server, llama-bench, ...) as the bench's peers: about 15 min on 2 cores, once per
# machine; never part of `make test`.
peers: $(VENV)/.installed
	$(VENV)/bin/specdecode peers build

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
