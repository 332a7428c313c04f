"""A real training step and a reference forward for the CPU harness (every parallel setting of
:class:`~megatron_refit.plan.layout.TrainLayout`).

Pipeline stages and virtual stages run in Megatron's order, exchanging activations and gradients
over the PP group with plain send/recv (one microbatch: :func:`conversion.forward.pipeline_forward`);
under context parallelism each CP rank runs its part of every sequence. Every rank feeds the
same tokens, so data-parallel replicas stay identical without a gradient all-reduce. The model
runs in eval mode: dropout is off in these models anyway, and MoE with TP refuses train mode
without sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from conversion.forward import (cpu_forward, gather_sequence, last_rank_holds_output, pipeline_backward,
                               pipeline_forward)
from conversion.testing.build import BuiltModel


def next_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """The label of every position: the token after it (the last position's label, its own
    first token, is left out of the loss)."""
    return torch.roll(tokens, -1, dims=1)


def _pipeline_forward(built: BuiltModel, tokens: torch.Tensor, *, labels: bool):
    """This rank's forward (:func:`conversion.forward.pipeline_forward`) in eval mode."""
    for chunk in built.model:
        chunk.eval()
    return pipeline_forward(built.model, tokens, labels=next_tokens(tokens) if labels else None)


def train_step(built: BuiltModel, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float | None:
    """Forward + backward + one optimizer step: a ``torch.optim`` optimizer over bare chunks,
    or Megatron's (:func:`~conversion.testing.megatron_optim.distributed_optimizer`: DDP-wrapped chunks,
    Megatron's ``finalize_model_grads``). The loss is Megatron's next-token loss on
    ``tokens``, or ``loss_fn(full-vocab logits [batch, seq, vocab])`` (e.g. a policy-gradient
    loss; the logits are gathered over TP with autograd). Returns the loss on the last
    pipeline stage, None elsewhere."""
    from conversion.cpu_shim import cuda_calls_on_cpu
    from conversion.testing.megatron_optim import is_megatron_optimizer

    if is_megatron_optimizer(optimizer):  # DDP-wrapped chunks and Megatron's optimizer
        with cuda_calls_on_cpu():
            return _step(built, optimizer, tokens, loss_fn, megatron=True)
    return _step(built, optimizer, tokens, loss_fn, megatron=False)


def _step(built: BuiltModel, optimizer, tokens: torch.Tensor, loss_fn, *, megatron: bool) -> float | None:
    if megatron:
        for chunk in built.model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=True)
    run = _pipeline_forward(built, tokens, labels=loss_fn is None)
    loss = None
    if last_rank_holds_output(built.model):
        with cpu_forward():
            if loss_fn is None:  # Megatron's per-token loss [batch, seq]; the last position has no next token
                loss = run.output[:, run.valid().to(run.output.device)].float().mean()
            else:
                loss = loss_fn(_full_logits(built, run))
    pipeline_backward(built.model, run, loss)
    if megatron:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(built.model)  # Megatron's: DP reduce-scatter, TP-replicated grads
        optimizer.step()
    else:
        _finalize_grads(built)
        optimizer.step()
    _update_expert_bias(built)
    return float(loss.detach()) if loss is not None else None


def _finalize_grads(built: BuiltModel) -> None:
    """The gradient reductions of Megatron's ``finalize_model_grads`` (no DDP wrapper here),
    so that every replica applies one identical update:

    - average over the data-parallel group with the context-parallel ranks (expert params: the
      expert-data-parallel group, which holds them too);
    - QK layernorms: sum over TP (each TP rank normalises only its own heads);
    - other TP-replicated params (norms, router): average over TP. Megatron gets the same
      effect from sequence parallelism, which MoE+TP training requires; without it the
      MoE dispatch sums in a rank-dependent order and replicas drift by an ulp."""
    from megatron.core import parallel_state as ps

    dense_dp = ps.get_data_parallel_group(with_context_parallel=True)
    expert_dp = ps.get_expert_data_parallel_group()
    tp = ps.get_tensor_model_parallel_group()
    for chunk in built.model:
        for name, param in chunk.named_parameters():
            if param.grad is None:
                continue
            dp = dense_dp if getattr(param, "allreduce", True) else expert_dp
            if dp.size() > 1:
                torch.distributed.all_reduce(param.grad, group=dp)
                param.grad /= dp.size()
            if tp.size() > 1 and not getattr(param, "tensor_model_parallel", False) and dp is dense_dp:
                torch.distributed.all_reduce(param.grad, group=tp)
                if not ("q_layernorm" in name or "k_layernorm" in name):
                    param.grad /= tp.size()
    _sync_shared_embedding(built)


def _sync_shared_embedding(built: BuiltModel) -> None:
    """As Megatron's ``_allreduce_word_embedding_grads``: a word embedding held on two pipeline
    stages (tied to the output layer, or the MTP layers' on the last stage) has its gradients summed
    over the embedding group, so both copies take one update."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    group = ps.get_embedding_group(check_initialized=False)
    if group is None or group.size() <= 1 or torch.distributed.get_rank() not in \
            torch.distributed.get_process_group_ranks(group):
        return
    chunk = built.model[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else built.model[-1]
    if not (get_attr_wrapped_model(chunk, "share_embeddings_and_output_weights")
            or getattr(get_model_config(chunk), "mtp_num_layers", 0)):
        return
    weight = get_attr_wrapped_model(chunk, "shared_embedding_or_output_weight")()
    if weight is not None and weight.grad is not None:
        torch.distributed.all_reduce(weight.grad, group=group)


@torch.no_grad()
def _update_expert_bias(built: BuiltModel) -> None:
    """The aux-loss-free router bias update of Megatron's ``finalize_model_grads``
    (DeepSeek-V3's ``e_score_correction_bias``): ``bias += rate * sign(mean - tokens)`` from
    the tokens routed in this step. Megatron's ``_update_router_expert_bias`` skips modules
    in eval mode, which this step runs in (see the module docstring), so its loop is done
    here with Megatron's ``get_updated_expert_bias``."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    routers = [m for chunk in built.model for m in chunk.modules() if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    tokens = torch.stack([r.local_tokens_per_expert for r in routers])
    bias = torch.stack([r.expert_bias for r in routers])
    updated = get_updated_expert_bias(tokens, bias, built.config.moe_router_bias_update_rate)
    for router, new_bias in zip(routers, updated, strict=True):
        router.expert_bias.copy_(new_bias)
        router.local_tokens_per_expert.zero_()


@torch.no_grad()
def forward_logits(built: BuiltModel, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits ``[batch, seq, vocab]`` on the last pipeline stage (None elsewhere);
    HF vocab (Megatron's padding rows dropped)."""
    run = _pipeline_forward(built, tokens, labels=False)
    if not last_rank_holds_output(built.model):
        return None
    with cpu_forward():
        return _full_logits(built, run).float().cpu().clone()


def _full_logits(built: BuiltModel, run) -> torch.Tensor:
    """Vocab-parallel logits gathered over TP and CP (autograd-aware), in sequence order,
    Megatron's padding rows and the batch's padding dropped."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits = gather_from_tensor_model_parallel_region(run.output)[..., : built.hf_config.vocab_size]
    return gather_sequence(logits, run)


@torch.no_grad()
def greedy_decode(built: BuiltModel, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's own greedy continuation of ``prompt``: ``new_tokens`` token ids (a full
    forward per token; every rank of the model-parallel group calls it and gets them)."""
    from megatron.core import parallel_state as ps

    tokens = list(prompt)
    for _ in range(new_tokens):
        logits = forward_logits(built, torch.tensor([tokens]))
        last = torch.zeros(1, dtype=torch.long)
        if logits is not None:
            last[0] = logits[0, -1].argmax()
        if ps.get_pipeline_model_parallel_world_size() > 1:  # every stage feeds the same tokens
            torch.distributed.broadcast(last, ps.get_pipeline_model_parallel_last_rank(),
                                        group=ps.get_pipeline_model_parallel_group())
        tokens.append(int(last[0]))
    return tokens[len(prompt):]
