"""What the serving check (``refit.verify_serving``) sees at bf16: clean refits and broken engines
on a 64-expert top-8 MoE, in a nearly flat and in a peaked model state (#50 item 2).

:func:`power_rank` (one spawned rank, :func:`~megatron_refit.local.launch.run_spawned`) builds
Qwen3-MoE through Megatron-Bridge in bf16 for each state of :data:`STATES`, trains it (Adam), then
runs 20 refits at lr 1e-6 into an HF engine in bf16, each checked by
:class:`~megatron_refit.fleet.serving.ServingCheck` with its defaults (the first calibrates the
replica's limits, #68; its weights are not read back: ``readback: false``); then, at the last
version, an engine whose post-load step breaks the model as each of :data:`FAULTS` says, and what
the rounding bound alone would say of it. Used by
``tests/megatron/test_serving_bf16.py`` and ``scripts/bench_serving.py`` (its ``power`` section).
"""

from __future__ import annotations

import math

from megatron_refit.plan.probe import BULK

STATES = {"flat": dict(steps=10, lr=1e-2, corpus=False), "peaked": dict(steps=33, lr=5e-3, corpus=True),
          "hard": dict(steps=50, lr=5e-3, corpus=True)}
"""``flat``: 10 steps on random tokens from random init; ``peaked``: 33 steps on 8 repeated
sequences (the trainer then predicts them with mean probability 0.95: corpus loss 0.050; 150
steps at lr 3e-3, 0.034, cost 4x as much); ``hard``: 50 steps on them (a corpus loss near 0.01),
where one clean token's share of its tolerance moves 2.4x between refits (a near-tie of the router):
what the calibrated limits must not mistake for a fault. Further still the check's clean margin
goes: docs/guide-serving.md, the "trained hard" rows."""
FAULTS = ("nan", "rope", "scale x1.1", "swap", "expert x1.05", "o_proj x1.02")
"""A NaN in one routed expert's down projection; the RoPE base 1e6 for the config's 1e4; the final
norm's weight x1.1 (a post-load scale error: every logit 10 % larger, no token's log-prob beyond its
own tolerance); experts 3 and 5 of layer 0 swapped; expert 3's down projection x1.05; layer 1's
attention output x1.02."""
CLEAN_REFITS = 20


def break_engine(model, fault: str) -> None:
    """An HF engine's post-load step gone wrong: ``fault`` (of :data:`FAULTS`) applied to its
    Qwen3-MoE ``model`` in place."""
    import torch

    with torch.no_grad():
        if fault == "rope":
            for module in model.modules():
                if hasattr(module, "inv_freq"):
                    dim = module.inv_freq.numel() * 2
                    module.inv_freq.copy_(1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim)))
                    module.original_inv_freq = module.inv_freq.clone()
            return
        if fault == "o_proj x1.02":
            model.model.layers[1].self_attn.o_proj.weight.mul_(1.02)
            return
        if fault == "scale x1.1":
            model.model.norm.weight.mul_(1.1)
            return
        stacked = {n: p for n, p in model.model.layers[0].mlp.experts.named_parameters() if p.dim() == 3}
        if not stacked or fault not in FAULTS:
            raise ValueError(f"cannot break this engine with {fault!r} (stacked experts: {sorted(stacked)})")
        for name, param in stacked.items():
            if fault == "swap":
                param[[3, 5]] = param[[5, 3]]
            elif fault == "expert x1.05" and "down" in name:
                param[3] *= 1.05
            elif fault == "nan" and "down" in name:
                param[3, 0, 0] = math.nan


def power_rank(rank, world, port, states=tuple(STATES)):
    """Each state's ``clean`` (per refit: the largest |Δ log-prob|, or the mismatch), ``mean``
    (the largest mean |Δ| of a clean refit), ``faults`` (per fault: the same), the training's last
    ``loss``, the probe's ``experts`` (routed, total) and the check's ``tolerance`` / ``relative``."""
    import torch

    from conversion.serving import trainer_forward
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.presets import hf_config
    from conversion.testing.train_step import train_step
    from megatron_refit.config.section import RefitConfig
    from megatron_refit.engines.hf.storage import HFStorage
    from megatron_refit.errors import ServingMismatchError
    from megatron_refit.fleet.serving import ServingCheck
    from megatron_refit.plan.layout import TrainLayout
    from megatron_refit.plan.calibration import expert_shift, limits, scaled_move, shares
    from megatron_refit.plan.probe import bulk, compare

    init_gloo(rank, world, port)
    init_model_parallel(TrainLayout())
    found = {}
    for state in states:
        spec = STATES[state]
        cfg = hf_config("qwen3-moe", experts=64, num_experts_per_tok=8, vocab=2048)
        built = build_model(cfg, TrainLayout(), dtype=torch.bfloat16)
        optimizer = torch.optim.Adam([p for c in built.model for p in c.parameters()], lr=spec["lr"])
        rng = torch.Generator().manual_seed(3)
        corpus = torch.tensor([[(s * 37 + i * 5) % cfg.vocab_size for i in range(33)] for s in range(8)])
        for _ in range(spec["steps"]):
            loss = train_step(built, optimizer, corpus if spec["corpus"] else
                              torch.randint(0, cfg.vocab_size, (8, 33), generator=rng))
        check = ServingCheck(RefitConfig(enabled=True, verify_serving="on"), trainer_forward(built.model, cfg), rank=0)
        for group in optimizer.param_groups:
            group["lr"] = 1e-6  # from here on, RL refits

        def load(engine, version: int):
            for name, tensor in built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False):
                engine.buffer(name).copy_(tensor)
            engine.set_state("ready", version)
            return engine

        def verdict(engine, version, probe, reference):
            served = engine.score(probe.sequences)
            try:
                return check.verdict(0, version, lambda: served, reference, probe)
            except ServingMismatchError as exc:
                finite = all(math.isfinite(x) for row in served for x in row)
                share = bulk(served, reference, tolerance=check.tolerance, relative=check.relative) if finite else None
                try:  # what the rounding bound alone (the uncalibrated check) says of it
                    compare(served, reference, probe, tolerance=check.tolerance, relative=check.relative,
                            floor=check.floor, replica=0, version=version)
                    rounding = True
                except ServingMismatchError:
                    rounding = False
                return dict(max_dlogprob=exc.max_dlogprob, message=str(exc), bulk=math.inf if share is None else share,
                            rounding_passes=rounding, expert_moved=moved(served, reference) if finite else None)

        def moved(served, reference):  # the largest move of one expert's tokens since the last passed check,
            # in the expert limit's terms (over its token count's expert_scale), as the verdict reports it
            last = check.profiles[0].last if 0 in check.profiles else ()
            values = shares(served, reference, tolerance=check.tolerance, relative=check.relative)
            found = expert_shift(values, last, [r for row in reference.routes for r in row]) if last else None
            return scaled_move(found)

        clean, engine, probes = [], HFStorage.from_config(cfg, dtype=torch.bfloat16), []
        for version in range(1, CLEAN_REFITS + 1):
            train_step(built, optimizer, torch.randint(0, cfg.vocab_size, (8, 33), generator=rng))
            load(engine, version)
            probe, reference, _ = check.take_reference()
            probes.append(probe.sequences)
            clean.append(verdict(engine, version, probe, reference))
        # the versions whose probe was extended anew (the router trained: it routed fewer experts),
        # where a passed check measures the calibration again (plan.calibration.due)
        extended = [v for v in range(2, CLEAN_REFITS + 1) if probes[v - 1] != probes[v - 2]]
        faults, kept = {}, dict(check.profiles)
        for fault in FAULTS:  # each judged against the last clean check (a fault that passes is no baseline)
            check.profiles = dict(kept)
            broken = load(HFStorage.from_config(cfg, dtype=torch.bfloat16), CLEAN_REFITS + 1)
            break_engine(broken.model, fault)
            faults[fault] = verdict(broken, CLEAN_REFITS + 1, probe, reference)
        profile = check.profiles[0]
        found[state] = dict(clean=clean, faults=faults, loss=loss, experts=check.experts, probe_extended=extended,
                            tolerance=check.tolerance, relative=check.relative,
                            calibration=dict(version=profile.version, tail=profile.tail, bulk=profile.bulk,
                                             tail_limit=limits(profile).tail, bulk_limit=limits(profile).bulk))
    return found


def caught_by(message: str | None) -> str | None:
    """Which limit a serving mismatch's ``message`` names: ``expert``, ``tail`` or ``bulk`` (the
    calibrated limits), ``rounding bound``; None: no mismatch."""
    if message is None:
        return None
    for what, words in (("expert", "one expert's tokens are off"), ("tail", "the tail of its log-probs is off"),
                        ("bulk", "the bulk of its log-probs is off its calibrated")):
        if words in message:
            return what
    return "rounding bound"


def summary(found: dict) -> dict:
    """Per state: the clean refits' largest max / mean |Δ| and :func:`~megatron_refit.plan.probe.bulk`
    (against its limit), how many passed, the largest move of one expert's tokens between two clean
    checks (against its limit), and per fault its largest |Δ|, its bulk, its experts' move, whether
    the check caught it and by which limit (:func:`caught_by`); ``smallest_caught``: the caught fault that moved
    the log-probs least (its name and |Δ|)."""
    out = {}
    for state, got in found.items():
        clean = got["clean"]
        caught = {f: "message" in r for f, r in got["faults"].items()}
        moved = {f: r["max_dlogprob"] for f, r in got["faults"].items()}
        shares = {f: r.get("bulk") for f, r in got["faults"].items()}
        smallest = min((f for f in caught if caught[f]), key=lambda f: moved[f], default=None)
        moves = [r["expert_moved"] for r in clean if r.get("expert_moved") is not None]
        out[state] = dict(clean_passed=sum("message" not in r for r in clean), clean_refits=len(clean),
                          clean_expert_moved=max(moves, default=None),
                          expert_limit=next((r["expert_limit"] for r in clean if r.get("expert_limit")), None),
                          clean_max_dlogprob=max(r["max_dlogprob"] for r in clean),
                          clean_mean_dlogprob=max(r.get("mean_dlogprob", math.inf) for r in clean),
                          clean_bulk=max(r.get("bulk") or 0.0 for r in clean), bulk_limit=BULK,
                          readback=False, calibration=got["calibration"],
                          clean_calibrated=sum(bool(r.get("calibrated")) for r in clean),
                          tolerance=got["tolerance"], relative=got["relative"], loss=got["loss"],
                          experts_covered=got["experts"][0], experts_total=got["experts"][1],
                          faults={f: dict(max_dlogprob=moved[f], bulk=shares[f], caught=caught[f],
                                          caught_by=caught_by(got["faults"][f].get("message")),
                                          expert_moved=got["faults"][f].get("expert_moved"),
                                          rounding_bound_passes=got["faults"][f].get("rounding_passes", True))
                                  for f in moved},
                          smallest_caught=None if smallest is None else dict(fault=smallest,
                                                                              max_dlogprob=moved[smallest]))
    return out
