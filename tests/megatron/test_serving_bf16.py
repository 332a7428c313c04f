"""The serving check at bf16 on a 64-expert top-8 MoE (``refit.verify_serving``, #50 item 2,
#68), in three model states: nearly flat (10 Adam steps from random init), peaked (trained on 8
repeated sequences until the trainer predicts them with mean probability > 0.9) and trained hard on
them (a corpus loss near 0.01, where single clean tokens move far between refits), with the
engine's weights not read back (``readback: false``: as on vLLM and SGLang, whose post-load steps
re-pack). In each, the first check is judged against the rounding bound (each token within 0.02 +
0.1 x (|its logit| + |the largest logit|), 90 % of the probe's tokens within 0.2 of that) and
measures the replica's clean noise (again where the probe is extended anew: the router trained);
the next 19 checks are also held to the limits calibrated from it (``plan.calibration``: the
probe's tail and bulk against the calibration, and each expert's tokens against the replica's last
passed check). In every state: 20 clean refits at an RL learning
rate (1e-6) pass (trained hard, the rounding bound itself fails some clean refits on some CPUs and
thread counts: the known limit, docs/guide-serving.md "What passes"), and a NaN in one routed
expert, a wrong RoPE base and a post-load scale error (the final norm x1.1) are caught; on the
nearly flat and peaked models two swapped experts too. The calibration fails no clean refit that the
rounding bound passes, and a fault the calibration alone catches is one the rounding bound passes.

On the nearly flat model on 1 thread, as this test runs in ``make test``, two swapped experts move
the probe's tail only 1.25x its clean value (inside the 2.2x margin): the per-expert limit catches
them, scaled for their experts' 13 and 23 probe tokens (``calibration.expert_scale``; unscaled they
moved 0.94 of it and passed: docs/guide-serving.md, "Calibrated limits"). Two swapped experts on
the hard-trained model (caught on all 11 trajectories measured), one expert x1.05 and an attention
output x1.02 are measured and printed, not asserted. The HF engine's read-back of its live weights
catches every weight fault of these (``test_verify_serving.py``).
"""

from __future__ import annotations

import math

import pytest

from megatron_refit.local.launch import run_spawned
from megatron_refit.testing.serving_power import power_rank, summary

pytestmark = pytest.mark.slow

CAUGHT = {"flat": {"nan", "rope", "scale x1.1", "swap"}, "peaked": {"nan", "rope", "scale x1.1", "swap"},
          "hard": {"nan", "rope", "scale x1.1"}}
"""Faults the check must catch in each state (the others are reported)."""
CLEAN = ("flat", "peaked")
"""States whose 20 clean refits must all pass."""


def test_bf16_serving_check_passes_clean_rl_refits_and_catches_what_log_probs_can_see():
    found = run_spawned(power_rank, 1, timeout_s=900)[0]
    for state, got in summary(found).items():
        print(state, got)
    assert found["peaked"]["loss"] < math.log(1 / 0.9)  # the corpus: geometric mean probability > 0.9
    for state, got in found.items():
        failed = [r["message"] for r in got["clean"] if "message" in r]
        by_calibration = [m for m in failed if "off its calibrated noise" in m]
        assert not by_calibration, f"{state}: the calibration failed a clean refit: {by_calibration[0]}"
        if state in CLEAN:
            assert not failed, f"{state}: {len(failed)} of 20 clean refits failed: {failed[0]}"
            assert [bool(r["calibrated"]) for r in got["clean"]] == [False] + [True] * 19  # the first calibrates
        # calibrated at the first check, or where the probe was last extended anew (on some CPUs a
        # clean refit of the peaked model moves its router: version 5 on an Ice Lake Xeon, 2026-12-07)
        assert got["calibration"]["version"] == max([1, *got["probe_extended"]]), got["probe_extended"]
        assert got["calibration"]["tail_limit"] < 1.0
        for fault, result in got["faults"].items():
            caught = "does not serve the trainer's model" in result.get("message", "")
            assert caught or fault not in CAUGHT[state], f"{state}: {fault} passed (max |Δ| {result['max_dlogprob']})"
            if caught and "off its calibrated noise" in result["message"]:
                assert result["rounding_passes"], result["message"]  # the calibration's own catch
