"""A fleet of engine replicas when one of them dies, and when one joins (one run, gloo, CPU).

Two train ranks (row halves of ``--layers`` fp32 ``--dim`` x ``--dim`` weights) refit
``--replicas`` engine replicas (gen TP1) through ``trainer_refit_from_pieces`` /
``engine_refit``: ``--reps`` normal refits, then one in which replica 1's process dies while
its bytes land (``os._exit``: no cleanup, its sockets just close), then one more; then a new
replica starts and joins, and the train ranks refit as soon as its announcement reaches them.
Prints one JSON line:

- ``survivor_refit_over_normal``: the surviving replicas' receive time in the refit where
  replica 1 died ÷ their median receive time in the normal refits (goal <= 1.2);
- ``trainer_refit_over_normal``: the same for the train ranks' whole refit call;
- ``join_s``: the new replica from its ``engine_refit`` call to holding the current version;
- ``bit_exact``: every replica that holds a version holds it bit for bit.

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


def _weights(version: int, dim: int, layers: int) -> dict[str, torch.Tensor]:
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


def _rank(rank, world, port, reps, dim, layers, replicas, flag):
    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.fleet import JOINS
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.plan.spec import ShardSpec
    from megatron_refit.refit import engine_refit, trainer_refit_from_pieces

    cfg = RefitConfig(enabled=True, engine="hf", gen_tp=1, gen_dp=replicas, port=port, timeout_s=TIMEOUT_S,
                      on_replica_failure="continue")
    kill, last = reps + 1, reps + 3  # the refit where replica 1 dies; the one the new replica joins at
    if rank < NUM_TRAIN:
        half = dim // NUM_TRAIN
        box = ((rank * half, (rank + 1) * half), (0, dim))
        pieces = [TensorPiece(ShardSpec(name=f"layer{i}.w", global_shape=(dim, dim), dtype="float32", box=box),
                              torch.empty(0)) for i in range(layers)]
        sync = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        seconds = {}
        for version in range(1, last + 1):
            if version == last and rank == 0:  # the new replica starts; refit once its join is in the store
                open(flag, "w").close()
                while sync.control.store.get(JOINS).decode().count(",") <= replicas:
                    time.sleep(0.001)
            weights = _weights(version, dim, layers)
            for piece in pieces:
                piece.data = weights[piece.spec.name][rank * half:(rank + 1) * half].clone()
            start = time.perf_counter()
            report = sync.refit(version)
            seconds[version] = time.perf_counter() - start
            if version == kill:
                seconds["failed"] = sorted(report.failed_replicas)
        sync.close()
        return seconds
    gen = rank - NUM_TRAIN
    versions = range(1, last + 1)
    if gen == replicas:  # the new replica
        while not os.path.exists(flag):
            time.sleep(0.001)
        versions = [last]
    storage = _Storage(dim, layers)
    if gen == 1:
        storage.die_at = (kill, 2)
    start = time.perf_counter()
    sync = engine_refit(cfg, storage, gen_index=gen, num_train=NUM_TRAIN)
    out = {"exact": True}
    for version in versions:
        storage.version, storage.calls = version, 0
        t0 = time.perf_counter()
        sync.receive(version)
        out[version] = time.perf_counter() - t0
        out["exact"] &= all(torch.equal(storage.t[n], w) for n, w in _weights(version, dim, layers).items())
    if gen == replicas:
        out["join_s"] = time.perf_counter() - start
    sync.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3, help="engine replicas at the start (gen TP1 each)")
    p.add_argument("--dim", type=int, default=2048, help="each weight is dim x dim fp32")
    p.add_argument("--layers", type=int, default=16, help="weights")
    p.add_argument("--reps", type=int, default=5, help="normal refits before the one where a replica dies")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    if args.replicas < 2 or args.dim < NUM_TRAIN or args.dim % NUM_TRAIN or args.layers < 1 or args.reps < 1:
        print(f"error: need --replicas >= 2, an even --dim, --layers >= 1 and --reps >= 1, got {vars(args)}",
              file=sys.stderr)
        return 2
    from megatron_refit.tools.launch import run_spawned

    kill = args.reps + 1
    with tempfile.TemporaryDirectory() as tmp:
        out = run_spawned(_rank, NUM_TRAIN + args.replicas + 1, args.reps, args.dim, args.layers, args.replicas,
                          os.path.join(tmp, "flag"), timeout_s=600, may_die=frozenset({NUM_TRAIN + 1}))
    train, gen = out[:NUM_TRAIN], out[NUM_TRAIN:]
    survivors = [g for i, g in enumerate(gen[:args.replicas]) if i != 1]
    normal = statistics.median(max(g[v] for g in survivors) for v in range(2, kill))
    trainer_normal = statistics.median(max(t[v] for t in train) for v in range(2, kill))
    result = dict(
        replicas=args.replicas, bytes_per_replica=args.dim * args.dim * 4 * args.layers,
        normal_refit_s=normal,
        survivor_refit_over_normal=max(g[kill] for g in survivors) / normal,
        trainer_refit_over_normal=max(t[kill] for t in train) / trainer_normal,
        join_s=gen[args.replicas]["join_s"],
        failed_replicas=train[0]["failed"],
        bit_exact=all(g["exact"] for g in survivors + [gen[args.replicas]]) and gen[1] is None,
    )
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
