"""#67: an engine's draft beside its model as one refit target (``engines/fused/draft.py``), and
vLLM's draft session rules (``engines/vllm/worker/draft.py``), without vLLM: the draft's own
parameters under the checkpoint's names, the shared embedding and head left to the main model, a
copy of them or a draft without an MTP layer refused by name, and a refit in the wrong session
refused before any byte moves."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.engines.vllm.worker.draft import begin_session, vllm_draft

FIRST = 3


class _Main(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(16, 4)
        self.lm_head = torch.nn.Linear(4, 16, bias=False)


class _Layer(torch.nn.Module):  # vLLM's DeepSeekMultiTokenPredictorLayer, reduced
    def __init__(self, head):
        super().__init__()
        self.enorm = torch.nn.LayerNorm(4)
        self.eh_proj = torch.nn.Linear(8, 4, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = torch.nn.LayerNorm(4)
        self.shared_head.head = head
        self.mtp_block = torch.nn.Module()
        self.mtp_block.mlp = torch.nn.Linear(4, 4, bias=False)


def _draft(main: _Main, *, own_embedding: bool = False) -> torch.nn.Module:
    """vLLM's DeepSeekMTP as its proposer leaves it: the target's embedding and LM head shared."""
    draft = torch.nn.Module()
    draft.model = torch.nn.Module()
    draft.model.embed_tokens = torch.nn.Embedding(16, 4) if own_embedding else main.model.embed_tokens
    draft.model.layers = torch.nn.ModuleDict({str(FIRST): _Layer(main.lm_head)})
    return draft


def test_the_drafts_own_parameters_resolve_under_the_checkpoints_names():
    main = _Main()
    view = vllm_draft(main, FIRST)
    assert view.is_draft("model.layers.3.mlp.experts.w13_weight") and not view.is_draft("model.layers.2.mlp.x")
    assert dict(view.named_parameters()).keys() == dict(main.named_parameters()).keys()  # not handed over yet
    draft = _draft(main)
    view.hand_over(draft)
    names = dict(view.named_parameters())
    assert set(names) - set(dict(main.named_parameters())) == {
        "model.layers.3.enorm.weight", "model.layers.3.enorm.bias", "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.norm.weight", "model.layers.3.shared_head.norm.bias",
        "model.layers.3.mlp.weight"}  # mtp_block. dropped; the shared embedding and head are the model's once
    assert names["model.layers.3.mlp.weight"] is draft.model.layers["3"].mtp_block.mlp.weight


def test_a_draft_holding_its_own_embedding_or_no_mtp_layer_is_refused_by_name():
    main = _Main()
    with pytest.raises(ValueError, match=r"vLLM's draft holds its own model\.embed_tokens\.weight, not the main "):
        vllm_draft(main, FIRST).hand_over(_draft(main, own_embedding=True))
    eagle = torch.nn.Module()  # an EAGLE head: a layer 0 of its own, no MTP layer
    eagle.model = torch.nn.Module()
    eagle.model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4)})
    eagle.model.embed_tokens = main.model.embed_tokens
    with pytest.raises(ValueError, match=r"holds no MTP layer \(model\.layers\.3\.\*\): a draft the trainer does not"):
        vllm_draft(main, FIRST).hand_over(eagle)


def test_a_refit_in_the_wrong_session_is_refused_before_the_draft_is_bound():
    main = _Main()
    view = vllm_draft(main, FIRST)
    with pytest.raises(RuntimeError, match="refit.gen_draft is on: refit through vLLM's start_draft_weight_update"):
        begin_session(view, None)
    with pytest.raises(RuntimeError, match="start_draft_weight_update, but refit.gen_draft is off"):
        begin_session(None, (_draft(main), None))
    assert view.draft is None
    begin_session(None, None)  # a plain refit without a draft
    draft = _draft(main)
    begin_session(view, (draft, None))
    assert view.draft is draft
