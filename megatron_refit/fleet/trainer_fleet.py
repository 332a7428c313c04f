"""A fleet of engine replicas, each with a fate of its own: the train side's one owner.

A train rank holds one refit group per engine replica (the train ranks and that replica's
``replica_size`` engine ranks, under a namespace of its incarnation in the train ranks' store) and the
train ranks' own control group (no engine rank in it). :class:`TrainerFleet` runs everything on
its :class:`~megatron_refit.fleet.runner.Runner`: each replica's join (:mod:`~megatron_refit.fleet.joins`)
and its part of every refit in that replica's lane (every replica at once), the refits of
``refit.overlap`` in the background lane, the heartbeat watch. On train rank 0 it is the one caller
of the engine's control (:class:`~megatron_refit.fleet.control.EngineControl`, given to its
constructor), whose calls run in lanes of the control's own. The train ranks
agree on each replica's outcome over the control group and apply the one failure policy
(:mod:`~megatron_refit.fleet.policy`): a replica whose engine failed but whose group is intact
stays a member (its next refit, a full one, brings it back); one whose group broke (it died, it
stalled) is dropped, and may rejoin. Membership (:mod:`~megatron_refit.fleet.membership`) changes
at the start of a refit, from train rank 0's reading of the announcements; docs/design.md has the
whole story, and every failure path with its bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from megatron_refit.config import RefitConfig
from megatron_refit.endpoint.report import RefitReport, merge_reports
from megatron_refit.errors import RefitTransportError
from megatron_refit.fleet.control import EngineControl
from megatron_refit.fleet.fanout import FanoutRouter
from megatron_refit.fleet.joins import Joins
from megatron_refit.fleet.member import TrainerMember
from megatron_refit.fleet.policy import check_landed, failed_replicas
from megatron_refit.fleet.replica import Probing, refit_replica
from megatron_refit.fleet.runner import Runner, abort_at_exit
from megatron_refit.fleet.serving import ServingCheck
from megatron_refit.fleet.watchdog import Watchdog
from megatron_refit.group.member import close_quietly
from megatron_refit.group.store import SWAP_KEYS
from megatron_refit.registry import engine_named

logger = logging.getLogger(__name__)


class TrainerFleet:
    """Train side of a refit to every engine replica (one per train rank): see the module
    docstring. ``connect(replica, incarnation)`` opens that replica's group (this rank's end);
    ``member(group)`` builds its prepared :class:`~megatron_refit.fleet.member.TrainerMember`.
    ``control``: the engine's control plane (:class:`~megatron_refit.fleet.control.EngineControl`),
    which train rank 0 drives (every other train rank passes it or None and leaves it alone); None:
    the engines need no calls from the trainer."""

    def __init__(self, cfg: RefitConfig, control_group, *, connect: Callable, member: Callable, offloader=None,
                 on_report: Callable[[dict], None] | None = None, background: Callable | None = None,
                 forward=None, control: EngineControl | None = None):
        self.cfg = cfg
        self.control_group = control_group
        """The train ranks' own group: versions and outcomes, never an engine rank."""
        self.offloader = offloader
        self.on_report = on_report
        self.runner = Runner()
        """Every thread of this fleet on this rank (named, joined on :meth:`close`)."""
        self.serving = ServingCheck(cfg, forward, rank=control_group.rank)  # forward: the trainer model's
        self.background = background(self.runner) if background is not None else None
        """``refit.overlap: on``: the :class:`~megatron_refit.fleet.overlap.BackgroundRefit`
        (``background(runner)`` builds it over this fleet's runner)."""
        self.members: dict[int, TrainerMember] = {}
        self._lock = threading.RLock()
        """Membership changes: the training thread's and a background refit's, in one order."""
        self._closing = threading.Event()
        if control is not None and not isinstance(control, EngineControl):
            raise TypeError(f"TrainerFleet: control must be an EngineControl, got {type(control).__name__}")
        self.control = control if control_group.rank == 0 else None
        """Train rank 0: the engine control whose calls run when a replica joins, around each
        replica's part of every refit and at close (the fleet is its one caller); None: the engines
        need none, or another train rank."""
        self._probing: dict[int, Probing] = {}
        """Overlap: per version, what its refit checks (decided, and the reference taken, at its start)."""
        self._joined: dict[int, dict] = {}
        """Overlap: per version, the joins' failures of the membership update done at its start."""
        self._next_members: dict | None = None
        """Overlap: the joins' failures of the membership update a background refit did at its end
        for the next one (which then takes no collective in the training thread)."""
        self._started = False
        self._start_failures: dict[int, str] = {}
        self.router = FanoutRouter(cfg.fanout, delta=cfg.delta, bucket_bytes=cfg.bucket_bytes,
                                   replica_size=cfg.replica_size)
        """``refit.fanout``: each refit's placements (which replica forwards to which)."""
        self.watchdog = Watchdog(cfg, leader=control_group.rank == 0)
        """Every replica group's abort on this rank, and the heartbeats that tell a stalled replica."""
        if self.watchdog.enabled:
            self.runner.submit("watchdog", self.watchdog.run, self._closing)
        self.joins = Joins(cfg, control_group, self.runner, self.watchdog, self._closing, connect=connect,
                           member=member)
        """The joins under way, and train rank 0's reading of the announcements."""
        self._closed = False
        self._keep_at_exit = abort_at_exit(self, "the training process is exiting without closing the refit "
                                                 "(Ctrl-C, an error)")
        for replica in range(cfg.gen_dp):  # the replicas the job starts with, each in its lane
            self.joins.start(replica)
        if self.control is not None:  # their engines' connect calls (they announce, then join)
            for replica in self.control.replicas:
                self._connect_engine(replica)

    # -- membership ----------------------------------------------------------------------------
    def _connect_engine(self, replica: int, client=None) -> Future | None:
        """Train rank 0: replica ``replica``'s connect call (``client``: a new one); a call that
        fails aborts its join on every train rank at once."""
        future = self.control.connect(replica, num_train=self.control_group.world_size, client=client)

        def connected(done: Future) -> None:
            exc = None if done.cancelled() else done.exception()
            if exc is not None:
                self.joins.abort(replica, f"the {self.control.engine}'s connect call failed: "
                                          f"{type(exc).__name__}: {exc}")

        if future is not None:
            future.add_done_callback(connected)
        return future

    def add(self, client, *, replica: int | None = None) -> int:
        """Train rank 0, between refits: a new engine replica (``client``: its control client)
        joins under index ``replica`` (default: one past every index so far; the index of a
        replica that died, to restart it). Its connect call starts in a control lane of its own;
        returns (the index) once its join is announced, so the train ranks take it in at their next
        refit (``EngineLoadError`` where it did not announce within ``refit.timeout_s``)."""
        if self.control is None:
            raise ValueError(f"TrainerFleet.add: only train rank 0 of a fleet built with an engine control takes in "
                             f"engines; this is train rank {self.control_group.rank}")
        if replica is not None and (not isinstance(replica, int) or isinstance(replica, bool) or replica < 0):
            raise ValueError(f"replica must be a non-negative int, got {replica!r}")
        with self._lock:
            if replica is None:
                replica = max([*self.control.replicas, *self.members, -1]) + 1
            before = self.joins.announced(replica)
            connecting = self._connect_engine(replica, client)
        try:
            self.joins.await_announcement(replica, before, connecting, self.control.engine)
        except BaseException:
            self.control.forget(replica)
            raise
        return replica

    def await_start(self) -> None:
        """Every train rank, once (the first refit, ``plan``, an engine's ``trainer_init``): the
        replicas the job starts with, joined or failed (each named in the first refit's report);
        ``RefitTransportError`` naming why if none joined."""
        if self._started:
            return
        self._started = True
        with self._lock:
            failures = self._resolve_joins()
        if not self.members:
            why = "; ".join(f"replica {r}: {w}" for r, w in sorted(failures.items())) or "none joined"
            self.close()
            raise RefitTransportError(f"refit: the engines did not start: {why}")
        self._start_failures = failures

    def _resolve_joins(self) -> dict[int, str]:
        """Every train rank (collective): the joins under way resolved; those that joined are
        members; the failed ones' reasons (a failed replica's client stays: it is told at close,
        and a restart under its index replaces it)."""
        joined, failures = self.joins.resolve()
        for replica, member in sorted(joined.items()):
            self.members[replica] = member
            logger.info("refit: engine replica %d joined", replica)
        return failures

    def _update_membership(self, failures: dict) -> None:
        """Every train rank, at the start of a refit: the same joins and leaves, from rank 0."""
        with self._lock:
            changes = self.joins.changes()
            for replica in changes.leaves:
                logger.info("refit: engine replica %d left", replica)
                self._drop(replica)
            for replica, incarnation in changes.joins:
                if replica in self.members:  # restarted under its index: its old group is gone
                    self._drop(replica)
                self.joins.start(replica, incarnation)
            failures.update(self._resolve_joins())

    def _drop(self, replica: int) -> None:
        """Replica ``replica`` left, or its group broke: its group, lanes and client go."""
        member = self.members.pop(replica)
        self.router.forget(replica)
        self.watchdog.unwatch(replica)
        self.serving.forget(replica)
        if self.control is not None:
            self.control.forget(replica)
        self.runner.retire(f"replica-{replica}")
        close_quietly(member, replica)

    # -- refits --------------------------------------------------------------------------------
    @property
    def plan(self):
        """The plan of a replica's group (every replica of the layout has the same)."""
        self.await_start()
        if not self.members:
            raise ValueError("the refit has no engine replica connected now (every one left or failed): no plan")
        return next(iter(self.members.values())).plan

    @property
    def group(self):
        """The one replica's group (a fleet of one replica: e.g. an example that exchanges
        rollouts with its engine rank over it)."""
        self.await_start()
        if len(self.members) != 1:
            raise ValueError(f"the refit has {len(self.members)} replica groups; ask a member for its group")
        return next(iter(self.members.values())).group

    def is_full(self, full: bool = False) -> bool:
        """Whether the next refit moves everything to some replica (else LoRA adapters only)."""
        return any(member.is_full(full) for member in self.members.values())

    def refit(self, version: int, *, full: bool = False) -> RefitReport:
        """Send this rank's pieces of refit ``version`` to every replica. Collective over the
        train ranks (each calls it with the same ``version`` and ``full``) and, per replica, over
        its group; on train rank 0 the attached engine control's calls run around each replica's
        part. Under ``refit.overlap`` it waits for the refit in flight, then runs this one from a
        new snapshot to its end."""
        self.await_start()
        if self.background is not None:
            self.start_refit(version, full=full, busy="wait")
            self.background.wait()
            return self.background.collect()[-1]
        return self._refit(version, full=full, background=False)

    def start_refit(self, version: int, *, full: bool = False, busy: str | None = None) -> bool:
        """``refit.overlap: on``: take this rank's snapshot now and send refit ``version`` from it
        in the background. Collective over the train ranks. Returns False where it was skipped
        behind the refit still in flight (``refit.overlap_busy: skip``). A refit that failed in
        the background raises here, or at :meth:`finished`."""
        if self.background is None:
            raise ValueError("start_refit needs refit.overlap: on (the snapshot it sends from); call refit()")
        self.await_start()

        def prepare() -> set[str]:  # no refit in flight on any train rank now: the control group is free
            failures, self._next_members = self._next_members, None
            if failures is None:  # no background refit read the announcements for this one
                failures = {}
                self._update_membership(failures)
            self._joined[version] = failures
            self._probing[version] = self._plan_serving()  # the reference: the weights of this step
            from megatron_refit.fleet.overlap import sent_pieces

            return sent_pieces(self.members.values(), full)

        return self.background.start(version, prepare, lambda: self._refit(version, full=full, background=True),
                                     busy=busy)

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
            probing.probe, probing.reference, probing.reference_s = self.serving.take_reference()
        return probing

    def _refit(self, version: int, *, full: bool, background: bool) -> RefitReport:
        start = time.perf_counter()
        failures: dict[int, str] = self._joined.pop(version, None)
        if failures is None:
            failures = {}
            self._update_membership(failures)
        if self._start_failures:  # the starting replicas that did not join: named in the first report
            failures, self._start_failures = {**self._start_failures, **failures}, {}
        probing = self._probing.pop(version, None)  # overlap: planned at the step boundary
        rows = self.control_group.exchange("fleet", [version, int(full)])
        if any(row[:2] != [version, int(full)] for row in rows):
            raise ValueError(f"train ranks disagree on the refit: (version, full) by rank {[row[:2] for row in rows]}")
        replicas = sorted(self.members)
        placements = self.router.placements(self.control_group, self.members, full)  # the router owns fanout
        moved = {"onload": 0.0, "offload": 0.0}  # offloaded parameters: loaded once for every replica
        loaded = self.offloader is not None and self.offloader.offloaded
        if loaded:
            t0 = time.perf_counter()
            self.offloader.onload()
            moved["onload"] = time.perf_counter() - t0
        try:
            probing = probing or self._plan_serving()  # the reference reads the weights: after their onload
            args = (version, full, self.control, probing, self.control_group.rank)
            futures = {r: self.runner.submit(f"replica-{r}", refit_replica, self.members[r], r, *args, placements[r])
                       for r in replicas}
            outcomes = {r: futures[r].result() for r in replicas}
        finally:
            if loaded:
                t0 = time.perf_counter()
                self.offloader.offload()
                moved["offload"] = time.perf_counter() - t0
        report = self._outcomes(version, replicas, outcomes, failures, probing, moved, start)
        if background:  # the next refit's joins and leaves, read here (every train rank)
            self._next_members = {}
            self._update_membership(self._next_members)
        check_landed(version, report, failures, replicas=replicas, on_failure=self.cfg.on_replica_failure)
        return report

    def _outcomes(self, version, replicas, outcomes, failures, probing, moved, start) -> RefitReport:
        """Every train rank's view of every replica's outcome, gathered; the replicas whose group
        broke dropped; the fleet's report (its serving metrics too)."""
        mine = {r: (o.why(self.cfg), o.broken) for r, o in outcomes.items() if o.error is not None}
        checked = {r: o.serving for r, o in outcomes.items() if o.serving is not None}  # train rank 0's
        unprepared = {r: o.unprepared for r, o in outcomes.items() if o.unprepared}  # train rank 0's too
        gathered = self.control_group.all_gather_object((mine, moved, checked, unprepared), "fleet")
        moved_max = {key: max(m[key] for _, m, _, _ in gathered) for key in moved}
        failed, broken = failed_replicas([view for view, _, _, _ in gathered], replicas)
        failures.update(failed)
        with self._lock:
            for replica in broken:
                logger.warning("refit %d: engine replica %d's group broke; it is dropped until it rejoins",
                               version, replica)
                self._drop(replica)
                self.joins.forget(replica)
        found = gathered[0][2]  # train rank 0's serving verdicts
        for replica, verdict in found.items():  # its engine thinks it landed the version: the trainer forgets it did
            if verdict.get("mismatch") and replica in self.members:
                self.members[replica].force_full(adapters=not probing.in_band)
        serving = self.serving.record(found, failures, probing.reference_s, replicas)
        # the replicas whose group carried the refit (a failed one that drained it too: its bytes moved)
        carried = [o.report for o in outcomes.values() if o.report is not None]
        report = merge_reports(version, self.control_group.rank, carried, replicas=replicas, failures=failures,
                               seconds=time.perf_counter() - start, moved=moved, moved_max=moved_max)
        report.summary.update(serving)
        report.summary[SWAP_KEYS[0]] = len(gathered[0][3])
        for replica, why in gathered[0][3].items() if self.control_group.rank == 0 else ():
            logger.warning("refit %d: engine replica %d loaded the version under the pause (swap: staged could "
                           "not prepare it beside the live model; refit/swap_unprepared): %s", version, replica, why)
        self.router.record(version, replicas, failures, report.summary)
        if self.on_report is not None:
            self.on_report(report.summary)
        return report

    def abort(self, reason: str, wait_s: float = 5.0) -> None:
        """End now, without the engines' cooperation (an exit without :meth:`close`: Ctrl-C, an
        error): every group of this rank is aborted (each wait on it fails at once, here and at
        its engine ranks mid-refit, who report it), then every thread is given ``wait_s`` to end.
        No thread of ours is left inside a transport wait when the interpreter finalizes (one
        that returns from it then would abort the process: "terminate called without an active
        exception")."""
        if self._closed:
            return
        self._closed = True
        self._keep_at_exit()
        self._closing.set()
        logger.warning("refit: aborting (%s)", reason)
        self.watchdog.abort_all(reason)
        for group in (self.control_group, self.background.skip_group if self.background is not None else None):
            if group is not None:
                group.abort(reason)
        deadline = time.monotonic() + wait_s
        self.runner.close(wait_s)
        if self.control is not None:  # no engine is told: its lanes get what is left of wait_s
            self.control.close(tell=False, wait_s=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Release every replica's group, the control group and every thread (after the refit in
        flight, under ``refit.overlap``, ended; its error is raised after the groups are released).
        Train rank 0 tells every engine first, through the control (at most its bound: 10 s for
        :class:`~megatron_refit.fleet.lanes.ReplicaLanes`)."""
        if self._closed:
            return
        self._closed = True
        self._keep_at_exit()
        self._closing.set()
        error = None
        if self.background is not None:
            try:
                self.background.close()
            except Exception as exc:  # noqa: BLE001 -- release the groups first
                error = exc
        if self.control is not None:
            self.control.close()
        with self._lock:
            for replica in sorted(self.members):
                self._drop(replica)
        self.runner.close()
        self.control_group.close()
        if error is not None:
            raise error
