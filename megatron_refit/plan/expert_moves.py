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
from dataclasses import dataclass, field, replace
from itertools import compress, repeat

import numpy as np

from megatron_refit.plan.box_groups import BoxGroup
from megatron_refit.plan.buckets import Transfer
from megatron_refit.plan.pieces import kind_indices, kind_specs
from megatron_refit.plan.spec import box_numel, intersect, relative


@dataclass(frozen=True, kw_only=True)
class Basis:
    """What a local plan was built from, kept for :func:`replan` (its cache fills on first use)."""

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
    """The plan's whole-expert groups, numbered: expert ``i`` (a parameter) is ``names[i]``,
    the groups' parameters in turn (built once per basis)."""

    def __init__(self, basis: Basis) -> None:
        self.names: list[str] = []
        self.groups: list[BoxGroup] = []
        self.starts: list[int] = []
        self.holders: list[list[np.ndarray]] = []  # per group, per train box: its senders (parameters x h)
        self.before: list[int] = []  # per group: ranks holding each parameter in the basis's targets
        self.kind: list[tuple] = []  # per group: (global shape, dtype)
        for g in basis.groups:
            held = [box for box in g.gen_boxes if box is not None]
            shape = basis.train_meta[g.names[0]].global_shape
            if not basis.train_meta[g.names[0]].is_expert or any(box_numel(b) != math.prod(shape) for b in held):
                continue  # not an expert whole where held (expert parallelism): its names stay where they are
            try:  # per train box, its senders: (parameters, holders), where every parameter has as many
                senders = np.array(g.senders, dtype=np.int64)
            except ValueError:
                continue
            if senders.ndim != 3:
                continue
            self.starts.append(len(self.names))
            self.names += g.names
            self.groups.append(g)
            self.before.append(len(held))
            self.kind.append((shape, g.dtype))
            self.holders.append([senders[:, i, :] for i in range(len(g.train_boxes))])
        self.index = dict(zip(self.names, range(len(self.names))))
        self.kinds: dict[tuple, int] = {}  # every (shape, dtype, box) met, numbered
        self.group_id = np.repeat(np.arange(len(self.groups)), [len(g.names) for g in self.groups])
        self.position = np.arange(len(self.names)) - np.array(self.starts + [0], dtype=np.int64)[self.group_id] \
            if self.groups else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Holding:
    """Which gen ranks hold each expert after a move, as arrays over :class:`_Experts`' numbering."""

    counts: np.ndarray
    """Ranks holding each expert."""
    experts: np.ndarray
    """Every rank's experts, rank after rank (their numbers)."""
    ranks: np.ndarray
    """The rank of each of ``experts``."""
    order: np.ndarray
    """``experts`` sorted by number, stably (so each expert's ranks in rank order)."""
    starts: np.ndarray
    """Where each expert's run begins in ``order``."""

    @classmethod
    def of(cls, held: list[np.ndarray], num: int) -> Holding:
        experts = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
        ranks = np.repeat(np.arange(len(held)), [len(h) for h in held])
        counts = np.bincount(experts, minlength=num)
        order = np.argsort(experts, kind="stable")
        return cls(counts, experts, ranks, order, np.concatenate(([0], np.cumsum(counts)[:-1])))

    def twice(self) -> bool:
        """Whether a rank lists an expert twice."""
        ranks, experts = self.ranks[self.order], self.experts[self.order]
        return bool(((ranks[1:] == ranks[:-1]) & (experts[1:] == experts[:-1])).any())

    def ranks_of(self, i: int) -> np.ndarray:
        start = self.starts[i]
        return self.ranks[self.order[start:start + self.counts[i]]]


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
    basis.cache["rest"] = [_split(gen[r], r, experts)[0] for r in range(len(gen))]
    if local[0] == "train":  # the experts this train rank holds a box of
        basis.cache["sends"] = np.concatenate([
            start + np.flatnonzero(np.any([(matrix == local[1]).any(axis=1) for matrix in boxes], axis=0))
            for start, boxes in zip(experts.starts, experts.holders)]).tolist()
    for g in experts.groups:
        _geometry(basis, g)
    return True


def replan(previous, gen: dict, finish) -> object | None:
    """``previous`` (a local :class:`~megatron_refit.plan.refit_plan.RefitPlan` with its
    ``basis``) re-planned for the gen ranks' new parts ``gen``, or None where the module
    docstring's conditions do not hold. ``finish(transfers, targets, totals, basis)`` makes the
    plan (the caller's, shared with a full build)."""
    basis: Basis | None = previous.basis
    if basis is None or len(gen) != len(previous.gen_parts):
        return None
    targets = basis.targets
    experts = basis.cache.get("experts")
    if experts is None and not movable(basis, previous.gen_parts, previous.local):
        return None
    experts = basis.cache["experts"]
    held = _held(basis, experts, gen)
    if held is None:
        return None
    holding = Holding.of(held, len(experts.names))
    if not holding.counts.all() or holding.twice():  # an expert no rank holds, or one listed twice on a
        return None  # rank (its other pieces are compared whole): the full build names it
    totals = _totals(previous, basis, experts, holding)
    transfers = _transfers(previous, basis, experts, held, holding)
    return finish(transfers, _Targets(targets, holding, experts), totals,
                  replace(basis, holding=holding, cache=basis.cache))


def _held(basis: Basis, experts: _Experts, gen: dict) -> list[np.ndarray] | None:
    """Each gen rank's experts (their numbers), checked: its other pieces as before, its experts whole."""
    rest = basis.cache["rest"]
    out = []
    distinct: dict[tuple, int] = {}
    for rank in range(len(gen)):
        names, layout = gen[rank]
        others, mine = _split((names, layout), rank, experts, whole=True)
        if others is None or others != rest[rank] or distinct.setdefault(names, rank) != rank:
            return None  # another change, or two ranks alike (another class structure): a full build
        out.append(mine)
    return out


def _split(part: tuple, rank: int, experts: _Experts, whole: bool = False):
    """``((other names, their kinds' numbers), the numbers of its experts)`` of one gen rank's part;
    ``(None, None)`` where it is malformed or (``whole``) an expert's piece is not its whole
    tensor of its shape and dtype."""
    names, layout = part
    try:
        kind_of = kind_indices("gen", rank, names, layout)
        specs = kind_specs("gen", rank, names, layout, kind_of)
    except ValueError:
        return None, None
    name_list = names[0]
    number = np.fromiter(map(experts.index.get, name_list, repeat(-1)), dtype=np.int64, count=len(name_list))
    flags = number >= 0
    others = (~flags).tolist()
    values = [(s.global_shape, s.dtype, s.box) for s in specs]
    ids = [experts.kinds.setdefault(value, len(experts.kinds)) for value in values]  # each kind by value, once
    rest = (tuple(compress(name_list, others)), np.array(ids, dtype=np.int64)[np.frombuffer(
        kind_of.tobytes(), dtype=np.uint32)[~flags].astype(np.int64)].tobytes())
    mine = number[flags]
    if whole and len(mine):
        kinds = np.frombuffer(kind_of.tobytes(), dtype=np.uint32)[flags].astype(np.int64)
        pairs = np.unique(kinds * len(experts.groups) + experts.group_id[mine])
        for k, g in zip(*divmod(pairs, len(experts.groups))):  # each (kind, group) once: the group's whole tensor?
            k, g = int(k), int(g)
            shape, dtype, box = values[k]
            if (shape, dtype) != experts.kind[g] or box_numel(box) != math.prod(shape):
                return None, None
    return rest, mine


def _totals(previous, basis: Basis, experts: _Experts, holding: Holding) -> tuple[tuple[int, ...], int, int]:
    """``(train bytes, transfers, bytes held)`` of the whole plan after the move."""
    load = np.array(previous.train_bytes, dtype=np.int64)
    transfers, held = previous.num_transfers, previous.bytes_minimal
    for gi, (g, senders) in enumerate(zip(experts.groups, experts.holders)):
        span = slice(experts.starts[gi], experts.starts[gi] + len(g.names))
        after = holding.counts[span]
        before = basis.holding.counts[span] if basis.holding is not None else np.full_like(after, experts.before[gi])
        row = next(r for r in g.nbytes if any(r))  # a whole expert: the same bytes on every rank holding it
        for matrix, nbytes in zip(senders, row):
            k = matrix.shape[1]
            for h in range(k):
                share = (after // k + (h < after % k)) - (before // k + (h < before % k))
                load += np.bincount(matrix[:, h], weights=share * nbytes, minlength=len(load)).astype(np.int64)
        delta = int((after - before).sum())
        transfers += delta * len(g.train_boxes)
        held += delta * sum(row)
    return tuple(load.tolist()), transfers, held


def _geometry(basis: Basis, g: BoxGroup) -> list:
    geometry = basis.cache.setdefault("geometry", {})
    got = geometry.get(id(g))
    if got is None:  # a whole expert: each train box lands whole, at its own place
        box = next(b for b in g.gen_boxes if b is not None)
        got = geometry[id(g)] = [(relative(intersect(tb, box), tb), relative(intersect(tb, box), box),
                                  intersect(tb, box), nbytes)
                                 for tb, nbytes in zip(g.train_boxes, next(r for r in g.nbytes if any(r)))]
    return got


def _transfers(previous, basis: Basis, experts: _Experts, held: list[np.ndarray], holding: Holding) -> list[Transfer]:
    """The local rank's transfers: its other transfers as before, its experts' anew."""
    side, rank = previous.local
    index = experts.index
    out = [t for t in previous.transfers if t.name not in index]
    names, groups, position, group_id = experts.names, experts.groups, experts.position, experts.group_id
    if side == "gen":
        mine = held[rank]
        earlier = np.bincount(np.concatenate(held[:rank]), minlength=len(names)) if rank else None
        turns = earlier[mine].tolist() if earlier is not None else [0] * len(mine)
        for i, turn in zip(mine.tolist(), turns):  # turn: ranks before this one holding it
            g = groups[group_id[i]]
            senders = g.senders[position[i]]
            for s, (src_box, dst_box, box, nbytes) in zip(senders, _geometry(basis, g)):
                out.append(Transfer(names[i], s[turn % len(s)], rank, src_box, dst_box, box, g.dtype, nbytes))
        out.sort(key=lambda t: t.name)  # stable: a name's pieces in train box order
        return out
    for i in basis.cache["sends"]:
        g = groups[group_id[i]]
        senders = g.senders[position[i]]
        for turn, dst in enumerate(holding.ranks_of(i).tolist()):
            for s, (src_box, dst_box, box, nbytes) in zip(senders, _geometry(basis, g)):
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
        ranks = set(self._holding.ranks_of(i).tolist())
        shape, dtype = self._experts.kind[self._experts.group_id[i]]
        whole = tuple((0, n) for n in shape)
        return shape, dtype, tuple(whole if c in ranks else None for c in range(self._n))
