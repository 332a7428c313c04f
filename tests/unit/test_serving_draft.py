"""#67: the serving check of an engine's speculative draft (``fleet/draft_check.py``): an in-band
answer with the draft's log-probs is judged against the trainer's MTP layer's (the sequences from
their second token, each token within the rounding bound), a draft outside it fails its replica by
name, and an answer without a draft is counted unchecked, said once."""

from __future__ import annotations

import logging

import pytest

from megatron_refit.config import RefitConfig
from megatron_refit.errors import ServingMismatchError
from megatron_refit.fleet.draft_check import DraftScores
from megatron_refit.fleet.serving import ServingCheck, served_or_raise
from megatron_refit.plan.probe import Probe, Reference

TOKENS = tuple(tuple(range(i, i + 6)) for i in range(3))  # 3 sequences of 6: 5 scored tokens, 4 of the draft


class _Forward:
    vocab_size, experts, dtype, scale, routes, lora = 12, None, "bfloat16", None, None, False
    draft = draft_scale = None

    def prepare(self, *, fp8, draft=False):
        self.asked = draft


def _check():
    forward = _Forward()
    check = ServingCheck(RefitConfig(enabled=True, verify_serving="on", gen_draft=True,
                                     serving_probe={"tokens": [list(s) for s in TOKENS]}), forward, rank=0)
    assert forward.asked  # the reference scores the draft under gen_draft
    return check


REFERENCE = Reference([[-2.0] * 5 for _ in TOKENS], [[1.0] * 5 for _ in TOKENS],
                      draft=[[-3.0] * 4 for _ in TOKENS], draft_scale=[[1.0] * 4 for _ in TOKENS])


def _answer(draft_off: float = 0.0) -> dict:
    """An in-band answer as the HF engine gives it: the model's right, the draft's token (1, 2) off."""
    draft = [[-3.0] * 4 for _ in TOKENS]
    draft[1][2] += draft_off
    return {"logprobs": [[-2.0] * 5 for _ in TOKENS], "draft": draft}


def test_a_draft_within_the_rounding_bound_passes_and_is_counted():
    check = _check()
    served = served_or_raise(_answer(0.05))  # within 0.02 + 0.1 x 1.0
    assert isinstance(served, DraftScores)
    found = check.verdict(0, 1, lambda: served, REFERENCE, Probe(TOKENS))
    assert found["draft_dlogprob"] == pytest.approx(0.05) and found["max_dlogprob"] == 0.0
    metrics = check.record({0: found}, {}, 0.0, [0])
    assert metrics["refit/serving_draft_checked"] == 1
    assert metrics["refit/serving_draft_max_dlogprob"] == pytest.approx(0.05)


def test_a_draft_beyond_it_fails_its_replica_naming_the_draft():
    with pytest.raises(ServingMismatchError) as caught:
        _check().verdict(2, 3, lambda: served_or_raise(_answer(0.5)), REFERENCE, Probe(TOKENS))
    message = str(caught.value)
    assert message.startswith("refit 3: engine replica 2 does not serve the trainer's model: its log-probs differ from "
                              "the trainer's by up to 0.5, 1 of the probe's 12 tokens beyond"), message
    assert "first beyond it at sequence 1, token 3 (served -2.5, trainer -3)" in message  # counted from token 2
    assert message.endswith("[in its speculative draft: the MTP layer's log-prob of the token after the next, against "
                            "the trainer's MTP layer; sequence and token counted from each sequence's second token]")
    assert caught.value.replica == 2 and caught.value.max_dlogprob == pytest.approx(0.5)


def test_a_draft_answer_of_another_shape_fails_and_none_is_unchecked_said_once(caplog):
    bad = {"logprobs": [[-2.0] * 5 for _ in TOKENS], "draft": [[-3.0] * 5 for _ in TOKENS]}  # the model's shape
    with pytest.raises(ServingMismatchError, match=r"answered the serving probe with \[5, 5, 5\] log-probs per "
                                                   r"sequence, expected \[4, 4, 4\].*speculative draft"):
        _check().verdict(0, 1, lambda: served_or_raise(bad), REFERENCE, Probe(TOKENS))
    check = _check()
    with caplog.at_level(logging.WARNING):
        found = [check.verdict(r, 1, lambda: [[-2.0] * 5 for _ in TOKENS], REFERENCE, Probe(TOKENS)) for r in (0, 1)]
    assert [f["draft_dlogprob"] for f in found] == [None, None]
    assert check.record(dict(enumerate(found)), {}, 0.0, [0, 1])["refit/serving_draft_checked"] == 0
    said = [r for r in caplog.records if "gives the model's log-probs only" in r.getMessage()]
    assert len(said) == 1 and "engine replica 0 " in said[0].getMessage()


def test_a_draft_drifting_from_its_clean_noise_is_reported_not_failed(caplog):
    check = _check()
    first = check.verdict(0, 1, lambda: served_or_raise(_answer(0.0)), REFERENCE, Probe(TOKENS))
    assert first["draft_drift"] is None  # its calibration check: its clean tail (0, at least the floor)
    same = check.verdict(0, 2, lambda: served_or_raise(_answer(0.0)), REFERENCE, Probe(TOKENS))
    assert same["draft_drift"] == 0.0
    with caplog.at_level(logging.WARNING):
        moved = check.verdict(0, 3, lambda: served_or_raise(_answer(0.05)), REFERENCE, Probe(TOKENS))
    # one token 0.05 / 0.12 of its bound: the tail (the 2 largest of 12) 0.208, over the floor 0.005
    assert moved["draft_drift"] == pytest.approx(0.05 / 0.12 / 2 / 0.005)
    assert check.record({0: moved}, {}, 0.0, [0])["refit/serving_draft_drift"] == pytest.approx(41.67, rel=1e-3)
    assert any("engine replica 0's speculative draft drifted from the trainer's MTP layer" in r.getMessage()
               for r in caplog.records)
    check.forget(0)  # whoever joins as replica 0 is measured clean again
    assert check.verdict(0, 4, lambda: served_or_raise(_answer(0.05)), REFERENCE, Probe(TOKENS))["draft_drift"] is None
