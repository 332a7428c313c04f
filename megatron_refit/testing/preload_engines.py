"""What a forkserver imports once for the engine suites' spawned ranks (``REFIT_SPAWN_PRELOAD``
in ``tests/engines/vllm`` and ``tests/engines/sglang``, whose environments have no Megatron).

Those suites start 3–5 ranks per scenario, each a vLLM or SGLang worker or a train rank beside
one, and a fresh interpreter imports torch, transformers and the engine again: 20–30 s of CPU
per rank on the 2-core CI machine (vLLM's worker and model classes, SGLang's runtime), most of
the suite's time. Forked from a forkserver that imported them once, a rank starts in a second,
with the same modules in the same state as if it had imported them itself. Nothing here
starts a thread, a process or a device: the engines do that in the rank, as before.
"""

import importlib.util

from megatron_refit.local.launch import quiet_imports

VLLM = (
    "vllm.config",
    "vllm.distributed.weight_transfer",
    "vllm.v1.worker.gpu_worker",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.model_executor.models.deepseek_v2",
    "vllm.model_executor.models.nemotron_h",
    "megatron_refit.engines.vllm.worker.engine",
    "megatron_refit.engines.vllm.trainer.engine",
)
OURS = ("megatron_refit.refit", "megatron_refit.engine_side.entry", "megatron_refit.fleet.member",
        "megatron_refit.fleet.trainer_fleet")
"""This project's modules every rank imports (neither side needs Megatron to import them)."""
SGLANG = (
    "sglang.srt.server_args",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.qwen3",
    "sglang.srt.models.qwen3_moe",
    "sglang.srt.layers.attention.torch_native_backend",
)


def _load(modules: tuple[str, ...]) -> None:
    for module in modules:
        try:
            __import__(module)
        except ImportError:  # a rank that needs it imports it itself, and fails there by name
            pass


with quiet_imports(r"vllm", r"sglang"):
    import torch  # noqa: F401
    import transformers  # noqa: F401

    _load(OURS)
    if importlib.util.find_spec("vllm") is not None:
        _load(VLLM)
    if importlib.util.find_spec("sglang") is not None:
        _load(SGLANG)
