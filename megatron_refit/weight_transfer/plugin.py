"""``vllm.general_plugins`` entry point: registers the ``megatron_refit`` backend by name.

pyproject.toml declares ``megatron_refit = "megatron_refit.weight_transfer.plugin:register"``
in the ``vllm.general_plugins`` group, so vLLM runs :func:`register` in every one of its
processes (front end, engine core, workers) before it builds engines: after that,
``WeightTransferConfig(backend="megatron_refit")`` (``LLM``, ``AsyncLLM``) and
``vllm serve --weight-transfer-config '{"backend": "megatron_refit"}'`` select it with no
code in the engine process. Registration is lazy (a module path): the engines' modules are
imported only when an engine is created.
"""

from __future__ import annotations

from . import BACKEND


def register() -> None:
    """Register the worker and trainer engines with vLLM's factories (idempotent: vLLM may
    load plugins more than once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "megatron_refit.weight_transfer.worker",
                                                    "MegatronRefitEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "megatron_refit.weight_transfer.trainer",
                                                     "MegatronRefitTrainerEngine")
