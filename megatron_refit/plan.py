"""The refit plan: which train rank sends which box of which parameter to which gen rank (pure).

Every process builds the same plan from the same ShardSpecs, so no collective is needed to
agree on it. All validation happens in :meth:`RefitPlan.build`, before any transfer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from megatron_refit.packing import Bucket, Transfer, _bucketize
from megatron_refit.plan_checks import ITEMSIZE, PlanError, gc_paused
from megatron_refit.senders import SenderPlan, gen_classes
from megatron_refit.spec import ShardSpec

__all__ = ["ITEMSIZE", "PlanError", "RefitPlan", "SenderPlan", "gc_paused", "gen_classes"]


def _next_maps(adjacent: dict[int, list[tuple[str, str]]] | None, specs: dict[int, list[ShardSpec]],
               side: str) -> dict[int, dict[str, str]]:
    """Per rank, piece name -> the piece after it in memory; names must be the rank's pieces."""
    out: dict[int, dict[str, str]] = {}
    for rank, pairs in (adjacent or {}).items():
        if not pairs:
            continue
        if rank not in specs:
            raise PlanError(f"{side}_adjacent names {side} rank {rank}, which is not in the plan")
        names = {s.name for s in specs[rank]}
        for a, b in pairs:
            if a not in names or b not in names:
                raise PlanError(f"{side}_adjacent of {side} rank {rank}: ({a!r}, {b!r}) names a piece the rank "
                                "does not hold")
        out[rank] = dict(pairs)
    return out


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
        train_adjacent: dict[int, list[tuple[str, str]]] | None = None,
        gen_adjacent: dict[int, list[tuple[str, str]]] | None = None,
    ) -> RefitPlan:
        """``direct_bytes``: transfers at least this large get buckets of their own (sent
        without packing where the memory layout allows); None packs everything.

        ``train_adjacent`` / ``gen_adjacent``: per rank, pairs ``(a, b)`` of its pieces where
        ``b`` starts in memory where ``a`` ends (e.g. gate and up of one fused weight). Whole
        pieces adjacent on both ends of a pair then share one bucket that can go direct
        (see :func:`megatron_refit.packing._units`); a hint only, checked again at each refit."""
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
        src_next = _next_maps(train_adjacent, train_specs, "train")
        dst_next = _next_maps(gen_adjacent, gen_specs, "gen")
        shapes = ({(r, s.name): s.shape for r in src_next for s in train_specs[r]},
                  {(r, s.name): s.shape for r in dst_next for s in gen_specs[r]})

        def whole(t: Transfer) -> bool:
            shape = tuple(b - a for a, b in t.global_box)
            return shapes[0].get((t.src_rank, t.name)) == shape == shapes[1].get((t.dst_rank, t.name))

        buckets = _bucketize(transfers, bucket_bytes, direct_bytes, src_next, dst_next, whole)
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
