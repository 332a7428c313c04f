"""The refit group's error types (raised by :mod:`megatron_refit.transport` and
:mod:`megatron_refit.transport.rendezvous`; see docs/troubleshooting.md)."""


class RefitTransportError(RuntimeError):
    """A transfer failed: the peer closed the connection, crashed or misbehaved; or the
    group could not be formed, or is broken by an earlier failure."""


class RefitTimeoutError(RefitTransportError):
    """A wait ran past ``timeout_s``."""


class RefitProtocolError(RuntimeError):
    """Refit ranks are in different calls (or run different protocol versions): raised on
    every rank of the exchange, naming each side's call; no weight byte moved."""
