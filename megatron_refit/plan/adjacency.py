"""Which pieces lie back to back in a rank's memory (gate and up of one fused weight), for the
buckets' direct runs (pure): per rank, a piece name -> the piece after it, checked against the
rank's pieces, and the maps :func:`~megatron_refit.plan.buckets.bucketize` takes for a plan's
transfers."""

from __future__ import annotations

from collections.abc import Callable

from megatron_refit.errors import PlanError
from megatron_refit.plan.buckets import Transfer
from megatron_refit.plan.gen_layout import GenTargets
from megatron_refit.plan.spec import ShardSpec, box_shape


def next_maps(adjacent: dict[int, list[tuple[str, str]]] | None, specs: dict[int, list[ShardSpec]],
               side: str) -> dict[int, dict[str, str]]:
    """Per rank, piece name -> the piece after it in memory; names must be the rank's pieces."""
    out: dict[int, dict[str, str]] = {}
    for rank, pairs in (adjacent or {}).items():
        if not pairs:
            continue
        if rank not in specs:
            raise PlanError(f"{side}_adjacent names {side} rank {rank}, which is not in the plan")
        names = {s.name for s in specs[rank]}
        for a, b in pairs:
            if a not in names or b not in names:
                raise PlanError(f"{side}_adjacent of {side} rank {rank}: ({a!r}, {b!r}) names a piece the rank "
                                "does not hold")
        out[rank] = dict(pairs)
    return out


def adjacency(transfers: list[Transfer], direct_bytes: int | None, train_shapes: Callable[[int], dict],
              train_next: Callable[[int], dict | None], targets: GenTargets, gen_next: Callable[[int], dict | None]):
    """``(src_next, dst_next, whole)`` for :func:`~megatron_refit.plan.buckets.bucketize`, for the
    ranks that ``transfers`` touch only (``train_next`` / ``gen_next``: a rank's piece name -> the
    piece after it)."""
    if direct_bytes is None:
        return None, None, None
    src_next = {rank: m for rank in {t.src_rank for t in transfers} if (m := train_next(rank))}
    dst_next = {rank: m for rank in {t.dst_rank for t in transfers} if (m := gen_next(rank))}
    if not src_next or not dst_next:
        return None, None, None
    class_of = {rank: c for c, ranks in enumerate(targets.ranks) for rank in ranks}

    def whole(t: Transfer) -> bool:
        shape = box_shape(t.global_box)
        gen_box = targets.params[t.name][2][class_of[t.dst_rank]]
        return train_shapes(t.src_rank).get(t.name) == shape == box_shape(gen_box)

    return src_next, dst_next, whole
