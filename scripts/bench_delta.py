"""Delta vs full refits at small learning rates, inside ``scripts/bench_refit.py``'s run.

The benchmark model's weights in bf16 with fp32 master copies, as Megatron trains: before
each refit every master weight takes an Adam-sized step (``lr`` per element, a fixed random
direction) and the bf16 weights are re-rounded from it, so only the elements whose master
crossed a bf16 rounding boundary change. Three endpoints, ``refit.delta`` ``on``, ``auto`` and
``off`` (full), refit the same weights into engines of their own, back to back in rotating
order; medians of the slowest rank. Then the same at the first learning rate over a throttled
link (:data:`THROTTLE_BYTES_PER_S` per train rank: each bucket waits its bytes' time before
it is posted), where the link, not the comparison, is the bottleneck.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

LRS = (1e-6, 1e-5)
KEYS = ("on", "auto", "off")
THROTTLE_BYTES_PER_S = 200e6
"""The throttled link: 200 MB/s per train rank (1.6 Gb/s)."""
THROTTLED = "throttled"


def _timed(fn, group) -> float:
    group.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def delta_rank(group, spec, cfg, shards, reps: int) -> dict:
    """On every rank of the benchmark's group (``shards``: a train rank's local shards, None
    on generation ranks). Returns per learning rate the seconds, bytes and density."""
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter, TensorPiece
    from megatron_refit.plan.spec import ShardSpec
    from megatron_refit.local.harness import make_gen_backend

    T = spec.num_train
    kw = dict(num_train=T, num_gen=spec.num_gen, bucket_bytes=spec.bucket_bytes)
    is_train = group.rank < T
    if is_train:
        masters, pieces, noise = [], [], []
        g = torch.Generator().manual_seed(group.rank)
        for shard in shards:
            master = shard.tensor().detach().float().clone()
            s = shard.spec
            bf16 = ShardSpec(name=s.name, global_shape=s.global_shape, dtype="bfloat16", box=s.box,
                             pp_stage=s.pp_stage, is_expert=s.is_expert)
            pieces.append(TensorPiece(bf16, master.to(torch.bfloat16), follows=shard.follows))
            masters.append(master)
            noise.append(torch.randn(master.shape, generator=g))
            shard.release()  # drop a copy tensor() made (the QKV split)
        endpoints = {key: Refitter(group, pieces, delta=key, **kw) for key in KEYS}
    else:
        bf16_spec = replace(spec, dtype="bfloat16")
        endpoints = {key: Receiver(group, make_gen_backend(bf16_spec, cfg, group.rank - T), delta=key, **kw)
                     for key in KEYS}
    for endpoint in endpoints.values():
        endpoint.prepare()

    def refit(key, version):
        ep = endpoints[key]
        return ep.refit(version) if is_train else ep.receive(version)

    out, version = {}, 0
    for lr in (*LRS, THROTTLED):
        if lr == THROTTLED and is_train:
            _throttle(group, THROTTLE_BYTES_PER_S)
        step = LRS[0] if lr == THROTTLED else lr
        times, summaries = {key: [] for key in KEYS}, {key: [] for key in KEYS}
        warm = 3 if lr == THROTTLED else 1  # auto's first refits there: full (measured), then with copies
        for rep in range(reps + warm):
            if is_train:
                for master, piece, direction in zip(masters, pieces, noise):
                    master.add_(direction, alpha=step)
                    piece.data.copy_(master)
            version += 1
            order = KEYS[rep % 3:] + KEYS[:rep % 3]
            for key in order:
                reports = []
                seconds = _timed(lambda key=key: reports.append(refit(key, version)), group)
                if rep >= warm and version > 1:
                    times[key].append(seconds)
                    summaries[key].append(reports[0].summary)
        out[lr] = dict(times=times, summaries=summaries)
    return out


def _throttle(group, bytes_per_s: float) -> None:
    """A slow link on this train rank: each message waits its bytes' time before it is posted."""
    isend = group.isend

    def throttled(buffer, peer, tag):
        time.sleep(buffer.numel() * buffer.element_size() / bytes_per_s)
        return isend(buffer, peer, tag)

    group.isend = throttled


def summarize(per_rank: list[dict]) -> dict:
    """Slowest rank per repetition, medians, from every rank's :func:`delta_rank`."""
    rows = {}
    for lr in (*LRS, THROTTLED):
        reps = len(per_rank[0][lr]["times"]["on"])
        slowest = {key: [max(r[lr]["times"][key][i] for r in per_rank) for i in range(reps)] for key in KEYS}
        summaries = per_rank[0][lr]["summaries"]
        on, auto = summaries["on"], summaries["auto"]
        row = rows[lr if lr == THROTTLED else f"{lr:g}"] = dict(
            full_s=statistics.median(slowest["off"]),
            delta_s=statistics.median(slowest["on"]),
            auto_s=statistics.median(slowest["auto"]),
            bytes_full=on[0]["refit/bytes_full"],
            bytes_delta=int(statistics.median(s["refit/bytes"] for s in on)),
            bytes_auto=int(statistics.median(s["refit/bytes"] for s in auto)),
            auto_deltas=sum(s["refit/delta"] for s in auto),
            density=statistics.median(s["refit/density"] for s in on),
            all_delta=all(s["refit/delta"] for s in on),
            pack_s=statistics.median(s["refit/pack_s"] for s in on),
            load_s=statistics.median(s["refit/load_s"] for s in on),
            verify_s=statistics.median(s["refit/verify_s"] for s in on),
            reps=reps,
        )
        row["bytes_ratio"] = row["bytes_delta"] / row["bytes_full"]
        row["time_ratio"] = row["delta_s"] / row["full_s"]
        row["auto_over_full_s"] = row["auto_s"] / row["full_s"]
        row["auto_over_full_bytes"] = row["bytes_auto"] / row["bytes_full"]
    return rows
