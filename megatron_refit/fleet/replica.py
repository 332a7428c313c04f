"""One replica's part of a fleet refit, in that replica's own thread: its engine's calls around
its group's refit (train rank 0), then, where this refit checks it, its serving probe
(``refit.verify_serving``). Whatever happens is this replica's outcome alone
(:class:`ReplicaOutcome`); :class:`~megatron_refit.fleet.trainer_fleet.TrainerFleet` gathers every
replica's from every train rank and applies the one failure policy."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from megatron_refit.endpoint.report import RefitReport
from megatron_refit.fleet.control import EngineControl
from megatron_refit.fleet.serving import ServingCheck, ServingUnavailableError, served_or_raise, stale_of
from megatron_refit.group.store import unprepared
from megatron_refit.plan.fanout import DIRECT, Placement
from megatron_refit.errors import RefitTransportError, ReplicaFailedError, ServingMismatchError


logger = logging.getLogger(__name__)


@dataclass
class Probing:
    """What one refit checks (every train rank holds the same): the fleet's check, the replicas
    it checks, the trainer's reference (None where none is checked) and whether replicas answer
    in band (over their refit group) or through train rank 0's control client."""

    check: ServingCheck
    due: dict[int, bool] = field(default_factory=dict)
    reference: Any = None
    probe: Any = None
    """The probe ``reference`` scored (:meth:`~megatron_refit.fleet.serving.ServingCheck.take_reference`)."""
    reference_s: float = 0.0
    in_band: bool = False


@dataclass
class ReplicaOutcome:
    """One replica's outcome of a refit on this train rank."""

    report: RefitReport | None = None
    """Its group's report, where the group carried the refit (a replica that failed after its
    bytes moved, or that drained them, has one)."""
    error: BaseException | None = None
    serving: dict | None = None
    """Train rank 0, a checked replica: its verdict (``max_dlogprob``, ``seconds``; ``mismatch`` where
    it failed; or ``unable``)."""
    unprepared: str | None = None
    """Train rank 0, ``swap: staged``: why the version loaded under the pause (None: prepared)."""

    @property
    def broken(self) -> bool:
        """The replica's group cannot carry another refit (a peer died or stalled: a transport
        error). Any other failure (a rank's checks, its engine, its bytes, its serving) left
        the group intact."""
        return isinstance(self.error, RefitTransportError)

    def why(self, cfg) -> str:
        """What failed, its engine ranks named as ``cfg`` names them (:meth:`RefitConfig.rank_name`)."""
        report = self.report
        if isinstance(self.error, ReplicaFailedError) and report is not None and report.failed_ranks:
            first = report.summary["refit/train_ranks"]  # its engine ranks' own errors
            return "; ".join(f"{cfg.rank_name(rank - first)}: {why}"
                             for rank, why in sorted(report.failed_ranks.items()))
        return f"{type(self.error).__name__}: {self.error}"[:1000]


def refit_replica(member, replica: int, version: int, full: bool, control: EngineControl | None,
                  probing: Probing | None, rank: int, placement: Placement = DIRECT) -> ReplicaOutcome:
    """Replica ``replica``'s part of refit ``version`` on train rank ``rank`` (``member``: its
    :class:`~megatron_refit.fleet.member.TrainerMember`; ``placement``: where its bytes go, under
    ``refit.fanout``): its engine's calls around its group's refit, then its serving check where
    ``probing`` says so. Never raises: the outcome says."""
    out = ReplicaOutcome()
    probe = probing.probe if probing is not None and probing.due.get(replica) else None
    try:
        if control is not None:
            control.start(replica, version, member.is_full(full))
        verdict = None
        in_band = probe is not None and probing.in_band  # the engine ranks answer over the group, told in the handshake
        # the endpoint's refit is called here, not through the member: its sends are 5 frames below the lane
        out.report = member.endpoint(full).refit(version, probe=in_band, placement=placement)
        member.sent(version)
        if in_band and rank == 0 and out.report.summary["refit/ok"]:
            def judge(answer):  # the verdict is told to the engine ranks in band
                return probing.check.verdict(replica, version, lambda: served_or_raise(answer), probing.reference,
                                            probe, stale_of(answer))

            verdict, answer_s = member.verdict_in_band(probe, judge)
            if isinstance(verdict, ServingMismatchError):
                raise verdict  # told to its engine ranks already: they hold their weights
            if verdict is not None:
                verdict["seconds"] = answer_s  # the engine scored it inside its refit's group, then heard it
        if out.report.failed_ranks:  # an engine rank could not apply it (its group drained it: intact)
            why = "; ".join(out.report.failed_replicas.values())
            out.error = ReplicaFailedError(f"refit {version}: engine replica {replica} could not apply it: {why}",
                                           report=out.report)
            return out
        gate = probe is not None and rank == 0 and not probing.in_band  # scored before it takes traffic
        if control is not None:
            control.land(replica, version, gate=gate)  # its error fails this replica alone (its group is intact)
            if rank == 0 and control.staged:
                out.unprepared = _unprepared(member, replica, version)
        if probe is not None and rank == 0:
            if probing.in_band:
                out.serving = verdict
            else:
                def score():
                    if control is None:
                        raise ServingUnavailableError("train rank 0 holds no control client of this engine to ask it")
                    return control.score(replica, probe.sequences)
                out.serving = probing.check.verdict(replica, version, score, probing.reference, probe)
                if control is not None:
                    control.release(replica, passed=True)
    except ServingMismatchError as exc:
        out.error, out.serving = exc, dict(max_dlogprob=exc.max_dlogprob, seconds=0.0, mismatch=True)
        if control is not None:
            control.hold(replica)
            control.release(replica, passed=False)
    except Exception as exc:  # noqa: BLE001 -- one replica's failure is its outcome, not raised here
        out.error = exc
        if isinstance(exc, ReplicaFailedError) and exc.report is not None:
            out.report = exc.report
        if control is not None:  # a gated version that failed to land or to be judged takes no traffic
            control.release(replica, passed=False)
    return out


def _unprepared(member, replica: int, version: int) -> str | None:
    """Why the staged ``version`` loaded under the pause on ``replica`` (its engine ranks' notes),
    None where it was prepared; a store that fails here costs the count only (logged)."""
    try:
        return unprepared(member.group.store, version, member.full.num_gen)
    except Exception as exc:  # noqa: BLE001 -- the version landed; only its note is lost
        logger.warning("refit %d: engine replica %d's swap note could not be read: %s", version, replica, exc)
        return None
