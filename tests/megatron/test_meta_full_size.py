"""Meta enumeration of a full-size model, every rank of a production layout, one process."""

from __future__ import annotations

import pytest

from megatron_refit.local.launch import run_spawned

pytestmark = pytest.mark.slow


def _enumerate_full_size(rank, world_size, port):
    import time

    from conversion.presets import hf_config
    from conversion.testing.meta import all_rank_shard_specs, peak_rss_mb
    from megatron_refit.plan.layout import TrainLayout

    start = time.perf_counter()
    specs = all_rank_shard_specs(hf_config("qwen3-30b-a3b"), TrainLayout(tp=4, pp=2, ep=8, dp=2))
    return specs, time.perf_counter() - start, peak_rss_mb()


def test_qwen3_30b_a3b_tp4_ep8_pp2_meta_enumeration():
    specs, seconds, rss_mb = run_spawned(_enumerate_full_size, 1, timeout_s=400)[0]
    print(f"\nQwen3-30B-A3B TP4xEP8xPP2 (16 ranks): {seconds:.1f} s, peak RSS {rss_mb:.0f} MB")
    assert sorted(specs) == list(range(16))
    assert rss_mb < 2048
    # rank 5: tp 1, ep 5 -> experts 80..95 of every layer of its stage (PP stage 0: layers 0..23)
    experts = {int(s.name.split(".experts.")[1].split(".")[0]) for s in specs[5] if s.is_expert}
    assert experts == set(range(80, 96))
    layers = {int(s.name.split(".layers.")[1].split(".")[0]) for s in specs[5] if ".layers." in s.name}
    assert layers == set(range(24))
    assert {s.pp_stage for s in specs[5]} == {0} and {s.pp_stage for s in specs[8]} == {1}
    # every HF tensor of the model is tiled exactly once by the distinct boxes of all ranks
    numel: dict[str, int] = {}
    seen: set[tuple] = set()
    global_numel: dict[str, int] = {}
    for rank_specs in specs.values():
        for s in rank_specs:
            global_numel[s.name] = 1
            for size in s.global_shape:
                global_numel[s.name] *= size
            if (s.name, s.box) not in seen:
                seen.add((s.name, s.box))
                numel[s.name] = numel.get(s.name, 0) + s.numel
    assert numel == global_numel
    num_params = sum(global_numel.values())
    assert 30.0e9 < num_params < 31.0e9, num_params
