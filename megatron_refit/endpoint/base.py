"""The part of a refit endpoint both sides share (see :mod:`megatron_refit.endpoint.sender`).

``prepare()`` gathers every rank's pieces, builds and validates the plan and checks that
all ranks built the same one; ``_agree_on_version`` is the per-refit handshake; ``run_buckets``
posts buckets in the plan's order and retires them in the same order, at most two packed
buckets (the two staging buffers) and ``MAX_DIRECT_IN_FLIGHT`` direct ones outstanding.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from megatron_refit.endpoint.delta import check_mode as check_delta_mode
from megatron_refit.endpoint.direct import direct_view, resolve_direct_bytes
from megatron_refit.endpoint.integrity import Digester, bucket_seed, check_mode
from megatron_refit.endpoint.report import RefitReport, report_values, summarize
from megatron_refit.errors import RefitAbortedError
from megatron_refit.plan.fanout import DIRECT, PLACEMENT_VALUES, Placement
from megatron_refit.plan.folded import fold
from megatron_refit.plan.pieces import pack
from megatron_refit.plan.agreement import agreement, check_settings, disagreeing, in_agreement
from megatron_refit.plan.refit_plan import RefitPlan, build_local_plan
from megatron_refit.plan.spec import ShardSpec
from megatron_refit.transport import Transport

logger = logging.getLogger("megatron_refit")

MAX_DIRECT_IN_FLIGHT = 16


IDLE_TIMEOUTS = 3
"""An engine rank waits this many ``timeout_s`` for the train ranks to begin its group's next
refit (the time between refits is the trainer's; a replica that stalled in the last refit holds
the train ranks up to one ``timeout_s`` more)."""

ANY_VERSION = -2
"""What an engine rank shows in the handshake when it takes whatever version the train ranks send."""


DECODED = "decoded parts"
"""The key of the shared plan cache (:attr:`Endpoint.plans`) under which the last gather's
decoded parts are kept, by digest."""
LAST = "last plan"
"""Its key for the last plan agreed, with its key: what an engine whose experts moved re-plans from."""

class Endpoint:
    """What both sides share: the plan agreement, the version handshake, and the bucket
    loop with a bounded window. :class:`~megatron_refit.endpoint.sender.Refitter` and
    :class:`~megatron_refit.endpoint.receiver.Receiver` add what each side does per bucket."""

    role: str

    def __init__(self, group: Transport, *, num_train: int, num_gen: int, bucket_bytes: int, verify: str,
                 direct_bytes: int | str | None, on_report: Callable[[dict], None] | None = None,
                 delta: str = "off", replica_size: int | None = None, plans: dict | None = None,
                 stall_s: float = 0.0):
        if group.world_size != num_train + num_gen:
            raise ValueError(f"refit group has {group.world_size} ranks but num_train={num_train} + "
                             f"num_gen={num_gen} = {num_train + num_gen}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.group = group
        self.on_report = on_report
        """Called on every rank with each refit's group metrics, one flat dict of scalars
        (:func:`~megatron_refit.endpoint.report.summarize`; e.g. ``wandb.log`` on the rank that logs)."""
        self.num_train = num_train
        self.num_gen = num_gen
        replica_size = num_gen if replica_size is None else replica_size
        if not isinstance(replica_size, int) or replica_size < 1 or num_gen % replica_size:
            raise ValueError(f"replica_size (gen_tp) must be a positive int dividing num_gen={num_gen}, "
                             f"got {replica_size!r}")
        self.replica_size = replica_size
        """Engine ranks per replica (``gen_tp``): failures are reported per replica."""
        self.bucket_bytes = bucket_bytes
        self.delta = check_delta_mode(delta)
        """``refit.delta``: ``off``, ``on`` or ``auto`` (see :mod:`megatron_refit.endpoint.delta`)."""
        self.verify = check_mode(verify)
        """Integrity check of every bucket: ``"sampled"``, ``"full"`` or ``"off"`` (see
        :mod:`megatron_refit.endpoint.integrity`)."""
        self.direct_bytes = resolve_direct_bytes(direct_bytes, group, bucket_bytes)
        """Transfers of at least this many bytes skip packing
        (:func:`~megatron_refit.endpoint.direct.resolve_direct_bytes`)."""
        self.stall_s = float(stall_s)
        """``refit.stall_s`` in force on this rank (0: off): the train ranks' watchdog judges the
        engine ranks' beats by it, so every rank of the group must hold the same (``prepare``)."""
        self.plans = plans
        """Plans already built, shared by endpoints that meet the same pieces (a train rank's
        refit groups of every replica with one layout): ``prepare`` builds a plan once per
        distinct set of gathered pieces. ``None``: not shared. Under the key :data:`DECODED` it
        also holds the last gather's decoded parts by digest, so that a replica (re)joining with
        a layout planned before is neither decoded nor planned again; under :data:`LAST` the last
        plan agreed, which an engine whose experts moved re-plans from."""
        self.plan: RefitPlan | None = None
        self._plan_id = 0
        """The plan's shared fingerprint as an int: the per-refit handshake checks that every
        rank uses the same plan."""
        self.version: int | None = None
        self.probe_due = False
        """``refit.verify_serving``, in band: this refit's replica scores the probe over the group
        after it (agreed in the handshake: the train side shows it, the engine side learns it)."""
        self._digesters: dict[int, Digester] | None = None
        """Per peer: the digest constants of this rank's buckets with it under this plan (see
        :meth:`_pair_digesters`)."""
        self.placement: Placement = DIRECT
        """``refit.fanout``: where this refit's bytes come from and go (agreed in the handshake:
        train rank 0 shows it, every rank keeps it)."""
        self.shown_base = -1
        """The delta base this rank showed in the last handshake."""
        self.experts_moved = False
        """An engine rank: its engine's load balancer moved experts since the plan was built
        (shown in the handshake: every rank of the group then re-plans before any byte moves)."""
        self.replans = 0
        """How often a handshake re-planned the group because an engine rank's experts moved."""

    def _local_specs(self) -> list[ShardSpec]:
        raise NotImplementedError

    def _local_adjacent(self) -> list[tuple[str, str]]:
        """Pairs ``(a, b)`` of this rank's pieces where ``b`` starts in memory where ``a`` ends."""
        return []

    @property
    def plan_id(self) -> int:
        """The plan's shared fingerprint as an int: equal for equal plans (those of replicas of one
        layout, whether or not they share the plan object), 0 before :meth:`prepare`."""
        return self._plan_id

    def _local_optional(self) -> tuple[str, ...]:
        """This rank's optional pieces (MTP layers): skipped by name where no engine rank holds them."""
        return ()

    def prepare(self) -> RefitPlan:
        self._begin("prepare")
        adjacent = self._local_adjacent() if self.direct_bytes is not None else []
        names, layout = pack(self._local_specs(), adjacent)
        if self.role == "gen":  # its whole experts folded: an EPLB move is then a few numbers (plan/folded.py)
            names, layout = fold(names, layout)
        # names apart from boxes: an engine's TP ranks hold pieces of the same parameters, and
        # the gather moves each distinct object once (DP replicas' pieces, TP ranks' names)
        known = self.plans.get(DECODED) if self.plans is not None else None
        names_gathered, name_digests = self.group.all_gather_unique(names, "prepare", digests=True, known=known)
        mine = (self.role, layout, self.verify, self.bucket_bytes, self.direct_bytes, self.delta,
                self._local_optional(), self.stall_s)
        gathered, digests = self.group.all_gather_unique(mine, "prepare", digests=True, known=known)
        if self.plans is not None:  # only the last gather's: what a rejoining replica meets again
            self.plans[DECODED] = {**dict(zip(name_digests, names_gathered)), **dict(zip(digests, gathered))}
        check_settings(gathered, self.num_train, self.num_gen)
        key = (tuple(name_digests), tuple(digests), self._local_rank())
        plan, prints = self.plans.get(key, (None, None)) if self.plans is not None else (None, None)
        if plan is None:
            pieces = [(n, g[1]) for n, g in zip(names_gathered, gathered)]
            plan = self._experts_moved(key, pieces)
            if plan is not None:  # kept as the last only: each EPLB move is another key
                prints = plan.fingerprints()
            else:
                plan, prints = self._build(pieces, frozenset(name for g in gathered for name in g[6]))
                if self.plans is not None:
                    self.plans[key] = plan, prints
        # 16 numbers a rank, in the control header; only where they disagree, every rank's route
        # fingerprints, to name the ranks (every rank sees the same summaries: the same branch)
        if not in_agreement(plan, self.group.exchange("prepare", agreement(prints))):
            bad = disagreeing(plan, self.group.all_gather_object(prints, "prepare"))
            raise ValueError(f"refit plan fingerprint mismatch on refit ranks {bad}: ranks built different plans")
        self.plan = plan
        if self.plans is not None:
            self.plans[LAST] = key, plan
        self._plan_id = int(prints["plan"][:15], 16)
        self._digesters = None
        return plan

    def _experts_moved(self, key: tuple, pieces: list[tuple]) -> RefitPlan | None:
        """The last plan re-planned where the engine ranks' experts moved and nothing else changed
        (an EPLB rebalance: :meth:`RefitPlan.replanned`): the same train ranks' pieces and
        settings, this rank in the same place; None otherwise (a full build)."""
        last = self.plans.get(LAST) if self.plans is not None else None
        if last is None:
            return None
        (names, parts, local), last = last
        num_train = self.num_train
        if (local != key[2] or names[:num_train] != key[0][:num_train] or parts[:num_train] != key[1][:num_train]
                or last.settings != (self.bucket_bytes, self.direct_bytes)):
            return None
        return last.replanned(dict(enumerate(pieces[num_train:])))

    def _build(self, pieces: list[tuple], optional: frozenset[str] = frozenset()) -> tuple[RefitPlan, dict]:
        """The plan of what every rank of the group holds (``pieces``: each rank's
        :func:`~megatron_refit.plan.pieces.pack`; ``optional``: the train ranks' optional
        pieces), and its fingerprints."""
        plan = build_local_plan(pieces, self.num_train, bucket_bytes=self.bucket_bytes,
                                direct_bytes=self.direct_bytes, local=self._local_rank(), optional=optional)
        if plan.skipped_params and self._local_rank() == ("train", 0):
            logger.warning("refit: %d MTP parameters are held by no engine rank and are not sent "
                           "(refit/skipped_params), e.g. %s: an engine holds them only with an MTP draft",
                           len(plan.skipped_params), list(plan.skipped_params[:3]))
        return plan, plan.fingerprints()

    def _local_rank(self) -> tuple[str, int]:
        """This rank in the plan: each endpoint expands only its own transfers and buckets."""
        if self.role == "train":
            return ("train", self.group.rank)
        return ("gen", self.group.rank - self.num_train)

    def delta_base(self) -> int:
        """The version a delta refit would start from on this rank (-1: none): the trainer's
        copies of what it last sent, the engine's weights."""
        return -1

    def _agree_on_version(self, version: int | None, preflight: Callable[[], None] | None = None,
                          told: tuple[bool, Placement] = (False, DIRECT)) -> tuple[int, set[int]]:
        """The per-refit handshake, before any byte moves: every rank shows its version, the
        plan it uses, whether its own checks (``preflight``, e.g. a receiver re-resolving
        its engine's parameters) passed, and the version a delta would start from. A rank whose
        checks failed raises its own error; every other rank raises :class:`RefitAbortedError`
        naming it, so no rank is left waiting. Returns the version (an engine rank that passed
        None takes the train ranks': a replica that joined a running trainer) and the peers
        (refit ranks) this rank's pairs move a delta with: those that hold the same previous
        version as this rank (a receiver that missed one, restarted, failed the last refit or is
        stale gets a full refit, while the others keep their deltas; both ends of a pair decide
        alike)."""
        if self.plan is None:
            raise RuntimeError("call prepare() before the first refit")
        self._begin(f"refit {version if version is not None else 'next'}")
        if self.role == "gen":  # idle until the train ranks begin it: their time, not a refit's
            self.group.await_refit(IDLE_TIMEOUTS * self.group.timeout_s)
        elif self.group.rank == 0:
            self.group.open_refit()
        error: BaseException | None = None
        try:
            self._check_version(version)
            if preflight is not None:
                preflight()
        except Exception as exc:  # reported to every rank below, then re-raised here
            error = exc
        shown = (ANY_VERSION if version is None else version) if error is None else -1
        base = self.delta_base() if self.delta != "off" and error is None else -1
        probe = int(told[0]) if self.role == "train" else 0  # the train side's ``told``: this refit's
        placement = told[1].values() if self.role == "train" else [0] * PLACEMENT_VALUES
        moved = int(self.experts_moved and error is None)
        rows = self.group.exchange("refit", [shown, int(error is not None), self._plan_id, base, probe, *placement,
                                             moved])
        self.probe_due = bool(rows[0][4])
        self.placement = Placement.from_values(rows[0][5:5 + PLACEMENT_VALUES])  # train rank 0's (they agree)
        self.shown_base = base
        failed = [rank for rank, row in enumerate(rows) if row[1]]
        if failed:  # a second message, only then: every rank learns why (the first named, cut short)
            why = "" if error is None else f"{type(error).__name__}: {error}"[:300]
            first = self.group.all_gather_object(why, "refit")[failed[0]]
        if error is not None:
            raise error
        if version is None:
            version = rows[0][0]  # train rank 0's (the train ranks agree, checked below)
        if failed:
            raise RefitAbortedError(f"refit {version}: refit rank(s) {failed} failed their checks before any byte "
                                    f"moved (refit rank {failed[0]}: {first}); this rank sent and received nothing")
        versions = [row[0] for row in rows]
        if any(v != version for v in versions if v != ANY_VERSION):
            raise ValueError(f"refit ranks disagree on the version: {versions}")
        plans = sorted({row[2] for row in rows})
        if len(plans) != 1:
            by_plan = {p: [r for r, row in enumerate(rows) if row[2] == p] for p in plans}
            raise ValueError(f"refit {version}: refit ranks use different plans (ranks by plan: "
                             f"{list(by_plan.values())}); e.g. a trainer sending LoRA adapters only while "
                             f"the engine expects a full refit")
        replanned = any(row[5 + PLACEMENT_VALUES] for row in rows)
        if replanned:  # EPLB moved an engine rank's experts: re-planned, this refit in full on every pair
            self.prepare()
            self.replans += 1
            self._replanned()
            self._begin(f"refit {version}")
        mine = rows[self.group.rank][3]
        peers = range(self.num_train, len(rows)) if self.role == "train" else range(self.num_train)
        return version, {peer for peer in peers if mine >= 0 and rows[peer][3] == mine and not replanned}

    def _replanned(self) -> None:
        """The plan changed in this refit's handshake: what was kept per bucket of the old one is
        dropped (a sender's delta copies)."""

    def _begin(self, phase: str) -> None:
        self.group.begin(phase)

    def _check_version(self, version: int | None) -> None:
        if version is None and self.role == "gen":  # the train ranks' version, whatever it is
            return
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if self.version is not None and version <= self.version:
            raise ValueError(f"refit version {version} does not advance past {self.version}")

    def _pair_digesters(self, buckets, peer_of: Callable) -> dict[int, Digester]:
        """Per peer (``peer_of(bucket)``): the digest constants of this rank's ``buckets``
        with it, in plan order, built once per plan (see :mod:`megatron_refit.endpoint.integrity`)."""
        if self._digesters is None:
            by_peer: dict[int, list] = {}
            for bucket in buckets:
                by_peer.setdefault(peer_of(bucket), []).append(bucket)
            self._digesters = {
                peer: Digester([bucket_seed(self.plan.global_src(b), self.plan.global_dst(b), b.index, b.nbytes,
                                            self._plan_id) for b in mine], [b.nbytes for b in mine], self.verify)
                for peer, mine in by_peer.items()}
        return self._digesters

    def _summarize(self, report: RefitReport, error: BaseException | None = None) -> list[int]:
        """The end of every refit, on every rank: one control message with each rank's
        bytes, seconds and whether it applied the refit (``error``: why not); fills
        ``report.summary`` (the same flat dict on every rank) and, when a rank failed,
        ``report.failed_replicas`` with every failed rank's error (a second message, only
        then). Returns the refit ranks that failed."""
        rows = self.group.exchange("report", report_values(report, error is not None))
        report.summary = summarize(report.version, rows, self.num_train, report.bytes_minimal, self.replica_size,
                                   skipped_params=len(self.plan.skipped_params))
        failed = [rank for rank, row in enumerate(rows) if row[0]]
        if failed:
            why = "" if error is None else f"{type(error).__name__}: {error}"[:500]
            reasons = self.group.all_gather_object(why, "report")
            report.failed_ranks = {rank: reasons[rank] for rank in failed}
            for rank in failed:
                replica = (rank - self.num_train) // self.replica_size if rank >= self.num_train else None
                report.failed_replicas.setdefault(replica, []).append(f"refit rank {rank}: {reasons[rank]}")
            report.failed_replicas = {r: "; ".join(v) for r, v in sorted(report.failed_replicas.items(),
                                                                         key=lambda kv: (kv[0] is None, kv[0]))}
        return failed

    def _emit(self, report: RefitReport) -> None:
        """One structured log line per refit and rank (its detail), the group summary on
        refit rank 0, and the optional callback with the summary."""
        logger.info("refit %s", json.dumps(report.as_dict(), sort_keys=True))
        if self.group.rank == 0 and report.summary:
            logger.info("refit summary %s", json.dumps(report.summary, sort_keys=True))
        if self.on_report is not None:
            self.on_report(report.summary)

    def count_path(self, report: RefitReport, direct: bool) -> None:
        """One bucket's path in ``report``: ``direct``, else ``shared`` or ``packed`` as the group stages."""
        path = "direct" if direct else ("shared" if self.group.shares_buffers else "packed")
        report.paths[path] += 1

    def run_buckets(self, buckets, post: Callable, retire: Callable, report: RefitReport, group=None,
             direct_window: int = MAX_DIRECT_IN_FLIGHT) -> None:
        """Post buckets in order and retire them in the same order (FIFO). At most two
        packed buckets are in flight (they occupy the two staging buffers); direct buckets
        use no staging memory and may have up to ``direct_window`` outstanding (a relay keeps it
        at two: it forwards a bucket when it retires it, so it retires each as soon as it can).
        ``group``: where they travel (default the refit group; a relayed rank's upstream link)."""
        group = self.group if group is None else group
        width = max((b.nbytes for b in buckets), default=0)
        count = min(2, len(buckets))
        slots = group.staging(count, width) if group.shares_buffers else [
            torch.empty(width, dtype=torch.uint8, device=group.device) for _ in range(count)]
        free = list(range(len(slots)))
        in_flight: deque = deque()
        direct_in_flight = 0

        def retire_oldest():
            nonlocal direct_in_flight
            bucket, pending, slot = in_flight.popleft()
            self._retire((bucket, pending), retire, report, group)
            if slot is None:
                direct_in_flight -= 1
            else:
                free.append(slot)

        for bucket in buckets:
            while not free or direct_in_flight >= direct_window:
                retire_oldest()
            slot = free.pop(0)
            pending = post(bucket, slots[slot][:bucket.nbytes])
            if pending.direct:
                free.insert(0, slot)
                slot = None
                direct_in_flight += 1
            in_flight.append((bucket, pending, slot))
        while in_flight:
            retire_oldest()

    def _retire(self, item, retire, report, group) -> None:
        bucket, pending = item
        start = time.perf_counter()
        group.wait(pending)
        report.seconds["transfer"] += time.perf_counter() - start
        retire(bucket, pending)
        group.release(pending)  # colocated: hand the shared buffer back

    def _direct_view(self, bucket, get: Callable[[str], torch.Tensor], side: str) -> torch.Tensor | None:
        """:func:`~megatron_refit.endpoint.direct.direct_view` on this rank's group."""
        return direct_view(self.group, bucket, get, side)
