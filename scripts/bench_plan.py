"""The plan at the record's scale: the worst rank's ``prepare()`` per train world (#65).

DeepSeek-V3's Megatron-Bridge recipe layout (``configs/recipe-deepseek-v3.yaml``: TP2 · PP16 ·
EP64, sequence parallel, its pipeline layout, MTP; EP16 at 256 ranks, where a stage has 16) at
train worlds 256, 1,024, 2,048 and 4,096 (DP 8 … 128) into an engine of 256 ranks: vLLM TP32 × DP8
(``--engine tp``, the default) or the wide-EP deployments of ``configs/deepseek-v3-wide-ep.yaml``
(``--engine wide``: 8 deployments of DP32 × TP1 with EP32, 32 redundant experts, FP8).

Each world is one dry run (``python -m megatron_refit.dryrun``, its enumeration from the cache as
users run it); each timed rank's prepare runs in a process of its own
(:mod:`megatron_refit.tools.prepare_rank`), so its peak RSS is the rank's. Per world: the worst
rank's prepare seconds (the median of ``--repeat`` processes, 3 by default: this 2-core machine is
shared and one run can take twice another) and peak RSS. Then, at 1,024:

- ``join_replan_s``: a train rank's ``prepare()`` when a replica of a layout it has planned (re)joins:
  each gathered part it already decoded found by its digest, the plan by its key
  (``Endpoint.plans``), the agreement checked (the collectives' own time is not in it);
- ``eplb_replan_s``: the wide engine's expert map moved by EPLB (every slot's expert permuted: vLLM's
  own rebalance moves ~96 % of them, ``scripts/eplb_moves.py``): the slower of gen rank 0's and
  the busiest train rank's re-plan of one deployment's refit group
  (:meth:`~megatron_refit.plan.refit_plan.RefitPlan.replanned`, the new engine parts decoded,
  fingerprints and agreement included), from the wide config's dry run at 1,024
  (``eplb_replan_seconds``; :mod:`megatron_refit.tools.eplb_replan`);
- ``wide_first_prepare_s``: the slower of the same two ranks' first prepare of that deployment's
  group (1,024 train ranks + DP32 x TP1, FP8; keeping what a move needs), the figure a wide-EP run
  pays at start; its 7 other deployments' groups find the plan by its key.

``--cold`` also runs the smallest world with an empty enumeration cache once (the enumeration's
seconds reported apart). The last line is JSON::

    {"worlds": {"256": {"prepare_s": …, "peak_rss_mb": …}, …}, "join_replan_s": …, "eplb_replan_s": …}

    .venv/bin/python scripts/bench_plan.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"tp": "configs/recipe-deepseek-v3.yaml", "wide": "configs/deepseek-v3-wide-ep.yaml"}
WORLDS = (256, 1024, 2048, 4096)
STAGE = 2 * 16  # TP2 x PP16: a world's DP is world / 32


def world_config(engine: str, world: int, out_dir: str) -> str:
    """The recipe's YAML at ``world`` train ranks (EP16 at 256, EP64 above)."""
    with open(os.path.join(ROOT, CONFIGS[engine])) as f:
        cfg = yaml.safe_load(f)
    if world % STAGE:
        raise ValueError(f"--worlds: {world} is not a multiple of TP2 x PP16 = {STAGE}")
    cfg["model"]["expert_model_parallel_size"] = min(64, world // 16)
    cfg["refit"]["train_dp"] = world // STAGE
    path = os.path.join(out_dir, f"{engine}-{world}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path


def dry_run(path: str, cache_dir: str, repeat: int = 1) -> dict:
    done = subprocess.run([sys.executable, "-m", "megatron_refit.dryrun", "--config", path, "--json",
                           "--cache-dir", cache_dir, "--repeat", str(repeat)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"dry run of {path} failed: {done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=sorted(CONFIGS), default="tp")
    p.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    p.add_argument("--cold", action="store_true", help="also run the smallest world with an empty enumeration cache")
    p.add_argument("--json", action="store_true", help="print the JSON summary as the last line")
    p.add_argument("--repeat", type=int, default=3,
                   help="each timed rank's prepare (and EPLB re-plan) in this many processes: their median")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    cache = os.path.join(ROOT, "configs", "cache")
    out: dict = {"engine": args.engine, "config": CONFIGS[args.engine], "repeat": args.repeat, "worlds": {}}
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        for world in args.worlds:
            result = dry_run(world_config(args.engine, world, tmp), cache, args.repeat)
            row = {"prepare_s": result["prepare_seconds"], "peak_rss_mb": result["prepare_peak_rss_mb"],
                   "rank": result["prepare_rank"], "plan_s": result["plan_seconds"],
                   "enumerate_s": result["enumerate_seconds"], "rejoin_s": result["rejoin_seconds"]}
            out["worlds"][str(world)] = row
            print(f"world {world:>5}: worst rank's prepare {row['prepare_s']:.3f} s ({row['rank']}), "
                  f"peak RSS {row['peak_rss_mb']:.0f} MB; whole plan {row['plan_s']:.2f} s", flush=True)
        if args.cold:
            world = min(args.worlds)
            start = time.perf_counter()
            result = dry_run(world_config(args.engine, world, tmp), os.path.join(tmp, "cold-cache"))
            out["cold"] = {"world": world, "enumerate_s": result["enumerate_seconds"],
                           "prepare_s": result["prepare_seconds"], "total_s": round(time.perf_counter() - start, 2)}
            print(f"cold  {world:>5}: enumeration {result['enumerate_seconds']:.1f} s, prepare "
                  f"{result['prepare_seconds']:.3f} s", flush=True)
        if 1024 in args.worlds:
            out["join_replan_s"] = out["worlds"]["1024"]["rejoin_s"]
            wide = dry_run(world_config("wide", 1024, tmp), cache, args.repeat)
            out["eplb_replan_s"] = wide["eplb_replan_seconds"]
            out["eplb_full_prepare_s"] = wide["prepare_seconds"]
            out["wide_first_prepare_s"] = wide["eplb_first_prepare_seconds"]
            print(f"join re-plan {out['join_replan_s'] * 1e3:.1f} ms; EPLB map change re-planned in "
                  f"{out['eplb_replan_s'] * 1e3:.0f} ms (the wide engine at 1,024: a deployment group's first "
                  f"prepare {out['wide_first_prepare_s']:.3f} s; all 8 deployments' in one plan "
                  f"{wide['prepare_seconds']:.3f} s)", flush=True)
    worlds = out["worlds"]
    if "256" in worlds and "4096" in worlds:
        out["growth_4096_over_256"] = round(worlds["4096"]["prepare_s"] / worlds["256"]["prepare_s"], 2)
        print(f"growth: 4,096 / 256 = {out['growth_4096_over_256']:.2f}x")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
