"""The refit plan: which train rank sends which box of which parameter to which gen rank (pure).

Every process builds the same plan from the same ShardSpecs, so no collective is needed to
agree on it. All validation happens in :meth:`RefitPlan.build`, before any transfer.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_refit.errors import PlanError
from megatron_refit.plan.adjacency import adjacency, next_maps
from megatron_refit.plan.assignment import Assignment
from megatron_refit.plan.buckets import Bucket, Transfer, bucketize
from megatron_refit.plan.checks import ITEMSIZE, draft_hint, gc_paused, index_specs
from megatron_refit.plan.expert_moves import Basis, movable, replan
from megatron_refit.plan.folded import unfold, unfold_parts
from megatron_refit.plan.pieces import (Layout, Names, adjacent_names, gen_targets_of, index_parts, kind_indices, pack,
                                      unpack)
from megatron_refit.plan.spec import ShardSpec, box_shape

__all__ = ["ITEMSIZE", "PlanError", "RefitPlan", "gc_paused"]


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
    skipped_params: tuple[str, ...] = ()
    """Of those, the optional ones (e.g. MTP layers, which an engine holds only with an MTP draft):
    skipped by name; :func:`build_local_plan` refuses any other."""
    gen_parts: dict[int, tuple[Names, Layout]] = field(repr=False)
    """Every gen rank's pieces in the compact form (:func:`megatron_refit.plan.pieces.pack`)."""
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
    basis: Basis | None = field(default=None, repr=False, compare=False)
    """What a local plan was built from, for :meth:`replanned` after an engine's experts move."""

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
        they equal the whole plan's for that rank. Validation covers the whole plan either way.

        The gen pieces are planned in the compact form ``prepare()`` gathers
        (:func:`megatron_refit.plan.pieces.pack`); :meth:`from_pieces` takes that form directly."""
        train_next = next_maps(train_adjacent, train_specs, "train")
        next_maps(gen_adjacent, gen_specs, "gen")
        packed: dict[tuple[int, int], tuple] = {}  # ranks given one list (gathered replicas) are packed once
        gen = {}
        for rank, specs in gen_specs.items():
            pairs = (gen_adjacent or {}).get(rank) or ()
            key = (id(specs), id(pairs))
            if key not in packed:
                packed[key] = pack(specs, pairs)
            gen[rank] = packed[key]
        shapes: dict[int, dict[str, tuple[int, ...]]] = {}  # by list: DP replicas share one

        def train_shapes(rank: int) -> dict[str, tuple[int, ...]]:
            specs = train_specs[rank]
            if id(specs) not in shapes:
                shapes[id(specs)] = {spec.name: spec.shape for spec in specs}
            return shapes[id(specs)]

        with gc_paused():
            index = index_specs("train", train_specs)
        return cls._assemble(index, len(train_specs), train_shapes, train_next.get, gen, gen, {},
                             bucket_bytes=bucket_bytes,
                             direct_bytes=direct_bytes, train_rank_ids=train_rank_ids, gen_rank_ids=gen_rank_ids,
                             local=local)

    @classmethod
    def from_pieces(
        cls,
        train: dict[int, tuple[Names, Layout]],
        gen: dict[int, tuple[Names, Layout]],
        *,
        bucket_bytes: int = 64 << 20,
        direct_bytes: int | None = None,
        train_rank_ids: list[int] | None = None,
        gen_rank_ids: list[int] | None = None,
        local: tuple[str, int] | None = None,
    ) -> RefitPlan:
        """:meth:`build` from every rank's pieces in the compact form
        (:func:`megatron_refit.plan.pieces.pack`: adjacency included), as ``prepare()`` gathers
        them. Parts that are one object (the gather's equal objects) are read once, and no
        ShardSpec is built per train piece (:func:`~megatron_refit.plan.pieces.index_parts`)."""
        nexts: dict[int, dict[str, str]] = {}
        shapes: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}

        def train_next(rank: int) -> dict[str, str] | None:
            names = train[rank][0]
            if id(names) not in nexts:
                nexts[id(names)] = adjacent_names(names)
            return nexts[id(names)] or None

        def train_shapes(rank: int) -> dict[str, tuple[int, ...]]:
            names, layout = train[rank]
            key = (id(names), id(layout))
            if key not in shapes:  # a part the index validated
                kinds = [box_shape(kind[2]) for kind in layout[0]]
                shapes[key] = {name: kinds[k] for name, k in zip(names[0], kind_indices("train", rank, names, layout))}
            return shapes[key]

        folded = gen
        with gc_paused():
            spelled: dict = {}  # the engine ranks' expert names, spelled once: what a move re-plans by
            train, gen = unfold_parts("train", train), unfold_parts("gen", gen, spelled)
            index = index_parts("train", train)
        return cls._assemble(index, len(train), train_shapes, train_next, gen, folded, spelled,
                             bucket_bytes=bucket_bytes,
                             direct_bytes=direct_bytes, train_rank_ids=train_rank_ids, gen_rank_ids=gen_rank_ids,
                             local=local)

    @classmethod
    def _assemble(cls, train_index: tuple[dict, dict], num_train: int, train_shapes: Callable[[int], dict],
                  train_next: Callable[[int], dict | None],
                  gen: dict[int, tuple[Names, Layout]], folded: dict[int, tuple], spelled: dict, *, bucket_bytes: int,
                  direct_bytes: int | None,
                  train_rank_ids: list[int] | None, gen_rank_ids: list[int] | None,
                  local: tuple[str, int] | None) -> RefitPlan:
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise PlanError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if direct_bytes is not None and (not isinstance(direct_bytes, int) or direct_bytes < 1):
            raise PlanError(f"direct_bytes must be a positive int or None, got {direct_bytes!r}")
        num_gen = len(gen)
        train_global = tuple(range(num_train) if train_rank_ids is None else train_rank_ids)
        gen_global = tuple(range(num_train, num_train + num_gen) if gen_rank_ids is None else gen_rank_ids)
        for side, ids, count in (("train", train_global, num_train), ("gen", gen_global, num_gen)):
            if len(ids) != count or len(set(ids)) != count:
                raise PlanError(f"{side}_rank_ids {list(ids)} must be {count} distinct ranks")
        if local is not None and (local[0] not in ("train", "gen") or not isinstance(local[1], int)
                                  or not 0 <= local[1] < (num_train if local[0] == "train" else num_gen)):
            raise PlanError(f"local must be ('train', 0..{num_train - 1}) or ('gen', 0..{num_gen - 1}), got {local!r}")

        with gc_paused():
            targets = gen_targets_of(gen)
            assignment = Assignment.from_index(*train_index, num_train, targets)
            if local is None:
                transfers = assignment.transfers()
            else:
                transfers = assignment.transfers(**{"src" if local[0] == "train" else "dst": local[1]})
            basis = Basis(groups=assignment.groups, train_meta=train_index[1], targets=targets,
                          train_shapes=train_shapes, train_next=train_next)
            totals = (assignment.train_bytes, assignment.num_transfers, sum(assignment.gen_bytes().values()))
            nexts: dict[int, dict[str, str]] = {}

            def gen_next(rank: int) -> dict[str, str]:
                names = gen[rank][0]
                if id(names) not in nexts:
                    nexts[id(names)] = adjacent_names(names)
                return nexts[id(names)]

            return cls._finish(transfers, targets, totals, basis, gen_next, gen=folded,
                               unused=assignment.unused_train_params, num_train=num_train, train_global=train_global,
                               gen_global=gen_global, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes,
                               local=local, keep=local is not None and movable(basis, folded, local, spelled))

    @classmethod
    def _finish(cls, transfers: list[Transfer], targets, totals: tuple, basis: Basis,
                gen_next: Callable[[int], dict[str, str]], *, gen: dict,
                unused: tuple[str, ...], num_train: int, train_global: tuple[int, ...], gen_global: tuple[int, ...],
                bucket_bytes: int, direct_bytes: int | None, local: tuple[str, int] | None, keep: bool = True,
                skipped: tuple[str, ...] = ()) -> RefitPlan:
        """The plan of ``transfers`` (the local rank's, or all) and the whole plan's ``totals``
        (bytes each train rank sends, transfers, bytes the gen ranks hold): buckets cut; ``gen``:
        the gen ranks' parts as gathered, ``gen_next(rank)`` their adjacent pieces; ``keep``: keep
        ``basis`` on it (for :meth:`replanned`)."""
        buckets = bucketize(transfers, bucket_bytes, direct_bytes,
                            *adjacency(transfers, direct_bytes, basis.train_shapes, basis.train_next, targets,
                                       gen_next))
        from_: dict[int, list[Bucket]] = {rank: [] for rank in range(num_train)}
        to: dict[int, list[Bucket]] = {rank: [] for rank in range(len(gen))}
        for bucket in buckets:
            from_[bucket.src_rank].append(bucket)
            to[bucket.dst_rank].append(bucket)
        if local is not None:  # other ranks' lists are partial: keep only the local rank's
            from_ = {local[1]: from_[local[1]]} if local[0] == "train" else {}
            to = {local[1]: to[local[1]]} if local[0] == "gen" else {}
        train_bytes, num_transfers, bytes_minimal = totals
        return cls(
            train_global=train_global,
            gen_global=gen_global,
            transfers=tuple(transfers),
            buckets=tuple(buckets),
            unused_train_params=unused,
            skipped_params=skipped,
            gen_parts=dict(gen),
            local=local,
            train_bytes=tuple(train_bytes),
            num_transfers=num_transfers,
            settings=(bucket_bytes, direct_bytes),
            bytes_minimal=bytes_minimal,  # what the gen ranks hold
            _from={rank: tuple(sorted(b, key=_send_order)) for rank, b in from_.items()},
            _to={rank: tuple(sorted(b, key=_receive_order)) for rank, b in to.items()},
            basis=basis if keep else None,
        )

    def replanned(self, gen: dict[int, tuple[Names, Layout]]) -> RefitPlan | None:
        """This local plan for the gen ranks' new pieces where only which experts each holds
        changed (an EPLB move: :mod:`megatron_refit.plan.expert_moves`), equal to a full
        build; None where that is not the change (build in full)."""
        def finish(transfers, targets, totals, basis, gen_next):
            return self._finish(transfers, targets, totals, basis, gen_next, gen=gen, unused=self.unused_train_params,
                                num_train=len(self.train_global), train_global=self.train_global,
                                gen_global=self.gen_global, bucket_bytes=self.settings[0],
                                direct_bytes=self.settings[1], local=self.local, skipped=self.skipped_params)

        with gc_paused():
            return replan(self, gen, finish)

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
        """The pieces gen rank ``gen_idx`` holds (by name, then box)."""
        return unpack("gen", gen_idx, *unfold("gen", gen_idx, *self.gen_parts[gen_idx]))

    @property
    def bytes_sent(self) -> int:
        """Bytes the whole plan sends (every train rank)."""
        return sum(self.train_bytes)

    def bytes_from(self, train_idx: int) -> int:
        return sum(item.transfer.nbytes for bucket in self.buckets_from(train_idx) for item in bucket.items)

    def bytes_to(self, gen_idx: int) -> int:
        return sum(item.transfer.nbytes for bucket in self.buckets_to(gen_idx) for item in bucket.items)

    def fingerprints(self) -> dict:
        """``{"plan": sha256 of what every rank shares, (src, dst): sha256 of that route's
        buckets}`` for the routes this plan holds (a local plan: its own). Ranks that built the
        same plan agree on ``"plan"`` and, route by route, on what both ends of a route hold."""
        shared = [f"train {self.train_global}", f"gen {self.gen_global}", f"unused {self.unused_train_params}",
                  f"bytes {self.train_bytes}", f"transfers {self.num_transfers}", f"settings {self.settings}"]
        out: dict = {"plan": hashlib.sha256("\n".join(shared).encode()).hexdigest()}
        routes: dict[tuple[int, int], list[str]] = {}
        # a transfer's geometry as text once per global box object, checked by identity (the
        # plan's boxes are shared and alive): transfers of one group share their three boxes
        text: dict[int, tuple] = {}
        for bucket in self.buckets:
            lines = routes.setdefault((bucket.src_rank, bucket.dst_rank), [])
            lines.append(f"bucket {bucket.index} {bucket.nbytes}")
            for (name, _, _, src_box, dst_box, global_box, dtype, nbytes), offset in bucket.items:
                got = text.get(id(global_box))
                if got is None or got[0] is not src_box or got[1] is not dst_box or got[2] != (dtype, nbytes):
                    got = text[id(global_box)] = (src_box, dst_box, (dtype, nbytes), global_box,
                                                  f"{dtype} {nbytes} {global_box} {src_box} {dst_box}")
                lines.append(f"  {offset} {name} {got[4]}")
        for route, lines in routes.items():
            out[route] = hashlib.sha256("\n".join(lines).encode()).hexdigest()
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
            "num_skipped_params": len(self.skipped_params),
            "bytes_sent": self.bytes_sent,
            "bytes_minimal": self.bytes_minimal,
            "max_bytes_from_one_train_rank": max(self.train_bytes, default=0),
            "min_bytes_from_one_train_rank": min(self.train_bytes, default=0),
            "max_bucket_bytes": max((b.nbytes for b in self.buckets), default=0),
        }


def build_local_plan(pieces: list[tuple[Names, Layout]], num_train: int, *, bucket_bytes: int,
                     direct_bytes: int | None, local: tuple[str, int],
                     optional: frozenset[str] = frozenset()) -> RefitPlan:
    """What each rank's ``prepare()`` builds from every refit rank's gathered pieces (in refit
    rank order: the train ranks, then the gen ranks); the dry run times the same call. A
    parameter the trainer produces but no gen rank holds is refused (``ValueError``), unless it
    is ``optional`` (the train ranks' optional pieces: MTP layers): then it is skipped by name
    (:attr:`RefitPlan.skipped_params`)."""
    plan = RefitPlan.from_pieces(dict(enumerate(pieces[:num_train])), dict(enumerate(pieces[num_train:])),
                                 bucket_bytes=bucket_bytes, direct_bytes=direct_bytes,
                                 train_rank_ids=list(range(num_train)),
                                 gen_rank_ids=list(range(num_train, len(pieces))), local=local)
    return skip_optional(plan, optional)


def skip_optional(plan: RefitPlan, optional: frozenset[str]) -> RefitPlan:
    """``plan`` with its unused optional parameters as :attr:`RefitPlan.skipped_params`;
    ``ValueError`` naming any other parameter that no gen rank holds."""
    refused = sorted(set(plan.unused_train_params) - optional)
    if refused:
        skippable = len(plan.unused_train_params) - len(refused)
        raise ValueError(f"the trainer produces {len(refused)} HF parameters that no generation rank holds "
                         f"(the receiver does not know them), e.g. {refused[:5]}; {skippable} MTP parameters "
                         f"besides, which may be skipped{draft_hint(refused)}")
    return dataclasses.replace(plan, skipped_params=tuple(sorted(plan.unused_train_params)))
