"""Shard metadata of any trainer rank, from one process, with no weight memory.

A rank's :class:`ShardSpec` list depends only on the model config, the layout and the rank.
:func:`rank_shard_specs` builds that rank's model on the meta device inside a *fake*
process group of the layout's world size (torch's ``fake`` backend: collectives are
no-ops, nothing is started), runs the ordinary local-shard enumeration, and tears the
state down again. :func:`all_rank_shard_specs` does that for every rank of a layout; for
large layouts only one rank per distinct (TP, PP, EP, ETP) coordinate is built, and DP
replicas reuse its specs (they hold identical pieces).

The fake backend is an internal torch API; it is used only here.
"""

from __future__ import annotations

import contextlib

from megatron_refit.plan.layout import TrainLayout
from megatron_refit.plan.spec import ShardSpec

from conversion.testing.build import build_model, destroy_model_parallel, init_model_parallel


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """A fake default process group in which this process plays ``rank``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a default process group")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_shard_specs(hf_config, layout: TrainLayout, rank: int, *, dtype=None) -> list[ShardSpec]:
    """The ShardSpecs that train rank ``rank`` of ``layout`` would enumerate (parameters in
    ``dtype``, a torch dtype; default float32)."""
    import torch

    from conversion.local_shards import enumerate_local_shards

    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside layout {layout.describe()} of {layout.world_size} ranks")
    with fake_world(rank, layout.world_size):
        # gloo subgroups on a fake store crash; the enumeration needs none.
        init_model_parallel(layout, create_gloo_process_groups=False)
        try:
            built = build_model(hf_config, layout, meta=True, dtype=dtype or torch.float32)
            return [s.spec for s in enumerate_local_shards(built.bridge, built.model, hf_config)]
        finally:
            destroy_model_parallel()


def rank_coordinates(layout: TrainLayout, rank: int) -> dict[str, int]:
    """Megatron's default rank order; see :meth:`TrainLayout.coordinates`."""
    return layout.coordinates(rank)


def all_rank_shard_specs(hf_config, layout: TrainLayout) -> dict[int, list[ShardSpec]]:
    """ShardSpecs of every rank of ``layout``, built in this process.

    Ranks that differ only in their data-parallel coordinates (dense DP and expert DP)
    hold identical pieces; one representative per class is built and the others share its
    list. Checked against building every rank in the tests.
    """
    representative: dict[tuple, int] = {}
    specs: dict[int, list[ShardSpec]] = {}
    for rank in range(layout.world_size):
        c = rank_coordinates(layout, rank)
        key = (c["tp"], c["pp"], c["etp"], c["ep"])
        if key not in representative:
            representative[key] = rank
            specs[rank] = rank_shard_specs(hf_config, layout, rank)
        else:
            specs[rank] = specs[representative[key]]
    return specs


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

