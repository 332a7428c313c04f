"""Replica fan-out against direct sends, side by side in one run (gloo, CPU, spawned ranks).

Two train ranks (row halves of ``--layers`` fp32 ``--dim`` x ``--dim`` weights) refit
``--replicas`` engine replicas (gen TP1) through ``trainer_refit_from_pieces`` / ``engine_refit``,
``--reps`` timed refits per arm after a warm-up, first with ``refit.fanout: off`` (every replica
from the train ranks), then ``chain``. Every rank's egress is one throttled link of ``--mbps``
MB/s (a token bucket per process, shared by all its groups: a train rank's NIC carries every
replica's bytes; an engine rank's carries what it forwards), as ``bench_refit.py``'s throttled arm
slows a train rank's link. A third run (``chain``) kills the chain's head (``os._exit`` while it
lands a refit). Prints one JSON line:

- ``trainer_egress_over_minimal``: the bytes the train ranks sent per refit ÷ one replica's bytes
  (goal <= 1.1 with fan-out; direct: ``direct_egress_over_minimal`` ≈ the replicas);
- ``fanout_over_direct_s``: the median train-side refit time with fan-out ÷ direct;
- ``bit_exact``: every replica held every version of every arm bit for bit;
- ``relay_killed_ok``: with the head killed mid-refit, its successors still landed that version
  bit-exactly (routed around within the refit), and the refit named the dead head alone.

    .venv/bin/python scripts/bench_fanout.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time

import torch
from bench_fleet import weights  # the same fp32 layers, a sparse change per version

NUM_TRAIN = 2
TIMEOUT_S = 30.0
KILLED_AT = 2
"""The refit (of the kill run) in which the head dies."""


class _Posted:
    """A message the link has not put on the wire yet: its wait waits for the post, then for it."""

    def __init__(self):
        self.posted, self.work, self.error = threading.Event(), None, None

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if timeout is not None else None
        if not self.posted.wait(seconds):
            raise RuntimeError("timed out waiting for the throttled link to post the message")
        if self.error is not None:
            raise self.error
        return self.work.wait(timeout) if timeout is not None else self.work.wait()


class Link:
    """One process's egress link of ``bytes_per_s``: a NIC. Posting a message returns at once (as
    with a real NIC); the link puts messages on the wire one after another, each when the link has
    carried the bytes before it, from a thread of its own (shared by all of the process's groups)."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="bench-link", daemon=True).start()

    def _run(self) -> None:
        busy_until = 0.0
        while True:
            isend, buffer, peer, tag, posted = self.queue.get()
            busy_until = max(time.monotonic(), busy_until) + buffer.numel() * buffer.element_size() / self.rate
            time.sleep(max(0.0, busy_until - time.monotonic()))
            try:
                posted.work = isend(buffer, peer, tag).work
            except Exception as exc:  # noqa: BLE001 -- the waiter raises it
                posted.error = exc
            posted.posted.set()

    def wrap(self, group) -> None:
        from megatron_refit.transport.base import Pending

        isend = group.isend

        def throttled(buffer, peer, tag):
            posted = _Posted()
            self.queue.put((isend, buffer, peer, tag, posted))
            return Pending(posted, peer, f"send to rank {peer}", buffer)

        group.isend = throttled


def _rank(rank, world, port, mode, dim, layers, reps, mbps, kill):
    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.refit import trainer_refit_from_pieces
    from megatron_refit.testing.storages import MemoryStorage, local, row_specs

    torch.set_num_threads(1)
    replicas = world - NUM_TRAIN
    shapes = {f"layer{i}.w": (dim, dim) for i in range(layers)}
    cfg = RefitConfig(enabled=True, engine="vllm", gen_tp=1, gen_dp=replicas, port=port, bucket_mb=4.0,
                      timeout_s=TIMEOUT_S, stall_s=5.0, fanout=mode, on_replica_failure="continue")
    link = Link(mbps * 1e6)
    versions = range(1, reps + 2)
    out = []
    if rank < NUM_TRAIN:
        pieces = [TensorPiece(s, torch.zeros(s.shape)) for s in row_specs(shapes, rank, NUM_TRAIN)]
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        fleet.await_start()
        for member in fleet.members.values():
            link.wrap(member.group)
        for version in versions:
            full = weights(version, dim, layers)
            for piece in pieces:
                piece.data.copy_(local(piece.spec, full[piece.spec.name]))
            start = time.perf_counter()
            report = fleet.refit(version)
            out.append(dict(seconds=time.perf_counter() - start, summary=report.summary,
                            failed=sorted(report.failed_replicas), why=report.failed_replicas))
        fleet.close()
        return out
    replica = rank - NUM_TRAIN
    store = MemoryStorage(row_specs(shapes, 0, 1))
    if kill and replica == 0:
        calls = [0]

        def die(name, call):
            if len(out) != KILLED_AT - 1:
                return
            calls[0] += 1
            if calls[0] == layers:  # refit KILLED_AT, about half-way (two buckets per layer)
                os._exit(17)

        store.on_buffer = die
    member = engine_refit(cfg, store, gen_index=replica, num_train=NUM_TRAIN)
    join = member.relay.join

    def throttled_join(name, rank_):  # what this engine rank forwards leaves through its one link too
        group = join(name, rank_)
        link.wrap(group)
        return group

    member.relay.join = throttled_join
    for version in versions:
        try:
            member.receive(version)
            out.append(dict(version=version, ok=True, exact=store.exact(weights(version, dim, layers))))
        except Exception as exc:  # noqa: BLE001 -- reported
            out.append(dict(version=version, ok=False, error=f"{type(exc).__name__}: {exc}"[:300]))
    member.close()
    return out


def _arm(mode: str, args, *, kill: bool = False) -> tuple[list, list]:
    from megatron_refit.local.launch import run_spawned

    world = NUM_TRAIN + args.replicas
    out = run_spawned(_rank, world, mode, args.dim, args.layers, args.reps, args.mbps, kill, timeout_s=600,
                      may_die=frozenset({NUM_TRAIN}) if kill else frozenset())
    return out[:NUM_TRAIN], out[NUM_TRAIN:]


def _timed(train: list) -> tuple[float, dict]:
    """The median slowest-train-rank refit time (warm-up excluded) and the last refit's summary."""
    seconds = [max(rank[i]["seconds"] for rank in train) for i in range(1, len(train[0]))]
    return statistics.median(seconds), train[0][-1]["summary"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--mbps", type=float, default=100.0,
                   help="every rank's egress link, MB/s (at 400 the 2 CPU cores, not the links, set the pace)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.replicas < 2:
        p.error(f"--replicas {args.replicas}: fan-out needs at least 2 replicas")
    results, exact = {}, True
    for mode in ("off", "chain"):
        train, gen = _arm(mode, args)
        exact &= all(r["ok"] and r["exact"] for outcome in gen for r in outcome)
        results[mode] = _timed(train)
    train, gen = _arm("chain", args, kill=True)
    survivors = [outcome[KILLED_AT - 1] for outcome in gen[1:]]
    killed_report = train[0][KILLED_AT - 1]
    relay_killed_ok = (gen[0] is None and all(r["ok"] and r["exact"] for r in survivors)
                       and killed_report["failed"] == [0]
                       and killed_report["summary"]["refit/relay_fallbacks"] >= 1)
    (direct_s, direct), (chain_s, chain) = results["off"], results["chain"]
    one = chain["refit/bytes_minimal"] / args.replicas
    row = {
        "replicas": args.replicas, "mb_per_replica": round(one / 1e6, 2), "link_mbps": args.mbps,
        "direct_s": round(direct_s, 4), "fanout_s": round(chain_s, 4),
        "fanout_over_direct_s": round(chain_s / direct_s, 4),
        "trainer_egress_over_minimal": round(chain["refit/bytes"] / one, 4),
        "direct_egress_over_minimal": round(direct["refit/bytes"] / one, 4),
        "bytes_relayed_over_minimal": round(chain["refit/bytes_relayed"] / one, 4),
        "bit_exact": bool(exact), "relay_killed_ok": bool(relay_killed_ok),
        "killed_refit_s": round(max(rank[KILLED_AT - 1]["seconds"] for rank in train), 4),
        "killed_why": [rank[KILLED_AT - 1]["why"].get(0, "")[:200] for rank in train],
    }
    print(f"fan-out (chain) vs direct, {args.replicas} replicas of {row['mb_per_replica']} MB, every rank's link "
          f"{args.mbps:g} MB/s: {chain_s:.3f} s vs {direct_s:.3f} s ({row['fanout_over_direct_s']:.2f}x); the train "
          f"ranks sent {row['trainer_egress_over_minimal']:g}x one replica's bytes (direct "
          f"{row['direct_egress_over_minimal']:g}x); head killed mid-refit: successors landed it: {relay_killed_ok}")
    if args.json:
        print(json.dumps(row))
    return 0 if exact and relay_killed_ok else 1


if __name__ == "__main__":
    sys.exit(main())
