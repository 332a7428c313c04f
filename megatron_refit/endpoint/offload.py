"""Trainer parameters offloaded to host memory between steps, loaded back around a refit.

``ParamOffloader.offload()`` copies every parameter's data to host memory (pinned when the
parameters live on a GPU) and leaves the parameter holding an empty tensor on its device,
so the device memory is free for the engine; ``onload()`` restores it. The parameter
objects themselves stay (the optimizer and the refit's local shards hold them), only their
``.data`` changes. A :class:`~megatron_refit.endpoint.sender.Refitter` given an offloader loads the
parameters before a refit if they are offloaded and offloads them again afterwards, and
reports both durations (exactly 0.0 when nothing had to move).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class ParamOffloader:
    """Moves the data of ``params`` between their device and host memory."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = list(params)
        if not self.params:
            raise ValueError("ParamOffloader needs at least one parameter")
        self._host: list[torch.Tensor] | None = None
        self._devices = [p.device for p in self.params]

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def offload(self) -> None:
        """Parameters' data to host memory; each parameter keeps an empty tensor."""
        if self.offloaded:
            raise RuntimeError("parameters are already offloaded")
        host = []
        with torch.no_grad():
            for p in self.params:
                copy = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda)
                copy.copy_(p.data, non_blocking=p.is_cuda)
                host.append(copy)
            if any(p.is_cuda for p in self.params):
                torch.cuda.synchronize()
            for p in self.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._host = host

    def onload(self) -> None:
        """Parameters' data back on their devices."""
        if not self.offloaded:
            raise RuntimeError("parameters are not offloaded")
        with torch.no_grad():
            for p, host, device in zip(self.params, self._host, self._devices):
                p.data = host.to(device, non_blocking=host.is_pinned())
            if any(d.type == "cuda" for d in self._devices):
                torch.cuda.synchronize()
        self._host = None
