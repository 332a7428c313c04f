"""A transport cost model of one refit on a GPU cluster (pure math).

Input: the bytes every route (train rank, gen rank) carries, from the plan. Every rank is
one GPU; GPU ``g`` of the cluster sits on node ``g // gpus_per_node``. A transfer between
two GPUs of one node goes over NVLink, between nodes over the sender's and the receiver's
NIC (one per GPU, as on H100 nodes with 8x 400 Gb/s), and within one GPU (colocated
trainer and engine) it is a device copy. Links run in parallel and in both directions, so
each GPU's time is the slowest of its five loads (NIC out, NIC in, NVLink out, NVLink in,
device copy), each divided by its bandwidth, plus a fixed cost per message it handles;
the refit takes as long as the slowest GPU. Not modelled: the fabric's core (assumed
non-blocking), the engine's post-load step, and the trainer-side packing (at HBM speed).

Trainer-side FP8 (``refit.trainer_quantize_fp8``): each train rank quantizes every weight piece it
sends from once per refit (:func:`quantized_bytes`), on its own GPU, lazily before the piece's first
bucket (``endpoint.fp8_pieces``). The model counts it **serially on that train rank's GPU**: its
quantize seconds (bytes of bf16 input ÷ ``Cluster.quantize_gbps``) are added to its link time, as
if none of it overlapped its own sends (an upper bound for that GPU), while the other GPUs' links
run in parallel as before; every receiver also waits for the first bucket's quantization (a
pipeline fill). :func:`quantize_busy` builds those seconds for :func:`predict`. The alternative
bound, the slowest train rank's quantization added to the whole refit, is what the cost model
prints beside it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from megatron_refit.plan.spec import box_numel

GB = 1e9
FP8 = "float8_e4m3fn"


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Bandwidths per GPU and per direction, in GB/s (10^9 bytes)."""

    gpus_per_node: int = 8
    """GPUs per node (NVLink domain)."""
    nvlink_gbps: float = 450.0
    """H100 SXM NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction (nominal)."""
    nic_gbps: float = 50.0
    """One 400 Gb/s NIC (InfiniBand NDR / RoCE) per GPU = 50 GB/s per direction (nominal)."""
    copy_gbps: float = 1500.0
    """Device-to-device copy within one GPU (H100 HBM3 3.35 TB/s, read + write)."""
    efficiency: float = 0.8
    """Fraction of the nominal bandwidths that NCCL point-to-point transfers reach."""
    latency_s: float = 20e-6
    """Fixed cost per message (launch + rendezvous), charged to both of its ends."""
    quantize_gbps: float = 128.0
    """Trainer-side FP8 blockwise quantization on one GPU, in GB/s of bf16 input (not scaled by
    ``efficiency``: a measured rate): this project's H100 measurement, an 8192x8192 bf16 weight
    in 1.05 ms (``scripts/gpu_check.py``, ``results/gpu_check_h100.json``, BENCHMARKS.md "GPU
    checks"; 143 GB/s on an H200, ``results/gpu_checks_2026-11-28.jsonl``)."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nvlink_gbps", "nic_gbps", "copy_gbps", "efficiency", "quantize_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Cluster.{name} must be positive, got {getattr(self, name)!r}")
        if self.efficiency > 1 or self.latency_s < 0:
            raise ValueError(f"Cluster: efficiency must be in (0, 1] and latency_s >= 0, got "
                             f"{self.efficiency!r}, {self.latency_s!r}")


def nic_floor(gen_bytes_max: int, cluster: Cluster) -> float:
    """Seconds no sending scheme beats on disaggregated GPUs: the busiest gen rank's bytes through its
    own NIC (each gen rank must receive what it holds, from the train ranks' nodes or a peer's)."""
    return gen_bytes_max / (cluster.nic_gbps * cluster.efficiency * GB)


def quantized_bytes(assignment, *, source_itemsize: int = 2) -> list[int]:
    """Bytes of high-precision input each train rank quantizes per refit under trainer-side FP8: every
    FP8 weight piece (its train box) it sends from, once however many gen ranks get it
    (``endpoint.fp8_pieces`` quantizes a piece whole, on first use). ``assignment``: the plan's
    :class:`~megatron_refit.plan.assignment.Assignment`; ``source_itemsize``: the training dtype's."""
    out = [0] * len(assignment.train_bytes)
    for group in assignment.groups:
        if group.dtype != FP8:
            continue
        live = [(i, box_numel(box) * source_itemsize, turns) for i, (box, turns)
                in enumerate(zip(group.train_boxes, group.turns)) if turns]
        for senders in group.senders:
            for i, nbytes, turns in live:
                for sender in senders[i][:turns]:  # a parameter's turns of box i: senders[i][t % len]
                    out[sender] += nbytes
    return out


def quantize_busy(quantized: list[int], train_gpu: list[int], gen_gpu: list[int], cluster: Cluster, *,
                  bucket_bytes: int) -> dict[int, float]:
    """Seconds each GPU spends on trainer-side FP8 besides its links (the module docstring's model):
    a train rank's ``quantized`` bytes at ``quantize_gbps``; every gen rank the first bucket's
    (``bucket_bytes`` of FP8 from twice as many bf16 bytes, at most the largest train rank's)."""
    rate = cluster.quantize_gbps * GB
    busy: dict[int, float] = defaultdict(float)
    for rank, nbytes in enumerate(quantized):
        busy[train_gpu[rank]] += nbytes / rate
    fill = min(2 * bucket_bytes, max(quantized, default=0)) / rate
    for gpu in gen_gpu:
        busy[gpu] += fill
    return dict(busy)


def mask_bytes(words: int) -> int:
    """A delta's bitmask: one bit per word, padded to a multiple of 8 bytes (the values after
    it stay aligned for any word size)."""
    return -(-words // 64) * 8


def encoding_sizes(words: int, changed: float, word: int) -> tuple[float, float, float]:
    """Bytes of a bucket of ``words`` words (``word`` bytes each) sent raw, as the changed
    words' int32 indices + values, or as a bitmask (padded to 8 bytes) + values
    (:mod:`megatron_refit.endpoint.delta` sends the smallest)."""
    return words * word, changed * (4 + word), mask_bytes(words) + changed * word


def delta_fraction(density: float, word: int = 2) -> float:
    """Bytes of a delta refit as a fraction of a full one when ``density`` of the words
    (``word`` bytes each: 2 for bf16) changed, for large buckets."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"delta density must be in [0, 1], got {density!r}")
    words = 1 << 30
    raw, *delta = encoding_sizes(words, density * words, word)
    return min(raw, *delta) / raw


def delta_prediction(route_bytes: dict[tuple[int, int], int], train_gpu: list[int], gen_gpu: list[int],
                     cluster: Cluster, *, bucket_bytes: int, density: float, word: int = 2) -> Prediction:
    """:func:`predict` for a delta refit at ``density``: every route's bytes scaled by
    :func:`delta_fraction`, plus each GPU's compare / apply pass over its full bytes at
    device-copy bandwidth (the sender reads the new bytes and its copy; the receiver writes
    the changed words in place)."""
    fraction = delta_fraction(density, word)
    scaled = {route: math.ceil(nbytes * fraction) for route, nbytes in route_bytes.items()}
    base = predict(scaled, train_gpu, gen_gpu, cluster, bucket_bytes=bucket_bytes)
    full: dict[int, int] = defaultdict(int)
    for (src, dst), nbytes in route_bytes.items():
        full[train_gpu[src]] += 2 * nbytes  # new bytes and the copy, read
        full[gen_gpu[dst]] += math.ceil(nbytes * fraction)
    per_gpu = {gpu: base.per_gpu.get(gpu, 0.0) + full[gpu] / (cluster.copy_gbps * cluster.efficiency * GB)
               for gpu in set(base.per_gpu) | set(full)}
    slowest = max(per_gpu, key=per_gpu.get)
    return Prediction(seconds=per_gpu[slowest], bottleneck=f"{base.bottleneck}; compare pass on GPU {slowest}",
                      per_gpu=per_gpu)


def swap_pause(gen_bytes: int, cluster: Cluster, *, copy: bool = True) -> float:
    """Seconds a staged refit (``refit.swap: staged``) pauses generation on a generation rank
    holding ``gen_bytes``: a device copy from staging into the engine's parameters (vLLM,
    whose parameters must stay put), or nothing measurable for a pointer swap (``copy=False``).
    An in-place refit pauses for its whole transfer instead."""
    return gen_bytes / (cluster.copy_gbps * cluster.efficiency * GB) if copy else 0.0


def staged_pause(gen_bytes: int, transfer_s: float, cluster: Cluster, *, engine: str,
                 budget_bytes: int | None) -> tuple[float, str]:
    """Seconds a staged refit pauses generation on a generation rank holding ``gen_bytes`` under
    ``refit.swap_budget_mb`` (``budget_bytes``; None: no bound), and how. vLLM holds its
    staging buffers and the prepared shadow (about two copies): a version that does not fit
    is not prepared and loads under the pause (at least a device copy: vLLM's reload is not
    modelled). The HF engine shadows what fits and writes the rest in place under the pause,
    from the first unshadowed tensor on: that share of the transfer. Otherwise the swap."""
    if budget_bytes is not None and engine == "vllm" and 2 * gen_bytes > budget_bytes:
        return swap_pause(gen_bytes, cluster), "not prepared: vLLM loads the version under the pause, at least"
    if budget_bytes is not None and engine != "vllm" and gen_bytes > budget_bytes:
        return transfer_s * (1 - budget_bytes / gen_bytes), "the transfer of what the budget does not shadow"
    return swap_pause(gen_bytes, cluster), "staging -> parameters, device copy"


def overlap_stall(train_bytes: int, cluster: Cluster) -> float:
    """``refit.overlap: on``: the training-step stall per refit of a train rank that sends
    ``train_bytes``: its snapshot, one device copy of those bytes (the send runs behind the next
    step). With ``overlap: off`` the stall is the whole refit."""
    return train_bytes / (cluster.copy_gbps * cluster.efficiency * GB)


def placement(num_train: int, num_gen: int, mode: str, gpus_per_node: int) -> tuple[list[int], list[int]]:
    """Cluster GPU of each train rank and of each gen rank.

    ``disaggregated``: train ranks on GPUs ``0..T-1``, gen ranks on the next whole node
    onwards (no node shared). ``colocated``: gen rank ``i`` on train rank ``i``'s GPU.
    """
    if mode == "disaggregated":
        first_gen = math.ceil(num_train / gpus_per_node) * gpus_per_node
        return list(range(num_train)), [first_gen + i for i in range(num_gen)]
    if mode == "colocated":
        if num_train != num_gen:
            raise ValueError(f"colocated placement needs as many gen ranks as train ranks, "
                             f"got {num_gen} and {num_train}")
        return list(range(num_train)), list(range(num_gen))
    raise ValueError(f"unknown placement mode {mode!r}; expected 'disaggregated' or 'colocated'")


@dataclass(frozen=True, slots=True)
class Prediction:
    seconds: float
    """Predicted refit seconds (the slowest GPU)."""
    bottleneck: str
    """The load that sets ``seconds``, e.g. ``"nic in of gen rank 3 (GPU 19, node 2)"``."""
    per_gpu: dict[int, float]
    """Predicted seconds of each GPU."""


def predict(
    route_bytes: dict[tuple[int, int], int],
    train_gpu: list[int],
    gen_gpu: list[int],
    cluster: Cluster,
    *,
    bucket_bytes: int,
    relays: dict[tuple[int, int], int] | None = None,
    busy: dict[int, float] | None = None,
) -> Prediction:
    """Refit seconds for ``route_bytes[(train rank, gen rank)]`` placed on ``train_gpu`` / ``gen_gpu``,
    and ``relays[(gen rank, gen rank)]`` forwarded between replicas (fan-out,
    :mod:`megatron_refit.plan.fanout`; their pipeline fill is :func:`fanout_prediction`'s);
    ``busy``: seconds a GPU spends besides its links, added to its time (:func:`quantize_busy`).

    A route's bytes travel in ``ceil(bytes / bucket_bytes)`` messages: what the endpoint sends
    on NCCL with its default ``direct_bytes`` (one bucket; see
    :func:`megatron_refit.endpoint.direct.resolve_direct_bytes`), where transfers smaller than a
    bucket are packed together.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    loads: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    messages: dict[int, int] = defaultdict(int)
    gpu_routes = [((train_gpu[src], gen_gpu[dst]), nbytes) for (src, dst), nbytes in route_bytes.items()]
    gpu_routes += [((gen_gpu[src], gen_gpu[dst]), nbytes) for (src, dst), nbytes in (relays or {}).items()]
    for (a, b), nbytes in gpu_routes:
        if nbytes == 0:
            continue
        if a == b:
            loads[a]["device copy"] += nbytes
        elif a // cluster.gpus_per_node == b // cluster.gpus_per_node:
            loads[a]["nvlink out"] += nbytes
            loads[b]["nvlink in"] += nbytes
        else:
            loads[a]["nic out"] += nbytes
            loads[b]["nic in"] += nbytes
        count = -(-nbytes // bucket_bytes)
        messages[a] += count
        messages[b] += count if a != b else 0
    bandwidth = {
        "nic out": cluster.nic_gbps, "nic in": cluster.nic_gbps,
        "nvlink out": cluster.nvlink_gbps, "nvlink in": cluster.nvlink_gbps,
        "device copy": cluster.copy_gbps,
    }
    per_gpu: dict[int, float] = {}
    worst = (0.0, "nothing to send")
    busy = busy or {}
    for gpu in sorted(set(loads) | set(messages)):
        link, seconds = max(((link, nbytes / (bandwidth[link] * cluster.efficiency * GB))
                             for link, nbytes in loads[gpu].items()), key=lambda item: item[1], default=("", 0.0))
        total = seconds + messages[gpu] * cluster.latency_s + busy.get(gpu, 0.0)
        per_gpu[gpu] = total
        if total > worst[0]:
            what = _describe(gpu, train_gpu, gen_gpu, cluster.gpus_per_node)
            worst = (total, f"{link} of {what}: {loads[gpu][link] / GB:.2f} GB, {messages[gpu]} messages"
                     + (f", + {busy[gpu]:.3f} s of trainer-side FP8 quantization" if busy.get(gpu) else ""))
    return Prediction(seconds=worst[0], bottleneck=worst[1], per_gpu=per_gpu)


def fanout_prediction(routes, train_gpu: list[int], gen_gpu: list[int], cluster: Cluster, *,
                      bucket_bytes: int) -> Prediction:
    """:func:`predict` for a refit under fan-out (``routes``: a
    :class:`~megatron_refit.plan.fanout.FanoutRoutes`): the train ranks' routes to the first
    replica and every relay, in parallel on their links, plus the pipeline's fill: each hop
    forwards a bucket once it has it (store and forward), so the farthest replica starts
    ``depth`` buckets' transfer times after the first."""
    base = predict(routes.from_trainers, train_gpu, gen_gpu, cluster, bucket_bytes=bucket_bytes,
                   relays=routes.relays)
    if not routes.relays:
        return base
    crosses = any(gen_gpu[a] // cluster.gpus_per_node != gen_gpu[b] // cluster.gpus_per_node for a, b in routes.relays)
    link = cluster.nic_gbps if crosses else cluster.nvlink_gbps
    bucket = min(bucket_bytes, max(routes.relays.values()))
    fill = routes.depth * (bucket / (link * cluster.efficiency * GB) + cluster.latency_s)
    return Prediction(seconds=base.seconds + fill,
                      bottleneck=f"{base.bottleneck}; then {routes.depth} hop(s) of pipeline fill ({fill:.3f} s)",
                      per_gpu=base.per_gpu)


def _describe(gpu: int, train_gpu: list[int], gen_gpu: list[int], gpus_per_node: int) -> str:
    roles = [f"train rank {train_gpu.index(gpu)}"] if gpu in train_gpu else []
    roles += [f"gen rank {gen_gpu.index(gpu)}"] if gpu in gen_gpu else []
    return f"{' / '.join(roles)} (GPU {gpu}, node {gpu // gpus_per_node})"
