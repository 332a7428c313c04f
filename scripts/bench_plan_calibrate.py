"""#65's goals on the slower CPU, from one side-by-side run on this machine (#65).

#65's table was measured on the 2-core AMD EPYC at commit 6ffec8d (its peak RSS figures are that
commit's: 419, 145 and 330 MB). This script runs that commit (``git archive`` into a temporary
folder) and this checkout interleaved, round by round, on this machine:

- the baseline's worst-rank prepare of each configuration of the table (its own dry run, as the
  table measured it) gives this machine's speed against the AMD's over the run:
  ``factor = AMD figure / the baseline here`` (per configuration and AMD run);
- this checkout's figures (``scripts/bench_plan.py``'s worlds 256, 1,024 and 4,096 into TP32 x DP8,
  the wide engine's EPLB re-plan at 1,024 and its deployment group's first prepare), times the
  factor, estimate the AMD's.

The estimate assumes the two codes slow down alike from one CPU to the other (both are the same
kind of work: a single Python thread building dicts, lists and tuples; neither imports torch).
Per figure it prints the estimate with the recipe's factor (the same layout as the 1,024 goal),
from the medians and from the fastest runs (:func:`estimates`), each over the table's two AMD
runs; the other configurations' factors show how far one factor holds. With --json, a JSON last line::

    .venv/bin/python scripts/bench_plan_calibrate.py --rounds 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_plan import ROOT, dry_run, world_config  # noqa: E402

BASELINE = "6ffec8d"
TABLE = {  # #65's table: the worst rank's prepare seconds on the 2-core AMD EPYC (two runs each)
    "configs/recipe-deepseek-v3.yaml": (5.7, 6.8),  # 1,024 -> 256, Bridge's recipe
    "configs/deepseek-v3.yaml": (2.3, 2.5),  # 256 -> 256
    "configs/kimi-k2-fp8-256to128.yaml": (3.5, 5.3),  # 256 -> 128
}
RECIPE = "configs/recipe-deepseek-v3.yaml"
GOALS = {"1024": 1.0, "eplb_replan": 0.1}  # seconds on the slower CPU


def export(rev: str, into: str) -> None:
    """``rev``'s tree into ``into`` (``ValueError`` naming it where this clone lacks it)."""
    known = subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True)
    if known.returncode != 0:
        raise ValueError(f"--baseline {rev}: no such commit in this clone (a shallow clone? git fetch --unshallow)")
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)


def baseline_prepare(tree: str, config: str) -> float:
    """The baseline's own dry run of ``config`` (its enumeration cache shipped with it)."""
    done = subprocess.run([sys.executable, "-m", "megatron_refit.dryrun", "--config", config, "--json"],
                          cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
    if done.returncode != 0:
        raise RuntimeError(f"the baseline's dry run of {config} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["prepare_seconds"]


def current(tmp: str) -> dict[str, float]:
    """This checkout's figures (one process each), as bench_plan.py measures them."""
    cache = os.path.join(ROOT, "configs", "cache")
    out = {world: dry_run(world_config("tp", int(world), tmp), cache)["prepare_seconds"]
           for world in ("256", "1024", "4096")}
    wide = dry_run(world_config("wide", 1024, tmp), cache)
    out["eplb_replan"], out["wide_first_prepare"] = wide["eplb_replan_seconds"], wide["eplb_first_prepare_seconds"]
    return out


def estimates(rounds: list[dict]) -> dict[str, dict]:
    """Per figure of this checkout: its median and fastest run here, and each times the AMD's
    figures over the baseline recipe's median (fastest) here. One process can take twice the
    next on this shared machine, so the medians pair with the medians and the fastest with the
    fastest; a round's own pairing would carry each run's noise twice."""
    base = [rnd["baseline_s"][RECIPE] for rnd in rounds]
    lo, hi = TABLE[RECIPE]
    out = {}
    for key in rounds[0]["current_s"]:
        now = [rnd["current_s"][key] for rnd in rounds]
        med, fast = statistics.median(now) / statistics.median(base), min(now) / min(base)
        out[key] = {"here_median": round(statistics.median(now), 4), "here_min": round(min(now), 4),
                    "amd_median": [round(med * lo, 3), round(med * hi, 3)],
                    "amd_min": [round(fast * lo, 3), round(fast * hi, 3)]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default=BASELINE, help="the commit #65's AMD table was measured on")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (baseline, then this checkout)")
    p.add_argument("--json", action="store_true", help="print the JSON summary as the last line")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-calibrate-") as tmp:
        tree = os.path.join(tmp, "baseline")
        os.mkdir(tree)
        try:
            export(args.baseline, tree)
        except ValueError as e:  # the user's --baseline: named, no traceback
            p.error(str(e))
        for r in range(args.rounds):
            base = {config: baseline_prepare(tree, config) for config in TABLE}
            now = current(tmp)
            rounds.append({"baseline_s": base, "current_s": now})
            print(f"round {r + 1}: baseline "
                  + ", ".join(f"{os.path.basename(c)[:-5]} {s:.2f} s" for c, s in base.items())
                  + " | this checkout " + ", ".join(f"{k} {v:.3f} s" for k, v in now.items()), flush=True)
    out: dict = {"baseline": args.baseline, "rounds": rounds, "estimates": estimates(rounds)}
    spread = {os.path.basename(c)[:-5]: [round(amd / statistics.median(r["baseline_s"][c] for r in rounds), 2)
                                         for amd in TABLE[c]] for c in TABLE}
    out["factors"] = spread
    print("the AMD's time over this machine's (the table over the baseline's median here): "
          + ", ".join(f"{c} {lo:.2f}-{hi:.2f}x" for c, (lo, hi) in spread.items()))
    for key, est in out["estimates"].items():
        goal = GOALS.get(key)
        print(f"{key:>11}: here median {est['here_median']:.3f} s, fastest {est['here_min']:.3f} s; on the AMD "
              f"{est['amd_median'][0]:.3f}-{est['amd_median'][1]:.3f} s by the medians, "
              f"{est['amd_min'][0]:.3f}-{est['amd_min'][1]:.3f} s by the fastest runs"
              + ("" if goal is None else f" (goal {goal} s)"))
    growth = [rnd["current_s"]["4096"] / rnd["current_s"]["256"] for rnd in rounds]
    out["growth_4096_over_256"] = round(statistics.median(r["current_s"]["4096"] for r in rounds)
                                        / statistics.median(r["current_s"]["256"] for r in rounds), 2)
    print(f"growth 4,096 / 256 (this checkout's own medians: no factor): {out['growth_4096_over_256']:.2f}x "
          "(per round " + ", ".join(f"{g:.2f}x" for g in growth) + ")")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
