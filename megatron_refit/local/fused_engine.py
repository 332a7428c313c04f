"""The harness's engine at gen TP > 1: vLLM-shaped storage without vLLM
(:class:`~megatron_refit.engines.fused.layout.FusedLayoutStorage`), registered as
``refit.engine: fused``. It receives into every wide expert-parallel deployment the plan knows
(data-parallel attention ranks, a placement with redundant experts, a map that EPLB changed
between refits: :func:`rebalanced`, moved in place by a :class:`Balancer`),
so the train ranks' side of one is tested end to end before
an engine's own receive path takes it."""

from __future__ import annotations

import random

import torch

from megatron_refit.config.deployment import WIDE_EP_KEYS
from megatron_refit.plan.deployment import moe_layers
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


class Balancer:
    """The harness engine's load balancer: the live expert map its ranks read at the start of each
    refit (called as ``live_map``), which :meth:`move` changes while the engine serves."""

    def __init__(self, placement: ExpertPlacement):
        self.placement = placement

    def __call__(self) -> ExpertPlacement:
        return self.placement

    def move(self, storage, placement: ExpertPlacement) -> None:
        """EPLB moved the experts to ``placement``. Their bytes are scrambled (NaN in every float
        dtype) rather than moved, so that a slot the next refit does not write is caught."""
        self.placement = placement
        with torch.no_grad():
            for name, tensor in storage.tensors().items():
                if ".w13_" in name or ".w2_" in name:
                    tensor.view(torch.uint8).fill_(0xFF)

    @staticmethod
    def layers(storage) -> int:
        """The model's MoE layers (the maps' rows)."""
        return len(moe_layers(storage.source.params))
