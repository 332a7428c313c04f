"""megatron_refit inside every TP worker of a running SGLang engine (SGLang 0.5.23).

The hook is SGLang's own **custom weight loader**: an engine started with
``custom_weight_loader=[LOADER]`` (``--custom-weight-loader`` on ``sglang serve``) calls
:func:`refit_loader` in every TP worker, on its scheduler thread and with the live model, for
each ``update_weights_from_tensor(named_tensors, load_format=LOADER)`` of a weight-update
session (``begin_weight_update`` … ``end_weight_update``). The named tensors carry only small
control messages (:mod:`megatron_refit.engines.sglang.trainer.client` builds them): ``connect`` joins the
refit group and builds the plan (an :class:`~megatron_refit.engines.fused.live.LiveModelStorage` over the model's own
fused parameters: ``qkv_proj``, ``gate_up_proj``, ``w13_weight`` / ``w2_weight``, padded
vocabulary rows), ``refit`` receives one version in place over the refit group (NCCL or
gloo: no weight byte passes through SGLang's control plane), ``close`` leaves the group.

SGLang's distributed path (``update_weights_from_distributed``) broadcasts every full tensor
from trainer rank 0 to every TP rank; here each TP rank receives exactly its own pieces from
the train ranks that hold them.

This module imports without Megatron and without SGLang (SGLang's runtime context is read
at ``connect``, inside the worker).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from megatron_refit.engines.sglang.messages import parse_message

log = logging.getLogger(__name__)

_MEMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each SGLang model's refit group member, from ``connect`` to ``close``: kept beside the model,
not on it (the model is SGLang's). The member holds the model, so an entry ends at ``close``."""
_ERRORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each model's last loader call's error (None: it succeeded)."""


def engine_refit_for(model: torch.nn.Module, refit: dict, *, num_train: int, replica: int = 0,
                     tp_rank: int | None = None):
    """Join the refit group as this worker's rank (from SGLang's parallel state:
    :func:`~megatron_refit.engines.sglang.worker.rank.engine_rank`; ``tp_rank`` given: that TP rank of an
    engine without DP attention) of engine ``replica`` and build the plan: an
    :class:`~megatron_refit.engines.fused.live.LiveModelStorage` writing in place into ``model``'s own
    parameters, SGLang's post-load hook after every refit. In a DP-attention deployment
    (``gen_attention_dp > 1``) each FusedMoE layer's slots are first held to the plan's
    (:func:`~megatron_refit.engines.sglang.worker.expert_location.check_expert_location`). ``refit``: the
    ``refit:`` section; its ``engine`` must be ``sglang`` (the default here)."""
    from megatron_refit.config import refit_section
    from megatron_refit.config.deployment import refuse_wide_ep
    from megatron_refit.engines.hf.checkpoint import hf_param_table, model_shape
    from megatron_refit.engines.fused.live import LiveModelStorage
    from megatron_refit.engines.sglang.worker.expert_location import check_expert_location
    from megatron_refit.engines.sglang.worker.rank import engine_rank
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.plan.gen_layout import deployment_placement

    cfg = refit_section({"engine": "sglang", **refit} if isinstance(refit, dict) else refit, "connect")
    if cfg.engine != "sglang":
        raise ValueError(f"refit.engine is {cfg.engine!r}, but this is SGLang's megatron_refit weight loader "
                         "(set engine: sglang)")
    refuse_wide_ep(cfg)  # what SGLang's side does not receive into (redundant experts, EPLB), before any check
    if not isinstance(replica, int) or replica < 0:  # any index: one past gen_dp joins the running trainer
        raise ValueError(f"replica must be a non-negative int, got {replica!r}")
    if tp_rank is not None and cfg.gen_attention_dp != 1:
        raise ValueError(f"tp_rank={tp_rank} names a TP rank of an engine without DP attention; refit.gen_attention_dp="
                         f"{cfg.gen_attention_dp}: the rank comes from SGLang's parallel state (leave tp_rank unset)")
    hf_config = model.config
    shape = model_shape(hf_config)
    if tp_rank is None:
        from sglang.srt.runtime_context import get_parallel

        gen_index = engine_rank(cfg, get_parallel(), replica=replica, moe=shape.num_experts > 0)
    else:
        gen_index = replica * cfg.replica_size + tp_rank
    rank = gen_index % cfg.replica_size  # this rank's pieces: the same in every replica
    # the dtype the model computes in: its first floating-point parameter wider than a byte
    # (an FP8 engine's embedding and norms, not its quantized weights)
    dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point and p.element_size() > 1)
    params = hf_param_table(hf_config, dtype)
    if cfg.trainer_quantize_fp8:
        from megatron_refit.plan.fp8_layout import fp8_param_table

        params = fp8_param_table(params)
    layout = cfg.replica_layout(shape.num_experts)
    placement = deployment_placement(layout, shape.num_experts)
    if placement is not None:  # a wide deployment: SGLang's own expert slots are the ones planned
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        check_expert_location(model, placement, rank, get_global_expert_location_metadata())
    storage = LiveModelStorage.for_model(model, params, layout, shape, gen_index=rank,
                                         post_load=sglang_post_load(model))
    return engine_refit(cfg, storage, gen_index=gen_index, num_train=num_train,
                        device=next(model.parameters()).device)


def sglang_post_load(model) -> Callable[[], None]:
    """SGLang's post-load hook: models that define ``post_load_weights`` (e.g. DeepSeek's
    MLA absorb) recompute derived tensors there; others need nothing."""

    def run() -> None:
        hook = getattr(model, "post_load_weights", None)
        if hook is not None:
            hook()

    return run


def refit_loader(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader (``WeightUpdater.update_weights_from_tensor`` calls it in
    every TP worker with the live model and this rank's deserialised named tensors): runs the
    control messages in order. The refit group's member is kept per model (:data:`_MEMBERS`) from
    ``connect`` to ``close``.

    It never raises: SGLang does not catch a custom loader's exception, which would end the
    scheduler process ("Scheduler hit an exception", SIGQUIT to the server) and leave the
    other TP workers in the call's closing barrier. A failure is logged and kept for
    :func:`refit_state` (``None`` after a call that succeeded); the weights' state
    is the receiver's (``stale`` once bytes moved, ``ready`` at the old version when it refused
    before), and every train rank's ``refit`` raises: the trainer is the source of truth."""
    _ERRORS[model] = None
    for name, _ in named_tensors:
        op = "?"
        try:
            op, args = parse_message(name)
            if op == "connect":
                if _MEMBERS.get(model) is not None:
                    raise RuntimeError("this engine is connected to a refit group already; close it first")
                _MEMBERS[model] = engine_refit_for(model, args["refit"], num_train=args["num_train"],
                                                   replica=args.get("replica", 0))
            else:
                member = _MEMBERS.get(model)
                if member is None:
                    raise RuntimeError(f"megatron_refit {op}: this engine never connected to a refit group "
                                       "(send the connect message first)")
                if op == "refit":
                    member.receive(args["version"], full=args.get("full", False))
                else:
                    del _MEMBERS[model]
                    member.close()
        except Exception as exc:  # noqa: BLE001 -- see the docstring: raising would end the engine
            log.exception("megatron_refit %s failed", op)
            _ERRORS[model] = f"{type(exc).__name__}: {exc}"
            return


def refit_member(model: torch.nn.Module):
    """The model's refit group member (None before ``connect`` and after ``close``)."""
    return _MEMBERS.get(model)


def refit_state(model: torch.nn.Module) -> dict:
    """What a TP worker's model says about its refits: the receiver's ``state`` and
    ``weights_version`` (``None`` before ``connect``) and the last call's error."""
    member = _MEMBERS.get(model)
    return dict(connected=member is not None, state=None if member is None else member.state,
                weights_version=None if member is None else member.full.weights_version,
                error=_ERRORS.get(model))
