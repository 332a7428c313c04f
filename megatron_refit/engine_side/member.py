"""An engine rank's end of its replica's refit group: :class:`EngineMember` (the train ranks'
end is :class:`~megatron_refit.fleet.member.TrainerMember`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from megatron_refit.config import RefitConfig
from megatron_refit.endpoint.receiver import Receiver
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.endpoint.storage import GatesTraffic, HoldsWeights, ScoresProbe
from megatron_refit.group.inband import exchange_in_band, verdict_in_band
from megatron_refit.group.member import Member, endpoint_kw

logger = logging.getLogger(__name__)


class EngineMember(Member):
    """Generation side of the refit (one per generation rank)."""

    def __init__(self, group, storage, cfg: RefitConfig, *, num_train: int, lora: tuple[int, float] | None = None,
                 on_report: Callable[[dict], None] | None = None, relay=None, heartbeat=None,
                 on_close: Callable[[], None] | None = None):
        self.num_train = num_train
        self._score = storage.score if isinstance(storage, ScoresProbe) else None
        """The engine's forward over the probe (``refit.verify_serving`` in band), if it has one."""
        self._hold_storage = storage.hold if isinstance(storage, HoldsWeights) else None
        """How the engine stops serving a version that failed its serving check, if it can."""
        self._gates = storage if isinstance(storage, GatesTraffic) else None
        """An engine that keeps traffic off a checked version until its verdict (scored first)."""
        kw = dict(endpoint_kw(cfg, num_train, on_report), relay=relay,
                  gate=None if self._gates is None else self._gates.gate,
                  dense_forward=(cfg.gen_tp, cfg.gen_attention_dp, cfg.gen_node_ranks)
                  if cfg.gen_dense_forward == "node" else None)
        self.group = group
        self.heartbeat = heartbeat
        """This rank's :class:`~megatron_refit.engine_side.heartbeat.Heartbeat` (stopped by :meth:`close`)."""
        self.on_close = on_close
        """Called first by :meth:`close` (replica rank 0 announces that the replica leaves)."""
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
        self._last = self.full

    def receive(self, version: int | None = None, *, full: bool = False) -> RefitReport:
        """Receive refit ``version`` into the engine (see :meth:`TrainerMember.refit`); None:
        the version the train ranks send next (a replica that joined a running trainer)."""
        self._last = self._endpoint(full)
        try:
            report = self._last.receive(version)
            self._advance(report.version)
            if self._last.probe_due and report.summary["refit/ok"]:  # the train ranks ask for its serving probe
                exchange_in_band(self.group, self.num_train, score=self._score,
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
        if self._hold_storage is not None:
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
