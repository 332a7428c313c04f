"""Property tests: random tilings, replicas and targets; the plan must reproduce every target."""

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_refit.endpoint.bytes import replay
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.errors import PlanError
from megatron_refit.plan.spec import Box, ShardSpec, full_box
from megatron_refit.testing.plan_strategies import SETTINGS, problems, shapes, tilings

pytestmark = pytest.mark.reliability

def _random_full(shape: tuple[int, ...], dtype: str, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs included) of ``dtype``."""
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(getattr(torch, dtype)).reshape(shape)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _shape_of(specs: list[ShardSpec], name: str) -> tuple[int, ...]:
    return next(s.shape for s in specs if s.name == name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _key(bucket) -> tuple[int, int, int]:
    """The global order every rank posts its buckets in."""
    return bucket.index, bucket.dst_rank, bucket.src_rank


def _hints(draw, specs: dict[int, list[ShardSpec]]) -> dict[int, list[tuple[str, str]]]:
    """Random adjacency hints among each rank's pieces (cycles and chains included)."""
    out = {}
    for rank, pieces in specs.items():
        names = [s.name for s in pieces]
        pairs = st.tuples(st.sampled_from(names), st.sampled_from(names)) if names else st.nothing()
        out[rank] = draw(st.lists(pairs, max_size=4)) if names else []
    return out


@settings(max_examples=600, **SETTINGS)
@given(problems(), st.one_of(st.none(), st.integers(1, 512)), st.data())
def test_plan_reproduces_targets(problem, direct_bytes, data):
    train, gen, bucket_bytes, seed = problem
    src_adj, dst_adj = {}, {}
    if data.draw(st.booleans()):
        src_adj, dst_adj = _hints(data.draw, train), _hints(data.draw, gen)
    plan = RefitPlan.build(train, gen, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes,
                           train_adjacent=src_adj, gen_adjacent=dst_adj)
    rng = torch.Generator().manual_seed(seed)
    meta = {s.name: (s.global_shape, s.dtype) for specs in train.values() for s in specs}
    full = {name: _random_full(shape, dtype, rng) for name, (shape, dtype) in meta.items()}
    train_tensors = {r: {s.name: full[s.name][_slices(s.box)].clone() for s in specs} for r, specs in train.items()}

    got = replay(plan, train_tensors)
    coverage = {r: {s.name: torch.zeros(s.shape, dtype=torch.int32) for s in specs} for r, specs in gen.items()}
    for bucket in plan.buckets:
        assert bucket.nbytes <= bucket_bytes or len(bucket.items) == 1
        if direct_bytes is not None and any(item.transfer.nbytes >= direct_bytes for item in bucket.items) \
                and len(bucket.items) > 1:  # a run: whole pieces back to back on both ends
            offset = 0
            src_next, dst_next = dict(src_adj[bucket.src_rank]), dict(dst_adj[bucket.dst_rank])
            for item, after in itertools.zip_longest(bucket.items, bucket.items[1:]):
                t = item.transfer
                assert item.offset == offset and t.nbytes >= direct_bytes
                offset += t.nbytes
                assert t.src_box == full_box(_shape_of(train[bucket.src_rank], t.name))
                assert t.dst_box == full_box(_shape_of(gen[bucket.dst_rank], t.name))
                if after is not None:
                    assert src_next[t.name] == dst_next[t.name] == after.transfer.name
            assert bucket.nbytes == offset <= bucket_bytes
        for item in bucket.items:
            coverage[bucket.dst_rank][item.transfer.name][_slices(item.transfer.dst_box)] += 1
    for rank, specs in gen.items():
        for spec in specs:
            assert torch.equal(_bits(got[rank][spec.name]), _bits(full[spec.name][_slices(spec.box)]))
            assert bool((coverage[rank][spec.name] == 1).all())
    assert plan.bytes_sent == plan.bytes_minimal
    needed = {s.name for specs in gen.values() for s in specs}
    assert set(plan.unused_train_params) == set(meta) - needed

    # every rank posts its buckets in one global order (deadlock freedom, docs/design.md)
    for rank in train:
        order = [_key(b) for b in plan.buckets_from(rank)]
        assert order == sorted(order) and {b.src_rank for b in plan.buckets_from(rank)} <= {rank}
    for rank in gen:
        order = [_key(b) for b in plan.buckets_to(rank)]
        assert order == sorted(order) and {b.dst_rank for b in plan.buckets_to(rank)} <= {rank}
    assert sum(len(plan.buckets_from(r)) for r in train) == len(plan.buckets) \
        == sum(len(plan.buckets_to(r)) for r in gen)

    # what prepare() builds: each rank's local plan holds exactly the whole plan's buckets of
    # that rank, and its fingerprints agree with the whole plan's pair by pair
    whole = plan.fingerprints()
    for side, ranks in (("train", train), ("gen", gen)):
        for rank in ranks:
            local = RefitPlan.build(train, gen, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes,
                                    train_adjacent=src_adj, gen_adjacent=dst_adj, local=(side, rank))
            mine = local.buckets_from(rank) if side == "train" else local.buckets_to(rank)
            assert mine == (plan.buckets_from(rank) if side == "train" else plan.buckets_to(rank))
            assert sorted(local.buckets, key=_key) == sorted(mine, key=_key)
            assert local.bytes_sent == plan.bytes_sent and local.summary()["num_transfers"] == len(plan.transfers)
            prints = local.fingerprints()
            assert prints == {key: whole[key] for key in prints} and prints["plan"] == whole["plan"]


@settings(max_examples=200, **SETTINGS)
@given(st.data())
def test_broken_tiling_is_rejected(data):
    shape = data.draw(shapes)
    boxes = data.draw(tilings(shape))
    victim = data.draw(st.integers(0, len(boxes) - 1))
    box = list(boxes[victim])
    grow = data.draw(st.booleans())
    if grow:  # overlap: extend the box by one along a dim where a neighbour lies
        dims = [d for d, (lo, hi) in enumerate(box) if hi < shape[d]]
        assume(dims)
        d = data.draw(st.sampled_from(dims))
        box[d] = (box[d][0], box[d][1] + 1)
    else:  # gap: shrink the box, or drop it if it is a single element
        dims = [d for d, (lo, hi) in enumerate(box) if hi - lo > 1]
        if dims:
            d = data.draw(st.sampled_from(dims))
            box[d] = (box[d][0], box[d][1] - 1)
        else:
            assume(len(boxes) > 1)
            box = None
    broken = boxes[:victim] + ([tuple(box)] if box else []) + boxes[victim + 1 :]
    # Intact copies of the original boxes on other ranks are not replicas of a changed box.
    pieces = broken + (boxes if box is not None and data.draw(st.booleans()) else [])
    train = {r: [ShardSpec(name="w", global_shape=shape, dtype="float32", box=b)] for r, b in enumerate(pieces)}
    gen = {0: [ShardSpec(name="w", global_shape=shape, dtype="float32", box=full_box(shape))]}
    with pytest.raises(PlanError, match=r"^w: train pieces"):
        RefitPlan.build(train, gen)
