"""How much of the expert map one EPLB rebalance moves: vLLM's own policy, DeepSeek-V3's shape (#65).

A re-plan after an EPLB map change can be limited to the parameters whose engine ranks changed;
this measures how many that is. vLLM 0.33's ``DefaultEplbPolicy.rebalance_experts`` (what
``--enable-eplb`` runs, with ``old_global_expert_indices`` so that experts staying on a rank keep
their slot) on DeepSeek-V3's MoE shape served wide: 58 MoE layers, 256 logical experts in 8
groups, 32 redundant (288 physical slots) over 32 ranks (``configs/deepseek-v3-wide-ep.yaml``'s
deployment). Loads: heavy-tailed per (layer, expert), then drifted by a log-normal factor of
``--drift`` sigma (a small drift: the loads of the next window). Prints, per drift, the fraction of
(layer, logical expert) pairs whose set of ranks changed; the last line is JSON.

    .venv-vllm/bin/python scripts/eplb_moves.py
"""

from __future__ import annotations

import argparse
import json


def ranks_of(phy2log, num_ranks: int) -> list[list[frozenset[int]]]:
    """Per layer, per logical expert: the ranks holding a replica of it."""
    rows = phy2log.tolist()
    out = []
    for row in rows:
        per_rank = len(row) // num_ranks
        held: dict[int, set[int]] = {}
        for slot, expert in enumerate(row):
            held.setdefault(expert, set()).add(slot // per_rank)
        out.append([frozenset(held.get(e, ())) for e in range(max(row) + 1)])
    return out


def main(argv=None) -> int:
    import torch
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--redundant", type=int, default=32)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--drift", type=float, nargs="+", default=[0.05, 0.2, 1.0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    slots = args.experts + args.redundant
    load = torch.distributions.Pareto(1.0, 1.5).sample((args.layers, args.experts))

    def rebalance(weight, old=None):
        got = DefaultEplbPolicy.rebalance_experts(weight, slots, args.groups, 1, args.ranks,
                                                  old_global_expert_indices=old)
        return got[0] if isinstance(got, tuple) else got

    first = rebalance(load)
    before = ranks_of(first, args.ranks)
    out = {"layers": args.layers, "experts": args.experts, "slots": slots, "ranks": args.ranks, "moved": {}}
    for drift in args.drift:
        after = ranks_of(rebalance(load * torch.exp(drift * torch.randn(args.layers, args.experts)), first),
                         args.ranks)
        moved = sum(a != b for row_a, row_b in zip(before, after) for a, b in zip(row_a, row_b))
        out["moved"][str(drift)] = round(moved / (args.layers * args.experts), 3)
        print(f"drift {drift}: {moved} of {args.layers * args.experts} (layer, expert) pairs on other ranks "
              f"({moved / (args.layers * args.experts):.0%})", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
