"""The serving check's limits from each replica's own measured noise (pure: lists of floats).

The rounding bound (:func:`~megatron_refit.plan.probe.compare`'s ``tolerance + relative x
scale`` per token, :data:`~megatron_refit.plan.probe.BULK` for the probe's bulk) is what bf16
arithmetic can do on any model; what one deployment shows is usually far less. So a replica's
first check, whose bytes the refit proved (every bucket's digest; the HF engine also reads its
weights back), is judged against the rounding bound and its clean noise measured: its
:class:`Profile`, each token's ``|Δ log-prob|`` as a share of its own rounding bound. Every later
check of that replica is judged against :func:`limits` of it as well: each token within
:data:`TOKEN_MARGIN` times the worst clean share, and the :data:`QUANTILE` of the shares within
:data:`BULK_MARGIN` times the clean one; never tighter than :data:`MIN_SHARE` (a token) and
:data:`MIN_BULK` (the quantile) of the rounding bound, never looser than it.

Shares, not nats: each token's bound is re-measured by the trainer's reference at every check
(``|its logit| + |the largest logit|``), so as training makes the model more peaked the limits
grow with its logits. What the shares themselves drift by over a run is what the margins keep
(measured over 20 RL refits: docs/guide-serving.md, "Calibrated limits"). The profile is taken
again only where the probe changed (from a check that passed the limits in force, never
shrinking) and when the replica rejoins: never after a failure, so a fault is not calibrated in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_refit.plan.probe import BULK, BULK_MIN_TOKENS, Reference

TOKEN_MARGIN = 2.0
"""A token may differ by this many times the worst clean token's share of its rounding bound.
Measured (bf16, 64 experts top-8, 20 clean refits at lr 1e-6 after the calibration): the worst
share ranges 1.11x (flat) and 1.57x (peaked) over the run; two swapped experts reach 3.1x the
calibration's (flat)."""
QUANTILE = 0.8
"""The calibrated bulk's quantile: the steadiest one measured (its clean range over 20 refits
1.11x flat, 1.16x peaked; the 90 % quantile's 1.09x and 2.2x: on a peaked model it sits in the
tail)."""
BULK_MARGIN = 2.0
"""The :data:`QUANTILE` of the shares may reach this many times the clean one. Measured as
above: two swapped experts reach 2.6x the largest clean one (peaked)."""
MIN_SHARE = 0.1
"""No token's limit is tighter than this share of its rounding bound: in bf16 0.002 + 0.01 x the
logits' magnitude, 1.3 units in the last place of a bf16 logit (2^-7 of its magnitude)."""
MIN_BULK = 0.05
"""Nor the :data:`QUANTILE`'s: in bf16 0.001 + 0.005 x the magnitude, about one rounding of a bf16
logit (2^-8 of its magnitude, x1.28)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """One replica's clean noise on the probe: shares of each token's rounding bound."""

    worst: float
    """The largest share over the probe's tokens."""
    bulk: float | None
    """The :data:`QUANTILE` of the shares; None for a probe of fewer than
    :data:`~megatron_refit.plan.probe.BULK_MIN_TOKENS` tokens."""
    version: int
    """The version it was (last) measured at."""
    tokens: tuple[tuple[int, ...], ...]
    """The probe it was measured on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """What one check is judged against, as shares of each token's rounding bound."""

    token: float = 1.0
    """Each token's largest share."""
    bulk: float | None = None
    """The :data:`QUANTILE`'s largest share (None: not judged; the rounding bound's
    :data:`~megatron_refit.plan.probe.BULK` always is)."""
    profile: Profile | None = None
    """The profile they come from (None: the rounding bound itself, uncalibrated)."""


ROUNDING = Limits()
"""The rounding bound: a replica's calibration check, and every check with calibration off."""


def shares(served: list[list[float]], reference: Reference, *, tolerance: float, relative: float) -> list[float]:
    """Every scored token's ``|Δ log-prob|`` as a share of its rounding bound ``tolerance +
    relative x`` its :attr:`~megatron_refit.plan.probe.Reference.scale` (both sides finite and of
    one shape: after :func:`~megatron_refit.plan.probe.compare`'s checks)."""
    scale = reference.scale or [[0.0] * len(s) for s in reference.logprobs]
    return [abs(float(g) - float(w)) / (tolerance + relative * float(size))
            for got, want, sizes in zip(served, reference.logprobs, scale, strict=True)
            for g, w, size in zip(got, want, sizes, strict=True)]


def quantile(values: list[float]) -> float | None:
    """The :data:`QUANTILE` of ``values`` (nearest rank, as
    :func:`~megatron_refit.plan.probe.bulk`); None for fewer than
    :data:`~megatron_refit.plan.probe.BULK_MIN_TOKENS`."""
    if len(values) < BULK_MIN_TOKENS:
        return None
    return sorted(values)[math.ceil(QUANTILE * len(values)) - 1]


def measure(served, reference: Reference, tokens, *, tolerance: float, relative: float, version: int) -> Profile:
    """The profile of one clean check (``tokens``: the probe's sequences; after
    :func:`~megatron_refit.plan.probe.compare` passed it: every share finite)."""
    values = shares(served, reference, tolerance=tolerance, relative=relative)
    return Profile(worst=max(values), bulk=quantile(values), version=version, tokens=tuple(map(tuple, tokens)))


def limits(profile: Profile | None) -> Limits:
    """The limits ``profile`` sets (see the module docstring); :data:`ROUNDING` for None."""
    if profile is None:
        return ROUNDING
    token = min(1.0, max(MIN_SHARE, TOKEN_MARGIN * profile.worst))
    bulk = None if profile.bulk is None else min(BULK, max(MIN_BULK, BULK_MARGIN * profile.bulk))
    return Limits(token=token, bulk=bulk, profile=profile)


def remeasured(profile: Profile, new: Profile) -> Profile:
    """``profile`` after a re-measure that passed its limits: the larger of each statistic (a
    profile never shrinks: a quiet check must not make the next one fail); on a changed probe
    the new probe's."""
    same = new.tokens == profile.tokens
    bulk = new.bulk if not same or profile.bulk is None or new.bulk is None else max(profile.bulk, new.bulk)
    return Profile(worst=max(profile.worst, new.worst), bulk=bulk, version=new.version, tokens=new.tokens)


def due(profile: Profile | None, tokens) -> bool:
    """Whether a passed check measures the profile: the first (none yet), and one on a probe other
    than the profile's."""
    return profile is None or tuple(map(tuple, tokens)) != profile.tokens
