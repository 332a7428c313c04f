"""Refits that overlap the next training step (``refit.overlap: on``).

At the step boundary a train rank copies the bytes it sends into a snapshot (:class:`Snapshot`:
a device-side copy of each piece this rank sends from, taken in the training loop's own
thread and stream, the optimizer's fp32 main params never among them) and returns to the
training loop; a background thread (:class:`BackgroundRefit`) then sends from the snapshot
while the next forward/backward changes the live weights. Each version lands exactly as the
weights were at the step it was taken. At most one refit is in flight per train rank: a refit
that would start while the last one still moves waits for it (``refit.overlap_busy: wait``)
or, on every train rank alike, is skipped and counted (``skip``). A refit that failed in the
background raises at the next refit call or :meth:`BackgroundRefit.collect` (the next step
boundary), its version named in a note; :meth:`BackgroundRefit.close` waits for the refit in
flight (each of its waits is bounded by ``refit.timeout_s``) before the groups close.

On a GPU the snapshot is a device-to-device copy on the training stream, and the background
send runs on a CUDA stream of its own that waits for that copy only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from megatron_refit.config import OVERLAP_BUSY
from megatron_refit.plan.spec import ShardSpec


@dataclass
class SnapshotPiece:
    """A piece as it was at the last snapshot (what the refit in flight sends from). Its buffer
    is its own, so it declares no ``follows``: a run of pieces adjacent in the live weights is
    not adjacent here, and each piece leaves as a message of its own."""

    spec: ShardSpec
    data: torch.Tensor | None = None
    optional: str | None = None
    """As the live piece's (a snapshot stands for it in the plan)."""
    follows = None
    """Its buffer is its own: it follows no piece."""

    def release(self) -> None:
        """Nothing to drop: the buffer is kept for the next snapshot."""

    def tensor(self) -> torch.Tensor:
        if self.data is None:
            raise RuntimeError(f"refit.overlap: {self.spec.name} is not in this refit's snapshot (this rank sends "
                               f"none of its bytes in any plan it had when the snapshot was taken)")
        return self.data


class Snapshot:
    """This rank's pieces as of the last :meth:`take`: ``pieces`` stand for ``live`` in the
    refit endpoints; their buffers are allocated once (the first take) and reused."""

    def __init__(self, live: list):
        self.live = {p.spec.name: p for p in live}
        self.pieces = [SnapshotPiece(p.spec, optional=p.optional) for p in live]
        self._by_name = {p.spec.name: p for p in self.pieces}
        self.ready: torch.cuda.Event | None = None
        """On a GPU: recorded on the training stream after the copies (the sender waits for it)."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the snapshot buffers (the memory overlap costs)."""
        return sum(p.data.numel() * p.data.element_size() for p in self.pieces if p.data is not None)

    def take(self, names: set[str]) -> float:
        """Copy the live pieces ``names`` (those this rank sends from) into the snapshot; the
        others' buffers are freed. Returns the seconds it took."""
        unknown = sorted(names - set(self._by_name))
        if unknown:
            raise ValueError(f"refit.overlap: no local piece named {unknown[:3]} to snapshot")
        t0 = time.perf_counter()
        dsts, srcs, releases = [], [], []
        with torch.no_grad():
            for name, piece in self._by_name.items():
                if name not in names:
                    piece.data = None
                    continue
                live = self.live[name]
                src = live.tensor().detach()
                if piece.data is None or piece.data.shape != src.shape or piece.data.dtype != src.dtype \
                        or piece.data.device != src.device:
                    piece.data = torch.empty(src.shape, dtype=src.dtype, device=src.device)
                dsts.append(piece.data)
                srcs.append(src)
                releases.append(live.release)
            if dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=True)  # one call (device: one launch per group)
        for release in releases:  # copies tensor() made (a QKV split): after the copy that read them
            release()
        self.ready = None
        if any(p.data is not None and p.data.is_cuda for p in self.pieces):
            self.ready = torch.cuda.Event()
            self.ready.record()
        return time.perf_counter() - t0


def sent_pieces(members, full: bool) -> set[str]:
    """The snapshot pieces that the next refit of ``members`` (a fleet's
    :class:`~megatron_refit.fleet.member.TrainerMember` per replica), called with ``full``,
    sends from on this rank, in every member's plan."""
    names = set()
    for member in members:
        endpoint = member.endpoint(full)
        for bucket in endpoint.plan.buckets_from(endpoint.group.rank):
            for item in bucket.items:
                piece = endpoint.pieces[item.transfer.name]
                while not isinstance(piece, SnapshotPiece):  # a wrapper: FP8 quantization
                    piece = piece.source.piece
                names.add(piece.spec.name)
    return names


def check_busy(busy: str) -> None:
    if busy not in OVERLAP_BUSY:
        raise ValueError(f"refit.overlap_busy: {busy!r} is not one of {list(OVERLAP_BUSY)}")


class BackgroundRefit:
    """At most one refit of this train rank in flight, in the fleet runner's ``background`` lane
    (see the module docstring). ``skip_group``: the train ranks' **skip group** (``exchange``),
    used under ``busy="skip"`` so that every train rank skips the same refits."""

    LANE = "background"

    def __init__(self, snapshot: Snapshot, runner, *, busy: str = "wait", skip_group=None):
        check_busy(busy)
        if busy == "skip" and skip_group is None:
            raise ValueError("refit.overlap_busy: skip needs the train ranks' skip group")
        self.snapshot = snapshot
        self.busy = busy
        self.skip_group = skip_group
        self.runner = runner
        """The fleet's :class:`~megatron_refit.fleet.runner.Runner` (the fleet owns it and joins its
        lanes on close): the background refits run in its lane."""
        self._future: Future | None = None
        self._version: int | None = None
        self._finished: list = []
        self.skipped: list[int] = []
        """Versions skipped because the last refit was still moving (``busy: skip``)."""
        self.waited_s = 0.0
        """Seconds the training loop waited for a refit in flight (``busy: wait``), in all."""
        self.last_report = None
        """The report of the last refit that finished."""

    @property
    def in_flight(self) -> int | None:
        """The version being sent, if one is."""
        return self._version if self._future is not None and not self._future.done() else None

    def start(self, version: int, prepare: Callable[[], set[str]], run: Callable[[], object],
              *, busy: str | None = None) -> bool:
        """Start refit ``version``: wait for (or skip behind) the one in flight, then
        ``prepare()`` (collective over the train ranks, in this thread: the names of the pieces
        to snapshot), snapshot, and ``run()`` in the background. False: skipped."""
        busy = busy or self.busy
        if busy == "skip":
            moving = self.in_flight is not None
            if any(row[0] for row in self.skip_group.exchange("overlap", [int(moving)])):
                self.skipped.append(version)
                self._reap()
                return False
        t0 = time.perf_counter()
        self._join()
        self.waited_s += time.perf_counter() - t0
        self._reap()  # the last one's error, if it failed, is raised here (named)
        self.snapshot.take(prepare())
        ready = self.snapshot.ready

        def body():
            if ready is None:
                return run()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                result = run()
                stream.synchronize()
            return result

        self._version = version
        self._future = self.runner.submit(self.LANE, body)
        return True

    def _join(self, timeout_s: float | None = None) -> bool:
        if self._future is None:
            return True
        done, _ = wait([self._future], timeout=timeout_s)
        return bool(done)

    def _reap(self) -> None:
        """Take the finished refit's outcome; raise its error, its version named."""
        if self._future is None or not self._future.done():
            return
        future, version = self._future, self._version
        self._future = self._version = None
        error = future.exception()
        if error is not None:
            error.add_note(f"refit.overlap: refit {version} failed in the background (taken at its step "
                           f"boundary); raised at the next refit call or step boundary")
            raise error
        self.last_report = future.result()
        self._finished.append(self.last_report)

    def collect(self) -> list:
        """The reports of the refits that finished since the last call (in order); raises the
        error of one that failed. Never waits."""
        self._reap()
        out, self._finished = self._finished, []
        return out

    def wait(self, timeout_s: float | None = None):
        """Wait for the refit in flight; its report (None if there was none), or its error."""
        if not self._join(timeout_s):
            raise TimeoutError(f"refit.overlap: refit {self._version} still in flight after {timeout_s:g} s")
        had = self._future is not None
        self._reap()
        return self.last_report if had else None

    def close(self, timeout_s: float | None = None) -> None:
        """Shutdown: wait for the refit in flight (``timeout_s``: at most that long; its own
        waits are bounded by ``refit.timeout_s``); its report stays for :meth:`collect`."""
        try:
            self.wait(timeout_s)
        finally:
            if self.skip_group is not None and not self.in_flight:
                self.skip_group.close()
                self.skip_group = None
