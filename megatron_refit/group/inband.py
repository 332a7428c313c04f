"""The serving probe in band (``refit.verify_serving`` with an engine that has no control plane
of its own, e.g. the HF engine), after a refit every rank applied: train rank 0 sends each engine
rank the probe, each engine rank answers it (:func:`exchange_in_band`), then train rank 0 tells
each its verdict (:func:`verdict_in_band`). Point-to-point messages over the replica's refit
group between train rank 0 and the engine ranks alone: the other train ranks take no part (they
sent their bytes; the verdict is train rank 0's). Each message is a size, then that many bytes of
:mod:`megatron_refit.wire` (JSON); every wait is bounded by the group's ``timeout_s`` (a peer that
dies or stalls breaks the group, as in a refit)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_refit import wire
from megatron_refit.plan.probe import Probe

PROBE_TAG = 3 << 29
"""Message tags of the exchange (each a size, then its bytes under the next tag): above every
bucket, delta header and digest tag of a refit (``DELTA_TAG`` ``1 << 29``, ``DIGEST_TAG`` ``1 << 30``)."""
ANSWER_TAG = PROBE_TAG + 2
VERDICT_TAG = PROBE_TAG + 4


def exchange_in_band(group, num_train: int, *, probe: Probe | None = None,
                     score: Callable[[tuple], Any] | None = None, stale: Callable[[], list[str]] | None = None) -> Any:
    """Train rank 0 (with the ``probe``) and every engine rank (with its ``score``, or None where
    its storage cannot score, and its ``stale``: the parameters it no longer holds as they arrived,
    ``Receiver.stale_live``) after a refit they applied; other train ranks do not call it.
    Returns, on train rank 0, what the first engine rank answered: its log-probs,
    ``{"unable": why}`` or ``{"error": why}``; where an engine rank holds a stale parameter,
    ``{"served": that answer, "stale": [names]}``. An engine rank returns its own answer."""
    engines = range(num_train, group.world_size)
    if group.rank == 0:
        _send(group, [list(s) for s in probe.sequences], engines, PROBE_TAG)
        rows = [_receive(group, rank, ANSWER_TAG) for rank in engines]
        names = sorted({name for row in rows for name in row[1]})
        return {"served": rows[0][0], "stale": names} if names else rows[0][0]
    if group.rank < num_train:
        raise ValueError(f"exchange_in_band on train rank {group.rank}: train rank 0 alone asks the engine ranks")
    sequences = tuple(tuple(s) for s in _receive(group, 0, PROBE_TAG))
    if score is None:
        answer = {"unable": "its storage has no score method"}
    else:
        try:
            answer = score(sequences)
        except Exception as exc:  # noqa: BLE001 -- the train ranks learn why this replica could not score
            answer = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    try:
        row = [answer, stale() if stale is not None else []]
    except Exception as exc:  # noqa: BLE001 -- reading its weights back failed: it cannot vouch for them
        row = [{"error": f"reading its weights back: {type(exc).__name__}: {exc}"[:500]}, []]
    _send(group, row, [0], ANSWER_TAG)
    return row[0]


def verdict_in_band(group, num_train: int, *, failed: str | None = None) -> str | None:
    """After :func:`exchange_in_band`, train rank 0 tells every engine rank its verdict
    (``failed``: why the replica does not serve the trainer's model; None: it passed): an engine
    rank told it holds its weights (:meth:`~megatron_refit.endpoint.storage.WeightsState.hold`).
    Returns it on train rank 0 and on every engine rank (other train ranks do not call it)."""
    if group.rank == 0:
        _send(group, failed, range(num_train, group.world_size), VERDICT_TAG)
        return failed
    if group.rank < num_train:
        raise ValueError(f"verdict_in_band on train rank {group.rank}: train rank 0 alone tells the engine ranks")
    return _receive(group, 0, VERDICT_TAG)


def _send(group, obj, peers, tag: int) -> None:
    """``obj`` to each of ``peers``: its size, then its bytes; returns once every send completed."""
    blob = wire.dumps(obj)
    size = torch.tensor([len(blob)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    pending = [p for peer in peers for p in (group.send_small(size, peer, tag), group.send_small(body, peer, tag + 1))]
    for p in pending:
        group.wait(p)


def _receive(group, peer: int, tag: int):
    """What ``peer`` sent under ``tag`` with :func:`_send`."""
    size = group.recv_small(torch.zeros(1, dtype=torch.int64), peer, tag)
    group.wait(size)
    body = group.recv_small(torch.zeros(int(size.buffer.cpu()[0]), dtype=torch.uint8), peer, tag + 1)
    group.wait(body)
    return wire.loads(body.buffer.cpu().numpy().tobytes())
