"""A vLLM worker's engine rank in the refit, from vLLM's parallel state (imports no vLLM).

A **MoE** model served at ``--data-parallel-size D`` is one deployment: vLLM spreads its experts
(expert-parallel, or MoE-tensor-parallel) over all ``D * T`` ranks, flattened ``dp_rank * T +
tp_rank``; the ``refit:`` section names it with ``gen_attention_dp: D``, and the engine's
``init_info.replica`` says which of the ``gen_dp`` deployments it is (default 0). A **dense**
model's data-parallel ranks are independent replicas: each is replica ``data_parallel_index``.
"""

from __future__ import annotations

from collections.abc import Callable


def engine_rank(cfg, parallel, *, replica: int | None, tp_rank: Callable[[], int], moe: bool) -> int:
    """``replica * replica_size + dp_rank * gen_tp + tp_rank()`` for ``cfg`` (the trainer's
    ``RefitConfig``) and ``parallel`` (vLLM's ``ParallelConfig``); ``ValueError`` naming the field
    where they disagree, before ``tp_rank`` (vLLM's group, set up by then) is asked."""
    if cfg.engine != "vllm":
        raise ValueError(f"init_info.refit.engine is {cfg.engine!r}, but this is vLLM's megatron_refit engine")
    if parallel.tensor_parallel_size != cfg.gen_tp:
        raise ValueError(f"init_info.refit.gen_tp={cfg.gen_tp}, but this vLLM engine runs "
                         f"tensor_parallel_size={parallel.tensor_parallel_size}")
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(f"megatron_refit needs vLLM pipeline_parallel_size 1, got {parallel.pipeline_parallel_size}")
    if bool(parallel.enable_expert_parallel) != cfg.gen_expert_parallel:
        raise ValueError(f"init_info.refit.gen_expert_parallel={cfg.gen_expert_parallel}, but this vLLM engine "
                         f"runs enable_expert_parallel={parallel.enable_expert_parallel}")
    dp = parallel.data_parallel_size
    if dp > 1 and moe:
        if cfg.gen_attention_dp != dp:
            raise ValueError(f"init_info.refit.gen_attention_dp={cfg.gen_attention_dp}, but this vLLM engine runs a "
                             f"MoE model at data_parallel_size={dp}: one deployment of its data-parallel ranks "
                             "(set gen_attention_dp to it)")
        replica = 0 if replica is None else replica
        return replica * cfg.replica_size + parallel.data_parallel_rank * cfg.gen_tp + tp_rank()
    if cfg.gen_attention_dp != 1:
        raise ValueError(f"init_info.refit.gen_attention_dp={cfg.gen_attention_dp}, but this vLLM engine runs "
                         f"data_parallel_size={dp} of a {'MoE' if moe else 'dense'} model (a dense model's "
                         "data-parallel ranks are replicas: gen_dp)")
    if replica is not None:
        if dp > 1:
            raise ValueError(f"init_info.replica={replica} is for independent engines; this one runs vLLM "
                             f"data_parallel_size={dp} and takes its replica from vLLM")
    else:
        replica = parallel.data_parallel_index
    return replica * cfg.replica_size + tp_rank()
