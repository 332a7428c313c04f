"""The one failure policy of a fleet refit (``refit.on_replica_failure``), from every train rank's
view of every replica's outcome.

Each train rank shows, per replica, whether it failed and why, and whether its group broke;
every train rank gets every rank's view (one collective over the train ranks' own group) and
decides alike: a replica failed if any train rank saw it fail (the first rank's reason names
it); its group broke if any rank saw a transport error (it is dropped: it may rejoin); a refit
raises :class:`~megatron_refit.errors.ReplicaFailedError` where the policy says ``raise`` and a
replica failed, or where no replica holds the version.
"""

from __future__ import annotations

from megatron_refit.errors import ReplicaFailedError


def failed_replicas(seen: list[dict[int, tuple[str, bool]]], replicas) -> tuple[dict[int, str], list[int]]:
    """From every train rank's ``{replica: (why, broken)}`` of the replicas it saw fail: each
    failed replica's reason (the first rank's) and the replicas whose group broke."""
    failures, broken = {}, []
    for replica in sorted(replicas):
        theirs = [view[replica] for view in seen if replica in view]
        if theirs:
            failures[replica] = theirs[0][0]
            if any(b for _, b in theirs):
                broken.append(replica)
    return failures, broken


def check_landed(version: int, report, failures: dict[int, str], *, replicas, on_failure: str) -> None:
    """Raise :class:`~megatron_refit.errors.ReplicaFailedError` (with ``report``) where the policy
    says so: no replica was connected, or a replica failed under ``raise``, or none landed it."""
    landed = report.summary["refit/replicas_ok"]
    if not replicas and not failures:
        raise ReplicaFailedError(f"refit {version}: no engine replica is connected (every one failed or left, "
                                 f"and none joined since): no replica holds it", report=report)
    if failures and (on_failure == "raise" or not landed):
        held = f"the other {landed} replica(s) hold version {version}" if landed else "no replica holds it"
        raise ReplicaFailedError(f"refit {version}: engine replica(s) {sorted(failures)} could not apply it: "
                                 f"{'; '.join(f'replica {r}: {w}' for r, w in sorted(failures.items()))}; "
                                 f"{held}", report=report)
