"""Megatron's DDP and optimizer calls that assume CUDA, run on a host without it.

A few of their calls assume CUDA (the current device and stream, ``device="cuda"`` factory
calls, ``Tensor.type()`` checks for ``torch.cuda.*``); :func:`cuda_calls_on_cpu` answers them on
the host over gloo. Where CUDA exists it changes nothing. The training callback wraps its
param sync in it (so the same callback runs in the CPU tests), the test builders their
construction and steps.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

_CUDA_TYPE_NAMES = {torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.float32: "torch.cuda.FloatTensor"}


class HostStream:
    """A CUDA stream on a host (``torch.cuda.current_stream()``, ``torch.cuda.Stream()``):
    every wait is already satisfied."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs) -> None:
        return None


_GRAD = torch.Tensor.grad
"""The ``.grad`` descriptor: a mode sees reads of it as calls of its ``__get__``."""


class _CudaToHost(torch.overrides.TorchFunctionMode):
    """``device="cuda"`` factory calls make host tensors (not pinned: that needs a driver),
    ``Tensor.cuda()`` keeps the tensor, ``Tensor.type()`` answers the CUDA type name Megatron's
    dtype checks compare against."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "cuda" in str(kwargs.get("device", "")):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[args[0].dtype]
        if getattr(func, "__self__", None) is _GRAD:  # Megatron reads .grad of non-leaf views: its warning,
            with warnings.catch_warnings():       # which would be attributed to this line, not to Megatron
                warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf")
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def cuda_to_host():
    """The mode of :func:`cuda_calls_on_cpu` alone (CUDA factory calls and ``.cuda()`` on the host)."""
    return _CudaToHost()


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """Megatron's DDP and optimizer on a machine without CUDA (a no-op where CUDA exists)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.current_stream
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: HostStream()
    try:
        with _CudaToHost():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.current_stream = saved
