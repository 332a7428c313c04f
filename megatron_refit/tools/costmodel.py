"""``python -m megatron_refit.costmodel --config configs/<model>.yaml [--json]``.

Builds the config's plan as the dry run does (:mod:`megatron_refit.tools.dryrun`), places its
ranks on a GPU cluster and predicts the refit seconds with :mod:`megatron_refit.plan.cost`,
printed beside the published refit times of other systems for the same model.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_refit.plan.assignment import Assignment
from megatron_refit.plan.cost import (Cluster, Prediction, delta_fraction, delta_prediction, fanout_prediction,
                                      nic_floor, overlap_stall, placement, predict, quantize_busy, quantized_bytes,
                                      staged_pause)
from megatron_refit.plan.checks import ITEMSIZE
from megatron_refit.plan.dense_forward import node_group
from megatron_refit.plan.deployment_forwarding import FORWARDING, forwarding_routes, node_routes
from megatron_refit.plan.fanout import MODES, fanout_routes, resolve_mode
from megatron_refit.plan.roles import EXPERT_RE
from megatron_refit.tools.cli import plain
from megatron_refit.tools.dryrun import DryRun, build
from megatron_refit.tools.dryrun_layouts import gen_text

PUBLISHED: dict[str, list[tuple[str, str, float, float]]] = {
    "qwen3-4b": [("NeMo-RL refit, earlier version (H100)", "not stated", 0.07, 0.07)],
    "qwen3-30b-a3b": [("NeMo-RL reshard refit (H100)", "EP8xPP2 -> TP8xDP2", 0.74, 1.00)],
    "qwen3-235b-a22b": [
        ("NeMo-RL refit, earlier version (H100)", "TP4xPP8xEP16 -> TP8xDP16", 4.56, 4.56),
        ("MoonshotAI checkpoint-engine (8x H800)", "its own layout", 6.22, 6.22),
    ],
    "deepseek-v3-671b": [
        ("NeMo-RL reshard refit (H100)", "PP16xEP16 -> TP32xDP8", 2.39, 2.83),
        ("NeMo-RL refit, earlier version (H100)", "PP16xEP16 -> TP32xDP8", 7.65, 9.94),
    ],
    "kimi-k2": [
        ("Perplexity (record, in-house engine)", "256 BF16 -> 128 FP8 GPUs", 1.3, 1.3),
        ("miles P2P into SGLang", "TP8xPP8xCP4xEP32 -> TP32/EP32, DPattn8", 7.23, 7.23),
    ],
}
"""Published refit seconds by preset: (system, layout, low, high)."""


def route_bytes(senders: Assignment) -> dict[tuple[int, int], int]:
    """Bytes per route (train rank, gen rank) of a plan (or of the tests' per-piece reference)."""
    return senders.route_bytes()


def snapshot_bytes_max(pairs: dict[tuple[int, int], int], local_bytes: list[int]) -> int:
    """The most bytes one train rank's ``refit.overlap`` snapshot copies: what it sends, each
    byte once however many replicas get it, so at most its local pieces."""
    sent: dict[int, int] = {}
    for (src, _), nbytes in pairs.items():
        sent[src] = sent.get(src, 0) + nbytes
    return max((min(nbytes, local_bytes[src]) for src, nbytes in sent.items()), default=0)


def fanout_summary(routes, prediction, pairs: dict[tuple[int, int], int], gen_bytes_max: int, mode: str,
                   cluster: Cluster) -> dict:
    """The ``"fanout"`` entry of ``--json``: the prediction, the bytes from the train ranks and
    relayed, each as a multiple of one replica's bytes, and (disaggregated) the floor no scheme
    beats: the busiest gen rank's bytes through its own NIC."""
    head = {gen for _, gen in routes.from_trainers}  # the first replica's ranks
    minimal = sum(nbytes for (_, gen), nbytes in pairs.items() if gen in head)
    direct = sum(pairs.values())
    floor = nic_floor(gen_bytes_max, cluster) if mode == "disaggregated" else None
    return {"mode": routes.mode, "predicted_seconds": round(prediction.seconds, 4),
            "bottleneck": prediction.bottleneck, "depth": routes.depth,
            "bytes_from_trainers": routes.bytes_from_trainers, "bytes_relayed": routes.bytes_relayed,
            "trainer_egress_over_minimal": round(routes.bytes_from_trainers / minimal, 4) if minimal else 0.0,
            "direct_egress_over_minimal": round(direct / minimal, 4) if minimal else 0.0,
            "floor_seconds": round(floor, 4) if floor is not None else None}


def gen_label(run: DryRun) -> str:
    """The engine layout in the table: ``TP16xDP8``, or a deployment's ``D16xT8 EP128 R32 x1``."""
    gen = run.gen
    if gen.attention_dp == 1 and gen.placement is None:
        return f"TP{gen.tp}xDP{gen.dp}"
    redundant = gen.placement.num_redundant if gen.placement is not None else 0
    experts = f" EP{gen.deployment_size}" if gen.expert_parallel else ""
    return f"D{gen.attention_dp}xT{gen.tp}{experts}{f' R{redundant}' if redundant else ''} x{gen.dp}"


def forwarding_json(run: DryRun, direct_seconds: float, train_gpu: list[int], gen_gpu: list[int],
                    cluster: Cluster) -> dict | None:
    """The ``"deployment_forwarding"`` entry of ``--json`` (None: one DP rank per deployment): the
    transport seconds of sending each deployment's dense weights to every DP rank from the train
    ranks (``direct``) and of forwarding them from DP rank 0 in a ``chain`` or ``tree``
    (:mod:`megatron_refit.plan.deployment_forwarding`; modelled, not built) or split over the DP
    ranks of a node (``node``: ``refit.gen_dense_forward``, its node groups of ``gen_node_ranks``
    engine ranks; the rows pass on once every rank's own arrived, so its exchange is added after);
    the fastest (``picked``) and what the config runs (``configured``)."""
    gen = run.gen
    if gen.attention_dp < 2:
        return None
    dense = run.senders.route_bytes(keep=lambda name: EXPERT_RE.search(name) is None)
    experts = run.senders.route_bytes(keep=lambda name: EXPERT_RE.search(name) is not None)
    seconds, egress = {"direct": direct_seconds}, {"direct": sum(dense.values()) + sum(experts.values())}
    shape = dict(tp=gen.tp, attention_dp=gen.attention_dp, deployments=gen.dp)
    per_node = run.refit.gen_node_ranks
    for mode in MODES:
        routes = forwarding_routes(dense, experts, mode=mode, **shape)
        seconds[mode] = fanout_prediction(routes, train_gpu, gen_gpu, cluster,
                                          bucket_bytes=run.refit.bucket_bytes).seconds
        egress[mode] = routes.bytes_from_trainers
    groups = [node_group(g, tp=gen.tp, attention_dp=gen.attention_dp, node_ranks=per_node)
              for g in range(gen.world_size)]
    routes = node_routes(dense, experts, node=groups, **shape)  # the refit's own node groups
    receive, forward = (predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=run.refit.bucket_bytes,
                                relays=relays) for pairs, relays in ((routes.from_trainers, None), ({}, routes.relays)))
    seconds["node"] = receive.seconds + forward.seconds
    egress["node"] = routes.bytes_from_trainers
    into: dict[int, int] = {}
    for (_, dst), nbytes in routes.from_trainers.items():
        into[dst] = into.get(dst, 0) + nbytes
    picked = min(seconds, key=lambda mode: (seconds[mode], mode != "direct"))
    return {"picked": picked, "configured": "node" if run.refit.gen_dense_forward == "node" else "direct",
            **{f"{mode}_seconds": round(t, 4) for mode, t in seconds.items()},
            **{f"{mode}_trainer_egress_bytes": nbytes for mode, nbytes in egress.items()},
            "dense_bytes_per_dp_rank": sum(dense.values()) // (gen.dp * gen.attention_dp),
            "node_gen_bytes_max": max(into.values(), default=0),
            "node_bottleneck": f"{receive.bottleneck}; then the exchange in each node group, {forward.bottleneck}"}


def egress_json(run: DryRun, pairs: dict[tuple[int, int], int], sent: int | None = None) -> dict:
    """What the train ranks send (``sent``, default the plan's routes) against the least that
    reaches every replica: each byte the engine holds once per replica (a wide deployment's
    attention is held alike by its data-parallel ranks: sent to each of them, or under
    ``gen_dense_forward: node`` once per node group, which forwards it)."""
    egress, minimal = sum(pairs.values()) if sent is None else sent, run.gen.dp * run.held_bytes
    return {"trainer_egress_bytes": egress, "trainer_egress_minimal_bytes": minimal,
            "trainer_egress_over_minimal": round(egress / minimal, 4) if minimal else 0.0}


def main(argv=None) -> int:
    defaults = Cluster()
    p = argparse.ArgumentParser(prog="python -m megatron_refit.costmodel", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="training YAML with a refit: section")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--cache-dir", default=None, help="enumeration cache (default: <config dir>/cache)")
    p.add_argument("--placement", choices=["disaggregated", "colocated"], default=None,
                   help="default: the config's refit.mode")
    p.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node)
    p.add_argument("--nvlink-gbps", type=float, default=defaults.nvlink_gbps)
    p.add_argument("--nic-gbps", type=float, default=defaults.nic_gbps)
    p.add_argument("--efficiency", type=float, default=defaults.efficiency)
    p.add_argument("--latency-us", type=float, default=defaults.latency_s * 1e6)
    p.add_argument("--quantize-gbps", type=float, default=defaults.quantize_gbps,
                   help="trainer-side FP8 quantization per GPU, GB/s of bf16 input (refit.trainer_quantize_fp8)")
    p.add_argument("--delta-density", type=float, default=None, metavar="D",
                   help="also predict a delta refit (refit.delta) where a share D of the bf16 elements changed "
                        "since the last refit (e.g. 0.03)")
    p.add_argument("--swap", choices=["in_place", "staged"], default=None,
                   help="also predict the generation pause of a refit (refit.swap; default: the config's)")
    p.add_argument("--overlap", action="store_true",
                   help="also predict the training-step stall per refit with refit.overlap on and off")
    p.add_argument("--fanout", choices=["off", *MODES, "auto"], default=None,
                   help="also predict a refit under replica fan-out (refit.fanout: the train ranks send to one "
                        "replica, the replicas forward); default: the config's refit.fanout; auto: the cost "
                        "model's choice")
    args = p.parse_args(argv)
    model = ""
    try:
        cluster = Cluster(gpus_per_node=args.gpus_per_node, nvlink_gbps=args.nvlink_gbps, nic_gbps=args.nic_gbps,
                          efficiency=args.efficiency, latency_s=args.latency_us * 1e-6,
                          quantize_gbps=args.quantize_gbps)
        run = build(args.config, cache_dir=args.cache_dir, prepare=False, forward=False)  # each scheme from it
        model = run.refit.model
        mode = args.placement or run.refit.mode
        train_gpu, gen_gpu = placement(run.train.world_size, run.gen.world_size, mode, cluster.gpus_per_node)
        pairs = route_bytes(run.senders)
        transport = predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=run.refit.bucket_bytes)
        quantized = quantized_bytes(run.senders, source_itemsize=ITEMSIZE["bfloat16"]) \
            if run.refit.trainer_quantize_fp8 else []
        prediction = transport
        if any(quantized):
            busy = quantize_busy(quantized, train_gpu, gen_gpu, cluster, bucket_bytes=run.refit.bucket_bytes)
            prediction = predict(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=run.refit.bucket_bytes, busy=busy)
        delta = None
        if args.delta_density is not None:
            delta = delta_prediction(pairs, train_gpu, gen_gpu, cluster, bucket_bytes=run.refit.bucket_bytes,
                                     density=args.delta_density)
        forwarding = forwarding_json(run, transport.seconds, train_gpu, gen_gpu, cluster)
        gen_max = run.gen_bytes_max()
        if forwarding is not None and forwarding["configured"] == "node":  # what runs: node groups' shares
            gen_max = forwarding["node_gen_bytes_max"]
            extra = prediction.seconds - transport.seconds  # the trainer's FP8 quantization, as counted direct
            transport = Prediction(seconds=forwarding["node_seconds"], per_gpu={},
                                   bottleneck=f"node forwarding: {forwarding['node_bottleneck']}")
            prediction = Prediction(seconds=transport.seconds + extra, bottleneck=transport.bottleneck, per_gpu={})
        fanout = None
        fanout_mode = resolve_mode(args.fanout or run.refit.fanout, pairs, tp=run.gen.deployment_size, dp=run.gen.dp,
                                   bucket_bytes=run.refit.bucket_bytes)
        if fanout_mode != "off" and run.gen.dp > 1:
            routes = fanout_routes(pairs, tp=run.gen.deployment_size, dp=run.gen.dp, mode=fanout_mode)
            fanout = (routes, fanout_prediction(routes, train_gpu, gen_gpu, cluster,
                                                bucket_bytes=run.refit.bucket_bytes))
    except (ValueError, FileNotFoundError) as e:  # the user's input: name it, report not ok
        print(f"error: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "model": model, "predicted_seconds": 0.0, "bottleneck": "",
                              "bytes_per_gen_rank_max": 0, "error": str(e)}))
        return 2
    layout = f"{run.train.describe()} -> {gen_label(run)}"
    print(f"{model}: {layout}, {mode}, {cluster.gpus_per_node} GPUs/node, NVLink {cluster.nvlink_gbps:g} GB/s, "
          f"NIC {cluster.nic_gbps:g} GB/s per GPU, efficiency {cluster.efficiency:g}, "
          f"{cluster.latency_s * 1e6:g} us/message")
    print(f"engine: {gen_text(run)}")
    print(f"bytes per gen rank (max): {gen_max / 1e9:.2f} GB (from the train ranks: each rank what it holds, "
          f"once, or its node group's share of the dense rows); bottleneck: {prediction.bottleneck}")
    floor = nic_floor(gen_max, cluster) if mode == "disaggregated" else None
    if floor is not None:
        print(f"per-gen-rank floor: {floor:.3f} s (the busiest gen rank's bytes through its own NIC); predicted "
              f"{prediction.seconds / floor:.2f}x it")
    node = forwarding is not None and forwarding["configured"] == "node"
    egress = egress_json(run, pairs, forwarding["node_trainer_egress_bytes"] if node else None)
    how = ("; a node group's data-parallel ranks each get a share of its dense rows from the train ranks" if node
           else "; a deployment's data-parallel ranks each get its attention from the train ranks"
           if run.gen.attention_dp > 1 else "")
    print(f"trainer egress: {egress['trainer_egress_bytes'] / 1e9:.1f} GB, {egress['trainer_egress_over_minimal']:g}x "
          f"the minimal {egress['trainer_egress_minimal_bytes'] / 1e9:.1f} GB (each byte the engine holds once per "
          f"replica{how})")
    if forwarding is not None:
        times = ", ".join(f"{m} {forwarding[f'{m}_seconds']:.3f} s" for m in FORWARDING)
        picked, configured = forwarding["picked"], forwarding["configured"]
        advice = {"direct": " (refit.gen_dense_forward: off)", "node": " (refit.gen_dense_forward: node)"}.get(
            picked, " (modelled only: the refit runs direct or node)")
        print(f"a deployment's dense weights ({forwarding['dense_bytes_per_dp_rank'] / 1e9:.2f} GB on each of its "
              f"{run.gen.attention_dp} DP ranks): {times} (transport); picked: {picked}{advice}; this config runs "
              f"{configured}")
    quantize_max = max(quantized, default=0) / (cluster.quantize_gbps * 1e9)
    if any(quantized):
        print(f"trainer-side FP8: the busiest train rank quantizes {max(quantized) / 1e9:.2f} GB of bf16 in "
              f"{quantize_max:.3f} s at {cluster.quantize_gbps:g} GB/s, counted on its own GPU (transport alone "
              f"{transport.seconds:.3f} s; were it added to the whole refit: {transport.seconds + quantize_max:.3f} s)")
    if run.refit.direct_mb is not None and run.refit.direct_bytes < run.refit.bucket_bytes:
        print(f"note: refit.direct_mb={run.refit.direct_mb:g} is below bucket_mb={run.refit.bucket_mb:g}: every "
              "transfer of that size or more is a message of its own, which this prediction does not count "
              "(it counts full buckets, the NCCL default)")
    print(f"{'system':42} {'layout':40} {'seconds':>12}")
    print(f"{'megatron-refit (predicted)':42} {layout:40} {prediction.seconds:12.2f}")
    if delta is not None:
        label = f"  delta at density {args.delta_density:g} ({delta_fraction(args.delta_density):.3f} of bytes)"
        print(f"{label:42} {layout:40} {delta.seconds:12.2f}")
    fanout_json = None
    if fanout is not None:
        fanout_json = fanout_summary(*fanout, pairs, run.gen_bytes_max(), mode, cluster)
        label = f"  fan-out ({fanout_mode})"
        print(f"{label:42} {layout:40} {fanout[1].seconds:12.2f}")
        floor = fanout_json["floor_seconds"]
        print(f"fan-out ({fanout_mode}): the train ranks send {fanout_json['bytes_from_trainers'] / 1e9:.2f} GB "
              f"({fanout_json['trainer_egress_over_minimal']:g}x one replica's; direct: "
              f"{fanout_json['direct_egress_over_minimal']:g}x), the replicas relay "
              f"{fanout_json['bytes_relayed'] / 1e9:.2f} GB over {fanout[0].depth} hop(s); bottleneck: "
              f"{fanout[1].bottleneck}"
              + (f"; floor of any scheme: {floor:.2f} s (each gen rank's bytes through its own NIC)" if floor else ""))
    swap = args.swap or run.refit.swap
    if swap == "in_place":
        pause, how = prediction.seconds, "the whole transfer"
    else:
        budget = run.refit.swap_budget_mb
        pause, how = staged_pause(run.gen_bytes_max(), prediction.seconds, cluster, engine=run.refit.engine,
                                  budget_bytes=None if budget is None else int(budget * 2**20))
    print(f"generation pause per refit ({swap}): {pause:.3f} s ({how})")
    stall = None
    if args.overlap:
        sent = snapshot_bytes_max(pairs, run.train_local_bytes)
        stall = overlap_stall(sent, cluster)
        print(f"training-step stall per refit: overlap off {prediction.seconds:.3f} s (the whole refit); overlap on "
              f"{stall * 1e3:.2f} ms (the snapshot: a device copy of the {sent / 1e9:.2f} GB the busiest train rank "
              f"sends from, also its extra memory); the send then runs behind the next step, which must take longer "
              f"than {prediction.seconds:.3f} s for the refit never to wait")
    for system, their_layout, low, high in PUBLISHED.get(model, []):
        seconds = f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"
        print(f"{system:42} {their_layout:40} {seconds:>12}")
    if args.json:
        print(json.dumps({"ok": prediction.seconds > 0, "model": model,
                          "predicted_seconds": round(prediction.seconds, 4), "bottleneck": prediction.bottleneck,
                          "bytes_per_gen_rank_max": gen_max,
                          "floor_seconds": round(floor, 4) if floor is not None else None,
                          "transport_seconds": round(transport.seconds, 4),
                          "quantize_seconds": round(quantize_max, 4),
                          "quantized_bytes_per_train_rank_max": max(quantized, default=0),
                          "gen_tp": run.gen.tp, "gen_attention_dp": run.gen.attention_dp, "gen_dp": run.gen.dp,
                          "gen_expert_parallel_size": run.gen.deployment_size if run.gen.expert_parallel else 1,
                          **egress,
                          **({"deployment_forwarding": forwarding} if forwarding is not None else {}),
                          "swap": swap, "predicted_pause_seconds": round(pause, 4),
                          **({"delta_density": args.delta_density, "predicted_delta_seconds": round(delta.seconds, 4),
                              "delta_bytes_fraction": round(delta_fraction(args.delta_density), 4)}
                             if delta is not None else {}),
                          **({"predicted_stall_blocking_seconds": round(prediction.seconds, 4),
                              "predicted_stall_overlap_seconds": round(stall, 6),
                              "snapshot_bytes_per_train_rank_max": sent}
                             if stall is not None else {}),
                          **({"fanout": fanout_json} if fanout_json is not None else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
