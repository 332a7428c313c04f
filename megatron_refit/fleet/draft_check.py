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


class DraftCheck:
    """Train rank 0's judging of the replicas' drafts (one per fleet's serving check)."""

    def __init__(self):
        self._said_unscored = False

    def judge(self, draft: list[list[float]] | None, reference: Reference, probe: Probe, **kwargs) -> float | None:
        """:func:`judge_draft` of a replica's draft answer, or None where its answer carries none
        (an engine scored through its serving API: said once, counted by ``refit/serving_draft_checked``)."""
        if draft is not None:
            return judge_draft(draft, reference, probe, **kwargs)
        if not self._said_unscored:
            logger.warning("refit.verify_serving with gen_draft: engine replica %d scores the probe through an API "
                           "that gives the model's log-probs only: its speculative draft is proven by its bytes "
                           "(refit.verify), not by its log-probs (refit/serving_draft_checked)", kwargs["replica"])
            self._said_unscored = True
        return None
