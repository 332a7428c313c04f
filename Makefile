VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
# SKIP_VLLM=1 skips the vLLM-engine tests (they need a 9 GB venv of their own).
SKIP_VLLM ?= 0

.PHONY: setup setup-vllm setup-slurm test test-main test-vllm demo docs clean
setup:
	@VENV=$(VENV) scripts/setup_venv.sh

setup-vllm: setup
	@VLLM_VENV=$(VLLM_VENV) scripts/setup_vllm_venv.sh

test: test-main
ifneq ($(SKIP_VLLM),1)
test: test-vllm
endif

test-main: setup
	$(PY) -m pytest -q -rs --durations=15 --ignore=tests/vllm tests

test-vllm: setup-vllm
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -m pytest -q -rs tests/vllm

demo: setup
	$(PY) -m megatron_refit.demo

# Regenerate docs/configuration.md from RefitConfig's field docstrings (tests/test_docs.py checks it).
docs: setup
	$(PY) scripts/gen_config_docs.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache

# Debian's slurm-wlm for tests/test_slurm.py's real single-node SLURM run (needs root; ~30 s).
setup-slurm:
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm
