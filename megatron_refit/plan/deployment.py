"""Which ranks of one engine deployment hold each routed expert under wide expert parallelism (pure).

A **deployment** is one engine instance of ``attention_dp`` (D) data-parallel ranks of ``tp`` (T)
tensor-parallel ranks (vLLM ``--data-parallel-size D --tensor-parallel-size T
--enable-expert-parallel``): its rank ``i = dp_rank * T + tp_rank`` is vLLM's flattened EP rank.
Attention and the other dense weights are TP-sharded over T and the same on the D ranks of one
TP rank; the routed experts are whole, on the ranks of an
:class:`~megatron_refit.plan.expert_placement.ExpertPlacement` over ``D * T`` (its physical slots,
redundant experts and per-layer physical->logical maps).

**MoE layer order.** The placement's maps are indexed by MoE layer, as vLLM's EPLB indexes them:
the position of a decoder layer among the layers that hold routed experts, sorted by HF layer
index (DeepSeek-V3's layers 3..60 are MoE layers 0..57). One map stands for every layer. A map per
decoder layer (SGLang's ``ExpertLocationMetadata``, dense layers included) must be cut to the MoE
layers' rows first: a row count other than the MoE layers' is refused.

An engine rank writes a received logical expert into every local slot that holds it, two on one
rank included: :func:`local_slots` (the placement's ``slots_of`` regrouped), after
:func:`moe_layers` turned the HF layer index of the expert's name into its MoE layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from megatron_refit.plan.expert_placement import ExpertPlacement, rank_slots, slots_of
from megatron_refit.plan.roles import EXPERT_RE

_LAYER_ID = re.compile(r"(?:^|\.)(\d+)(?=\.)")


def layer_index(name: str) -> int | None:
    """The HF decoder layer of a routed expert's parameter: the last index in its name before
    the expert's (``model.layers.5.mlp.experts.17.up_proj.weight`` → 5); None for a name that is
    not a routed expert's or has no layer index."""
    match = EXPERT_RE.search(name)
    return None if match is None else _prefix_layer(name[: match.start("expert")])


def _prefix_layer(prefix: str) -> int | None:
    found = _LAYER_ID.findall(prefix)
    return int(found[-1]) if found else None


def moe_layers(names: Iterable[str]) -> dict[int, int]:
    """``{HF layer index: MoE layer index}`` of the layers whose routed experts ``names`` hold: the
    index the placement's maps are read at (see the module docstring)."""
    return _positions(layer for name in names if (layer := layer_index(name)) is not None)


def _positions(layers: Iterable[int]) -> dict[int, int]:
    """``{HF layer index: its position among ``layers``, sorted}``: the MoE layer order."""
    return {layer: position for position, layer in enumerate(sorted(set(layers)))}


def holders_per_expert(placement: ExpertPlacement, moe_layer: int) -> tuple[tuple[int, ...], ...]:
    """Per logical expert, the ranks that hold at least one slot of it in MoE layer ``moe_layer``,
    ascending (:func:`~megatron_refit.plan.expert_placement.ranks_holding` for every expert, in one
    pass over the slots)."""
    row = placement.layer_map(moe_layer)
    held: list[list[int]] = [[] for _ in range(placement.num_logical_experts)]
    for rank in range(placement.ep_size):
        for physical in rank_slots(placement, rank):
            ranks = held[row[physical]]
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    return tuple(map(tuple, held))


def local_slots(placement: ExpertPlacement, ep_rank: int, moe_layer: int) -> dict[int, tuple[int, ...]]:
    """``{logical expert: its local slot indices}`` on rank ``ep_rank`` in MoE layer ``moe_layer``:
    where an engine rank writes each logical expert it receives (a rank receives each once, however
    many of its slots hold it)."""
    out: dict[int, list[int]] = {}
    for local, logical in slots_of(placement, ep_rank, moe_layer):
        out.setdefault(logical, []).append(local)
    return {logical: tuple(slots) for logical, slots in sorted(out.items())}


class ExpertHolders:
    """The deployment ranks that hold each routed expert, per MoE layer (each layer's map read
    once). A layer is named by its experts' **prefix**: a parameter's name up to its expert index
    (``model.layers.5.mlp.experts.``)."""

    def __init__(self, placement: ExpertPlacement, prefixes: Iterable[str]):
        self.placement = placement
        self._order: dict[str, int] | None = None  # prefix -> MoE layer, where the maps differ by layer
        if len(placement.physical_to_logical) > 1:
            layers = {}
            for prefix in prefixes:
                layers[prefix] = _prefix_layer(prefix)
                if layers[prefix] is None:
                    raise ValueError(f"{prefix}*: routed experts without a layer index in their name, and the "
                                     "expert placement has one map per MoE layer")
            position = _positions(layers.values())
            if len(position) != len(placement.physical_to_logical):
                raise ValueError(f"the expert placement has {len(placement.physical_to_logical)} physical_to_logical "
                                 f"maps, the model {len(position)} MoE layers (one map per MoE layer, in layer "
                                 "order; or one for all)")
            self._order = {prefix: position[layer] for prefix, layer in layers.items()}
        self._rows: dict[int, tuple[tuple[int, ...], ...]] = {}

    def moe_layer(self, prefix: str) -> int:
        """The MoE layer of ``prefix``: the index the placement's maps are read at."""
        return 0 if self._order is None else self._order[prefix]

    def of_layer(self, prefix: str) -> tuple[tuple[int, ...], ...]:
        """Per logical expert, the ranks that hold it in the MoE layer of ``prefix``
        (:func:`holders_per_expert`)."""
        moe_layer = self.moe_layer(prefix)
        rows = self._rows.get(moe_layer)
        if rows is None:
            rows = self._rows[moe_layer] = holders_per_expert(self.placement, moe_layer)
        return rows


def expert_prefixes(names: Iterable[str]) -> set[str]:
    """The prefixes (``model.layers.5.mlp.experts.``) of the routed experts among ``names``."""
    return {name[: match.start("expert")] for name in names if (match := EXPERT_RE.search(name)) is not None}


class ExpertSlots:
    """Where deployment rank ``rank`` writes each routed expert it receives: the local slots of
    its MoE layer that hold it (:func:`local_slots`), two on one rank included. ``names``: every
    HF parameter of the model (the MoE layer order is the model's, not this rank's)."""

    def __init__(self, placement: ExpertPlacement, rank: int, names: Iterable[str]):
        self.placement, self.rank = placement, rank
        self.count = len(rank_slots(placement, rank))
        """Local slots per MoE layer on this rank: the first dim of its FusedMoE weights."""
        self._holders = ExpertHolders(placement, expert_prefixes(names))
        self._layers: dict[int, dict[int, tuple[int, ...]]] = {}

    def of(self, name: str) -> tuple[int, ...]:
        """The local slots that hold the expert of parameter ``name`` (``ValueError`` where this
        rank holds none: the plan sent it elsewhere)."""
        match = EXPERT_RE.search(name)
        if match is None:
            raise ValueError(f"{name}: not a routed expert's parameter")
        moe_layer = self._holders.moe_layer(name[: match.start("expert")])
        layer = self._layers.get(moe_layer)
        if layer is None:
            layer = self._layers[moe_layer] = local_slots(self.placement, self.rank, moe_layer)
        slots = layer.get(int(match.group("expert")), ())
        if not slots:
            raise ValueError(f"{name}: deployment rank {self.rank} holds no slot of its expert in MoE layer "
                             f"{moe_layer}")
        return slots
