"""What proof of serving (``refit.verify_serving``) costs next to the refit it checks, and that it
catches a broken engine, in one run.

Megatron train TP2 (real optimizer steps between refits) into two Hugging Face engine replicas
(gen TP1 x DP2; each scores the probe with its own forward, in band), ``verify_serving: on``:

- ``refit_s``: the median wall time of a refit (its slowest replica's group);
- ``serving_check_s``: the median time of the check (the trainer's reference forward over the
  probe, every train rank at once, plus the slowest replica's scoring and answer) and
  ``check_over_refit`` their ratio, the cost of checking every refit (``verify_serving: N``
  divides it by N);
- ``reference_s``: the trainer's forward alone (what the training loop waits for under
  ``refit.overlap: on``);
- ``added_s``: what the check adds to the training loop's wait for a refit (``fleet.refit``'s wall
  time; one run under ``verify_serving: 2``, its checked refits against its unchecked ones, side by
  side), ``wall_off_s`` that wait without it, and ``added_over_refit_auto`` the share under
  ``auto`` (every 10th refit);
- ``gate_s``: how long a checked version is live but kept from traffic until its verdict (it is
  scored before it takes traffic), beside ``blocked_s``, what the refit itself blocks traffic for
  (in place: the whole refit; ``staged``: the swap's pause, measured in a second run under
  ``refit.swap: staged``), and their ratio ``gate_over_blocked``;
- ``caught_broken``: a second run whose replica 1 keeps its first decoder layer from before the
  refit at version 3 (:func:`megatron_refit.local.faults.break_post_load`): the check names
  replica 1 at version 3 and no other, and the next refit serves right again.

- ``moe``: the same check on a MoE model as users train one: Qwen3-MoE with 64 experts top-8,
  bf16, train TP2 with sequence parallelism x EP2, RL learning rate 1e-6: the check's cost, its
  clean max and mean |Δ| over the refits beside the bf16 tolerance (absolute, and ``relative``: times
  each token's logits' magnitude), and ``experts_covered`` of
  ``experts_total`` (the (layer, expert) pairs the probe routes to under the trainer's router,
  after its extension).

- ``power``: what the check sees at bf16 (:mod:`megatron_refit.testing.serving_power`): a
  64-expert top-8 Qwen3-MoE nearly flat and peaked, 20 clean refits at lr 1e-6 each (the first
  calibrates the limits, #68; the weights are not read back: ``readback: false``), then six
  engines broken after the load; per state the clean max and mean |Δ|, the calibration and its
  limits, each fault's |Δ|, whether it was caught and whether the rounding bound alone passes it,
  and ``smallest_caught``; a fault not caught is printed beside the clean noise it stays in.

``--larger``: about 5M parameters (``bench_overlap.py``'s model) instead of the tests' one.
``--json``: the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from machine import cpu_model
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.plan.probe import default_tolerance, relative_tolerance
from megatron_refit.tools.cli import reports_user_errors
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, run
from megatron_refit.local.launch import run_spawned
from megatron_refit.testing.serving_power import power_rank, summary

LARGER = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768, vocab=4096)
BROKEN_AT = 3


def _runs(shape: dict, refits: int, swap: str, verify: str | int) -> list[dict]:
    spec = RunSpec(model="qwen3", overrides=shape, train=TrainLayout(tp=2), gen=GenLayout(tp=1, dp=2),
                   refits=refits, bucket_bytes=4 << 20, collect=False, verify_serving=verify, swap=swap)
    return [r["serving"] | {k: r[k] for k in ("refit_s", "gate_s", "pause_s", "wall_s")} | {"total_s": r["refit_s"]}
            for r in evaluate(spec, run(spec))["refits"]]


def added(shape: dict, refits: int, warmup: int) -> dict:
    """What the check adds to the training loop's wait for a refit (``fleet.refit``'s wall time):
    one run under ``verify_serving: 2``, its checked refits against its unchecked ones, side by side
    in the same processes (two runs apart differ by more than the check on a shared 2-core box):
    ``added_s`` and, under ``auto`` (every 10th refit), ``added_over_refit_auto``."""
    kept = _runs(shape, 2 * refits, "in_place", 2)[warmup:]
    walls = {on: statistics.median(r["wall_s"] for r in kept if bool(r["checked"]) == on) for on in (False, True)}
    more = walls[True] - walls[False]
    return dict(wall_off_s=walls[False], wall_on_s=walls[True], added_s=more,
                added_over_refit_auto=more / 10 / walls[False])


def measure(shape: dict, refits: int, warmup: int, swap: str = "in_place") -> dict:
    summaries = _runs(shape, refits, swap, "on")
    kept = summaries[warmup:]
    check = statistics.median(s["s"] for s in kept)
    refit = statistics.median(s["total_s"] for s in kept)
    gate = statistics.median(s["gate_s"] for s in kept)
    # what traffic cannot be answered for: in place the whole refit, staged the swap; plus the gate
    blocked = statistics.median(s["pause_s"] for s in kept) if swap == "staged" else refit
    return dict(refit_s=refit, serving_check_s=check, check_over_refit=check / refit, gate_s=gate,
                blocked_s=blocked, gate_over_blocked=gate / blocked,
                reference_s=statistics.median(s["reference_s"] for s in kept),
                max_dlogprob=max(s["max_dlogprob"] for s in summaries),
                mean_dlogprob=max(s["mean_dlogprob"] for s in summaries), tolerance=default_tolerance("float32"),
                relative=relative_tolerance("float32"), checked=[s["checked"] for s in summaries])


def caught(shape: dict) -> dict:
    spec = RunSpec(model="qwen3", overrides=shape, train=TrainLayout(tp=2), gen=GenLayout(tp=1, dp=2), refits=4,
                   bucket_bytes=4 << 20, verify_serving="on", breaks=((1, BROKEN_AT, "unload_layer"),))
    refits = evaluate(spec, run(spec))["refits"]
    failed = [sorted(r["failed_replicas"]) for r in refits]
    named = "ServingMismatchError" in refits[BROKEN_AT - 1]["failed_replicas"].get(1, "")
    ok = failed == [[] if r["version"] != BROKEN_AT else [1] for r in refits] and named
    return dict(caught_broken=ok, broken_dlogprob=refits[BROKEN_AT - 1]["serving"]["max_dlogprob/replica_1"],
                failed_by_version=failed)


MOE = dict(experts=64, num_experts_per_tok=8, vocab=4096)


def moe(refits: int, warmup: int) -> dict:
    spec = RunSpec(model="qwen3-moe", overrides=MOE, train=TrainLayout(tp=2, ep=2, sequence_parallel=True),
                   gen=GenLayout(tp=1, dp=2), refits=refits, bucket_bytes=4 << 20, collect=False,
                   verify_serving="on", dtype="bfloat16", lr=1e-6)
    summaries = [r["serving"] | {"total_s": r["refit_s"]} for r in evaluate(spec, run(spec))["refits"]]
    kept = summaries[warmup:]
    check = statistics.median(s["s"] for s in kept)
    refit = statistics.median(s["total_s"] for s in kept)
    return dict(model="qwen3-moe 64 experts top-8, bf16, lr 1e-6", refit_s=refit, serving_check_s=check,
                check_over_refit=check / refit, first_check_s=summaries[0]["s"],
                max_dlogprob=max(s["max_dlogprob"] for s in summaries),
                mean_dlogprob=max(s["mean_dlogprob"] for s in summaries), tolerance=default_tolerance("bfloat16"),
                relative=relative_tolerance("bfloat16"), experts_covered=summaries[-1]["experts_covered"],
                experts_total=summaries[-1]["experts_total"])


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


@reports_user_errors
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refits", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="refits left out of the medians")
    parser.add_argument("--larger", action="store_true", help="a 5M-parameter model instead of the tests' one")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.refits < args.warmup + 3:
        raise ValueError(f"--refits {args.refits}: needs at least --warmup + 3 = {args.warmup + 3}")
    shape = LARGER if args.larger else {}
    t0 = time.perf_counter()
    result = measure(shape, args.refits, args.warmup)
    print(f"refit {result['refit_s'] * 1e3:.1f} ms, serving check {result['serving_check_s'] * 1e3:.1f} ms "
          f"(x{result['check_over_refit']:.2f}), max |dlogprob| {result['max_dlogprob']:.2e}", flush=True)
    result |= added(shape, args.refits, args.warmup)
    print(f"the check adds {result['added_s'] * 1e3:.1f} ms to the training loop's {result['wall_off_s'] * 1e3:.1f} ms "
          f"wait for a refit: under auto (every 10th) {result['added_over_refit_auto']:.1%}", flush=True)
    staged = measure(shape, args.refits, args.warmup, swap="staged")
    result["staged"] = {k: staged[k] for k in ("refit_s", "serving_check_s", "gate_s", "blocked_s",
                                               "gate_over_blocked")}
    for name, r in (("in place", result), ("staged", staged)):
        print(f"{name}: a checked version is scored before it takes traffic: gate {r['gate_s'] * 1e3:.1f} ms "
              f"on top of {r['blocked_s'] * 1e3:.2f} ms blocked by the refit (x{r['gate_over_blocked']:.2f})",
              flush=True)
    result |= caught(shape)
    print(f"caught_broken {result['caught_broken']} (replica 1 at version {BROKEN_AT}: "
          f"|dlogprob| {result['broken_dlogprob']:.3g})", flush=True)
    result["moe"] = moe(max(args.warmup + 3, 5), min(args.warmup, 2))
    m = result["moe"]
    print(f"moe (64 experts top-8, bf16): refit {m['refit_s'] * 1e3:.1f} ms, serving check "
          f"{m['serving_check_s'] * 1e3:.1f} ms (x{m['check_over_refit']:.2f}; the first, with the probe's "
          f"extension, {m['first_check_s'] * 1e3:.1f} ms), max |dlogprob| {m['max_dlogprob']:.2e}, mean "
          f"{m['mean_dlogprob']:.2e} (tolerance {m['tolerance']:g} + {m['relative']:g} x the logits' magnitude), "
          f"experts covered "
          f"{m['experts_covered']} of {m['experts_total']}", flush=True)
    result["power"] = summary(run_spawned(power_rank, 1, timeout_s=900)[0])
    for state, p in result["power"].items():
        seen = [f for f, v in p["faults"].items() if v["caught"]]
        cal = p["calibration"]
        print(f"power, {state} (bf16, 64 experts top-8, readback {p['readback']}): {p['clean_passed']} of "
              f"{p['clean_refits']} clean refits pass, {p['clean_calibrated']} of them against the limits calibrated "
              f"at version {cal['version']} (tail {cal['tail_limit']:.3g}, 80 % quantile {cal['bulk_limit']:.3g} "
              f"of the rounding bound {p['tolerance']:g} + {p['relative']:g} x the logits' magnitude); clean max "
              f"|dlogprob| {p['clean_max_dlogprob']:.3g}, mean {p['clean_mean_dlogprob']:.2g}, bulk "
              f"{p['clean_bulk']:.3g}, one expert's tokens moved {_g(p['clean_expert_moved'])} (limit "
              f"{_g(p['expert_limit'])}); caught {[(f, p['faults'][f]['caught_by']) for f in seen]} (of them the "
              f"rounding bound alone passes {[f for f in seen if p['faults'][f]['rounding_bound_passes']]}); smallest "
              f"caught {p['smallest_caught']}", flush=True)
        for fault, v in p["faults"].items():
            if not v["caught"]:
                print(f"  {fault}: not caught, within the calibrated limits (the clean noise and its margins): "
                      f"max |dlogprob| {v['max_dlogprob']:.3g} (clean {p['clean_max_dlogprob']:.3g}), bulk "
                      f"{v['bulk']:.3g} (clean {p['clean_bulk']:.3g}), one expert's tokens moved "
                      f"{_g(v['expert_moved'])} (clean {_g(p['clean_expert_moved'])}, limit {_g(p['expert_limit'])})",
                      flush=True)
    result |= dict(model="qwen3", shape=shape or "qwen3 (tests)", train="TP2", gen="TP1xDP2 (HF engine, in band)",
                   refits=args.refits, cpu=cpu_model(), seconds=time.perf_counter() - t0)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
