"""Pack plan buckets into flat byte buffers and unpack them into gen pieces (no collectives)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit.plan.buckets import Bucket, BucketItem
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.plan.spec import Box, box_shape


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def _item_view(buf: torch.Tensor, item: BucketItem) -> torch.Tensor:
    """The item's bytes in ``buf`` as a tensor of its dtype and shape."""
    t = item.transfer
    flat = buf[item.offset : item.offset + t.nbytes].view(getattr(torch, t.dtype))
    return flat.view(box_shape(t.global_box))


def pack_bucket(
    bucket: Bucket, get_src: Callable[[str], torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The bucket as a flat uint8 tensor of ``bucket.nbytes``, copied from the sender's pieces
    (the padding between items zeroed: a bucket packs to the same bytes every time, so a train
    rank can recompute the digest of a bucket another route carried).

    ``get_src(name)`` returns the sender's local piece of ``name`` (shaped like its spec box,
    any strides). Each item is one strided copy from the piece into the buffer.
    """
    if out is None:
        device = get_src(bucket.items[0].transfer.name).device
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < bucket.nbytes:
        raise ValueError(
            f"out must be a 1-D uint8 tensor of at least {bucket.nbytes} bytes, got {out.dtype} {tuple(out.shape)}"
        )
    out = out[: bucket.nbytes]
    zero_padding(bucket, out)  # zeros, so the same bucket packs to the same bytes
    for item in bucket.items:
        src = get_src(item.transfer.name)
        if str(src.dtype).removeprefix("torch.") != item.transfer.dtype:  # copy_ would cast silently
            raise ValueError(f"{item.transfer.name}: the local piece is {src.dtype}, its spec (and the plan) "
                             f"says {item.transfer.dtype}")
        _item_view(out, item).copy_(src[_slices(item.transfer.src_box)])
    return out


def zero_padding(bucket: Bucket, out: torch.Tensor) -> None:
    """Zero the alignment padding of ``bucket`` in ``out`` (its bytes): between items and after the last."""
    end = 0
    for item in bucket.items:
        if item.offset > end:
            out[end:item.offset].zero_()
        end = item.offset + item.transfer.nbytes
    if bucket.nbytes > end:
        out[end:bucket.nbytes].zero_()


def contiguous_bytes(tensor: torch.Tensor, box: Box) -> torch.Tensor | None:
    """``tensor[box]`` as a flat uint8 view if that slice is contiguous (it can then be sent
    or received in place), else None."""
    part = tensor[_slices(box)]
    if not part.is_contiguous() or part.numel() == 0:
        return None
    return part.reshape(-1).view(torch.uint8)


def unpack_bucket(bucket: Bucket, buf: torch.Tensor, get_dst: Callable[[str], torch.Tensor]) -> None:
    """Copy each item of ``buf`` in place into ``get_dst(name)`` at its destination box."""
    for item in bucket.items:
        get_dst(item.transfer.name)[_slices(item.transfer.dst_box)].copy_(_item_view(buf, item))


def repack_bucket(bucket: Bucket, get_dst: Callable[[str], torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`unpack_bucket`: the bucket's bytes as the receiver holds them
    now (delta refits start from them; the engine's read-back compares them with what landed),
    the padding zeroed as :func:`pack_bucket` sent it, whatever ``out`` held before."""
    out = out[: bucket.nbytes]
    zero_padding(bucket, out)
    for item in bucket.items:
        _item_view(out, item).copy_(get_dst(item.transfer.name)[_slices(item.transfer.dst_box)])
    return out


def replay(plan: RefitPlan, train_tensors: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan`` in one process: the gen pieces that the train pieces produce."""
    gen = {
        rank: {spec.name: torch.empty(spec.shape, dtype=getattr(torch, spec.dtype)) for spec in plan.gen_pieces(rank)}
        for rank in range(len(plan.gen_global))
    }
    for bucket in plan.buckets:
        buf = pack_bucket(bucket, train_tensors[bucket.src_rank].__getitem__)
        unpack_bucket(bucket, buf, gen[bucket.dst_rank].__getitem__)
    return gen
