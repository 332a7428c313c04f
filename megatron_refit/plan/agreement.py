"""Do the refit ranks hold the same plan, with the same settings? (pure). Each rank's :meth:`RefitPlan.fingerprints`
summed into two strings that every rank gathers (:func:`agreement`, :func:`in_agreement`), and,
only where they disagree, the ranks named from the full fingerprints (:func:`disagreeing`)."""

from __future__ import annotations

import hashlib
import struct
from collections import Counter

from megatron_refit.plan.refit_plan import RefitPlan

ROUTE_SUM_BITS = 256
SUMMARY_VALUES = 16
"""A rank's :func:`agreement`: 8 words of 32 bits of its plan fingerprint's sha256, then 8 of its route sum."""
_WORDS = struct.Struct(">8I")


def agreement(prints: dict) -> tuple[int, ...]:
    """What ``prepare()`` gathers from every rank of its :meth:`RefitPlan.fingerprints`:
    :data:`SUMMARY_VALUES` numbers however many routes the rank holds (they travel in the
    control header, no message to decode per rank). The sha256 of the plan fingerprint, and the
    route sum: a sha256 of each route's ends and digest added up (mod 2**256). Every route is
    held by one train rank and one gen rank, so the train ranks' sums add up to the gen ranks'
    exactly when both ends of every route hold it alike (:func:`in_agreement`)."""
    total = 0
    for route, digest in prints.items():
        if route != "plan":
            total += int.from_bytes(hashlib.sha256(f"{route[0]} {route[1]} {digest}".encode()).digest(), "big")
    plan = hashlib.sha256(str(prints["plan"]).encode()).digest()
    return _WORDS.unpack(plan) + _WORDS.unpack((total % (1 << ROUTE_SUM_BITS)).to_bytes(32, "big"))


def in_agreement(plan: RefitPlan, summaries: list) -> bool:
    """Whether every refit rank built this plan (each rank's :func:`agreement`, by refit rank;
    a row may carry more values after it, as the control header's rows do): one plan
    fingerprint, and the train ranks' route sums adding up to the gen ranks'. The same answer on
    every rank, in O(ranks); where it is False, :func:`disagreeing` over the full fingerprints
    names the ranks."""
    if len(summaries) != len(plan.train_global) + len(plan.gen_global):
        return False
    try:
        if len({tuple(summary[:8]) for summary in summaries}) != 1:
            return False
        sums = [int.from_bytes(_WORDS.pack(*summary[8:SUMMARY_VALUES]), "big") for summary in summaries]
    except (TypeError, struct.error):  # a malformed summary: found by name in the full check
        return False
    mod = 1 << ROUTE_SUM_BITS
    return (sum(sums[rank] for rank in plan.train_global) % mod) == (sum(sums[rank] for rank in plan.gen_global) % mod)


def disagreeing(plan: RefitPlan, prints: list[dict]) -> list[int]:
    """Refit ranks whose plan differs, the same answer on every rank (each sees every rank's
    :meth:`RefitPlan.fingerprints`): those whose ``"plan"`` fingerprint
    is not the most common one, and both ends of any route (train rank, gen rank) that they
    hold differently (one end alone cannot tell which of them is wrong)."""
    common = Counter(p.get("plan") for p in prints).most_common(1)[0][0]
    bad = {rank for rank, theirs in enumerate(prints) if theirs.get("plan") != common}
    routes = set()
    for rank, theirs in enumerate(prints):
        for route in theirs:
            if route == "plan":
                continue
            if not (isinstance(route, tuple) and len(route) == 2 and 0 <= route[0] < len(plan.train_global)
                    and 0 <= route[1] < len(plan.gen_global)):
                bad.add(rank)  # a route this plan does not have
                continue
            routes.add(route)
    for src, dst in routes:
        ends = (plan.train_global[src], plan.gen_global[dst])
        if prints[ends[0]].get((src, dst)) != prints[ends[1]].get((src, dst)):
            bad.update(ends)
    return sorted(bad)


def check_settings(gathered: list[tuple], num_train: int, num_gen: int) -> None:
    """Every refit rank's role in place and its settings alike: ``gathered`` is each rank's
    ``(role, layout, verify, bucket_bytes, direct_bytes, delta, optional, stall_s)`` as
    ``prepare()`` gathers it; ``ValueError`` naming the setting and every rank's value."""
    roles = [g[0] for g in gathered]
    expected = ["train"] * num_train + ["gen"] * num_gen
    if roles != expected:
        raise ValueError(f"refit ranks disagree on roles: got {roles}, expected {expected}")
    for what, index in (("verify", 2), ("bucket_bytes", 3), ("direct_bytes", 4), ("delta", 5)):
        values = [g[index] for g in gathered]
        if len(set(values)) != 1:
            raise ValueError(f"refit ranks disagree on {what}: {values} (by refit rank)")
    stalls = {g[0]: g[7] for g in gathered}  # the watchdog (train) judges the beats (gen) by its own
    if len({g[7] for g in gathered}) != 1:
        raise ValueError(
            f"the train ranks' refit.stall_s in force is {stalls['train']:g} s but the engine ranks' is "
            f"{stalls['gen']:g} s (0: off, or not under refit.timeout_s): the engine would beat at another "
            f"pace than the train ranks judge it by; set the same refit.stall_s and refit.timeout_s on both "
            f"sides (by refit rank: {[g[7] for g in gathered]})")
