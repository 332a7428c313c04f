"""The train-rank entry points over a Megatron model built through Megatron-Bridge.

:func:`trainer_refit` enumerates this rank's HF-named local shards (Bridge's conversion
tasks, no gather; LoRA adapters of Bridge PEFT wrappers too) and joins the refit
(:func:`megatron_refit.refit.trainer_refit_from_pieces`); :func:`local_shard_source` gives
the same pieces as the vLLM trainer engine's ``WeightSource``.
"""

from __future__ import annotations

from collections.abc import Callable

from conversion.serving import trainer_forward
from megatron_refit.config import RefitConfig
from megatron_refit.fleet.control import EngineControl
from megatron_refit.fleet.trainer_fleet import TrainerFleet
from megatron_refit.group.connect import check_enabled
from megatron_refit.refit import trainer_refit_from_pieces


def trainer_refit(cfg: RefitConfig, bridge, model, hf_config, *, rank: int, num_train: int, offloader=None,
                  on_report: Callable[[dict], None] | None = None,
                  control: EngineControl | None = None) -> TrainerFleet:
    """Enumerate this train rank's HF-named local shards (Bridge conversion tasks, no gather),
    join the refit group and build the plan. ``model``: the Megatron model chunks, their
    parameters on the device (call this before offloading them; pass the ``offloader`` so
    each refit loads them back); LoRA adapters (Bridge PEFT) on it are found and synced per
    ``cfg.lora_sync``. ``control``: the engine's control plane over its clients, which the fleet
    drives on train rank 0 (:func:`~megatron_refit.engines.control.engine_control`; None: the
    engine needs no calls from the trainer)."""
    check_enabled(cfg, num_train)
    pieces, adapters = local_pieces(bridge, model, hf_config)
    device = next(p for chunk in model for p in chunk.parameters()).device
    # the model's own forward to compare with; whether a refit is checked is the fleet's ServingCheck's to
    # decide (refit.verify_serving), from the one config
    forward = trainer_forward(model, hf_config, lora=bool(adapters))
    return trainer_refit_from_pieces(cfg, pieces, adapters, rank=rank, num_train=num_train, device=device,
                                     offloader=offloader, on_report=on_report, forward=forward, control=control)


def local_pieces(bridge, model, hf_config) -> tuple[list, list]:
    """``(weights, LoRA adapters)``: this train rank's HF-named local shards of Megatron model
    chunks built through Bridge (adapters empty without Bridge PEFT wrappers). Needs Megatron."""
    from conversion.local_shards import enumerate_local_shards

    pieces = enumerate_local_shards(bridge, model, hf_config)
    adapters = []
    if any(hasattr(m, "adapter") and hasattr(m, "to_wrap") for chunk in model for m in chunk.modules()):
        from conversion.lora import adapter_shards  # Bridge PEFT LoRALinear wrappers

        adapters = adapter_shards(bridge, model, hf_config)
    return pieces, adapters


def local_shard_source(bridge, model: list, hf_config):
    """This rank's local shards of Megatron model chunks built through Megatron-Bridge as the
    vLLM trainer engine's :class:`~megatron_refit.engines.vllm.trainer.engine.LocalShardSource`
    (LoRA adapters of Bridge PEFT wrappers included, with their rank and alpha), and the model's
    forward over the serving probe (``refit.verify_serving``)."""
    from conversion.serving import trainer_forward
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource

    weights, adapters = local_pieces(bridge, model, hf_config)
    wrapped = [m.adapter for chunk in model for m in chunk.modules() if hasattr(m, "adapter")
               and hasattr(m, "to_wrap")]
    rank, alpha = (wrapped[0].dim, wrapped[0].alpha) if wrapped else (0, 0.0)
    device = next(p for chunk in model for p in chunk.parameters()).device
    return LocalShardSource(weights, adapters, lora_rank=rank, lora_alpha=alpha, device=device,
                            forward=trainer_forward(model, hf_config, lora=bool(adapters)))
