"""One refit group's endpoints as the entry points hand them out: :class:`TrainerMember` on a
train rank, :class:`EngineMember` on an engine rank, each with one prepared endpoint for all
pieces and, under LoRA adapter sync, one for the adapters only (sharing one version)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from megatron_refit.config import RefitConfig
from megatron_refit.endpoint.integrity import in_force
from megatron_refit.endpoint.receiver import Receiver
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.endpoint.sender import Refitter
from megatron_refit.endpoint.storage import GatesTraffic
from megatron_refit.errors import ServingMismatchError
from megatron_refit.fleet.heartbeat import stall_s
from megatron_refit.fleet.serving import exchange_in_band, verdict_in_band

logger = logging.getLogger(__name__)


def member_config(cfg: RefitConfig) -> RefitConfig:
    """The ``refit:`` section of one replica's group: the same, with one replica."""
    return dataclasses.replace(cfg, gen_dp=1)


def close_quietly(member, replica: int) -> None:
    """Release replica ``replica``'s group on this rank; a broken one only logs (its peer is gone)."""
    try:
        member.close()
    except Exception:  # noqa: BLE001 -- a broken group: its peer is gone, there is nothing to release
        logger.warning("refit: closing replica %d's group failed", replica, exc_info=True)


class _Member:
    """One or two prepared endpoints (all pieces; adapters only) that share a version."""

    full = adapters = None
    _version: int | None = None

    _resend = False
    """The next refit moves every piece (a replica that failed its last one, its serving check
    included), not only the LoRA adapters."""

    def _endpoint(self, full: bool):
        """All pieces on the first refit, when asked, or without adapters; else the adapters."""
        if full or self._resend or self._version is None or self.adapters is None:
            return self.full
        return self.adapters

    def endpoint(self, full: bool = False):
        """The endpoint the next refit, called with ``full``, runs (all pieces, or adapters)."""
        return self._endpoint(full)

    def is_full(self, full: bool = False) -> bool:
        """Whether the next refit, called with ``full``, moves everything (else adapters only)."""
        return self._endpoint(full) is self.full

    def _advance(self, version: int) -> None:
        self._version = version
        for endpoint in (self.full, self.adapters):
            if endpoint is not None:
                endpoint.version = version  # the next refit must advance past it on either plan

    on_close: Callable[[], None] | None = None
    """Called first by :meth:`close` (an engine replica announces that it leaves)."""
    relay = None
    """An engine rank's :class:`~megatron_refit.endpoint.relay.RelayLinks` (closed by :meth:`close`)."""
    heartbeat = None
    """An engine rank's :class:`~megatron_refit.fleet.heartbeat.Heartbeat` (stopped by :meth:`close`)."""

    def close(self) -> None:
        """Release the group (colocated: collective, the shared buffers too)."""
        try:
            if self.on_close is not None:
                self.on_close()
            self.group.close()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.close()
            if self.relay is not None:
                self.relay.close()


def _endpoint_kw(cfg: RefitConfig, num_train: int, on_report) -> dict:
    """What both sides' endpoints take from the ``refit:`` config (they must agree on it: ``prepare``)."""
    return dict(num_train=num_train, num_gen=cfg.gen_tp * cfg.gen_dp, bucket_bytes=cfg.bucket_bytes,
                direct_bytes=cfg.direct_bytes, verify=in_force(cfg.verify, cfg.fanout), on_report=on_report,
                delta=cfg.delta, replica_size=cfg.gen_tp, stall_s=stall_s(cfg))


class TrainerMember(_Member):
    """Train side of the refit (one per train rank); see the module docstring. ``plans``: plans
    built already (shared by a train rank's replica groups: one plan per replica layout)."""

    def __init__(self, group, pieces: list, adapters: list, cfg: RefitConfig, *, num_train: int,
                 on_report: Callable[[dict], None] | None = None, plans: dict | None = None):
        kw = dict(_endpoint_kw(cfg, num_train, on_report), plans=plans, check_finite=cfg.check_finite)
        self.group = group
        self.full = Refitter(group, pieces + adapters, **kw)
        self.plan = self.full.prepare()
        self.adapters = None
        if adapters and cfg.lora_sync != "full":
            self.adapters = Refitter(group, adapters, **kw)
            self.adapters.prepare()

    def refit(self, version: int, *, full: bool = False) -> RefitReport:
        """Send this rank's pieces of refit ``version``. Collective over the refit group:
        every train and generation rank calls it with the same ``version`` and ``full``."""
        return self.refit_and_probe(version, full=full)[0]

    def refit_and_probe(self, version: int, *, full: bool = False, probe=None,
                        judge: Callable[[object], dict] | None = None) -> tuple[RefitReport, object, float]:
        """:meth:`refit`, then, with a ``probe`` (``refit.verify_serving``, in band), the engine's
        answer to it over the group once every rank applied the refit, and train rank 0's verdict
        on it (``judge(answer)``: :meth:`~megatron_refit.fleet.serving.ServingCheck.verdict`), which
        the engine ranks hear in band before the call returns: one that fails holds its weights.
        Returns the report, the verdict (None: not asked, or not train rank 0; a failed one as its
        :class:`~megatron_refit.errors.ServingMismatchError`, once told) and the seconds from the
        answer's request to the verdict told."""
        endpoint = self._endpoint(full)
        endpoint.probe_due = probe is not None
        report = endpoint.refit(version)
        self._advance(version)
        self._resend = False
        verdict, t0 = None, time.perf_counter()
        if probe is not None and report.summary["refit/ok"]:
            answer = exchange_in_band(self.group, self.full.num_train, probe=probe if self.group.rank == 0 else None)
            try:
                verdict = judge(answer) if judge is not None else None
            except ServingMismatchError as exc:
                verdict = exc
            finally:  # told whatever judge did (an error of its own is this replica's outcome, untold)
                failed = str(verdict) if isinstance(verdict, ServingMismatchError) else None
                verdict_in_band(self.group, self.full.num_train, failed=failed)
        return report, verdict, time.perf_counter() - t0

    def set_route(self, route) -> None:
        """``refit.fanout``: where the next refit's bytes go (a :class:`~megatron_refit.plan.fanout.Route`)."""
        for endpoint in (self.full, self.adapters):
            if endpoint is not None:
                endpoint.route = route

    def force_full(self, *, adapters: bool) -> None:
        """The replica failed this refit: its next one is full (no delta; with ``adapters``, the
        base weights too under LoRA adapter sync, where its engine follows the trainer's choice)."""
        for endpoint in (self.full, self.adapters):
            if endpoint is not None:
                endpoint.forget_delta_base()
        self._resend = adapters


class EngineMember(_Member):
    """Generation side of the refit (one per generation rank)."""

    def __init__(self, group, storage, cfg: RefitConfig, *, num_train: int, lora: tuple[int, float] | None = None,
                 on_report: Callable[[dict], None] | None = None, relay=None):
        self.num_train = num_train
        self._score = getattr(storage, "score", None)
        """The engine's forward over the probe (``refit.verify_serving`` in band), if it has one."""
        self._hold_storage = getattr(storage, "hold", None)
        """How the engine stops serving a version that failed its serving check, if it can."""
        self._gates = storage if isinstance(storage, GatesTraffic) else None
        """An engine that keeps traffic off a checked version until its verdict (scored first)."""
        kw = dict(_endpoint_kw(cfg, num_train, on_report), relay=relay)
        self.group = group
        self.relay = relay
        """``refit.fanout``: this rank's links to the other replicas (closed with the member)."""
        self.adapters = None
        if lora is not None:
            from megatron_refit.endpoint.lora import LoraStorage

            merge = LoraStorage(storage, rank=lora[0], alpha=lora[1])
            self.full = Receiver(group, merge.full(), **kw)
            self.plan = self.full.prepare()
            if cfg.lora_sync != "full":
                self.adapters = Receiver(group, merge.adapters(), **kw)
                self.adapters.prepare()
        else:
            self.full = Receiver(group, storage, **kw)
            self.plan = self.full.prepare()
        for endpoint in (self.full, self.adapters):
            if endpoint is not None and self._gates is not None:
                endpoint.gate = self._gates.gate
        self._last = self.full

    def receive(self, version: int | None = None, *, full: bool = False) -> RefitReport:
        """Receive refit ``version`` into the engine (see :meth:`TrainerMember.refit`); None:
        the version the train ranks send next (a replica that joined a running trainer)."""
        self._last = self._endpoint(full)
        try:
            report = self._last.receive(version)
            self._advance(report.version)
            if self._last.probe_due and report.summary["refit/ok"]:  # the train ranks ask for its serving probe
                exchange_in_band(self.group, self.num_train, score=self._score if callable(self._score) else None,
                                 stale=self._last.stale_live)
                failed = verdict_in_band(self.group, self.num_train)
                if failed is not None:
                    self._hold(failed)
        finally:  # the verdict is in (or the refit ended without one): traffic goes on, or is refused if held
            if self._gates is not None:
                self._gates.release()
        return report

    def _hold(self, why: str) -> None:
        """Train rank 0 found this replica serving another model than the trainer's: its engine
        refuses to serve until the next refit lands (a storage without ``hold`` cannot: said)."""
        if callable(self._hold_storage):
            self._hold_storage(why)
            logger.warning("refit: this engine failed its serving check and holds its weights until the next "
                           "refit lands: %s", why)
        else:
            logger.error("refit: this engine failed its serving check but its storage cannot hold its weights "
                         "(no hold()): it goes on serving them: %s", why)

    @property
    def state(self) -> str:
        """``ready`` after a complete refit; ``stale`` (or ``updating``) otherwise."""
        return self._last.state
