"""vLLM's parameter layout on one generation TP rank, and HF pieces as views into it.

vLLM fuses projections per layer (``qkv_proj = [q; k; v]``, ``gate_up_proj = [gate; up]``,
MLA's replicated ``fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa]``,
FusedMoE ``w13_weight [E_local, 2·I_tp, H]`` with gate then up, ``w2_weight [E_local, H,
I_tp]``) and pads vocab-parallel rows per rank. Given the HF pieces a rank needs
(:func:`megatron_refit.plan.gen_layout.gen_target_specs`), :func:`fused_layout` says where each
piece lives in that storage; received bytes are then unpacked straight into it.

This module imports no vLLM: :class:`FusedLayoutStorage` allocates vLLM-shaped tensors
itself (CPU tests without the engine); the real receiver applies the same layout to the
engine's own parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_refit import families
from megatron_refit.endpoint.storage import WeightsState
from megatron_refit.engines.segments import split_segments
from megatron_refit.plan.gen_layout import VOCAB_PADDING, GenLayout, ModelShape, gen_target_specs
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


def fused_layout(pieces: list[ShardSpec], model: ModelShape, tp: int) -> tuple[dict, dict]:
    """``(shapes, placements)``: vLLM parameter name → (shape, dtype), HF name → Placement."""
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
        for local, e in enumerate(ids):
            gate, up, down = (by_expert[e].get(k) for k in ("gate", "up", "down"))
            if gate is not None:  # gated: w13 = [gate; up]
                n = gate.shape[0]
                placements[gate.name] = Placement(w13, (local, slice(0, n)))
                placements[up.name] = Placement(w13, (local, slice(n, 2 * n)))
                shapes[w13] = ((len(ids), 2 * n, gate.shape[1]), gate.dtype)
            elif up is not None:  # non-gated (e.g. ReLU²): w13 is the up projection alone
                placements[up.name] = Placement(w13, (local,))
                shapes[w13] = ((len(ids), *up.shape), up.dtype)
            placements[down.name] = Placement(w2, (local,))
            shapes[w2] = ((len(ids), *down.shape), down.dtype)
    return shapes, placements


class FusedLayoutStorage(WeightsState):
    """Storage over vLLM-shaped storage of one generation TP rank (``state`` /
    ``require_ready``: the weights' state, for the engine loop that serves them)."""

    def __init__(self, storage: dict[str, torch.Tensor], pieces: list[ShardSpec],
                 placements: dict[str, Placement]):
        self._pieces = pieces
        self._placements = placements
        self._staged: dict[str, torch.Tensor] = {}
        """Sent bytes of the pieces the engine keeps transformed (by HF name)."""
        self._bind(storage)

    def _bind(self, storage: dict[str, torch.Tensor]) -> None:
        """Views of every piece into ``storage`` (vLLM-named tensors)."""
        views, transformed = {}, []
        for piece in self._pieces:
            place = self._placements[piece.name]
            view = storage[place.vllm_name][place.index]
            if tuple(view.shape) != piece.shape:
                raise ValueError(
                    f"{piece.name}: vLLM storage {place.vllm_name}{list(place.index)} has shape "
                    f"{tuple(view.shape)}, the piece needs {piece.shape}"
                )
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
        self._storage, self._views, self._transformed = storage, views, transformed

    @classmethod
    def allocate(cls, params: dict[str, tuple[tuple[int, ...], str]], layout: GenLayout, model: ModelShape,
                 *, gen_index: int, device: str | torch.device = "cpu") -> FusedLayoutStorage:
        pieces = gen_target_specs(params, layout, model, style="vllm")[gen_index]
        shapes, placements = fused_layout(pieces, model, layout.tp)
        storage = {name: torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
                   for name, (shape, dtype) in shapes.items()}
        return cls(storage, pieces, placements)

    def target_specs(self) -> list[ShardSpec]:
        return list(self._pieces)

    def buffer(self, name: str) -> torch.Tensor:
        return self._views[name]

    def finalize(self) -> None:
        """Write the parameters the engine keeps transformed (e.g. Mamba's ``A``)."""
        with torch.no_grad():
            for view, staged, transform in self._transformed:
                view.copy_(transform(staged))

    def storage(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self._storage.items()}


def expected_storage(full: dict[str, torch.Tensor], pieces: list[ShardSpec], model: ModelShape,
                     tp: int) -> dict[str, torch.Tensor]:
    """What a rank's vLLM storage must hold, filled from full HF tensors (vocab padding
    rows zero; segmented tensors split as the pieces' segments say)."""
    shapes, placements = fused_layout(pieces, model, tp)
    out = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, (shape, dtype) in shapes.items()}
    full = split_segments(full, {piece.name: piece.global_shape for piece in pieces})
    for piece in pieces:
        place = placements[piece.name]
        value = full[piece.name][tuple(slice(a, b) for a, b in piece.box)]
        out[place.vllm_name][place.index] = value if place.transform is None else TRANSFORMS[place.transform][0](value)
    return out
