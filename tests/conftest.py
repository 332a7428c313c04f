"""Multi-process tests fork their ranks from a forkserver that imported torch, transformers
and Megatron once (megatron_refit/testing/preload.py), or, in the engine suites' environments
(no Megatron), vLLM's or SGLang's worker and model modules (megatron_refit/testing/preload_engines.py):
the suites' largest cost on 2 cores is each fresh rank importing them again.
``REFIT_SPAWN_PRELOAD=`` (empty) turns it off."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
    os.environ.setdefault("REFIT_SPAWN_PRELOAD", "megatron_refit.testing.preload")
    # Megatron-Core's fused activations and MoE routing go through torch.compile: on CPU each
    # rank then looks up, loads and hashes Inductor's C++ builds (and runs g++ on a miss), about
    # 15 % of a Megatron test's CPU; eager runs the same math (the refit moves weights, and every
    # served-versus-trainer comparison has its measured tolerance). vLLM servers keep their own
    # setting (megatron_refit.testing.vllm_server.server_env).
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
elif importlib.util.find_spec("vllm") is not None or importlib.util.find_spec("sglang") is not None:
    os.environ.setdefault("REFIT_SPAWN_PRELOAD", "megatron_refit.testing.preload_engines")
if importlib.util.find_spec("vllm") is not None:
    # vLLM's model-info cache of this venv, filled at setup (scripts/warm_vllm_cache.py): without
    # it each process that meets a model class first inspects it in a fresh interpreter
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(sys.prefix, "vllm-cache"))
    # vLLM 0.33's humming kernels start two interpreters in the background at import, to build a
    # CUDA launcher that a CPU run never calls
    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")


TIERS = ("unit", "mp", "megatron", "engines")
"""tests/<tier>/: each test's marker is its folder's (``pytest -m unit``); no test lives outside one."""
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.fspath)).resolve().relative_to(HERE).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in one of tests/{{{','.join(TIERS)}}}")
        item.add_marker(getattr(pytest.mark, tier))
