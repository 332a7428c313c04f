"""Which bytes of a refit may travel straight from (or into) a tensor's own memory instead of
through a packed staging bucket: the size from which a transfer goes direct on a transport
(:func:`resolve_direct_bytes`), the pieces whose storages lie end to end, so that a run of
them is one message (:func:`adjacent_pieces`), both asked before the plan, and a bucket's bytes
as one view of a side's memory where it can skip packing (:func:`direct_view`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit.endpoint.bytes import contiguous_bytes
from megatron_refit.transport import Transport


def resolve_direct_bytes(direct_bytes: int | str | None, group: Transport, bucket_bytes: int) -> int | None:
    """The size from which a transfer skips packing on ``group`` (None: none does): ``"auto"``
    asks the transport (:meth:`~megatron_refit.transport.base.Transport.auto_direct_bytes`:
    1 MiB on gloo, one bucket on NCCL); a transport that cannot send from the pieces' own
    memory (``direct_ok`` false: colocated IPC) packs everything."""
    if direct_bytes != "auto" and direct_bytes is not None and (
            isinstance(direct_bytes, bool) or not isinstance(direct_bytes, int) or direct_bytes < 1):
        raise ValueError(f"direct_bytes must be a positive int, 'auto' or None, got {direct_bytes!r}")
    if not group.direct_ok:
        return None  # nothing goes direct (colocated): fill whole buckets, fewer handshakes
    return group.auto_direct_bytes(bucket_bytes) if direct_bytes == "auto" else direct_bytes


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


def direct_view(group, bucket, get: Callable[[str], torch.Tensor], side: str) -> torch.Tensor | None:
    """The bucket's bytes as one flat view of this side's memory (``get(name)``: a piece's tensor),
    when it can skip packing on ``group``: one item whose slice is contiguous, or items that lie
    back to back in one storage exactly as they sit in the bucket (a run: see
    :func:`megatron_refit.plan.buckets._units`). Each side decides for itself; the bytes on the
    wire are the same either way."""
    if not group.direct_ok:
        return None
    first, offset = None, 0
    for item in bucket.items:  # stops at the first item out of place (packed buckets: the second)
        transfer = item.transfer
        view = contiguous_bytes(get(transfer.name), transfer.src_box if side == "src" else transfer.dst_box)
        if view is None:
            return None
        if item.offset != offset:
            return None
        if first is None:
            first = view
        elif (view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
              or view.data_ptr() - first.data_ptr() != offset):
            return None
        offset += view.numel()
    return first if len(bucket.items) == 1 else first.as_strided((offset,), (1,))
