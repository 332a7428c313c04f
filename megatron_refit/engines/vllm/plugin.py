"""``vllm.general_plugins`` entry point: registers the ``megatron_refit`` backend by name.

pyproject.toml declares ``megatron_refit = "megatron_refit.engines.vllm.plugin:register"``
in the ``vllm.general_plugins`` group, so vLLM runs :func:`register` in every one of its
processes (front end, engine core, workers) before it builds engines: after that,
``WeightTransferConfig(backend="megatron_refit")`` (``LLM``, ``AsyncLLM``) and
``vllm serve --weight-transfer-config '{"backend": "megatron_refit"}'`` select it with no
code in the engine process. Registration is lazy (a module path): the engines' modules are
imported only when an engine is created.
"""

from __future__ import annotations

from megatron_refit.engines.vllm import BACKEND


_registered = False


def register() -> None:
    """Register the worker and trainer engines with vLLM's factories, once per process (vLLM
    may load plugins more than once; its factories refuse a name registered twice, and we ask
    them only through their public ``register_engine``)."""
    global _registered
    if _registered:
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    WeightTransferEngineFactory.register_engine(BACKEND, "megatron_refit.engines.vllm.worker.engine",
                                                "MegatronRefitEngine")
    WeightTransferTrainerFactory.register_engine(BACKEND, "megatron_refit.engines.vllm.trainer.engine",
                                                 "MegatronRefitTrainerEngine")
    _registered = True
