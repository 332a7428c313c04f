"""Side-by-side refit benchmark, one run, same processes, same model and layout:

(a) ours: shard-to-shard refit (exactly the bytes each generation rank needs);
(b) the peers' default: Bridge ``export_hf_weights`` (full gathers on the trainer), then a
    packed send of every full HF tensor from train rank 0 to every generation rank;
(c) the transport floor: for every (sender, receiver) pair of plan (a), one flat
    pre-allocated buffer of exactly that pair's bytes, same group, same pattern;
(d) ours with the integrity check off (``verify="off"``): ``verify_overhead`` is (a) / (d),
    the cost of the bucket digests that every refit runs by default (``--verify``: which
    check (a) runs, ``sampled`` by default): the median over back-to-back pairs, each
    repetition's own and :data:`VERIFY_PAIRS` more per repetition;
(e) delta vs full refits at lr 1e-6 and 1e-5 (``refit.delta``; the model in bf16 with fp32
    master copies, :mod:`bench_delta`), on the first layout (``--no-delta`` skips it).

Warm-up, then ``--reps`` repetitions; medians of the slowest rank per repetition.
``--json``: the last line is one JSON object (see the issue for the fields); ``--png PATH``
writes a bar chart of the three per layout (needs matplotlib: the ``plots`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.tools.cli import reports_user_errors
from megatron_refit.local.harness import RunSpec, check_layout

# Qwen3-shaped, ~215M parameters: sized for 2 cores / 24 GB.
BENCH_SHAPE = dict(hidden=1024, layers=12, heads=16, kv_heads=8, head_dim=64, ffn=3072, vocab=32000)
VERIFY_PAIRS = 2
"""Extra back-to-back (a) / (d) pairs per repetition, in alternating order, for
``verify_overhead``: the check costs a few percent and this machine drifts more than that
between repetitions, so one pair per repetition leaves its median ±2–4 % from run to run."""


class _FullBuffers:
    """Storage of the peers' path: every full HF tensor on every gen rank."""

    def __init__(self, specs):
        self._specs = specs
        self._t = {s.name: torch.empty(s.global_shape, dtype=getattr(torch, s.dtype)) for s in specs}

    def target_specs(self):
        return self._specs

    def buffer(self, name):
        return self._t[name]

    def finalize(self):
        pass


def _timed(fn, group) -> float:
    """Wall seconds of ``fn`` on this rank, started together on all ranks."""
    group.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_rank(rank, world, port, spec: RunSpec, reps: int, verify: str = "sampled", with_delta: bool = False):
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter, TensorPiece
    from megatron_refit.local.harness import hf_config_for, make_gen_backend
    from megatron_refit.plan.spec import ShardSpec, full_box
    from megatron_refit.transport import ProcessGroupTransport

    torch.set_num_threads(1)  # 4+ processes share the cores: intra-op threads would oversubscribe them
    cfg = hf_config_for(spec)
    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=600)
    T, G = spec.num_train, spec.num_gen
    kw = dict(num_train=T, num_gen=G, bucket_bytes=spec.bucket_bytes)
    is_train = rank < T
    if is_train:
        from conversion.testing.build import build_model, init_gloo, init_model_parallel
        from conversion.local_shards import enumerate_local_shards

        init_gloo(rank, T, spec.megatron_port, timeout_s=600)
        init_model_parallel(spec.train)
        built = build_model(cfg, spec.train, dtype=getattr(torch, spec.dtype))
        shards = enumerate_local_shards(built.bridge, built.model, cfg)
        ours, unverified = (Refitter(group, shards, verify=v, **kw) for v in (verify, "off"))
    else:
        backend = make_gen_backend(spec, cfg, rank - T)
        ours, unverified = (Receiver(group, backend, verify=v, **kw) for v in (verify, "off"))
    plan = ours.prepare()
    unverified.prepare()

    # (b) peers: the full export's names and shapes, on every rank
    full_specs = [ShardSpec(name=s.name, global_shape=s.global_shape, dtype=s.dtype, box=full_box(s.global_shape))
                  for s in plan.gen_pieces(0)] if G else []
    seen = {s.name for s in full_specs}
    for g in range(1, G):
        for s in plan.gen_pieces(g):
            if s.name not in seen:
                seen.add(s.name)
                full_specs.append(ShardSpec(name=s.name, global_shape=s.global_shape, dtype=s.dtype,
                                            box=full_box(s.global_shape)))
    if is_train:
        holders = {s.name: TensorPiece(s, torch.empty(s.global_shape, dtype=getattr(torch, s.dtype)))
                   for s in full_specs} if rank == 0 else {}
        peers = Refitter(group, list(holders.values()), **kw)
    else:
        peers = Receiver(group, _FullBuffers(full_specs), **kw)
    peers.prepare()

    # (c) floor: one flat buffer per (src, dst) pair of plan (a)
    route_bytes: dict[tuple[int, int], int] = {}
    for b in plan.buckets:
        route_bytes[b.src_rank, b.dst_rank] = route_bytes.get((b.src_rank, b.dst_rank), 0) + b.payload_bytes
    mine = {pair: torch.zeros(n, dtype=torch.uint8) for pair, n in route_bytes.items()
            if (is_train and pair[0] == rank) or (not is_train and pair[1] == rank - T)}

    def floor():
        pending = [group.isend(buf, plan.gen_global[d], 0) if is_train else group.irecv(buf, plan.train_global[s], 0)
                   for (s, d), buf in sorted(mine.items())]
        for p in pending:
            group.wait(p)

    def run_ours(v, endpoint=ours):
        endpoint.refit(v) if is_train else endpoint.receive(v)

    def run_peers(v):
        if is_train:
            export = built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False)
            for name, tensor in export:
                if rank == 0 and name in holders:
                    holders[name].data = tensor
            peers.refit(v)
        else:
            peers.receive(v)

    from megatron_refit.local.progress import Bar

    times = {"ours": [], "gather_broadcast": [], "floor": [], "ours_unverified": [], "pairs_on": [],
             "pairs_off": []}
    rounds = range(1, reps + 2)  # the first round is the warm-up
    per_round = 1 + VERIFY_PAIRS  # versions of ours / ours unverified per round
    for v in Bar(rounds, desc=f"bench gen TP{spec.gen.tp}xDP{spec.gen.dp}") if rank == 0 else rounds:
        # ours, ours unverified and the floor back to back (this machine's speed drifts over
        # seconds), in rotating order so that none always runs first
        version = v * per_round
        runs = [("ours", lambda: run_ours(version)), ("ours_unverified", lambda: run_ours(version, unverified)),
                ("floor", floor)]
        got = {}
        for key, fn in runs[v % 3:] + runs[: v % 3]:
            got[key] = _timed(fn, group)
        got["gather_broadcast"] = _timed(lambda: run_peers(v), group)
        pairs = {"pairs_on": [], "pairs_off": []}
        for i in range(VERIFY_PAIRS):  # (a) and (d) once more each, alternating which goes first
            version = v * per_round + 1 + i
            both = [("pairs_on", lambda: run_ours(version)), ("pairs_off", lambda: run_ours(version, unverified))]
            for key, fn in both[(v + i) % 2:] + both[: (v + i) % 2]:
                pairs[key].append(_timed(fn, group))
        if v > 1:
            for key, seconds in got.items():
                times[key].append(seconds)
            for key, seconds in pairs.items():
                times[key] += seconds
    num_params = sum(math.prod(s.global_shape) for s in full_specs)
    from megatron_refit.endpoint.integrity import extra_bytes

    delta = None
    if with_delta:  # (e) delta vs full at small learning rates, bf16 with fp32 masters (scripts/bench_delta.py)
        from bench_delta import delta_rank

        delta = delta_rank(group, spec, cfg, shards if is_train else None, reps)
    return dict(times=times, num_params=num_params, bytes_sent=plan.bytes_sent, bytes_minimal=plan.bytes_minimal,
                delta=delta,
                verify_extra_bytes=max((extra_bytes(b.nbytes, verify) for b in plan.buckets), default=0),
                max_bucket_bytes=max((b.nbytes for b in plan.buckets), default=0),
                peer_bytes=peers.plan.bytes_sent, role="train" if is_train else "gen",
                driver_cpu=_driver_cpu(group, lambda v: run_ours(v, unverified), first_version=(reps + 2) * per_round,
                                       reps=reps))


def _driver_cpu(group, run_ours, *, first_version: int, reps: int) -> float:
    """Median CPU seconds of this rank's refit with a transport that moves nothing: the
    driver's own work per refit (the version handshake, getting the pieces, the QKV split,
    packing and unpacking, Python per bucket), which the measured refit adds to the wire's.
    Measured without the integrity check (digests of bytes that never moved cannot match);
    ``verify_overhead`` measures that."""
    from megatron_refit.transport import Pending

    group.isend = group.irecv = lambda buffer, peer, tag: Pending(None, peer, "nothing", buffer)
    group.wait = lambda pending: None
    cpu = []
    for v in range(first_version, first_version + reps):
        group.barrier()
        start = time.process_time()
        run_ours(v)
        cpu.append(time.process_time() - start)
    del group.isend, group.irecv, group.wait  # the class's own again
    return statistics.median(cpu)


def run_bench(spec: RunSpec, reps: int, verify: str = "sampled", with_delta: bool = False) -> dict:
    from dataclasses import replace

    from megatron_refit.local.launch import free_ports, run_spawned

    megatron_port, refit_port = free_ports(2)
    spec = replace(spec, megatron_port=megatron_port, collect=False)
    out = run_spawned(bench_rank, spec.num_train + spec.num_gen, spec, reps, verify, with_delta, timeout_s=1800,
                      port=refit_port)
    seconds, per_rep = {}, {}
    for key in ("ours", "gather_broadcast", "floor", "ours_unverified"):
        per_rep[key] = [max(r["times"][key][i] for r in out) for i in range(reps)]
        seconds[key] = statistics.median(per_rep[key])
    pairs = [[max(r["times"][key][i] for r in out) for i in range(reps * VERIFY_PAIRS)]
             for key in ("pairs_on", "pairs_off")]
    return dict(
        seconds=seconds,
        # the median on / off ratio of pairs measured back to back (each repetition's own
        # and VERIFY_PAIRS more): this machine's speed drifts more between repetitions than
        # the check costs
        verify_overhead=statistics.median(
            [a / b for a, b in zip(per_rep["ours"], per_rep["ours_unverified"])] + [a / b for a, b in zip(*pairs)]),
        verify_pairs=reps * (1 + VERIFY_PAIRS),
        verify_extra_bytes_per_bucket=max(r["verify_extra_bytes"] for r in out),
        max_bucket_bytes=max(r["max_bucket_bytes"] for r in out),
        driver_cpu_ms={role: round(1e3 * max(r["driver_cpu"] for r in out if r["role"] == role), 1)
                       for role in ("train", "gen")},
        model_params=out[0]["num_params"],
        bytes_sent=out[0]["bytes_sent"],
        bytes_minimal=out[0]["bytes_minimal"],
        peer_bytes=out[0]["peer_bytes"],
        layout=f"train {spec.train.describe()} -> gen TP{spec.gen.tp}xDP{spec.gen.dp}",
        delta=_delta_summary([r["delta"] for r in out]) if with_delta else None,
    )


def _delta_summary(per_rank):
    from bench_delta import summarize

    return summarize(per_rank)


def check_args(args) -> None:
    """``ValueError`` naming a bad value of :func:`layout_parser`'s flags."""
    for name in ("train_tp", "gen_tp", "gen_dp", "reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be positive, got {args.bucket_mb}")


def layout_parser(doc: str) -> argparse.ArgumentParser:
    """The benchmarks' common flags: layout, repetitions, bucket size."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-tp", type=int, default=2)
    p.add_argument("--gen-tp", type=int, default=2)
    p.add_argument("--gen-dp", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=64)
    return p


@reports_user_errors
def main(argv=None) -> int:
    p = layout_parser(__doc__)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--also-tp1-dp2", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure train TP2 -> gen TP1xDP2 for the table")
    p.add_argument("--verify", default="sampled", choices=["sampled", "full"],
                   help="the integrity check of the measured refit (default: %(default)s, as refit.verify)")
    p.add_argument("--delta", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure delta vs full refits at lr 1e-6 and 1e-5 (bf16 with fp32 masters; first "
                        "layout)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--png", metavar="PATH", help="write a bar chart: ours vs gather+broadcast vs floor per layout")
    args = p.parse_args(argv)
    check_args(args)
    if args.png:
        from megatron_refit.tools.plots import require_matplotlib

        require_matplotlib()
    layouts = [(args.gen_tp, args.gen_dp)]
    if args.also_tp1_dp2 and (args.gen_tp, args.gen_dp) != (1, 2):
        layouts.append((1, 2))
    rows = []
    for gen_tp, gen_dp in layouts:
        spec = RunSpec(model="qwen3", overrides=dict(BENCH_SHAPE), train=TrainLayout(tp=args.train_tp),
                       gen=GenLayout(tp=gen_tp, dp=gen_dp), bucket_bytes=int(args.bucket_mb * (1 << 20)),
                       dtype=args.dtype)
        check_layout(spec)  # before any rank starts
        rows.append(run_bench(spec, args.reps, args.verify, with_delta=args.delta and not rows))
    print(f"{'layout':36s} {'ours s':>8} {'gather+bcast s':>14} {'floor s':>8} {'p1 bytes':>9} "
          f"{'p2 vs floor':>11} {'p3 speedup':>10} {'bytes ours':>13} {'bytes peers':>13}")
    for r in rows:
        s = r["seconds"]
        print(f"{r['layout']:36s} {s['ours']:8.3f} {s['gather_broadcast']:14.3f} {s['floor']:8.3f} "
              f"{r['bytes_sent'] / r['bytes_minimal']:9.3f} {s['ours'] / s['floor']:11.3f} "
              f"{s['gather_broadcast'] / s['ours']:10.2f} {r['bytes_sent']:13,} {r['peer_bytes']:13,}")
    head = rows[0]
    s = head["seconds"]
    result = dict(
        ok=True,
        p1_bytes_ratio=head["bytes_sent"] / head["bytes_minimal"],
        p2_vs_floor=s["ours"] / s["floor"],
        p3_speedup_vs_gather=s["gather_broadcast"] / s["ours"],
        seconds=s,
        verify=args.verify,
        verify_overhead=head["verify_overhead"],
        verify_pairs=head["verify_pairs"],
        verify_extra_bytes_per_bucket=head["verify_extra_bytes_per_bucket"],
        driver_cpu_ms=head["driver_cpu_ms"],
        model_params=head["model_params"],
        layout=head["layout"],
    )
    result["ok"] = result["p1_bytes_ratio"] == 1.0 and result["p2_vs_floor"] <= 1.15 and \
        result["p3_speedup_vs_gather"] >= 2.0
    for r in rows:
        print(f"{r['layout']}: integrity check (verify {args.verify}) {r['seconds']['ours']:.3f} s against "
              f"{r['seconds']['ours_unverified']:.3f} s off: verify_overhead {r['verify_overhead']:.3f} "
              f"(median of {r['verify_pairs']} pairs); "
              f"peak extra memory {r['verify_extra_bytes_per_bucket']:,} bytes per bucket (largest bucket "
              f"{r['max_bucket_bytes']:,} bytes)")
    for r in rows:
        print(f"{r['layout']}: driver CPU per refit with a transport that moves nothing (median, slowest rank): "
              f"train {r['driver_cpu_ms']['train']} ms, gen {r['driver_cpu_ms']['gen']} ms")
    if head["delta"]:
        from bench_delta import LRS, THROTTLE_BYTES_PER_S, THROTTLED

        result["delta"] = head["delta"]
        # refit.delta: auto against a full refit: on loopback at the first lr, and over the throttled link
        result["delta_auto_over_full_s"] = head["delta"][f"{LRS[0]:g}"]["auto_over_full_s"]
        result["delta_auto_over_full_bytes"] = head["delta"][THROTTLED]["auto_over_full_bytes"]
        result["delta_auto_over_full_s_throttled"] = head["delta"][THROTTLED]["auto_over_full_s"]
        for lr, d in head["delta"].items():
            where = f"lr {LRS[0]:g} over a {THROTTLE_BYTES_PER_S / 1e6:g} MB/s link" if lr == THROTTLED else f"lr {lr}"
            print(f"{head['layout']}: delta vs full at {where} (bf16, fp32 masters): on {d['delta_s']:.3f} s, "
                  f"auto {d['auto_s']:.3f} s, full {d['full_s']:.3f} s (on x{d['time_ratio']:.2f}, auto "
                  f"x{d['auto_over_full_s']:.2f}); bytes on {d['bytes_ratio']:.3f}, auto "
                  f"{d['auto_over_full_bytes']:.3f} of {d['bytes_full']:,} ({d['auto_deltas']} of {d['reps']} auto "
                  f"refits deltas), density {d['density']:.4f}")
    print(f"model: {head['model_params'] / 1e6:.0f}M params, {args.dtype}, median of {args.reps} after warm-up; "
          f"targets p1 = 1.00, p2 <= 1.15, p3 >= 2.0: {'met' if result['ok'] else 'NOT met'}")
    if args.png:
        from megatron_refit.tools.plots import bench_chart

        bench_chart(rows, args.png, title=f"refit of a {head['model_params'] / 1e6:.0f}M-parameter Qwen3 shape, "
                                          f"{args.dtype}, median of {args.reps} (gloo, CPU)")
        print(f"chart: {args.png}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
