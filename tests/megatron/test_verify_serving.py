"""Proof of serving (``refit.verify_serving``): the probe, the comparison and the cadence alone;
then real refits (Megatron train ranks, HF engine replicas scoring the probe with their own
forward, in band) where one replica's post-load step is broken on purpose and the check must
name exactly that replica, and must be what catches it (the same runs with the check off accept
the broken replica)."""

from __future__ import annotations

import math

import pytest

from megatron_refit.config import RefitConfig
from megatron_refit.fleet.serving import ServingCheck, ServingUnavailableError, served_or_raise, stale_of
from megatron_refit.errors import ServingMismatchError
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.plan.probe import (BULK, BULK_MIN_TOKENS, Probe, Reference, bulk, compare, default_tolerance,
                                      greedy_cover, make_probe, mean_difference, sweep)
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, run


class _Forward:
    """A trainer forward (``TrainerForward``) that counts its calls."""

    vocab_size, dtype, lora = 50, "float32", False
    experts = scale = routes = None  # a dense model; no logits' magnitudes measured

    def __init__(self):
        self.calls, self.fp8 = 0, None

    def prepare(self, *, fp8):
        self.fp8 = fp8

    def cover(self, base, *, budget, seed):
        return tuple(base)

    def __call__(self, sequences):
        self.calls += 1
        return [[-1.0] * (len(s) - 1) for s in sequences]


# -- the probe, the comparison, the cadence (no processes) ---------------------------------------


def test_verify_serving_probe_is_seeded_given_or_refused_by_name():
    a, b = make_probe(None, 100), make_probe({"seed": 0}, 100)
    assert a == b and len(a.sequences) == 4 and {len(s) for s in a.sequences} == {16}
    assert make_probe({"seed": 1}, 100) != a and all(0 <= t < 100 for s in a.sequences for t in s)
    assert make_probe({"sequences": 2, "length": 3}, 7).num_tokens == 4
    assert make_probe({"tokens": [[1, 2, 3], [4, 5]]}, 10).sequences == ((1, 2, 3), (4, 5))
    assert make_probe({"tokens": [[1, 2]], "cover_tokens": 0}, 10).sequences == ((1, 2),)
    assert make_probe({"seed": 1, "cover_tokens": 64}, 100) == make_probe({"seed": 1}, 100)
    for bad, words in [({"cover_tokens": -1}, "cover_tokens must be an int in 0..1048576, got -1"),
                       ({"tokens": [[1, 2]], "cover_tokens": 1.5}, "cover_tokens must be an int"),
                       ({"tokens": [[1]]}, "tokens[0] must be a list of at least 2"),
                       ({"tokens": [[1, 2]], "seed": 3}, "not both"), ({"length": 1}, "length must be an int"),
                       ({"sequences": True}, "sequences must be an int"), ({"sede": 1}, "unknown key(s) ['sede']"),
                       ([1, 2], "must be a mapping")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            make_probe(bad, 10)
    with pytest.raises(ValueError, match="token id 12, outside the model's vocabulary of 10"):
        make_probe({"tokens": [[1, 12]]}, 10)


def test_the_coverage_sweep_holds_each_token_once_and_the_greedy_cover_keeps_its_budget():
    pool = list(sweep(10, 4, seed=3))
    assert [len(s) for s in pool] == [4, 4, 4] and sorted({t for s in pool for t in s}) == list(range(10))
    assert pool == list(sweep(10, 4, seed=3)) and pool != list(sweep(10, 4, seed=4))
    assert pool[-1][2:] == pool[0][:2]  # the last filled from the permutation's start
    assert len(list(sweep(1000, 16, seed=0, limit=64))) == 4
    candidates = [{1, 2}, {3}, {1, 2, 3, 4}, {5}]
    assert greedy_cover({1, 2, 3, 4, 5}, candidates, [1, 1, 1, 1], budget=10) == [2, 3]
    assert greedy_cover({1, 2, 3, 4, 5}, candidates, [1, 1, 5, 1], budget=3) == [0, 1, 3]  # 2 too costly
    assert greedy_cover({1, 2, 3, 4, 5}, candidates, [1, 1, 1, 1], budget=1) == [2]
    assert greedy_cover({9}, candidates, [1, 1, 1, 1], budget=10) == []  # nothing helps
    assert greedy_cover(set(), candidates, [1, 1, 1, 1], budget=10) == []


def test_the_mean_difference_is_over_every_scored_token():
    assert mean_difference([[-1.0, -2.0], [-3.0]], [[-1.5, -2.0], [-2.0]]) == pytest.approx(0.5)
    assert mean_difference([], []) == 0.0


def test_verify_serving_compare_names_the_replica_version_and_first_token_beyond_the_tolerance():
    probe = Probe(((1, 2, 3), (4, 5, 6, 7)))
    reference = [[-1.0, -2.0], [-1.0, -1.5, -3.0]]
    close = [[-1.0000004, -2.0], [-1.0, -1.5000002, -3.0]]
    assert compare(close, reference, probe, tolerance=1e-3, floor=1e-3, replica=0, version=1) < 1e-6
    with pytest.raises(ServingMismatchError) as caught:
        compare([[-1.0, -2.0], [-1.0, -1.2, -3.5]], reference, probe, tolerance=1e-3, floor=1e-3, replica=3,
                version=7)
    err = caught.value
    assert (err.replica, err.version, err.first) == (3, 7, (1, 2)) and err.max_dlogprob == pytest.approx(0.5)
    assert "refit 7: engine replica 3 does not serve the trainer's model" in str(err)
    assert ("up to 0.5, 2 of the probe's 5 tokens beyond the tolerance 0.001 + 0 x their logits' magnitude; first "
            "beyond it at sequence 1, token 2" in str(err))
    with pytest.raises(ServingMismatchError, match="first beyond it at sequence 0, token 1") as caught:
        compare([[math.nan, -2.0], [-1.0, -1.5, -3.0]], reference, probe, tolerance=1e-3, floor=1e-3, replica=0,
                version=1)
    assert caught.value.max_dlogprob == math.inf  # a NaN is never within a tolerance
    for bad in (math.nan, math.inf, -math.inf):  # nor on the trainer's side (abs(x - nan) is nan: max() kept 0.0)
        with pytest.raises(ServingMismatchError, match="first beyond it at sequence 1, token 3") as caught:
            compare(reference, [[-1.0, -2.0], [-1.0, -1.5, bad]], probe, tolerance=1e-3, floor=1e-3, replica=0,
                    version=1)
        assert caught.value.max_dlogprob == math.inf
    with pytest.raises(ServingMismatchError, match=r"answered the serving probe with \[2, 2\] log-probs per "
                                                   r"sequence, expected \[2, 3\]"):
        compare([[-1.0, -2.0], [-1.0, -1.5]], reference, probe, tolerance=1e-3, floor=1e-3, replica=0, version=1)


def test_verify_serving_allows_each_token_for_its_logits_magnitude():
    """Both sides compute the logits to the dtype's relative precision: a token whose logits are
    large (|its logit| + |the largest|: the trainer measures it) is allowed ``relative`` times that
    more; a token whose logits are small is held to the absolute tolerance."""
    probe = Probe((tuple(range(33)),))
    want = [[-11.0] * 32]
    moved = [[-11.0 + 0.1] + [-11.0] * 31]
    for reference in (want, Reference(want, [[1.0] * 32])):  # small logits: the tolerance alone
        with pytest.raises(ServingMismatchError, match=r"1 of the probe's 32 tokens beyond the tolerance 0.02 \+ "
                                                       r"0.05 x their logits' magnitude;"):
            compare(moved, reference, probe, tolerance=0.02, relative=0.05, floor=0.02, replica=0, version=1)
    assert compare(moved, Reference(want, [[2.0] + [1.0] * 31]), probe, tolerance=0.02, relative=0.05, floor=0.02,
                   replica=0, version=1) == pytest.approx(0.1)  # 0.1 <= 0.02 + 0.05 * 2
    with pytest.raises(ServingMismatchError, match="32 of the probe's 32 tokens"):  # a NaN never passes
        compare([[math.nan] * 32], Reference(want, [[1e9] * 32]), probe, tolerance=0.02, relative=0.05, floor=0.02,
                replica=0, version=1)
    for bad in (math.nan, math.inf):  # nor NaN logits on the trainer's side: its log-prob and magnitude NaN
        with pytest.raises(ServingMismatchError, match="1 of the probe's 32 tokens") as caught:
            compare(want, Reference([[bad] + [-11.0] * 31], [[bad] + [1.0] * 31]), probe, tolerance=0.02,
                    relative=0.05, floor=0.02, replica=0, version=1)
        assert caught.value.max_dlogprob == math.inf
    with pytest.raises(ServingMismatchError, match="1 of the probe's 32 tokens"):  # a magnitude alone non-finite
        compare(want, Reference(want, [[math.nan] + [1.0] * 31]), probe, tolerance=0.02, relative=0.05, floor=0.02,
                replica=0, version=1)


def test_verify_serving_judges_the_probes_bulk_beside_each_token():
    """Each token within its own tolerance is not enough: 90 % of the probe's tokens must lie
    within ``BULK`` (0.2) of theirs. A few tokens far off (clean bf16: a router's near-ties) pass; the
    same shift on most tokens (a fault) fails, named as the bulk; a probe too short for a
    quantile is judged per token only."""
    n = 60
    probe = Probe((tuple(range(n + 1)),))
    want = [[-5.0] * n]
    reference = Reference(want, [[10.0] * n])  # each token's tolerance: 0.02 + 0.1 * 10 = 1.02
    tail = [[-5.0 + 0.9] * 5 + [-5.0 + 0.01] * (n - 5)]  # 5 of 60 near their limit, the rest at 1 %
    assert compare(tail, reference, probe, tolerance=0.02, relative=0.1, floor=0.02, replica=0, version=1) == \
        pytest.approx(0.9)
    assert bulk(tail, reference, tolerance=0.02, relative=0.1) == pytest.approx(0.01 / 1.02)
    shifted = [[-5.0 + 0.3] * n]  # every token at 30 % of its tolerance: within each, not as a bulk
    with pytest.raises(ServingMismatchError, match=r"the bulk of its log-probs is off, 90% of the probe's 60 tokens "
                                                   r"should differ .* by at most 0.2 of their tolerance .* quantile is "
                                                   r"0.294 of it") as caught:
        compare(shifted, reference, probe, tolerance=0.02, relative=0.1, floor=0.02, replica=2, version=7)
    assert (caught.value.replica, caught.value.version) == (2, 7) and "too tight" not in str(caught.value)
    assert bulk(shifted, reference, tolerance=0.02, relative=0.1) > BULK
    with pytest.raises(ServingMismatchError, match=r"quantile is 0.3 of it.*refit.serving_tolerance=0.1 is too tight"):
        compare([[-5.0 + 0.03] * n], Reference(want), probe, tolerance=0.1, floor=0.5, replica=0, version=1)
    short = Probe((tuple(range(BULK_MIN_TOKENS)),))  # BULK_MIN_TOKENS - 1 scored tokens
    few = [[-5.0 + 0.2] * (BULK_MIN_TOKENS - 1)]
    assert bulk(few, [[-5.0] * (BULK_MIN_TOKENS - 1)], tolerance=1.02) is None
    assert compare(few, [[-5.0] * (BULK_MIN_TOKENS - 1)], short, tolerance=1.02, floor=1.02, replica=0,
                   version=1) == pytest.approx(0.2)


def test_verify_serving_a_tolerance_tighter_than_the_dtypes_noise_says_so():
    probe = Probe(((1, 2, 3),))
    noise = [[-1.0 + 3e-6, -2.0]]  # float32 noise (clean runs measure <= 1e-6)
    with pytest.raises(ServingMismatchError, match=r"within this dtype's measured numerical noise \(default "
                                                   r"tolerance 0.001\): refit.serving_tolerance=1e-09 is too tight"):
        compare(noise, [[-1.0, -2.0]], probe, tolerance=1e-9, floor=default_tolerance("float32"), replica=0,
                version=2)
    with pytest.raises(ServingMismatchError) as caught:  # a real mismatch does not blame the tolerance
        compare([[-1.5, -2.0]], [[-1.0, -2.0]], probe, tolerance=1e-9, floor=1e-3, replica=0, version=2)
    assert "too tight" not in str(caught.value)
    assert default_tolerance("bfloat16", fp8=True, lora=True) > default_tolerance("bfloat16") > \
        default_tolerance("float32")
    with pytest.raises(ValueError, match="no default serving tolerance for dtype 'int8'"):
        default_tolerance("int8")


def test_verify_serving_cadence_first_refit_to_each_replica_every_nth_and_after_a_failure():
    forward = _Forward()
    check = ServingCheck(RefitConfig(enabled=True, verify_serving=3, trainer_quantize_fp8=False), forward, rank=0)
    assert forward.fp8 is False and check.tolerance == 1e-3 and check.enabled
    assert check.due([0, 1]) == {0: True, 1: True}  # the first refit to each replica
    check.record({0: dict(max_dlogprob=0.0, seconds=0.0), 1: dict(max_dlogprob=0.0, seconds=0.0)}, {}, 0.0)
    assert check.due([0, 1]) == {0: False, 1: False}
    assert check.due([0, 1, 2]) == {0: True, 1: True, 2: True}  # the 3rd refit; 2 just joined
    check.record({r: dict(max_dlogprob=0.0, seconds=0.0) for r in (0, 1, 2)}, {1: "ServingMismatchError: ..."}, 0.0)
    assert check.due([0, 1, 2]) == {0: False, 1: True, 2: False}  # 1 failed: checked again
    check.forget(0)
    assert check.due([0, 2]) == {0: True, 2: False}
    metrics = check.record({0: dict(max_dlogprob=2e-7, mean_dlogprob=1e-7, bulk=0.004, seconds=0.01)}, {}, 0.02,
                           [0, 2])
    assert metrics == {"refit/serving_checked": 1, "refit/serving_unchecked": 0, "refit/serving_max_dlogprob": 2e-7,
                       "refit/serving_mean_dlogprob": 1e-7, "refit/serving_bulk": 0.004,
                       "refit/serving_s": 0.03, "refit/serving_reference_s": 0.02,
                       "refit/serving_experts_covered": 0, "refit/serving_experts_total": 0,
                       "refit/serving_calibrated": 0, "refit/serving_draft_checked": 0,
                       "refit/serving_draft_max_dlogprob": 0.0, "refit/serving_draft_drift": 0.0,
                       "refit/serving_max_dlogprob/replica_0": 2e-7}


class _Routed(_Forward):
    """A MoE trainer forward: each sequence routes the experts named by its first token (a token
    ``t`` routes experts ``t % 12`` and ``(t + 1) % 12`` of 12); ``cover`` adds sequences from a pool."""

    def __init__(self, pool):
        super().__init__()
        self.pool, self.covers, self.experts, self.dead = pool, [], None, set()

    def __call__(self, sequences):  # ``dead``: experts the router (trained on) no longer sends a token to
        routed = {e for s in sequences for e in (s[0] % 12, (s[0] + 1) % 12)} - self.dead
        self.experts = (len(routed), 12)
        return super().__call__(sequences)

    def cover(self, base, *, budget, seed):
        self.covers.append((budget, seed))
        return tuple(base) + tuple(self.pool[: budget // 2])


def test_verify_serving_probe_is_extended_until_every_expert_is_routed_and_kept_while_it_is(caplog):
    """The reference's probe: ``serving_probe`` while it routes every expert; extended by the
    forward's ``cover`` where it does not; a WARNING, once, where ``cover_tokens`` runs out; the
    verdict compares with the probe the reference scored."""
    caplog.set_level("WARNING", logger="megatron_refit")
    spec = {"tokens": [[0, 1], [2, 1], [4, 1], [6, 1], [8, 1]]}  # experts 0-9 of 12
    forward = _Routed(pool=((10, 3), (1, 3), (5, 3)))
    check = ServingCheck(RefitConfig(enabled=True, verify_serving="on", serving_probe=dict(spec, cover_tokens=2)),
                         forward, rank=0)
    probe, reference, _ = check.take_reference()  # 2 tokens: one sequence more, experts 10 and 11
    assert probe.sequences == tuple(map(tuple, spec["tokens"])) + ((10, 3),) and check.probe == probe
    assert check.experts == (12, 12) and forward.covers == [(2, 0)] and len(reference.logprobs) == 6
    assert check.record({}, {}, 0.0)["refit/serving_experts_covered"] == 12
    assert check.verdict(0, 1, lambda: reference.logprobs, reference, probe)["max_dlogprob"] == 0.0
    said = [r.getMessage() for r in caplog.records]  # 6 tokens: judged per token only, said once
    assert len(said) == 1 and "scores 6 tokens, fewer than 40" in said[0] and "bulk" in said[0]
    assert check.verdict(0, 1, lambda: reference.logprobs, reference, probe)["bulk"] is None
    caplog.clear()
    assert check.take_reference()[0] == probe and len(forward.covers) == 1  # still covers: kept, no search
    assert not caplog.records
    forward.dead = {3}  # the router moved on: the probe routes fewer than the last search reached
    assert check.take_reference()[0] == probe and len(forward.covers) == 2 and check.experts == (11, 12)
    assert check.take_reference()[0] == probe and len(forward.covers) == 2  # 11 is what a search reaches now
    assert ["routes 11 of the 12" in r.getMessage() for r in caplog.records] == [True]
    caplog.clear()
    short = ServingCheck(RefitConfig(enabled=True, verify_serving="on", serving_probe=dict(spec, cover_tokens=1)),
                         _Routed(pool=((10, 3),)), rank=0)
    for _ in range(2):
        assert short.take_reference()[0].sequences == tuple(map(tuple, spec["tokens"]))  # nothing fits
    assert short.experts == (10, 12) and len(short.forward.covers) == 1  # not searched again at 10 of 12
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "the serving probe routes 10 of the 12 experts" in said[0] and "cover_tokens=1" in said[0]
    off = ServingCheck(RefitConfig(enabled=True, verify_serving="on", serving_probe=dict(spec, cover_tokens=0)),
                       _Routed(pool=((10, 3),)), rank=0)
    assert off.take_reference()[0] == off.base and off.forward.covers == []  # cover_tokens 0: never extended


def test_verify_serving_a_stale_read_back_fails_a_replica_whose_log_probs_agree():
    """An in-band answer that names stale parameters (the HF engine's read-back) fails the replica
    even where its log-probs are within the tolerance; without them the same answer passes."""
    check = ServingCheck(RefitConfig(enabled=True, verify_serving="on"), _Forward(), rank=0)
    probe, reference, _ = check.take_reference()
    served = reference.logprobs
    answer = {"served": served, "stale": ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]}
    assert served_or_raise(answer) == served and stale_of(answer) == answer["stale"] and stale_of(served) == []
    assert check.verdict(0, 3, lambda: served_or_raise(served), reference, probe)["max_dlogprob"] == 0.0
    with pytest.raises(ServingMismatchError, match=r"refit 3: engine replica 0 does not serve the trainer's model: "
                       r"its weights, read back after its post-load step, no longer hold the bytes it received in "
                       r"the buckets of 2 parameter\(s\) \['model.layers.0.mlp.down_proj.weight'") as caught:
        check.verdict(0, 3, lambda: served_or_raise(answer), reference, probe, stale_of(answer))
    assert caught.value.max_dlogprob == 0.0 and caught.value.replica == 0


def test_verify_serving_auto_skips_what_cannot_be_checked_and_on_refuses_it(caplog):
    caplog.set_level("INFO", logger="megatron_refit")
    bare = ServingCheck(RefitConfig(enabled=True), None, rank=0)  # auto: bare pieces, no forward: off, said
    assert not bare.enabled and bare.record({}, {}, 0.0, [0, 1])["refit/serving_unchecked"] == 2
    assert [r.levelname for r in caplog.records if "verify_serving auto: off" in r.getMessage()] == ["WARNING"]
    with pytest.raises(ValueError, match="refit.verify_serving='on' needs the trainer model's forward"):
        ServingCheck(RefitConfig(enabled=True, verify_serving="on"), None, rank=0)
    assert not ServingCheck(RefitConfig(enabled=True, verify_serving="off"), _Forward(), rank=0).enabled
    auto = ServingCheck(RefitConfig(enabled=True), _Forward(), rank=0)

    def cannot():
        raise ServingUnavailableError("a client without score()")

    found = auto.verdict(0, 1, cannot, [[-1.0] * 15] * 4, auto.probe)
    assert "unable" in found
    for _ in range(2):  # a WARNING the first time, counted every refit
        assert auto.record({0: found}, {}, 0.0, [0, 1])["refit/serving_unchecked"] == 1
    said = [r for r in caplog.records if "replica 0 is not checked until it rejoins" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"] and "a client without score()" in said[0].getMessage()
    assert auto.due([0, 1]) == {0: False, 1: True}  # not asked again; a new replica is
    on = ServingCheck(RefitConfig(enabled=True, verify_serving="on"), _Forward(), rank=0)
    with pytest.raises(ServingMismatchError, match="engine replica 0 cannot score the serving probe"):
        on.verdict(0, 1, cannot, [[-1.0] * 15] * 4, on.probe)
    for value, words in [(0, "positive int"), ("sometimes", "not one of"), (-1, "positive int")]:
        with pytest.raises(ValueError, match=words):
            RefitConfig(enabled=True, verify_serving=value)
    assert RefitConfig.from_dict({"enabled": True, "verify_serving": False}).serving_every is None  # YAML `off`
    assert RefitConfig.from_dict({"enabled": True, "verify_serving": True}).serving_every == 1
    with pytest.raises(ValueError, match="serving_tolerance must be positive"):
        RefitConfig(enabled=True, serving_tolerance=0.0)


class _CannotRun(_Forward):
    """A trainer forward that cannot run this model (as a standalone MTP stage, FP8 off the grid)."""

    def prepare(self, *, fp8):
        raise ValueError("refit.verify_serving: the layout has a standalone MTP stage")


def test_verify_serving_auto_turns_off_with_one_warning_where_the_forward_cannot_run(caplog):
    caplog.set_level("WARNING", logger="megatron_refit")
    auto = ServingCheck(RefitConfig(enabled=True), _CannotRun(), rank=0)
    assert not auto.enabled and auto.due([0, 1]) == {}
    warned = [r.getMessage() for r in caplog.records if "verify_serving auto: off" in r.getMessage()]
    assert len(warned) == 1 and "standalone MTP stage" in warned[0]
    for _ in range(2):  # every refit's replicas counted unchecked, no second warning
        assert auto.record({}, {}, 0.0, [0, 1])["refit/serving_unchecked"] == 2
    assert len([r for r in caplog.records if "verify_serving auto: off" in r.getMessage()]) == 1
    with pytest.raises(ValueError, match="standalone MTP stage"):  # on: refused at start, named
        ServingCheck(RefitConfig(enabled=True, verify_serving="on"), _CannotRun(), rank=0)


# -- real refits: a broken replica caught, named, and recovered ----------------------------------

BROKEN = 1
"""The replica whose post-load step is broken (of gen TP1 x DP2)."""


def _broken_run(verify: str, model: str, breaks, **kw) -> list[dict]:
    spec = RunSpec(model=model, train=TrainLayout(tp=2, ep=2 if model == "qwen3-moe" else 1),
                   gen=GenLayout(tp=1, dp=2), refits=1 + len(breaks) + 1, bucket_bytes=64 << 10, delta="on",
                   verify_serving=verify, breaks=breaks, **kw)
    return evaluate(spec, run(spec))["refits"]


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["on", "off"])
def test_verify_serving_catches_permuted_experts_and_an_unloaded_layer_on_exactly_that_replica(verify):
    """Qwen3-MoE, train TP2xEP2 into gen TP1xDP2, deltas on: replica 1's post-load step swaps
    two experts (version 2), then leaves a layer unloaded (version 3). With the check off the
    same refits report success while replica 1 holds other weights: only the check catches it.
    A client asks each replica for a forward pass the moment a version goes live: with the check
    on, that pass waits for the verdict, so no answer ever comes from a version that failed it."""
    refits = _broken_run(verify, "qwen3-moe", ((BROKEN, 2, "permute_experts"), (BROKEN, 3, "unload_layer")),
                         traffic=True)
    assert [r["bit_exact"] for r in refits] == [True, False, False, True]  # the breaks are real
    for r in refits:  # a client's pass asked the moment each version went live, on each replica
        failed = set(r["failed_replicas"]) if verify == "on" else set()
        assert r["traffic"] == {rep: ["refused" if rep in failed else r["version"]] for rep in (0, BROKEN)}, r
    # checked: each version was scored before it took traffic (the pass waited for the verdict)
    assert [r["gate_s"] > 0 for r in refits] == [verify == "on"] * 4, [r["gate_s"] for r in refits]
    if verify == "off":
        assert all(r["failed_replicas"] == {} and r["serving"]["checked"] == 0 for r in refits)
        assert all(r["serves"] == {0: True, BROKEN: True} for r in refits)  # nobody told: it serves the wrong model
        return
    for r in refits:
        assert r["serving"]["checked"] == 2, r  # every replica, every refit (on)
        assert r["serving"]["max_dlogprob/replica_0"] <= 1e-5  # float32: 100x under the tolerance
    for r in refits[1:3]:
        why = r["failed_replicas"][BROKEN]
        assert list(r["failed_replicas"]) == [BROKEN], r["failed_replicas"]
        want = f"ServingMismatchError: refit {r['version']}: engine replica {BROKEN} does not serve"
        assert why.startswith(want), why
        assert "first beyond it at sequence" in why and r["serving"][f"max_dlogprob/replica_{BROKEN}"] > 1e-2
        assert r["replicas_ok"] == 1
        # told in band before the refit returned: the HF engine refuses to serve what failed, the other serves
        held = r["serves"][BROKEN]
        assert r["serves"][0] is True and isinstance(held, str), r["serves"]
        assert f"the weights of refit {r['version']} failed their serving check (refit {r['version']}: engine " \
               f"replica {BROKEN} does not serve" in held, held
    assert refits[3]["failed_replicas"] == {} and refits[3]["serving"]["max_dlogprob"] <= 1e-5
    assert refits[3]["serves"] == {0: True, BROKEN: True}  # the next version landed and passed: served again


@pytest.mark.slow
def test_verify_serving_catches_a_stale_fp8_scale_and_passes_clean_fp8_with_margin():
    """Trainer-side FP8 (128-aligned Qwen3, train TP2 into gen TP1xDP2): replica 1 dequantizes
    one weight with the last refit's ``weight_scale_inv`` at version 2; the reference forward
    computes with the FP8 round trip, so the clean replica stays at float32 noise."""
    aligned = dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=256)
    refits = _broken_run("on", "qwen3", ((BROKEN, 2, "stale_scale"),), overrides=aligned, fp8="trainer")
    assert [sorted(r["failed_replicas"]) for r in refits] == [[], [BROKEN], []]
    assert "ServingMismatchError: refit 2: engine replica 1 does not serve" in refits[1]["failed_replicas"][BROKEN]
    assert all(r["serving"]["max_dlogprob/replica_0"] <= 1e-5 for r in refits)
    assert refits[2]["bit_exact"] and not refits[1]["bit_exact"]


@pytest.mark.slow
def test_verify_serving_under_overlap_comes_back_with_the_refits_report():
    """``refit.overlap: on``: the reference is taken at each step boundary, the check runs in the
    background refit, and its verdict comes back with that refit's report."""
    spec = RunSpec(model="qwen3", train=TrainLayout(tp=2), gen=GenLayout(tp=1, dp=2), refits=3,
                   bucket_bytes=64 << 10, overlap=True, hold_refits=True, verify_serving="on",
                   breaks=((BROKEN, 2, "unload_layer"),))
    refits = evaluate(spec, run(spec))["refits"]
    assert [sorted(r["failed_replicas"]) for r in refits] == [[], [BROKEN], []]
    assert all(r["serving"]["checked"] == 2 for r in refits)
    assert refits[0]["bit_exact"] and refits[2]["bit_exact"]


def test_reference_forward_refuses_a_standalone_mtp_stage_by_name():
    """A layout whose MTP stage comes before the loss's (Megatron's ``mtp_standalone``, from its
    layout, the same on every rank): the reference cannot run it, and says so at prepare()."""
    from types import SimpleNamespace

    import torch

    from conversion.serving import MegatronForward

    class Chunk(torch.nn.Module):
        def __init__(self, standalone: bool):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.config = SimpleNamespace(mtp_standalone=standalone, kv_channels=128, hidden_size=128,
                                          num_attention_heads=1)

    MegatronForward([Chunk(False)], SimpleNamespace(vocab_size=10)).prepare(fp8=False)
    with pytest.raises(ValueError, match=r"verify_serving: pipeline_model_parallel_layout puts the MTP layers on a "
                                         r"stage before the loss's \(a standalone MTP stage\)"):
        MegatronForward([Chunk(True)], SimpleNamespace(vocab_size=10)).prepare(fp8=False)


def _vocab_parallel_rank(rank, world, port):
    import torch

    from conversion.serving import _vocab_parallel_logprobs
    from conversion.testing.build import init_gloo, init_model_parallel

    init_gloo(rank, world, port)
    init_model_parallel(TrainLayout(tp=2))
    full = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)) * 30  # padded vocabulary 16
    labels = torch.randint(0, 6, (2, 5), generator=torch.Generator().manual_seed(4))
    out = {}
    for vocab in (6, 8, 12):  # rank 1's slice (8..15): all padding, its first column, most of it
        got = _vocab_parallel_logprobs(full[..., rank * 8:(rank + 1) * 8], labels, vocab)
        want = torch.log_softmax(full[..., :vocab], dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        magnitude = full[..., :vocab].gather(-1, labels.unsqueeze(-1)).squeeze(-1).abs() + \
            full[..., :vocab].max(dim=-1).values.abs()
        out[vocab] = (bool(torch.isfinite(got).all()), float((got[..., 0] - want).abs().max()),
                      float((got[..., 1] - magnitude).abs().max()))
    return out


def test_reference_log_probs_over_a_vocabulary_split_on_tp_with_a_rank_of_padding_only():
    """The reference's log-probs over Megatron's vocab-parallel logits, one all-gather over TP:
    the HF vocabulary's log-softmax on every rank, also where a TP rank's slice holds only
    Megatron's padding rows (its largest logit -inf: no NaN, which no replica could match)."""
    from megatron_refit.local.launch import run_spawned

    for ranks in run_spawned(_vocab_parallel_rank, 2):
        for vocab, (finite, logprob_error, magnitude_error) in ranks.items():
            assert finite, vocab
            assert logprob_error < 1e-4 and magnitude_error < 1e-4, (vocab, logprob_error, magnitude_error)


@pytest.mark.slow
@pytest.mark.slow
def test_verify_serving_read_back_catches_swapped_and_scaled_experts_at_bf16_64_experts_top8():
    """bf16, Qwen3-MoE 64 experts top-8 at an RL learning rate: replica 1's post-load step swaps
    two experts (version 2), then scales one expert's down projection by 1.05 (version 3). The
    log-probs do not see the x1.05 at bf16 (within each token's tolerance, the bulk's and the
    per-expert limit: the guide's "What it cannot catch"); the swap the per-expert limit, scaled for
    its experts' tokens, may see (on 1 thread it does: a median move of 0.01 of the tolerance
    against 0.009), else the HF engine's read-back of its live weights catches it; either fails
    that replica alone, and the next (full) refit serves again."""
    spec = RunSpec(model="qwen3-moe", overrides=dict(experts=64, num_experts_per_tok=8, vocab=2048),
                   gen=GenLayout(tp=1, dp=2), refits=4, bucket_bytes=1 << 20, dtype="bfloat16", lr=1e-6,
                   verify_serving="on", breaks=((BROKEN, 2, "permute_experts"), (BROKEN, 3, "scale_expert")))
    refits = evaluate(spec, run(spec))["refits"]
    assert [r["bit_exact"] for r in refits] == [True, False, False, True]  # the breaks are real
    assert [sorted(r["failed_replicas"]) for r in refits] == [[], [BROKEN], [BROKEN], []]
    for r in refits[1:3]:
        why = r["failed_replicas"][BROKEN]
        prefix = (f"ServingMismatchError: refit {r['version']}: engine replica {BROKEN} does not serve the trainer's "
                  "model: ")
        by_expert = r["version"] == 2 and why.startswith(prefix + "one expert's tokens are off its calibrated noise")
        assert by_expert or why.startswith(prefix + "its weights, read back after its post-load step, no longer hold "
                                                    "the bytes"), why
        assert by_expert or "model.layers.0.mlp.experts.0.down_proj.weight" in why, why  # among its bucket's
        assert r["serving"][f"max_dlogprob/replica_{BROKEN}"] < 0.02  # every token within the clean noise
    assert refits[3]["serves"] == {0: True, BROKEN: True}


def test_verify_serving_reads_the_hf_engines_weights_back_and_catches_one_left_a_version_stale():
    """bf16 at an RL learning rate (1e-6): replica 1's post-load step puts one weight back as it
    was before refit 2. It differs from the sent one by a bf16 step in a few elements, far
    below any log-prob tolerance; the HF engine's weights read back against the refit's digests
    name it, on that replica alone, and the next (full) refit serves again."""
    spec = RunSpec(model="qwen3", train=TrainLayout(tp=2), gen=GenLayout(tp=1, dp=2), refits=3,
                   bucket_bytes=64 << 10, dtype="bfloat16", lr=1e-6, verify_serving="on",
                   breaks=((BROKEN, 2, "stale_tensor"),))
    refits = evaluate(spec, run(spec))["refits"]
    assert [r["bit_exact"] for r in refits] == [True, False, True]  # the stale weight is real
    assert [sorted(r["failed_replicas"]) for r in refits] == [[], [BROKEN], []]
    why = refits[1]["failed_replicas"][BROKEN]
    assert why.startswith(f"ServingMismatchError: refit 2: engine replica {BROKEN} does not serve the trainer's "
                          "model: its weights, read back after its post-load step, no longer hold the bytes"), why
    assert "model.layers.0.mlp.down_proj.weight" in why  # with the others of its buckets
    assert refits[1]["serving"][f"max_dlogprob/replica_{BROKEN}"] < default_tolerance("bfloat16")  # log-probs: unseen
    held = refits[1]["serves"][BROKEN]
    assert isinstance(held, str) and "failed their serving check" in held and refits[1]["serves"][0] is True
    assert refits[2]["serves"] == {0: True, BROKEN: True}
