"""Transports: how bucket bytes and control messages travel between refit ranks.

:class:`~.base.Transport` is the interface the endpoint speaks. Implementations register
under a name; :func:`open_transport` builds the one a refit uses:

- ``"gloo"`` / ``"nccl"``: :class:`~.process_group.ProcessGroupTransport`, torch.distributed
  point-to-point in a process group of its own (gloo on CPU, NCCL between GPUs);
- ``"ipc"``: :class:`~.ipc.IpcTransport`, colocated: bucket bytes through staging buffers the
  peers map (CUDA IPC on a GPU, POSIX shared memory on CPU), control over gloo.

:func:`register_transport` adds another (e.g. an RDMA engine) under a new name, which
``refit.transport`` then selects (:mod:`~megatron_refit.transport.registry`).
"""

from __future__ import annotations

from megatron_refit.errors import RefitProtocolError, RefitTimeoutError, RefitTransportError
from megatron_refit.transport.base import Pending, Transport
from megatron_refit.transport.process_group import ProcessGroupTransport
from megatron_refit.transport.registry import open_transport, register_transport, transport_name, transport_names

__all__ = ["Transport", "Pending", "ProcessGroupTransport", "open_transport", "register_transport", "transport_name",
           "transport_names", "RefitProtocolError", "RefitTimeoutError", "RefitTransportError"]
