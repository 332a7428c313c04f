"""The forward (and backward) of a Megatron GPT model over one batch of token sequences, through
every pipeline stage and virtual stage, as Megatron's schedules run one microbatch, the same on
a GPU and on a host without CUDA (the serving check's reference, the CPU test harness).

- **Pipeline.** The model chunks run in Megatron's stage order: virtual stage 0 of every
  pipeline rank, then virtual stage 1, … (a rank holds one chunk per virtual stage, and stage
  ``(p, v)`` hands its output to ``(p + 1, v)``, the last rank's to ``(0, v + 1)``). Activations
  travel over the PP group with plain send / recv.
- **Sequence parallelism.** Between stages the activations are ``[seq / tp, batch, hidden]``
  (each TP rank's part of the sequence), and the sequence must split over TP.
- **Context parallelism.** Each CP rank runs its two of ``2 * cp`` chunks of every sequence
  (Megatron's load-balanced split: :mod:`conversion.context_parallel`); the outputs are
  gathered back into sequence order on every rank.

A batch whose length does not split as these need is padded at its end: under causal attention
the padding changes no earlier position, and its outputs are dropped. Megatron's own schedules
assume CUDA streams, and a few forward calls ask for the current CUDA device: :func:`cpu_forward`
answers them on a host (a no-op where CUDA exists).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from conversion.context_parallel import gather_positions, local_positions


@contextlib.contextmanager
def cpu_forward():
    """Run Megatron's forward on a machine without CUDA.

    The forward asks ``torch.cuda.current_device()`` (rotary embeddings, MoE router) and
    forks the CUDA RNG tracker around attention dropout; for the duration, the device
    answer is "cpu" and the fork is a no-op (the models here use no attention dropout). Under
    context parallelism the rotary embedding moves its CP positions to the GPU (pinned, then
    ``.cuda()``): they stay on the host."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from conversion.cpu_shim import cuda_to_host

    tracker = get_cuda_rng_tracker()
    saved_device, saved_fork = torch.cuda.current_device, tracker.fork
    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    try:
        with cuda_to_host() if cp > 1 else contextlib.nullcontext():
            yield
    finally:
        torch.cuda.current_device = saved_device
        tracker.fork = saved_fork


def causal_inputs(tokens: torch.Tensor, positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids, attention_mask)`` of a causal forward over ``tokens`` [batch, seq] at
    ``positions`` (default: 0..seq-1; Megatron's mask: True where attention is masked out)."""
    batch, seq = tokens.shape
    where = torch.arange(seq) if positions is None else torch.tensor(positions)
    position_ids = where.to(tokens.device).unsqueeze(0).expand(batch, -1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril().logical_not()
    return position_ids, causal.view(1, 1, seq, seq).expand(batch, 1, seq, seq)


@dataclass
class PipelinePass:
    """One batch through this rank's model chunks (:func:`pipeline_forward`)."""

    length: int
    """Tokens per sequence before padding."""
    positions: list[int]
    """The (padded) sequence positions this rank's CP part holds."""
    outputs: list = field(default_factory=list)
    """Each chunk's output (its activations, or the model's output on the last stage)."""
    inputs: list = field(default_factory=list)
    """Each chunk's input received from the previous stage (None on the first)."""
    next_tokens: torch.Tensor | None = None
    """Each of :attr:`positions`' next token ``[batch, local seq]`` (0 past the end)."""
    output: torch.Tensor | None = None
    """The model's output, on the rank that holds its last chunk: logits ``[batch, seq, vocab /
    tp]`` (or Megatron's per-token loss ``[batch, seq]`` with labels) at :attr:`positions`."""

    def valid(self) -> torch.Tensor:
        """Which of :attr:`positions` have a next token in the unpadded sequence (bool)."""
        return torch.tensor([p < self.length - 1 for p in self.positions])


def sequence_multiple(config) -> int:
    """What the sequence length must be a multiple of: ``2 * cp`` chunks, each split over TP
    under sequence parallelism."""
    cp = config.context_parallel_size
    return (2 * cp if cp > 1 else 1) * (config.tensor_model_parallel_size if config.sequence_parallel else 1)


def pipeline_forward(model: list, tokens: torch.Tensor, *, labels: torch.Tensor | None = None) -> PipelinePass:
    """This rank's part of the forward of ``tokens`` [batch, seq] through Megatron model chunks
    ``model`` (bare or wrapped: DDP, Float16Module), every stage feeding the same tokens (see the
    module docstring). ``labels``: Megatron's per-token loss instead of logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    config = get_model_config(model[0])
    device = next(model[0].parameters()).device
    length = tokens.shape[1]
    pad = -length % sequence_multiple(config)
    if pad:
        tokens = torch.nn.functional.pad(tokens, (0, pad))
        labels = None if labels is None else torch.nn.functional.pad(labels, (0, pad))
    cp = ps.get_context_parallel_world_size()
    positions = local_positions(tokens.shape[1], cp, ps.get_context_parallel_rank())
    index = torch.tensor(positions)
    next_tokens = torch.nn.functional.pad(tokens[:, 1:], (0, 1))[:, index].to(device)
    tokens = tokens[:, index].to(device)
    labels = None if labels is None else labels[:, index].to(device)
    position_ids, mask = causal_inputs(tokens, positions)
    seq = tokens.shape[1] // (config.tensor_model_parallel_size if config.sequence_parallel else 1)
    dtype = config.pipeline_dtype or config.params_dtype
    run = PipelinePass(length=length, positions=positions, next_tokens=next_tokens)
    for chunk in model:
        stage_input = None
        if not get_attr_wrapped_model(chunk, "pre_process"):
            stage_input = torch.empty(seq, tokens.shape[0], config.hidden_size, dtype=dtype, device=device)
            torch.distributed.recv(stage_input, ps.get_pipeline_model_parallel_prev_rank())
            stage_input.requires_grad_(torch.is_grad_enabled())
        get_attr_wrapped_model(chunk, "set_input_tensor")(stage_input)  # through a DDP wrapper too
        with cpu_forward():
            output = chunk(tokens, position_ids, mask, labels=labels)
        if get_attr_wrapped_model(chunk, "post_process"):
            run.output = output
        else:
            torch.distributed.send(output.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
        run.outputs.append(output)
        run.inputs.append(stage_input)
    return run


def pipeline_backward(model: list, run: PipelinePass, loss: torch.Tensor | None) -> None:
    """The backward of :func:`pipeline_forward` in reverse stage order: ``loss`` (a scalar on the
    rank that holds the last chunk, None elsewhere) back through every chunk, the gradients of
    the activations over the PP group."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    with cpu_forward():
        for chunk, output, stage_input in reversed(list(zip(model, run.outputs, run.inputs, strict=True))):
            if get_attr_wrapped_model(chunk, "post_process"):
                loss.backward()
            else:
                grad = torch.empty_like(output)
                torch.distributed.recv(grad, ps.get_pipeline_model_parallel_next_rank())
                output.backward(grad)
            if stage_input is not None:
                torch.distributed.send(stage_input.grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank())


def gather_sequence(x: torch.Tensor, run: PipelinePass) -> torch.Tensor:
    """Per-position values ``x`` [batch, local seq, …] of this CP rank in sequence order over the
    whole batch, the padding dropped (autograd-aware; a collective over the CP group)."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() > 1:
        x = gather_positions(x, 1, ps.get_context_parallel_group(), run.positions)
    return x[:, : run.length]


def last_rank_holds_output(model: list) -> bool:
    """Whether this rank holds the model's last chunk (its output: logits or loss)."""
    from megatron.core.utils import get_attr_wrapped_model

    return bool(get_attr_wrapped_model(model[-1], "post_process"))
