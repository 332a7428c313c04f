"""The refit plan: which train rank sends which box of which parameter to which gen rank (pure).

Every process builds the same plan from the same ShardSpecs, so no collective is needed to
agree on it. All validation happens in :meth:`RefitPlan.build`, before any transfer.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from operator import itemgetter

from megatron_refit.packing import Bucket, Transfer, _bucketize, _numel
from megatron_refit.spec import Box, ShardSpec, intersect, relative

ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""Byte alignment of items in a bucket, so any slice can be viewed as any dtype above."""


class PlanError(ValueError):
    """The train and gen ShardSpecs cannot be matched; the message names the parameter."""


def _check_dtype(name: str, dtype: str) -> None:
    if dtype not in ITEMSIZE:
        raise PlanError(f"{name}: unsupported dtype {dtype!r}; expected one of {sorted(ITEMSIZE)}")


def _check_tiling(name: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Distinct train boxes must be pairwise disjoint and cover ``shape`` exactly."""
    covered = sum(_numel(box) for box in boxes)
    if covered != math.prod(shape):
        raise PlanError(
            f"{name}: train pieces cover {covered} elements, the global shape {shape} has {math.prod(shape)}"
        )
    if not shape or len(boxes) == 1:  # one box inside the shape that covers it: the full box
        return
    # Sweep along the dim with the most distinct starts; only boxes open at a start can overlap.
    dim = max(range(len(shape)), key=lambda d: len({box[d][0] for box in boxes}))
    active: list[Box] = []
    for box in sorted(boxes, key=lambda b: b[dim][0]):
        active = [a for a in active if a[dim][1] > box[dim][0]]
        for other in active:
            if intersect(box, other) is not None:
                raise PlanError(f"{name}: train pieces {other} and {box} overlap")
        active.append(box)


def _index_specs(
    side: str, specs: dict[int, list[ShardSpec]]
) -> tuple[dict[str, dict[Box, list[int]]], dict[str, ShardSpec]]:
    """``name -> box -> ranks holding it`` and one spec per name; rejects duplicates and inconsistent metadata."""
    if sorted(specs) != list(range(len(specs))):
        raise PlanError(f"{side} ranks must be 0..{len(specs) - 1}, got {sorted(specs)}")
    index: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    meta: dict[str, ShardSpec] = {}
    for rank in range(len(specs)):
        seen: set[str] = set()
        for spec in specs[rank]:
            if spec.name in seen:
                raise PlanError(f"{spec.name}: listed twice on {side} rank {rank}")
            seen.add(spec.name)
            first = meta.setdefault(spec.name, spec)
            if first is spec:
                _check_dtype(spec.name, spec.dtype)
            elif (first.global_shape, first.dtype) != (spec.global_shape, spec.dtype):
                raise PlanError(
                    f"{spec.name}: {side} pieces disagree: global shape {first.global_shape} {first.dtype} "
                    f"vs {spec.global_shape} {spec.dtype} on {side} rank {rank}"
                )
            index[spec.name][spec.box].append(rank)
    return index, meta


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection meanwhile: building a plan allocates hundreds of
    thousands of long-lived acyclic tuples, and each collection would rescan them all."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


GenClass = tuple[tuple[int, ...], list[ShardSpec]]
"""Gen ranks holding identical pieces (e.g. the engine's DP replicas of one TP rank) and those pieces."""


def gen_classes(gen_specs: dict[int, list[ShardSpec]]) -> list[GenClass]:
    """Group gen ranks whose pieces are identical, in order of their first rank."""
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(gen_specs):
        key = tuple(sorted((s.name, s.box, s.global_shape, s.dtype) for s in gen_specs[rank]))
        groups.setdefault(key, []).append(rank)
    return [(tuple(ranks), gen_specs[ranks[0]]) for ranks in groups.values()]


Piece = tuple[Box, tuple[int, ...], int]
"""``(train box, senders, nbytes)``: one train box overlapping a gen piece; the class's
j-th gen rank receives it from ``senders[j % len(senders)]``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SenderPlan:
    """Validated sender assignment per class of identical gen ranks (pure).

    The compact form of a plan: what :meth:`RefitPlan.build` expands into transfers and
    buckets, and what a dry run at hundreds of gen ranks evaluates without expanding.
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
        train_index, train_meta = _index_specs("train", train_specs)
        for name in sorted(train_meta):
            _check_tiling(name, train_meta[name].global_shape, list(train_index[name]))
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

    def transfers(self) -> list[Transfer]:
        """Every transfer, ordered by gen rank, then name."""
        position = {rank: (c, j) for c, (ranks, _) in enumerate(self.classes) for j, rank in enumerate(ranks)}
        out = []
        for gen_rank in range(len(position)):
            c, j = position[gen_rank]
            for spec, pieces in self.classes[c][1]:
                for train_box, senders, nbytes in pieces:
                    box = intersect(train_box, spec.box)
                    out.append(Transfer(spec.name, senders[j % len(senders)], gen_rank, relative(box, train_box),
                                        relative(box, spec.box), box, spec.dtype, nbytes))
        return out


def _check_target(spec: ShardSpec, shape: tuple[int, ...], dtype: str) -> None:
    """A gen piece must agree with the trainer's tensor in global shape and dtype."""
    if spec.global_shape != shape:
        raise PlanError(f"{spec.name}: global shape {spec.global_shape} on gen ranks, {shape} on train ranks")
    if spec.dtype != dtype:
        hint = ""
        if spec.dtype.startswith("float8") and not dtype.startswith("float8"):
            hint = (": the engine loads block-FP8 weights; turn on trainer-side FP8 quantisation "
                    "(trainer_quantize_fp8) or serve the engine in the training dtype")
        raise PlanError(f"{spec.name}: dtype {spec.dtype} on gen ranks, {dtype} on train ranks{hint}")


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
            _check_target(spec, shape, dtype)
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
        _check_target(spec, shape, dtype)
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


@dataclass(frozen=True, kw_only=True)
class RefitPlan:
    """Transfers and their buckets, with trainer-local and gen-local rank indices."""

    train_global: tuple[int, ...]
    """Rank in the shared process group of each train rank."""
    gen_global: tuple[int, ...]
    """Rank in the shared process group of each gen rank."""
    transfers: tuple[Transfer, ...]
    buckets: tuple[Bucket, ...]
    """Ordered by (src_rank, dst_rank, index)."""
    unused_train_params: tuple[str, ...]
    """Train parameters that no gen rank needs (not sent)."""
    gen_specs: dict[int, tuple[ShardSpec, ...]] = field(repr=False)
    _from: dict[int, tuple[Bucket, ...]] = field(repr=False, compare=False)
    _to: dict[int, tuple[Bucket, ...]] = field(repr=False, compare=False)

    @classmethod
    def build(
        cls,
        train_specs: dict[int, list[ShardSpec]],
        gen_specs: dict[int, list[ShardSpec]],
        *,
        bucket_bytes: int = 64 << 20,
        direct_bytes: int | None = None,
        train_rank_ids: list[int] | None = None,
        gen_rank_ids: list[int] | None = None,
    ) -> RefitPlan:
        """``direct_bytes``: transfers at least this large get buckets of their own (sent
        without packing where the memory layout allows); None packs everything."""
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise PlanError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if direct_bytes is not None and (not isinstance(direct_bytes, int) or direct_bytes < 1):
            raise PlanError(f"direct_bytes must be a positive int or None, got {direct_bytes!r}")
        num_train, num_gen = len(train_specs), len(gen_specs)
        train_global = tuple(range(num_train) if train_rank_ids is None else train_rank_ids)
        gen_global = tuple(range(num_train, num_train + num_gen) if gen_rank_ids is None else gen_rank_ids)
        for side, ids, count in (("train", train_global, num_train), ("gen", gen_global, num_gen)):
            if len(ids) != count or len(set(ids)) != count:
                raise PlanError(f"{side}_rank_ids {list(ids)} must be {count} distinct ranks")

        senders = SenderPlan.build(train_specs, gen_classes(gen_specs))
        transfers = senders.transfers()
        buckets = _bucketize(transfers, bucket_bytes, direct_bytes)
        from_: dict[int, list[Bucket]] = {rank: [] for rank in range(num_train)}
        to: dict[int, list[Bucket]] = {rank: [] for rank in range(num_gen)}
        for bucket in buckets:
            from_[bucket.src_rank].append(bucket)
            to[bucket.dst_rank].append(bucket)
        return cls(
            train_global=train_global,
            gen_global=gen_global,
            transfers=tuple(transfers),
            buckets=tuple(buckets),
            unused_train_params=senders.unused_train_params,
            gen_specs={rank: tuple(specs) for rank, specs in gen_specs.items()},
            _from={rank: tuple(b) for rank, b in from_.items()},
            _to={rank: tuple(b) for rank, b in to.items()},
        )

    def global_src(self, bucket: Bucket) -> int:
        return self.train_global[bucket.src_rank]

    def global_dst(self, bucket: Bucket) -> int:
        return self.gen_global[bucket.dst_rank]

    def buckets_from(self, train_idx: int) -> tuple[Bucket, ...]:
        return self._from[train_idx]

    def buckets_to(self, gen_idx: int) -> tuple[Bucket, ...]:
        return self._to[gen_idx]

    def gen_pieces(self, gen_idx: int) -> list[ShardSpec]:
        return list(self.gen_specs[gen_idx])

    @property
    def bytes_sent(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    @property
    def bytes_minimal(self) -> int:
        """Bytes the gen ranks hold: what any refit must deliver at least."""
        return sum(spec.numel * ITEMSIZE[spec.dtype] for specs in self.gen_specs.values() for spec in specs)

    def bytes_from(self, train_idx: int) -> int:
        return sum(item.transfer.nbytes for bucket in self._from[train_idx] for item in bucket.items)

    def bytes_to(self, gen_idx: int) -> int:
        return sum(item.transfer.nbytes for bucket in self._to[gen_idx] for item in bucket.items)

    def fingerprint(self) -> str:
        """sha256 of the canonical plan text; equal on every rank that built the same plan."""
        lines = [f"train {self.train_global}", f"gen {self.gen_global}", f"unused {self.unused_train_params}"]
        for bucket in self.buckets:
            lines.append(f"bucket {bucket.src_rank} {bucket.dst_rank} {bucket.index} {bucket.nbytes}")
            for item in bucket.items:
                t = item.transfer
                lines.append(f"  {item.offset} {t.name} {t.dtype} {t.nbytes} {t.global_box} {t.src_box} {t.dst_box}")
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()

    def summary(self) -> dict[str, int]:
        sent = [self.bytes_from(rank) for rank in self._from]
        return {
            "num_train_ranks": len(self.train_global),
            "num_gen_ranks": len(self.gen_global),
            "num_transfers": len(self.transfers),
            "num_buckets": len(self.buckets),
            "num_unused_train_params": len(self.unused_train_params),
            "bytes_sent": self.bytes_sent,
            "bytes_minimal": self.bytes_minimal,
            "max_bytes_from_one_train_rank": max(sent, default=0),
            "min_bytes_from_one_train_rank": min(sent, default=0),
            "max_bucket_bytes": max((b.nbytes for b in self.buckets), default=0),
        }
