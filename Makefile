VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo clean
setup:
	@VENV=$(VENV) scripts/setup_venv.sh

test: setup
	$(PY) -m pytest -q -rs --durations=15 tests

demo: setup
	$(PY) -m megatron_refit.demo

clean:
	rm -rf $(VENV) .pytest_cache
