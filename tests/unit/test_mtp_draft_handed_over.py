"""#67: a draft that reaches the refit after its plan (vLLM hands its draft over at the first draft
session) is held to the plan when it arrives: a draft parameter in another dtype than the trainer
sends (an FP8 engine's draft quantized where trainer-side FP8 keeps the weight bf16) is named as
handed over, not as a parameter that "changed since prepare()"."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.engines.fused.draft import ModelWithDraft
from megatron_refit.engines.fused.live import LiveModelStorage
from megatron_refit.plan.gen_layout import GenLayout, ModelShape

EH = "model.layers.1.eh_proj.weight"


class _Draft(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.layer = torch.nn.Linear(8, 4, bias=False).to(dtype)


def _storage():
    main = torch.nn.Module()
    with_draft = ModelWithDraft(main, 1, lambda name: EH if name == "layer.weight" else None, "vLLM")
    storage = LiveModelStorage.for_model(with_draft, {EH: ((4, 8), "bfloat16")}, GenLayout(tp=1),
                                         ModelShape(num_attention_heads=1, num_kv_heads=1, vocab_size=4),
                                         gen_index=0, pending=with_draft.is_draft)
    return with_draft, storage


def test_a_draft_handed_over_in_the_planned_dtype_is_bound():
    with_draft, storage = _storage()
    draft = _Draft(torch.bfloat16)
    with_draft.hand_over(draft)
    assert storage.refresh_targets() is True  # the placeholder's view re-resolved into the draft's parameter
    assert storage.buffer(EH).data_ptr() == draft.layer.weight.data_ptr()


def test_a_draft_handed_over_in_another_dtype_is_named_as_handed_over():
    with_draft, storage = _storage()
    with_draft.hand_over(_Draft(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=rf"engine parameter {EH} is torch.float8_e4m3fn as the engine handed it "
                                         r"over \(a draft\), the trainer sends bfloat16"):
        storage.refresh_targets()
