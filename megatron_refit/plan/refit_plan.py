"""The refit plan: which train rank sends which box of which parameter to which gen rank (pure).

Every process builds the same plan from the same ShardSpecs, so no collective is needed to
agree on it. All validation happens in :meth:`RefitPlan.build`, before any transfer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from megatron_refit.errors import PlanError
from megatron_refit.plan.buckets import Bucket, Transfer, bucketize
from megatron_refit.plan.checks import ITEMSIZE, gc_paused
from megatron_refit.plan.senders import SenderPlan, gen_classes
from megatron_refit.plan.spec import ShardSpec, box_shape

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


def _send_order(bucket: Bucket) -> tuple[int, int]:
    return bucket.index, bucket.dst_rank


def _receive_order(bucket: Bucket) -> tuple[int, int]:
    return bucket.index, bucket.src_rank


@dataclass(frozen=True, kw_only=True)
class RefitPlan:
    """Transfers and their buckets, with trainer-local and gen-local rank indices.

    A *local* plan (``build(..., local=("train", i))`` or ``("gen", j)``) holds only the
    transfers and buckets of that one rank: what a refit endpoint needs, without expanding
    every other rank's (millions at full scale). Its totals (``bytes_sent``, ``bytes_minimal``,
    :meth:`summary`) are still those of the whole plan; the buckets of other ranks are refused."""

    train_global: tuple[int, ...]
    """Rank in the shared process group of each train rank."""
    gen_global: tuple[int, ...]
    """Rank in the shared process group of each gen rank."""
    transfers: tuple[Transfer, ...]
    """Of the local rank only, in a local plan."""
    buckets: tuple[Bucket, ...]
    """Ordered by (src_rank, dst_rank, index); of the local rank only, in a local plan."""
    unused_train_params: tuple[str, ...]
    """Train parameters that no gen rank needs (not sent)."""
    gen_specs: dict[int, tuple[ShardSpec, ...]] = field(repr=False)
    local: tuple[str, int] | None = None
    """``("train", i)`` / ``("gen", j)`` for a local plan, None for the whole plan."""
    train_bytes: tuple[int, ...] = ()
    """Bytes each train rank sends (the whole plan's, also in a local plan)."""
    num_transfers: int = 0
    """Transfers of the whole plan."""
    settings: tuple[int, int | None] = (0, None)
    """``(bucket_bytes, direct_bytes)`` the buckets were cut with."""
    bytes_minimal: int = 0
    """Bytes the gen ranks hold: what any refit must deliver at least (from the gen pieces,
    not from the senders, so ``bytes_sent / bytes_minimal`` checks the assignment)."""
    _from: dict[int, tuple[Bucket, ...]] = field(repr=False, compare=False, default_factory=dict)
    _to: dict[int, tuple[Bucket, ...]] = field(repr=False, compare=False, default_factory=dict)

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
        local: tuple[str, int] | None = None,
    ) -> RefitPlan:
        """``direct_bytes``: transfers at least this large get buckets of their own (sent
        without packing where the memory layout allows); None packs everything.

        ``train_adjacent`` / ``gen_adjacent``: per rank, pairs ``(a, b)`` of its pieces where
        ``b`` starts in memory where ``a`` ends (e.g. gate and up of one fused weight). Whole
        pieces adjacent on both ends of a pair then share one bucket that can go direct
        (see :func:`megatron_refit.plan.buckets._units`); a hint only, checked again at each refit.

        ``local``: expand only this rank's transfers and buckets (see the class docstring);
        they equal the whole plan's for that rank. Validation covers the whole plan either way."""
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

        if local is not None and (local[0] not in ("train", "gen") or not isinstance(local[1], int)
                                  or not 0 <= local[1] < (num_train if local[0] == "train" else num_gen)):
            raise PlanError(f"local must be ('train', 0..{num_train - 1}) or ('gen', 0..{num_gen - 1}), got {local!r}")

        classes = gen_classes(gen_specs)
        senders = SenderPlan.build(train_specs, classes)
        if local is None:
            transfers = senders.transfers()
        else:
            transfers = senders.transfers(**{"src" if local[0] == "train" else "dst": local[1]})
        src_next = _next_maps(train_adjacent, train_specs, "train")
        dst_next = _next_maps(gen_adjacent, gen_specs, "gen")
        shapes: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}  # (side, rank) -> name -> piece shape

        def shape_of(side: int, rank: int, name: str):
            if (side, rank) not in shapes:
                specs = (train_specs if side == 0 else gen_specs)[rank]
                shapes[side, rank] = {spec.name: spec.shape for spec in specs}
            return shapes[side, rank].get(name)

        def whole(t: Transfer) -> bool:
            if t.src_rank not in src_next or t.dst_rank not in dst_next:
                return False
            shape = box_shape(t.global_box)
            return shape_of(0, t.src_rank, t.name) == shape == shape_of(1, t.dst_rank, t.name)

        buckets = bucketize(transfers, bucket_bytes, direct_bytes, src_next, dst_next, whole)
        from_: dict[int, list[Bucket]] = {rank: [] for rank in range(num_train)}
        to: dict[int, list[Bucket]] = {rank: [] for rank in range(num_gen)}
        for bucket in buckets:
            from_[bucket.src_rank].append(bucket)
            to[bucket.dst_rank].append(bucket)
        if local is not None:  # other ranks' lists are partial: keep only the local rank's
            from_ = {local[1]: from_[local[1]]} if local[0] == "train" else {}
            to = {local[1]: to[local[1]]} if local[0] == "gen" else {}
        return cls(
            train_global=train_global,
            gen_global=gen_global,
            transfers=tuple(transfers),
            buckets=tuple(buckets),
            unused_train_params=senders.unused_train_params,
            gen_specs={rank: tuple(specs) for rank, specs in gen_specs.items()},
            local=local,
            train_bytes=senders.train_bytes,
            num_transfers=senders.num_transfers,
            settings=(bucket_bytes, direct_bytes),
            bytes_minimal=sum(len(ranks) * sum(spec.numel * ITEMSIZE[spec.dtype] for spec in specs)
                              for ranks, specs in classes),  # once per class of identical gen ranks
            _from={rank: tuple(sorted(b, key=_send_order)) for rank, b in from_.items()},
            _to={rank: tuple(sorted(b, key=_receive_order)) for rank, b in to.items()},
        )

    def global_src(self, bucket: Bucket) -> int:
        return self.train_global[bucket.src_rank]

    def global_dst(self, bucket: Bucket) -> int:
        return self.gen_global[bucket.dst_rank]

    def _held(self, side: str, rank: int, lists: dict) -> tuple[Bucket, ...]:
        if rank not in lists:
            where = "" if self.local is None else f" (a local plan of {self.local[0]} rank {self.local[1]})"
            raise ValueError(f"this plan holds no buckets of {side} rank {rank}{where}")
        return lists[rank]

    def buckets_from(self, train_idx: int) -> tuple[Bucket, ...]:
        """The buckets this train rank sends, in the order it sends them: by (index, dst), so
        that it feeds all its receivers at once instead of one after the other."""
        return self._held("train", train_idx, self._from)

    def buckets_to(self, gen_idx: int) -> tuple[Bucket, ...]:
        """The buckets this gen rank receives, in the order it receives them: by (index, src).
        Both orders follow one global order, (index, dst, src), which keeps a bounded window
        deadlock-free (docs/design.md)."""
        return self._held("gen", gen_idx, self._to)

    def gen_pieces(self, gen_idx: int) -> list[ShardSpec]:
        return list(self.gen_specs[gen_idx])

    @property
    def bytes_sent(self) -> int:
        """Bytes the whole plan sends (every train rank)."""
        return sum(self.train_bytes)

    def bytes_from(self, train_idx: int) -> int:
        return sum(item.transfer.nbytes for bucket in self.buckets_from(train_idx) for item in bucket.items)

    def bytes_to(self, gen_idx: int) -> int:
        return sum(item.transfer.nbytes for bucket in self.buckets_to(gen_idx) for item in bucket.items)

    def fingerprints(self) -> dict:
        """``{"plan": sha256 of what every rank shares, (src, dst): sha256 of that pair's
        buckets}`` for the pairs this plan holds (a local plan: its own). Ranks that built the
        same plan agree on ``"plan"`` and, pair by pair, on what both ends of a pair hold."""
        shared = [f"train {self.train_global}", f"gen {self.gen_global}", f"unused {self.unused_train_params}",
                  f"bytes {self.train_bytes}", f"transfers {self.num_transfers}", f"settings {self.settings}"]
        out: dict = {"plan": hashlib.sha256("\n".join(shared).encode()).hexdigest()}
        pairs: dict[tuple[int, int], list[str]] = {}
        for bucket in self.buckets:
            lines = pairs.setdefault((bucket.src_rank, bucket.dst_rank), [])
            lines.append(f"bucket {bucket.index} {bucket.nbytes}")
            for item in bucket.items:
                t = item.transfer
                lines.append(f"  {item.offset} {t.name} {t.dtype} {t.nbytes} {t.global_box} {t.src_box} {t.dst_box}")
        for pair, lines in pairs.items():
            out[pair] = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        return out

    def fingerprint(self) -> str:
        """sha256 over :meth:`fingerprints`: equal for equal plans (a local plan: of its rank)."""
        items = sorted(self.fingerprints().items(), key=lambda kv: str(kv[0]))
        return hashlib.sha256(repr(items).encode()).hexdigest()

    def summary(self) -> dict:
        """Totals of the whole plan; the bucket figures are those this plan holds (``local``:
        None for the whole plan, else whose)."""
        return {
            "local": None if self.local is None else f"{self.local[0]} rank {self.local[1]}",
            "num_train_ranks": len(self.train_global),
            "num_gen_ranks": len(self.gen_global),
            "num_transfers": self.num_transfers,
            "num_buckets": len(self.buckets),
            "num_unused_train_params": len(self.unused_train_params),
            "bytes_sent": self.bytes_sent,
            "bytes_minimal": self.bytes_minimal,
            "max_bytes_from_one_train_rank": max(self.train_bytes, default=0),
            "min_bytes_from_one_train_rank": min(self.train_bytes, default=0),
            "max_bucket_bytes": max((b.nbytes for b in self.buckets), default=0),
        }
