"""Megatron's own training wrapper and optimizer: DDP-wrapped chunks and the DistributedOptimizer.

What real Megatron training runs: every model chunk wrapped in
``megatron.core.distributed.DistributedDataParallel`` (contiguous param and grad buffers,
grads reduce-scattered over data parallelism) and ``get_megatron_optimizer`` with the
distributed optimizer (bf16 model params, fp32 main params and Adam state sharded over
data parallelism; after ``step()`` each rank's updated shard is all-gathered into every
replica's bf16 params, or, with ``overlap_param_gather``, at the next forward).

On a machine without CUDA both run over gloo with :func:`conversion.cpu_shim.cuda_calls_on_cpu`
around their construction and every step (with CUDA present it changes nothing).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from conversion.cpu_shim import cuda_calls_on_cpu
from conversion.testing.build import BuiltModel


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
