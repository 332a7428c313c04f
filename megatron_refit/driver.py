"""Refit driver: ``Refitter`` on train ranks, ``Receiver`` on generation ranks.

``prepare()`` (once): every rank contributes its pieces (train: the HF-named local shards
it holds; generation: the pieces its engine needs), all build the same plan from the
gathered specs, validate it, and agree on its fingerprint — any error is raised here,
before a single weight byte moves. ``refit(version)`` / ``receive(version)`` (every step):
the ranks agree on the version, then each sender packs its buckets straight from its
local pieces and each receiver unpacks straight into engine storage, at most two buckets
in flight per rank.

Every rank processes its buckets in one global order, (index within its pair, dst, src):
a sender feeds all its receivers at once, a receiver takes from all its senders at once,
and with a bounded window this cannot deadlock (the globally first unfinished bucket is
always posted at both ends).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import torch

from .buckets import pack_bucket, unpack_bucket
from .checksum import chunk_sums, digests
from .endpoint import DIGEST_TAG, Endpoint, RefitAbortedError  # noqa: F401  (re-exported with the other refit errors)
from .finite import check_finite
from .receivers.base import (  # noqa: F401  (re-exported: the receiver protocol and its errors)
    STATES,
    RefitCorruptionError,
    ReceiverBackend,
    RefreshesTargets,
    StaleWeightsError,
    TracksState,
)
from .report import RefitReport
from .spec import ShardSpec
from .transport import Transport


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
    follows: str | None = None
    """Name of the piece whose memory this one starts right after, if any (a hint: pieces
    adjacent on both ends of a transfer can leave as one message)."""

    def tensor(self) -> torch.Tensor:
        return self.data


def adjacent_pieces(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` of contiguous tensors where ``b`` starts in the same storage where
    ``a`` ends."""
    starts, ends = {}, {}
    for name, t in tensors.items():
        if t.is_contiguous() and t.numel():
            storage = t.untyped_storage().data_ptr()
            starts[storage, t.data_ptr()] = name
            ends[name] = (storage, t.data_ptr() + t.numel() * t.element_size())
    return [(a, starts[end]) for a, end in ends.items() if end in starts]


def _release(piece) -> None:
    release = getattr(piece, "release", None)
    if release is not None:
        release()


class Refitter(Endpoint):
    """Train side. ``pieces``: this rank's local shards (objects with ``spec``, ``tensor()``)."""

    role = "train"

    def __init__(self, group: Transport, pieces: list[HasPiece], *, num_train: int, num_gen: int,
                 bucket_bytes: int = 64 << 20, verify: str = "sampled", direct_bytes: int | str | None = "auto",
                 offloader=None, on_report: Callable[[dict], None] | None = None, check_finite: bool = False):
        super().__init__(group, num_train=num_train, num_gen=num_gen, bucket_bytes=bucket_bytes, verify=verify,
                         direct_bytes=direct_bytes, on_report=on_report)
        self.check_finite = check_finite
        """Before a refit, every piece is read for NaN / Inf; one found ends the refit on
        every rank before any byte moves (:class:`~megatron_refit.finite.NonFiniteWeightsError` here,
        :class:`~megatron_refit.endpoint.RefitAbortedError` on the others)."""
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

    def _local_adjacent(self) -> list[tuple[str, str]]:
        # declared by the pieces (``follows``: gate/up of one fused weight, q/k/v of one split)
        return [(p.follows, name) for name, p in self.pieces.items() if getattr(p, "follows", None) in self.pieces]

    def _onload(self) -> float:
        """Load offloaded parameters back (seconds it took; 0 if there was nothing to load)."""
        if self.offloader is None or not self.offloader.offloaded:
            return 0.0
        t0 = time.perf_counter()
        self.offloader.onload()
        return time.perf_counter() - t0

    def refit(self, version: int) -> RefitReport:
        start = time.perf_counter()
        was_offloaded = self.offloader is not None and self.offloader.offloaded
        onload_s = 0.0
        if self.check_finite:
            def preflight():
                nonlocal onload_s
                onload_s = self._onload()
                check_finite(self.pieces, version=version, rank=self.group.rank)
        try:
            self._agree_on_version(version, preflight if self.check_finite else None)
        except BaseException:
            for piece in self.pieces.values():
                _release(piece)
            if was_offloaded and not self.offloader.offloaded:
                self.offloader.offload()
            raise
        report = RefitReport(version=version, role="train", rank=self.group.rank,
                             bytes_minimal=self.plan.bytes_minimal)
        report.seconds["onload"] = onload_s + self._onload()
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

        sums: dict[int, list] = {}  # receiver -> [(seed, chunk sums)] in plan order
        left = Counter(self.plan.global_dst(b) for b in buckets)  # buckets still to post, per receiver
        digest_sends: list = []

        def check(bucket, data: torch.Tensor) -> None:
            # after the send is posted: the digest pass overlaps the transfer; a receiver's
            # digests follow its last bucket at once (no wait for the sends to complete)
            if self.verify == "off":
                return
            t0 = time.perf_counter()
            dst = self.plan.global_dst(bucket)
            sums.setdefault(dst, []).append((self._seed(version, bucket), chunk_sums(data, self.verify)))
            left[dst] -= 1
            if not left[dst]:
                values = digests([s for _, s in sums[dst]], [seed for seed, _ in sums[dst]])
                digest_sends.append(self.group.send_small(values, dst, DIGEST_TAG))
            report.seconds["verify"] += time.perf_counter() - t0

        def post(bucket, buf):
            report.bytes_sent += bucket.payload_bytes
            direct = self._direct_view(bucket, get_src, "src")
            self._route(report, direct is not None)
            report.bytes_wire += bucket.nbytes
            if direct is not None:  # straight from the local tensor
                pending = self.group.isend(direct, self.plan.global_dst(bucket), bucket.index)
                pending.direct = True
                check(bucket, direct)
                return pending
            t0 = time.perf_counter()
            pack_bucket(bucket, get_src, out=buf)
            report.seconds["pack"] += time.perf_counter() - t0
            pending = self.group.isend(buf, self.plan.global_dst(bucket), bucket.index)
            check(bucket, buf)
            return pending

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
                t0 = time.perf_counter()
                for pending in digest_sends:
                    self.group.wait(pending)
                report.seconds["verify"] += time.perf_counter() - t0
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
        failed = self._summarize(report)  # waits for the receivers to apply the refit
        self._emit(report)
        if failed:
            raise RefitAbortedError(f"refit {version}: generation rank(s) {failed} could not apply it (their own "
                                    f"errors say why, e.g. a digest mismatch); they are stale until the next refit")
        return report


class Receiver(Endpoint):
    """Generation side: receives this rank's pieces into ``backend`` storage."""

    role = "gen"

    def __init__(self, group: Transport, backend: ReceiverBackend, *, num_train: int, num_gen: int,
                 bucket_bytes: int = 64 << 20, verify: str = "sampled", direct_bytes: int | str | None = "auto",
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
        self.state = state
        if isinstance(self.backend, TracksState):
            self.backend.set_state(state, self.weights_version)

    def _local_specs(self) -> list[ShardSpec]:
        return list(self.backend.target_specs())

    def _local_adjacent(self) -> list[tuple[str, str]]:
        # from the engine storage's addresses (it stays put between refits)
        return adjacent_pieces({spec.name: self.backend.buffer(spec.name) for spec in self.backend.target_specs()})

    def _refresh_targets(self) -> None:
        if not isinstance(self.backend, RefreshesTargets):
            return
        try:
            self.backend.refresh_targets()
        except BaseException:
            self._set_state("stale")  # the engine's storage is no longer what the last refit wrote
            raise

    def receive(self, version: int) -> RefitReport:
        """Receive refit ``version``. On any failure the weights are marked ``stale`` (the
        engine must not serve them) and the error propagates; the next complete refit
        restores ``ready``."""
        self._agree_on_version(version, self._refresh_targets)
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
        buckets = self.plan.buckets_to(self.gen_index)
        received: dict[int, list] = {}  # sender -> [(bucket, seed, chunk sums)] in plan order
        left = Counter(self.plan.global_src(b) for b in buckets)  # buckets still to come, per sender
        computed: dict[int, torch.Tensor] = {}  # sender -> digests of what arrived
        sent = {}  # sender -> its digest message, posted before the first bucket
        if self.verify != "off":
            sent = {src: self.group.recv_small(torch.zeros(n, dtype=torch.int64), src, DIGEST_TAG)
                    for src, n in left.items()}

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
            if self.verify != "off":  # of the bytes as they arrived (in engine storage when direct)
                t0 = time.perf_counter()
                src = self.plan.global_src(bucket)
                received.setdefault(src, []).append((bucket, self._seed(version, bucket),
                                                     chunk_sums(buf, self.verify)))
                left[src] -= 1
                if not left[src]:
                    items = received[src]
                    computed[src] = digests([s for _, _, s in items], [seed for _, seed, _ in items]).cpu()
                report.seconds["verify"] += time.perf_counter() - t0
            if pending.direct:
                return
            t0 = time.perf_counter()
            unpack_bucket(bucket, buf, self.backend.buffer)
            report.seconds["load"] += time.perf_counter() - t0

        with torch.no_grad():
            self._run(buckets, post, retire, report)
            try:
                self._check_and_finalize(version, sent, computed, received, report)
            except Exception:
                try:  # every byte arrived: the group is intact, tell the trainer this rank failed
                    self._summarize(report, failed=True)
                except Exception:  # noqa: BLE001 -- this rank's own error is the one to raise
                    pass
                raise
        self.version = version
        report.seconds["total"] = time.perf_counter() - start
        self._summarize(report)
        return report

    def _check_and_finalize(self, version: int, sent: dict, computed: dict, received: dict,
                            report: RefitReport) -> None:
        """Compare the digests each sender computed with what arrived, then run the
        engine's post-load step."""
        if self.verify != "off":
            t0 = time.perf_counter()
            corrupted = []
            for src, pending in sent.items():
                self.group.wait(pending)
                mismatch = (computed[src] != pending.buffer.cpu()).nonzero().flatten().tolist()
                corrupted += [received[src][i][0] for i in mismatch]
            report.seconds["verify"] += time.perf_counter() - t0
            if corrupted:
                names = sorted({item.transfer.name for b in corrupted for item in b.items})
                sources = sorted({self.plan.global_src(b) for b in corrupted})
                raise RefitCorruptionError(
                    f"refit {version}: digest mismatch in {len(corrupted)} bucket(s) from refit rank(s) "
                    f"{sources} (bytes changed in flight, or misrouted); parameters "
                    f"{names[:8]}{' ...' if len(names) > 8 else ''}"
                )
        t0 = time.perf_counter()
        self.backend.finalize()
        report.seconds["load"] += time.perf_counter() - t0
