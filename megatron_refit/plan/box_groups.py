"""Groups of parameters that match box for box, and the turns their holders take (pure): how
:class:`~megatron_refit.plan.assignment.Assignment` is built.

A full-scale MoE plan has millions of (gen class, parameter) pieces (DeepSeek-V3 on vLLM
TP32: 45 k parameters x 32 engine TP ranks) but few patterns: the routed experts of one
projection share their global shape, dtype and train boxes and have the same box on every
gen class; only the train ranks holding them differ. A *group* is such a set of parameters:
validated, intersected and sized once, with one tuple of senders per parameter and train box.

**Turns.** A train box held by h ranks (DP replicas; experts under expert data parallelism)
is sent by its holders in turns. The boxes one set of holders holds are numbered in order
(names in order, then each name's train boxes in order); the gen ranks that need a piece of
box number n take its turns in order of gen class, then rank within the class, and turn t is
taken by ``holders[(n + t) % h]`` (holders in rank order). So the gen ranks that need one box
get it from each holder D // h or D // h + 1 times, and consecutive boxes start at
consecutive holders. It is a closed form: a parameter's senders are its holders rotated to
its number, so a group's parameters are planned in one step each, never class by class; and
where the engine's ranks hold changes (EPLB moves an expert), no other parameter's senders do.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from megatron_refit.errors import PlanError
from megatron_refit.plan.checks import ITEMSIZE
from megatron_refit.plan.spec import Box, box_numel, intersect

Senders = tuple[int, ...]
"""A box's holders in turn order (rotated to the box's number): the class's j-th gen rank that needs it gets it from
``senders[(offset + j) % len(senders)]`` (``offset``: the box's turns taken by earlier classes)."""


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
    offsets: tuple[tuple[int, ...], ...]
    """Per class, per train box: the box's turns taken by earlier classes (their ranks that need it)."""
    turns: tuple[int, ...]
    """Per train box: the gen ranks that need it (turns one parameter's box takes)."""
    names: tuple[str, ...]
    senders: tuple[tuple[Senders, ...], ...]
    """Per name, per train box: its holders in turn order (see :data:`Senders`)."""


class Builder:
    """Accumulates groups and each train rank's load (``load``, in place), names in order."""

    def __init__(self, ranks: tuple[tuple[int, ...], ...], load: list[int]) -> None:
        self.copies = [len(r) for r in ranks]
        self.load = load
        # BoxGroup keys number boxes by value, looked up by identity: the boxes of one (role,
        # shape) are shared objects, and every box here stays alive meanwhile.
        self.ids: dict[int, int] = {}
        self.values: dict[tuple, int] = {}
        self.members: dict[tuple, Members] = {}  # by (dtype, gen boxes, train boxes) as numbers
        self.by_id: dict[tuple, Members] = {}  # the same by the boxes' identities
        self.turns: dict[tuple[int, ...], list] = {}
        """Per holder set: ``[its boxes numbered so far, its rotations, each rotation as a 1-tuple, the set]``
        (a rotation None until taken)."""
        self.lists: dict[int, list] = {}  # the same by a holders list's identity (the index's lists stay alive)
        self.solo = [(rank,) for rank in range(len(load))]
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

    def group(self, dtype: str, gen_boxes: tuple, boxes: dict[Box, list[int]]) -> Members:
        """The group of a parameter with these gen boxes and train boxes."""
        members = self.by_id.get(key := (dtype, id(gen_boxes), *map(id, boxes)))
        if members is None:  # equal boxes may be distinct objects (e.g. FP8 scale tiles): by value
            value_key = (dtype, self._number(gen_boxes), *map(self._number, boxes))
            members = self.members.get(value_key)
            if members is None:
                members = self.members[value_key] = self._shape(dtype, gen_boxes, list(boxes))
            self.by_id[key] = members
        return members

    def _shape(self, dtype: str, gen_boxes: tuple, train_boxes: list[Box]) -> Members:
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
        offsets, taken = [], [0] * len(order)
        for num, row in zip(self.copies, nbytes):
            offsets.append(tuple(taken))
            taken = [t + num * bool(b) for t, b in zip(taken, row)]
        group = BoxGroup(dtype=dtype, train_boxes=tuple(train_boxes[i] for i in order), gen_boxes=gen_boxes,
                         nbytes=tuple(nbytes), offsets=tuple(offsets), turns=tuple(taken), names=(), senders=())
        return Members(group, order, self.copies)

    def add(self, members: Members, name: str, boxes: dict[Box, list[int]]) -> None:
        """A parameter of ``members``' group (``boxes``: its train boxes and their holders)."""
        holders = list(boxes.values())
        senders = []
        load = self.load
        for i, k in enumerate(members.order):  # train boxes in order
            ranks = holders[k]
            if len(ranks) == 1:
                rank = ranks[0]
                senders.append(self.solo[rank])
                load[rank] += members.sent[i]
                continue
            senders.append(self._turn(members, i, ranks))
        members.names.append(name)
        members.senders.append(tuple(senders))

    def rotations(self, ranks: list[int]) -> list:
        """The turn state of holder set ``ranks`` (see :attr:`turns`; its rotations made as
        they are taken, :meth:`rotated`: a dense box of 128 DP replicas takes a few)."""
        state = self.lists.get(id(ranks))
        if state is None:
            key = tuple(ranks)
            state = self.turns.get(key)
            if state is None:
                state = self.turns[key] = [0, [None] * len(key), [None] * len(key), key]
            self.lists[id(ranks)] = state
        return state

    @staticmethod
    def rotated(state: list, n: int, single: bool = False) -> tuple:
        """Rotation ``n`` of a holder set's state (``single``: as a 1-tuple, one box's senders)."""
        rotated = state[1][n]
        if rotated is None:
            key = state[3]
            rotated = state[1][n] = key[n:] + key[:n]
        if not single:
            return rotated
        state[2][n] = (rotated,)
        return state[2][n]

    def _turn(self, members: Members, i: int, ranks: list[int]) -> Senders:
        """The next box of holder set ``ranks``: its senders (its bytes are counted by :meth:`finish`)."""
        members.turned.add(i)
        state = self.rotations(ranks)
        n = state[0] % len(ranks)
        state[0] += 1
        return state[1][n] or self.rotated(state, n)

    def finish(self) -> tuple[BoxGroup, ...]:
        """The groups, with the bytes of every box of several holders in ``load``: each group's
        boxes counted per rotation (the rotations are shared tuples) and added once."""
        for m in self.members.values():
            one = len(m.order) == 1  # one train box: a parameter's senders counted whole, at C speed
            for i in m.turned:
                counts = Counter(m.senders) if one else Counter(senders[i] for senders in m.senders)
                for key, count in counts.items():
                    rotated = key[0] if one else key
                    if len(rotated) > 1:  # a box of one holder is in load already
                        for rank, nbytes in zip(rotated, m.shares(i, len(rotated))):
                            self.load[rank] += count * nbytes
        return tuple(replace(m.group, names=tuple(m.names), senders=tuple(m.senders)) for m in self.members.values())


class Members:
    """The parameters of one group while the plan is built."""

    __slots__ = ("group", "order", "sent", "names", "senders", "copies", "turned", "_shares")

    def __init__(self, group: BoxGroup, order: list[int], copies: list[int]) -> None:
        self.group = group
        self.order = order
        """``group.train_boxes[i]`` is a parameter's ``order[i]``-th train box (in first-seen order)."""
        self.copies = copies
        self.sent = [sum(row[i] * num for num, row in zip(copies, group.nbytes)) for i in range(len(order))]
        """Bytes each train box (in order) sends to all classes."""
        self.names: list[str] = []
        self.senders: list[tuple[Senders, ...]] = []
        self.turned: set[int] = set()
        """The train boxes (in order) that some parameter's several holders send in turns."""
        self._shares: dict[tuple[int, int], list[int]] = {}

    def shares(self, i: int, num_holders: int) -> list[int]:
        """Bytes of train box ``i`` that the holder taking its parameter's turns t ≡ h (mod
        ``num_holders``) sends, per h (the box's turns in class order, each the class's bytes)."""
        out = self._shares.get((i, num_holders))
        if out is None:
            out = [0] * num_holders
            turn = 0
            for num, row in zip(self.copies, self.group.nbytes):
                if row[i]:
                    for t in range(turn, turn + min(num, num_holders)):
                        out[t % num_holders] += row[i] * ((num - (t - turn) - 1) // num_holders + 1)
                    turn += num
            self._shares[i, num_holders] = out
        return out
