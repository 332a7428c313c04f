"""Sender assignment per class of identical gen ranks (pure): which train rank sends each
piece that the gen ranks need, with every piece validated first."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from operator import itemgetter

from megatron_refit.packing import Transfer, _numel
from megatron_refit.plan_checks import ITEMSIZE, PlanError, check_target, check_tiling, gc_paused, index_specs
from megatron_refit.spec import Box, ShardSpec, intersect, relative


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


Piece = tuple[Box, tuple[int, ...], int]
"""``(train box, senders, nbytes)``: one train box overlapping a gen piece; the class's
j-th gen rank receives it from ``senders[j % len(senders)]``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SenderPlan:
    """Validated sender assignment per class of identical gen ranks (pure).

    The compact form of a plan: what :meth:`RefitPlan.build` expands into transfers and
    buckets. The dry run gets the same senders from
    :class:`megatron_refit.family_plan.FamilyPlan`, without a piece per class and parameter.
    Senders are balanced by water-filling: the D gen ranks of a class that need a train
    box held by h train ranks get it from the holders in order of (bytes assigned so far,
    rank), round robin, so each holder sends it D // h or D // h + 1 times (with D = 1
    this is the least-loaded holder, lowest rank on ties).
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
        num_gen = sum(len(ranks) for ranks, _ in classes)
        ranks_seen = sorted(rank for ranks, _ in classes for rank in ranks)
        if ranks_seen != list(range(num_gen)):
            raise PlanError(f"gen ranks must be 0..{num_gen - 1}, got {ranks_seen}")
        train_index, train_meta = index_specs("train", train_specs)
        for name in sorted(train_meta):
            check_tiling(name, train_meta[name].global_shape, list(train_index[name]))
        load = [0] * len(train_specs)
        assigned = _assign(train_index, train_meta, sorted(classes, key=lambda c: c[0][0]), load)
        needed = {spec.name for _, items in assigned for spec, _ in items}
        return cls(classes=assigned, train_bytes=tuple(load),
                   unused_train_params=tuple(sorted(set(train_meta) - needed)))

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

    def pair_bytes(self) -> dict[tuple[int, int], int]:
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


def _assign(
    train_index: dict[str, dict[Box, list[int]]],
    train_meta: dict[str, ShardSpec],
    classes: list[GenClass],
    load: list[int],
) -> tuple[tuple[tuple[int, ...], tuple[tuple[ShardSpec, tuple[Piece, ...]], ...]], ...]:
    """Check every gen class's pieces against the trainer's and assign their senders, name
    by name (sorted), class by class; adds the bytes assigned to ``load``."""
    by_name = []
    for ranks, specs in classes:
        pieces = {spec.name: spec for spec in specs}
        if len(pieces) != len(specs):
            name = next(name for name in pieces if sum(spec.name == name for spec in specs) > 1)
            raise PlanError(f"{name}: listed twice on gen rank {ranks[0]}")
        by_name.append(pieces)
    out: list[list[tuple[ShardSpec, tuple[Piece, ...]]]] = [[] for _ in classes]
    copies = [len(ranks) for ranks, _ in classes]
    # Memos by object identity: gen pieces share box objects (see gen_target_classes), and
    # every box and holder list here stays alive (held by its spec or the index) meanwhile.
    overlap: dict[tuple[int, int], int] = {}
    numel_of: dict[int, int] = {}
    single: dict[int, tuple[int, ...]] = {}
    for name in sorted(set().union(*by_name)):
        train = train_meta.get(name)
        if train is None:
            raise PlanError(f"HF name {name} is not produced by the trainer")
        shape, dtype = train.global_shape, train.dtype
        boxes = list(train_index[name].items())
        itemsize = ITEMSIZE[dtype]
        if len(boxes) == 1 and len(boxes[0][1]) == 1:  # fast path: one train box, one holder
            _assign_whole(name, boxes[0], shape, dtype, itemsize, by_name, copies, load, out, overlap)
            continue
        for c, pieces_of in enumerate(by_name):
            spec = pieces_of.get(name)
            if spec is None:
                continue
            check_target(spec.name, spec.global_shape, spec.dtype, shape, dtype)
            gen_box = spec.box
            gid = id(gen_box)
            pieces = []
            total = 0
            for train_box, holders in boxes:
                key = (id(train_box), gid)
                numel = overlap.get(key)
                if numel is None:
                    box = intersect(train_box, gen_box) if gen_box else train_box
                    numel = overlap[key] = 0 if box is None else _numel(box)
                if not numel:
                    continue
                nbytes = numel * itemsize
                total += numel
                if len(holders) == 1:
                    load[holders[0]] += nbytes * copies[c]
                    senders = single.get(id(holders))
                    if senders is None:
                        senders = single[id(holders)] = tuple(holders)
                else:
                    order = sorted(holders, key=lambda rank: (load[rank], rank))[: copies[c]]
                    base, extra = divmod(copies[c], len(order))
                    for i, rank in enumerate(order):
                        load[rank] += nbytes * (base + (i < extra))
                    senders = tuple(order)
                pieces.append((train_box, senders, nbytes))
            expected = numel_of.get(gid)
            if expected is None:
                expected = numel_of[gid] = _numel(gen_box)
            assert total == expected, spec
            if len(pieces) > 1:
                pieces.sort(key=itemgetter(0))
            out[c].append((spec, tuple(pieces)))
    return tuple((tuple(ranks), tuple(items)) for (ranks, _), items in zip(classes, out))


def _assign_whole(name, entry, shape, dtype, itemsize, by_name, copies, load, out, overlap) -> None:
    """:func:`_assign` for a name that one train rank holds whole (e.g. an expert under EP)."""
    train_box, holders = entry
    holder = holders[0]
    senders = (holder,)
    tid = id(train_box)
    shared: dict[int, tuple[Piece]] = {}  # classes with equal slices share one pieces tuple
    for c, pieces_of in enumerate(by_name):
        spec = pieces_of.get(name)
        if spec is None:
            continue
        check_target(spec.name, spec.global_shape, spec.dtype, shape, dtype)
        key = (tid, id(spec.box))
        numel = overlap.get(key)
        if numel is None:
            numel = overlap[key] = _numel(spec.box)
        nbytes = numel * itemsize
        load[holder] += nbytes * copies[c]
        pieces = shared.get(nbytes)
        if pieces is None:
            pieces = shared[nbytes] = ((train_box, senders, nbytes),)
        out[c].append((spec, pieces))
