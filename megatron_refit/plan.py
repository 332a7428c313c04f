"""The refit plan: which train rank sends which box of which parameter to which gen rank (pure).

Every process builds the same plan from the same ShardSpecs, so no collective is needed to
agree on it. All validation happens in :meth:`RefitPlan.build`, before any transfer.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

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
    if not shape:
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


def _assign(
    train_index: dict[str, dict[Box, list[int]]], gen_specs: dict[int, list[ShardSpec]], num_train: int
) -> list[Transfer]:
    """One transfer per (gen piece, overlapping train box), sent by the least-loaded holder
    of that train box so far (lowest rank on ties)."""
    # Train boxes sorted by their dim-0 start: those starting at or after a gen box's dim-0
    # stop cannot overlap it.
    by_start = {name: sorted(boxes, key=lambda box: box[0][0] if box else 0) for name, boxes in train_index.items()}
    overlaps: dict[tuple[str, Box], list[tuple[list[int], Box, Box, Box, int]]] = {}

    def find_overlaps(spec: ShardSpec) -> list[tuple[list[int], Box, Box, Box, int]]:
        """``(holders, src_box, dst_box, global_box, nbytes)`` per train box overlapping ``spec``."""
        boxes = by_start[spec.name]
        if spec.box:
            boxes = boxes[: bisect.bisect_left(boxes, spec.box[0][1], key=lambda box: box[0][0])]
        out = []
        for train_box in boxes:
            box = intersect(train_box, spec.box)
            if box is not None:
                nbytes = _numel(box) * ITEMSIZE[spec.dtype]
                out.append(
                    (train_index[spec.name][train_box], relative(box, train_box), relative(box, spec.box), box, nbytes)
                )
        assert sum(piece[-1] for piece in out) == spec.numel * ITEMSIZE[spec.dtype], spec
        return out

    load = [0] * num_train
    transfers = []
    for gen_rank in range(len(gen_specs)):
        for spec in sorted(gen_specs[gen_rank], key=lambda spec: spec.name):
            key = (spec.name, spec.box)
            if key not in overlaps:
                overlaps[key] = find_overlaps(spec)
            for holders, src_box, dst_box, box, nbytes in overlaps[key]:
                src = min(holders, key=load.__getitem__)
                load[src] += nbytes
                transfers.append(Transfer(spec.name, src, gen_rank, src_box, dst_box, box, spec.dtype, nbytes))
    return transfers


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

        train_index, train_meta = _index_specs("train", train_specs)
        _, gen_meta = _index_specs("gen", gen_specs)
        for name in sorted(gen_meta):
            gen, train = gen_meta[name], train_meta.get(name)
            if train is None:
                raise PlanError(f"HF name {name} is not produced by the trainer")
            if gen.global_shape != train.global_shape:
                raise PlanError(
                    f"{name}: global shape {gen.global_shape} on gen ranks, {train.global_shape} on train ranks"
                )
            if gen.dtype != train.dtype:
                hint = ""
                if gen.dtype.startswith("float8") and not train.dtype.startswith("float8"):
                    hint = (": the engine loads block-FP8 weights; turn on trainer-side FP8 quantisation "
                            "(trainer_quantize_fp8) or serve the engine in the training dtype")
                raise PlanError(f"{name}: dtype {gen.dtype} on gen ranks, {train.dtype} on train ranks{hint}")
        for name in sorted(train_meta):
            _check_tiling(name, train_meta[name].global_shape, list(train_index[name]))

        transfers = _assign(train_index, gen_specs, num_train)
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
            unused_train_params=tuple(sorted(set(train_meta) - set(gen_meta))),
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
