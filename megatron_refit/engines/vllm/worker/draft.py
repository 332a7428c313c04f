"""vLLM's speculative draft as a refit target (``refit.gen_draft``, #67): the MTP layers vLLM
decodes with (``--speculative-config '{"method": "mtp", ...}'``, ``DeepSeekMTP``).

vLLM's contract for a draft: a weight-transfer engine that declares
``supports_draft_weight_update`` is handed the draft model by the worker
(``set_weight_update_target``) in a session the client opens with ``start_draft_weight_update``;
around it the worker shares the target's LM head with the draft and re-derives the draft's
copies at the end. Under ``refit.gen_draft`` every refit is such a session, and the engine writes
the whole version into both models in it, so the main model and its draft switch versions
together, under one post-load step each.

vLLM's draft holds the MTP layer ``N + i`` (``N = num_hidden_layers``) as
``model.layers.<N + i>.mtp_block.*`` (its decoder layer) beside its ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm``; its embedding and ``shared_head.head`` are the target's own
modules once vLLM's proposer loaded it (an MTP draft always shares them):
:func:`vllm_draft` spells the checkpoint's names so
(:class:`~megatron_refit.engines.fused.draft.ModelWithDraft`).
"""

from __future__ import annotations

import re

from megatron_refit.engines.fused.draft import ModelWithDraft

_OWN = re.compile(r"^model\.layers\.(\d+)\.(?:mtp_block\.)?")
DRAFT_METHODS = ("mtp",)
"""vLLM's speculative methods whose draft is the model's own MTP layers (``deepseek_mtp`` and the
other per-model names are normalised to ``mtp`` by vLLM's ``SpeculativeConfig``)."""


def check_draft_config(cfg, vllm_config, *, lora: bool) -> None:
    """``ValueError`` naming what rules out ``refit.gen_draft`` for this vLLM engine, before any
    byte moves: no speculative draft, a draft that is not the model's MTP layers (an external
    EAGLE model the trainer does not train: start without gen_draft, and the refit leaves it
    untouched), or a combination this receive path does not plan. Every ``engine_load`` and
    ``swap`` takes the draft: in place, the draft's parameters are written with the model's; under
    ``load_weights`` (and ``swap: staged``, which builds on it) vLLM's layerwise reload runs on the
    draft too, with its MTP pieces (:func:`reload_draft`, :func:`prepare_draft`)."""
    spec = vllm_config.speculative_config
    method = None if spec is None else spec.method
    if method not in DRAFT_METHODS:
        raise ValueError(
            f"refit.gen_draft: this vLLM engine's speculative method is {method!r}, not one of {list(DRAFT_METHODS)} "
            "(the model's own MTP layers as its draft, e.g. --speculative-config "
            "'{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}'); a draft the trainer does not train "
            "is left untouched with gen_draft: false")
    for key, value, why in (("gen_attention_dp", cfg.gen_attention_dp != 1, "a wide expert-parallel deployment"),
                            ("lora_sync", lora, "LoRA adapters (vLLM's draft session skips its LoRA reset)")):
        if value:
            raise ValueError(f"refit.gen_draft with refit.{key}: {why} into vLLM's draft is not planned yet")


def vllm_draft(model, first_layer: int) -> ModelWithDraft:
    """``model`` (vLLM's main model) with room for its MTP draft, handed over at each draft session."""
    def checkpoint_name(name: str) -> str | None:
        match = _OWN.match(name)
        if match is None or int(match.group(1)) < first_layer or ".shared_head.head." in name:
            return None  # the target's embedding and LM head (or no MTP layer's)
        return f"model.layers.{match.group(1)}." + name[match.end():]
    return ModelWithDraft(model, first_layer, checkpoint_name, "vLLM")


def split_pieces(with_draft: ModelWithDraft | None) -> tuple:
    """``load_weights`` mode: the predicates of the staged pieces that go to the main model's
    ``load_weights`` and to the draft's (None, None without a draft: all to the main model)."""
    if with_draft is None:
        return None, None
    return (lambda name: not with_draft.is_draft(name)), with_draft.is_draft


def reload_draft(handed: tuple, load) -> None:
    """``load_weights`` mode, under the pause: vLLM's layerwise reload of the handed-over draft
    (``handed``: the draft and its model config), fed by ``load(draft)`` (its MTP pieces only: the
    embedding and LM head it shares are the main model's, reloaded with it; vLLM's finalize puts
    back what a reload did not load), its post-load step run as vLLM's own draft reload runs it."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from megatron_refit.engines.vllm.worker.moe_reload import FirstLoadSetup

    draft, model_config = handed
    initialize_layerwise_reload(draft)
    with FirstLoadSetup(draft):
        load(draft)
        finalize_layerwise_reload(draft, model_config)


def prepare_draft(main, handed: tuple, load, budget_bytes: int | None):
    """``swap: staged``: the draft's version prepared beside the live draft (``prepare`` of
    :mod:`.prepare`, fed by ``load(shadow)``), and joined to ``main`` (the model's prepared version)
    so that one swap makes both live. The modules the draft shares with the model (its embedding
    and LM head) are the model's to swap: the draft's shadow of them is dropped."""
    from megatron_refit.engines.vllm.worker.moe_reload import FirstLoadSetup
    from megatron_refit.engines.vllm.worker.prepare import prepare

    left = None if budget_bytes is None else budget_bytes - main.nbytes
    draft = prepare(handed[0], load, first_load_setup=FirstLoadSetup, budget_bytes=left,
                    shared=main.modules())
    return main.joined(draft)


def begin_session(with_draft: ModelWithDraft | None, handed: tuple | None, *, reload: bool = False) -> None:
    """The start of a weight-update session (``handed``: vLLM's draft and its model config in a
    draft session, else None): under ``refit.gen_draft`` (``with_draft``) every refit is a draft
    session, which hands the draft over; without it no refit writes a draft. ``RuntimeError``
    naming the call otherwise, before any byte moves. ``reload`` (``load_weights`` mode): the draft
    must be one vLLM's reload can process again (``check_reloadable``)."""
    if with_draft is not None and handed is None:
        raise RuntimeError("megatron_refit: refit.gen_draft is on: refit through vLLM's start_draft_weight_update, "
                           "so that the draft lands with the main model")
    if with_draft is None and handed is not None:
        raise RuntimeError("megatron_refit: start_draft_weight_update, but refit.gen_draft is off: this refit "
                           "does not write the draft (start_weight_update)")
    if with_draft is not None:
        with_draft.hand_over(handed[0])
        if reload:  # load_weights mode: the draft's reload must run its experts' post-load step again
            from megatron_refit.engines.vllm.worker.moe_reload import check_reloadable

            check_reloadable(handed[0])
