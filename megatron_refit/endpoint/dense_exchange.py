"""``refit.gen_dense_forward: node`` on an engine rank: once its own rows of the dense shards
arrived, it passes them to the other members of its node group and takes theirs
(:class:`~megatron_refit.plan.dense_forward.DenseForward`), over the refit group's own links.

Deadlock-free on links that match sends and receives in order (NCCL's streams): the pairs of a
node group go in one order, ``(i, j)`` by their members' positions, and each rank takes its pairs
in that order, the lower member sending first (each direction's transfers posted at once). Each
transfer is one forwarded piece's rows (a view into the engine's storage where contiguous, a copy
otherwise); after them each side sends a digest
of what it sent (:func:`~megatron_refit.endpoint.integrity.position_sums`, summed on the device;
none under ``refit.verify: off``) and whether its own refit went well: a member whose bytes did not
all arrive, or rows that changed on the way, fail the receiving rank with a
:class:`~megatron_refit.errors.RefitCorruptionError` naming the peer.
Every member takes part whatever its own outcome, so no peer waits for rows that never come (each
wait is bounded by the group's timeout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit.endpoint.integrity import position_sums
from megatron_refit.endpoint.stages import DIGEST_TAG
from megatron_refit.errors import RefitCorruptionError
from megatron_refit.plan.dense_forward import DenseForward

def exchange(group, num_train: int, forward: DenseForward, buffer: Callable[[str], torch.Tensor], *,
             ok: bool, check: bool = True) -> int:
    """This engine rank's part of its node group's exchange (``buffer(name)``: the piece's whole
    view in the engine's storage; ``ok``: this rank's own bytes all arrived and checked; ``check``:
    digest the rows, as ``refit.verify`` other than ``off``). Returns the bytes it received from its
    peers; raises :class:`RefitCorruptionError` naming the first peer whose rows cannot be trusted,
    after every pair is done."""
    names = sorted(forward.rows)
    me = forward.group[forward.position]
    received, failure = 0, None  # the first peer whose rows cannot be trusted, and why
    for peer in forward.peers():
        if me < peer:  # the lower member sends first, the higher receives first
            _send(group, num_train + peer, names, forward, buffer, ok, check)
        nbytes, why = _receive(group, num_train + peer, names, forward, forward.group.index(peer), buffer, check)
        if me > peer:
            _send(group, num_train + peer, names, forward, buffer, ok, check)
        received += nbytes
        if why is not None and failure is None:
            failure = peer, why
    if failure is not None:
        raise RefitCorruptionError(f"engine rank {me}: the dense rows forwarded by its node-group peer, engine rank "
                                   f"{failure[0]}, {failure[1]}")
    return received


def _rows(forward: DenseForward, name: str, position: int, buffer: Callable[[str], torch.Tensor]) -> torch.Tensor:
    start, stop = forward.rows[name][position]
    return buffer(name)[start:stop]


def _send(group, peer: int, names: list[str], forward: DenseForward, buffer, ok: bool, check: bool) -> None:
    """This rank's rows of every forwarded piece to ``peer``, posted at once, then the digest."""
    total = torch.zeros(1, dtype=torch.int64, device=group.device)  # summed on the device: one sync per peer
    pending = []
    for index, name in enumerate(names):
        view = _rows(forward, name, forward.position, buffer)
        if view.numel():
            flat = view.contiguous().reshape(-1).view(torch.uint8)  # a copy only where the rows are strided
            pending.append(group.isend(flat, peer, index))
            if check:
                total += position_sums(flat).sum().to(total.device)
    for sent in pending:
        group.wait(sent)
    group.wait(group.send_small(torch.cat([torch.tensor([int(ok)], dtype=torch.int64), total.cpu()]), peer,
                                DIGEST_TAG))


def _receive(group, peer: int, names: list[str], forward: DenseForward, position: int,
             buffer, check: bool) -> tuple[int, str | None]:
    """``peer``'s rows (its ``position`` in the group) of every forwarded piece, posted at once, into
    this rank's storage; ``(bytes, why they cannot be trusted or None)`` once its digest arrived."""
    posted = []
    for index, name in enumerate(names):
        view = _rows(forward, name, position, buffer)
        if view.numel():
            target = view.reshape(-1).view(torch.uint8) if view.is_contiguous() else torch.empty(
                view.numel() * view.element_size(), dtype=torch.uint8, device=view.device)
            posted.append((view, target, group.irecv(target, peer, index)))
    total = torch.zeros(1, dtype=torch.int64, device=group.device)
    nbytes = 0
    for view, target, pending in posted:
        group.wait(pending)
        if not view.is_contiguous():
            view.copy_(target.view(view.dtype).view(view.shape))
        if check:
            total += position_sums(target).sum().to(total.device)
        nbytes += target.numel()
    digest = group.recv_small(torch.zeros(2, dtype=torch.int64), peer, DIGEST_TAG)
    group.wait(digest)
    shown_ok, shown = digest.buffer.cpu().tolist()
    if not shown_ok:
        return nbytes, "are not this version's: its own refit failed before it forwarded them"
    if check and shown != int(total.cpu()):
        return nbytes, f"changed on the way (digest {shown} sent, {int(total.cpu())} received)"
    return nbytes, None
