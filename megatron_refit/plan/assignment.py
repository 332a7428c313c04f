"""Sender assignment by groups of parameters (pure): the one implementation of who sends
what. ``prepare()`` (:class:`megatron_refit.plan.refit_plan.RefitPlan`), the dry run and the
cost model plan with it, without a piece per gen class and parameter; a rank expands only
its own transfers (:meth:`Assignment.transfers`). ``megatron_refit/testing/reference_senders.py`` holds the
piece-by-piece reference it is tested against.

A full-scale MoE plan has millions of (gen class, parameter) pieces (DeepSeek-V3 on vLLM
TP32: 45 k parameters x 32 engine TP ranks) but few patterns: the routed experts of one
projection share their global shape, dtype and train boxes (each box held by one rank) and
have the same box on every gen class; only the train rank holding them differs. A *group*
is such a set of parameters: it is validated, intersected and sized once and keeps one
tuple of holders per parameter. A parameter with a train box held by several ranks (DP
replicas) has its senders water-filled piece by piece, by name, then class.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from operator import attrgetter, itemgetter

from megatron_refit.errors import PlanError
from megatron_refit.plan.buckets import Transfer
from megatron_refit.plan.spec import box_numel
from megatron_refit.plan.checks import ITEMSIZE, check_target, check_tiling, gc_paused, index_specs
from megatron_refit.plan.gen_layout import GenTargets
from megatron_refit.plan.spec import Box, ShardSpec, intersect, relative

Piece = tuple[Box, tuple[int, ...], int]
"""``(train box, senders, nbytes)``: one train box overlapping a gen piece; the class's
j-th gen rank receives it from ``senders[j % len(senders)]``."""

Item = tuple[str, str, Box, tuple[Piece, ...]]
"""``(name, dtype, gen box, its train pieces)``: one gen piece of a class and its senders."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BoxGroup:
    """Parameters that match box for box on both sides; only their holders differ."""

    dtype: str
    train_boxes: tuple[Box, ...]
    """Sorted, as the pieces of an item list them."""
    gen_boxes: tuple[Box | None, ...]
    """Per class; None where the class holds none of these parameters."""
    nbytes: tuple[tuple[int, ...], ...]
    """Per class, per train box: bytes of its overlap with the class's box (0: none)."""
    names: tuple[str, ...]
    holders: tuple[tuple[int, ...], ...]
    """Per name: the train rank holding each train box."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """Validated sender assignment (see the module docstring)."""

    class_ranks: tuple[tuple[int, ...], ...]
    """Gen ranks of each class (identical pieces), in order of their first rank."""
    groups: tuple[BoxGroup, ...]
    replicated: tuple[tuple[Item, ...], ...]
    """Per class, the pieces of parameters with a train box held by several ranks."""
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
        tiled: set[tuple[int, ...]] = set()  # by object identity: every shape and box stays alive
        for name in sorted(train_meta):
            shape, boxes = train_meta[name].global_shape, train_index[name]
            key = (id(shape), *map(id, boxes))
            if key not in tiled:
                check_tiling(name, shape, list(boxes))
                tiled.add(key)
        load = [0] * num_train
        builder = _Builder(ranks, load)
        needed = []
        params = targets.params
        for name in sorted(params):  # the reference's order: water-filling reads the load so far
            shape, dtype, gen_boxes = params[name]
            if gen_boxes.count(None) == len(gen_boxes):
                continue
            train = train_meta.get(name)
            if train is None:
                raise PlanError(f"HF name {name} is not produced by the trainer")
            if train.global_shape != shape or train.dtype != dtype:
                check_target(name, shape, dtype, train.global_shape, train.dtype)
            needed.append(name)
            boxes = train_index[name]
            if len(boxes) == 1:  # the common case (whole experts under EP): inlined
                (box, holders), = boxes.items()
                if len(holders) == 1:
                    members = builder.by_id.get((dtype, id(gen_boxes), id(box))) or builder.group(
                        dtype, gen_boxes, boxes)
                    members.names.append(name)
                    members.holders.append((holders[0],))
                    load[holders[0]] += members.sent[0]
                    continue
            if all(len(holders) == 1 for holders in boxes.values()):
                builder.group(dtype, gen_boxes, boxes).add(name, boxes, load)
            else:
                builder.add_replicated(name, dtype, gen_boxes, boxes)
        return cls(class_ranks=ranks, groups=builder.groups(), replicated=builder.replicated_items(),
                   train_bytes=tuple(load), unused_train_params=tuple(sorted(set(train_meta).difference(needed))))

    def gen_bytes(self) -> dict[int, int]:
        """Bytes each gen rank receives (= holds)."""
        per_class = [sum(piece[2] for *_, pieces in items for piece in pieces) for items in self.replicated]
        for group in self.groups:
            for c, row in enumerate(group.nbytes):
                per_class[c] += len(group.names) * sum(row)
        out = {rank: per_class[c] for c, ranks in enumerate(self.class_ranks) for rank in ranks}
        return dict(sorted(out.items()))

    @property
    def num_transfers(self) -> int:
        per_class = [sum(len(pieces) for *_, pieces in items) for items in self.replicated]
        for group in self.groups:
            for c, row in enumerate(group.nbytes):
                per_class[c] += len(group.names) * sum(map(bool, row))
        return sum(len(ranks) * n for ranks, n in zip(self.class_ranks, per_class))

    def route_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes per route (train rank, gen rank)."""
        counts = [[Counter(holders[i] for holders in f.holders) for i in range(len(f.train_boxes))]
                  for f in self.groups]  # names per holder of each train box
        out: dict[tuple[int, int], int] = defaultdict(int)
        for c, ranks in enumerate(self.class_ranks):
            by_senders: dict[tuple[int, ...], int] = defaultdict(int)
            for _, _, _, pieces in self.replicated[c]:
                for _, senders, nbytes in pieces:
                    by_senders[senders] += nbytes
            for group, per_box in zip(self.groups, counts):
                for nbytes, holders in zip(group.nbytes[c], per_box):
                    if nbytes:
                        for holder, num in holders.items():
                            by_senders[holder,] += num * nbytes
            for j, gen_rank in enumerate(ranks):
                for senders, nbytes in by_senders.items():
                    out[senders[j % len(senders)], gen_rank] += nbytes
        return dict(out)

    def transfer_counts(self) -> tuple[list[int], list[int]]:
        """Transfers each train rank sends and each gen rank receives (what its local plan
        expands), without expanding them."""
        sent = [0] * len(self.train_bytes)
        per_class = [0] * len(self.class_ranks)
        for c, ranks in enumerate(self.class_ranks):
            for *_, pieces in self.replicated[c]:
                per_class[c] += len(pieces)
                for _, senders, _ in pieces:
                    base, extra = divmod(len(ranks), len(senders))
                    for i, rank in enumerate(senders):
                        sent[rank] += base + (i < extra)
        for f in self.groups:
            fan = [0] * len(f.train_boxes)  # gen ranks that get a piece of each train box
            for c, (ranks, row) in enumerate(zip(self.class_ranks, f.nbytes)):
                live = [bool(nbytes) for nbytes in row]
                per_class[c] += len(f.names) * sum(live)
                for i, on in enumerate(live):
                    fan[i] += len(ranks) * on
            for holders in f.holders:
                for holder, num in zip(holders, fan):
                    sent[holder] += num
        received = [0] * sum(map(len, self.class_ranks))
        for c, ranks in enumerate(self.class_ranks):
            for rank in ranks:
                received[rank] = per_class[c]
        return sent, received

    def items(self, c: int) -> list[Item]:
        """Class ``c``'s gen pieces and their senders, by name (what the reference lists for it)."""
        out = list(self.replicated[c])
        for f in self.groups:
            box, row = f.gen_boxes[c], f.nbytes[c]
            if box is None:
                continue
            for name, holders in zip(f.names, f.holders):
                out.append((name, f.dtype, box, tuple((train_box, (holder,), nbytes) for train_box, holder, nbytes
                                                      in zip(f.train_boxes, holders, row) if nbytes)))
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
        groups = [(f, list(zip(f.names, f.holders)) if src is None else
                   [(name, holders) for name, holders in zip(f.names, f.holders) if src in holders])
                  for f in self.groups]
        groups = [(f, members) for f, members in groups if members]
        replicated = [items if src is None else [item for item in items if any(src in senders for _, senders, _
                                                                                in item[3])]
                      for items in self.replicated]
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
            for name, dtype, gen_box, pieces in replicated[c]:
                for train_box, senders, nbytes in pieces:
                    sender = senders[j % len(senders)]
                    if src is None or sender == src:
                        mine.append(Transfer(name, sender, gen_rank, *where(train_box, gen_box), dtype, nbytes))
            for f, members in groups:
                gen_box = f.gen_boxes[c]
                if gen_box is None:
                    continue
                live = [(i, where(train_box, gen_box), nbytes)
                        for i, (train_box, nbytes) in enumerate(zip(f.train_boxes, f.nbytes[c])) if nbytes]
                for name, holders in members:
                    for i, (src_box, dst_box, box), nbytes in live:
                        if src is None or holders[i] == src:
                            mine.append(Transfer(name, holders[i], gen_rank, src_box, dst_box, box, f.dtype, nbytes))
            mine.sort(key=attrgetter("name"))  # stable: a name's pieces stay in train box order
            out += mine
        return out


class _Builder:
    """Accumulates groups, replicated items and each train rank's load (``load``, in place)."""

    def __init__(self, ranks: tuple[tuple[int, ...], ...], load: list[int]) -> None:
        self.copies = [len(r) for r in ranks]
        self.load = load
        # BoxGroup keys number boxes by value, looked up by identity: the boxes of one (role,
        # shape) are shared objects, and every box here stays alive meanwhile.
        self.ids: dict[int, int] = {}
        self.values: dict[tuple, int] = {}
        self.members: dict[tuple, _Members] = {}  # by (dtype, gen boxes, train boxes) as numbers
        self.by_id: dict[tuple, _Members] = {}  # the same by the boxes' identities
        self.replicated: list[list[Item]] = [[] for _ in ranks]
        self.overlap: dict[tuple[int, int], int] = {}  # by identity: boxes stay alive meanwhile

    def _number(self, value: tuple) -> int:
        number = self.ids.get(id(value))
        if number is None:
            number = self.ids[id(value)] = self.values.setdefault(value, len(self.values))
        return number

    def _numel(self, train_box: Box, gen_box: Box) -> int:
        key = (id(train_box), id(gen_box))
        numel = self.overlap.get(key)
        if numel is None:
            box = intersect(train_box, gen_box) if gen_box else train_box  # a 0-dim box is ()
            numel = self.overlap[key] = 0 if box is None else box_numel(box)
        return numel

    def group(self, dtype: str, gen_boxes: tuple, boxes: dict[Box, list[int]]) -> _Members:
        """The group of a parameter whose every train box has one holder."""
        members = self.by_id.get(key := (dtype, id(gen_boxes), *map(id, boxes)))
        if members is None:  # equal boxes may be distinct objects (e.g. FP8 scale tiles): by value
            value_key = (dtype, self._number(gen_boxes), *map(self._number, boxes))
            members = self.members.get(value_key)
            if members is None:
                members = self.members[value_key] = self._family_shape(dtype, gen_boxes, list(boxes))
            self.by_id[key] = members
        return members

    def _family_shape(self, dtype: str, gen_boxes: tuple, train_boxes: list[Box]) -> _Members:
        order = sorted(range(len(train_boxes)), key=train_boxes.__getitem__)
        itemsize = ITEMSIZE[dtype]
        nbytes = []
        for gen_box in gen_boxes:
            if gen_box is None:
                nbytes.append((0,) * len(train_boxes))
                continue
            row = tuple(self._numel(train_boxes[i], gen_box) * itemsize for i in order)
            if sum(row) != box_numel(gen_box) * itemsize:  # the tiling was checked: a bug if reached
                raise PlanError(f"train boxes {train_boxes} do not cover gen box {gen_box} exactly")
            nbytes.append(row)
        group = BoxGroup(dtype=dtype, train_boxes=tuple(train_boxes[i] for i in order), gen_boxes=gen_boxes,
                        nbytes=tuple(nbytes), names=(), holders=())
        return _Members(group, order, self.copies)

    def add_replicated(self, name: str, dtype: str, gen_boxes: tuple, boxes: dict[Box, list[int]]) -> None:
        """A parameter with a train box held by several ranks: the reference's water-filling, class by class."""
        itemsize = ITEMSIZE[dtype]
        load, overlap = self.load, self.overlap
        by_load = load.__getitem__  # (load, rank) order: holders are in rank order (index_specs), sorts are stable
        entries = list(boxes.items())
        for c, gen_box in enumerate(gen_boxes):
            if gen_box is None:
                continue
            copies = self.copies[c]
            pieces = []
            total = 0
            for train_box, holders in entries:
                numel = overlap.get((id(train_box), id(gen_box)))
                if numel is None:
                    numel = self._numel(train_box, gen_box)
                if not numel:
                    continue
                total += numel
                nbytes = numel * itemsize
                if len(holders) == 1:
                    load[holders[0]] += nbytes * copies
                    senders = tuple(holders)
                elif copies <= len(holders):  # each of the least loaded sends once
                    senders = tuple(sorted(holders, key=by_load)[:copies])
                    for rank in senders:
                        load[rank] += nbytes
                else:
                    senders = tuple(sorted(holders, key=by_load))
                    base, extra = divmod(copies, len(senders))
                    for i, rank in enumerate(senders):
                        load[rank] += nbytes * (base + (i < extra))
                pieces.append((train_box, senders, nbytes))
            if total != self._numel(gen_box, gen_box):  # the tiling was checked: a bug if reached
                raise PlanError(f"{name}: train pieces do not cover gen box {gen_box} exactly")
            if len(pieces) > 1:
                pieces.sort(key=itemgetter(0))
            self.replicated[c].append((name, dtype, gen_box, tuple(pieces)))

    def groups(self) -> tuple[BoxGroup, ...]:
        return tuple(replace(m.group, names=tuple(m.names), holders=tuple(m.holders)) for m in self.members.values())

    def replicated_items(self) -> tuple[tuple[Item, ...], ...]:
        return tuple(map(tuple, self.replicated))


class _Members:
    """The parameters of one group while the plan is built."""

    __slots__ = ("group", "order", "sent", "names", "holders")

    def __init__(self, group: BoxGroup, order: list[int], copies: list[int]) -> None:
        self.group = group
        self.order = order
        """``group.train_boxes[i]`` is a parameter's ``order[i]``-th train box (in first-seen order)."""
        self.sent = [0] * len(order)
        """Bytes the holder of each train box (first-seen order) sends to all classes."""
        for num, row in zip(copies, group.nbytes):
            for i, k in enumerate(order):
                self.sent[k] += row[i] * num
        self.names: list[str] = []
        self.holders: list[tuple[int, ...]] = []

    def add(self, name: str, boxes: dict[Box, list[int]], load: list[int]) -> None:
        holders = [ranks[0] for ranks in boxes.values()]
        self.names.append(name)
        self.holders.append(tuple(holders[k] for k in self.order))
        for holder, nbytes in zip(holders, self.sent):
            load[holder] += nbytes
