"""A rank's pieces in the compact form ``prepare()`` gathers, and the gen targets built from
them (pure).

An engine's TP ranks each hold a piece of the same parameters: at DeepSeek-V3 scale (vLLM
TP32) 45 k names on each of 32 ranks, with a handful of distinct boxes between them. So a
rank's pieces travel in two parts: its *names* (sorted, with the pairs of pieces adjacent
in memory as index pairs), which the TP ranks share and the group's de-duplicating gather
moves once, and its *layout* (the distinct ``(global shape, dtype, box, pp stage, expert)``
kinds and each name's kind), which is small. The plan is then built from the parts without
a ShardSpec per gen piece: :func:`gen_targets_of` gives :class:`GenTargets` directly.

Both parts are plain tuples, bytes and numbers (they travel as refit metadata, see
:mod:`megatron_refit.wire`); :func:`unpack` validates a peer's parts.
"""

from __future__ import annotations

from array import array

from megatron_refit.errors import PlanError
from megatron_refit.plan.checks import check_dtype
from megatron_refit.plan.gen_layout import GenTargets
from megatron_refit.plan.roles import EXPERT_RE
from megatron_refit.plan.spec import ShardSpec

Names = tuple[tuple[str, ...], tuple[int, ...]]
"""``(names sorted, flat pairs (a, b, a, b, ...) of indices, in order: piece b starts where a ends)``."""

Layout = tuple[tuple[tuple, ...], bytes]
"""``(kinds, each name's kind as uint8, uint16 or uint32: :func:`narrow`)``; a kind is ``(global shape, dtype, box,
pp stage, expert)``."""


WIDTHS = {1: "B", 2: "H", 4: "I"}
"""Bytes per kind index -> its array type code: a part's kind indices travel in the fewest bytes
that hold the largest (a rank holds up to 10^5 names of a few dozen kinds: one byte each)."""


def type_code(top: int) -> str:
    """The array type code of kind indices up to ``top``, as :func:`narrow` writes them."""
    return "B" if top < 1 << 8 else "H" if top < 1 << 16 else "I"


def narrow(kind_of) -> bytes:
    """Kind indices as a part carries them: each in 1, 2 or 4 bytes, the fewest that hold the largest."""
    code = type_code(max(kind_of, default=0))
    return (kind_of if isinstance(kind_of, array) and kind_of.typecode == code else array(code, kind_of)).tobytes()


def widen(raw: bytes, count: int) -> array | None:
    """The kind indices of ``count`` names from ``raw`` (:func:`narrow`'s, the width read from
    the sizes); None where no width fits."""
    if not count:
        code = None if raw else "B"
    else:
        code = None if len(raw) % count else WIDTHS.get(len(raw) // count)
    if code is None:
        return None
    out = array(code)
    out.frombytes(raw)
    return out


def pack(specs: list[ShardSpec], adjacent: list[tuple[str, str]] = ()) -> tuple[Names, Layout]:
    """``specs`` (and adjacent pairs of them) as ``(names, layout)``. A name listed twice stays
    twice (the plan refuses it on every rank, naming this one); an adjacent pair naming a piece
    the rank does not hold becomes index -1 (refused likewise)."""
    order = sorted(specs, key=lambda s: (s.name, s.box))
    kinds: dict[tuple, int] = {}
    kind_of = array("I", (kinds.setdefault((s.global_shape, s.dtype, s.box, s.pp_stage, s.is_expert), len(kinds))
                          for s in order))
    names = tuple(s.name for s in order)
    index: dict[str, int] = {}
    for i, name in enumerate(names):
        index.setdefault(name, i)
    pairs = tuple(x for pair in sorted((index.get(a, -1), index.get(b, -1)) for a, b in adjacent) for x in pair)
    plain = tuple((tuple(shape), dtype, tuple(map(tuple, box)), int(stage), bool(expert))  # as peers decode them
                  for shape, dtype, box, stage, expert in kinds)
    return (names, pairs), (plain, narrow(kind_of))


def kind_indices(side: str, rank: int, names: Names, layout: Layout, checked: dict | None = None) -> array:
    """Each name's kind, checked against the parts (``PlanError`` naming the rank). ``checked``:
    what this caller's earlier calls checked (an engine's TP ranks share one names list and
    equal kind indices), kept alive by the caller; this call's is added."""
    parts = names, layout
    if not (all(isinstance(part, tuple) and len(part) == 2 for part in parts)
            and all(isinstance(x, t) for x, t in zip((*names, *layout), (tuple, tuple, tuple, bytes)))):
        raise PlanError(f"{side} rank {rank}: malformed pieces (expected ((names, pairs), (kinds, bytes)) of tuples)")
    (name_list, pairs), (kinds, raw) = parts
    kind_of = widen(raw, len(name_list))
    if kind_of is None:
        raise PlanError(f"{side} rank {rank}: {len(name_list)} names but {len(raw)} bytes of kind indices")
    if kind_of and (checked is None or (raw, len(kinds)) not in checked):
        if max(kind_of) >= len(kinds):
            raise PlanError(f"{side} rank {rank}: kind index {max(kind_of)} out of range for {len(kinds)} kinds")
        if checked is not None:
            checked[raw, len(kinds)] = True
    if checked is None or id(name_list) not in checked:
        try:
            "".join(name_list)  # every name a string, checked at C speed (a rank holds up to 10^5 names)
        except TypeError:
            bad = next(name for name in name_list if not isinstance(name, str))
            raise PlanError(f"{side} rank {rank}: a piece name is {bad!r}, not a string") from None
        if checked is not None:
            checked[id(name_list)] = True
    if len(pairs) % 2 or any(not isinstance(i, int) or not 0 <= i < len(name_list) for i in pairs):
        bad = next((i for i in pairs if not isinstance(i, int) or not 0 <= i < len(name_list)), None)
        raise PlanError(f"{side}_adjacent of {side} rank {rank}: a pair names a piece the rank does not hold "
                        f"(index {bad!r} of {len(name_list)})")
    return kind_of


def kind_specs(side: str, rank: int, names: Names, layout: Layout, kind_of: array,
               firsts: dict | None = None) -> list[ShardSpec]:
    """One validated ShardSpec per kind (named after its first name), so that every piece of
    the rank can be built trusted. ``firsts``: each kind's first index by the kind indices'
    bytes, kept by a caller whose ranks number kinds alike (an engine's TP ranks: one scan)."""
    name_list, kinds = names[0], layout[0]
    first = None if firsts is None else firsts.get(layout[1])
    if first is None:
        first = {}
        for i, k in enumerate(kind_of):
            if k not in first:
                first[k] = i
                if len(first) == len(kinds):
                    break
        if firsts is not None:
            firsts[layout[1]] = first
    out = []
    for k, kind in enumerate(kinds):
        name = name_list[first[k]] if k in first else "(unused kind)"
        problem = None
        if not (isinstance(kind, tuple) and len(kind) == 5 and isinstance(kind[0], tuple) and isinstance(kind[1], str)
                and isinstance(kind[2], tuple) and all(isinstance(d, tuple) for d in kind[2])):
            problem = "expected (global shape, dtype, box, pp stage, expert)"
        else:
            try:
                shape, dtype, box, pp_stage, is_expert = kind
                out.append(ShardSpec(name, shape, dtype, box, pp_stage=pp_stage, is_expert=bool(is_expert)))
            except (TypeError, ValueError) as exc:
                problem = str(exc)
        if problem is not None:
            raise PlanError(f"{side} rank {rank}: malformed piece kind {kind!r}: {problem}")
    return out


def unpack(side: str, rank: int, names: Names, layout: Layout) -> list[ShardSpec]:
    """The rank's ShardSpecs (by name, then box), validated (``PlanError`` naming the rank)."""
    kind_of = kind_indices(side, rank, names, layout)
    kinds = kind_specs(side, rank, names, layout, kind_of)
    trusted = ShardSpec.trusted
    return [trusted(name, kinds[k].global_shape, kinds[k].dtype, kinds[k].box, pp_stage=kinds[k].pp_stage,
                    is_expert=kinds[k].is_expert) for name, k in zip(names[0], kind_of)]


def index_parts(side: str, parts: dict[int, tuple[Names, Layout]]) -> tuple[dict, dict]:
    """:func:`~megatron_refit.plan.checks.index_specs` of ranks' gathered parts, without a
    ShardSpec per piece: ``name -> box -> ranks holding it`` (in rank order) and, per name, a
    spec of its global shape and dtype. Each distinct part (the gather's equal objects: DP
    replicas) is read once, so the work grows with the distinct parts, not with the world. The
    same validation and errors: a malformed part, a name listed twice on a rank, a parameter
    whose global shape or dtype differs between ranks. The names of one part held alone share
    one list of holders, and those of one kind one boxes dict (and their spec), until another
    part adds to them: the index's dicts and lists are read only."""
    if sorted(parts) != list(range(len(parts))):
        raise PlanError(f"{side} ranks must be 0..{len(parts) - 1}, got {sorted(parts)}")
    sharing: dict[tuple[int, int], list[int]] = {}
    for rank in range(len(parts)):
        names, layout = parts[rank]
        sharing.setdefault((id(names), id(layout)), []).append(rank)
    index: dict[str, dict] = {}
    meta: dict[str, ShardSpec] = {}
    merged: dict[int, list[int]] = {}  # holder lists that more than one part added to (copies): sorted at the end
    shared: dict[int, dict] = {}  # boxes dicts that one part's names of one kind share (copied where merged)
    checked: dict = {}
    layouts: dict[int, list[ShardSpec]] = {}  # a layout's kinds, read once (EP ranks share one)
    for ranks in sharing.values():
        names, layout = parts[ranks[0]]
        kind_of = kind_indices(side, ranks[0], names, layout, checked)
        specs = layouts.get(id(layout))
        if specs is None:  # named after the first part's names: a spec's name appears in no message here
            specs = layouts[id(layout)] = kind_specs(side, ranks[0], names, layout, kind_of)
        name_list = names[0]
        if len(set(name_list)) != len(name_list):
            twice = next(a for a, b in zip(name_list, name_list[1:]) if a == b)
            raise PlanError(f"{twice}: listed twice on {side} rank {ranks[0]}")
        alone: list[dict | None] = [None] * len(specs)  # the part's boxes of each kind, shared by its names
        for name, k in zip(name_list, kind_of):
            spec = specs[k]
            boxes = index.get(name)
            if boxes is None:
                boxes = alone[k]
                if boxes is None:
                    check_dtype(name, spec.dtype)
                    boxes = alone[k] = {spec.box: ranks}
                    shared[id(boxes)] = boxes
                index[name] = boxes
                meta[name] = spec
                continue
            first = meta[name]
            if first is not spec and (first.global_shape, first.dtype) != (spec.global_shape, spec.dtype):
                raise PlanError(f"{name}: {side} pieces disagree: global shape {first.global_shape} {first.dtype} "
                                f"vs {spec.global_shape} {spec.dtype} on {side} rank {ranks[0]}")
            if id(boxes) in shared:  # the name's own boxes from here on
                boxes = index[name] = boxes.copy()
            holders = boxes.get(spec.box)
            if holders is None:
                boxes[spec.box] = ranks
            elif id(holders) in merged:
                holders += ranks
            else:
                boxes[spec.box] = holders = holders + ranks
                merged[id(holders)] = holders
    for holders in merged.values():
        holders.sort()
    return index, meta


def adjacent_names(names: Names) -> dict[str, str]:
    """``{a: b}`` of the rank's pairs (validated by :func:`kind_indices`)."""
    name_list, pairs = names
    return {name_list[pairs[i]]: name_list[pairs[i + 1]] for i in range(0, len(pairs), 2)}


def pack_targets(targets: GenTargets) -> dict[int, tuple[Names, Layout]]:
    """Each gen rank's pieces as its receiver packs them (the ShardSpecs of
    :func:`~megatron_refit.plan.gen_layout.gen_target_specs`, no adjacency), built from the
    compact targets without a ShardSpec per piece: names that share their shape, dtype and
    tuple of boxes share a *signature*, and each class maps signatures to its kinds. Equal
    names lists are one object, as the gather returns them."""
    names = sorted(targets.params)
    signatures: dict[tuple, int] = {}  # in order of first occurrence, as pack() meets kinds
    sig_of = []
    for name in names:
        shape, dtype, boxes = targets.params[name]
        sig_of.append(signatures.setdefault((shape, dtype, boxes, EXPERT_RE.search(name) is not None),
                                            len(signatures)))
    lists: dict[tuple[str, ...], Names] = {}
    out = {}
    for c, ranks in enumerate(targets.ranks):
        kinds: dict[tuple, int] = {}
        table = [None if boxes[c] is None else kinds.setdefault((shape, dtype, boxes[c], 0, expert), len(kinds))
                 for shape, dtype, boxes, expert in signatures]
        if None in table:  # this class holds only some of the parameters
            held = [(name, table[sig]) for name, sig in zip(names, sig_of) if table[sig] is not None]
            class_names, kind_of = tuple(name for name, _ in held), array("I", (k for _, k in held))
        else:
            class_names, kind_of = tuple(names), array("I", map(table.__getitem__, sig_of))
        parts = (lists.setdefault(class_names, (class_names, ())), (tuple(kinds), narrow(kind_of)))
        out.update(dict.fromkeys(ranks, parts))
    return out


def gen_targets_of(gen: dict[int, tuple[Names, Layout]]) -> GenTargets:
    """The gen ranks' pieces as :class:`GenTargets`: a class per distinct ``(names, layout)``
    (ranks holding identical pieces), in order of their first rank; every piece's box, with
    ``PlanError`` for a name listed twice on a rank, a malformed piece, or a parameter whose
    global shape or dtype differs between gen ranks. Linear in the distinct names lists plus
    the classes' name counts, with no ShardSpec per piece."""
    if sorted(gen) != list(range(len(gen))):
        raise PlanError(f"gen ranks must be 0..{len(gen) - 1}, got {sorted(gen)}")
    classes: dict[tuple, list[int]] = {}  # by (canonical names' identity, layout)
    # by identity first (the gather returns equal parts as one object): a names list is hashed
    # (all its names) once per distinct object, not once per rank or class
    seen: dict[tuple[int, int], list[int]] = {}
    canonical: dict[tuple, Names] = {}  # names lists by value: the first such object
    canonical_of: dict[int, Names] = {}  # the same by identity
    found: dict[tuple, tuple] = {}  # a class's (names, layout, kind indices)
    checked: dict = {}
    for rank in range(len(gen)):
        names, layout = gen[rank]
        members = seen.get((id(names), id(layout)))
        if members is None:  # checked before it is hashed: a peer's parts may be anything
            kind_of = kind_indices("gen", rank, names, layout, checked)
            same = canonical_of.get(id(names))
            if same is None:
                same = canonical_of[id(names)] = canonical.setdefault(names, names)
            key = (id(same), layout)
            members = seen[id(names), id(layout)] = classes.setdefault(key, [])
            found.setdefault(key, (same, layout, kind_of))
        members.append(rank)
    ranks = tuple(tuple(r) for r in classes.values())
    parts = [found[key] for key in classes]
    by_names: dict[int, tuple[Names, list[int]]] = {}  # classes sharing one names list (an engine's TP ranks)
    for c, (names, _, _) in enumerate(parts):
        by_names.setdefault(id(names), (names, []))[1].append(c)
    kinds = []
    firsts: dict = {}
    for c, (names, layout, kind_of) in enumerate(parts):
        specs = kind_specs("gen", ranks[c][0], names, layout, kind_of, firsts)
        kinds.append((kind_of, [(s.global_shape, s.dtype, s.box) for s in specs]))
    table: dict[str, tuple] = {}
    interned: dict[tuple, tuple] = {}  # equal box tuples as one object: the assignment groups by identity
    merged: dict[tuple[int, int], tuple] = {}  # by the entries' identity: names of one pattern merge once
    first: dict[int, int] = {}  # each entry's first gen rank, by its identity (entries stay alive meanwhile)
    for names, members in by_names.values():
        name_list = names[0]
        if len(set(name_list)) != len(name_list):
            twice = next(a for a, b in zip(name_list, name_list[1:]) if a == b)
            raise PlanError(f"{twice}: listed twice on gen rank {ranks[members[0]][0]}")
        rows: dict[tuple, tuple] = {}
        alike: dict[bytes, int] = {}  # classes whose kinds are numbered alike (an engine's TP ranks) zip once
        spread = [alike.setdefault(kinds[c][0].tobytes(), len(alike)) for c in members]
        firsts = [members[spread.index(d)] for d in range(len(alike))]
        for name, key in zip(name_list, zip(*(kinds[c][0] for c in firsts))):
            entry = rows.get(key)
            if entry is None:
                entry = rows[key] = _row(name, tuple(key[d] for d in spread), members, kinds, ranks, interned, first)
            prev = table.get(name)
            if prev is None:
                table[name] = entry
                continue
            done = merged.get((id(prev), id(entry)))
            if done is None:  # the entries kept alive with it: their ids stay theirs
                done = merged[id(prev), id(entry)] = (prev, entry, _merge(name, prev, entry, interned, first))
            table[name] = done[2]
    return GenTargets(ranks=ranks, params=dict(sorted(table.items())))  # the entries as they are: no copy a name


def _row(name: str, row: tuple, members: list[int], kinds: list, ranks: tuple, interned: dict,
         first_of: dict[int, int]) -> tuple:
    """``(global shape, dtype, box per class)`` of a name whose kind in each class of ``members``
    is ``row``; its first gen rank into ``first_of`` by its identity."""
    boxes: list = [None] * len(ranks)
    shape = dtype = None
    first = None
    for c, k in zip(members, row):
        kind_shape, kind_dtype, box = kinds[c][1][k]
        if first is None:
            shape, dtype, first = kind_shape, kind_dtype, ranks[c][0]
        elif (kind_shape, kind_dtype) != (shape, dtype):
            raise PlanError(f"{name}: global shape {shape} dtype {dtype} on gen rank {first}, "
                            f"{kind_shape} {kind_dtype} on gen rank {ranks[c][0]}")
        boxes[c] = box
    boxes = tuple(boxes)
    entry = shape, dtype, interned.setdefault(boxes, boxes)
    first_of[id(entry)] = first
    return entry


def _merge(name: str, a: tuple, b: tuple, interned: dict, first_of: dict[int, int]) -> tuple:
    """One name held by classes with different names lists (e.g. dense weights under expert
    parallelism)."""
    if (a[0], a[1]) != (b[0], b[1]):
        first, second = sorted((a, b), key=lambda e: first_of[id(e)])
        raise PlanError(f"{name}: global shape {first[0]} dtype {first[1]} on gen rank {first_of[id(first)]}, "
                        f"{second[0]} {second[1]} on gen rank {first_of[id(second)]}")
    boxes = tuple(x if x is not None else y for x, y in zip(a[2], b[2]))
    entry = a[0], a[1], interned.setdefault(boxes, boxes)
    first_of[id(entry)] = min(first_of[id(a)], first_of[id(b)])
    return entry
