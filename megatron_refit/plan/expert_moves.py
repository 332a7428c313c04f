"""A plan re-planned after an engine's experts moved (EPLB), without planning the rest again (pure).

A wide expert-parallel deployment that rebalances (vLLM ``--enable-eplb``) rejoins with its
ranks holding other experts: vLLM's own rebalance puts ~96 % of the (layer, expert) pairs on
other ranks (``scripts/eplb_moves.py``), so a re-plan by the names that changed is a full one.
But nothing else changed: the train side, every rank's other pieces, and each expert's senders
(the turns of :mod:`megatron_refit.plan.box_groups` number a box by its holders and names, not by
who receives it). :func:`replan` takes the previous plan's groups and the new gen parts and
derives what a full build would: the rank's own transfers (its own experts only), and the
totals every rank shows (each train rank's bytes, transfers, bytes held) from the experts'
receiver counts with array arithmetic, never parameter by parameter over the world.

It applies where the gen ranks are one class each (a deployment's ranks at run time), the
experts are whole on every rank holding them (expert parallelism), and the new parts differ
from the previous only in which experts each rank holds, each expert held once at least;
anywhere else it returns None and the caller builds in full (which names the errors).
``tests/unit/test_expert_moves.py`` checks it equal to a full build.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import chain, compress, repeat

from megatron_refit.plan.box_groups import BoxGroup
from megatron_refit.plan.buckets import Transfer
from megatron_refit.plan.pieces import kind_indices, kind_specs
from megatron_refit.plan.spec import box_numel, intersect, relative


@dataclass(frozen=True, kw_only=True)
class Basis:
    """What a local plan was built from, kept for :func:`replan` (its cache is filled by
    :func:`movable` when the plan is built, and only read afterwards)."""

    groups: tuple[BoxGroup, ...]
    train_meta: dict
    targets: object
    """The :class:`~megatron_refit.plan.gen_layout.GenTargets` planned (the other pieces' boxes)."""
    holding: Holding | None = None
    """Where a re-plan moved the experts (None: as ``targets`` has them)."""
    train_shapes: object = None
    train_next: object = None
    cache: dict = field(default_factory=dict, compare=False)


class _Experts:
    """The plan's experts whole where held, numbered: expert ``i`` (a parameter) is ``names[i]``,
    the groups' parameters in turn."""

    def __init__(self, basis: Basis) -> None:
        self.names: list[str] = []
        self.groups: list[BoxGroup] = []
        self.group_id = array("l")
        self.position = array("l")
        self.kind: list[tuple] = []  # per group: (global shape, dtype)
        before = []  # per expert: the ranks holding it in the basis's targets
        for g in basis.groups:
            held = [box for box in g.gen_boxes if box is not None]
            shape = basis.train_meta[g.names[0]].global_shape
            if not basis.train_meta[g.names[0]].is_expert or any(box_numel(b) != math.prod(shape) for b in held):
                continue  # not an expert whole where held (expert parallelism): its names stay where they are
            self.group_id.extend(repeat(len(self.groups), len(g.names)))
            self.position.extend(range(len(g.names)))
            self.names += g.names
            self.groups.append(g)
            self.kind.append((shape, g.dtype))
            before.append(repeat(len(held), len(g.names)))
        self.index = dict(zip(self.names, range(len(self.names))))
        self.sigs = {kind: n for n, kind in enumerate(dict.fromkeys(self.kind))}  # (shape, dtype) numbered
        self.sig = array("l", map([self.sigs[kind] for kind in self.kind].__getitem__, self.group_id))
        self.before = Counter(dict(zip(range(len(self.names)), chain.from_iterable(before))))
        self.kinds: dict[tuple, int] = {}
        """Every (shape, dtype, box) of the parts the plan was built from, numbered."""


@dataclass(frozen=True)
class Holding:
    """Which gen ranks hold each expert (by :class:`_Experts`' numbers) after a move."""

    counts: Counter
    """Ranks holding each expert."""
    only: dict[int, int]
    """A rank holding each (the one, for an expert held once)."""
    several: dict[int, list[int]]
    """The ranks in order, for an expert held more than once."""

    @classmethod
    def of(cls, held: list[list[int]]) -> Holding:
        counts = Counter(chain.from_iterable(held))
        only = dict(zip(chain.from_iterable(held), chain.from_iterable(repeat(r, len(h)) for r, h in enumerate(held))))
        twice = {i for i, n in counts.items() if n > 1}
        several: dict[int, list[int]] = {}
        if twice:
            for rank, numbers in enumerate(held):
                for i in compress(numbers, map(twice.__contains__, numbers)):
                    several.setdefault(i, []).append(rank)
        return cls(counts, only, several)

    def ranks_of(self, i: int) -> list[int]:
        return self.several.get(i) or [self.only[i]]


def movable(basis: Basis, gen: dict, local: tuple[str, int]) -> bool:
    """Whether the ``local`` rank's plan over the gen ranks' parts ``gen`` has experts that
    :func:`replan` can move (a deployment under expert parallelism); if so their numbering, each
    rank's other pieces and what this rank sends are kept in ``basis`` now, so that a move
    re-plans in its own time only."""
    if any(len(ranks) != 1 for ranks in basis.targets.ranks):
        return False
    experts = basis.cache["experts"] = _Experts(basis)
    if not experts.groups:
        return False
    basis.cache["rest"] = [_split(gen[r], r, experts, learn=True)[0] for r in range(len(gen))]
    if local[0] == "train":  # the experts this train rank holds a box of
        rank = local[1]
        basis.cache["sends"] = [i for i, (gi, p) in enumerate(zip(experts.group_id, experts.position))
                                if any(rank in s for s in experts.groups[gi].senders[p])]
    basis.cache["geometry"] = {id(g): _geometry(g) for g in experts.groups}
    return True


def replan(previous, gen: dict, finish) -> object | None:
    """``previous`` (a local :class:`~megatron_refit.plan.refit_plan.RefitPlan` with its
    ``basis``) re-planned for the gen ranks' new parts ``gen``, or None where the module
    docstring's conditions do not hold. ``finish(transfers, targets, totals, basis)`` makes the
    plan (the caller's, shared with a full build)."""
    basis: Basis | None = previous.basis
    if basis is None or len(gen) != len(previous.gen_parts) or "experts" not in basis.cache:
        return None
    experts = basis.cache["experts"]
    held = _held(basis, experts, gen)
    if held is None:
        return None
    holding = Holding.of(held)
    if len(holding.counts) != len(experts.names):  # an expert no rank holds: the full build names it
        return None
    totals = _totals(previous, basis, experts, holding)
    transfers = _transfers(previous, basis, experts, held, holding)
    return finish(transfers, _Targets(basis.targets, holding, experts), totals,
                  replace(basis, holding=holding, cache=basis.cache))


def _held(basis: Basis, experts: _Experts, gen: dict) -> list[list[int]] | None:
    """Each gen rank's experts (their numbers), checked: its other pieces as before, its experts
    whole, none twice."""
    rest = basis.cache["rest"]
    out = []
    distinct: dict[tuple, int] = {}
    for rank in range(len(gen)):
        names, layout = gen[rank]
        others, mine = _split((names, layout), rank, experts)
        if others is None or others != rest[rank] or distinct.setdefault(names, rank) != rank \
                or len(set(mine)) != len(mine):
            return None  # another change, or two ranks alike (another class structure): a full build
        out.append(mine)
    return out


def _split(part: tuple, rank: int, experts: _Experts, learn: bool = False):
    """``((other names, their kinds' numbers), the numbers of its experts)`` of one gen rank's
    part; ``(None, None)`` where it is malformed or an expert's piece is not its whole tensor of
    its shape and dtype. ``learn``: number kinds not met before (when the plan is built)."""
    names, layout = part
    try:
        kind_of = kind_indices("gen", rank, names, layout)
        specs = kind_specs("gen", rank, names, layout, kind_of)
    except ValueError:
        return None, None
    name_list = names[0]
    number = list(map(experts.index.get, name_list, repeat(-1)))  # -1: not an expert
    values = [(s.global_shape, s.dtype, s.box) for s in specs]
    kinds = experts.kinds
    ids = [kinds.setdefault(v, len(kinds)) for v in values] if learn else [kinds.get(v, -1) for v in values]
    rest = (tuple(compress(name_list, map((-1).__eq__, number))),
            array("l", map(ids.__getitem__, compress(kind_of, map((-1).__eq__, number)))).tobytes())
    mine = list(filter((-1).__ne__, number))
    # each expert's piece its whole tensor of its shape and dtype: its kind's signature is its group's
    whole = [experts.sigs.get((shape, dtype), -1) if box_numel(box) == math.prod(shape) else -1
             for shape, dtype, box in values]
    if not all(map(int.__eq__, map(whole.__getitem__, compress(kind_of, map((-1).__ne__, number))),
                   map(experts.sig.__getitem__, mine))):
        return None, None
    return rest, mine


def _totals(previous, basis: Basis, experts: _Experts, holding: Holding) -> tuple[tuple[int, ...], int, int]:
    """``(train bytes, transfers, bytes held)`` of the whole plan after the move: what the
    experts whose number of holders changed add or take."""
    before = basis.holding.counts if basis.holding is not None else experts.before
    load = list(previous.train_bytes)
    transfers, held = previous.num_transfers, previous.bytes_minimal
    changed = () if dict.__eq__(holding.counts, before) else [i for i, n in holding.counts.items() if before[i] != n]
    for i in changed:
        g = experts.groups[experts.group_id[i]]
        senders = g.senders[experts.position[i]]
        after, was = holding.counts[i], before[i]
        row = next(r for r in g.nbytes if any(r))  # a whole expert: the same bytes on every rank holding it
        for holders, nbytes in zip(senders, row):
            k = len(holders)
            for h, rank in enumerate(holders):  # turn t is holders[t % k]: D // k or D // k + 1 turns each
                load[rank] += nbytes * ((after // k + (h < after % k)) - (was // k + (h < was % k)))
        transfers += (after - was) * len(g.train_boxes)
        held += (after - was) * sum(row)
    return tuple(load), transfers, held


def _geometry(g: BoxGroup) -> list:
    """A whole expert's pieces: each train box lands whole, at its own place."""
    box = next(b for b in g.gen_boxes if b is not None)
    return [(relative(intersect(tb, box), tb), relative(intersect(tb, box), box), intersect(tb, box), nbytes)
            for tb, nbytes in zip(g.train_boxes, next(r for r in g.nbytes if any(r)))]


def _transfers(previous, basis: Basis, experts: _Experts, held: list[list[int]], holding: Holding) -> list[Transfer]:
    """The local rank's transfers: its other transfers as before, its experts' anew."""
    side, rank = previous.local
    index, geometry = experts.index, basis.cache["geometry"]
    out = [t for t in previous.transfers if t.name not in index]
    names, groups, position, group_id = experts.names, experts.groups, experts.position, experts.group_id
    if side == "gen":
        for i in held[rank]:
            g = groups[group_id[i]]
            ranks = holding.several.get(i)
            turn = ranks.index(rank) if ranks else 0  # the ranks before this one holding it
            for s, (src_box, dst_box, box, nbytes) in zip(g.senders[position[i]], geometry[id(g)]):
                out.append(Transfer(names[i], s[turn % len(s)], rank, src_box, dst_box, box, g.dtype, nbytes))
        out.sort(key=lambda t: t.name)  # stable: a name's pieces in train box order
        return out
    for i in basis.cache["sends"]:
        g = groups[group_id[i]]
        senders = g.senders[position[i]]
        for turn, dst in enumerate(holding.ranks_of(i)):
            for s, (src_box, dst_box, box, nbytes) in zip(senders, geometry[id(g)]):
                if s[turn % len(s)] == rank:
                    out.append(Transfer(names[i], rank, dst, src_box, dst_box, box, g.dtype, nbytes))
    out.sort(key=lambda t: (t.dst_rank, t.name))  # by gen rank, then name (stable: train box order)
    return out


class _Targets:
    """The targets after a move, for the buckets' adjacency: the other pieces as planned, each
    expert whole on the ranks now holding it."""

    def __init__(self, targets, holding: Holding, experts: _Experts) -> None:
        self.ranks = targets.ranks
        self.params = _Params(targets.params, holding, experts, len(targets.ranks))


class _Params:
    def __init__(self, params: dict, holding: Holding, experts: _Experts, num_classes: int) -> None:
        self._params, self._holding, self._experts, self._n = params, holding, experts, num_classes

    def __getitem__(self, name: str) -> tuple:
        i = self._experts.index.get(name)
        if i is None:
            return self._params[name]
        ranks = set(self._holding.ranks_of(i))
        shape, dtype = self._experts.kind[self._experts.group_id[i]]
        whole = tuple((0, n) for n in shape)
        return shape, dtype, tuple(whole if c in ranks else None for c in range(self._n))
