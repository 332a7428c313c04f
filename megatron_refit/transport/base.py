"""The transport interface: what the endpoint needs from a refit group.

A transport connects every train and generation rank of one refit (refit ranks ``0 ..
num_train-1`` train, then generation ranks) and offers point-to-point bucket messages,
small control messages and a few control collectives, each wait bounded by ``timeout_s``.
The endpoints (:mod:`megatron_refit.endpoint.base`, :mod:`megatron_refit.endpoint.sender`) speaks only this
interface; :mod:`megatron_refit.transport` registers the implementations by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class Pending:
    """An outstanding send or receive."""

    work: object
    peer: int
    what: str
    buffer: torch.Tensor = field(repr=False)
    direct: bool = False
    """The buffer is the tensor itself (no packing / unpacking)."""
    control: torch.Tensor | None = field(default=None, repr=False)
    """Shared-buffer transports: the control message that says where the bytes are."""
    tag: int | None = None


class Transport(ABC):
    """A refit group. Implementations: :class:`~megatron_refit.transport.process_group.ProcessGroupTransport`
    (torch.distributed P2P: gloo on CPU, NCCL between GPUs) and
    :class:`~megatron_refit.transport.ipc.IpcTransport` (colocated: shared staging buffers)."""

    rank: int
    world_size: int
    backend: str
    """The torch.distributed backend under it (``"gloo"`` / ``"nccl"``)."""
    device: torch.device
    """Where small control tensors and the transport's own buffers live."""
    timeout_s: float
    broken: str | None = None
    """Set by the first timeout or transport failure; every later call then fails at once."""
    direct_ok: bool = True
    """Whether the endpoint may send a tensor straight from / into its own memory (no staging)."""
    store = None
    """The group's store, where small notes pass between its ranks outside a refit (None: the
    transport has none)."""

    def auto_direct_bytes(self, bucket_bytes: int) -> int | None:
        """``direct_bytes="auto"`` (``refit.direct_mb: null``) on this transport: the size from
        which a transfer skips packing (None: none does). By default one bucket: between
        devices a packing copy runs ~30x faster than a 400 Gb/s NIC (~3x faster than NVLink)
        but every message costs ~20 us, so a model's many mid-size pieces (one expert's slice,
        one layer's projection) travel packed, a few full buckets per peer, as
        :mod:`megatron_refit.plan.cost` counts them."""
        return bucket_bytes if self.direct_ok else None
    shares_buffers: bool = False
    """Bucket bytes go through buffers the peers map (the endpoint gets them from :meth:`staging`)."""

    # -- bucket messages ----------------------------------------------------------------------
    @abstractmethod
    def isend(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending: ...

    @abstractmethod
    def irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending: ...

    @abstractmethod
    def wait(self, pending: Pending) -> None:
        """Until ``pending`` completes; ``RefitTimeoutError`` / ``RefitTransportError`` naming the peer."""

    def release(self, pending: Pending) -> None:  # noqa: B027 -- optional hook, nothing to do by default
        """Receiver: the bucket in ``pending.buffer`` is unpacked (a shared buffer may be reused)."""

    def staging(self, count: int, width: int) -> list[torch.Tensor]:
        """Shared-buffer transports: ``count`` staging buffers of ``width`` bytes (collective)."""
        raise NotImplementedError(f"{type(self).__name__} has no shared staging buffers")

    # -- control ------------------------------------------------------------------------------
    def open_refit(self) -> None:  # noqa: B027 -- optional: a transport without a store
        """Rank 0: this group's next refit begins (see :meth:`await_refit`; both count refits)."""

    def await_refit(self, timeout_s: float) -> None:  # noqa: B027 -- optional, as above
        """An engine rank between refits: until rank 0 opened the group's next refit, up to
        ``timeout_s`` (longer than a refit's own waits: the time between refits is the
        trainer's, e.g. a training step, plus another replica's refit that timed out)."""

    @abstractmethod
    def send_small(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending: ...

    @abstractmethod
    def recv_small(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending: ...

    @abstractmethod
    def exchange(self, call: str, values=()) -> list[list[int]]:
        """A control collective with a header naming the call (see ``ProcessGroupTransport.exchange``)."""

    @abstractmethod
    def all_gather_object(self, obj, call: str = "message") -> list: ...

    @abstractmethod
    def all_gather_unique(self, obj, call: str = "message", *, digests: bool = False,
                          known: dict | None = None) -> list:
        """:meth:`all_gather_object` of objects many ranks share; ``digests``: also each rank's
        object's sha256 (``(objects, digests)``), a key for what was gathered; ``known``:
        objects decoded before, by digest, taken instead of decoding their bytes again."""

    def barrier(self, call: str = "message") -> None:
        self.exchange(call)

    @abstractmethod
    def begin(self, phase: str) -> None:
        """Name what the group is doing (``"prepare"``, ``"refit 7"``) for its failure messages."""

    def abort(self, reason: str) -> None:  # noqa: B027 -- a transport without blocking waits has nothing to free
        """Fail every wait on this group now, in whatever thread it blocks (shutdown, a stalled
        peer); the group is broken after it."""

    @abstractmethod
    def close(self) -> None: ...
