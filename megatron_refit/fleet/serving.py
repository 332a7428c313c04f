"""Proof of serving on the train side (``refit.verify_serving``): which replicas a refit checks,
the trainer's reference, and each replica's verdict.

Every train rank holds one :class:`ServingCheck` per fleet and asks it the same questions in the
same order, so all of them agree without a message: :meth:`ServingCheck.due` at the start of a
refit (which replicas this refit checks: every N-th refit, and any replica that has not passed
a check since it joined or last failed), :meth:`ServingCheck.take_reference` (collective over the
train ranks: the trainer model's own per-token log-probs on the probe, in the thread that owns
the model, before the next training step changes it), and :meth:`ServingCheck.record` with what
train rank 0 found (gathered with the refit's outcomes). Train rank 0 alone compares
(:meth:`ServingCheck.verdict`); a mismatch fails that replica like any replica failure.

How a replica scores the probe is its engine's: through its control client on train rank 0
(vLLM's server or ``LLM``, SGLang), or in band over its refit group (an engine without a control
plane, e.g. the HF engine: :func:`~megatron_refit.group.inband.exchange_in_band`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from megatron_refit.config import RefitConfig
from megatron_refit.errors import ServingMismatchError
from megatron_refit.fleet.draft_check import DraftCheck, DraftScores
from megatron_refit.plan import calibration
from megatron_refit.plan.probe import (BULK_MIN_TOKENS, DEFAULT_COVER_TOKENS, Probe, Reference, bulk, compare,
                                      default_tolerance, make_probe, mean_difference, relative_tolerance)

logger = logging.getLogger(__name__)

SERVING_KEYS = ("refit/serving_checked", "refit/serving_unchecked", "refit/serving_max_dlogprob",
                "refit/serving_mean_dlogprob", "refit/serving_bulk", "refit/serving_s", "refit/serving_reference_s",
                "refit/serving_experts_covered", "refit/serving_experts_total", "refit/serving_calibrated",
                "refit/serving_draft_checked", "refit/serving_draft_max_dlogprob", "refit/serving_draft_drift")
"""The fleet summary's serving metrics: replicas checked, replicas ``auto`` could not check (the
check is off for a named reason, or the replica's engine cannot score), their largest |Δ
log-prob|, the largest of their mean |Δ| over the probe's tokens and of their bulk (the 90 %
quantile of |Δ| as a share of each token's tolerance), the check's seconds (the
trainer's reference plus the slowest replica's answer) and the reference's alone, and of a MoE
model the (layer, expert) pairs the probe routes to under the trainer's router at the last
reference, of all of them (0 of 0: a dense model, or no reference yet), the replicas judged
against their calibrated noise (:mod:`~megatron_refit.plan.calibration`; the others against the
rounding bound: a replica's first check, or every check under ``refit.verify: off``), under
``refit.gen_draft`` the replicas whose speculative draft was scored, its largest |Δ log-prob| and
its largest drift from its clean noise (:mod:`~megatron_refit.fleet.draft_check`); each replica's difference also under
``refit/serving_max_dlogprob/replica_<r>`` when it was checked."""


@runtime_checkable
class TrainerForward(Protocol):
    """The trainer model's own forward for the probe (``conversion.serving.trainer_forward``):
    called on every train rank at once (a collective over the model-parallel groups), returns
    the per-token log-probs of each sequence on every rank."""

    vocab_size: int
    experts: tuple[int, int] | None
    """After a call, for a MoE model: ``(experts the sequences were routed to, experts)`` over its
    MoE layers (every (layer, expert) pair counts once); None for a dense model."""
    dtype: str
    """The dtype of the weights it sends (the engine's: the tolerance's dtype)."""
    scale: list[list[float]] | None
    """After a call: per scored token, ``|its logit| + |the largest logit|``
    (:attr:`~megatron_refit.plan.probe.Reference.scale`; None: not measured)."""
    lora: bool
    """The model carries LoRA adapters (the engine merges them)."""
    routes: list[list[tuple[tuple[int, int], ...]]] | None
    """After a call, for a MoE model: per scored token, the (layer, expert) pairs its position is
    routed to (:attr:`~megatron_refit.plan.probe.Reference.routes`); None for a dense model."""

    def prepare(self, *, fp8: bool) -> None:
        """Once, before the first call: ``fp8``, the trainer quantizes what it sends (the reference
        then computes with the FP8-rounded weights); ``ValueError`` naming why where it cannot run
        (the same on every train rank: decided from what they share, the model's config)."""

    def __call__(self, sequences: tuple[tuple[int, ...], ...]) -> list[list[float]]: ...

    def cover(self, base: tuple[tuple[int, ...], ...], *, budget: int, seed: int) -> tuple[tuple[int, ...], ...]:
        """``base`` and at most ``budget`` tokens more, chosen so that every expert is routed
        (collective; the same on every train rank)."""


class ServingUnavailableError(Exception):
    """A replica's engine has no way to score the probe (a client without ``score``, a storage
    without ``score``): under ``auto`` that replica is not checked; under ``on`` / N it fails."""


class ServingCheck:
    """One fleet's serving checks on one train rank (see the module docstring)."""

    def __init__(self, cfg: RefitConfig, forward: TrainerForward | None, *, rank: int):
        self.every = cfg.serving_every
        self.auto = cfg.verify_serving == "auto"
        self.rank = rank
        self.forward = forward
        self.unchecked: str | None = None
        """``auto``: why the check is off (every replica of every refit unchecked), None while it runs."""
        if self.every is not None and forward is None:
            if not self.auto:
                raise ValueError(f"refit.verify_serving={cfg.verify_serving!r} needs the trainer model's forward to "
                                 "compare with: refit a Megatron model (RefitCallback, conversion.refit.trainer_refit, "
                                 "local_shard_source) or pass forward=conversion.serving.trainer_forward(...); "
                                 "or set verify_serving: off")
            self._turn_off("the trainer refits bare pieces: no forward to compare with")
        self.draft = cfg.gen_draft
        """The engines decode with the trainer's MTP layer as their draft: the reference scores it too."""
        self.drafts = DraftCheck()
        if self.every is not None:
            try:  # the draft only where there is one: a forward without MTP layers needs no such argument
                forward.prepare(fp8=cfg.trainer_quantize_fp8, **({"draft": True} if self.draft else {}))
            except ValueError as exc:
                if not self.auto:
                    raise
                self._turn_off(str(exc))
        self.probe: Probe | None = None
        """The probe the last reference scored: :attr:`base`, extended to route every expert."""
        self.base: Probe | None = None
        """``refit.serving_probe``'s sequences."""
        self.cover_tokens = (cfg.serving_probe or {}).get("cover_tokens", DEFAULT_COVER_TOKENS)
        self.seed = (cfg.serving_probe or {}).get("seed", 0)
        self.experts: tuple[int, int] = (0, 0)
        """Of a MoE model at the last reference: (experts the probe routes to, experts)."""
        self.tolerance = self.floor = math.inf
        self.relative = 0.0
        if self.every is not None:
            self.base = self.probe = make_probe(cfg.serving_probe, forward.vocab_size)
            self.relative = relative_tolerance(forward.dtype)
            self.floor = default_tolerance(forward.dtype, fp8=cfg.trainer_quantize_fp8, lora=forward.lora)
            self.tolerance = cfg.serving_tolerance if cfg.serving_tolerance is not None else self.floor
        self._said_uncovered = self._said_short = False
        self._reached = math.inf
        """The experts the last search's probe routed (searched again only below it)."""
        self.refits = 0
        self.verified: set[int] = set()
        """Replicas that passed a check since they joined or last failed."""
        self.unable: set[int] = set()
        """``auto``: replicas whose engine cannot score the probe (not asked again until they rejoin)."""
        self.calibrate = cfg.verify != "off"
        """Replicas' limits from their own clean noise (:mod:`~megatron_refit.plan.calibration`),
        measured only where the refit proves the bytes (``refit.verify``)."""
        self.profiles: dict[int, calibration.Profile] = {}
        """Train rank 0: each replica's clean noise, measured at its first passed check."""
        if self.enabled and not self.calibrate and rank == 0:
            logger.warning("refit.verify_serving: refit.verify is off, so no refit proves the bytes a calibration "
                           "would measure the engine's noise on: every check is judged against the dtype's rounding "
                           "bound alone (refit/serving_calibrated stays 0)")

    def _turn_off(self, why: str) -> None:
        """``auto`` where the check cannot run: off, said once (and counted per refit in
        ``refit/serving_unchecked``)."""
        if self.rank == 0:
            logger.warning("refit.verify_serving auto: off, no replica's serving is checked (refit/serving_unchecked): "
                           "%s", why)
        self.unchecked, self.every = why, None

    @property
    def enabled(self) -> bool:
        return self.every is not None

    def due(self, replicas) -> dict[int, bool]:
        """Which of ``replicas`` this refit checks (every train rank calls it once per refit)."""
        if not self.enabled:
            return {}
        self.refits += 1
        hit = self.refits % self.every == 0
        return {r: (hit or r not in self.verified) and r not in self.unable for r in replicas}

    def take_reference(self) -> tuple[Probe, Reference, float]:
        """The probe, the trainer's answer to it now (collective over the train ranks: its
        log-probs and the magnitude of their logits where the forward gives it) and the seconds
        they took. Of a MoE model, the probe routes every expert under the router as it is
        now where ``cover_tokens`` allows: the last probe is kept while it routes as many as the
        last search reached, and extended again from ``refit.serving_probe``'s own sequences
        (:meth:`TrainerForward.cover`) when it routes fewer (the router trained); a probe that
        cannot cover them all is a WARNING, once (an expert no token reaches is not searched for
        again at every check)."""
        t0 = time.perf_counter()
        reference = self.forward(self.probe.sequences)
        experts = self.forward.experts or (0, 0)
        if experts[0] < min(experts[1], self._reached) and self.cover_tokens:
            sequences = self.forward.cover(self.base.sequences, budget=self.cover_tokens, seed=self.seed)
            if sequences != self.probe.sequences:
                self.probe = Probe(tuple(sequences))
                reference = self.forward(self.probe.sequences)
                experts = self.forward.experts
            self._reached = experts[0]
            if experts[0] < experts[1] and self.rank == 0 and not self._said_uncovered:
                logger.warning("refit.verify_serving: the serving probe routes %d of the %d experts (layer, expert) "
                               "under the trainer's router (refit.serving_probe.cover_tokens=%d tokens more at most); "
                               "a fault in the others goes unseen (refit/serving_experts_covered)",
                               experts[0], experts[1], self.cover_tokens)
                self._said_uncovered = True
        self.experts = experts
        answer = Reference(reference, self.forward.scale, self.forward.routes,
                           draft=self.forward.draft if self.draft else None,
                           draft_scale=self.forward.draft_scale if self.draft else None)
        return self.probe, answer, time.perf_counter() - t0

    def verdict(self, replica: int, version: int, score: Callable[[], Any], reference: Reference, probe: Probe,
                stale: list[str] = ()) -> dict:
        """Train rank 0: replica ``replica``'s score of ``probe`` (``score()``: its log-probs, or
        raises :class:`ServingUnavailableError`) against ``reference``. Returns what :meth:`record`
        takes; raises :class:`~megatron_refit.errors.ServingMismatchError` where it differs, or
        where its engine reads back ``stale`` parameters: weights that no longer hold the bytes
        they received (below any log-prob tolerance: one bf16 step of an RL update)."""
        t0 = time.perf_counter()
        try:
            served = score()
        except ServingUnavailableError as exc:
            if self.auto:
                return dict(unable=str(exc), seconds=time.perf_counter() - t0)
            raise ServingMismatchError(f"refit {version}: engine replica {replica} cannot score the serving probe "
                                       f"({exc}); refit.verify_serving={self.every} asks every replica to",
                                       replica=replica, version=version, max_dlogprob=math.inf, first=None) from exc
        except Exception as exc:  # noqa: BLE001 -- an engine that cannot serve the probe has not proven the version
            why = f"{type(exc).__name__}: {exc}"[:500]
            raise ServingMismatchError(f"refit {version}: engine replica {replica} failed to serve the probe ({why})",
                                       replica=replica, version=version, max_dlogprob=math.inf, first=None) from exc
        seconds = time.perf_counter() - t0
        served, draft = (served.logprobs, served.draft) if isinstance(served, DraftScores) else (served, None)
        moved, drafted = None, (None, None)
        profile = self.profiles.get(replica)
        bound = None if profile is None else calibration.limits(profile)
        paths = served.paths if isinstance(served, PathScores) else (("", served),)
        try:
            judged = [(self._compare(label, answer, reference, probe, replica, version, calibrated=profile is not None),
                       answer) for label, answer in paths]
            worst, served = max(judged, key=lambda item: item[0])  # the path furthest off stands for the replica
            shares = [calibration.shares(answer, reference, tolerance=self.tolerance, relative=self.relative)
                      for _, answer in judged]
            values = [max(column) for column in zip(*shares)]  # a fault on one path is the replica's
            if bound is not None:
                same = reference.routes is not None and calibration.on_probe(profile, probe.sequences)
                judge = functools.partial(calibration.judge, bound=bound, tolerance=self.tolerance,
                                          relative=self.relative, replica=replica, version=version, worst=worst,
                                          routes=[r for row in reference.routes for r in row] if same else None)
                try:
                    moved = judge(values)
                except ServingMismatchError as exc:
                    failing = [label for (label, _), own in zip(paths, shares) if label and not _passes(judge, own)]
                    if not failing:
                        raise
                    raise ServingMismatchError(f"{exc} (through its {', '.join(failing)})", replica=replica,
                                               version=version, max_dlogprob=exc.max_dlogprob,
                                               first=exc.first) from exc
            if stale:
                raise ServingMismatchError(
                    f"refit {version}: engine replica {replica} does not serve the trainer's model: its weights, "
                    f"read back after its post-load step, no longer hold the bytes it received in the buckets of "
                    f"{len(stale)} parameter(s) {list(stale)[:8]}{' ...' if len(stale) > 8 else ''} (a tensor left "
                    f"stale or changed after the load; its log-probs are within {worst:.3g} of the trainer's). It "
                    f"has not landed version {version}; its next refit is a full one",
                    replica=replica, version=version, max_dlogprob=worst, first=None)
            if reference.draft is not None:
                drafted = self.drafts.judge(draft, reference, probe, tolerance=self.tolerance, relative=self.relative,
                                            floor=self.floor, replica=replica, version=version) or (None, None)
        except ServingMismatchError as exc:
            exc.seconds = seconds
            raise
        self._calibrate(replica, version, values, probe)
        share = bulk(served, reference, tolerance=self.tolerance, relative=self.relative)
        if share is None and not self._said_short:
            logger.warning("refit.verify_serving: the serving probe scores %d tokens, fewer than %d: each is judged "
                           "against its own tolerance, the probe's bulk (refit/serving_bulk) is not judged",
                           probe.num_tokens, BULK_MIN_TOKENS)
            self._said_short = True
        return dict(max_dlogprob=worst, mean_dlogprob=mean_difference(served, reference), seconds=seconds, bulk=share,
                    calibrated=bound is not None, tail=calibration.tail(values),
                    tail_limit=None if bound is None else bound.tail, expert_moved=moved,
                    expert_limit=None if bound is None else bound.expert, draft_dlogprob=drafted[0],
                    draft_drift=drafted[1])

    def _compare(self, label: str, served: Any, reference: Reference, probe: Probe, replica: int, version: int, *,
                 calibrated: bool) -> float:
        """:func:`~megatron_refit.plan.probe.compare` of one serving path (``label``: which, '' where
        the replica has one), its failure named by the path and, on a calibration check, as such."""
        try:
            return compare(served, reference, probe, tolerance=self.tolerance, relative=self.relative,
                           floor=self.floor, replica=replica, version=version)
        except ServingMismatchError as exc:
            where = f" (through its {label})" if label else ""
            if calibrated or not self.calibrate:
                if not where:
                    raise
                raise ServingMismatchError(f"{exc} (through its {label})", replica=replica, version=version,
                                           max_dlogprob=exc.max_dlogprob, first=exc.first) from exc
            raise ServingMismatchError(
                f"{exc}{where}. This was its calibration check (its first since it joined, where its clean noise is "
                f"measured, judged against the rounding bound): it has no calibration", replica=replica,
                version=version, max_dlogprob=exc.max_dlogprob, first=exc.first) from exc

    def _calibrate(self, replica: int, version: int, values: list[float], probe: Probe) -> None:
        """After replica ``replica`` passed a check with these :func:`~megatron_refit.plan.calibration.shares`:
        its profile measured where one is due (:func:`~megatron_refit.plan.calibration.due`), else
        these shares kept as the baseline of its next check's experts
        (:func:`~megatron_refit.plan.calibration.passed`)."""
        profile = self.profiles.get(replica)
        if not self.calibrate:
            return
        if not calibration.due(profile, probe.sequences):
            self.profiles[replica] = calibration.passed(profile, values, version=version)
            return
        new = calibration.measure(values, probe.sequences, version=version)
        self.profiles[replica] = new if profile is None else calibration.remeasured(profile, new)

    def record(self, found: dict[int, dict], failures: dict[int, str], reference_s: float,
               replicas: list[int] = ()) -> dict:
        """Every train rank, after a refit of ``replicas``: what train rank 0 found per checked
        replica (:meth:`verdict`'s results; a mismatch's ``max_dlogprob`` too) and the refit's
        failures; returns the serving metrics for the fleet summary."""
        for replica, result in found.items():
            if "unable" in result:
                if replica not in self.unable and self.rank == 0:
                    logger.warning("refit.verify_serving auto: engine replica %d is not checked until it rejoins "
                                   "(refit/serving_unchecked): %s", replica, result["unable"])
                self.unable.add(replica)
            elif replica in failures:
                self.verified.discard(replica)
            else:
                self.verified.add(replica)
        for replica in failures:  # any failure: check it again at its next refit
            self.verified.discard(replica)
        checked = {r: v["max_dlogprob"] for r, v in found.items() if "max_dlogprob" in v}
        unchecked = len(replicas) if self.unchecked is not None else len(set(replicas) & self.unable)
        metrics = {"refit/serving_checked": len(checked), "refit/serving_unchecked": unchecked,
                   "refit/serving_max_dlogprob": max(checked.values(), default=0.0),
                   "refit/serving_mean_dlogprob": max((v.get("mean_dlogprob", 0.0) for v in found.values()
                                                       if "max_dlogprob" in v), default=0.0),
                   "refit/serving_bulk": max((v.get("bulk") or 0.0 for v in found.values()
                                              if "max_dlogprob" in v), default=0.0),
                   "refit/serving_s": reference_s + max((v["seconds"] for v in found.values()), default=0.0),
                   "refit/serving_reference_s": reference_s, "refit/serving_experts_covered": self.experts[0],
                   "refit/serving_experts_total": self.experts[1],
                   "refit/serving_calibrated": sum(bool(v.get("calibrated")) for v in found.values()
                                                   if "max_dlogprob" in v),
                   "refit/serving_draft_checked": sum(v.get("draft_dlogprob") is not None for v in found.values()),
                   "refit/serving_draft_max_dlogprob": max((v.get("draft_dlogprob") or 0.0 for v in found.values()),
                                                           default=0.0),
                   "refit/serving_draft_drift": max((v.get("draft_drift") or 0.0 for v in found.values()), default=0.0)}
        metrics.update({f"refit/serving_max_dlogprob/replica_{r}": d for r, d in sorted(checked.items())})
        return metrics

    def forget(self, replica: int) -> None:
        """Replica ``replica`` left or was dropped: a new one under its index starts unchecked."""
        self.verified.discard(replica)
        self.unable.discard(replica)
        self.profiles.pop(replica, None)
        self.drafts.forget(replica)


@dataclass(frozen=True)
class PathScores:
    """A replica's log-probs of the probe through each of its serving paths: a wide expert-parallel
    deployment's data-parallel ranks each serve from their own attention copy, so each is probed
    (:class:`~megatron_refit.engines.vllm.trainer.deployment_client.DeploymentClient`). The
    verdict judges every path and names the one that fails."""

    paths: tuple[tuple[str, Any], ...]
    """``(label, log-probs)`` per path, e.g. ``("DP rank 1", [[...], ...])``."""


def _passes(judge: Callable[[list[float]], Any], values: list[float]) -> bool:
    try:
        judge(values)
    except ServingMismatchError:
        return False
    return True


def stale_of(answer: Any) -> list[str]:
    """The parameters an in-band answer (:func:`~megatron_refit.group.inband.exchange_in_band`)
    names stale: [] for most."""
    return answer["stale"] if isinstance(answer, dict) and "stale" in answer else []


def served_or_raise(answer: Any) -> Any:
    """An in-band answer (:func:`~megatron_refit.group.inband.exchange_in_band`) as
    :meth:`ServingCheck.verdict`'s ``score()`` gives it: the log-probs, or
    :class:`ServingUnavailableError`; an engine error raises as itself."""
    if isinstance(answer, dict) and "stale" in answer:
        answer = answer["served"]
    if isinstance(answer, dict) and "unable" in answer:
        raise ServingUnavailableError(f"its engine answered: {answer['unable']}")
    if isinstance(answer, dict) and "error" in answer:
        raise RuntimeError(f"scoring the serving probe failed on the engine: {answer['error']}")
    if isinstance(answer, dict) and "draft" in answer:
        return DraftScores(answer["logprobs"], answer["draft"])
    return answer
