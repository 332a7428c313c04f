"""Refit driver: ``Refitter`` on train ranks, ``Receiver`` on generation ranks.

``prepare()`` (once): every rank contributes its pieces (train: the HF-named local shards
it holds; generation: the pieces its engine needs), all build the same plan from the
gathered specs, validate it, and agree on its fingerprint — any error is raised here,
before a single weight byte moves. ``refit(version)`` / ``receive(version)`` (every step):
the ranks agree on the version, then each sender packs its buckets straight from its
local pieces and each receiver unpacks straight into engine storage, at most two buckets
in flight per rank.

Buckets are processed in the plan's global order by every rank; with a bounded window
this cannot deadlock (the globally first unfinished bucket is always posted at both ends).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .buckets import contiguous_bytes, pack_bucket, unpack_bucket
from .checksum import TRAILER_BYTES, trailer_ok, write_trailer
from .plan import RefitPlan
from .report import RefitReport
from .spec import ShardSpec
from .transport import RefitGroup


class HasPiece(Protocol):
    """A trainer's local piece: ``conversion.local_shards.LocalShard`` satisfies it. An
    optional ``release()`` is called after every refit to drop copies ``tensor()`` made."""

    spec: ShardSpec

    def tensor(self) -> torch.Tensor: ...


@dataclass
class TensorPiece:
    """A piece held as a plain tensor shaped like ``spec.box`` (trainers without
    Megatron-Bridge, tests, benchmarks). ``data`` may be swapped between refits."""

    spec: ShardSpec
    data: torch.Tensor

    def tensor(self) -> torch.Tensor:
        return self.data


class RefitCorruptionError(ValueError):
    """``verify`` found buckets whose bytes changed in flight (names the parameters)."""


class StaleWeightsError(RuntimeError):
    """The engine's weights are not those of a complete refit."""


logger = logging.getLogger("megatron_refit")

STATES = ("stale", "updating", "ready")
MAX_DIRECT_IN_FLIGHT = 16


class ReceiverBackend(Protocol):
    """What a generation engine provides to :class:`Receiver`."""

    def target_specs(self) -> list[ShardSpec]:
        """The pieces of HF tensors this generation rank holds (HF names, global boxes)."""

    def buffer(self, name: str) -> torch.Tensor:
        """Engine storage for the piece ``name``, shaped like its box (written in place)."""

    def finalize(self) -> None:
        """Post-load step, once all pieces of a refit are in."""

    # Optional: ``set_state(state: str, version: int | None)`` is called on every state
    # change (``stale`` → ``updating`` → ``ready``, or back to ``stale`` on failure), so the
    # engine can refuse to serve half-updated weights.


class _Endpoint:
    role: str

    def __init__(self, group: RefitGroup, *, num_train: int, num_gen: int, bucket_bytes: int, verify: bool,
                 direct_bytes: int | None, on_report: Callable[[dict], None] | None = None):
        if group.world_size != num_train + num_gen:
            raise ValueError(
                f"refit group has {group.world_size} ranks but num_train={num_train} + num_gen={num_gen} "
                f"= {num_train + num_gen}"
            )
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.group = group
        self.on_report = on_report
        """Called with each refit's metrics dict (e.g. to forward them to wandb or TensorBoard)."""
        self.num_train = num_train
        self.num_gen = num_gen
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        if not getattr(group, "direct_ok", True):
            direct_bytes = None  # nothing goes direct (colocated): fill whole buckets, fewer handshakes
        self.direct_bytes = direct_bytes
        self.plan: RefitPlan | None = None
        self.version: int | None = None

    def _local_specs(self) -> list[ShardSpec]:
        raise NotImplementedError

    def prepare(self) -> RefitPlan:
        mine = (self.role, self._local_specs(), self.verify, self.bucket_bytes, self.direct_bytes)
        gathered = self.group.all_gather_object(mine)
        roles = [g[0] for g in gathered]
        expected = ["train"] * self.num_train + ["gen"] * self.num_gen
        if roles != expected:
            raise ValueError(f"refit ranks disagree on roles: got {roles}, expected {expected}")
        for what, index in (("verify", 2), ("bucket_bytes", 3), ("direct_bytes", 4)):
            values = [g[index] for g in gathered]
            if len(set(values)) != 1:
                raise ValueError(f"refit ranks disagree on {what}: {values} (by refit rank)")
        train_specs = {i: g[1] for i, g in enumerate(gathered[: self.num_train])}
        gen_specs = {i: g[1] for i, g in enumerate(gathered[self.num_train:])}
        plan = RefitPlan.build(
            train_specs,
            gen_specs,
            bucket_bytes=self.bucket_bytes,
            direct_bytes=self.direct_bytes,
            train_rank_ids=list(range(self.num_train)),
            gen_rank_ids=list(range(self.num_train, self.num_train + self.num_gen)),
        )
        if plan.unused_train_params:
            names = sorted(plan.unused_train_params)
            raise ValueError(
                f"the trainer produces {len(names)} HF parameters that no generation rank holds "
                f"(the receiver does not know them), e.g. {names[:5]}"
            )
        fingerprint = bytes.fromhex(plan.fingerprint())
        prints = self.group.all_gather_object(fingerprint)
        if any(p != fingerprint for p in prints):
            bad = [r for r, p in enumerate(prints) if p != fingerprint]
            raise ValueError(f"refit plan fingerprint mismatch on refit ranks {bad}: ranks built different plans")
        self.plan = plan
        return plan

    def _agree_on_version(self, version: int) -> None:
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if self.plan is None:
            raise RuntimeError("call prepare() before the first refit")
        if self.version is not None and version <= self.version:
            raise ValueError(f"refit version {version} does not advance past {self.version}")
        versions = self.group.all_gather_tensor(torch.tensor([version], dtype=torch.int64))
        if any(int(v) != version for v in versions):
            raise ValueError(f"refit ranks disagree on the version: {[int(v) for v in versions]}")

    def _emit(self, report: RefitReport) -> None:
        """One structured log line per refit and rank, and the optional callback."""
        metrics = report.as_dict()
        logger.info("refit %s", json.dumps(metrics, sort_keys=True))
        if self.on_report is not None:
            self.on_report(metrics)

    def _route(self, report: RefitReport, direct: bool) -> None:
        route = "direct" if direct else ("shared" if hasattr(self.group, "staging") else "packed")
        report.routes[route] += 1

    def _run(self, buckets, post: Callable, retire: Callable, report: RefitReport) -> None:
        """Post buckets in order and retire them in the same order (FIFO). At most two
        packed buckets are in flight (they occupy the two staging buffers); direct buckets
        use no staging memory and may have up to ``MAX_DIRECT_IN_FLIGHT`` outstanding."""
        width = max((b.nbytes for b in buckets), default=0) + (TRAILER_BYTES if self.verify else 0)
        count = min(2, len(buckets))
        staging = getattr(self.group, "staging", None)  # colocated: buffers the peers map
        slots = staging(count, width) if staging is not None else [
            torch.empty(width, dtype=torch.uint8, device=self.group.device) for _ in range(count)]
        free = list(range(len(slots)))
        in_flight: deque = deque()
        direct_in_flight = 0

        def retire_oldest():
            nonlocal direct_in_flight
            bucket, pending, slot = in_flight.popleft()
            self._retire((bucket, pending), retire, report)
            if slot is None:
                direct_in_flight -= 1
            else:
                free.append(slot)

        for bucket in buckets:
            while not free or direct_in_flight >= MAX_DIRECT_IN_FLIGHT:
                retire_oldest()
            slot = free.pop(0)
            wire = bucket.nbytes + (TRAILER_BYTES if self.verify else 0)
            pending = post(bucket, slots[slot][:wire])
            if pending.direct:
                free.insert(0, slot)
                slot = None
                direct_in_flight += 1
            in_flight.append((bucket, pending, slot))
        while in_flight:
            retire_oldest()

    def _retire(self, item, retire, report) -> None:
        bucket, pending = item
        start = time.perf_counter()
        self.group.wait(pending)
        report.seconds["transfer"] += time.perf_counter() - start
        retire(bucket, pending)
        release = getattr(self.group, "release", None)  # colocated: hand the shared buffer back
        if release is not None:
            release(pending)

    def _direct_view(self, bucket, get: Callable[[str], torch.Tensor], side: str) -> torch.Tensor | None:
        """The one item's tensor slice as flat bytes, when the bucket can skip packing."""
        if self.verify or len(bucket.items) != 1 or not getattr(self.group, "direct_ok", True):
            return None
        transfer = bucket.items[0].transfer
        return contiguous_bytes(get(transfer.name), transfer.src_box if side == "src" else transfer.dst_box)


def _release(piece) -> None:
    release = getattr(piece, "release", None)
    if release is not None:
        release()


class Refitter(_Endpoint):
    """Train side. ``pieces``: this rank's local shards (objects with ``spec``, ``tensor()``)."""

    role = "train"

    def __init__(self, group: RefitGroup, pieces: list[HasPiece], *, num_train: int, num_gen: int,
                 bucket_bytes: int = 64 << 20, verify: bool = False, direct_bytes: int | None = 1 << 20,
                 offloader=None, on_report: Callable[[dict], None] | None = None):
        super().__init__(group, num_train=num_train, num_gen=num_gen, bucket_bytes=bucket_bytes, verify=verify,
                         direct_bytes=direct_bytes, on_report=on_report)
        self.offloader = offloader
        """Optional :class:`~megatron_refit.offload.ParamOffloader`: offloaded parameters are
        loaded for the refit and offloaded again after it."""
        if group.rank >= num_train:
            raise ValueError(f"refit rank {group.rank} is a generation rank (num_train={num_train})")
        self.pieces = {p.spec.name: p for p in pieces}
        if len(self.pieces) != len(pieces):
            raise ValueError("duplicate HF names among this rank's pieces")

    def _local_specs(self) -> list[ShardSpec]:
        return [p.spec for p in self.pieces.values()]

    def refit(self, version: int) -> RefitReport:
        self._agree_on_version(version)
        start = time.perf_counter()
        report = RefitReport(version=version, role="train", rank=self.group.rank,
                             bytes_minimal=self.plan.bytes_minimal)
        was_offloaded = self.offloader is not None and self.offloader.offloaded
        if was_offloaded:
            t0 = time.perf_counter()
            self.offloader.onload()
            report.seconds["onload"] = time.perf_counter() - t0
        cache: dict[str, torch.Tensor] = {}
        buckets = self.plan.buckets_from(self.group.rank)
        last_use = {item.transfer.name: bucket.index for bucket in buckets for item in bucket.items}

        def get_src(name: str) -> torch.Tensor:
            if name not in cache:
                tensor = self.pieces[name].tensor().detach()
                spec = self.pieces[name].spec
                if tuple(tensor.shape) != spec.shape or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
                    raise ValueError(f"{name}: the local piece is {tuple(tensor.shape)} {tensor.dtype}, its spec says "
                                     f"{spec.shape} {spec.dtype}")
                cache[name] = tensor
            return cache[name]

        def post(bucket, buf):
            report.bytes_sent += bucket.payload_bytes
            direct = self._direct_view(bucket, get_src, "src")
            self._route(report, direct is not None)
            if direct is not None:  # straight from the local tensor
                report.bytes_wire += bucket.nbytes
                pending = self.group.isend(direct, self.plan.global_dst(bucket), bucket.index)
                pending.direct = True
                return pending
            t0 = time.perf_counter()
            pack_bucket(bucket, get_src, out=buf[: bucket.nbytes])
            if self.verify:
                write_trailer(buf, bucket.nbytes)
            report.seconds["pack"] += time.perf_counter() - t0
            report.bytes_wire += buf.numel()
            return self.group.isend(buf, self.plan.global_dst(bucket), bucket.index)

        def retire(bucket, pending) -> None:
            # a piece's last bucket has left: drop copies made for it (QKV split, FP8 quantisation)
            for item in bucket.items:
                name = item.transfer.name
                if last_use.get(name) == bucket.index:
                    cache.pop(name, None)
                    _release(self.pieces[name])

        try:
            with torch.no_grad():
                self._run(buckets, post, retire, report)
        finally:
            cache.clear()
            for piece in self.pieces.values():  # also pieces of a failed refit or never sent
                _release(piece)
            if was_offloaded:  # leave the parameters where the training loop had them
                t0 = time.perf_counter()
                self.offloader.offload()
                report.seconds["offload"] = time.perf_counter() - t0
        self.version = version
        report.seconds["total"] = time.perf_counter() - start
        self._emit(report)
        return report


class Receiver(_Endpoint):
    """Generation side: receives this rank's pieces into ``backend`` storage."""

    role = "gen"

    def __init__(self, group: RefitGroup, backend: ReceiverBackend, *, num_train: int, num_gen: int,
                 bucket_bytes: int = 64 << 20, verify: bool = False, direct_bytes: int | None = 1 << 20,
                 on_report: Callable[[dict], None] | None = None):
        super().__init__(group, num_train=num_train, num_gen=num_gen, bucket_bytes=bucket_bytes, verify=verify,
                         direct_bytes=direct_bytes, on_report=on_report)
        if group.rank < num_train:
            raise ValueError(f"refit rank {group.rank} is a train rank (num_train={num_train})")
        self.backend = backend
        self.gen_index = group.rank - num_train
        self.state = "stale"
        self.weights_version: int | None = None
        """Version of the last complete refit (None before the first)."""
        self._set_state("stale")

    def _set_state(self, state: str) -> None:
        assert state in STATES
        self.state = state
        hook = getattr(self.backend, "set_state", None)
        if hook is not None:
            hook(state, self.weights_version)

    def _local_specs(self) -> list[ShardSpec]:
        return list(self.backend.target_specs())

    def receive(self, version: int) -> RefitReport:
        """Receive refit ``version``. On any failure the weights are marked ``stale`` (the
        engine must not serve them) and the error propagates; the next complete refit
        restores ``ready``."""
        self._agree_on_version(version)
        self._set_state("updating")
        try:
            report = self._receive(version)
        except BaseException:
            self._set_state("stale")
            raise
        self.weights_version = version
        self._set_state("ready")
        self._emit(report)
        return report

    def _receive(self, version: int) -> RefitReport:
        start = time.perf_counter()
        report = RefitReport(version=version, role="gen", rank=self.group.rank,
                             bytes_minimal=self.plan.bytes_minimal)
        corrupted: list = []

        def post(bucket, buf):
            direct = self._direct_view(bucket, self.backend.buffer, "dst")
            self._route(report, direct is not None)
            if direct is not None:  # straight into engine storage
                pending = self.group.irecv(direct, self.plan.global_src(bucket), bucket.index)
                pending.direct = True
                return pending
            return self.group.irecv(buf, self.plan.global_src(bucket), bucket.index)

        def retire(bucket, pending):
            buf = pending.buffer
            report.bytes_received += bucket.payload_bytes
            report.bytes_wire += buf.numel()
            if pending.direct:
                return
            if self.verify and not trailer_ok(buf, bucket.nbytes):
                corrupted.append(bucket)  # keep draining: the senders must not be left waiting
                return
            t0 = time.perf_counter()
            unpack_bucket(bucket, buf, self.backend.buffer)
            report.seconds["load"] += time.perf_counter() - t0

        with torch.no_grad():
            self._run(self.plan.buckets_to(self.gen_index), post, retire, report)
            if corrupted:
                names = sorted({item.transfer.name for b in corrupted for item in b.items})
                sources = sorted({self.plan.global_src(b) for b in corrupted})
                raise RefitCorruptionError(
                    f"refit {version}: checksum mismatch in {len(corrupted)} bucket(s) from refit rank(s) "
                    f"{sources}; parameters {names[:8]}{' ...' if len(names) > 8 else ''}"
                )
            t0 = time.perf_counter()
            self.backend.finalize()
            report.seconds["load"] += time.perf_counter() - t0
        self.version = version
        report.seconds["total"] = time.perf_counter() - start
        return report
