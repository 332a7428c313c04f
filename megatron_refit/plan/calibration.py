"""The serving check's limits from each replica's own measured noise (pure: lists of floats).

The rounding bound (:func:`~megatron_refit.plan.probe.compare`: each token within ``tolerance +
relative x scale``, the 90 % quantile within :data:`~megatron_refit.plan.probe.BULK` of that) is
what bf16 arithmetic can do on any model; what one deployment shows is usually far less. So a
replica's first check, whose bytes the refit proved (every bucket's digest; the HF engine also
reads its weights back), is judged against the rounding bound alone and its clean noise measured:
its :class:`Profile`, from each token's ``|Δ log-prob|`` as a share of its own rounding bound.
Every later check of that replica must also keep (:func:`judge`):

- the probe's **tail**, the mean of its :data:`TAIL_SHARE` largest shares, within
  :data:`TAIL_MARGIN` times the clean one: a fault that moves a few tokens far (two swapped
  experts on a flat model);
- the probe's **bulk**, the :data:`QUANTILE` of the shares, within :data:`BULK_MARGIN` times the
  clean one: a fault that moves many tokens a little (two swapped experts on a peaked model);

never tighter than :data:`MIN_SHARE` and :data:`MIN_BULK` of the rounding bound, never looser than
it. No single token is held to its own calibration: one token's share moves 2.4x between two clean
refits of a hard-trained model (a near-tie of its router), a mean over several moves less.

Shares, not nats: each token's bound is re-measured by the trainer's reference at every check
(``|its logit| + |the largest logit|``), so as training makes the model more peaked the limits
grow with its logits. What the shares drift by over a run is what the margins keep (measured over
20 RL refits in four model states: docs/guide-serving.md, "Calibrated limits"). The profile is
taken again only where the probe changed (from a check that passed the limits in force, never
shrinking) and when the replica rejoins: never after a failure, so a fault is not calibrated in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_refit.errors import ServingMismatchError
from megatron_refit.plan.probe import BULK, BULK_MIN_TOKENS, Reference

TAIL_SHARE = 0.03
"""The tail is the largest 3 % of the probe's shares (at least 2 of them), averaged."""
TAIL_MARGIN = 2.2
"""The tail may reach this many times the clean one. Measured (bf16, 64 experts top-8, 20 clean
refits at lr 1e-6 after the calibration): the clean tail grows up to 1.13x (flat), 1.77x (peaked)
and 1.78x (trained hard); two swapped experts reach 2.55x (flat)."""
QUANTILE = 0.8
"""The calibrated bulk's quantile: the steadiest measured (its clean range over 20 refits 1.11x
flat, 1.16x peaked; the 90 % quantile's 2.2x on the peaked model, where it sits in the tail)."""
BULK_MARGIN = 2.0
"""The :data:`QUANTILE` may reach this many times the clean one. Measured as above: two swapped
experts reach 2.6x the largest clean one (peaked)."""
MIN_SHARE = 0.1
"""No tail limit is tighter than this share: in bf16 0.002 + 0.01 x the logits'
magnitude, 1.3 units in the last place of a bf16 logit (2^-7 of its magnitude)."""
MIN_BULK = 0.05
"""Nor the :data:`QUANTILE`'s: in bf16 0.001 + 0.005 x the magnitude, about one rounding of a bf16
logit (2^-8 of its magnitude, x1.28)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """One replica's clean noise on the probe, in shares of each token's rounding bound."""

    tail: float
    """The mean of the :func:`tail_size` largest shares."""
    bulk: float | None
    """The :data:`QUANTILE` of the shares; None for a probe of fewer than
    :data:`~megatron_refit.plan.probe.BULK_MIN_TOKENS` tokens."""
    version: int
    """The version it was (last) measured at."""
    tokens: tuple[tuple[int, ...], ...]
    """The probe it was measured on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """What a calibrated check holds the probe's tail and bulk to, in shares."""

    tail: float
    bulk: float | None
    """None: not judged (a short probe)."""
    profile: Profile


def shares(served: list[list[float]], reference: Reference, *, tolerance: float, relative: float) -> list[float]:
    """Every scored token's ``|Δ log-prob|`` as a share of its rounding bound ``tolerance +
    relative x`` its :attr:`~megatron_refit.plan.probe.Reference.scale` (both sides finite and of
    one shape: after :func:`~megatron_refit.plan.probe.compare` passed)."""
    scale = reference.scale or [[0.0] * len(s) for s in reference.logprobs]
    return [abs(float(g) - float(w)) / (tolerance + relative * float(size))
            for got, want, sizes in zip(served, reference.logprobs, scale, strict=True)
            for g, w, size in zip(got, want, sizes, strict=True)]


def tail_size(num_tokens: int) -> int:
    """How many of ``num_tokens`` shares the tail averages: :data:`TAIL_SHARE` of them, at least 2."""
    return min(num_tokens, max(2, math.ceil(TAIL_SHARE * num_tokens)))


def tail(values: list[float]) -> float:
    """The mean of the :func:`tail_size` largest of ``values`` (not empty)."""
    size = tail_size(len(values))
    return sum(sorted(values, reverse=True)[:size]) / size


def quantile(values: list[float]) -> float | None:
    """The :data:`QUANTILE` of ``values`` (nearest rank, as :func:`~megatron_refit.plan.probe.bulk`);
    None for fewer than :data:`~megatron_refit.plan.probe.BULK_MIN_TOKENS`."""
    if len(values) < BULK_MIN_TOKENS:
        return None
    return sorted(values)[math.ceil(QUANTILE * len(values)) - 1]


def measure(values: list[float], tokens, *, version: int) -> Profile:
    """The profile of one clean check's :func:`shares` (``tokens``: the probe's sequences)."""
    return Profile(tail=tail(values), bulk=quantile(values), version=version, tokens=tuple(map(tuple, tokens)))


def limits(profile: Profile) -> Limits:
    """The limits ``profile`` sets (see the module docstring)."""
    return Limits(tail=min(1.0, max(MIN_SHARE, TAIL_MARGIN * profile.tail)),
                  bulk=None if profile.bulk is None else min(BULK, max(MIN_BULK, BULK_MARGIN * profile.bulk)),
                  profile=profile)


def judge(values: list[float], bound: Limits, *, tolerance: float, relative: float, replica: int,
          version: int, worst: float) -> None:
    """:class:`~megatron_refit.errors.ServingMismatchError` where a check's :func:`shares` (one
    that passed the rounding bound; ``worst``: its largest |Δ log-prob|) break ``bound``."""
    p = bound.profile
    found = [("tail", f"its {tail_size(len(values))} largest |Δ| (the largest {TAIL_SHARE:.0%}) average",
              tail(values), bound.tail, TAIL_MARGIN, p.tail, "a few tokens moved far")]
    if bound.bulk is not None:
        found.append(("bulk", f"the {QUANTILE:.0%} quantile of its |Δ| is", quantile(values), bound.bulk,
                      BULK_MARGIN, p.bulk, "many tokens moved a little"))
    for what, stat, got, limit, margin, clean, how in found:
        if got > limit:
            raise ServingMismatchError(
                f"refit {version}: engine replica {replica} does not serve the trainer's model: the {what} of its "
                f"log-probs is off its calibrated noise: over the probe's {len(values)} tokens {stat} {got:.3g} of "
                f"their tolerance ({tolerance:g} + {relative:g} x their logits' magnitude), beyond {limit:.3g}: "
                f"{margin:g}x the {clean:.3g} this replica showed clean at version {p.version} (the largest "
                f"difference {worst:.4g}). Every token is within its tolerance: {how}, as a post-load fault does "
                f"that the uncalibrated check lets pass (two experts swapped), or the noise grew past the margin. It "
                f"has not landed version {version}; its next refit is a full one",
                replica=replica, version=version, max_dlogprob=worst, first=None)


def remeasured(profile: Profile, new: Profile) -> Profile:
    """``profile`` after a re-measure that passed its limits: the larger of each statistic (a quiet
    check must not make the next one fail), on the new check's probe."""
    bulk = new.bulk if profile.bulk is None or new.bulk is None else max(profile.bulk, new.bulk)
    return Profile(tail=max(profile.tail, new.tail), bulk=bulk, version=new.version, tokens=new.tokens)


def due(profile: Profile | None, tokens) -> bool:
    """Whether a passed check measures the profile: the first (none yet), and one on a probe other
    than the profile's."""
    return profile is None or tuple(map(tuple, tokens)) != profile.tokens
