"""The training helper's default loss is a next-token loss: a tiny Megatron model trained on one
sequence learns to predict each position's next token (with a copy loss it would learn to
repeat each position's own token, which makes greedy-decode checks of a refit weak)."""

from __future__ import annotations

import torch

from megatron_refit.local.launch import run_spawned

STEPS = 40


def _learn_rank(rank, world, port):
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.presets import hf_config
    from conversion.testing.train_step import forward_logits, train_step
    from megatron_refit.plan.layout import TrainLayout

    cfg = hf_config("qwen3")
    init_gloo(rank, world, port)
    init_model_parallel(TrainLayout(tp=1))
    built = build_model(cfg, TrainLayout(tp=1), seed=0)
    tokens = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:16].unsqueeze(0)
    optimizer = torch.optim.Adam(built.model[0].parameters(), lr=1e-2)
    losses = [train_step(built, optimizer, tokens) for _ in range(STEPS)]
    predicted = forward_logits(built, tokens).argmax(-1)[0, :-1]
    return dict(losses=losses, next=(predicted == tokens[0, 1:]).float().mean().item(),
                same=(predicted == tokens[0, :-1]).float().mean().item())


def test_train_step_teaches_the_next_token():
    out = run_spawned(_learn_rank, 1, timeout_s=180)[0]
    assert out["losses"][-1] < out["losses"][0] / 4, out["losses"]
    assert out["next"] == 1.0 and out["same"] == 0.0, out
