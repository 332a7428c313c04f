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
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import accumulate, chain, compress, repeat

from megatron_refit.plan.box_groups import BoxGroup
from megatron_refit.plan.buckets import BY_DST_NAME, BY_NAME, Transfer, new_tuple
from megatron_refit.plan.folded import is_folded, stems_of
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
    """The plan's experts that can move, numbered: expert ``i`` (a parameter) is ``names[i]``,
    the groups' parameters in turn; a *unit* is one expert of one folded stem (its parameters
    move together), numbered stem by stem (:mod:`megatron_refit.plan.folded`)."""

    def __init__(self, basis: Basis, gen: dict, spelled: dict) -> None:
        self.names: list[str] = []
        self.groups: list[BoxGroup] = []
        self.group_id = array("l")
        self.position = array("l")
        for g in basis.groups:
            held = [box for box in g.gen_boxes if box is not None]
            shape = basis.train_meta[g.names[0]].global_shape
            if not basis.train_meta[g.names[0]].is_expert or any(box_numel(b) != math.prod(shape) for b in held):
                continue  # not an expert whole where held (expert parallelism): its names stay where they are
            self.group_id.extend(repeat(len(self.groups), len(g.names)))
            self.position.extend(range(len(g.names)))
            self.names += g.names
            self.groups.append(g)
        self.index = index = dict(zip(self.names, range(len(self.names))))
        self.stems: dict[tuple, int] = {}  # (prefix, suffixes) -> stem number
        self.rank_stems: list[list[int]] = []  # per gen rank: its stems' numbers, in its order
        size: list[int] = []  # per stem: 1 + the highest expert any rank holds
        rows = []
        for rank in range(len(gen)):
            numbers = []
            for prefix, suffixes, _, experts in stems_of("gen", rank, *gen[rank]):
                t = self.stems.setdefault((prefix, suffixes), len(self.stems))
                size += [0] * (len(self.stems) - len(size))
                size[t] = max(size[t], max(experts, default=-1) + 1)
                numbers.append(t)
                rows.append((rank, t, len(suffixes), experts))
            self.rank_stems.append(numbers)
        self.size = size
        self.width = [len(suffixes) for _, suffixes in self.stems]
        self.base = list(accumulate(size, initial=0))
        none = (-1,)
        self.unit_names: list[tuple[int, ...]] = [none] * self.base[-1]
        """Per unit: its parameters' numbers, one per suffix (-1: not a movable expert of this plan)."""
        at = {}  # per rank: where its next stem's names start in its spelled names
        for rank, t, width, experts in rows:  # each unit named once, by the names the parts were unfolded to
            every = spelled[id(gen[rank][0]), id(gen[rank][1])]
            start = at.get(rank, len(gen[rank][0][0]))
            for k, u in enumerate(map(self.base[t].__add__, experts)):
                if self.unit_names[u] is none:
                    self.unit_names[u] = tuple([index.get(x, -1) for x in every[start + k * width:
                                                                                 start + (k + 1) * width]])
            at[rank] = start + len(experts) * width
        self.bad = {u for u, found in enumerate(self.unit_names) if -1 in found}
        good = [u for u in range(len(self.unit_names)) if u not in self.bad]
        flat = list(chain.from_iterable(map(self.unit_names.__getitem__, good)))
        widths = [len(self.unit_names[u]) for u in good]
        self.unit_at = array("l", repeat(-1, len(self.names) + 1))
        """Each parameter's unit (-1: it does not move; the last entry: a name not here)."""
        self.suffix_at = array("l", repeat(-1, len(self.names) + 1))
        """Each moving parameter's place among its unit's."""
        for i, u, j in zip(flat, chain.from_iterable(map(repeat, good, widths)),
                           chain.from_iterable(map(range, widths))):
            self.unit_at[i], self.suffix_at[i] = u, j
        self.alone = len(set(flat)) == len(flat)
        """No parameter in two units (two ranks folding one layer's experts alike)."""
        self.moving = len(self.unit_names) - len(self.bad)
        self.kinds = [(basis.train_meta[g.names[0]].global_shape, g.dtype) for g in self.groups]
        """Per group: its parameters' ``(global shape, dtype)``."""

    def unit(self, name: str) -> int:
        """The unit of parameter ``name``, -1 where it does not move."""
        return self.unit_at[self.index.get(name, -1)]

    def name(self, u: int, j: int) -> str:
        return self.names[self.unit_names[u][j]]

    def kind_of(self, name: str) -> tuple:
        """``(global shape, dtype)`` of a parameter."""
        return self.kinds[self.group_id[self.index[name]]]


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


def movable(basis: Basis, gen: dict, local: tuple[str, int], spelled: dict) -> bool:
    """Whether the ``local`` rank's plan over the gen ranks' parts ``gen`` (as gathered:
    folded; ``spelled``: their names as :func:`~megatron_refit.plan.folded.unfold_parts` spelled
    them) has experts that :func:`replan` can move (a deployment under expert parallelism);
    if so their numbering, each rank's other pieces and what this rank sends are kept in
    ``basis`` now, so that a move re-plans in its own time only."""
    if any(len(ranks) != 1 for ranks in basis.targets.ranks) or not all(map(is_folded, gen.values())):
        return False
    experts = basis.cache["experts"] = _Experts(basis, gen, spelled)
    held = _units(experts, gen)
    plain = {id(names): names[0] for names, _ in gen.values()}
    if not experts.moving or held is None or not experts.alone or any(
            max(map(experts.unit, names), default=-1) >= 0 for names in plain.values()):
        return False  # none folded, one that cannot move, or one a rank holds unfolded (it would not move)
    classes: dict[tuple, int] = {}  # ranks whose other pieces are equal, numbered
    basis.cache["parts"] = [(names, layout[:3], classes.setdefault((names, layout[:3]), len(classes)))
                            for names, layout in (gen[r] for r in range(len(gen)))]
    basis.cache["before"] = Holding.of([list(chain.from_iterable(rows)) for rows in held]).counts
    if local[0] == "train":  # the units this train rank sends a box of
        rank, groups, position, group_id = local[1], experts.groups, experts.position, experts.group_id
        basis.cache["sends"] = [u for u, found in enumerate(experts.unit_names) if u not in experts.bad and any(
            rank in s for i in found for s in groups[group_id[i]].senders[position[i]])]
    basis.cache["geometry"] = {id(g): _geometry(g) for g in experts.groups}
    return True


def replan(previous, gen: dict, finish) -> object | None:
    """``previous`` (a local :class:`~megatron_refit.plan.refit_plan.RefitPlan` with its
    ``basis``) re-planned for the gen ranks' new parts ``gen`` (folded), or None where the
    module docstring's conditions do not hold. ``finish(transfers, targets, totals, basis,
    gen_next)`` makes the plan (the caller's, shared with a full build)."""
    basis: Basis | None = previous.basis
    if basis is None or len(gen) != len(previous.gen_parts) or "parts" not in basis.cache:
        return None
    experts = basis.cache["experts"]
    rows = _held(basis, experts, gen)
    if rows is None:
        return None
    held = [list(chain.from_iterable(r)) for r in rows]
    holding = Holding.of(held)
    if len(holding.counts) != experts.moving:  # a unit no rank holds: the full build names it
        return None
    totals = _totals(previous, basis, experts, holding)
    transfers = _transfers(previous, basis, experts, held, holding)
    return finish(transfers, _Targets(basis.targets, holding, experts), totals,
                  replace(basis, holding=holding, cache=basis.cache),
                  lambda rank: _Next(experts, gen[rank], experts.rank_stems[rank], rows[rank]))


def _units(experts: _Experts, gen: dict) -> list[list[list[int]]] | None:
    """Each gen rank's units (its experts, by unit number) per stem in its order, or None where
    one is malformed, out of range, listed twice or not movable."""
    out = []
    base, size, bad = experts.base, experts.size, experts.bad
    for rank in range(len(gen)):
        rows, stems = gen[rank][1][3], experts.rank_stems[rank]
        if not isinstance(rows, tuple) or len(rows) != len(stems):
            return None
        units: list[list[int]] = []
        for t, raw in zip(stems, rows):
            if not isinstance(raw, bytes) or len(raw) % 4:
                return None
            row = array("I")
            row.frombytes(raw)
            if row and max(row) >= size[t]:
                return None
            units.append(list(map(base[t].__add__, row)))
        every = list(chain.from_iterable(units))
        if len(set(every)) != len(every) or not bad.isdisjoint(every):
            return None
        out.append(units)
    return out


def _held(basis: Basis, experts: _Experts, gen: dict) -> list[list[list[int]]] | None:
    """Each gen rank's units per stem, checked: its other pieces as before (the same stems), its
    experts' pairs in range, none listed twice, no two ranks alike (that would be another class
    structure)."""
    parts = basis.cache["parts"]
    alike = set()
    for rank in range(len(gen)):
        part = gen[rank]
        if not is_folded(part):
            return None
        names, layout = part
        was_names, was_layout, same = parts[rank]
        if (names is not was_names and names != was_names) or layout[:3] != was_layout:
            return None  # another change: a full build
        alike.add((same, layout[3], layout[4]))
    rows = _units(experts, gen) if len(alike) == len(gen) else None
    for rank in range(len(gen)) if rows is not None else ():  # the experts' pairs within the rank's pieces
        names, layout = gen[rank]
        pairs = array("i")
        if not isinstance(layout[4], bytes) or len(layout[4]) % 8:
            return None
        pairs.frombytes(layout[4])
        size = len(names[0]) + sum(len(r) * experts.width[t] for r, t in zip(rows[rank], experts.rank_stems[rank]))
        if pairs and not (0 <= min(pairs) and max(pairs) < size):
            return None
    return rows


def _totals(previous, basis: Basis, experts: _Experts, holding: Holding) -> tuple[tuple[int, ...], int, int]:
    """``(train bytes, transfers, bytes held)`` of the whole plan after the move: what the
    units whose number of holders changed add or take."""
    before = basis.holding.counts if basis.holding is not None else basis.cache["before"]
    load = list(previous.train_bytes)
    transfers, held = previous.num_transfers, previous.bytes_minimal
    changed = () if dict.__eq__(holding.counts, before) else [u for u, n in holding.counts.items() if before[u] != n]
    for u in changed:
        after, was = holding.counts[u], before[u]
        for i in experts.unit_names[u]:
            g = experts.groups[experts.group_id[i]]
            row = next(r for r in g.nbytes if any(r))  # a whole expert: the same bytes on every rank holding it
            for holders, nbytes in zip(g.senders[experts.position[i]], row):
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
    geometry = basis.cache["geometry"]
    out = [t for t in previous.transfers if experts.unit(t.name) < 0]
    names, groups, position, group_id, unit_names = (experts.names, experts.groups, experts.position,
                                                     experts.group_id, experts.unit_names)
    if side == "gen":
        for u in held[rank]:
            ranks = holding.several.get(u)
            turn = ranks.index(rank) if ranks else 0  # the ranks before this one holding it
            for i in unit_names[u]:
                g = groups[group_id[i]]
                for s, (src_box, dst_box, box, nbytes) in zip(g.senders[position[i]], geometry[id(g)]):
                    out.append(new_tuple(Transfer, (names[i], s[turn % len(s)], rank, src_box, dst_box, box, g.dtype,
                                                    nbytes)))
        out.sort(key=BY_NAME)  # stable: a name's pieces in train box order
        return out
    for u in basis.cache["sends"]:
        for turn, dst in enumerate(holding.ranks_of(u)):
            for i in unit_names[u]:
                g = groups[group_id[i]]
                for s, (src_box, dst_box, box, nbytes) in zip(g.senders[position[i]], geometry[id(g)]):
                    if s[turn % len(s)] == rank:
                        out.append(new_tuple(Transfer, (names[i], rank, dst, src_box, dst_box, box, g.dtype, nbytes)))
    out.sort(key=BY_DST_NAME)  # by gen rank, then name (stable: train box order)
    return out


class _Targets:
    """The targets after a move, for the buckets' adjacency: the other pieces as planned, each
    moving expert whole on the ranks now holding it."""

    def __init__(self, targets, holding: Holding, experts: _Experts) -> None:
        self.ranks = targets.ranks
        self.params = _Params(targets.params, holding, experts, len(targets.ranks))


class _Params:
    def __init__(self, params: dict, holding: Holding, experts: _Experts, num_classes: int) -> None:
        self._params, self._holding, self._experts, self._n = params, holding, experts, num_classes

    def __getitem__(self, name: str) -> tuple:
        u = self._experts.unit(name)
        if u < 0:
            return self._params[name]
        ranks = set(self._holding.ranks_of(u))
        shape, dtype = self._experts.kind_of(name)
        whole = tuple((0, n) for n in shape)
        return shape, dtype, tuple(whole if c in ranks else None for c in range(self._n))


class _Next:
    """A gen rank's piece name -> the piece after it in its memory, after a move, for the
    buckets' direct runs: looked up as they ask, from the rank's pairs in the folded order
    (:mod:`megatron_refit.plan.folded`) and the experts now in its slots."""

    def __init__(self, experts: _Experts, part: tuple, stems: list[int], rows: list[list[int]]) -> None:
        (names, layout), outer = part, array("i")
        outer.frombytes(layout[4])
        self._experts, self._plain, self._rows = experts, names[0], rows
        self._links = dict(zip(chain(names[1][::2], outer[::2]), chain(names[1][1::2], outer[1::2])))
        self._widths = [experts.width[t] for t in stems]
        self._starts = list(accumulate((len(r) * w for r, w in zip(rows, self._widths)), initial=len(names[0])))
        self._index: dict[str, int] | None = None

    def __bool__(self) -> bool:
        return bool(self._links)

    def get(self, name: str, default=None):
        if self._index is None:  # each piece's place in the folded order
            self._index = dict(zip(self._plain, range(len(self._plain))))
            for n, (row, width) in enumerate(zip(self._rows, self._widths)):
                self._index.update(zip(map(self._experts.name, row, repeat(0)),
                                       range(self._starts[n], self._starts[n + 1], width)))
        at = self._index.get(name)
        if at is None:
            u = self._experts.unit(name)
            first = None if u < 0 else self._index.get(self._experts.name(u, 0))
            if first is None:
                return default
            at = first + self._experts.suffix_at[self._experts.index[name]]
        b = self._links.get(at, -1)
        if b < 0:
            return default
        if b < len(self._plain):
            return self._plain[b]
        n = bisect_right(self._starts, b) - 1
        k, j = divmod(b - self._starts[n], self._widths[n])
        return self._experts.name(self._rows[n][k], j)
