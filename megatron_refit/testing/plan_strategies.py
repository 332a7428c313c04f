"""Random refit problems for the plan's property tests (hypothesis strategies): parameters of
1-3 dims, train pieces that tile them (each held by 1-3 replicas), generation targets that tile
them too or are arbitrary boxes, on random ranks, and a bucket size."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck
from hypothesis import strategies as st

from megatron_refit.plan.spec import Box, ShardSpec, full_box

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int32", "uint8"]
BUCKET_BYTES = [1, 3, 16, 33, 64, 200, 64 << 20]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


def _spans(size: int, cuts: set[int]) -> list[tuple[int, int]]:
    return list(itertools.pairwise([0, *sorted(cuts), size]))


@st.composite
def tilings(draw, shape: tuple[int, ...]) -> list[Box]:
    """A partition of ``shape``: cut along one dim, then maybe cut each slab along another."""
    dim = draw(st.sampled_from(range(len(shape))))
    boxes = []
    for lo, hi in _spans(
        shape[dim], draw(st.sets(st.integers(1, shape[dim] - 1)) if shape[dim] > 1 else st.just(set()))
    ):
        slab = full_box(shape)[:dim] + ((lo, hi),) + full_box(shape)[dim + 1 :]
        other = [d for d in range(len(shape)) if d != dim and shape[d] > 1]
        if not other or not draw(st.booleans()):
            boxes.append(slab)
            continue
        dim2 = draw(st.sampled_from(other))
        for lo2, hi2 in _spans(shape[dim2], draw(st.sets(st.integers(1, shape[dim2] - 1)))):
            boxes.append(slab[:dim2] + ((lo2, hi2),) + slab[dim2 + 1 :])
    return boxes


@st.composite
def sub_boxes(draw, shape: tuple[int, ...]) -> Box:
    box = []
    for size in shape:
        lo = draw(st.integers(0, size - 1))
        box.append((lo, draw(st.integers(lo + 1, size))))
    return tuple(box)


def _place(draw, slots_by_name: dict[str, list[Box]], meta: dict[str, tuple]) -> dict[int, list[ShardSpec]]:
    """Put each name's boxes on distinct random ranks (at most one piece of a name per rank)."""
    num_ranks = max((len(slots) for slots in slots_by_name.values()), default=0) or 1
    specs: dict[int, list[ShardSpec]] = {rank: [] for rank in range(num_ranks)}
    for name, slots in slots_by_name.items():
        ranks = draw(st.permutations(range(num_ranks)))
        shape, dtype = meta[name]
        for rank, box in zip(ranks, slots):
            specs[rank].append(ShardSpec(name=name, global_shape=shape, dtype=dtype, box=box))
    return specs


@st.composite
def problems(draw):
    """``(train_specs, gen_specs, bucket_bytes, seed)`` for 1-3 parameters."""
    meta = {f"p{i}": (draw(shapes), draw(st.sampled_from(DTYPES))) for i in range(draw(st.integers(1, 3)))}
    train_slots, gen_slots = {}, {}
    for name, (shape, _) in meta.items():
        # Each distinct train box held by 1-3 replicas.
        train_slots[name] = [box for box in draw(tilings(shape)) for _ in range(draw(st.integers(1, 3)))]
        targets = []
        if draw(st.integers(0, 4)):  # sometimes no gen rank needs the parameter
            # A partition (e.g. TP) whose pieces may each go to several ranks (DP, KV replication)...
            targets = [box for box in draw(tilings(shape)) for _ in range(draw(st.integers(1, 3)))]
            # ...plus arbitrary extra boxes on other ranks.
            targets += draw(st.lists(sub_boxes(shape), max_size=2))
        gen_slots[name] = targets
    return (
        _place(draw, train_slots, meta),
        _place(draw, gen_slots, meta),
        draw(st.sampled_from(BUCKET_BYTES)),
        draw(st.integers(0, 2**31)),
    )
