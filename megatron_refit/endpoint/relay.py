"""Replica fan-out on an engine rank (``refit.fanout``): its links to the same TP rank of other
replicas, a relay's forwarding stage, and the upstream link as a relayed rank's receive loop sees it.

A replica's :class:`~megatron_refit.plan.fanout.Placement` comes in its version handshake. Engine rank
``k`` of a relay forwards each bucket of its part as it arrived (a delta payload as it is) with its
``(encoding, size)`` header to rank ``k`` of every successor, while its next bucket arrives
(:class:`Forwarder`: a bucket in a receive slot is copied into one of two forward buffers, so the
slot takes the next bucket at once; one received into engine memory leaves from there), then the
train ranks' digests of its buckets. A relayed rank reads them through :class:`UpstreamView` with
the same receive loop, stages and checks as from the train ranks (the same digests: a bucket's seed
names the train rank, this TP rank's place in its group and the plan, which every replica of the
layout shares), so every hop checks the train ranks' digests against what it holds.

Failure: a forward that fails, or does not complete within the link's bound, aborts that link
(the successor's waits on it fail at once) and the relay goes on with its own refit, which never
waits on a successor longer than that bound. A relayed rank whose upstream fails (the relay died,
stalled, or aborted the link) aborts the link too and tells the train ranks of its group what it
holds; they send it the rest (:meth:`~megatron_refit.endpoint.sender.Refitter.refit`). A bucket
whose digest differs (corrupted on a link) is taken again the same way, from the train rank's
first bad bucket on. Links live for one placement epoch (the train ranks' count of placement
changes): a link is joined once per epoch and never rejoined under its name.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import torch

from megatron_refit.endpoint.delta import DELTA_TAG
from megatron_refit.endpoint.stages import DIGEST_TAG
from megatron_refit.errors import RefitTransportError
from megatron_refit.transport.base import Pending, Transport

logger = logging.getLogger(__name__)

LINK_NAMESPACE = "megatron_refit/relay"


def link_name(epoch: int, up: int, down: int, tp_rank: int) -> str:
    """The store namespace of the link from replica ``up`` to ``down`` at TP rank ``tp_rank``."""
    return f"{LINK_NAMESPACE}/{epoch}/{up}-{down}/{tp_rank}"


def positions(buckets, src_of: Callable) -> dict[tuple[int, int], int]:
    """(sending refit rank, bucket index) -> the bucket's place in this rank's receive order: the
    tag it travels under on a relay link (buckets of different train ranks share indices)."""
    return {(src_of(b), b.index): i for i, b in enumerate(buckets)}


class RelayLinks:
    """An engine rank's links to TP rank ``tp_rank`` of other replicas (rank 0 of a link: the
    upstream replica's). ``connect(name, rank)`` joins one (a 2-rank group in the train ranks'
    store under ``name``). Every link of an epoch goes when a placement of another epoch comes."""

    def __init__(self, connect: Callable[[str, int], Transport], *, replica: int, tp_rank: int):
        self.join = connect
        """How a link is joined (a benchmark wraps it to throttle the links)."""
        self.replica, self.tp_rank = replica, tp_rank
        self.epoch: int | None = None
        self._links: dict[tuple[int, int], Transport | None] = {}

    def link(self, epoch: int, up: int, down: int) -> Transport:
        """The link from replica ``up`` to ``down`` (one of them this one) in placement epoch ``epoch``:
        joined at its first use in the epoch (waiting up to the link's bound for the other end);
        ``RefitTransportError`` if it broke or failed to join earlier in the epoch."""
        if self.replica not in (up, down) or up == down:
            raise ValueError(f"relay link {up} -> {down} does not start or end at replica {self.replica}")
        if epoch != self.epoch:
            self.close()
            self.epoch = epoch
        key = (up, down)
        if key in self._links:
            link = self._links[key]
            if link is None or link.broken is not None:
                raise RefitTransportError(f"relay link replica {up} -> {down} (TP rank {self.tp_rank}) broke earlier "
                                          f"in placement epoch {epoch}")
            return link
        self._links[key] = None  # one join per name: a failed one is not retried in this epoch
        link = self.join(link_name(epoch, up, down, self.tp_rank), 0 if up == self.replica else 1)
        self._links[key] = link
        return link

    def drop(self, link: Transport, reason: str) -> None:
        """``link`` failed: aborted (its other end's waits fail now), unusable for the epoch."""
        link.abort(reason)
        for key, held in self._links.items():
            if held is link:
                self._links[key] = None

    def close(self) -> None:
        for link in self._links.values():
            if link is not None:
                link.close()
        self._links.clear()


class UpstreamView:
    """The upstream relay link as a relayed rank's receive loop sees its refit group: a bucket,
    delta header or digest message from train rank ``src`` comes from the relay (the link's rank
    0) under the bucket's place in this rank's order (:func:`positions`)."""

    shares_buffers = False

    def __init__(self, link: Transport, places: dict[tuple[int, int], int]):
        self.link, self.places = link, places
        self.device, self.direct_ok, self.timeout_s = link.device, link.direct_ok, link.timeout_s

    def _tag(self, src: int, tag: int) -> int:
        if tag >= DIGEST_TAG:
            return DIGEST_TAG + src
        if tag >= DELTA_TAG:
            return DELTA_TAG + self.places[src, tag - DELTA_TAG]
        return self.places[src, tag]

    def irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending:
        return self.link.irecv(buffer, 0, self._tag(peer, tag))

    def recv_small(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        return self.link.recv_small(tensor, 0, self._tag(peer, tag))

    def wait(self, pending: Pending) -> None:
        self.link.wait(pending)

    def release(self, pending: Pending) -> None:
        pass


class Forwarder:
    """A relay's forwarding stage for one refit: ``links`` (successor replica -> link, rank 1 its
    end) each get every bucket this rank receives, in its order, then the digests. A bucket that
    landed in engine memory (a direct receive, stable until the refit ends) leaves from there; one
    in a receive slot is copied into one of :data:`POOL` forward buffers first, so the slot takes
    the next bucket at once and the relay's receive never waits on its successors while a buffer
    is free (a relay holds at most ``POOL`` buckets more). A link that fails is dropped (``drop(link,
    reason)``: aborted) and the others go on; nothing here raises into the relay's own refit."""

    POOL = 2
    """Forward buffers of a relay (each as large as its largest bucket)."""
    MAX_IN_FLIGHT = 16
    """Buckets whose forwards may be outstanding at once (those sent from engine memory included)."""

    def __init__(self, links: dict[int, Transport], places: dict[tuple[int, int], int], drop: Callable, report,
                 *, replica: int, tp_rank: int):
        self.links, self.places, self._drop, self.report = dict(links), places, drop, report
        self.replica, self.tp_rank = replica, tp_rank
        self.dropped: dict[int, str] = {}
        self._queue: deque = deque()
        """Per bucket in flight: (its forward buffer or None, [(successor, pending)])."""
        self._free: list[torch.Tensor] = []
        self._buffers = 0

    def _fail(self, successor: int, exc: BaseException) -> None:
        link = self.links.pop(successor, None)
        if link is None:
            return
        why = f"{type(exc).__name__}: {exc}"[:300]
        self.dropped[successor] = why
        logger.warning("refit: replica %d TP rank %d stops forwarding to replica %d: %s", self.replica, self.tp_rank,
                       successor, why)
        try:
            self._drop(link, f"relay to replica {successor} failed")
        except Exception:  # noqa: BLE001 -- the link is gone either way
            logger.debug("aborting the relay link failed", exc_info=True)

    def bucket(self, src: int, bucket, encoding: int, data: torch.Tensor, *, stable: bool) -> None:
        """Post ``bucket`` (from train rank ``src``; ``data``: its bytes as they arrived; ``stable``:
        in engine memory, unchanged until the refit ends) to every successor."""
        if not self.links:
            return
        held = None
        if not stable:  # a receive slot: copied out, the slot is free again when this returns
            held = self._buffer(data.numel(), data.device)
            data = held[: data.numel()].copy_(data)
        place, sent = self.places[src, bucket.index], []
        for successor, link in list(self.links.items()):
            try:
                header = torch.tensor([encoding, data.numel()], dtype=torch.int64)
                sent.append((successor, link.send_small(header, 1, DELTA_TAG + place)))
                sent.append((successor, link.isend(data, 1, place)))
                self.report.bytes_relayed += data.numel()
            except Exception as exc:  # noqa: BLE001 -- that successor's trouble, not this replica's
                self._fail(successor, exc)
        self._queue.append((held, sent))
        while len(self._queue) > self.MAX_IN_FLIGHT:
            self._retire()

    def _buffer(self, nbytes: int, device) -> torch.Tensor:
        """A free forward buffer of at least ``nbytes`` (waiting for the oldest forwards if all are busy)."""
        while not self._free and self._buffers >= self.POOL and self._queue:
            self._retire()
        if self._free and self._free[-1].numel() >= nbytes:
            return self._free.pop()
        if self._free:
            self._free.pop()  # too small for this bucket: replaced
        else:
            self._buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _retire(self) -> None:
        held, sent = self._queue.popleft()
        for successor, pending in sent:
            link = self.links.get(successor)
            if link is None:
                continue
            try:
                link.wait(pending)
            except Exception as exc:  # noqa: BLE001
                self._fail(successor, exc)
        if held is not None:
            self._free.append(held)

    def wait(self) -> None:
        """Every forward posted has left (or its link was dropped)."""
        while self._queue:
            self._retire()

    def digests(self, values: dict[int, torch.Tensor]) -> None:
        """The train ranks' digests of this rank's buckets (``src`` -> int64 digests), forwarded
        as they came, then every forward waited for."""
        sent = []
        for src, digests in sorted(values.items()):
            for successor, link in list(self.links.items()):
                try:
                    sent.append((successor, link.send_small(digests, 1, DIGEST_TAG + src)))
                except Exception as exc:  # noqa: BLE001
                    self._fail(successor, exc)
        self._queue.append((None, sent))
        self.wait()

    def abort(self, reason: str) -> None:
        """This relay's own refit failed: its successors stop waiting for it now."""
        for successor in list(self.links):
            self._fail(successor, RefitTransportError(reason))


class DeltaNotApplicableError(Exception):
    """A relayed rank cannot apply what its relay forwards (a delta on a version it does not hold)."""


def forwarder(rx, placement, buckets, report) -> Forwarder:
    """A relay's forwarding stage to ``placement``'s successors, each link joined now (a successor that
    cannot be joined is dropped: it gets its bytes from the train ranks). ``rx``: the relay's
    :class:`~megatron_refit.endpoint.receiver.Receiver`."""
    relay = _links(rx, "route replicas through this engine rank")
    links = {}
    for successor in placement.successors:
        try:
            links[successor] = relay.link(placement.epoch, relay.replica, successor)
        except RefitTransportError as exc:
            logger.warning("refit: replica %d TP rank %d cannot relay to replica %d: %s", relay.replica,
                           relay.tp_rank, successor, exc)
    return Forwarder(links, positions(buckets, rx.plan.global_src), relay.drop, report, replica=relay.replica,
                     tp_rank=relay.tp_rank)


def _links(rx, what: str) -> RelayLinks:
    if rx.relay is None:
        raise ValueError(f"refit.fanout: the train ranks {what}, but it has no relay links (an engine rank built "
                         "without engine_refit?)")
    return rx.relay


def receive_relayed(rx, placement, buckets, run, report) -> None:
    """A relayed rank's part of a refit (``rx``: its Receiver; ``run``: its receive loop): every
    bucket from its upstream relay, then the train ranks' digests, compared here. Whatever it does
    not hold then (the relay failed; its delta payloads do not apply to this rank's weights; a
    bucket's digest differs: corrupted on the way) comes from the train ranks, who learn in one
    collective of the group (``fanout``) how many of each train rank's buckets it holds."""
    relay = _links(rx, "route this engine rank through a relay")
    src_of = rx.plan.global_src
    link, complete, keep = None, False, None
    run.use(None, set(), chain_base=placement.chain_base)
    try:
        link = relay.link(placement.epoch, placement.upstream, relay.replica)
        view = UpstreamView(link, positions(buckets, src_of))
        run.use(view, {src_of(b) for b in buckets}, chain_base=placement.chain_base)
        rx.run_buckets(buckets, run.post, run.retire, report, group=view, direct_window=run.window)
        run.digests.post(view)
        run.digests.wait_sent()
        complete = True
    except (RefitTransportError, DeltaNotApplicableError) as exc:
        logger.warning("refit %d: replica %d TP rank %d: relay from replica %d ended after %d of %d buckets (%s); "
                       "the train ranks send the rest", run.version, relay.replica, relay.tp_rank, placement.upstream,
                       run.retired, len(buckets), exc)
        if link is not None:
            relay.drop(link, f"replica {relay.replica} stopped taking the relay")
    done = run.done_by_src(rx.num_train)
    if complete and rx.verify != "off" and not run.drain.draining:
        run.digests.flush()
        keep = run.digests.first_mismatch()  # bytes the relay carried corrupted: taken again, from the first bad one
        if keep:
            logger.warning("refit %d: replica %d TP rank %d: the relay's buckets from train rank(s) %s differ from the "
                           "train ranks' digests; the train ranks send them again", run.version, relay.replica,
                           relay.tp_rank, sorted(keep))
            complete = False
            done = [keep.get(src, count) for src, count in enumerate(done)]
    rx.group.all_gather_object(dict(done=done, digests=complete), "fanout")
    if complete:
        return
    report.relay_fallback = True
    if keep:  # its successors had the same bytes and take them again themselves
        run.forwarding = False
        run.digests.rewind(keep)
    seen: dict[int, int] = {}
    rest = []
    for bucket in buckets:
        src = src_of(bucket)
        place, seen[src] = seen.get(src, 0), seen.get(src, 0) + 1
        if place >= done[src]:
            rest.append(bucket)
    run.use(rx.group, set(), chain_base=-1)
    if rx.verify != "off":
        run.digests.post(rx.group)
    rx.run_buckets(rest, run.post, run.retire, report, direct_window=run.window)
