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

- of a MoE model, each **expert's tokens**: the probe tokens the trainer routes to one (layer,
  expert), at least :data:`EXPERT_MIN_TOKENS` of them, may not have moved by a median of more than
  :data:`EXPERT_MARGIN` times the clean tail (and :data:`EXPERT_BULK` times the clean bulk), scaled
  down for an expert with more tokens (:func:`expert_scale`), since the replica's last passed check
  (:func:`expert_shift`): a fault confined to a few experts (two swapped experts on a flat model,
  which moves the probe's tail no further than clean drift does on a peaked one);

never tighter than :data:`MIN_SHARE`, :data:`MIN_BULK` and :data:`MIN_EXPERT` of the rounding bound,
never looser than it. No single token is held to its own calibration: one token's share moves 2.4x
between two clean refits of a hard-trained model (a near-tie of its router), a mean over several
moves less, and the median of an expert's tokens less still.

Shares, not nats: each token's bound is re-measured by the trainer's reference at every check
(``|its logit| + |the largest logit|``), so as training makes the model more peaked the limits
grow with its logits. What the shares drift by over a run is what the margins keep (measured over
20 RL refits in four model states: docs/guide-serving.md, "Calibrated limits"). The profile is
taken again only where the probe changed (from a check that passed the limits in force, never
shrinking) and when the replica rejoins: never after a failure, so a fault is not calibrated in.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

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
EXPERT_MARGIN = 0.15
"""An expert's tokens may move by a median of this many times the clean tail between two checks
(or :data:`EXPERT_BULK` times the clean bulk, the larger), scaled by :func:`expert_scale` of its
token count. Measured (bf16, 64 experts top-8, lr 1e-6; four model states on sixteen numeric
trajectories, Megatron TP1 and TP2 with sequence parallelism x EP2; checks 1, 5 and 10 refits
apart): clean moves reach 0.75 of the scaled limit (0.79 unscaled in ``bench_serving.py``'s
``moe`` section); two swapped experts 1.13-10x it on the nearly flat model, where the probe's
tail may not see them (docs/guide-serving.md, "Calibrated limits")."""
EXPERT_BULK = 1.0
"""...and this many times the clean :data:`QUANTILE`: the tokens of an expert that matched the
trainer almost exactly (shares ~1e-4: their roundings happened to agree) move to the deployment's
typical noise when an update changes its weights, all at once (a model at random init, Megatron
TP2 with sequence parallelism x EP2: a median move of 0.0092 where the 80 % quantile was 0.0117);
a fault moves them beyond it."""
EXPERT_MIN_TOKENS = 8
"""An expert is judged where at least this many probe tokens are routed to it: the median of
fewer follows single tokens (a near-tie of the router moves one token's share 2.4x)."""
MIN_EXPERT = 0.005
"""No expert limit is tighter than this share: 5x the clean shares of a float32 engine (~1e-3 of
its rounding bound), where a near-exact engine's tiny tail would set none."""
EXPERT_TIGHTEST = 0.5
"""An expert with ``n`` tokens is held to its limit x ``sqrt(EXPERT_MIN_TOKENS / n)``, at most this
much tighter (:func:`expert_scale`): the median of ``n`` clean moves spreads as ``1 / sqrt(n)``
where the moves are independent, and a fault moves every token of its experts; an update's shared
move of one expert's tokens does not shrink with ``n``, hence the floor (reached at 32 tokens).
Measured on the sixteen trajectories: clean moves reach 0.75 of the scaled limit (0.64 unscaled);
two swapped experts on the nearly flat model of ``make test``'s trajectory (1 thread) 1.2x it (0.94
unscaled: not caught)."""


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
    last: tuple[float, ...] = ()
    """The shares of the replica's last passed check, on :attr:`tokens`: what :func:`expert_shift`
    measures each expert's tokens from."""
    last_version: int = 0
    """The version of that check."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """What a calibrated check holds the probe's tail and bulk to, in shares."""

    tail: float
    bulk: float | None
    """None: not judged (a short probe)."""
    expert: float
    """The largest median move of one expert's tokens (:func:`expert_shift`)."""
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
    return Profile(tail=tail(values), bulk=quantile(values), version=version, tokens=tuple(map(tuple, tokens)),
                   last=tuple(values), last_version=version)


def passed(profile: Profile, values: list[float], *, version: int) -> Profile:
    """``profile`` after a check on its probe passed with these :func:`shares`: the baseline of
    the next :func:`expert_shift`."""
    return replace(profile, last=tuple(values), last_version=version)


def limits(profile: Profile) -> Limits:
    """The limits ``profile`` sets (see the module docstring)."""
    return Limits(tail=min(1.0, max(MIN_SHARE, TAIL_MARGIN * profile.tail)),
                  bulk=None if profile.bulk is None else min(BULK, max(MIN_BULK, BULK_MARGIN * profile.bulk)),
                  expert=min(1.0, max(MIN_EXPERT, EXPERT_MARGIN * profile.tail, EXPERT_BULK * (profile.bulk or 0.0))),
                  profile=profile)


def expert_scale(count: int) -> float:
    """The factor on the expert limit for an expert with ``count`` probe tokens (see :data:`EXPERT_TIGHTEST`)."""
    return max(EXPERT_TIGHTEST, math.sqrt(EXPERT_MIN_TOKENS / count))


def scaled_move(shift: tuple[float, tuple[int, int], int] | None) -> float | None:
    """An :func:`expert_shift`'s move in the expert limit's terms: its median over :func:`expert_scale`
    of its token count (None for none)."""
    return None if shift is None else shift[0] / expert_scale(shift[2])


def expert_shift(values: list[float], last: Sequence[float],
                 routes: Sequence[Sequence[tuple[int, int]]]) -> tuple[float, tuple[int, int], int] | None:
    """The (layer, expert) whose tokens moved most since ``last`` (the same probe's shares at an
    earlier check) for their count (the median of their share increases over :func:`expert_scale`
    of it): ``(that median, (layer, expert), how many tokens)`` over the experts that ``routes``
    (per token, the (layer, expert) pairs its position is routed to) gives at least
    :data:`EXPERT_MIN_TOKENS` tokens; None where none has as many."""
    if len(last) != len(values) or len(routes) != len(values):
        raise ValueError(f"expert_shift: {len(values)} shares, {len(last)} earlier ones and {len(routes)} routes "
                         "(one each per probe token)")
    tokens: dict[tuple[int, int], list[int]] = {}
    for i, pairs in enumerate(routes):
        for pair in pairs:
            tokens.setdefault(tuple(pair), []).append(i)
    found = [(statistics.median(values[i] - last[i] for i in index), pair, len(index))
             for pair, index in tokens.items() if len(index) >= EXPERT_MIN_TOKENS]
    return max(found, key=lambda f: (scaled_move(f), f[1]), default=None)


def judge(values: list[float], bound: Limits, *, tolerance: float, relative: float, replica: int,
          version: int, worst: float, routes: Sequence[Sequence[tuple[int, int]]] | None = None) -> float | None:
    """:class:`~megatron_refit.errors.ServingMismatchError` where a check's :func:`shares` (one
    that passed the rounding bound; ``worst``: its largest |Δ log-prob|) break ``bound``;
    ``routes`` (a MoE model's, on the profile's probe): each expert's tokens judged too. Returns
    the largest move of an expert's tokens it judged, over :func:`expert_scale` of their count (in
    the terms of ``bound.expert``; None: none judged)."""
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
    shift = None if routes is None or not p.last else expert_shift(values, p.last, routes)
    moved = scaled_move(shift)
    if moved is not None and moved > bound.expert:
        median, (layer, expert), count = shift
        raise ServingMismatchError(
            f"refit {version}: engine replica {replica} does not serve the trainer's model: one expert's tokens are "
            f"off its calibrated noise: the {count} probe tokens the trainer routes to expert {expert} of layer "
            f"{layer} moved by a median of {median:.3g} of their tolerance ({tolerance:g} + {relative:g} x their "
            f"logits' magnitude) since its check at version {p.last_version}, beyond "
            f"{bound.expert * expert_scale(count):.3g}: {expert_scale(count):.3g}x for its {count} tokens the larger "
            f"of {EXPERT_MARGIN:g}x the tail {p.tail:.3g} and {EXPERT_BULK:g}x the {QUANTILE:.0%} quantile "
            f"{p.bulk or 0.0:.3g} this replica showed clean at version {p.version}; the largest difference "
            f"{worst:.4g}). Every token is within its tolerance: the tokens of one expert moved "
            f"together, as a post-load fault confined to a few experts does (two experts swapped, one expert's "
            f"weights wrong). It has not landed version {version}; its next refit is a full one",
            replica=replica, version=version, max_dlogprob=worst, first=None)
    return moved


def remeasured(profile: Profile, new: Profile) -> Profile:
    """``profile`` after a re-measure that passed its limits: the larger of each statistic (a quiet
    check must not make the next one fail), on the new check's probe."""
    bulk = new.bulk if profile.bulk is None or new.bulk is None else max(profile.bulk, new.bulk)
    return Profile(tail=max(profile.tail, new.tail), bulk=bulk, version=new.version, tokens=new.tokens,
                   last=new.last, last_version=new.last_version)


def on_probe(profile: Profile, tokens) -> bool:
    """Whether ``profile`` was measured on the probe ``tokens`` (its shares line up with a check's)."""
    return tuple(map(tuple, tokens)) == profile.tokens


def due(profile: Profile | None, tokens) -> bool:
    """Whether a passed check measures the profile: the first (none yet), and one on a probe other
    than the profile's."""
    return profile is None or not on_probe(profile, tokens)
