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
from megatron_refit.plan.calibration import MIN_BULK, MIN_SHARE, Profile, due, limits, measure, remeasured
from megatron_refit.plan.probe import BULK, Probe, Reference, compare

TOKENS = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11),) * 5  # 50 scored tokens: the bulk is judged


def _profile(worst, bulk, tokens=TOKENS, version=1):
    return Profile(worst=worst, bulk=bulk, version=version, tokens=tokens)


def test_limits_are_the_margins_times_the_clean_noise_between_the_rounding_floor_and_the_bound():
    assert limits(None) is calibration.ROUNDING and (limits(None).token, limits(None).bulk) == (1.0, None)
    got = limits(_profile(0.104, 0.038))
    assert got.token == pytest.approx(calibration.TOKEN_MARGIN * 0.104)
    assert got.bulk == pytest.approx(calibration.BULK_MARGIN * 0.038) and got.profile.version == 1
    quiet = limits(_profile(1e-4, 1e-5))  # float32-quiet: never tighter than the rounding floor
    assert (quiet.token, quiet.bulk) == (MIN_SHARE, MIN_BULK)
    loud = limits(_profile(0.9, 0.15))  # never looser than the rounding bound
    assert (loud.token, loud.bulk) == (1.0, BULK)
    assert limits(_profile(0.1, None)).bulk is None  # a short probe: its bulk is not judged


def test_a_profile_is_each_tokens_share_of_its_rounding_bound():
    reference = Reference([[-1.0] * 50], [[10.0] * 25 + [0.0] * 25])  # bounds 0.02 + 0.1 x 10 and 0.02
    served = [[-1.0 - 0.102] + [-1.0] * 24 + [-1.0 - 0.01] + [-1.0] * 24]
    got = measure(served, reference, [tuple(range(51))], tolerance=0.02, relative=0.1, version=3)
    assert got.worst == pytest.approx(0.5) and got.bulk == 0.0 and got.version == 3  # 0.01 / 0.02; 0.102 / 1.02
    assert measure([[-1.0 - 0.002 * (t % 5 == 0) for t in range(50)]], Reference([[-1.0] * 50]), [tuple(range(51))],
                   tolerance=0.02, relative=0.1, version=1).bulk == 0.0  # 10 of 50 moved: above the 80 % quantile
    assert measure([[-1.0 - 0.002 * (t % 4 == 0) for t in range(50)]], Reference([[-1.0] * 50]), [tuple(range(51))],
                   tolerance=0.02, relative=0.1, version=1).bulk == pytest.approx(0.1)  # 13 of 50: within it
    assert got.tokens == (tuple(range(51)),)
    short = measure([[-1.01]], Reference([[-1.0]]), [(1, 2)], tolerance=0.02, relative=0.1, version=1)
    assert short.bulk is None and short.worst == pytest.approx(0.5)


def test_a_remeasure_never_shrinks_and_follows_a_new_probe():
    old = _profile(0.2, 0.04)
    assert remeasured(old, _profile(0.1, 0.05, version=9)) == _profile(0.2, 0.05, version=9)
    other = ((5, 6, 7),)
    new = remeasured(old, _profile(0.1, None, tokens=other, version=9))
    assert (new.worst, new.bulk, new.tokens) == (0.2, None, other)
    assert due(None, TOKENS) and not due(old, TOKENS) and due(old, other)


def test_compare_under_calibrated_limits_names_what_the_rounding_bound_alone_lets_pass():
    probe = Probe(TOKENS)
    reference = Reference([[-2.0] * 10 for _ in range(5)], [[1.0] * 10 for _ in range(5)])  # bound 0.12 each
    moved = [[-2.0] * 10 for _ in range(5)]
    moved[2][4] = -2.05  # 0.42 of its bound: within it, 4x a worst clean share of 0.1
    assert compare(moved, reference, probe, tolerance=0.02, relative=0.1, floor=0.02, replica=0, version=2) \
        == pytest.approx(0.05)
    with pytest.raises(ServingMismatchError) as caught:
        compare(moved, reference, probe, tolerance=0.02, relative=0.1, floor=0.02, replica=1, version=5, share=0.2,
                calibrated="; calibrated on X")
    text = str(caught.value)
    assert "1 of the probe's 50 tokens beyond 0.2 of the tolerance 0.02 + 0.1 x their logits' magnitude; " \
           "calibrated on X; first beyond it at sequence 2, token 5" in text
    assert text.endswith("each within the rounding bound itself (a difference the uncalibrated check lets pass), "
                         "beyond the noise this replica showed clean")
    bulk = [[-2.0 - 0.012 * (t % 2)] * 10 for t in range(5)]  # 0.1 of the bound on 30 of 50 tokens
    assert compare(bulk, reference, probe, tolerance=0.02, relative=0.1, floor=0.02, replica=0, version=2) \
        == pytest.approx(0.012)
    with pytest.raises(ServingMismatchError, match=r"the bulk of its log-probs is off, 80% of the probe's 50 tokens "
                                                   r"should differ from the trainer's by at most 0.05 of"):
        compare(bulk, reference, probe, tolerance=0.02, relative=0.1, floor=0.02, replica=0, version=2,
                calibrated_bulk=(0.8, 0.05))


class _Forward:
    """A trainer forward of a 12-token vocabulary in bf16 (only what ``ServingCheck`` reads)."""

    vocab_size, experts, dtype, scale, lora = 12, None, "bfloat16", None, False

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
    assert not first["calibrated"] and first["limit"] == 1.0 and check.profiles[0].worst == pytest.approx(0.1)
    assert check.verdict(0, 2, lambda: _served(0.02), reference, probe)["calibrated"]  # 0.17 < 2 x 0.1
    with pytest.raises(ServingMismatchError, match="beyond 0.2 of the tolerance .* calibrated on the clean noise this "
                                                   "replica showed at version 1: each token within 2x its worst "
                                                   "share 0.1") as caught:
        check.verdict(0, 3, lambda: _served(0.012, moved=0.05), reference, probe)  # 0.42 of the bound
    assert "each within the rounding bound itself" in str(caught.value)
    other = check.verdict(1, 3, lambda: _served(0.012, moved=0.05), reference, probe)  # replica 1: its first
    assert not other["calibrated"] and check.profiles[1].worst == pytest.approx(0.05 / 0.12)
    check.record({0: dict(max_dlogprob=0.05, seconds=0.0, mismatch=True)}, {0: "mismatch"}, 0.0, [0, 1])
    assert check.profiles[0].worst == pytest.approx(0.1)  # a failure keeps the profile: not re-taken on a fault
    metrics = check.record({1: check.verdict(1, 4, lambda: _served(0.012), reference, probe)}, {}, 0.0, [0, 1])
    assert metrics["refit/serving_calibrated"] == 1
    check.forget(0)  # a replica that leaves: whoever joins as 0 is calibrated again
    assert 0 not in check.profiles and not check.verdict(0, 5, lambda: _served(0.05), reference, probe)["calibrated"]


def test_a_failed_calibration_check_fails_by_name_and_calibrates_nothing():
    check = _check()
    probe, reference = Probe(TOKENS), Reference([[-2.0] * 10 for _ in range(5)], [[1.0] * 10 for _ in range(5)])
    for bad in (math.nan, 0.5):
        with pytest.raises(ServingMismatchError, match=r"This was its calibration check \(its first since it joined, "
                                                       r"where its clean noise is measured, judged against the "
                                                       r"rounding bound\): it has no calibration"):
            check.verdict(0, 1, lambda bad=bad: _served(bad), reference, probe)
    assert check.profiles == {}


def test_the_profile_is_taken_again_on_a_new_probe_and_never_without_proven_bytes():
    check = _check()
    probe, reference = Probe(TOKENS), Reference([[-2.0] * 10 for _ in range(5)], [[1.0] * 10 for _ in range(5)])
    for version in range(1, 4):
        check.verdict(0, version, lambda version=version: _served(0.003 * version), reference, probe)
    assert check.profiles[0].worst == pytest.approx(0.025) and check.profiles[0].version == 1  # not re-taken
    longer = Probe(TOKENS + ((1, 2, 3),))  # the probe extended (the router moved): measured on it
    check.verdict(0, 4, lambda: _served(0.011) + [[-1.0, -1.0]],
                  Reference(reference.logprobs + [[-1.0, -1.0]], reference.scale + [[1.0, 1.0]]), longer)
    assert check.profiles[0].worst == pytest.approx(0.011 / 0.12) and check.profiles[0].tokens == longer.sequences
    off = _check(verify="off")  # no refit proves its bytes: the rounding bound alone, every check
    for version in (1, 2):
        assert not off.verdict(0, version, lambda: _served(0.05), reference, probe)["calibrated"]
    assert off.profiles == {}
