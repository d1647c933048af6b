# The entry points: `make demo`, `make test` (CI) and `make test-fast`. Each creates .venv when missing.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch==2.13.0 is a CPU build pip finds on this kind of machine; a bare `torch` would
# pull a multi-GB CUDA build. An already-importable torch (a GPU user's) is kept.
TORCH_PIN ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# NOTE: packages are installed without byte-compiling all of them (most of transformers is
# never imported: about 30 s saved on a fresh install here); the install then imports what
# runs import, which compiles and caches just those modules. An empty
# PYTHONDONTWRITEBYTECODE lets that happen even where the environment sets it (with it set,
# every process compiles torch anew: `import torch` takes 7 s here instead of 2.6).
export PYTHONDONTWRITEBYTECODE =

.PHONY: install demo test test-fast test-more test-full lint clean bench-load bench-inference docs docs-check

install: $(STAMP)

# The native kernels (src/shardwise/kernels/csrc) are built by the editable install (setup.py);
# editing them reinstalls.
$(STAMP): pyproject.toml Makefile setup.py $(wildcard src/shardwise/kernels/csrc/*)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile $(TORCH_PIN)
	$(PY) -m pip install -q --no-compile -e '.[dev,hf,mpi,serve,plot]'
	@# compile (and cache) what every command and test imports, once, instead of in each first process
	@$(PY) -c "import torch, torch._dynamo, torch.fx.experimental.symbolic_shapes, transformers.modeling_utils, shardwise.cli.main, shardwise.serve.http, mpi4py.MPI, pytest, xdist"
	@$(PY) -c "from shardwise.kernels import native; print(native.describe())"
	@touch $@

demo: install
	$(VENV)/bin/shardwise generate --tp 2 --compare-tp1

lint: install
	$(VENV)/bin/ruff check src tests $(wildcard benchmarks)
	$(VENV)/bin/ruff format --check src tests $(wildcard benchmarks)

# Two pytest workers (one per core here), a test file each at a time: its module fixtures
# (references, checkpoints, a server) are built once. See tests/conftest.py for the tiers.
PYTEST := OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n 2 --dist loadfile

# CI's gate, under 5 minutes on 2 cores: every unit and pooled multi-process case, each
# command's representative end-to-end cases, MPI parity and fail-fast.
test: lint
	$(PYTEST) -m "not full"

# Unit tests, one parity case per layer kind at tp=2, one CLI smoke: under 90 s on 2 cores.
test-fast: lint
	$(PYTEST) -m "not slow"

# What `make test` leaves out: every other end-to-end case, every job under mpiexec, every
# injected fault, the 8-rank layouts. One worker: the fault cases time what they see.
test-more: install
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m full

# Everything.
test-full: test test-more

# The docs: docs/reference.md regenerated from the argparse definitions; the docs test (links,
# the reference, every `<!-- runnable -->` block, the slower `runnable full` ones too). `make
# test` runs the same test without the `full` blocks.
docs: install
	$(PY) -m shardwise.cli.reference

docs-check: install
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q tests/unit/test_docs.py

bench-load: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/load_memory.py

bench-inference: install
	$(PY) -m pip install -q -e '.[bench]'
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_inference.py --out docs/benchmarks/bench_inference.json
	$(PY) benchmarks/report_inference.py docs/benchmarks/bench_inference.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
