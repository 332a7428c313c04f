"""Megatron's context-parallel split of a batch, and its way back (torch; no Megatron import).

Megatron trains under context parallelism (CP) with each CP rank holding two of ``2 * cp`` equal
chunks of every sequence, chunks ``r`` and ``2 * cp - 1 - r`` (its ``get_batch_on_this_cp_rank``:
causal attention then costs every rank the same). The model's rotary embedding takes the same
positions (``get_pos_emb_on_this_cp_rank``) and its attention exchanges keys and values over the
CP group. A forward over such a batch gives each rank the outputs of its own positions;
:func:`gather_positions` puts every rank's back in sequence order, on every rank.
"""

from __future__ import annotations

import torch


def local_positions(seq: int, cp: int, rank: int) -> list[int]:
    """The positions CP rank ``rank`` of ``cp`` holds of a sequence of ``seq`` tokens
    (``seq`` a multiple of ``2 * cp``)."""
    if cp == 1:
        return list(range(seq))
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} tokens does not split into 2 x context_parallel_size={cp} chunks")
    chunk = seq // (2 * cp)
    return [*range(rank * chunk, (rank + 1) * chunk), *range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]


class _AllGather(torch.autograd.Function):
    """``all_gather`` along dim ``dim`` with its gradient (each rank's slice of the summed
    gradient): works on gloo, which has no reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank], None, None


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, rank order (autograd-aware)."""
    return _AllGather.apply(x, dim, group)


def gather_positions(x: torch.Tensor, dim: int, group, positions: list[int]) -> torch.Tensor:
    """Every CP rank's ``x`` (its ``positions`` along ``dim``, :func:`local_positions`) in sequence
    order, on every rank (autograd-aware)."""
    size = torch.distributed.get_world_size(group)
    seq = len(positions) * size
    gathered = all_gather(x, dim, group)
    order = [p for rank in range(size) for p in local_positions(seq, size, rank)]
    inverse = torch.empty(seq, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(seq)
    return gathered.index_select(dim, inverse.to(gathered.device))
