"""Transfers and their packing into buckets: byte offsets and splits (pure)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from megatron_refit.spec import Box, box_shape

ALIGN = 16
"""Byte alignment of items in a bucket: a uint8 slice can be viewed as any dtype up to 16 bytes."""


def _numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one parameter, from a train rank's piece to a gen rank's piece."""

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


@dataclass(frozen=True, slots=True)
class BucketItem:
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
    """Position among the buckets of this (src_rank, dst_rank) pair."""
    items: tuple[BucketItem, ...]
    nbytes: int
    """Wire size: payload plus alignment padding between items."""
    payload_bytes: int
    """Sum of the items' bytes (what :attr:`RefitPlan.bytes_sent` counts)."""


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
        nbytes=_numel(global_box) * itemsize,
    )


def _chunks(transfer: Transfer, bucket_bytes: int) -> list[Transfer]:
    """``transfer`` split along its first dim of extent > 1 into pieces of at most
    ``bucket_bytes`` (whole rows; a single row larger than that stays whole)."""
    shape = box_shape(transfer.global_box)
    dim = next((d for d, size in enumerate(shape) if size > 1), None)
    if transfer.nbytes <= bucket_bytes or dim is None:
        return [transfer]
    itemsize = transfer.nbytes // _numel(transfer.global_box)
    rows = max(1, bucket_bytes // (transfer.nbytes // shape[dim]))
    return [_split(transfer, dim, start, min(start + rows, shape[dim]), itemsize)
            for start in range(0, shape[dim], rows)]


def _pack(transfers: list[Transfer], bucket_bytes: int, direct_bytes: int | None = None) -> list[list[BucketItem]]:
    """Pack one (src, dst) pair's transfers into buckets of at most ``bucket_bytes``.

    A transfer larger than a bucket is split along its first dim of extent > 1, filling the
    current bucket first. If one row along that dim alone exceeds ``bucket_bytes`` the
    transfer is not split further: each such row gets a bucket of its own.

    A transfer of at least ``direct_bytes`` gets buckets of its own (split into chunks of at
    most ``bucket_bytes``), so the driver can send it straight from the sender's tensor and
    receive it straight into the engine's storage, without packing.
    """
    buckets: list[list[BucketItem]] = []
    items: list[BucketItem] = []
    end = 0

    def add(transfer: Transfer) -> None:
        nonlocal end
        offset = _align(end)
        items.append(BucketItem(transfer, offset))
        end = offset + transfer.nbytes

    def close() -> None:
        nonlocal items, end
        if items:
            buckets.append(items)
        items, end = [], 0

    for transfer in transfers:
        if direct_bytes is not None and transfer.nbytes >= direct_bytes:
            close()
            for chunk in _chunks(transfer, bucket_bytes):
                add(chunk)
                close()
            continue
        offset = _align(end)
        if offset + transfer.nbytes <= bucket_bytes:
            items.append(BucketItem(transfer, offset))
            end = offset + transfer.nbytes
            continue
        shape = box_shape(transfer.global_box)
        dim = next((d for d, size in enumerate(shape) if size > 1), None)
        if transfer.nbytes <= bucket_bytes or dim is None:
            close()
            add(transfer)
            continue
        itemsize = transfer.nbytes // _numel(transfer.global_box)
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


def _bucketize(transfers: list[Transfer], bucket_bytes: int, direct_bytes: int | None) -> list[Bucket]:
    """Buckets ordered by (src_rank, dst_rank, index); a pair's transfers by (name, global_box)."""
    by_pair: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for transfer in transfers:
        by_pair[transfer.src_rank, transfer.dst_rank].append(transfer)
    buckets = []
    for src, dst in sorted(by_pair):
        pair = sorted(by_pair[src, dst], key=lambda t: (t.name, t.global_box))
        for index, items in enumerate(_pack(pair, bucket_bytes, direct_bytes)):
            nbytes = items[-1].offset + items[-1].transfer.nbytes
            payload = sum(item.transfer.nbytes for item in items)
            buckets.append(Bucket(src, dst, index, tuple(items), nbytes, payload))
    return buckets


