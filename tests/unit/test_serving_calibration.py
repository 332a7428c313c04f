"""The serving check's limits from each replica's measured clean noise (#68):
``megatron_refit.plan.calibration`` and how ``ServingCheck`` applies it. The measured runs (bf16,
64 experts top-8, flat and peaked) are ``tests/megatron/test_serving_bf16.py``."""

from __future__ import annotations

import math

import pytest

from megatron_refit.config import RefitConfig
from megatron_refit.errors import ServingMismatchError
from megatron_refit.fleet.serving import ServingCheck
from megatron_refit.plan import calibration
from megatron_refit.plan.calibration import (EXPERT_MIN_TOKENS, MIN_BULK, MIN_EXPERT, MIN_SHARE, Profile, due,
                                             expert_scale, expert_shift, judge, limits, measure, passed, quantile,
                                             remeasured, shares, tail, tail_size)
from megatron_refit.plan.probe import BULK, Probe, Reference

TOKENS = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11),) * 5  # 50 scored tokens: the bulk is judged, the tail is 2 of them


def _profile(tail_, bulk, tokens=TOKENS, version=1):
    return Profile(tail=tail_, bulk=bulk, version=version, tokens=tokens)


def test_limits_are_the_margins_times_the_clean_noise_between_the_rounding_floor_and_the_bound():
    got = limits(_profile(0.104, 0.038))
    assert got.tail == pytest.approx(calibration.TAIL_MARGIN * 0.104)
    assert got.bulk == pytest.approx(calibration.BULK_MARGIN * 0.038) and got.profile.version == 1
    assert got.expert == pytest.approx(calibration.EXPERT_BULK * 0.038)  # the larger: 0.038 against 0.0156
    assert limits(_profile(0.3, 0.038)).expert == pytest.approx(calibration.EXPERT_MARGIN * 0.3)
    quiet = limits(_profile(1e-4, 1e-5))  # float32-quiet: never tighter than the rounding floor
    assert (quiet.tail, quiet.bulk, quiet.expert) == (MIN_SHARE, MIN_BULK, MIN_EXPERT)
    loud = limits(_profile(0.9, 0.15))  # never looser than the rounding bound
    assert (loud.tail, loud.bulk) == (1.0, BULK)
    assert limits(_profile(20.0, 0.15)).expert == 1.0
    assert limits(_profile(0.1, None)).bulk is None  # a short probe: its bulk is not judged


def test_the_tail_is_the_mean_of_the_largest_three_percent_and_the_bulk_the_80_percent_quantile():
    assert [tail_size(n) for n in (1, 2, 50, 66, 67, 195)] == [1, 2, 2, 2, 3, 6]
    values = [0.0] * 44 + [0.1] * 4 + [0.3, 0.5]
    assert tail(values) == pytest.approx(0.4) and quantile(values) == 0.0  # 6 of 50 above 0: past the 80 %
    assert quantile([0.0] * 39 + [0.1] * 11) == pytest.approx(0.1) and quantile([0.1] * 39) is None
    reference = Reference([[-1.0] * 50], [[10.0] * 25 + [0.0] * 25])  # bounds 0.02 + 0.1 x 10 and 0.02
    served = [[-1.0 - 0.102] + [-1.0] * 24 + [-1.0 - 0.01] + [-1.0] * 24]
    assert shares(served, reference, tolerance=0.02, relative=0.1)[:1] == [pytest.approx(0.1)]
    got = measure(shares(served, reference, tolerance=0.02, relative=0.1), [tuple(range(51))], version=3)
    assert got.tail == pytest.approx((0.5 + 0.1) / 2) and got.bulk == 0.0 and got.version == 3
    assert got.tokens == (tuple(range(51)),)


def test_a_remeasure_never_shrinks_and_follows_a_new_probe():
    old = _profile(0.2, 0.04)
    assert remeasured(old, _profile(0.1, 0.05, version=9)) == _profile(0.2, 0.05, version=9)
    other = ((5, 6, 7),)
    new = remeasured(old, _profile(0.1, None, tokens=other, version=9))
    assert (new.tail, new.bulk, new.tokens) == (0.2, None, other)
    assert due(None, TOKENS) and not due(old, TOKENS) and due(old, other)


def test_judge_names_the_tail_or_the_bulk_beyond_the_calibrated_noise():
    bound = limits(_profile(0.05, 0.03, version=4))  # tail 0.11, bulk 0.06
    judge([0.1] * 2 + [0.05] * 48, bound, tolerance=0.02, relative=0.1, replica=1, version=5, worst=0.01)
    with pytest.raises(ServingMismatchError) as caught:
        judge([0.3, 0.2] + [0.01] * 48, bound, tolerance=0.02, relative=0.1, replica=1, version=5, worst=0.04)
    text = str(caught.value)
    assert text.startswith("refit 5: engine replica 1 does not serve the trainer's model: the tail of its log-probs "
                           "is off its calibrated noise: over the probe's 50 tokens its 2 largest |Δ| (the largest 3%) "
                           "average 0.25 of their tolerance (0.02 + 0.1 x their logits' magnitude), beyond 0.11: 2.2x "
                           "the 0.05 this replica showed clean at version 4 (the largest difference 0.04)"), text
    assert caught.value.max_dlogprob == 0.04 and caught.value.replica == 1
    with pytest.raises(ServingMismatchError, match=r"the bulk of its log-probs is off its calibrated noise: over the "
                                                   r"probe's 50 tokens the 80% quantile of its \|Δ\| is 0.07 of their "
                                                   r"tolerance .*, beyond 0.06: 2x the 0.03"):
        judge([0.07] * 50, bound, tolerance=0.02, relative=0.1, replica=1, version=5, worst=0.01)


def test_expert_shift_is_the_largest_median_move_of_one_experts_tokens_since_the_last_check():
    routes = [((0, 3), (1, 0))] * 8 + [((0, 1), (1, 0))] * 8 + [((0, 5),)] * (EXPERT_MIN_TOKENS - 1)
    last = [0.1] * len(routes)
    now = [0.1 + 0.02 * (i < 6) for i in range(8)] + [0.1] * 8 + [0.9] * (EXPERT_MIN_TOKENS - 1)
    # expert 3 of layer 0: 6 of its 8 tokens moved by 0.02 (its median); expert 5 of layer 0 moved more but has
    # too few tokens to be judged; expert 0 of layer 1 holds both groups (median 0.0: a coherent move is diluted)
    assert expert_shift(now, last, routes) == (pytest.approx(0.02), (0, 3), 8)
    assert expert_shift(now[:4], last[:4], routes[:4]) is None
    with pytest.raises(ValueError, match=r"expert_shift: 23 shares, 22 earlier ones and 23 routes"):
        expert_shift(now, last[:-1], routes)


def test_an_expert_with_more_tokens_is_held_tighter_down_to_half_the_limit():
    assert expert_scale(8) == 1.0 and expert_scale(18) == pytest.approx(2 / 3) and expert_scale(32) == 0.5
    assert expert_scale(200) == 0.5  # an update's shared move of one expert's tokens does not shrink
    # the expert that moved most for its count: 0.02 over 32 tokens (0.04 in the limit's terms) before 0.03 over 8
    routes = [((0, 1),)] * 8 + [((0, 2),)] * 32
    assert expert_shift([0.03] * 8 + [0.02] * 32, [0.0] * 40, routes) == (pytest.approx(0.02), (0, 2), 32)


def test_judge_names_the_expert_whose_tokens_moved_together_since_the_last_passed_check():
    routes = [((0, 3),)] * 10 + [((0, 1),)] * 40
    profile = passed(_profile(0.05, 0.03, version=1), [0.0] * 50, version=4)  # expert limit 1 x 0.03
    bound = limits(profile)
    judge([0.026] * 10 + [0.0] * 40, bound, tolerance=0.02, relative=0.1, replica=2, version=5, worst=0.01,
          routes=routes)  # within 0.0268: 0.03 x sqrt(8 / 10) for its 10 tokens
    with pytest.raises(ServingMismatchError) as caught:
        judge([0.05] * 10 + [0.0] * 40, bound, tolerance=0.02, relative=0.1, replica=2, version=5, worst=0.01,
              routes=routes)  # tail 0.05 and bulk 0.0 within theirs: expert 3 alone moved
    assert str(caught.value).startswith(
        "refit 5: engine replica 2 does not serve the trainer's model: one expert's tokens are off its calibrated "
        "noise: the 10 probe tokens the trainer routes to expert 3 of layer 0 moved by a median of 0.05 of their "
        "tolerance (0.02 + 0.1 x their logits' magnitude) since its check at version 4, beyond 0.0268: 0.894x for "
        "its 10 tokens the larger of 0.15x the tail 0.05 and 1x the 80% quantile 0.03 this replica showed clean at "
        "version 1; the largest difference 0.01)"), str(caught.value)
    judge([0.05] * 10 + [0.0] * 40, bound, tolerance=0.02, relative=0.1, replica=2, version=5, worst=0.01)  # no routes
    judge([0.05] * 10 + [0.0] * 40, limits(_profile(0.05, 0.03)), tolerance=0.02, relative=0.1, replica=2, version=5,
          worst=0.01, routes=routes)  # no baseline kept (a profile from before): nothing to measure a move from


class _Forward:
    """A trainer forward of a 12-token vocabulary in bf16 (only what ``ServingCheck`` reads)."""

    vocab_size, experts, dtype, scale, routes, lora = 12, None, "bfloat16", None, None, False

    def prepare(self, *, fp8):
        pass


def _check(**cfg):
    return ServingCheck(RefitConfig(enabled=True, verify_serving="on", serving_probe={"tokens": [list(s) for s in
                                                                                                 TOKENS]}, **cfg),
                        _Forward(), rank=0)


def _served(worst: float, moved: float = 0.0) -> list[list[float]]:
    """-2.0 everywhere, but token (0, 0) by ``worst`` and token (3, 7) by ``moved``."""
    rows = [[-2.0] * 10 for _ in range(5)]
    rows[0][0] += worst
    rows[3][7] += moved
    return rows


def test_a_replica_is_judged_against_its_own_clean_noise_from_its_second_check():
    check = _check()
    probe, reference = Probe(TOKENS), Reference([[-2.0] * 10 for _ in range(5)], [[1.0] * 10 for _ in range(5)])
    first = check.verdict(0, 1, lambda: _served(0.012), reference, probe)  # 0.1 of the bound 0.12: calibrates
    assert not first["calibrated"] and first["tail_limit"] is None
    assert check.profiles[0].tail == pytest.approx(0.05)  # the mean of the 2 largest: 0.1 and 0
    passed = check.verdict(0, 2, lambda: _served(0.024), reference, probe)  # tail 0.1, within 2.2 x 0.05
    assert passed["calibrated"] and passed["tail_limit"] == pytest.approx(0.11)
    with pytest.raises(ServingMismatchError, match="the tail of its log-probs is off its calibrated noise: .* average "
                                                   "0.417 .* beyond 0.11: 2.2x the 0.05 this replica showed clean at "
                                                   "version 1") as caught:
        check.verdict(0, 3, lambda: _served(0.05, moved=0.05), reference, probe)  # 0.42 of the bound, twice
    assert caught.value.max_dlogprob == pytest.approx(0.05)
    other = check.verdict(1, 3, lambda: _served(0.05, moved=0.05), reference, probe)  # replica 1: its first
    assert not other["calibrated"] and check.profiles[1].tail == pytest.approx(0.05 / 0.12)
    check.record({0: dict(max_dlogprob=0.05, seconds=0.0, mismatch=True)}, {0: "mismatch"}, 0.0, [0, 1])
    assert check.profiles[0].tail == pytest.approx(0.05)  # a failure keeps the profile: a fault is not calibrated in
    metrics = check.record({1: check.verdict(1, 4, lambda: _served(0.012), reference, probe)}, {}, 0.0, [0, 1])
    assert metrics["refit/serving_calibrated"] == 1
    check.forget(0)  # a replica that leaves: whoever joins as 0 is calibrated again
    assert 0 not in check.profiles and not check.verdict(0, 5, lambda: _served(0.05), reference, probe)["calibrated"]


def test_a_replicas_expert_tokens_are_judged_from_its_last_passed_check_on_the_same_probe():
    check = _check()
    routes = [[((0, 3), (1, 2))] * 10] + [[((0, 1), (1, 2))] * 10 for _ in range(4)]  # seq 0: expert 3 of layer 0
    probe = Probe(TOKENS)
    reference = Reference([[-2.0] * 10 for _ in range(5)], [[1.0] * 10 for _ in range(5)], routes)

    def served(moved: float) -> list[list[float]]:
        rows = _served(0.012)  # the calibration's tail (0.1 and 0) every time
        rows[0][1:] = [-2.0 + moved] * 9  # expert 3's other 9 tokens
        return rows

    check.verdict(0, 1, lambda: served(0.0), reference, probe)  # calibrates: tail 0.05, expert limit 0.0075
    second = check.verdict(0, 2, lambda: served(0.0006), reference, probe)  # a median move of 0.005
    # reported against the limit in its terms: the move over sqrt(8 / 10), expert 3's factor for its 10 tokens
    assert second["calibrated"] and second["expert_moved"] == pytest.approx(0.005 / math.sqrt(0.8))
    assert second["expert_limit"] == pytest.approx(0.0075)
    assert check.profiles[0].last_version == 2 and check.profiles[0].version == 1
    assert check.verdict(0, 3, lambda: served(0.0012), reference, probe)["calibrated"]  # +0.005 from version 2
    with pytest.raises(ServingMismatchError, match=r"the 10 probe tokens the trainer routes to expert 3 of layer 0 "
                                                   r"moved by a median of 0.01 of their tolerance .* since its check "
                                                   r"at version 3, beyond 0.00671: 0.894x for its 10 tokens"):
        check.verdict(0, 4, lambda: served(0.0024), reference, probe)
    assert check.profiles[0].last_version == 3  # a failure keeps the baseline
    assert check.verdict(0, 5, lambda: served(0.0018), reference, probe)["calibrated"]
    check.verdict(0, 6, lambda: served(0.0036) + [[-1.0, -1.0]],  # a new probe: measured on it, its experts not judged
                  Reference(reference.logprobs + [[-1.0, -1.0]], reference.scale + [[1.0, 1.0]],
                            routes + [[((0, 3),)] * 2]), Probe(TOKENS + ((1, 2, 3),)))
    assert check.profiles[0].last_version == 6 and len(check.profiles[0].last) == 52


def test_a_failed_calibration_check_fails_by_name_and_calibrates_nothing():
    check = _check()
    probe, reference = Probe(TOKENS), Reference([[-2.0] * 10 for _ in range(5)], [[1.0] * 10 for _ in range(5)])
    for bad in (math.nan, 0.5):
        with pytest.raises(ServingMismatchError, match=r"This was its calibration check \(its first since it joined, "
                                                       r"where its clean noise is measured, judged against the "
                                                       r"rounding bound\): it has no calibration"):
            check.verdict(0, 1, lambda bad=bad: _served(bad), reference, probe)
    assert check.profiles == {}


def test_the_profile_is_taken_again_on_a_new_probe_and_never_without_proven_bytes(caplog):
    check = _check()
    probe, reference = Probe(TOKENS), Reference([[-2.0] * 10 for _ in range(5)], [[1.0] * 10 for _ in range(5)])
    for version in range(1, 4):
        check.verdict(0, version, lambda version=version: _served(0.006 * version), reference, probe)
    assert check.profiles[0].tail == pytest.approx(0.025) and check.profiles[0].version == 1  # not re-taken
    longer = Probe(TOKENS + ((1, 2, 3),))  # the probe extended (the router moved): measured on it
    check.verdict(0, 4, lambda: _served(0.011, moved=0.011) + [[-1.0, -1.0]],
                  Reference(reference.logprobs + [[-1.0, -1.0]], reference.scale + [[1.0, 1.0]]), longer)
    assert check.profiles[0].tail == pytest.approx(0.011 / 0.12) and check.profiles[0].tokens == longer.sequences
    with caplog.at_level("WARNING", logger="megatron_refit.fleet.serving"):
        off = _check(verify="off")  # no refit proves its bytes: the rounding bound alone, every check, said once
    assert [r.getMessage() for r in caplog.records] == [
        "refit.verify_serving: refit.verify is off, so no refit proves the bytes a calibration would measure the "
        "engine's noise on: every check is judged against the dtype's rounding bound alone (refit/serving_calibrated "
        "stays 0)"]
    for version in (1, 2):
        assert not off.verdict(0, version, lambda: _served(0.05, moved=0.05), reference, probe)["calibrated"]
    assert off.profiles == {}


def test_a_wide_deployment_is_judged_through_every_dp_rank_and_a_fault_on_one_names_it():
    """#64: each DP rank of a wide deployment serves from its own attention copy; its client scores the probe
    through each (PathScores). Clean paths pass (calibrated on the largest share per token over the paths);
    a fault on DP rank 1's copy alone fails the replica naming that DP rank, at the calibration check and later."""
    from megatron_refit.fleet.serving import PathScores

    check = _check()
    probe, reference = Probe(TOKENS), Reference([[-2.0] * 10 for _ in range(5)], [[1.0] * 10 for _ in range(5)])

    def paths(dp1: float):
        return PathScores((("DP rank 0", _served(0.012)), ("DP rank 1", _served(0.006, moved=dp1))))

    first = check.verdict(0, 1, lambda: paths(0.0), reference, probe)
    assert not first["calibrated"] and first["max_dlogprob"] == pytest.approx(0.012)
    with pytest.raises(ServingMismatchError, match=r"\(through its DP rank 1\)$"):
        check.verdict(0, 2, lambda: paths(0.5), reference, probe)  # beyond the rounding bound on DP rank 1 only
    fresh = _check()
    with pytest.raises(ServingMismatchError, match=r"\(through its DP rank 1\)\. This was its calibration check"):
        fresh.verdict(0, 1, lambda: paths(0.5), reference, probe)
    assert check.verdict(0, 3, lambda: paths(0.0), reference, probe)["calibrated"]
    # within the rounding bound but off DP rank 1's calibrated noise: named by the calibration too
    off = PathScores((("DP rank 0", _served(0.012)), ("DP rank 1", _served(0.05, moved=0.05))))
    with pytest.raises(ServingMismatchError, match=r"off its calibrated noise.*\(through its DP rank 1\)$"):
        check.verdict(0, 4, lambda: off, reference, probe)
