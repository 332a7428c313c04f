"""One pipeline stage's forward of a Megatron GPT model on a batch of token sequences, the same
on a GPU and on a host without CUDA (the serving check's reference, the CPU test harness).

Activations travel between pipeline stages over the PP group with plain send / recv (one
microbatch, one model chunk); every stage feeds the same tokens. Megatron's own schedules
assume CUDA streams, and a few forward calls ask for the current CUDA device:
:func:`cpu_forward` answers them on a host (a no-op where CUDA exists).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def cpu_forward():
    """Run Megatron's forward on a machine without CUDA.

    The forward asks ``torch.cuda.current_device()`` (rotary embeddings, MoE router) and
    forks the CUDA RNG tracker around attention dropout; for the duration, the device
    answer is "cpu" and the fork is a no-op (the models here use no attention dropout)."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved_device, saved_fork = torch.cuda.current_device, tracker.fork
    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device
        tracker.fork = saved_fork


def causal_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids, attention_mask)`` of a causal forward over ``tokens`` [batch, seq]
    (Megatron's mask: True where attention is masked out)."""
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, -1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril().logical_not()
    return position_ids, causal.view(1, 1, seq, seq).expand(batch, 1, seq, seq)


def stage_forward(chunk, tokens: torch.Tensor, *, hidden_size: int, dtype: torch.dtype,
                  labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This pipeline stage's forward of ``tokens`` [batch, seq] through model chunk ``chunk`` (a
    GPT model, bare or wrapped: DDP, Float16Module): receives its input from the previous stage,
    sends its output to the next. Returns ``(output, stage_input)``: the last stage's output is
    the logits [batch, seq, vocab / TP] (or Megatron's per-token loss with ``labels``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    tokens = tokens.to(next(chunk.parameters()).device)  # a model on a GPU computes there
    position_ids, mask = causal_inputs(tokens)
    stage_input = None
    if not ps.is_pipeline_first_stage():
        stage_input = torch.empty(tokens.shape[1], tokens.shape[0], hidden_size, dtype=dtype, device=tokens.device)
        torch.distributed.recv(stage_input, ps.get_pipeline_model_parallel_prev_rank())
        stage_input.requires_grad_(torch.is_grad_enabled())
    get_attr_wrapped_model(chunk, "set_input_tensor")(stage_input)  # through a DDP wrapper too
    with cpu_forward():
        output = chunk(tokens, position_ids, mask, labels=labels)
    if not ps.is_pipeline_last_stage():
        torch.distributed.send(output.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
    return output, stage_input
