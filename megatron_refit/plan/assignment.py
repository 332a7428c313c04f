"""Sender assignment by groups of parameters (pure): the one implementation of who sends
what. ``prepare()`` (:class:`megatron_refit.plan.refit_plan.RefitPlan`), the dry run and the
cost model plan with it, without a piece per gen class and parameter; a rank expands only
its own transfers (:meth:`Assignment.transfers`). ``megatron_refit/testing/reference_senders.py`` holds the
piece-by-piece form it is tested against, and tests/unit/test_assignment.py the turns written out.

Parameters that match box for box on both sides form groups, and a train box held by
several ranks is sent by its holders in turns (:mod:`megatron_refit.plan.box_groups`): each
parameter is planned in one step, whatever the number of gen classes and train replicas.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter, itemgetter

from megatron_refit.errors import PlanError
from megatron_refit.plan.box_groups import BoxGroup, Builder
from megatron_refit.plan.buckets import Transfer, new_tuple
from megatron_refit.plan.checks import check_target, check_tiling, gc_paused, index_specs, unproduced_hint
from megatron_refit.plan.gen_layout import GenTargets
from megatron_refit.plan.spec import Box, ShardSpec, intersect, relative

Piece = tuple[Box, tuple[int, ...], int]
"""``(train box, senders, nbytes)``: one train box overlapping a gen piece; the class's
j-th gen rank receives it from ``senders[j % len(senders)]``."""

Item = tuple[str, str, Box, tuple[Piece, ...]]
"""``(name, dtype, gen box, its train pieces)``: one gen piece of a class and its senders."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """Validated sender assignment (see the module docstring)."""

    class_ranks: tuple[tuple[int, ...], ...]
    """Gen ranks of each class (identical pieces), in order of their first rank."""
    groups: tuple[BoxGroup, ...]
    train_bytes: tuple[int, ...]
    """Bytes each train rank sends."""
    unused_train_params: tuple[str, ...]
    """Train parameters that no gen rank needs."""

    @classmethod
    def build(cls, train_specs: dict[int, list[ShardSpec]], targets: GenTargets) -> Assignment:
        """Validate and assign senders; ``PlanError`` names the first bad parameter."""
        with gc_paused():
            return cls.from_index(*index_specs("train", train_specs), len(train_specs), targets)

    @classmethod
    def from_index(cls, train_index: dict[str, dict[Box, list[int]]], train_meta: dict[str, ShardSpec],
                   num_train: int, targets: GenTargets) -> Assignment:
        """:meth:`build` from the train pieces' index (``index_specs`` of their specs, or
        ``pieces.index_parts`` of the gathered parts: name -> box -> holders in rank order, and a
        spec of each name's global shape and dtype)."""
        with gc_paused():
            return cls._build(train_index, train_meta, num_train, targets)

    @classmethod
    def _build(cls, train_index: dict, train_meta: dict, num_train: int, targets: GenTargets) -> Assignment:
        ranks = targets.ranks
        num_gen = sum(map(len, ranks))
        ranks_seen = sorted(rank for class_ranks in ranks for rank in class_ranks)
        if ranks_seen != list(range(num_gen)):
            raise PlanError(f"gen ranks must be 0..{num_gen - 1}, got {ranks_seen}")
        if [r[0] for r in ranks] != sorted(r[0] for r in ranks):
            raise PlanError(f"gen classes must come in order of their first rank, got {ranks}")
        _check_tilings(train_index, train_meta)
        load = [0] * num_train
        builder = Builder(ranks, load)
        group = builder.group
        only = [(senders,) for senders in builder.solo]  # a one-box parameter's senders: one tuple per rank
        alone: dict[tuple, tuple] = {}  # a one-box, one-holder dict's group appenders, senders, holder and bytes
        several: dict[tuple, tuple] = {}  # a one-box group of several holders' appenders, by the boxes' identity
        rotations = builder.lists  # each holders list's turn state, by identity
        needed = []
        params = targets.params
        unheld: dict[int, bool] = {}  # a boxes tuple no class holds, by identity (targets keep them alive)
        for name in sorted(params):  # the turns count on in name order
            shape, dtype, gen_boxes = params[name]
            skip = unheld.get(id(gen_boxes))
            if skip is None:
                skip = unheld[id(gen_boxes)] = gen_boxes.count(None) == len(gen_boxes)
            if skip:
                continue
            train = train_meta.get(name)
            if train is None:
                raise PlanError(f"HF name {name} is not produced by the trainer{unproduced_hint(name, train_meta)}")
            if train.global_shape != shape or train.dtype != dtype:
                check_target(name, shape, dtype, train.global_shape, train.dtype)
            needed.append(name)
            boxes = train_index[name]
            hit = alone.get((dtype, id(gen_boxes), id(boxes)))  # a train part's names of one kind share boxes
            if hit is None:
                if len(boxes) != 1:
                    builder.add(group(dtype, gen_boxes, boxes), name, boxes)
                    continue
                (box, holders), = boxes.items()
                if len(holders) > 1:  # whole experts under expert DP: the holder set's next turn (Builder._turn)
                    hit = several.get((dtype, id(gen_boxes), id(box)))
                    if hit is None:
                        members = group(dtype, gen_boxes, boxes)
                        members.turned.add(0)
                        hit = several[dtype, id(gen_boxes), id(box)] = (members.names.append, members.senders.append)
                    state = rotations.get(id(holders))
                    if state is None:
                        state = builder.rotations(holders)
                    n = state[0] % len(holders)
                    state[0] += 1
                    hit[0](name)
                    hit[1](state[2][n] or builder.rotated(state, n, True))
                    continue
                members = group(dtype, gen_boxes, boxes)  # the common case (whole experts under EP)
                hit = alone[dtype, id(gen_boxes), id(boxes)] = (members.names.append, members.senders.append,
                                                                only[holders[0]], holders[0], members.sent[0])
            hit[0](name)
            hit[1](hit[2])
            load[hit[3]] += hit[4]
        groups = builder.finish()  # the load counted in full
        return cls(class_ranks=ranks, groups=groups, train_bytes=tuple(load),
                   unused_train_params=tuple(sorted(set(train_meta).difference(needed))))

    def gen_bytes(self) -> dict[int, int]:
        """Bytes each gen rank receives (= holds)."""
        per_class = [0] * len(self.class_ranks)
        for group in self.groups:
            for c, row in enumerate(group.nbytes):
                per_class[c] += len(group.names) * sum(row)
        out = {rank: per_class[c] for c, ranks in enumerate(self.class_ranks) for rank in ranks}
        return dict(sorted(out.items()))

    @property
    def num_transfers(self) -> int:
        per_class = [0] * len(self.class_ranks)
        for group in self.groups:
            for c, row in enumerate(group.nbytes):
                per_class[c] += len(group.names) * sum(map(bool, row))
        return sum(len(ranks) * n for ranks, n in zip(self.class_ranks, per_class))

    def route_bytes(self, keep: Callable[[str], bool] | None = None) -> dict[tuple[int, int], int]:
        """Bytes per route (train rank, gen rank); ``keep``: of the parameters it keeps only."""
        counts = [[Counter(senders[i] for name, senders in zip(g.names, g.senders) if keep is None or keep(name))
                   for i in range(len(g.train_boxes))] for g in self.groups]  # names per sender tuple of each train box
        out: dict[tuple[int, int], int] = defaultdict(int)
        for c, ranks in enumerate(self.class_ranks):
            for group, per_box in zip(self.groups, counts):
                for i, (nbytes, offset) in enumerate(zip(group.nbytes[c], group.offsets[c])):
                    if nbytes:
                        for senders, num in per_box[i].items():
                            for j, gen_rank in enumerate(ranks):
                                out[senders[(offset + j) % len(senders)], gen_rank] += num * nbytes
        return dict(out)

    def transfer_counts(self) -> tuple[list[int], list[int]]:
        """Transfers each train rank sends and each gen rank receives (what its local plan
        expands), without expanding them."""
        sent = [0] * len(self.train_bytes)
        per_class = [0] * len(self.class_ranks)
        for g in self.groups:
            for c, row in enumerate(g.nbytes):
                per_class[c] += len(g.names) * sum(map(bool, row))
            for i, turns in enumerate(g.turns):
                for senders, num in Counter(s[i] for s in g.senders).items():
                    base, extra = divmod(turns, len(senders))  # a parameter's turns of box i from turn 0
                    for h, rank in enumerate(senders):
                        sent[rank] += num * (base + (h < extra))
        received = [0] * sum(map(len, self.class_ranks))
        for c, ranks in enumerate(self.class_ranks):
            for rank in ranks:
                received[rank] = per_class[c]
        return sent, received

    def items(self, c: int) -> list[Item]:
        """Class ``c``'s gen pieces and their senders, by name (what the reference lists for it)."""
        out = []
        copies = len(self.class_ranks[c])
        for g in self.groups:
            box, row, offsets = g.gen_boxes[c], g.nbytes[c], g.offsets[c]
            if box is None:
                continue
            live = [(i, train_box, nbytes, offsets[i]) for i, (train_box, nbytes) in enumerate(zip(g.train_boxes, row))
                    if nbytes]
            for name, senders in zip(g.names, g.senders):
                out.append((name, g.dtype, box, tuple(
                    (train_box, tuple(senders[i][(offset + j) % len(senders[i])]
                                      for j in range(min(copies, len(senders[i])))), nbytes)
                    for i, train_box, nbytes, offset in live)))
        out.sort(key=itemgetter(0))
        return out

    def transfers(self, *, src: int | None = None, dst: int | None = None) -> list[Transfer]:
        """Every transfer, ordered by gen rank, then name, then train box (as
        the reference's); with ``src`` / ``dst`` only those that train rank sends /
        that gen rank receives, found without expanding the others (a rank's own part of a
        plan with millions of transfers)."""
        position = {rank: (c, j) for c, ranks in enumerate(self.class_ranks) for j, rank in enumerate(ranks)}
        if dst is not None and dst not in position:
            raise ValueError(f"gen rank {dst} is not in this plan (0..{len(position) - 1})")
        groups = [(g, list(zip(g.names, g.senders)) if src is None else _sent_by(g, src)) for g in self.groups]
        groups = [(g, members) for g, members in groups if members]
        geometry: dict[tuple[int, int], tuple[Box, Box, Box]] = {}  # by identity: boxes stay alive meanwhile

        def where(train_box: Box, gen_box: Box) -> tuple[Box, Box, Box]:
            got = geometry.get((id(train_box), id(gen_box)))
            if got is None:
                box = intersect(train_box, gen_box)
                got = geometry[id(train_box), id(gen_box)] = (relative(box, train_box), relative(box, gen_box), box)
            return got

        out = []
        for gen_rank in range(len(position)) if dst is None else (dst,):
            c, j = position[gen_rank]
            mine = []
            for g, members in groups:
                gen_box = g.gen_boxes[c]
                if gen_box is None:
                    continue
                live = [(i, where(train_box, gen_box), nbytes, offset + j) for i, (train_box, nbytes, offset)
                        in enumerate(zip(g.train_boxes, g.nbytes[c], g.offsets[c])) if nbytes]
                for name, senders in members:
                    for i, (src_box, dst_box, box), nbytes, turn in live:
                        holders = senders[i]
                        sender = holders[turn % len(holders)]
                        if src is None or sender == src:
                            mine.append(new_tuple(Transfer, (name, sender, gen_rank, src_box, dst_box, box, g.dtype,
                                                             nbytes)))
            mine.sort(key=attrgetter("name"))  # stable: a name's pieces stay in train box order
            out += mine
        return out


def _sent_by(g: BoxGroup, src: int) -> list[tuple[str, tuple]]:
    """``(name, senders)`` of the group's parameters that train rank ``src`` sends a box of."""
    if len(g.train_boxes) == 1:  # the common case (whole experts, replicated norms): one holder set a name
        return [(name, senders) for name, senders in zip(g.names, g.senders) if src in senders[0]]
    return [(name, senders) for name, senders in zip(g.names, g.senders) if any(src in s for s in senders)]


def _check_tilings(train_index: dict, train_meta: dict) -> None:
    """Each train parameter's boxes tile its shape exactly, checked once per distinct (shape,
    boxes) by the objects' identity (every shape and box stays alive meanwhile); the first bad
    parameter by name is named. Names that share one boxes dict (``index_parts``: a part's names
    of one kind, whose spec they share) are checked once, found at C speed."""
    tiled: set[tuple[int, ...]] = set()
    try:
        for name in dict(zip(map(id, train_index.values()), train_index)).values():  # a name of each boxes dict
            boxes = train_index[name]
            shape = train_meta[name].global_shape
            key = (id(shape), *map(id, boxes)) if len(boxes) > 1 else (id(shape), id(next(iter(boxes))))
            if key not in tiled:
                check_tiling(name, shape, list(boxes))
                tiled.add(key)
    except PlanError:  # name the first bad one in name order
        for name in sorted(train_index):
            check_tiling(name, train_meta[name].global_shape, list(train_index[name]))
        raise
