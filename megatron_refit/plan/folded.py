"""An engine rank's whole experts folded: each MoE layer's stem once and the experts the rank
holds as numbers, not a name per piece (pure).

A wide expert-parallel engine rank (vLLM ``--enable-expert-parallel``) holds whole experts:
DeepSeek-V3 at EP32 with FP8 weights, 3,132 expert names of its 4,349. When EPLB moves experts,
those names are all that changes, and a re-plan that looked each one up again would spend its
time hashing 10^5 fresh strings (:mod:`megatron_refit.plan.expert_moves`). So an engine rank
gathers its pieces folded: the names part keeps the other names, their adjacent pairs and, per
*stem* (the name up to the expert's number, e.g. ``model.layers.3.mlp.experts.``), the suffixes
every expert of it holds; the layout part keeps each suffix's kind, per stem the experts the rank
holds (uint32, ascending), and the adjacent pairs that touch an expert's piece (int32 indices in
the folded order: the other names, then each stem's experts' suffixes in turn). The names part is
then the same bytes before and after a move (the gather moves it by digest), and a move is a few
kB of numbers.

Folded parts::

    names  = (other names, their pairs, ((prefix, suffixes), ...))
    layout = (kinds, the other names' kinds as uint32, each stem's suffixes' kinds as uint32,
              (each stem's experts as uint32, ...), the experts' pairs as int32)

:func:`fold` folds only what round-trips: a stem whose experts hold the same suffixes, each
suffix of one kind, whole (the expert's full tensor); :func:`unfold` gives back exactly
:func:`~megatron_refit.plan.pieces.pack`'s form, so a full build plans folded and plain parts
alike.
"""

from __future__ import annotations

from array import array
from itertools import repeat

from megatron_refit.errors import PlanError
from megatron_refit.plan.pieces import Layout, Names, narrow, type_code, widen
from megatron_refit.plan.roles import EXPERT_RE


def is_folded(part: tuple) -> bool:
    names, layout = part
    return isinstance(names, tuple) and len(names) == 3 and isinstance(layout, tuple) and len(layout) == 5


def fold(names: Names, layout: Layout) -> tuple[tuple, tuple]:
    """``pack()``'s parts with their foldable stems folded (unchanged where none is)."""
    name_list, pairs = names
    kinds, raw = layout
    kind_of = widen(raw, len(name_list))
    whole = [box == tuple((0, n) for n in shape) for shape, _, box, _, _ in kinds]
    stems: dict[str, dict[int, dict[str, list[int]]]] = {}  # prefix -> expert -> suffix -> indices
    where: dict[int, str] = {}  # index -> its stem
    for i, name in enumerate(name_list):
        match = EXPERT_RE.search(name)
        if match is None or not whole[kind_of[i]]:
            continue
        number = match.group("expert")
        if number != str(int(number)) or int(number) >= 1 << 32:
            continue  # "01" would not round-trip, nor a number past uint32
        prefix, suffix = name[:match.start("expert")], name[match.end("expert") + 1:]
        stems.setdefault(prefix, {}).setdefault(int(number), {}).setdefault(suffix, []).append(i)
        where[i] = prefix
    folded = []
    for prefix in sorted(stems):
        experts = stems[prefix]
        first = next(iter(experts.values()))
        suffixes = sorted(first)
        kinds_of = [kind_of[first[suffix][0]] for suffix in suffixes]
        if all(sorted(s) == suffixes and all(len(s[x]) == 1 for x in suffixes)
               and [kind_of[s[x][0]] for x in suffixes] == kinds_of for s in experts.values()):
            folded.append((prefix, tuple(suffixes), kinds_of, sorted(experts)))
    if not folded:
        return names, layout
    gone = {f[0] for f in folded}
    plain = [i for i in range(len(name_list)) if where.get(i) not in gone]
    every = plain + [stems[prefix][e][x][0] for prefix, suffixes, _, row in folded for e in row for x in suffixes]
    at = {i: n for n, i in enumerate(every)}  # where each piece is in the folded order
    moved = sorted((at.get(a, -1), at.get(b, -1)) for a, b in zip(pairs[::2], pairs[1::2]))
    inner = [pair for pair in moved if max(pair) < len(plain)]  # the other pieces' own: as the names
    outer = [pair for pair in moved if max(pair) >= len(plain)]  # to or from an expert: where the experts are
    return ((tuple(map(name_list.__getitem__, plain)), tuple(x for pair in inner for x in pair),
             tuple((prefix, suffixes) for prefix, suffixes, _, _ in folded)),
            (kinds, narrow(array("I", map(kind_of.__getitem__, plain))),
             array("I", [k for _, _, ks, _ in folded for k in ks]).tobytes(),
             tuple(array("I", row).tobytes() for *_, row in folded),
             array("i", [x for pair in outer for x in pair]).tobytes()))


def fold_parts(parts: dict[int, tuple]) -> dict[int, tuple]:
    """Each rank's parts folded, equal objects once (as the gather returns them)."""
    done: dict[tuple[int, int], tuple] = {}
    out = {}
    for rank, (names, layout) in parts.items():
        key = (id(names), id(layout))
        if key not in done:
            done[key] = fold(names, layout)
        out[rank] = done[key]
    return out


def stems_of(side: str, rank: int, names: tuple, layout: tuple) -> list[tuple[str, tuple, array, array]]:
    """A folded part's stems checked: ``(prefix, suffixes, suffix kinds, experts in order)``
    each (``PlanError`` naming the rank where malformed)."""
    stems, (_, _, raw_kinds, rows, _) = names[2], layout
    if not (isinstance(stems, tuple) and isinstance(raw_kinds, bytes) and isinstance(rows, tuple)
            and len(rows) == len(stems) and all(isinstance(r, bytes) and len(r) % 4 == 0 for r in rows)
            and len(raw_kinds) % 4 == 0):
        raise PlanError(f"{side} rank {rank}: malformed folded experts (expected one uint32 row per stem)")
    suffix_kinds = array("I")
    suffix_kinds.frombytes(raw_kinds)
    out = []
    start = 0
    for stem, raw in zip(stems, rows):
        if not (isinstance(stem, tuple) and len(stem) == 2 and isinstance(stem[0], str)
                and isinstance(stem[1], tuple) and stem[1] and all(isinstance(x, str) for x in stem[1])):
            raise PlanError(f"{side} rank {rank}: malformed expert stem {stem!r} (expected (prefix, suffixes))")
        experts = array("I")
        experts.frombytes(raw)
        out.append((stem[0], stem[1], suffix_kinds[start:start + len(stem[1])], experts))
        start += len(stem[1])
    if start != len(suffix_kinds):
        raise PlanError(f"{side} rank {rank}: {len(suffix_kinds)} expert suffix kinds for {start} suffixes")
    return out


def unfold(side: str, rank: int, names: tuple, layout: tuple, spelled: list | None = None) -> tuple[Names, Layout]:
    """A folded part as :func:`~megatron_refit.plan.pieces.pack` gives it (a plain part as it
    is); ``spelled``: extended with its names in the folded order (the other names, then each
    stem's experts' suffixes in turn)."""
    if not is_folded((names, layout)):
        return names, layout
    plain_kinds = widen(layout[1], len(names[0])) if isinstance(names[0], tuple) and isinstance(layout[1], bytes) \
        else None
    if not (isinstance(names[1], tuple) and plain_kinds is not None):
        raise PlanError(f"{side} rank {rank}: malformed folded pieces (expected ((names, pairs, stems), "
                        "(kinds, bytes, bytes, rows, bytes)))")
    if not isinstance(layout[4], bytes) or len(layout[4]) % 8:
        raise PlanError(f"{side} rank {rank}: malformed folded pieces (expected the experts' pairs as int32 pairs)")
    plain, pairs, _ = names
    outer = array("i")
    outer.frombytes(layout[4])
    pairs = (*pairs, *outer)
    every = list(plain)  # the folded order: the pairs' indices
    kind_of = array("I", plain_kinds)
    for prefix, suffixes, suffix_kinds, experts in stems_of(side, rank, names, layout):
        every += [head + suffix for head in [f"{prefix}{e}." for e in experts] for suffix in suffixes]
        kind_of.extend(suffix_kinds * len(experts))
    if spelled is not None:
        spelled += every
    kinds = dict(zip(every, kind_of))
    code = type_code(max(kind_of, default=0))  # as pack() writes them
    if len(kinds) == len(every):  # names once each (else the plan names the one listed twice)
        order = sorted(every)  # runs already in order: the other names, each stem's experts
        kind_of = array(code, map(kinds.__getitem__, order))
        if not pairs:
            return (tuple(order), ()), (layout[0], kind_of.tobytes())
        at = dict(zip(order, range(len(order))))
        position = array("l", (at[name] for name in every))
    else:
        ranked = sorted(range(len(every)), key=every.__getitem__)
        order, kind_of = list(map(every.__getitem__, ranked)), array(code, map(kind_of.__getitem__, ranked))
        position = array("l", repeat(0, len(every)))
        for n, i in enumerate(ranked):
            position[i] = n
    position.append(-1)  # a pair's end out of range (a peer's) stays out of range: the plan names it
    out = len(every)
    ends = [position[i if isinstance(i, int) and 0 <= i < out else out] for i in pairs]
    moved = sorted(zip(ends[::2], ends[1::2]))
    return (tuple(order), tuple(x for pair in moved for x in pair)), (layout[0], kind_of.tobytes())


def unfold_parts(side: str, parts: dict[int, tuple], spelled: dict | None = None) -> dict[int, tuple]:
    """Each rank's parts unfolded, equal objects once (plain parts as they are); ``spelled``:
    each folded part's names in the folded order, by the ids of its two parts (see :func:`unfold`)."""
    done: dict[tuple[int, int], tuple] = {}
    out = {}
    for rank, (names, layout) in parts.items():
        key = (id(names), id(layout))
        if key not in done:
            every = spelled.setdefault(key, []) if spelled is not None and is_folded((names, layout)) else None
            done[key] = unfold(side, rank, names, layout, every)
        out[rank] = done[key]
    return out
