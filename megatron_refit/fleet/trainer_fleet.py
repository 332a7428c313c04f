"""A fleet of engine replicas, each with a fate of its own.

A train rank holds one refit group per engine replica (the train ranks and that replica's
``gen_tp`` engine ranks) and the train ranks' own control group (no engine rank in it). All of
them meet at ``refit.port``: the control group's rank 0 hosts the store, and each replica's
group lives there under a namespace of its own
(:func:`~megatron_refit.fleet.store.namespace`, one per incarnation of the replica, so a
restarted one never meets its predecessor's keys). :class:`TrainerFleet` refits every replica's
group at once (one thread each); the train ranks then agree on each replica's outcome over
the control group, which needs no engine rank alive. A replica whose engine failed but whose
group is intact (its storage raised, its bytes were corrupted: it drained the rest) stays a
member and its next refit brings it back; a replica whose group broke (its process died, its
link stalled past ``refit.timeout_s``) is dropped, and may rejoin.

Membership: an engine replica announces itself
(:func:`~megatron_refit.fleet.store.announce`: ``join`` before it connects, ``leave``
when it closes) in the control group's store, hosted by train rank 0. At the start of every
refit train rank 0 reads the announcements and all train ranks act on the same list: they drop
leaving replicas and connect joining ones (a replica that rejoins under the index of a member
replaces it), agree on the plan with them and send them the current version in full (deltas
afterwards). The other replicas' groups and plans are not touched. The plan of a replica layout
is built once per train rank and shared by every replica with that layout (one that joins
checks its pieces against it: it meets the cached plan when they match).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from megatron_refit.config import RefitConfig
from megatron_refit.fleet.store import JOINS, LEAVES, Announcements, wait_for_starting
from megatron_refit.fleet.replica import Probing, ReplicaHooks, refit_replica
from megatron_refit.endpoint.report import RefitReport, merge_reports
from megatron_refit.fleet.serving import ServingCheck
from megatron_refit.fleet.member import TrainerMember
from megatron_refit.registry import engine_named
from megatron_refit.errors import RefitTransportError, ReplicaFailedError

logger = logging.getLogger(__name__)


def member_config(cfg: RefitConfig) -> RefitConfig:
    """The ``refit:`` section of one replica's group: the same, with one replica."""
    return dataclasses.replace(cfg, gen_dp=1)



class TrainerFleet:
    """Train side of a refit to every engine replica (one per train rank): see the module
    docstring. ``connect(replica, incarnation)`` opens that replica's group (this rank's end);
    ``member(group)`` builds its prepared :class:`~megatron_refit.fleet.member.TrainerMember`."""

    def __init__(self, cfg: RefitConfig, control, *, connect: Callable, member: Callable, offloader=None,
                 on_report: Callable[[dict], None] | None = None, background=None, forward=None):
        self.cfg = cfg
        self.serving = ServingCheck(cfg, forward, rank=control.rank)
        """``refit.verify_serving`` (``forward``: the trainer model's, to compare with)."""
        self._probing: dict[int, Probing] = {}
        """Overlap: per version, what its refit checks (decided, and the reference taken, at its start)."""
        self.background = background
        """``refit.overlap: on``: the :class:`~megatron_refit.fleet.overlap.BackgroundRefit`
        that sends from its snapshot while training goes on (the members send from the snapshot)."""
        self._joined: dict[int, dict] = {}
        """Overlap: per version, the joins' failures of the membership update done at its start."""
        self._next_members: dict | None = None
        """Overlap: the joins' failures of the membership update a background refit did at its end
        for the next one (which then takes no collective in the training thread)."""
        self.control = control
        """The train ranks' own group: versions and outcomes, never an engine rank."""
        self._connect, self._member = connect, member
        self.offloader = offloader
        self.on_report = on_report
        self.members: dict[int, TrainerMember] = {}
        self._announcements = Announcements(control.store) if control.rank == 0 else None
        self._incarnation: dict[int, str] = {}
        """Train rank 0: each member's incarnation (a leave of another one is stale)."""
        starting = None
        if self._announcements is not None:  # the replicas a job starts with: every train rank waits for them
            starting = wait_for_starting(control.store, cfg)
        starting = control.all_gather_object(starting, "fleet")[0]
        if "error" in starting:
            control.close()
            raise RefitTransportError(f"refit: the engines did not start: {starting['error']}")
        for replica, incarnation in sorted(starting.items()):
            self.members[replica] = self._join(replica, incarnation)
        self._pending: list[tuple[int, str]] = []
        """Train rank 0: joins announced while the starting replicas connected (not theirs)."""
        if self._announcements is not None:
            self._incarnation.update(starting)
            self._pending = [(r, who) for r, who in self._announcements.read(JOINS) if starting.get(r) != who]

    # -- membership ----------------------------------------------------------------------------
    def _join(self, replica: int, incarnation: str) -> TrainerMember:
        return self._member(self._connect(replica, incarnation))

    def _drop(self, replica: int) -> None:
        member = self.members.pop(replica)
        self.serving.forget(replica)
        try:
            member.close()
        except Exception:  # noqa: BLE001 -- a broken group: its peer is gone, there is nothing to release
            logger.warning("refit: closing replica %d's group failed", replica, exc_info=True)

    def _update_membership(self, report_failures: dict) -> None:
        """Every train rank, at the start of a refit: the same joins and leaves, from rank 0."""
        news = None
        if self._announcements is not None:  # rank 0 decides; the others follow
            joins = dict(self._pending + self._announcements.read(JOINS))  # the latest incarnation of each
            self._pending = []
            leaves = sorted({r for r, who in self._announcements.read(LEAVES)
                             if r in self.members and self._incarnation.get(r) == who and r not in joins})
            self._incarnation.update(joins)
            for replica in leaves:
                self._incarnation.pop(replica, None)
            news = (sorted(joins.items()), leaves)
        joins, leaves = self.control.all_gather_object(news, "fleet")[0]
        for replica in leaves:
            logger.info("refit: engine replica %d left", replica)
            self._drop(replica)
        for replica, incarnation in joins:
            if replica in self.members:  # restarted under its index: its old group is gone
                self._drop(replica)
            try:
                self.members[replica] = self._join(replica, incarnation)
                logger.info("refit: engine replica %d joined", replica)
            except Exception as exc:  # noqa: BLE001 -- the joining replica's failure is its own
                report_failures[replica] = f"joining failed: {type(exc).__name__}: {exc}"[:500]

    def announced(self, replica: int) -> str | None:
        """Train rank 0: the latest incarnation replica ``replica`` announced joining with
        (``None``: none yet); a caller waits for it to change after starting a new engine."""
        if self._announcements is None:
            raise ValueError("TrainerFleet.announced: only train rank 0 reads the announcements")
        key = f"{JOINS}/{replica}"
        return self.control.store.get(key).decode() if self.control.store.check([key]) else None

    # -- refits --------------------------------------------------------------------------------
    @property
    def plan(self):
        """The plan of a replica's group (every replica of the layout has the same)."""
        if not self.members:
            raise ValueError("the refit has no engine replica connected now (every one left or failed): no plan")
        return next(iter(self.members.values())).plan

    @property
    def group(self):
        """The one replica's group (a fleet of one replica: e.g. an example that exchanges
        rollouts with its engine rank over it)."""
        if len(self.members) != 1:
            raise ValueError(f"the refit has {len(self.members)} replica groups; ask a member for its group")
        return next(iter(self.members.values())).group

    def is_full(self, full: bool = False) -> bool:
        """Whether the next refit moves everything to some replica (else LoRA adapters only)."""
        return any(member.is_full(full) for member in self.members.values())

    def refit(self, version: int, *, full: bool = False, hooks: ReplicaHooks | None = None) -> RefitReport:
        """Send this rank's pieces of refit ``version`` to every replica. Collective over the
        train ranks (each calls it with the same ``version`` and ``full``) and, per replica,
        over its group. ``hooks`` (train rank 0, an engine with a control plane): each
        replica's engine calls around its part (:class:`ReplicaHooks`). Under ``refit.overlap``
        it waits for the refit in flight, then runs this one from a new snapshot to its end."""
        if self.background is not None and not self.background.on_own_thread():
            self.start_refit(version, full=full, run=lambda: self._refit(version, full=full, hooks=hooks), busy="wait")
            self.background.wait()
            return self.background.collect()[-1]
        return self._refit(version, full=full, hooks=hooks)

    def start_refit(self, version: int, *, full: bool = False, run: Callable[[], object] | None = None,
                    busy: str | None = None) -> bool:
        """``refit.overlap: on``: take this rank's snapshot now and send refit ``version`` from it
        in the background (``run()``: the refit call, by default ``self.refit(version, full=full)``;
        an engine's control wraps it). Collective over the train ranks. Returns False where it
        was skipped behind the refit still in flight (``refit.overlap_busy: skip``). A refit that
        failed in the background raises here, or at :meth:`finished`."""
        if self.background is None:
            raise ValueError("start_refit needs refit.overlap: on (the snapshot it sends from); call refit()")

        def prepare() -> set[str]:  # no refit in flight on any train rank now: the control group is free
            failures, self._next_members = self._next_members, None
            if failures is None:  # no background refit read the announcements for this one
                failures = {}
                self._update_membership(failures)
            self._joined[version] = failures
            self._probing[version] = self._plan_serving()  # the reference: the weights of this step
            from megatron_refit.fleet.overlap import sent_pieces

            return sent_pieces(self.members.values(), full)

        run = run or (lambda: self._refit(version, full=full, hooks=None))
        return self.background.start(version, prepare, run, busy=busy)

    def finished(self) -> list[RefitReport]:
        """``refit.overlap: on``: the reports of the refits that finished in the background since
        the last call; raises the error of one that failed (its version named). Never waits."""
        return self.background.collect() if self.background is not None else []

    def _plan_serving(self) -> Probing:
        """Every train rank, in the thread that trains, before a refit's bytes move: which replicas
        it checks, and the trainer's reference if any (collective over the train ranks)."""
        probing = Probing(self.serving, due=self.serving.due(sorted(self.members)),
                          in_band=engine_named(self.cfg.engine).scores == "in_band")
        if any(probing.due.values()):
            probing.reference, probing.reference_s = self.serving.take_reference()
        return probing

    def _refit(self, version: int, *, full: bool, hooks: ReplicaHooks | None) -> RefitReport:
        start = time.perf_counter()
        failures: dict[int, str] = self._joined.pop(version, None)
        if failures is None:
            failures = {}
            self._update_membership(failures)
        probing = self._probing.pop(version, None)  # overlap: planned at the step boundary
        rows = self.control.exchange("fleet", [version, int(full)])
        if any(row[:2] != [version, int(full)] for row in rows):
            raise ValueError(f"train ranks disagree on the refit: (version, full) by rank {[row[:2] for row in rows]}")
        replicas = sorted(self.members)
        moved = {"onload": 0.0, "offload": 0.0}  # offloaded parameters: loaded once for every replica
        loaded = self.offloader is not None and self.offloader.offloaded
        if loaded:
            t0 = time.perf_counter()
            self.offloader.onload()
            moved["onload"] = time.perf_counter() - t0
        try:
            probing = probing or self._plan_serving()  # the reference reads the weights: after their onload
            with ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
                futures = {r: pool.submit(refit_replica, self.members[r], r, version, full, hooks, probing,
                                          self.control.rank) for r in replicas}
                outcomes = {r: futures[r].result() for r in replicas}
        finally:
            if loaded:
                t0 = time.perf_counter()
                self.offloader.offload()
                moved["offload"] = time.perf_counter() - t0
        # each replica's outcome as every train rank saw it: failed (why) and its group broken
        mine = {r: (o.why(), o.broken) for r, o in outcomes.items() if o.error is not None}
        checked = {r: o.serving for r, o in outcomes.items() if o.serving is not None}  # train rank 0's
        gathered = self.control.all_gather_object((mine, moved, checked), "fleet")
        seen = [rank_seen for rank_seen, _, _ in gathered]
        moved_max = {key: max(m[key] for _, m, _ in gathered) for key in moved}
        for r in replicas:
            theirs = [rank_seen[r] for rank_seen in seen if r in rank_seen]
            if theirs:
                failures[r] = theirs[0][0]
                if any(broken for _, broken in theirs):
                    logger.warning("refit %d: engine replica %d's group broke; it is dropped until it rejoins",
                                   version, r)
                    self._drop(r)
                    self._incarnation.pop(r, None)
        found = gathered[0][2]  # train rank 0's serving verdicts
        for r, verdict in found.items():  # its engine thinks it landed the version: the trainer forgets it did
            if verdict.get("mismatch") and r in self.members:
                self.members[r].force_full(adapters=not probing.in_band)
        serving = self.serving.record(found, failures, probing.reference_s)
        # the replicas whose group carried the refit (a failed one that drained it too: its bytes moved)
        carried = [o.report for o in outcomes.values() if o.report is not None]
        report = merge_reports(version, self.control.rank, carried,
                        replicas=replicas, failures=failures, seconds=time.perf_counter() - start, moved=moved,
                        moved_max=moved_max)
        report.summary.update(serving)
        if self.on_report is not None:
            self.on_report(report.summary)
        if self.background is not None and self.background.on_own_thread():
            self._next_members = {}  # the next refit's joins and leaves, read here (every train rank)
            self._update_membership(self._next_members)
        landed = report.summary["refit/replicas_ok"]
        if not replicas and not failures:
            raise ReplicaFailedError(f"refit {version}: no engine replica is connected (every one failed or left, "
                                     f"and none joined since): no replica holds it", report=report)
        if failures and (self.cfg.on_replica_failure == "raise" or not landed):
            held = f"the other {landed} replica(s) hold version {version}" if landed else "no replica holds it"
            raise ReplicaFailedError(f"refit {version}: engine replica(s) {sorted(failures)} could not apply it: "
                                     f"{'; '.join(f'replica {r}: {w}' for r, w in sorted(failures.items()))}; "
                                     f"{held}", report=report)
        return report

    def close(self) -> None:
        """Release every replica's group and the control group (after the refit in flight,
        under ``refit.overlap``, ended; its error is raised after the groups are released)."""
        error = None
        if self.background is not None:
            try:
                self.background.close()
            except Exception as exc:  # noqa: BLE001 -- release the groups first
                error = exc
        for replica in sorted(self.members):
            self._drop(replica)
        self.control.close()
        if error is not None:
            raise error
