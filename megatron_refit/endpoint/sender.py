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

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_refit.endpoint.base import Endpoint
from megatron_refit.endpoint.delta import delta_tag
from megatron_refit.endpoint.bytes import pack_bucket
from megatron_refit.endpoint.delta import DeltaSender, word_size
from megatron_refit.endpoint.finite import check_finite
from megatron_refit.endpoint.stages import SendDigests, Sources, release
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.plan.checks import ITEMSIZE
from megatron_refit.plan.fanout import DIRECT, Placement
from megatron_refit.plan.spec import ShardSpec
from megatron_refit.transport import Transport



PIECE_MEMBERS = ("spec", "tensor", "release", "follows", "optional")
"""What a piece declares (:class:`HasPiece`): checked by name where the pieces enter."""


class HasPiece(Protocol):
    """A trainer's local piece, as ``conversion.local_shards.LocalShard`` and
    :class:`TensorPiece` declare it: every member below, ``None`` where it does not apply."""

    spec: ShardSpec
    follows: str | None
    """Name of the piece whose memory this one starts right after (a hint: pieces adjacent on
    both ends of a transfer can leave as one message); None where none."""
    optional: str | None
    """Why an engine may not hold this piece (``"mtp"``: skipped by name where no engine rank
    holds it, ``refit/skipped_params``; any other piece no engine holds is refused); None."""

    def tensor(self) -> torch.Tensor: ...

    def release(self) -> None:
        """Drop any copy ``tensor()`` made (called after each refit); nothing where it made none."""


def check_pieces(pieces: list) -> None:
    """``ValueError`` naming the first piece that does not declare every member of :class:`HasPiece`."""
    for piece in pieces:
        missing = [m for m in PIECE_MEMBERS if not hasattr(piece, m)]
        if missing:
            raise ValueError(f"a refit piece of type {type(piece).__name__} does not declare {missing} "
                             f"(every piece declares {list(PIECE_MEMBERS)}: see endpoint.sender.HasPiece)")


@dataclass
class TensorPiece:
    """A piece held as a plain tensor shaped like ``spec.box`` (trainers without
    Megatron-Bridge, tests, benchmarks). ``data`` may be swapped between refits."""

    spec: ShardSpec
    data: torch.Tensor
    follows: str | None = None
    """Name of the piece whose memory this one starts right after, if any (a hint: pieces
    adjacent on both ends of a transfer can leave as one message)."""
    optional: str | None = None
    """Why an engine may not hold this piece (``"mtp"``), if it may not (see :class:`HasPiece`)."""

    def tensor(self) -> torch.Tensor:
        return self.data

    def release(self) -> None:
        """Nothing to drop: ``data`` is the piece."""


class Refitter(Endpoint):
    """Train side. ``pieces``: this rank's local shards (objects with ``spec``, ``tensor()``)."""

    role = "train"

    def __init__(self, group: Transport, pieces: list[HasPiece], *, num_train: int, num_gen: int,
                 bucket_bytes: int = 64 << 20, verify: str = "sampled", direct_bytes: int | str | None = "auto",
                 on_report: Callable[[dict], None] | None = None, check_finite: bool = False,
                 delta: str = "off", replica_size: int | None = None, plans: dict | None = None,
                 stall_s: float = 0.0, draft: bool = False):
        super().__init__(group, num_train=num_train, num_gen=num_gen, bucket_bytes=bucket_bytes, verify=verify,
                         direct_bytes=direct_bytes, on_report=on_report, delta=delta, replica_size=replica_size,
                         plans=plans, stall_s=stall_s)
        self.draft = draft
        """``refit.gen_draft``: the engine's speculative draft holds the MTP layers, so this rank's
        MTP pieces are not optional (every rank's plan refuses them unheld, by name)."""
        self._delta = DeltaSender(delta)
        """The copies of what this rank last sent, for delta refits (``refit.delta``)."""
        self.check_finite = check_finite
        """Before a refit, every piece is read for NaN / Inf; one found ends the refit on
        every rank before any byte moves (:class:`~megatron_refit.endpoint.finite.NonFiniteWeightsError` here,
        :class:`~megatron_refit.endpoint.base.RefitAbortedError` on the others)."""
        if group.rank >= num_train:
            raise ValueError(f"refit rank {group.rank} is a generation rank (num_train={num_train})")
        check_pieces(pieces)
        self.pieces = {p.spec.name: p for p in pieces}
        if len(self.pieces) != len(pieces):
            raise ValueError("duplicate HF names among this rank's pieces")

    def _local_specs(self) -> list[ShardSpec]:
        return [p.spec for p in self.pieces.values()]

    def _local_adjacent(self) -> list[tuple[str, str]]:
        # declared by the pieces (``follows``: gate/up of one fused weight, q/k/v of one split)
        return [(p.follows, name) for name, p in self.pieces.items() if p.follows in self.pieces]

    def _local_optional(self) -> tuple[str, ...]:
        if self.draft:
            return ()
        return tuple(sorted(name for name, p in self.pieces.items() if p.optional))

    def delta_base(self) -> int:
        return self._delta.base

    def forget_delta_base(self) -> None:
        """The next refit sends every byte, never a delta (its receiver may not hold what it wrote)."""
        self._delta.base = -1

    def _replanned(self) -> None:
        self._delta.previous.clear()  # copies of the old plan's buckets: this refit keeps the new ones
        self._delta.base = -1

    def refit(self, version: int, *, probe: bool = False, placement: Placement = DIRECT) -> RefitReport:
        """Send this rank's buckets of refit ``version`` (collective over the group; ``probe``: its
        replica scores the serving probe over the group after it, ``placement``: where its bytes go
        under ``refit.fanout``, both told to the engine ranks in the handshake); the report names the
        ranks that could not apply it (``failed_ranks``): what to make of that is the fleet's
        (``refit.on_replica_failure``)."""
        start = time.perf_counter()
        delta_to = self._handshake(version, (probe, placement))
        if self.placement.relayed:
            return self._refit_relayed(version, start)
        report = RefitReport(version=version, role="train", rank=self.group.rank,
                             bytes_minimal=self.plan.bytes_minimal, delta=bool(delta_to))
        buckets = self.plan.buckets_from(self.group.rank)
        report.bytes_full = sum(b.payload_bytes for b in buckets)
        sources = Sources(self.pieces, buckets)
        digesters = self._pair_digesters(buckets, self.plan.global_dst) if self.verify != "off" else {}
        digests = SendDigests(self.group, digesters, self.verify, version, buckets, self.plan.global_dst, report)
        if self._delta.keeps_copies:  # compare with (and keep) a copy of every bucket, send what changed
            self._delta.base = -1  # the copies change now: no delta from them unless this refit completes
            post = self._delta_post(sources, delta_to, digests, report)
        else:
            post = functools.partial(self._post, sources, digests, report)
        try:
            with torch.no_grad():
                self.run_buckets(buckets, post, lambda bucket, pending: sources.after(bucket), report)
                digests.wait()
        finally:
            sources.release_all()  # also pieces of a failed refit, or never sent
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
        return report

    def _refit_relayed(self, version: int, start: float) -> RefitReport:
        """``refit.fanout``, a replica whose bytes a relay forwards: this rank sends nothing unless
        the relay failed on one of its engine ranks, which then tells (``fanout``) how many of this
        rank's buckets it holds and whether it has the digests; the rest goes now (raw), with this
        rank's digests of all its buckets to it (those the relay carried recomputed here: a
        bucket packs to the same bytes every time). The copies kept for deltas are not this
        replica's (the chain's head holds them): its next direct refit is a full one."""
        report = RefitReport(version=version, role="train", rank=self.group.rank, bytes_minimal=self.plan.bytes_minimal)
        held = self.group.all_gather_object(None, "fanout")[self.num_train:]
        buckets = self.plan.buckets_from(self.group.rank)
        report.bytes_full = sum(b.payload_bytes for b in buckets)
        need = {self.num_train + k for k, h in enumerate(held) if not h["digests"]}
        seen: dict[int, int] = {}
        resend, carried = [], []
        for bucket in buckets:
            dst = self.plan.global_dst(bucket)
            place, seen[dst] = seen.get(dst, 0), seen.get(dst, 0) + 1
            if place >= held[dst - self.num_train]["done"][self.group.rank]:
                resend.append(bucket)
            elif dst in need:
                carried.append(bucket)
        if resend or carried:
            sources = Sources(self.pieces, buckets)
            digesters = self._pair_digesters(buckets, self.plan.global_dst) if self.verify != "off" else {}
            digests = SendDigests(self.group, digesters, self.verify, version,
                                  [b for b in buckets if self.plan.global_dst(b) in need], self.plan.global_dst, report)
            try:
                with torch.no_grad():
                    scratch = None
                    for bucket in carried:  # the digest pass over what the relay carried
                        data = self._direct_view(bucket, sources, "src")
                        if data is None:
                            if scratch is None or scratch.numel() < bucket.nbytes:
                                scratch = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.group.device)
                            data = pack_bucket(bucket, sources, out=scratch)
                        digests.add(bucket, data)
                    self.run_buckets(resend, functools.partial(self._post, sources, digests, report),
                              lambda bucket, pending: None, report)
                    digests.wait()
            finally:
                sources.release_all()
        self.version = version
        report.seconds["total"] = time.perf_counter() - start
        self._summarize(report)
        self.forget_delta_base()
        self._emit(report)
        return report

    def _handshake(self, version: int, told: tuple[bool, Placement]) -> set[int]:
        """The version handshake (with the NaN / Inf preflight under ``check_finite``): the peers
        this refit sends deltas to. Pieces read by the preflight are released if it fails."""
        preflight = None
        if self.check_finite:
            def preflight():
                check_finite(self.pieces, version=version, rank=self.group.rank)
        try:
            return self._agree_on_version(version, preflight, told)[1]
        except BaseException:
            for piece in self.pieces.values():
                release(piece)
            raise

    def _post(self, sources: Sources, digests: SendDigests, report: RefitReport, bucket, buf):
        """Post one bucket: straight from the local tensor where it is one contiguous run, else
        packed into ``buf``; its digest pass follows the post (and overlaps the transfer)."""
        report.bytes_sent += bucket.payload_bytes
        report.bytes_wire += bucket.nbytes
        direct = self._direct_view(bucket, sources, "src")
        self.count_path(report, direct is not None)
        if direct is None:
            t0 = time.perf_counter()
            pack_bucket(bucket, sources, out=buf)
            report.seconds["pack"] += time.perf_counter() - t0
        pending = self.group.isend(buf if direct is None else direct, self.plan.global_dst(bucket), bucket.index)
        pending.direct = direct is not None
        digests.add(bucket, buf if direct is None else direct)
        return pending

    def _delta_post(self, sources: Sources, delta_to: set[int], digests: SendDigests, report: RefitReport):
        """The bucket loop's post under ``refit.delta``: the bucket's full bytes compared with
        (and kept for the next refit as) the copy of the last; in a delta refit a small header
        (encoding, size) precedes each bucket, so the receiver posts exactly that size while
        this rank encodes the next bucket."""
        scratch: list[torch.Tensor] = []

        def post(bucket, buf):
            t0 = time.perf_counter()
            data = self._direct_view(bucket, sources, "src")
            if data is None:
                if not scratch or scratch[0].numel() < bucket.nbytes:
                    scratch[:] = [torch.empty(bucket.nbytes, dtype=torch.uint8, device=buf.device)]
                data = scratch[0][: bucket.nbytes].zero_()  # padding too: the receiver rebuilds it as zeros
                pack_bucket(bucket, sources, out=data)
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
                digests.sends.append(self.group.send_small(header, dst, delta_tag(bucket.index)))
            report.bytes_sent += bucket.payload_bytes if payload is None else data.numel()
            report.bytes_wire += data.numel()
            alone = not self.group.shares_buffers and data.device == self.group.device
            self.count_path(report, alone)
            if not alone:
                data = buf[: data.numel()].copy_(data)
            pending = self.group.isend(data, dst, bucket.index)
            pending.direct = alone
            digests.add(bucket, self._delta.previous[key])
            return pending
        return post


