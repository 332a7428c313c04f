"""vLLM's parameter layout on one generation TP rank, and HF pieces as views into it.

vLLM fuses projections per layer (``qkv_proj = [q; k; v]``, ``gate_up_proj = [gate; up]``,
MLA's replicated ``fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa]``,
FusedMoE ``w13_weight [E_local, 2·I_tp, H]`` with gate then up, ``w2_weight [E_local, H,
I_tp]``) and pads vocab-parallel rows per rank. In a wide expert-parallel deployment the first
dim of the FusedMoE weights is the rank's physical expert slots (EPLB's redundant experts
included): a received expert is written into its first slot and copied into the others that
hold it at the end of the refit (:class:`~megatron_refit.plan.deployment.ExpertSlots`). Given the HF pieces a rank needs
(:func:`megatron_refit.plan.gen_layout.gen_target_specs`), :func:`fused_layout` says where each
piece lives in that storage; received bytes are then unpacked straight into it.

This module imports no vLLM: :class:`FusedLayoutStorage` allocates vLLM-shaped tensors
itself (CPU tests without the engine); the real receiver applies the same layout to the
engine's own parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from megatron_refit import families
from megatron_refit.endpoint.storage import WeightsState
from megatron_refit.engines.segments import split_segments
from megatron_refit.plan.deployment import ExpertSlots, moe_layers
from megatron_refit.plan.expert_placement import ExpertPlacement, moved
from megatron_refit.plan.gen_layout import (VOCAB_PADDING, GenLayout, ModelShape, deployment_placement,
                                            gen_rank_specs)
from megatron_refit.plan.spec import ShardSpec

_VOCAB = families.vocab_names()


TRANSFORMS = {"neg_exp_fp32": (lambda t: -torch.exp(t.float()), "float32")}
"""Engine-side transforms of the family tables (``engine_transforms``): function of the sent
tensor, and the dtype the engine keeps the result in."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where an HF piece lives: ``storage[vllm_name][index]`` (index: ints and slices), or,
    with a ``transform``, what is written there from the piece at the end of a refit."""

    vllm_name: str
    index: tuple
    transform: str | None = None
    copies: tuple[tuple, ...] = ()
    """Indices into ``storage[vllm_name]`` that hold the same bytes: the other local slots of a
    routed expert (written from ``index`` at the end of a refit)."""


def expert_slots(params, layout: GenLayout, model: ModelShape, gen_index: int) -> ExpertSlots | None:
    """Where engine rank ``gen_index`` writes each routed expert it receives, in a deployment whose
    experts follow a placement (:func:`~megatron_refit.plan.gen_layout.deployment_placement`);
    None: its experts in ascending order, one slot each."""
    placement = deployment_placement(layout, model.num_experts)
    return None if placement is None else ExpertSlots(placement, gen_index % layout.deployment_size, params)


def fused_layout(pieces: list[ShardSpec], model: ModelShape, tp: int,
                 slots: ExpertSlots | None = None) -> tuple[dict, dict]:
    """``(shapes, placements)``: vLLM parameter name → (shape, dtype), HF name → Placement.
    ``slots``: a wide deployment rank's expert slots (:func:`expert_slots`)."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    placements: dict[str, Placement] = {}
    fused: dict[str, tuple[tuple[str, ...], dict[str, ShardSpec]]] = {}
    experts: dict[str, dict[int, dict[str, ShardSpec]]] = {}
    for piece in pieces:
        group = families.engine_group(piece.name)
        if group is not None and group[0] == "experts":
            m = group[1]
            experts.setdefault((m["p"], m["t"]), {}).setdefault(int(m["e"]), {})[m["m"]] = piece
        elif group is not None:
            template, m, order = group
            fused.setdefault(template.format(p=m["p"], t=m["t"]), (order, {}))[1][m["m"]] = piece
        else:
            shape = piece.shape
            if piece.name in _VOCAB:  # vLLM's per-rank rows are padded; HF rows fill a prefix
                padded = math.ceil(model.vocab_size / VOCAB_PADDING) * VOCAB_PADDING
                shape = (padded // tp, *shape[1:])
            name, transform = families.engine_name(piece.name)
            shapes[name] = (shape, piece.dtype if transform is None else TRANSFORMS[transform][1])
            placements[piece.name] = Placement(name, (slice(0, piece.shape[0]),), transform)
    for vllm_name, (order, members) in fused.items():
        vllm_name = families.engine_name(vllm_name)[0]
        start = 0
        for key in order:
            piece = members[key]
            placements[piece.name] = Placement(vllm_name, (slice(start, start + piece.shape[0]),))
            start += piece.shape[0]
        first = members[order[0]]
        shapes[vllm_name] = ((start, *first.shape[1:]), first.dtype)
    for (prefix, kind), by_expert in experts.items():
        ids = sorted(by_expert)
        prefix = families.engine_name(prefix)[0]
        w13, w2 = f"{prefix}.w13_{kind}", f"{prefix}.w2_{kind}"
        count = len(ids) if slots is None else slots.count
        for local, e in enumerate(ids):
            gate, up, down = (by_expert[e].get(k) for k in ("gate", "up", "down"))
            first, *others = (local,) if slots is None else slots.of(down.name)

            def place(name: str, *rest) -> Placement:
                return Placement(name, (first, *rest), copies=tuple((slot, *rest) for slot in others))

            if gate is not None:  # gated: w13 = [gate; up]
                n = gate.shape[0]
                placements[gate.name] = place(w13, slice(0, n))
                placements[up.name] = place(w13, slice(n, 2 * n))
                shapes[w13] = ((count, 2 * n, gate.shape[1]), gate.dtype)
            elif up is not None:  # non-gated (e.g. ReLU²): w13 is the up projection alone
                placements[up.name] = place(w13)
                shapes[w13] = ((count, *up.shape), up.dtype)
            placements[down.name] = place(w2)
            shapes[w2] = ((count, *down.shape), down.dtype)
    return shapes, placements


@dataclass(frozen=True, slots=True)
class RankLayout:
    """What one engine rank's pieces are derived from: the model's HF parameters (name ->
    (shape, dtype)), the generation layout, the model's shape and the rank's index."""

    params: dict
    layout: GenLayout
    model: ModelShape
    gen_index: int

    def build(self, placement: ExpertPlacement | None = None) -> tuple[list[ShardSpec], ExpertSlots | None, dict,
                                                                       dict]:
        """``(pieces, slots, shapes, placements)`` of this rank, its experts as ``placement``
        (default: the layout's) puts them."""
        layout = self.layout if placement is None else replace(self.layout, placement=placement)
        pieces = gen_rank_specs(self.params, layout, self.model, self.gen_index)
        slots = expert_slots(self.params, layout, self.model, self.gen_index)
        return (pieces, slots, *fused_layout(pieces, self.model, layout.tp, slots))


class FusedLayoutStorage(WeightsState):
    """Storage over vLLM-shaped storage of one generation TP rank (``state`` /
    ``require_ready``: the weights' state, for the engine loop that serves them). ``source``
    and ``live_map`` (both or neither): the rank's :class:`RankLayout`, and a reader of the
    engine's current expert map (EPLB moves experts while serving: :meth:`refresh_experts`)."""

    def __init__(self, storage: dict[str, torch.Tensor], pieces: list[ShardSpec],
                 placements: dict[str, Placement], slots: ExpertSlots | None = None, *,
                 source: RankLayout | None = None, live_map: Callable[[], ExpertPlacement] | None = None):
        self._pieces = pieces
        self._placements = placements
        self.slots = slots
        """A wide deployment rank's expert slots (None: one per expert it holds)."""
        if live_map is not None and (source is None or slots is None):
            raise ValueError("live_map: an engine's moving expert map needs the rank's RankLayout (source) and a "
                             "placement of its experts (gen_expert_parallel with a placement)")
        self._source, self._live_map = source, live_map
        self.experts_moved = 0
        """How often :meth:`refresh_experts` found the engine's experts moved and re-laid the pieces out."""
        self._staged: dict[str, torch.Tensor] = {}
        """Sent bytes of the pieces the engine keeps transformed (by HF name)."""
        self._bind(storage)

    def refresh_experts(self) -> bool:
        """Before a refit: the engine's current expert map (``live_map()``); True, and this rank's
        pieces and their views laid out for it, where it moved experts since the pieces were
        built; ``ValueError`` where it is not a map of this rank's slots."""
        if self._live_map is None:
            return False
        live = self._live_map()
        if not moved(live, self.slots.placement, len(moe_layers(self._source.params))):
            return False
        pieces, slots, shapes, placements = self._source.build(live)
        for name, (shape, _) in shapes.items():
            have = self._storage.get(name)
            if have is None or tuple(have.shape) != tuple(shape):
                raise ValueError(f"the engine's moved expert map needs {name} of shape {tuple(shape)}, the engine "
                                 f"holds {None if have is None else tuple(have.shape)}")
        self._pieces, self._placements, self.slots = pieces, placements, slots
        self._bind(self._storage)
        self.experts_moved += 1
        return True

    def _bind(self, storage: dict[str, torch.Tensor]) -> None:
        """Views of every piece into ``storage`` (vLLM-named tensors)."""
        views, transformed, copies = {}, [], []
        for piece in self._pieces:
            place = self._placements[piece.name]
            view = storage[place.vllm_name][place.index]
            for copy, index in enumerate((place.index, *place.copies)):
                where = storage[place.vllm_name][index]
                if tuple(where.shape) != piece.shape:
                    raise ValueError(
                        f"{piece.name}: vLLM storage {place.vllm_name}{list(index)} has shape "
                        f"{tuple(where.shape)}, the piece needs {piece.shape}"
                    )
                if copy:
                    copies.append((where, view))
            if place.transform is not None:  # received into a staging tensor, written at finalize
                staged = self._staged.get(piece.name)
                if staged is None or staged.device != view.device:
                    staged = self._staged[piece.name] = torch.zeros(piece.shape, dtype=getattr(torch, piece.dtype),
                                                                    device=view.device)
                transformed.append((view, staged, TRANSFORMS[place.transform][0]))
                view = staged
            views[piece.name] = view
            if piece.name in _VOCAB:  # as vLLM's loader does: padding rows beyond the vocab are zero
                storage[place.vllm_name][piece.shape[0]:].zero_()
        self._storage, self._views, self._transformed, self._copies = storage, views, transformed, copies

    @classmethod
    def allocate(cls, params: dict[str, tuple[tuple[int, ...], str]], layout: GenLayout, model: ModelShape,
                 *, gen_index: int, device: str | torch.device = "cpu",
                 live_map: Callable[[], ExpertPlacement] | None = None) -> FusedLayoutStorage:
        source = RankLayout(params, layout, model, gen_index)
        pieces, slots, shapes, placements = source.build()
        storage = {name: torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
                   for name, (shape, dtype) in shapes.items()}
        return cls(storage, pieces, placements, slots, source=source, live_map=live_map)

    def target_specs(self) -> list[ShardSpec]:
        return list(self._pieces)

    def buffer(self, name: str) -> torch.Tensor:
        return self._views[name]

    def finalize(self) -> None:
        """Write the other slots of each expert a rank holds twice, and the parameters the engine
        keeps transformed (e.g. Mamba's ``A``)."""
        with torch.no_grad():
            for where, view in self._copies:
                where.copy_(view)
            for view, staged, transform in self._transformed:
                view.copy_(transform(staged))

    def storage(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self._storage.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The vLLM-named tensors themselves (what an engine's own code writes into)."""
        return dict(self._storage)

    @property
    def source(self) -> RankLayout | None:
        """What this rank's pieces are derived from (None: given as they are)."""
        return self._source


def expected_storage(full: dict[str, torch.Tensor], pieces: list[ShardSpec], model: ModelShape,
                     tp: int, slots: ExpertSlots | None = None) -> dict[str, torch.Tensor]:
    """What a rank's vLLM storage must hold, filled from full HF tensors (vocab padding
    rows zero; segmented tensors split as the pieces' segments say; every slot of an expert)."""
    shapes, placements = fused_layout(pieces, model, tp, slots)
    out = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, (shape, dtype) in shapes.items()}
    full = split_segments(full, {piece.name: piece.global_shape for piece in pieces})
    for piece in pieces:
        place = placements[piece.name]
        value = full[piece.name][tuple(slice(a, b) for a, b in piece.box)]
        for index in (place.index, *place.copies):
            out[place.vllm_name][index] = value if place.transform is None else TRANSFORMS[place.transform][0](value)
    return out
