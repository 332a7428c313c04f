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
Under ``refit.gen_draft`` the same messages reach the speculative draft's runner after the
target's, and the draft lands with the main model in every refit
(:mod:`~megatron_refit.engines.sglang.worker.draft`).

SGLang's distributed path (``update_weights_from_distributed``) broadcasts every full tensor
from trainer rank 0 to every TP rank; here each TP rank receives exactly its own pieces from
the train ranks that hold them.

This module imports without Megatron and without SGLang (SGLang's runtime context is read
at ``connect``, inside the worker).
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable

import torch

from megatron_refit.engines.sglang.messages import parse_message
from megatron_refit.engines.sglang.worker.draft import draft_of

log = logging.getLogger(__name__)

_MEMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each SGLang model's refit group member, from ``connect`` to ``close``: kept beside the model,
not on it (the model is SGLang's). The member holds the model, so an entry ends at ``close``."""
_ERRORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each model's last loader call's error (None: it succeeded)."""
_DRAFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""``refit.gen_draft``: each connected model's :class:`~megatron_refit.engines.fused.draft.ModelWithDraft`
(the model and SGLang's draft, handed over by the draft runner's ``connect``), until ``close``."""
_TARGETS: weakref.WeakSet = weakref.WeakSet()
"""The models the loader took for targets (the first it met that share no embedding with another)."""
_DRAFT_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each speculative draft's model the loader met: a weak reference to its target."""


def engine_refit_for(model: torch.nn.Module, refit: dict, *, num_train: int, replica: int = 0,
                     tp_rank: int | None = None):
    """Join the refit group as this worker's rank (from SGLang's parallel state:
    :func:`~megatron_refit.engines.sglang.worker.rank.engine_rank`; ``tp_rank`` given: that TP rank of an
    engine without DP attention) of engine ``replica`` and build the plan: an
    :class:`~megatron_refit.engines.fused.live.LiveModelStorage` writing in place into ``model``'s own
    parameters, SGLang's post-load hook after every refit. In a DP-attention deployment
    (``gen_attention_dp > 1``) each FusedMoE layer's slots are first held to the plan's
    (:func:`~megatron_refit.engines.sglang.worker.expert_location.check_expert_location`); under
    ``gen_eplb`` or ``gen_redundant_experts`` the plan's map is the one SGLang serves, read again at
    the start of every refit (:mod:`~megatron_refit.engines.sglang.worker.eplb_map`). ``refit``: the
    ``refit:`` section; its ``engine`` must be ``sglang`` (the default here). Under ``gen_draft``
    the plan covers SGLang's speculative draft too, which its runner hands over through the loader
    (:func:`refit_loader`)."""
    return _connect(model, refit, num_train=num_train, replica=replica, tp_rank=tp_rank)[0]


def _connect(model: torch.nn.Module, refit: dict, *, num_train: int, replica: int = 0, tp_rank: int | None = None):
    """:func:`engine_refit_for`'s member, and under ``refit.gen_draft`` the model's
    :class:`~megatron_refit.engines.fused.draft.ModelWithDraft` (else None)."""
    from megatron_refit.config import refit_section
    from megatron_refit.config.deployment import refuse_wide_ep
    from megatron_refit.engines.hf.checkpoint import hf_param_table, model_shape
    from megatron_refit.engines.fused.live import LiveModelStorage
    from megatron_refit.engines.sglang.worker.draft import (DraftModelStorage, check_draft_server, draft_post_load,
                                                            sglang_draft)
    from megatron_refit.engines.sglang.worker.eplb_map import check_eplb_config, live_layout
    from megatron_refit.engines.sglang.worker.expert_location import check_expert_location
    from megatron_refit.engines.sglang.worker.rank import engine_rank
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.plan.gen_layout import deployment_placement

    cfg = refit_section({"engine": "sglang", **refit} if isinstance(refit, dict) else refit, "connect")
    if cfg.engine != "sglang":
        raise ValueError(f"refit.engine is {cfg.engine!r}, but this is SGLang's megatron_refit weight loader "
                         "(set engine: sglang)")
    refuse_wide_ep(cfg)  # what SGLang's side does not receive into, before any check
    if not isinstance(replica, int) or replica < 0:  # any index: one past gen_dp joins the running trainer
        raise ValueError(f"replica must be a non-negative int, got {replica!r}")
    if tp_rank is not None and cfg.gen_attention_dp != 1:
        raise ValueError(f"tp_rank={tp_rank} names a TP rank of an engine without DP attention; refit.gen_attention_dp="
                         f"{cfg.gen_attention_dp}: the rank comes from SGLang's parallel state (leave tp_rank unset)")
    hf_config = model.config
    if cfg.gen_draft:  # an engine without the model's MTP draft, before any group is joined
        from sglang.srt.runtime_context import get_spec

        check_draft_server(cfg, get_spec().speculative_algorithm, getattr(hf_config, "num_nextn_predict_layers", 0))
    shape = model_shape(hf_config)
    if shape.num_experts:  # SGLang's EPLB and redundant experts as the section says, before any group is joined
        from sglang.srt.runtime_context import get_exec

        check_eplb_config(cfg, get_exec().moe)
    if tp_rank is None:
        from sglang.srt.runtime_context import get_parallel

        gen_index = engine_rank(cfg, get_parallel(), replica=replica, moe=shape.num_experts > 0)
    else:
        gen_index = replica * cfg.replica_size + tp_rank
    rank = gen_index % cfg.replica_size  # this rank's pieces: the same in every replica
    # the dtype the model computes in: its first floating-point parameter wider than a byte
    # (an FP8 engine's embedding and norms, not its quantized weights)
    dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point and p.element_size() > 1)
    params = hf_param_table(_checkpoint_config(hf_config), dtype, draft=cfg.gen_draft)
    if cfg.trainer_quantize_fp8:
        from megatron_refit.plan.fp8_layout import fp8_param_table

        params = fp8_param_table(params)
    layout, live_map = cfg.replica_layout(shape.num_experts), None
    if shape.num_experts and (cfg.gen_eplb or deployment_placement(layout, shape.num_experts) is not None):
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata as metadata

        if cfg.gen_eplb or cfg.gen_redundant_experts:
            # the map SGLang serves now (EPLB moves it, --init-expert-location sets it), read again at every refit
            layout, live_map = live_layout(model, layout, shape.num_experts, metadata)
        # a wide deployment: SGLang's own expert slots are the ones planned
        check_expert_location(model, deployment_placement(layout, shape.num_experts), rank, metadata())
    with_draft = None
    if cfg.gen_draft:  # the draft's parameters are placeholders until its runner hands it over
        with_draft = sglang_draft(model, hf_config.num_hidden_layers)
        storage = DraftModelStorage.for_model(with_draft, params, layout, shape, gen_index=rank,
                                              post_load=draft_post_load(with_draft, sglang_post_load),
                                              pending=with_draft.is_draft)
    else:
        storage = LiveModelStorage.for_model(model, params, layout, shape, gen_index=rank,
                                             post_load=sglang_post_load(model), live_map=live_map)
    member = engine_refit(cfg, storage, gen_index=gen_index, num_train=num_train,
                          device=next(model.parameters()).device)
    return member, with_draft


def _checkpoint_config(hf_config):
    """``hf_config`` as the checkpoint has it, for the parameter table (which transformers builds on
    the meta device): SGLang's DeepSeek attention renames a YaRN rope type to its own
    ``deepseek_yarn`` in the model's config, in place, a name transformers does not know; then a
    copy with ``yarn`` back (no weight depends on it)."""
    def renamed(config) -> list[dict]:
        return [rope for rope in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None))
                if isinstance(rope, dict) and rope.get("rope_type") == "deepseek_yarn"]
    if not renamed(hf_config):
        return hf_config
    config = copy.deepcopy(hf_config)
    for rope in renamed(config):
        rope["rope_type"] = "yarn"
    return config


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
    before), and every train rank's ``refit`` raises: the trainer is the source of truth.

    SGLang's speculative draft (the model of the draft worker's runner, which SGLang calls after
    the target's with the same message: :func:`_target_of`) is written by its target's refit under
    ``refit.gen_draft`` (its ``connect`` hands it over) and left untouched otherwise."""
    _ERRORS[model] = None
    target = _target_of(model)
    if target is not None:
        _draft_call(model, target, named_tensors)
        return
    for name, _ in named_tensors:
        op = "?"
        try:
            op, args = parse_message(name)
            if op == "connect":
                if _MEMBERS.get(model) is not None:
                    raise RuntimeError("this engine is connected to a refit group already; close it first")
                member, with_draft = _connect(model, args["refit"], num_train=args["num_train"],
                                              replica=args.get("replica", 0))
                _MEMBERS[model] = member
                if with_draft is not None:
                    _DRAFTS[model] = with_draft
            else:
                member = _MEMBERS.get(model)
                if member is None:
                    raise RuntimeError(f"megatron_refit {op}: this engine never connected to a refit group "
                                       "(send the connect message first)")
                if op == "refit":
                    member.receive(args["version"], full=args.get("full", False))
                else:
                    del _MEMBERS[model]
                    _DRAFTS.pop(model, None)
                    member.close()
        except Exception as exc:  # noqa: BLE001 -- see the docstring: raising would end the engine
            log.exception("megatron_refit %s failed", op)
            _ERRORS[model] = f"{type(exc).__name__}: {exc}"
            return


def _target_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The target whose speculative draft ``model`` is (None: ``model`` is a target), decided the
    first time the loader meets ``model``: a model that holds the embedding or the LM head of one
    the loader took for a target is its draft (SGLang's EAGLE worker shares them into the draft,
    and calls the loader with the target's runner first)."""
    if model in _TARGETS:
        return None
    ref = _DRAFT_OF.get(model)
    target = None if ref is None else ref()
    if target is None:
        target = draft_of(model, list(_TARGETS))
        if target is None:
            _TARGETS.add(model)
        else:
            _DRAFT_OF[model] = weakref.ref(target)
    return target


def _draft_call(draft: torch.nn.Module, target: torch.nn.Module, named_tensors) -> None:
    """The control messages on SGLang's draft runner: under ``refit.gen_draft`` its ``connect``
    hands the draft over to its target's plan; its ``refit`` and ``close`` have nothing more to do
    (the target's wrote the draft, and left the group). Without ``gen_draft`` (or before its target
    connected) the draft is left untouched. Never raises (as :func:`refit_loader`)."""
    with_draft = _DRAFTS.get(target)
    for name, _ in named_tensors:
        op = "?"
        try:
            op, _ = parse_message(name)
            if with_draft is None:
                log.debug("megatron_refit %s: SGLang's draft %s left untouched (refit.gen_draft is off, or its "
                          "target is not connected)", op, type(draft).__name__)
            elif op == "connect":
                if with_draft.draft is not None and with_draft.draft is not draft:
                    raise ValueError(f"refit.gen_draft: a second SGLang draft runner's model ({type(draft).__name__}) "
                                     "for one target: one draft model per step (SGLang's multi-layer EAGLE) is not "
                                     "planned; the first runner's draft stays handed over")
                with_draft.hand_over(draft)
                log.info("megatron_refit connect: SGLang's draft %s handed over: every refit writes it with the "
                         "main model", type(draft).__name__)
            else:
                log.debug("megatron_refit %s on SGLang's draft runner: nothing more to do (the target's %s "
                          "covered the draft)", op, op)
        except Exception as exc:  # noqa: BLE001 -- as refit_loader: raising would end the engine
            log.exception("megatron_refit %s on SGLang's draft failed", op)
            _ERRORS[draft] = f"{type(exc).__name__}: {exc}"
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
