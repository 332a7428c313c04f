"""What splitting the same bytes into more messages costs on gloo, with nothing else in the way.

``--pairs`` sender/receiver process pairs (the refit benchmark's TP2 -> TP2 has two) move
``--mb`` MiB per pair from one pre-allocated buffer, once as one message and once as
``--messages`` messages (views of the same buffer, the refit's window of 16 in flight), in
alternating order, ``--reps`` rounds. Prints the medians of the slowest rank and the median
of the per-round ratios: the part of ``p2`` in ``scripts/bench_refit.py`` that no driver
work can remove while a refit is more than one message per pair.

    .venv/bin/python scripts/bench_messages.py --messages 55 --reps 21
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections import deque

import torch
import torch.distributed as dist

WINDOW = 16  # megatron_refit.endpoint.base.MAX_DIRECT_IN_FLIGHT


def _rank(rank: int, world: int, port: int, mb: int, messages: int, reps: int) -> dict:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=120))
    pairs = world // 2
    sender = rank < pairs
    peer = rank + pairs if sender else rank - pairs
    total = mb << 20
    buffer = torch.zeros(total, dtype=torch.uint8)
    size = total // messages
    cases = {1: [buffer], messages: [buffer[i * size:(i + 1) * size] for i in range(messages)]}

    def move(bufs) -> float:
        pg.allreduce([torch.zeros(1)]).wait()  # start together
        start = time.perf_counter()
        window: deque = deque()
        for tag, buf in enumerate(bufs):
            if len(window) >= WINDOW:
                window.popleft().wait()
            window.append(pg.send([buf], peer, tag) if sender else pg.recv([buf], peer, tag))
        while window:
            window.popleft().wait()
        return time.perf_counter() - start

    seconds: dict[int, list[float]] = {n: [] for n in cases}
    for r in range(reps + 1):  # the first round warms up
        for n in (sorted(cases) if r % 2 else sorted(cases, reverse=True)):
            elapsed = move(cases[n])
            if r:
                seconds[n].append(elapsed)
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--mb", type=int, default=413, help="MiB per pair (the refit benchmark's TP2 -> TP2: 413)")
    p.add_argument("--messages", type=int, default=55, help="messages per pair (the refit's TP2 -> TP2: 55)")
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("pairs", "mb", "messages", "reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be positive, got {getattr(args, name)}")

    from megatron_refit.local.launch import free_ports, run_spawned

    (port,) = free_ports(1)
    out = run_spawned(_rank, 2 * args.pairs, args.mb, args.messages, args.reps, timeout_s=900, port=port)
    slowest = {n: [max(r[n][i] for r in out) for i in range(args.reps)] for n in out[0]}
    one, many = slowest[1], slowest[args.messages]
    ratios = [b / a for a, b in zip(one, many, strict=True)]
    result = dict(one_message_s=statistics.median(one), many_messages_s=statistics.median(many),
                  ratio_of_medians=statistics.median(many) / statistics.median(one),
                  median_ratio=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)],
                  messages=args.messages, pairs=args.pairs, mib_per_pair=args.mb, reps=args.reps)
    print(f"{args.pairs} pairs x {args.mb} MiB over gloo, median of {args.reps}: one message "
          f"{result['one_message_s']:.3f} s, {args.messages} messages {result['many_messages_s']:.3f} s; "
          f"ratio of medians {result['ratio_of_medians']:.3f}, median of per-round ratios "
          f"{result['median_ratio']:.3f} (rounds {min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
