"""Sender assignment per class of identical gen ranks, piece by piece: the plain reference
that :class:`~megatron_refit.plan.assignment.Assignment` (what plans and dry runs use, by
groups of parameters) is tested against field for field. It needs a ShardSpec per gen
piece, which the runtime never builds, so it lives with the tests."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron_refit.errors import PlanError
from megatron_refit.plan.assignment import Assignment, Piece
from megatron_refit.plan.buckets import Transfer
from megatron_refit.plan.checks import gc_paused
from megatron_refit.plan.gen_layout import GenTargets
from megatron_refit.plan.spec import ShardSpec, intersect, relative

GenClass = tuple[tuple[int, ...], list[ShardSpec]]
"""Gen ranks holding identical pieces (e.g. the engine's DP replicas of one TP rank) and those pieces."""


def gen_classes(gen_specs: dict[int, list[ShardSpec]]) -> list[GenClass]:
    """Group gen ranks whose pieces are identical, in order of their first rank."""
    groups: dict[tuple, list[int]] = {}
    keys: dict[int, tuple] = {}  # by list identity: ranks given one list (gathered replicas) are keyed once
    for rank in sorted(gen_specs):
        specs = gen_specs[rank]
        key = keys.get(id(specs))
        if key is None:
            key = keys[id(specs)] = tuple(sorted((s.name, s.box, s.global_shape, s.dtype) for s in specs))
        groups.setdefault(key, []).append(rank)
    return [(tuple(ranks), gen_specs[ranks[0]]) for ranks in groups.values()]


@dataclass(frozen=True, kw_only=True, slots=True)
class SenderPlan:
    """Validated sender assignment per class of identical gen ranks (pure).

    The reference form of the assignment (see the module docstring): every gen piece of
    every class with its train pieces, listed one by one. Senders take turns
    (:mod:`megatron_refit.plan.box_groups`): the boxes one set of h holders holds are
    numbered, and the D gen ranks that need box n get it from the holders in turn from
    holder n % h on, so each holder sends it D // h or D // h + 1 times.
    """

    classes: tuple[tuple[tuple[int, ...], tuple[tuple[ShardSpec, tuple[Piece, ...]], ...]], ...]
    """``(gen ranks, ((gen piece, its train pieces), ...))`` per class; pieces sorted by name."""
    train_bytes: tuple[int, ...]
    """Bytes each train rank sends."""
    unused_train_params: tuple[str, ...]
    """Train parameters that no gen rank needs."""

    @classmethod
    def build(cls, train_specs: dict[int, list[ShardSpec]], classes: list[GenClass]) -> SenderPlan:
        """Validate and assign senders; ``PlanError`` names the first bad parameter."""
        with gc_paused():
            return cls._build(train_specs, classes)

    @classmethod
    def _build(cls, train_specs: dict[int, list[ShardSpec]], classes: list[GenClass]) -> SenderPlan:
        classes = sorted(classes, key=lambda c: c[0][0] if c[0] else -1)
        assignment = Assignment.build(train_specs, targets_of(classes))
        by_name = [{spec.name: spec for spec in specs} for _, specs in classes]
        assigned = tuple((tuple(ranks), tuple((by_name[c][name], pieces) for name, _, _, pieces in assignment.items(c)))
                         for c, (ranks, _) in enumerate(classes))
        return cls(classes=assigned, train_bytes=assignment.train_bytes,
                   unused_train_params=assignment.unused_train_params)

    def gen_bytes(self) -> dict[int, int]:
        """Bytes each gen rank receives (= holds)."""
        out = {}
        for ranks, items in self.classes:
            nbytes = sum(piece[2] for _, pieces in items for piece in pieces)
            out.update(dict.fromkeys(ranks, nbytes))
        return dict(sorted(out.items()))

    @property
    def num_transfers(self) -> int:
        return sum(len(ranks) * sum(len(pieces) for _, pieces in items) for ranks, items in self.classes)

    def route_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes per (train rank, gen rank) pair."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for ranks, items in self.classes:
            by_senders: dict[tuple[int, ...], int] = defaultdict(int)
            for _, pieces in items:
                for _, senders, nbytes in pieces:
                    by_senders[senders] += nbytes
            for j, gen_rank in enumerate(ranks):
                for senders, nbytes in by_senders.items():
                    out[senders[j % len(senders)], gen_rank] += nbytes
        return dict(out)

    def transfers(self, *, src: int | None = None, dst: int | None = None) -> list[Transfer]:
        """Every transfer, ordered by gen rank, then name; with ``src`` / ``dst`` only those
        that train rank sends / that gen rank receives (a rank's own part of a large plan)."""
        out = []
        for ranks, items in self.classes:
            wanted = [(j, rank) for j, rank in enumerate(ranks) if dst is None or rank == dst]
            if not wanted:
                continue
            for spec, pieces in items:
                for train_box, senders, nbytes in pieces:
                    if src is not None and src not in senders:
                        continue
                    box = intersect(train_box, spec.box)
                    src_box, dst_box = relative(box, train_box), relative(box, spec.box)
                    for j, gen_rank in wanted:
                        sender = senders[j % len(senders)]
                        if src is None or sender == src:
                            out.append(Transfer(spec.name, sender, gen_rank, src_box, dst_box, box, spec.dtype,
                                                nbytes))
        out.sort(key=lambda t: t.dst_rank)  # stable: names stay in order within a gen rank
        return out


def targets_of(classes: list[GenClass]) -> GenTargets:
    """The gen classes' pieces in the compact form the assignment plans from (one box per
    class and parameter); ``PlanError`` for a name listed twice on a rank or a parameter
    whose shape or dtype differs between gen ranks."""
    params: dict[str, list] = {}
    for c, (ranks, specs) in enumerate(classes):
        seen = set()
        for spec in specs:
            if spec.name in seen:
                raise PlanError(f"{spec.name}: listed twice on gen rank {ranks[0]}")
            seen.add(spec.name)
            entry = params.get(spec.name)
            if entry is None:
                entry = params[spec.name] = [spec.global_shape, spec.dtype, [None] * len(classes), ranks[0]]
            elif (entry[0], entry[1]) != (spec.global_shape, spec.dtype):
                raise PlanError(f"{spec.name}: global shape {entry[0]} dtype {entry[1]} on gen rank {entry[3]}, "
                                f"{spec.global_shape} {spec.dtype} on gen rank {ranks[0]}")
            entry[2][c] = spec.box
    interned: dict[tuple, tuple] = {}  # equal box tuples as one object: the assignment groups by identity
    out = {}
    for name in sorted(params):
        shape, dtype, boxes, _ = params[name]
        boxes = tuple(boxes)
        out[name] = (shape, dtype, interned.setdefault(boxes, boxes))
    return GenTargets(ranks=tuple(tuple(ranks) for ranks, _ in classes), params=out)
