"""Megatron's own training wrapper and optimizer: DDP-wrapped chunks and the DistributedOptimizer.

What real Megatron training runs: every model chunk wrapped in
``megatron.core.distributed.DistributedDataParallel`` (contiguous param and grad buffers,
grads reduce-scattered over data parallelism) and ``get_megatron_optimizer`` with the
distributed optimizer (bf16 model params, fp32 main params and Adam state sharded over
data parallelism; after ``step()`` each rank's updated shard is all-gathered into every
replica's bf16 params, or, with ``overlap_param_gather``, at the next forward).

On a machine without CUDA both run over gloo with :func:`cuda_calls_on_cpu` around their
construction and every step: a few of their calls assume CUDA (the current device and
stream, ``device="cuda"`` factory calls, ``Tensor.type()`` checks for ``torch.cuda.*``).
With CUDA present it changes nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace

import torch

from .build import BuiltModel

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
    """``device="cuda"`` factory calls make host tensors, ``Tensor.cuda()`` keeps the tensor,
    ``Tensor.type()`` answers the CUDA type name Megatron's dtype checks compare against."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "cuda" in str(kwargs.get("device", "")):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[args[0].dtype]
        if getattr(func, "__self__", None) is _GRAD:  # Megatron reads .grad of non-leaf views: its warning,
            with warnings.catch_warnings():       # which would be attributed to this line, not to Megatron
                warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf")
                return func(*args, **kwargs)
        return func(*args, **kwargs)


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


def distributed_optimizer(built: BuiltModel, *, lr: float, overlap: bool = False,
                          clip_grad: float = 1.0) -> tuple[BuiltModel, object]:
    """``(built with DDP-wrapped chunks, Megatron's DistributedOptimizer)``: bf16 params with
    fp32 main params when the model is bf16; ``overlap``: overlapped grad reduce-scatter and
    param all-gather (the gather of a step then runs at the next forward)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = next(p for chunk in built.model for p in chunk.parameters()).dtype
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                                               bucket_size=4096 if overlap else None)
    with cuda_calls_on_cpu():
        chunks = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk)
                  for chunk in built.model]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                            use_distributed_optimizer=True, clip_grad=clip_grad), chunks)
    return replace(built, model=chunks), optimizer


def is_megatron_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)
