"""Delta vs full refits at small learning rates, inside ``scripts/bench_refit.py``'s run.

The benchmark model's weights in bf16 with fp32 master copies, as Megatron trains: before
each refit every master weight takes an Adam-sized step (``lr`` per element, a fixed random
direction) and the bf16 weights are re-rounded from it, so only the elements whose master
crossed a bf16 rounding boundary change. A delta endpoint (``refit.delta: on``) and a full
one refit the same weights into two engines of their own, back to back in rotating order;
medians of the slowest rank.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

LRS = (1e-6, 1e-5)


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
    from megatron_refit.tools.harness import make_gen_backend

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
            pieces.append(TensorPiece(bf16, master.to(torch.bfloat16), follows=getattr(shard, "follows", None)))
            masters.append(master)
            noise.append(torch.randn(master.shape, generator=g))
            release = getattr(shard, "release", None)  # drop a copy tensor() made (the QKV split)
            if release is not None:
                release()
        endpoints = {key: Refitter(group, pieces, delta=key, **kw) for key in ("on", "off")}
    else:
        bf16_spec = replace(spec, dtype="bfloat16")
        endpoints = {key: Receiver(group, make_gen_backend(bf16_spec, cfg, group.rank - T), delta=key, **kw)
                     for key in ("on", "off")}
    for endpoint in endpoints.values():
        endpoint.prepare()

    def refit(key, version):
        ep = endpoints[key]
        return ep.refit(version) if is_train else ep.receive(version)

    out, version = {}, 0
    for lr in LRS:
        times, summaries = {"on": [], "off": []}, []
        for rep in range(reps + 1):  # the first: the delta endpoint's first refit of this lr is a delta too
            if is_train:
                for master, piece, direction in zip(masters, pieces, noise):
                    master.add_(direction, alpha=lr)
                    piece.data.copy_(master)
            version += 1
            order = ["on", "off"] if rep % 2 == 0 else ["off", "on"]
            for key in order:
                reports = []
                seconds = _timed(lambda key=key: reports.append(refit(key, version)), group)
                if rep and version > 1:
                    times[key].append(seconds)
                    if key == "on":
                        summaries.append(reports[0].summary)
        out[lr] = dict(times=times, summaries=summaries)
    return out


def summarize(per_rank: list[dict]) -> dict:
    """Slowest rank per repetition, medians, from every rank's :func:`delta_rank`."""
    rows = {}
    for lr in LRS:
        reps = len(per_rank[0][lr]["times"]["on"])
        slowest = {key: [max(r[lr]["times"][key][i] for r in per_rank) for i in range(reps)] for key in ("on", "off")}
        summaries = per_rank[0][lr]["summaries"]
        rows[f"{lr:g}"] = dict(
            full_s=statistics.median(slowest["off"]),
            delta_s=statistics.median(slowest["on"]),
            bytes_full=summaries[0]["refit/bytes_full"],
            bytes_delta=int(statistics.median(s["refit/bytes"] for s in summaries)),
            density=statistics.median(s["refit/density"] for s in summaries),
            all_delta=all(s["refit/delta"] for s in summaries),
            pack_s=statistics.median(s["refit/pack_s"] for s in summaries),
            load_s=statistics.median(s["refit/load_s"] for s in summaries),
            verify_s=statistics.median(s["refit/verify_s"] for s in summaries),
        )
        rows[f"{lr:g}"]["bytes_ratio"] = rows[f"{lr:g}"]["bytes_delta"] / rows[f"{lr:g}"]["bytes_full"]
        rows[f"{lr:g}"]["time_ratio"] = rows[f"{lr:g}"]["delta_s"] / rows[f"{lr:g}"]["full_s"]
    return rows
