"""Transfers and their packing into buckets: byte offsets and splits (pure)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from megatron_refit.plan.spec import Box, box_numel, box_shape

ALIGN = 16
"""Byte alignment of items in a bucket: a uint8 slice can be viewed as any dtype up to 16 bytes."""


class Transfer(NamedTuple):
    """One box of one parameter, from a train rank's piece to a gen rank's piece (a named
    tuple: a rank's plan holds tens of thousands, built in a loop)."""

    name: str
    src_rank: int
    """Trainer-local rank index."""
    dst_rank: int
    """Gen-local rank index."""
    src_box: Box
    """The box in the coordinates of the sender's local piece."""
    dst_box: Box
    """The box in the coordinates of the receiver's local piece."""
    global_box: Box
    dtype: str
    nbytes: int


class BucketItem(NamedTuple):
    transfer: Transfer
    offset: int
    """Byte offset in the bucket, a multiple of :data:`ALIGN`."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """Transfers from one train rank to one gen rank, packed into one flat byte buffer.

    ``nbytes`` is at most the plan's ``bucket_bytes``, except for a bucket holding a single
    row of a transfer that alone is larger (see :func:`_pack`).
    """

    src_rank: int
    dst_rank: int
    index: int
    """Position among the buckets of this route (src_rank, dst_rank)."""
    items: tuple[BucketItem, ...]
    nbytes: int
    """Wire size: payload plus alignment padding between items."""
    payload_bytes: int
    """Sum of the items' bytes (what :attr:`RefitPlan.bytes_sent` counts)."""


BY_NAME = itemgetter(Transfer._fields.index("name"))
BY_DST_NAME = itemgetter(Transfer._fields.index("dst_rank"), Transfer._fields.index("name"))
BY_NAME_BOX = itemgetter(Transfer._fields.index("name"), Transfer._fields.index("global_box"))
"""A transfer's ``(name, global_box)``: the order of a route's transfers (sort keys at C speed)."""

new_tuple = tuple.__new__
"""``new_tuple(BucketItem, (transfer, offset))``: a named tuple without its Python ``__new__`` frame."""


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _split(transfer: Transfer, dim: int, start: int, stop: int, itemsize: int) -> Transfer:
    """Rows ``[start, stop)`` along ``dim`` of ``transfer`` (relative to its global box)."""

    def narrow(box: Box) -> Box:
        lo = box[dim][0]
        return box[:dim] + ((lo + start, lo + stop),) + box[dim + 1 :]

    global_box = narrow(transfer.global_box)
    return Transfer(
        name=transfer.name,
        src_rank=transfer.src_rank,
        dst_rank=transfer.dst_rank,
        src_box=narrow(transfer.src_box),
        dst_box=narrow(transfer.dst_box),
        global_box=global_box,
        dtype=transfer.dtype,
        nbytes=box_numel(global_box) * itemsize,
    )


def _chunks(transfer: Transfer, bucket_bytes: int) -> list[Transfer]:
    """``transfer`` split along its first dim of extent > 1 into pieces of at most
    ``bucket_bytes`` (whole rows; a single row larger than that stays whole)."""
    shape = box_shape(transfer.global_box)
    dim = next((d for d, size in enumerate(shape) if size > 1), None)
    if transfer.nbytes <= bucket_bytes or dim is None:
        return [transfer]
    itemsize = transfer.nbytes // box_numel(transfer.global_box)
    rows = max(1, bucket_bytes // (transfer.nbytes // shape[dim]))
    return [_split(transfer, dim, start, min(start + rows, shape[dim]), itemsize)
            for start in range(0, shape[dim], rows)]


def _pack(units: list[list[Transfer]], bucket_bytes: int, direct_bytes: int | None = None) -> list[list[BucketItem]]:
    """Pack one route's transfers into buckets of at most ``bucket_bytes``.

    ``units``: the route's transfers in order, one per unit, except that a *run* (transfers
    that lie back to back in memory on both ranks, see :func:`_units`) is one unit.

    A transfer larger than a bucket is split along its first dim of extent > 1, filling the
    current bucket first. If one row along that dim alone exceeds ``bucket_bytes`` the
    transfer is not split further: each such row gets a bucket of its own.

    A transfer of at least ``direct_bytes``, and a run, gets buckets of its own (a transfer
    split into chunks of at most ``bucket_bytes``; a run's items back to back, no padding),
    so the endpoint can send it straight from the sender's memory and receive it straight
    into the engine's storage, without packing. The smaller transfers meanwhile keep filling
    one open bucket, so a few large ones between them do not scatter them over many
    small messages; it is closed once ``bucket_bytes`` of direct transfers went past it,
    which bounds how long the copies its items come from stay alive.
    """
    buckets: list[list[BucketItem]] = []
    items: list[BucketItem] = []
    end = 0
    passed = 0  # direct bytes emitted since the open bucket got its first item

    def add(transfer: Transfer) -> None:
        nonlocal end
        offset = _align(end)
        items.append(BucketItem(transfer, offset))
        end = offset + transfer.nbytes

    def close() -> None:
        nonlocal items, end, passed
        if items:
            buckets.append(items)
        items, end, passed = [], 0, 0

    for unit in units:
        transfer = unit[0]
        if direct_bytes is not None and (len(unit) > 1 or transfer.nbytes >= direct_bytes):
            if len(unit) > 1:  # a run: ALIGN-multiple sizes, so the items sit back to back
                offsets = itertools.accumulate((t.nbytes for t in unit[:-1]), initial=0)
                buckets.append([BucketItem(t, o) for t, o in zip(unit, offsets, strict=True)])
            else:
                buckets += [[BucketItem(chunk, 0)] for chunk in _chunks(transfer, bucket_bytes)]
            if items:
                passed += sum(t.nbytes for t in unit)
                if passed >= bucket_bytes:
                    # the open bucket's sources (e.g. k and v of a QKV split whose q already
                    # left) stay alive until it is sent: let at most a bucket's worth pass it
                    close()
            continue
        offset = -(-end // ALIGN) * ALIGN  # _align, inlined: a rank's tens of thousands of transfers pass here
        if offset + transfer.nbytes <= bucket_bytes:
            items.append(new_tuple(BucketItem, (transfer, offset)))
            end = offset + transfer.nbytes
            continue
        shape = box_shape(transfer.global_box)
        dim = next((d for d, size in enumerate(shape) if size > 1), None)
        if transfer.nbytes <= bucket_bytes or dim is None:
            close()
            add(transfer)
            continue
        itemsize = transfer.nbytes // box_numel(transfer.global_box)
        row_bytes = transfer.nbytes // shape[dim]
        start = 0
        while start < shape[dim]:
            rows = (bucket_bytes - _align(end)) // row_bytes
            if rows <= 0 and items:
                close()
                continue
            stop = min(start + max(rows, 1), shape[dim])
            add(_split(transfer, dim, start, stop, itemsize))
            start = stop
    close()
    return buckets


Adjacency = dict[int, dict[str, str]]
"""Per rank: piece name -> the name of the piece that starts where it ends in memory."""


def _units(route: list[Transfer], bucket_bytes: int, direct_bytes: int | None, src_next: dict[str, str],
           dst_next: dict[str, str], whole: Callable[[Transfer], bool]) -> list[list[Transfer]]:
    """The route's transfers in order, with *runs* joined into one unit: consecutive whole
    pieces that follow each other in memory on the sender (``src_next``) and on the receiver
    (``dst_next``), each at least ``direct_bytes`` and a multiple of :data:`ALIGN`, at most
    ``bucket_bytes`` together. A run stands where its first member stood."""
    if direct_bytes is None or not src_next or not dst_next:
        return [[t] for t in route]
    counts: dict[str, int] = defaultdict(int)
    for t in route:
        counts[t.name] += 1
    ok = {t.name: t for t in route if counts[t.name] == 1 and direct_bytes <= t.nbytes <= bucket_bytes
          and t.nbytes % ALIGN == 0 and whole(t)}
    link = {a: b for a in ok if (b := src_next.get(a)) in ok and dst_next.get(a) == b}
    run_of: dict[str, list[Transfer]] = {}
    for start in sorted(ok.keys() - set(link.values())):
        run, total, name = [ok[start]], ok[start].nbytes, start
        run_of[start] = run
        while (name := link.get(name)) is not None and name not in run_of:
            if total + ok[name].nbytes > bucket_bytes:
                run, total = [], 0
            run.append(ok[name])
            total += ok[name].nbytes
            run_of[name] = run
    units, seen = [], set()
    for t in route:
        run = run_of.get(t.name, [t])
        if id(run) not in seen:
            seen.add(id(run))
            units.append(run)
    return units


def _never(transfer: Transfer) -> bool:
    return False


def _one_bucket(route: list[Transfer], bucket_bytes: int, direct_bytes: int | None) -> tuple[BucketItem, ...] | None:
    """The route's items packed as :func:`_pack` packs them where they all fit one bucket and
    none goes direct (then no transfer is split and no run forms); None otherwise."""
    items, end = [], 0
    for transfer in route:
        if direct_bytes is not None and transfer.nbytes >= direct_bytes:
            return None
        offset = -(-end // ALIGN) * ALIGN
        end = offset + transfer.nbytes
        if end > bucket_bytes:
            return None
        items.append(new_tuple(BucketItem, (transfer, offset)))
    return tuple(items)


def bucketize(transfers: list[Transfer], bucket_bytes: int, direct_bytes: int | None,
               src_next: Adjacency | None = None, dst_next: Adjacency | None = None,
               whole: Callable[[Transfer], bool] | None = None) -> list[Bucket]:
    """Buckets ordered by (src_rank, dst_rank, index); a route's transfers by (name, global_box).
    ``src_next`` / ``dst_next`` / ``whole``: see :func:`_units` (no runs without them)."""
    by_route: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for transfer in transfers:
        by_route[transfer.src_rank, transfer.dst_rank].append(transfer)
    src_next, dst_next, whole = src_next or {}, dst_next or {}, whole or _never
    buckets = []
    for src, dst in sorted(by_route):
        route = by_route[src, dst]
        route.sort(key=BY_NAME_BOX)
        one = _one_bucket(route, bucket_bytes, direct_bytes)
        if one is not None:  # the common small route: one bucket, no runs (each transfer below direct_bytes)
            buckets.append(Bucket(src, dst, 0, one, one[-1].offset + one[-1].transfer.nbytes,
                                  sum(t.nbytes for t in route)))
            continue
        units = _units(route, bucket_bytes, direct_bytes, src_next.get(src, {}), dst_next.get(dst, {}), whole)
        for index, items in enumerate(_pack(units, bucket_bytes, direct_bytes)):
            nbytes = items[-1].offset + items[-1].transfer.nbytes
            payload = sum(item.transfer.nbytes for item in items)
            buckets.append(Bucket(src, dst, index, tuple(items), nbytes, payload))
    return buckets


