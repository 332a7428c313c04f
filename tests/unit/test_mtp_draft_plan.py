"""#67: an engine that decodes with the model's MTP layer as its speculative draft holds that layer
(``model.layers.<N>.*``, N = num_hidden_layers) as targets; a trainer with no MTP layer cannot feed
it, and the plan refuses at start, naming the draft, rather than leave it the first version's."""

from __future__ import annotations

import pytest

from megatron_refit.errors import PlanError
from megatron_refit.plan.refit_plan import RefitPlan, skip_optional
from megatron_refit.plan.spec import ShardSpec, full_box


def _spec(name, shape=(4, 4)):
    return ShardSpec(name=name, global_shape=shape, dtype="bfloat16", box=full_box(shape))


MAIN = [_spec("model.embed_tokens.weight"), _spec("model.layers.0.mlp.down_proj.weight"),
        _spec("model.layers.2.mlp.down_proj.weight")]
DRAFT = [_spec("model.layers.3.eh_proj.weight", (4, 8)), _spec("model.layers.3.enorm.weight", (4,))]


def test_a_draft_the_trainer_does_not_train_is_refused_at_the_plan_naming_it():
    with pytest.raises(PlanError, match=r"HF name model.layers.3.eh_proj.weight is not produced by the trainer: it is "
                                        r"in model.layers.3, past the trainer's last decoder layer \(model.layers.2\), "
                                        r"so the engine holds an MTP layer \(its speculative draft"):
        RefitPlan.build({0: MAIN}, {0: MAIN + DRAFT})
    # a name the trainer lacks inside its layers is not a draft: the plain message
    with pytest.raises(PlanError, match=r"^HF name model.layers.1.mlp.down_proj.weight is not produced by the "
                                        r"trainer$"):
        RefitPlan.build({0: MAIN}, {0: MAIN + [_spec("model.layers.1.mlp.down_proj.weight")]})


def test_a_trainer_with_mtp_feeds_the_draft_and_without_a_draft_skips_it():
    mtp = frozenset(s.name for s in DRAFT)  # the trainer's optional pieces
    plan = skip_optional(RefitPlan.build({0: MAIN + DRAFT}, {0: MAIN + DRAFT}), mtp)
    assert sorted(t.name for t in plan.transfers) == sorted(s.name for s in MAIN + DRAFT)
    assert plan.skipped_params == ()
    plan = skip_optional(RefitPlan.build({0: MAIN + DRAFT}, {0: MAIN}), mtp)  # an engine without a draft
    assert sorted(t.name for t in plan.transfers) == sorted(s.name for s in MAIN)
    assert plan.skipped_params == tuple(sorted(mtp))


def test_under_gen_draft_an_unheld_mtp_layer_fails_every_ranks_plan_naming_the_draft():
    """refit.gen_draft: the train ranks declare no optional pieces (``Refitter.draft``), so where no
    engine rank holds the MTP layer every rank's plan refuses it, saying why, at start."""
    plan = RefitPlan.build({0: MAIN + DRAFT}, {0: MAIN})
    with pytest.raises(ValueError, match=r"the trainer produces 2 HF parameters that no generation rank holds .*; 0 "
                                         r"MTP parameters besides, which may be skipped\. 2 of them are the trainer's "
                                         r"MTP layers \(the decoder layers with an eh_proj\), which refit.gen_draft "
                                         r"requires the engine's speculative draft to hold"):
        skip_optional(plan, frozenset())
    with pytest.raises(ValueError, match=r"which may be skipped$"):  # a parameter inside the layers: no such hint
        skip_optional(RefitPlan.build({0: MAIN + [_spec("model.layers.1.mlp.down_proj.weight")]}, {0: MAIN}),
                      frozenset())
