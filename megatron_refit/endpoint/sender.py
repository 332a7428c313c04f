"""The train side of a refit, ``Refitter``; the generation side, ``Receiver``, is in
:mod:`megatron_refit.endpoint.receiver`.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_refit.config import ON_REPLICA_FAILURE
from megatron_refit.endpoint.base import DIGEST_TAG, Endpoint, delta_tag
from megatron_refit.endpoint.bytes import pack_bucket
from megatron_refit.endpoint.delta import DeltaSender, word_size
from megatron_refit.endpoint.finite import check_finite
from megatron_refit.endpoint.integrity import chunk_sums
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.errors import ReplicaFailedError
from megatron_refit.plan.checks import ITEMSIZE
from megatron_refit.plan.spec import ShardSpec
from megatron_refit.transport import Transport



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


def _release(piece) -> None:
    release = getattr(piece, "release", None)
    if release is not None:
        release()


class Refitter(Endpoint):
    """Train side. ``pieces``: this rank's local shards (objects with ``spec``, ``tensor()``)."""

    role = "train"

    def __init__(self, group: Transport, pieces: list[HasPiece], *, num_train: int, num_gen: int,
                 bucket_bytes: int = 64 << 20, verify: str = "sampled", direct_bytes: int | str | None = "auto",
                 offloader=None, on_report: Callable[[dict], None] | None = None, check_finite: bool = False,
                 delta: str = "off", replica_size: int | None = None, on_replica_failure: str = "raise",
                 plans: dict | None = None):
        super().__init__(group, num_train=num_train, num_gen=num_gen, bucket_bytes=bucket_bytes, verify=verify,
                         direct_bytes=direct_bytes, on_report=on_report, delta=delta, replica_size=replica_size,
                         plans=plans)
        if on_replica_failure not in ON_REPLICA_FAILURE:
            raise ValueError(f"refit.on_replica_failure: {on_replica_failure!r} is not one of "
                             f"{list(ON_REPLICA_FAILURE)}")
        self.on_replica_failure = on_replica_failure
        """``raise``: a refit that an engine replica could not apply raises
        :class:`~megatron_refit.errors.ReplicaFailedError` (after the other replicas landed it);
        ``continue``: it returns, its report naming the failed replicas (``failed_replicas``),
        unless no replica landed it."""
        self._delta = DeltaSender(delta)
        """The copies of what this rank last sent, for delta refits (``refit.delta``)."""
        self.check_finite = check_finite
        """Before a refit, every piece is read for NaN / Inf; one found ends the refit on
        every rank before any byte moves (:class:`~megatron_refit.endpoint.finite.NonFiniteWeightsError` here,
        :class:`~megatron_refit.endpoint.base.RefitAbortedError` on the others)."""
        self.offloader = offloader
        """Optional :class:`~megatron_refit.endpoint.offload.ParamOffloader`: offloaded parameters are
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

    def _delta_base(self) -> int:
        return self._delta.base

    def forget_delta_base(self) -> None:
        """The next refit sends every byte, never a delta (its receiver may not hold what it wrote)."""
        self._delta.base = -1

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
            _, delta_to = self._agree_on_version(version, preflight if self.check_finite else None)
        except BaseException:
            for piece in self.pieces.values():
                _release(piece)
            if was_offloaded and not self.offloader.offloaded:
                self.offloader.offload()
            raise
        report = RefitReport(version=version, role="train", rank=self.group.rank,
                             bytes_minimal=self.plan.bytes_minimal, delta=bool(delta_to))
        report.seconds["onload"] = onload_s + self._onload()
        cache: dict[str, torch.Tensor] = {}
        buckets = self.plan.buckets_from(self.group.rank)
        report.bytes_full = sum(b.payload_bytes for b in buckets)
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

        sums: dict[int, list] = {}  # receiver -> chunk sums of its buckets in plan order
        digesters = self._pair_digesters(buckets, self.plan.global_dst) if self.verify != "off" else {}
        left = Counter(self.plan.global_dst(b) for b in buckets)  # buckets still to post, per receiver
        digest_sends: list = []

        def check(bucket, data: torch.Tensor) -> None:
            # after the send is posted: the digest pass overlaps the transfer; a receiver's
            # digests follow its last bucket at once (no wait for the sends to complete)
            if self.verify == "off":
                return
            t0 = time.perf_counter()
            dst = self.plan.global_dst(bucket)
            sums.setdefault(dst, []).append(chunk_sums(data, self.verify))
            left[dst] -= 1
            if not left[dst]:
                values = digesters[dst](sums[dst], version)
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
            # a piece's last bucket has left: drop copies made for it (QKV split, FP8 quantization)
            for item in bucket.items:
                name = item.transfer.name
                if last_use.get(name) == bucket.index:
                    cache.pop(name, None)
                    _release(self.pieces[name])

        try:
            with torch.no_grad():
                if self._delta.keeps_copies:  # compare with (and keep) a copy of every bucket, send what changed
                    self._delta.base = -1  # the copies change now: no delta from them unless this refit completes
                    post = self._delta_post(get_src, delta_to, check, report, digest_sends)
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
        # every byte left every train rank: the copies are this version's, a base for every
        # receiver that applied it (one that failed shows no base and gets a full refit)
        self._delta.finish(version, ok=not any(rank < self.num_train for rank in failed),
                           bytes_full=report.summary["refit/bytes_full"],
                           was_delta=bool(delta_to), seconds=report.summary["refit/total_s"],
                           rank_bytes=report.bytes_full)
        self._emit(report)
        landed = report.summary["refit/replicas_ok"]
        if failed and (self.on_replica_failure == "raise" or not landed):
            held = f"the other {landed} replica(s) hold version {version}" if landed else "no replica holds it"
            why = "; ".join(report.failed_replicas.values())
            raise ReplicaFailedError(f"refit {version}: engine replica(s) {sorted(report.failed_replicas)} could not "
                                     f"apply it: {why}; they are stale until the next refit; {held}", report=report)
        return report


    def _delta_post(self, get_src, delta_to: set[int], check, report: RefitReport, sends: list):
        """The bucket loop's post under ``refit.delta``: the bucket's full bytes compared with
        (and kept for the next refit as) the copy of the last; in a delta refit a small header
        (encoding, size) precedes each bucket, so the receiver posts exactly that size while
        this rank encodes the next bucket."""
        scratch: list[torch.Tensor] = []

        def post(bucket, buf):
            t0 = time.perf_counter()
            data = self._direct_view(bucket, get_src, "src")
            if data is None:
                if not scratch or scratch[0].numel() < bucket.nbytes:
                    scratch[:] = [torch.empty(bucket.nbytes, dtype=torch.uint8, device=buf.device)]
                data = scratch[0][: bucket.nbytes].zero_()  # padding too: the receiver rebuilds it as zeros
                pack_bucket(bucket, get_src, out=data)
            word = word_size(bucket.nbytes, (ITEMSIZE[item.transfer.dtype] for item in bucket.items))
            key = (bucket.dst_rank, bucket.index)
            dst = self.plan.global_dst(bucket)
            encoding, payload, changed = self._delta.encode(key, data, word, dst in delta_to)
            report.seconds["pack"] += time.perf_counter() - t0
            report.words += bucket.nbytes // word
            report.words_changed += changed
            data = self._delta.previous[key] if payload is None else payload
            if dst in delta_to:  # waited for with the digests
                header = torch.tensor([encoding, data.numel()], dtype=torch.int64)
                sends.append(self.group.send_small(header, dst, delta_tag(bucket.index)))
            report.bytes_sent += bucket.payload_bytes if payload is None else data.numel()
            report.bytes_wire += data.numel()
            alone = not self.group.shares_buffers and data.device == self.group.device
            self._route(report, alone)
            if not alone:
                data = buf[: data.numel()].copy_(data)
            pending = self.group.isend(data, dst, bucket.index)
            pending.direct = alone
            check(bucket, self._delta.previous[key])
            return pending
        return post


