"""The serving check of an engine's speculative draft (``refit.gen_draft``, #67).

An engine that decodes with the model's MTP layer as its draft serves two things from one refit:
the model's log-probs, and the draft's proposals. A draft that serves something else than the
trainer's MTP layer (left a version behind, changed by its post-load step, its layer swapped)
does not change a single token the engine returns (speculative decoding verifies every proposal
with the model), but slows decoding, unseen. So where an engine scores its draft too (the HF
engine, in band: :meth:`~megatron_refit.engines.hf.storage.HFStorage.score`), the verdict also
holds the draft's log-probs of the probe, ``log p(token t + 2 | tokens <= t + 1)`` from the first
MTP layer, to the trainer's own MTP layer's (``conversion.serving.MegatronForward`` with
``score_draft``), token by token within the rounding bound the model's log-probs are judged by
(:func:`~megatron_refit.plan.probe.compare`, with the draft's own logits' magnitudes). A draft
outside it fails the replica by name. The calibrated limits of
:mod:`~megatron_refit.plan.calibration` are the model's alone: the draft is judged against the
rounding bound at every check.

Engines scored through their serving API (vLLM, SGLang) return the model's log-probs only: their
draft is proven by its bytes (``refit.verify``'s digests) and counted unchecked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron_refit.errors import ServingMismatchError
from megatron_refit.plan import calibration
from megatron_refit.plan.probe import Probe, Reference, compare

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftScores:
    """A replica's answer to the probe with its draft's: the model's log-probs (as any replica
    answers) and the draft's, per sequence from its third token on."""

    logprobs: Any
    draft: list[list[float]]


def judge_draft(draft: list[list[float]], reference: Reference, probe: Probe, *, tolerance: float, relative: float,
                floor: float, replica: int, version: int) -> float:
    """The largest |Δ log-prob| of the draft's answer against the trainer's MTP layer
    (``reference.draft``); :class:`~megatron_refit.errors.ServingMismatchError` naming the draft
    where a token is beyond the rounding bound (or the answer has another shape)."""
    shifted = Probe(tuple(s[1:] for s in probe.sequences))  # its scored tokens: each sequence's from the third
    try:
        return compare(draft, Reference(reference.draft, reference.draft_scale), shifted, tolerance=tolerance,
                       relative=relative, floor=floor, replica=replica, version=version)
    except ServingMismatchError as exc:
        raise ServingMismatchError(
            f"{exc} [in its speculative draft: the MTP layer's log-prob of the token after the next, against the "
            f"trainer's MTP layer; sequence and token counted from each sequence's second token]",
            replica=replica, version=version, max_dlogprob=exc.max_dlogprob, first=exc.first) from exc


DRIFT_MARGIN = 2.2
"""A draft whose tail (:func:`~megatron_refit.plan.calibration.tail`) moved past this many times its
clean tail is said to drift (the model's own tail margin)."""
DRIFT_FLOOR = 0.005
"""The clean tail a drift is measured against at least, as a share of the rounding bound: one
bf16 rounding of a typical log-prob is a few thousandths of it."""


class DraftCheck:
    """Train rank 0's judging of the replicas' drafts (one per fleet's serving check). Beyond the
    rounding bound a draft fails its replica (:func:`judge_draft`). Within it, its drift is
    measured: the tail of its |Δ| (as shares of the bound) over the tail its replica's first check
    showed clean (its calibration: the bytes proven by the digests); past :data:`DRIFT_MARGIN` it is
    a WARNING and ``refit/serving_draft_drift``, not a failure: a drift changes no token the engine
    serves (speculative decoding verifies every proposal), only how many are accepted, and the
    draft's clean noise over an RL run has not been measured as the model's was (#68)."""

    def __init__(self):
        self._said_unscored = False
        self.clean: dict[int, tuple[float, int, tuple]] = {}
        """Per replica: its draft's clean tail, the version it was measured at and the probe's sequences."""

    def forget(self, replica: int) -> None:
        self.clean.pop(replica, None)

    def judge(self, draft: list[list[float]] | None, reference: Reference, probe: Probe,
              **kwargs) -> tuple[float, float | None] | None:
        """A replica's draft answer: its largest |Δ| (:func:`judge_draft`, which raises beyond the
        rounding bound) and its drift (None at its calibration check); None where its answer
        carries no draft (an engine scored through its serving API: said once, counted by
        ``refit/serving_draft_checked``)."""
        if draft is not None:
            worst = judge_draft(draft, reference, probe, **kwargs)
            return worst, self._drift(draft, reference, probe, **kwargs)
        if not self._said_unscored:
            logger.warning("refit.verify_serving with gen_draft: engine replica %d scores the probe through an API "
                           "that gives the model's log-probs only: its speculative draft is proven by its bytes "
                           "(refit.verify), not by its log-probs (refit/serving_draft_checked)", kwargs["replica"])
            self._said_unscored = True
        return None

    def _drift(self, draft, reference: Reference, probe: Probe, *, tolerance: float, relative: float, replica: int,
               version: int, **_) -> float | None:
        ours = Reference(reference.draft, reference.draft_scale)
        now = calibration.tail(calibration.shares(draft, ours, tolerance=tolerance, relative=relative) or [0.0])
        clean = self.clean.get(replica)
        if clean is None or clean[2] != probe.sequences:  # its calibration check (or a new probe)
            self.clean[replica] = (now, version, probe.sequences)
            return None
        drift = now / max(clean[0], DRIFT_FLOOR)
        if drift > DRIFT_MARGIN:
            logger.warning("refit %d: engine replica %d's speculative draft drifted from the trainer's MTP layer: the "
                           "tail of its |Δ log-prob| is %.3g of the rounding bound, %.3gx the %.3g it showed clean at "
                           "version %d (within the bound: not a failure; a draft left behind or changed by its "
                           "post-load step lowers acceptance, never the tokens) (refit/serving_draft_drift)",
                           version, replica, now, drift, clean[0], clean[1])
        return drift
