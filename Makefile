# Two entry points that work on a fresh machine: `make demo` (the main job on the real
# example pair) and `make test` (the test suite, as CI runs it).
VENV ?= .venv
PY := $(VENV)/bin/python
# With an NVIDIA GPU (nvidia-smi on the PATH): PyPI's default torch, a CUDA build; elsewhere
# the CPU build (the cpu extra pins it). `make EXTRAS=cpu,test` or `EXTRAS=test` chooses.
EXTRAS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),test,cpu,test)

# The `reference` extra of pyproject.toml (what the tests compare with), to install without its
# dependencies.
REFERENCE = $(PY) -c "from importlib.metadata import requires; print(*(r.split(';')[0] for r in \
	requires('flashdraft') if 'extra == \"reference\"' in r))"

.PHONY: install demo test test-fast clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps $$($(REFERENCE))
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/flashdraft models pull qwen2.5-coder
	$(VENV)/bin/flashdraft demo

test: install
	$(VENV)/bin/flashdraft models pull qwen2.5-coder
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not example_pair"

clean:
	rm -rf $(VENV) build *.egg-info
