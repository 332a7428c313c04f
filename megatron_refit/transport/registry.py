"""The transport registry: names to factories, and the rule ``refit.transport: auto`` follows.

:func:`open_transport` builds the transport a refit uses by name; :func:`register_transport`
adds another (e.g. an RDMA engine) under a new name, after which ``refit.transport: <name>``
selects it. Each transport declares its own direct-send policy
(:meth:`~megatron_refit.transport.base.Transport.auto_direct_bytes`, ``direct_ok``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit.transport.base import Transport
from megatron_refit.transport.process_group import ProcessGroupTransport

TransportFactory = Callable[..., Transport]
"""``factory(*, host, port, rank, world_size, timeout_s, num_train, device, namespace) -> Transport``
(``namespace``: None, or the group's keys in a store already hosted at ``host:port``)."""

_REGISTRY: dict[str, TransportFactory] = {}


def register_transport(name: str, factory: TransportFactory) -> None:
    """Make ``factory`` available as ``open_transport(name, ...)``; a taken name is refused."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"transport name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"transport {name!r} is already registered ({_REGISTRY[name]!r})")
    _REGISTRY[name] = factory


def transport_names() -> list[str]:
    return sorted(_REGISTRY)


def transport_name(name: str, *, colocated: bool, device: torch.device) -> str:
    """The transport ``refit.transport`` selects: ``name`` itself, or for ``auto``: ``ipc`` when
    trainer and engine share the devices (``mode: colocated``), else ``nccl`` between GPUs and
    ``gloo`` on CPU. ``ValueError`` naming an unregistered name, before anything connects."""
    if name == "auto":
        return "ipc" if colocated else ("nccl" if device.type == "cuda" else "gloo")
    if name not in _REGISTRY:
        raise ValueError(f"refit.transport: {name!r} is not 'auto' or a registered transport {transport_names()}")
    return name


def open_transport(name: str, *, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                   num_train: int, device: torch.device | str = "cpu", namespace: str | None = None) -> Transport:
    """Join the refit group at ``host:port`` as refit rank ``rank`` over transport ``name``."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown transport {name!r}; registered: {transport_names()}")
    group = factory(host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s,
                    num_train=num_train, device=torch.device(device), namespace=namespace)
    if not isinstance(group, Transport):
        raise TypeError(f"transport {name!r} returned a {type(group).__name__}, not a Transport")
    return group


def _p2p(backend: str) -> TransportFactory:
    def factory(*, host, port, rank, world_size, timeout_s, num_train, device, namespace=None):
        return ProcessGroupTransport.connect(host=host, port=port, rank=rank, world_size=world_size, backend=backend,
                                  timeout_s=timeout_s, namespace=namespace)
    return factory


def _ipc(*, host, port, rank, world_size, timeout_s, num_train, device, namespace=None):
    from megatron_refit.transport.ipc import IpcTransport

    control = ProcessGroupTransport.connect(host=host, port=port, rank=rank, world_size=world_size, backend="gloo",
                                 timeout_s=timeout_s, namespace=namespace)
    return IpcTransport(control, num_train=num_train, device=device)


register_transport("gloo", _p2p("gloo"))
register_transport("nccl", _p2p("nccl"))
register_transport("ipc", _ipc)
