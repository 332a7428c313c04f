"""One replica's refit group as a rank holds it, on either side: :class:`Member` (one prepared
endpoint for all pieces and, under LoRA adapter sync, one for the adapters only, sharing one
version), what both :class:`~megatron_refit.fleet.member.TrainerMember` (a train rank) and
:class:`~megatron_refit.engine_side.member.EngineMember` (an engine rank) build on."""

from __future__ import annotations

import logging
from collections.abc import Callable

from megatron_refit.config import RefitConfig
from megatron_refit.endpoint.integrity import in_force
from megatron_refit.group.beats import stall_s

logger = logging.getLogger(__name__)


def close_quietly(member, replica: int) -> None:
    """Release replica ``replica``'s group on this rank; a broken one only logs (its peer is gone)."""
    try:
        member.close()
    except Exception:  # noqa: BLE001 -- a broken group: its peer is gone, there is nothing to release
        logger.warning("refit: closing replica %d's group failed", replica, exc_info=True)


class Member:
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
    """An engine rank's :class:`~megatron_refit.engine_side.heartbeat.Heartbeat` (stopped by :meth:`close`)."""

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


def endpoint_kw(cfg: RefitConfig, num_train: int, on_report) -> dict:
    """What both sides' endpoints take from the ``refit:`` config (they must agree on it: ``prepare``).
    A group holds one replica: its engine ranks are ``cfg.replica_size``, whatever ``gen_dp``."""
    return dict(num_train=num_train, num_gen=cfg.replica_size, bucket_bytes=cfg.bucket_bytes,
                direct_bytes=cfg.direct_bytes, verify=in_force(cfg.verify, cfg.fanout), on_report=on_report,
                delta=cfg.delta, replica_size=cfg.replica_size, stall_s=stall_s(cfg))
