"""The harness's engine at gen TP > 1: vLLM-shaped storage without vLLM
(:class:`~megatron_refit.engines.fused.layout.FusedLayoutStorage`), registered as
``refit.engine: fused``. It receives into every wide expert-parallel deployment the plan knows
(data-parallel attention ranks, a placement with redundant experts, a map that EPLB changed
between refits: :func:`rebalanced`), so the train ranks' side of one is tested end to end before
an engine's own receive path takes it."""

from __future__ import annotations

import random

from megatron_refit.config.deployment import WIDE_EP_KEYS
from megatron_refit.plan.expert_placement import ExpertPlacement
from megatron_refit.registry import Engine, engine_names, register_engine

NAME = "fused"

if NAME not in engine_names():
    register_engine(Engine(name=NAME, engine_loads=("in_place",), swaps=("in_place",), wide_ep=WIDE_EP_KEYS,
                           writes="writes into vLLM-shaped tensors without vLLM (the test harness's storage)"))


def rebalanced(placement: ExpertPlacement, seed: int, *, layers: int) -> ExpertPlacement:
    """``placement`` after an EPLB rebalance (seeded): per MoE layer, every logical expert in one
    slot at least, the redundant slots on random experts, shuffled; the first two slots hold one
    expert (two replicas on one rank, under ``linear`` with two or more slots on rank 0)."""
    rng = random.Random(seed)
    experts, redundant = placement.num_logical_experts, placement.num_redundant
    rows = []
    for _ in range(layers):
        row = list(range(experts))
        rng.shuffle(row)
        extra = [rng.randrange(experts) for _ in range(redundant)]
        if extra:
            extra[0] = row[0]
            row = [row[0], extra[0], *row[1:], *extra[1:]]
        rows.append(tuple(row))
    return ExpertPlacement(num_logical_experts=experts, ep_size=placement.ep_size, num_redundant=redundant,
                           strategy=placement.strategy, physical_to_logical=tuple(rows))
