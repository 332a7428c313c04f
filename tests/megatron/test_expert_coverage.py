"""The serving probe routes every expert (``refit.verify_serving``, #50 item 3): at 64 experts
top-8 in bf16, trained TP2 with sequence parallelism x EP2, one expert of the first MoE layer is
reachable from one token id only. The random probe never routes it (a random probe of 64 tokens
holds that token with probability 1 - (4095/4096)**64 = 1.6 %), so an engine whose copy of that
expert is broken passes a check on the random probe; the probe extended under the trainer's
router (:meth:`conversion.serving.MegatronForward.cover`) routes every expert of every layer, and
the same engine fails it while a clean engine passes it. The per-token routes the calibrated check
groups the probe by (:meth:`conversion.routing.RoutedExperts.per_token`) are the same on both TP
ranks, and the token that alone reaches the expert is routed to it.
"""

from __future__ import annotations

import re

import pytest

from megatron_refit.local.launch import run_spawned

pytestmark = pytest.mark.slow

EXPERT = 37
"""The hard-to-reach expert of layer 0 (of 64)."""
FEATURE = 5
"""The hidden dimension that alone routes to it."""
FC2 = re.compile(r"^decoder\.layers\.0\.mlp\.experts\."
                 r"(?:local_experts\.(\d+)\.linear_fc2\.weight|linear_fc2\.weight(\d+))$")
"""Layer 0's local experts' down projections (SequentialMLP's or TEGroupedMLP's names)."""


def _rank(rank, world, port):
    import time

    import torch

    from conversion.serving import trainer_forward
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage
    from megatron_refit.errors import ServingMismatchError
    from megatron_refit.plan.layout import TrainLayout
    from megatron_refit.plan.probe import Reference, compare, default_tolerance, make_probe, relative_tolerance

    init_gloo(rank, world, port)
    layout = TrainLayout(tp=2, ep=2, sequence_parallel=True)
    init_model_parallel(layout)
    cfg = hf_config("qwen3-moe", experts=64, num_experts_per_tok=8, vocab=4096)
    built = build_model(cfg, layout, dtype=torch.bfloat16)
    probe = make_probe(None, cfg.vocab_size)
    target = next(t for t in range(1000, cfg.vocab_size) if all(t not in s for s in probe.sequences))
    params = dict(built.model[0].named_parameters())
    embedding = params["embedding.word_embeddings.weight"]  # vocab-parallel rows
    first = rank * embedding.shape[0]
    with torch.no_grad():
        # only `target` carries FEATURE into layer 0; attention writes nothing onto it; only
        # EXPERT reads it, and reads nothing else: its logit is 0 for every other token
        embedding[:, FEATURE] = 0
        if first <= target < first + embedding.shape[0]:
            embedding[target - first, FEATURE] = 1.0
        params["decoder.layers.0.self_attention.linear_proj.weight"][FEATURE] = 0
        router = params["decoder.layers.0.mlp.router.weight"]
        router[:, FEATURE] = 0
        router[EXPERT] = 0
        router[EXPERT, FEATURE] = 1.0
        # and what it adds matters: its down projection x200 (a random init's experts add next to
        # nothing to the residual stream, so that breaking one moves no log-prob)
        per_rank = 64 // layout.ep
        for name, param in params.items():
            hit = FC2.search(name)
            if hit and int(hit.group(1) or hit.group(2)) + rank * per_rank == EXPERT:
                param.mul_(200.0)

    forward = trainer_forward(built.model, cfg)
    forward.prepare(fp8=False)
    base_reference = Reference(forward(probe.sequences), forward.scale)
    base_experts = forward.experts
    start = time.perf_counter()
    sequences = forward.cover(probe.sequences, budget=1024)
    cover_s = time.perf_counter() - start
    reference = Reference(forward(sequences), forward.scale)
    covered = forward.experts
    routes = forward.routes  # per scored token, the (layer, expert) pairs its position is routed to
    weights = dict(built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False))
    if rank:
        return routes
    assert any(FC2.search(n) for n in params), sorted(params)
    found = dict(cover_s=round(cover_s, 2), base=base_experts, covered=covered,
                 added=len(sequences) - len(probe.sequences),
                 reaches=any(target in s for s in sequences[len(probe.sequences):]), routes=routes,
                 target_routes=[routes[i][t] for i, s in enumerate(sequences) for t, token in enumerate(s[:-1])
                                if token == target],
                 lengths=[len(s) - 1 for s in sequences])
    engine = HFStorage.from_config(cfg, dtype=torch.bfloat16)
    for name, tensor in weights.items():
        engine.buffer(name).copy_(tensor)
    engine.set_state("ready", 1)
    tolerance, relative = default_tolerance("bfloat16"), relative_tolerance("bfloat16")
    extended = type(probe)(tuple(sequences))

    def check(probe_, ref):  # the serving check's own comparison, its bf16 defaults
        try:
            return compare(engine.score(probe_.sequences), ref, probe_, tolerance=tolerance, relative=relative,
                           floor=tolerance, replica=0, version=1)
        except ServingMismatchError as exc:
            return dict(max_dlogprob=exc.max_dlogprob, message=str(exc))

    found["clean"] = check(extended, reference)
    with torch.no_grad():  # the engine's copy of EXPERT in layer 0 broken
        engine.buffer(f"model.layers.0.mlp.experts.{EXPERT}.down_proj.weight").neg_()
    found["broken_base"] = check(probe, base_reference)
    found["broken_extended"] = check(extended, reference)
    return found


def test_the_probe_routes_every_expert_and_catches_one_no_random_probe_reaches():
    found, other = run_spawned(_rank, 2, timeout_s=600)
    routes = found.pop("routes")
    print(found)
    # the routes the calibrated check groups tokens by: each scored token's 8 experts in each of the 2 MoE layers,
    # the same on both TP ranks though each router saw its own sequence-parallel half of the positions
    assert routes == other and [len(r) for r in routes] == found["lengths"]
    assert all(len(pairs) == 16 and sorted({layer for layer, _ in pairs}) == [0, 1] for r in routes for pairs in r)
    assert found["target_routes"] and all((0, EXPERT) in pairs for pairs in found["target_routes"])
    covered, total = found["covered"]
    assert total == 2 * 64 and covered == total  # every (layer, expert) of the two MoE layers
    assert found["base"][1] == total and found["base"][0] < total  # the random probe misses some: EXPERT
    assert found["reaches"] and 0 < found["added"] <= 1024 // 16
    assert isinstance(found["clean"], float) and found["clean"] <= 0.02  # no false alarm on the extended probe
    assert isinstance(found["broken_base"], float)  # the random probe never routes EXPERT: it passes
    broken = found["broken_extended"]
    assert isinstance(broken, dict), f"the extended probe must catch the broken expert (max |Δ| {broken})"
    assert broken["max_dlogprob"] > 0.1 and "does not serve the trainer's model" in broken["message"]
