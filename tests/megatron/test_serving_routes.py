"""The per-token routes the calibrated serving check groups the probe's tokens by (#68,
:meth:`conversion.routing.RoutedExperts.per_token`), under pipeline and context parallelism: each
router runs on one stage (its layers) and over one CP rank's positions, and every train rank must
still hold every scored token's (layer, expert) pairs, the same ones. Checked against what the
per-sequence coverage (:meth:`~conversion.routing.RoutedExperts.per_sequence`) says each sequence
reached. Tensor and sequence parallelism: ``test_expert_coverage.py``."""

from __future__ import annotations

import pytest

from megatron_refit.local.launch import run_spawned

pytestmark = pytest.mark.slow

LAYERS, EXPERTS, TOPK = 4, 16, 4


def _rank(rank, world, port, layout):
    import torch

    from conversion.presets import hf_config
    from conversion.serving import trainer_forward
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from megatron_refit.plan.probe import make_probe

    init_gloo(rank, world, port)
    init_model_parallel(layout)
    cfg = hf_config("qwen3-moe", experts=EXPERTS, num_experts_per_tok=TOPK, layers=LAYERS, vocab=512)
    built = build_model(cfg, layout, dtype=torch.bfloat16)
    forward = trainer_forward(built.model, cfg)
    forward.prepare(fp8=False)
    probe = make_probe({"sequences": 3, "length": 13}, cfg.vocab_size)  # 13 tokens: CP2 pads to 16
    _, seen, _ = forward._run(probe.sequences)  # noqa: SLF001 -- the per-sequence coverage to check against
    forward(probe.sequences)
    routes = forward.routes
    forward.cover(probe.sequences, budget=0, seed=0)  # the serving check's search: leaves the last call's routes
    assert forward.routes == routes
    return dict(routes=routes, seen=seen.nonzero().tolist(), lengths=[len(s) - 1 for s in probe.sequences])


@pytest.mark.parametrize("name", ["pp2", "cp2"])
def test_every_rank_holds_every_scored_tokens_experts(name):
    from megatron_refit.plan.layout import TrainLayout

    layout = TrainLayout(pp=2) if name == "pp2" else TrainLayout(cp=2)
    found = run_spawned(_rank, 2, layout, timeout_s=300)
    assert found[0]["routes"] == found[1]["routes"]  # the same on every rank
    routes = found[0]["routes"]
    assert [len(r) for r in routes] == found[0]["lengths"]
    for sequence in routes:
        for pairs in sequence:  # TOPK experts in each MoE layer, whichever stage and CP rank ran it
            assert sorted({layer for layer, _ in pairs}) == list(range(LAYERS)), pairs
            assert all(sum(layer == i for layer, _ in pairs) == TOPK for i in range(LAYERS)), pairs
    reached = {(b, layer, expert) for b, sequence in enumerate(routes) for pairs in sequence for layer, expert in pairs}
    seen = {tuple(x) for x in found[0]["seen"]}
    assert reached <= seen  # the scored tokens' experts are among what each sequence reached (its last token too)
    assert len(seen - reached) <= 3 * LAYERS * TOPK  # ... and differ by at most the last token's
