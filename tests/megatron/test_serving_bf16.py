"""The serving check at bf16 on a 64-expert top-8 MoE (``refit.verify_serving``, #50 item 2),
in two model states: nearly flat (10 Adam steps from random init) and peaked (trained on 8
repeated sequences until the trainer predicts them with mean probability >= 0.9). In each, 20
clean refits at an RL learning rate (1e-6) into an HF engine in bf16 pass the check with its
defaults (each token within 0.02 + 0.05 x |its logit| + |the largest logit|), and an engine
whose post-load step breaks the model is caught where the log-probs can see it: a NaN in one
routed expert (both states), a wrong RoPE base and two swapped experts (the flat state).

What the log-probs cannot see at bf16 here is measured and printed, not claimed: one expert
x1.05, an attention output x1.02, and on the peaked model the RoPE base and the swap (there
the clean noise on improbable tokens is larger than what these faults move;
docs/guide-serving.md, "What it catches"). The HF engine's read-back of its live weights
catches every weight fault of these (``test_verify_serving.py``).
"""

from __future__ import annotations

import math

import pytest

from megatron_refit.testing.launch import run_spawned

pytestmark = pytest.mark.slow

STATES = {"flat": dict(steps=10, lr=1e-2, corpus=False), "peaked": dict(steps=150, lr=3e-3, corpus=True)}
FAULTS = ("nan", "rope", "swap", "expert x1.05", "o_proj x1.02")
CAUGHT = {"flat": {"nan", "rope", "swap"}, "peaked": {"nan"}}
"""Faults the check must catch in each state (the others are reported)."""


def _break(model, fault: str) -> None:
    """An HF engine's post-load step gone wrong: ``fault`` applied to its model in place."""
    import torch

    layer = model.model.layers[0]
    with torch.no_grad():
        if fault == "rope":  # the config's base is 1e4; a loader that read another
            for module in model.modules():
                if hasattr(module, "inv_freq"):
                    dim = module.inv_freq.numel() * 2
                    module.inv_freq.copy_(1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim)))
                    module.original_inv_freq = module.inv_freq.clone()
            return
        if fault == "o_proj x1.02":
            model.model.layers[1].self_attn.o_proj.weight.mul_(1.02)
            return
        stacked = {n: p for n, p in layer.mlp.experts.named_parameters() if p.dim() == 3}
        assert stacked, "the HF Qwen3-MoE experts are stacked [experts, ...] parameters"
        for name, param in stacked.items():
            if fault == "swap":
                param[[3, 5]] = param[[5, 3]]
            elif fault == "expert x1.05" and "down" in name:
                param[3] *= 1.05
            elif fault == "nan" and "down" in name:
                param[3, 0, 0] = math.nan


def _rank(rank, world, port):
    import torch

    from conversion.serving import trainer_forward
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.testing.hf_configs import hf_config
    from conversion.testing.train_step import train_step
    from megatron_refit.config.section import RefitConfig
    from megatron_refit.engines.hf.storage import HFStorage
    from megatron_refit.errors import ServingMismatchError
    from megatron_refit.fleet.serving import ServingCheck
    from megatron_refit.plan.layout import TrainLayout

    init_gloo(rank, world, port)
    init_model_parallel(TrainLayout())
    found = {}
    for state, spec in STATES.items():
        cfg = hf_config("qwen3-moe", experts=64, num_experts_per_tok=8, vocab=2048)
        built = build_model(cfg, TrainLayout(), dtype=torch.bfloat16)
        optimizer = torch.optim.Adam([p for c in built.model for p in c.parameters()], lr=spec["lr"])
        rng = torch.Generator().manual_seed(3)
        corpus = torch.tensor([[(s * 37 + i * 5) % cfg.vocab_size for i in range(33)] for s in range(8)])
        for _ in range(spec["steps"]):
            loss = train_step(built, optimizer, corpus if spec["corpus"] else
                              torch.randint(0, cfg.vocab_size, (8, 33), generator=rng))
        forward = trainer_forward(built.model, cfg)
        check = ServingCheck(RefitConfig(enabled=True, verify_serving="on"), forward, rank=0)
        for group in optimizer.param_groups:
            group["lr"] = 1e-6  # from here on, RL refits

        def load(version: int):
            engine = HFStorage.from_config(cfg, dtype=torch.bfloat16)
            for name, tensor in built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False):
                engine.buffer(name).copy_(tensor)
            engine.set_state("ready", version)
            return engine

        def verdict(engine, version, probe, reference):
            try:
                return check.verdict(0, version, lambda: engine.score(probe.sequences), reference,
                                     probe)["max_dlogprob"]
            except ServingMismatchError as exc:
                return dict(max_dlogprob=exc.max_dlogprob, message=str(exc))

        clean = []
        engine = load(0)
        for version in range(1, 21):
            train_step(built, optimizer, torch.randint(0, cfg.vocab_size, (8, 33), generator=rng))
            for name, tensor in built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False):
                engine.buffer(name).copy_(tensor)
            engine.set_state("ready", version)
            probe, reference, _ = check.take_reference()
            clean.append(verdict(engine, version, probe, reference))
        faults = {}
        for fault in FAULTS:
            engine = load(21)
            _break(engine.model, fault)
            faults[fault] = verdict(engine, 21, probe, reference)
        found[state] = dict(clean=clean, faults=faults, loss=loss, experts=check.experts)
    return found


def test_bf16_serving_check_passes_clean_rl_refits_and_catches_what_log_probs_can_see():
    found = run_spawned(_rank, 1, timeout_s=900)[0]
    for state, got in found.items():
        print(state, {k: (v if isinstance(v, float) else v["max_dlogprob"]) for k, v in got["faults"].items()},
              "clean max", max(got["clean"], key=lambda v: v if isinstance(v, float) else math.inf),
              "loss", got["loss"], "experts routed", got["experts"])
    assert found["peaked"]["loss"] < math.log(1 / 0.9)  # the corpus: geometric mean probability > 0.9
    for state, got in found.items():
        false_alarms = [v["message"] for v in got["clean"] if not isinstance(v, float)]
        assert not false_alarms, f"{state}: {len(false_alarms)} of 20 clean refits failed: {false_alarms[0]}"
        for fault in CAUGHT[state]:
            result = got["faults"][fault]
            assert isinstance(result, dict) and "does not serve the trainer's model" in result["message"], \
                f"{state}: {fault} passed the check (max |Δ| {result})"
