"""A fleet of engine replicas when one of them dies, and when one joins (one run, gloo, CPU).

Two train ranks (row halves of ``--layers`` fp32 ``--dim`` x ``--dim`` weights) refit
``--replicas`` engine replicas (gen TP1) through ``trainer_refit_from_pieces`` /
``engine_refit``: ``--reps`` normal refits, then ``--rounds`` times a refit in which replica
1's process dies while its bytes land (``os._exit``: no cleanup, its sockets just close) and
one at which a restarted replica 1 joins (the train ranks refit as soon as its announcement
reaches them). Prints one JSON line:

- ``survivor_refit_over_normal``: the surviving replicas' receive time in a refit where
  replica 1 died ÷ their median receive time in the normal refits (the median over the
  rounds; each round's in ``..._each``; goal <= 1.2);
- ``trainer_refit_over_normal``: the same for the train ranks' whole refit call;
- ``join_s``: the last restarted replica from its ``engine_refit`` call to holding the
  current version (the others die before they could tell);
- ``bit_exact``: every replica that holds a version holds it bit for bit, and exactly the
  killed replica failed at exactly the refits it died in.

    .venv/bin/python scripts/bench_fleet.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

NUM_TRAIN = 2
TIMEOUT_S = 30.0


def weights(version: int, dim: int, layers: int) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(layers):
        w = torch.randn(dim, dim, generator=torch.Generator().manual_seed(i))
        w.view(-1)[version % 5::101] += 0.01 * version
        out[f"layer{i}.w"] = w
    return out


class _Storage:
    holds_sent_bytes = True

    def __init__(self, dim: int, layers: int):
        from megatron_refit.plan.spec import ShardSpec, full_box

        self.t = {f"layer{i}.w": torch.zeros(dim, dim) for i in range(layers)}
        self.specs = [ShardSpec(name=n, global_shape=(dim, dim), dtype="float32", box=full_box((dim, dim)))
                      for n in self.t]
        self.die_at = None  # (version, call): this process dies there
        self.version, self.calls = None, 0

    def target_specs(self):
        return self.specs

    def buffer(self, name):
        self.calls += 1
        if self.die_at == (self.version, self.calls):
            os._exit(17)
        return self.t[name]

    def finalize(self):
        pass


def _schedule(reps: int, rounds: int) -> tuple[list[int], list[int]]:
    """Versions: ``reps`` normal refits, then per round one where replica 1 dies and one where a
    restarted replica 1 joins. Returns (kill versions, join versions)."""
    kills = [reps + 1 + 2 * i for i in range(rounds)]
    return kills, [k + 1 for k in kills]


def _rank(rank, world, port, reps, rounds, dim, layers, replicas, flags):
    from megatron_refit.config import RefitConfig
    from megatron_refit.group.store import JOINS
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.plan.spec import ShardSpec
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.refit import trainer_refit_from_pieces

    cfg = RefitConfig(enabled=True, engine="hf", gen_tp=1, gen_dp=replicas, port=port, timeout_s=TIMEOUT_S,
                      on_replica_failure="continue")
    kills, joins = _schedule(reps, rounds)
    last = joins[-1]
    if rank < NUM_TRAIN:
        half = dim // NUM_TRAIN
        box = ((rank * half, (rank + 1) * half), (0, dim))
        pieces = [TensorPiece(ShardSpec(name=f"layer{i}.w", global_shape=(dim, dim), dtype="float32", box=box),
                              torch.empty(0)) for i in range(layers)]
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        seconds = {"failed": {}}
        for version in range(1, last + 1):
            if version in joins and rank == 0:  # replica 1 restarts; refit once its join is in the store
                open(flags[joins.index(version)], "w").close()
                while fleet.control_group.store.get(JOINS).decode().count(",") <= replicas + joins.index(version):
                    time.sleep(0.001)
            full = weights(version, dim, layers)
            for piece in pieces:
                piece.data = full[piece.spec.name][rank * half:(rank + 1) * half].clone()
            start = time.perf_counter()
            report = fleet.refit(version)
            seconds[version] = time.perf_counter() - start
            if report.failed_replicas:
                seconds["failed"][version] = sorted(report.failed_replicas)
        fleet.close()
        return seconds
    gen = rank - NUM_TRAIN
    versions, index = list(range(1, last + 1)), gen
    if gen >= replicas:  # the i-th restart of replica 1
        i = gen - replicas
        while not os.path.exists(flags[i]):
            time.sleep(0.001)
        versions, index = list(range(joins[i], last + 1)), 1
        if i + 1 < rounds:
            versions = versions[: versions.index(kills[i + 1]) + 1]
    storage = _Storage(dim, layers)
    kill = next((k for k in kills if k >= versions[0]), None) if index == 1 else None
    if kill is not None:  # the next kill is this incarnation's
        storage.die_at = (kill, 2)
    start = time.perf_counter()
    member = engine_refit(cfg, storage, gen_index=index, num_train=NUM_TRAIN)
    out = {"exact": True}
    for version in versions:
        storage.version, storage.calls = version, 0
        t0 = time.perf_counter()
        member.receive(version)
        out[version] = time.perf_counter() - t0
        out["exact"] &= all(torch.equal(storage.t[n], w) for n, w in weights(version, dim, layers).items())
        if version == versions[0] and gen >= replicas:
            out["join_s"] = time.perf_counter() - start
    member.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3, help="engine replicas at the start (gen TP1 each)")
    p.add_argument("--dim", type=int, default=2048, help="each weight is dim x dim fp32")
    p.add_argument("--layers", type=int, default=16, help="weights")
    p.add_argument("--reps", type=int, default=5, help="normal refits before the first where a replica dies")
    p.add_argument("--rounds", type=int, default=3, help="times replica 1 dies and restarts")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    if args.replicas < 2 or args.dim < NUM_TRAIN or args.dim % NUM_TRAIN or min(args.layers, args.reps,
                                                                                   args.rounds) < 1:
        print(f"error: need --replicas >= 2, an even --dim, --layers, --reps and --rounds >= 1, got {vars(args)}",
              file=sys.stderr)
        return 2
    from megatron_refit.local.launch import run_spawned

    kills, joins = _schedule(args.reps, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        flags = [os.path.join(tmp, f"restart{i}") for i in range(args.rounds)]
        dead = frozenset({NUM_TRAIN + 1, *(NUM_TRAIN + args.replicas + i for i in range(args.rounds - 1))})
        out = run_spawned(_rank, NUM_TRAIN + args.replicas + args.rounds, args.reps, args.rounds, args.dim,
                          args.layers, args.replicas, flags, timeout_s=600, may_die=dead)
    train, gen = out[:NUM_TRAIN], out[NUM_TRAIN:]
    survivors = [g for i, g in enumerate(gen[:args.replicas]) if i != 1]
    normal = statistics.median(max(g[v] for g in survivors) for v in range(2, kills[0]))
    trainer_normal = statistics.median(max(t[v] for t in train) for v in range(2, kills[0]))
    restarts = gen[args.replicas:]
    result = dict(
        replicas=args.replicas, bytes_per_replica=args.dim * args.dim * 4 * args.layers, rounds=args.rounds,
        normal_refit_s=normal,
        survivor_refit_over_normal=statistics.median(max(g[k] for g in survivors) for k in kills) / normal,
        survivor_refit_over_normal_each=[max(g[k] for g in survivors) / normal for k in kills],
        trainer_refit_over_normal=statistics.median(max(t[k] for t in train) for k in kills) / trainer_normal,
        join_s=restarts[-1]["join_s"],
        failed_replicas=train[0]["failed"],
        bit_exact=all(g["exact"] for g in survivors) and restarts[-1]["exact"]
        and sorted(train[0]["failed"]) == kills and all(v == [1] for v in train[0]["failed"].values()),
    )
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
