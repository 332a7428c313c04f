"""SGLang's speculative draft as a refit target (``refit.gen_draft``, #67): the NextN draft SGLang
decodes with (``--speculative-algorithm NEXTN``, which SGLang resolves to ``EAGLE``; on a DeepSeek-V3
model its draft is ``DeepseekV3ForCausalLMNextN``, built from the model's own checkpoint).

SGLang's contract for a draft: a weight-update session's selector (``begin_weight_update``, and
each ``update_weights_from_tensor``) names the runners a call reaches, and
``SchedulerWeightUpdaterManager`` calls the custom weight loader once per selected runner, the
target's first, then the draft worker's (selector ``all``), with the same message. Under
``refit.gen_draft`` the trainer's clients select ``all``: the target's ``connect`` plans the main
model and its draft as one (:class:`~megatron_refit.engines.fused.draft.ModelWithDraft`, the
draft's parameters placeholders until it is handed over), the draft's ``connect`` hands it over,
and the target's ``refit`` writes the whole version into both and runs both post-load steps; on
the draft's runner ``refit`` and ``close`` then have nothing left to do. Without ``gen_draft``
the clients select ``target``, and a draft the loader is given anyway is left untouched.

SGLang's NextN draft holds the MTP layer ``N`` (``N = num_hidden_layers``) as ``model.decoder.*``
(SGLang's ``DeepseekV2DecoderLayer``) beside its ``model.enorm``, ``model.hnorm``,
``model.eh_proj`` and ``model.shared_head.norm``; its ``model.embed_tokens`` and ``lm_head`` are
the target's own parameters once SGLang's EAGLE worker shared them (``set_embed_and_head``), which
is also how the loader tells the draft's runner from a target's: :func:`draft_of`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit.engines.fused.draft import SHARED, ModelWithDraft
from megatron_refit.engines.fused.live import LiveModelStorage, resolve_names

DRAFT_ALGORITHMS = ("EAGLE", "NEXTN")
"""SGLang's speculative algorithms whose draft for a DeepSeek-V3 model is its own MTP layer
(SGLang's NextN class; ``NEXTN`` is resolved to ``EAGLE`` by SGLang's server args)."""
_OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
"""The NextN draft's own modules beside its decoder layer, under ``model.``."""


def check_draft_server(cfg, algorithm, mtp_layers) -> None:
    """``ValueError`` naming what rules out ``refit.gen_draft`` for this SGLang engine, before it
    joins the refit group: no speculative draft (``algorithm``: the server's
    ``speculative_algorithm``), a model whose MTP layers SGLang's NextN draft does not hold
    (``mtp_layers``: its ``num_nextn_predict_layers``; NextN holds one), or a combination this
    receive path does not plan."""
    name = None if algorithm is None else str(algorithm).upper()
    if name not in DRAFT_ALGORITHMS:
        raise ValueError(
            f"refit.gen_draft: this SGLang engine's speculative_algorithm is {algorithm!r}, not one of "
            f"{list(DRAFT_ALGORITHMS)} (the model's own MTP layer as its NextN draft: --speculative-algorithm "
            "NEXTN); a draft the trainer does not train is left untouched with gen_draft: false")
    if mtp_layers != 1:
        raise ValueError(f"refit.gen_draft: the model has num_nextn_predict_layers={mtp_layers!r}; SGLang's NextN "
                         "draft holds exactly one MTP layer (model.layers.<num_hidden_layers>)")
    for key, value, why in (("gen_attention_dp", cfg.gen_attention_dp != 1, "a DP-attention deployment"),):
        if value:
            raise ValueError(f"refit.gen_draft with refit.{key}: {why} into SGLang's draft is not planned yet")


def sglang_draft(model, first_layer: int) -> ModelWithDraft:
    """``model`` (SGLang's main model) with room for its NextN draft, handed over at the draft
    runner's ``connect``."""
    layer = f"model.layers.{first_layer}."

    def checkpoint_name(name: str) -> str | None:
        if name.startswith("model.decoder."):
            return layer + name.removeprefix("model.decoder.")
        if any(name.startswith(f"model.{own}.") for own in _OWN):
            return layer + name.removeprefix("model.")
        return None  # the target's embedding and LM head (or a parameter hand_over refuses by name)
    return ModelWithDraft(model, first_layer, checkpoint_name, "SGLang")


def _shared_addresses(model) -> set[int]:
    return {p.data_ptr() for n, p in model.named_parameters() if n in SHARED and p.data_ptr()}


def draft_of(model, targets) -> object | None:
    """The model among ``targets`` (SGLang models the loader took for targets) whose embedding or
    LM head ``model`` holds as its own: SGLang's EAGLE worker shares them into its draft
    (``set_embed_and_head``), so ``model`` is that target's draft runner's model. None: no target's."""
    mine = _shared_addresses(model)
    for target in targets:
        if target is not model and mine & _shared_addresses(target):
            return target
    return None


class DraftModelStorage(LiveModelStorage):
    """:class:`~megatron_refit.engines.fused.live.LiveModelStorage` over a
    :class:`~megatron_refit.engines.fused.draft.ModelWithDraft`: a refit that starts before SGLang's
    draft runner handed the draft over is refused by name in the refit's handshake (every rank
    told, before any byte moves), and so is one into a draft that holds a parameter in another
    dtype than the trainer sends (:meth:`check_draft`)."""

    model: ModelWithDraft
    _checked: torch.nn.Module | None = None
    """The handed-over draft :meth:`check_draft` held to the plan (its parameters were placeholders
    when the plan was built)."""

    def refresh_targets(self) -> bool:
        draft = self.model.draft
        if draft is None:
            raise RuntimeError(
                "refit.gen_draft: SGLang's draft was never handed over: its runner's connect did not reach "
                "the loader (begin_weight_update and update_weights_from_tensor with selector 'all', as the "
                "trainer's clients send under gen_draft) or refused it (that worker's log says why)")
        if draft is not self._checked:
            self.check_draft(draft)
            self._checked = draft
        return super().refresh_targets()

    def check_draft(self, draft: torch.nn.Module) -> None:
        """``ValueError`` naming the first of the draft's parameters whose dtype is not the one the
        trainer sends. An FP8 engine quantizes its NextN draft by the checkpoint's FP8 config under
        SGLang's own module names (``model.decoder.*``; SGLang maps a checkpoint's
        ``model.layers.<N>`` onto them for DeepSeek-V3's ``N = 61`` only), while trainer-side FP8
        keeps MLA's low-rank down projections (SGLang's ``fused_qkv_a_proj_with_mqa``) in bf16."""
        table = {name: spec for name, spec in self._shapes.items() if self.model.is_draft(name)}
        views = resolve_names(table, dict(self.model.named_parameters()))
        own = {p.data_ptr(): n for n, p in draft.named_parameters()}
        for name, (_, dtype) in table.items():
            have = str(views[name].dtype).removeprefix("torch.")
            if have != dtype:
                raise ValueError(
                    f"refit.gen_draft: SGLang's draft {type(draft).__name__} holds "
                    f"{own.get(views[name].data_ptr(), name)} ({name}) as {have}, the trainer sends {dtype}: an FP8 "
                    "engine's draft is quantized by the checkpoint's FP8 config under SGLang's NextN module names "
                    "(model.decoder.*), and trainer-side FP8 keeps MLA's down projections in bf16: list "
                    "model.decoder.self_attn.q_a_proj and model.decoder.self_attn.kv_a_proj_with_mqa in its "
                    "ignored_layers (or modules_to_not_convert)")


def draft_post_load(with_draft: ModelWithDraft, post_load) -> Callable[[], None]:
    """After a refit: ``post_load(model)`` (SGLang's post-load hook) of the main model, then of
    the draft (NextN's ``post_load_weights``: its MLA absorb)."""
    def run() -> None:
        post_load(with_draft.main)()
        if with_draft.draft is not None:
            post_load(with_draft.draft)()
    return run
