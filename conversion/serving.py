"""The trainer model's own forward over the serving probe (``refit.verify_serving``): what every
replica's log-probs are compared with.

:func:`trainer_forward` wraps Megatron model chunks (bare or as Bridge's ``pretrain`` holds them:
DDP, Float16Module) in a :class:`MegatronForward`. Called on every train rank at once, it runs
the probe through the model as it is now (every pipeline stage, tensor- and expert-parallel as
the model trains) and returns each sequence's per-token log-probs on every rank, over the
Hugging Face vocabulary (Megatron's padded vocabulary rows are left out of the softmax, as an
engine serving the HF checkpoint has none).

Every parallel setting the model trains with takes part: pipeline stages and virtual stages in
Megatron's order, sequence parallelism between stages, context parallelism (each CP rank scores its
part of the probe, gathered back on every rank): :func:`conversion.forward.pipeline_forward`.

It must not change training: it runs under ``no_grad`` in eval mode (each chunk's mode is put
back), with the CPU and CUDA generators' states and Megatron's RNG tracker states restored, the
DDP forward pre-hooks of ``overlap_param_gather`` off (no param all-gather dispatched: the refit
ran after Bridge's ``force_param_sync``) and no optimizer or gradient buffer touched. Under
trainer-side FP8 (``refit.trainer_quantize_fp8``) each quantized linear weight computes with its
FP8 round trip, one layer at a time (what the engine holds), and is put back after.
"""

from __future__ import annotations

import contextlib
import re

import torch

from conversion.forward import cpu_forward, gather_sequence, last_rank_holds_output, pipeline_forward
from conversion.routing import RoutedExperts
from megatron_refit.plan.probe import by_length

QUANTIZED = re.compile(r"(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight\d*$")
"""Megatron linear weights whose HF pieces trainer-side FP8 quantizes (experts' too; the router,
embeddings, output layer and norms stay in the training dtype)."""


class MegatronForward:
    """The serving check's reference forward over Megatron model chunks (see the module docstring)."""

    def __init__(self, model: list, hf_config, *, lora: bool = False):
        from megatron.core.utils import get_model_config

        self.model = model
        self.config = get_model_config(model[0])
        self.vocab_size = hf_config.vocab_size
        self.dtype = str(next(model[0].parameters()).dtype).removeprefix("torch.")
        self.fp8, self.lora = False, lora
        self.routing = RoutedExperts(model, self.config)
        self.experts: tuple[int, int] | None = None
        """After a call, for a MoE model: ``(experts routed, experts)`` over its decoder MoE layers."""
        self.scale: list[list[float]] | None = None
        """After a call: per scored token, ``|its logit| + |the largest logit|``
        (:attr:`megatron_refit.plan.probe.Reference.scale`)."""
        self.routes: list[list[tuple[tuple[int, int], ...]]] | None = None
        """After a call, for a MoE model: per scored token, the (layer, expert) pairs its position was
        routed to (:attr:`megatron_refit.plan.probe.Reference.routes`); None for a dense model. Only
        a call sets it (:meth:`cover`'s forwards leave it as the last call's)."""
        self._moe_layers: torch.Tensor | None = None
        self.score_draft = False
        """``refit.gen_draft``: each call also scores the probe through the first MTP layer
        (:meth:`prepare`)."""
        self.draft: list[list[float]] | None = None
        """After a call with :attr:`score_draft`: per sequence, the first MTP layer's ``log p(token
        t + 2 | tokens <= t + 1)`` for t >= 0 (what the engine's speculative draft proposes from)."""
        self.draft_scale: list[list[float]] | None = None
        """Their logits' magnitudes, as :attr:`scale` is the model's."""

    def prepare(self, *, fp8: bool, draft: bool = False) -> None:
        """Before the first check: compute with FP8-rounded linear weights (``fp8``: the trainer
        quantizes what it sends); ``ValueError`` where the reference cannot run: FP8 that cannot
        match the engine's blocks, MTP layers on a stage of their own (a layout's ``mtp`` stage
        before the loss's: the hidden states it passes on carry the MTP outputs too). Decided from
        the model's config, the same on every train rank."""
        if getattr(self.config, "mtp_standalone", False):
            raise ValueError("refit.verify_serving: pipeline_model_parallel_layout puts the MTP layers on a stage "
                             "before the loss's (a standalone MTP stage), which the reference forward does not run")
        if draft and (not self.config.mtp_num_layers or self.config.context_parallel_size > 1):
            raise ValueError(f"refit.verify_serving with gen_draft: the reference scores the engine's draft through "
                             f"the trainer's first MTP layer, which needs mtp_num_layers >= 1 and no context "
                             f"parallelism; got mtp_num_layers={self.config.mtp_num_layers}, "
                             f"context_parallel_size={self.config.context_parallel_size}")
        self.fp8, self.score_draft = fp8, draft
        if fp8:
            kv_channels = self.config.kv_channels or self.config.hidden_size // self.config.num_attention_heads
            if kv_channels % 128:
                raise ValueError(f"refit.verify_serving with trainer_quantize_fp8: kv_channels={kv_channels} splits "
                                 "attention heads across 128-row FP8 blocks, so the reference forward cannot round "
                                 "Megatron's fused QKV weight as the engine's HF blocks are; set verify_serving: off")

    @torch.no_grad()
    def __call__(self, sequences) -> list[list[float]]:
        logprobs, seen, self.routes = self._run(sequences, routes=True)
        self.experts = None if seen is None else self._count(seen.any(dim=0))
        self.scale = [[m for _, m in row] for row in logprobs]
        return [[lp for lp, _ in row] for row in logprobs]

    @torch.no_grad()
    def cover(self, base, *, budget: int, seed: int = 0) -> tuple[tuple[int, ...], ...]:
        """``base`` (the probe's sequences) and, where they leave an expert of a MoE layer
        unrouted under the router as it is now, candidate sequences (a seeded sweep of the
        vocabulary in ``base``'s first length: :func:`~megatron_refit.plan.probe.sweep`) chosen
        greedily to route the most of the missing ones, at most ``budget`` tokens more
        (collective over the train ranks; the same answer on every one). A dense model: ``base``."""
        from megatron_refit.plan.probe import SWEEP_TOKENS, greedy_cover, sweep

        _, seen, _ = self._run(base)
        if seen is None:
            return tuple(base)
        moe = self._moe_layers
        missing = self._flat(~seen.any(dim=0) & moe[:, None])
        length = max(2, len(base[0]))
        candidates: list[tuple[int, ...]] = []
        gains: list[set] = []
        found: set = set()
        batch = max(1, 1024 // length)  # 1024 tokens a forward: its logits stay small at a 150k vocabulary
        pool = list(sweep(self.vocab_size, length, seed, SWEEP_TOKENS))
        for start in range(0, len(pool), batch):
            if not missing - found:
                break
            chunk = pool[start:start + batch]
            _, routed, _ = self._run(chunk, scored=False)
            for seq, row in zip(chunk, routed, strict=True):
                gain = self._flat(row & moe[:, None]) & missing
                if gain:
                    candidates.append(seq)
                    gains.append(gain)
                    found |= gain
        chosen = greedy_cover(missing, gains, [len(s) for s in candidates], budget)
        return tuple(base) + tuple(candidates[i] for i in chosen)

    def _run(self, sequences, *, scored: bool = True,
             routes: bool = False) -> tuple[list[list[float]] | None, torch.Tensor | None, list | None]:
        """Each sequence's log-probs (``scored``; else None) and, for a MoE model, the experts its
        tokens were routed to (``[sequences, layers, experts]`` bool,
        :meth:`conversion.routing.RoutedExperts.per_sequence`) and, with ``routes`` (a MoE model), each
        scored token's routes (:attr:`routes`; else None)."""
        out: list = [None] * len(sequences)
        drafted: list = [None] * len(sequences)
        seen = None
        per_token = [None] * len(sequences) if routes and self.routing.moe else None
        if self.routing.moe:
            seen = torch.zeros(len(sequences), self.routing.num_layers, self.routing.num_experts, dtype=torch.bool)
        with self._untouched(), (fp8_rounded_weights(self.model) if self.fp8 else contextlib.nullcontext()):
            for indices in by_length(sequences):
                tokens = torch.tensor([list(sequences[i]) for i in indices], dtype=torch.long)
                with self.routing.capture() if self.routing.moe else contextlib.nullcontext():
                    logprobs, run, draft = self._logprobs(tokens, scored=scored)
                for i, row in zip(indices, logprobs.tolist() if scored else [None] * len(indices), strict=True):
                    out[i] = row
                for i, row in zip(indices, draft.tolist() if draft is not None else [], strict=False):
                    drafted[i] = row
                if seen is not None:
                    routed, self._moe_layers = self.routing.per_sequence(run, len(indices))
                    seen[indices] = routed
                    if per_token is not None:
                        for i, row in zip(indices, self.routing.per_token(run, len(indices)), strict=True):
                            per_token[i] = row
        if scored and self.score_draft:
            self.draft = [[lp for lp, _ in row] for row in drafted]
            self.draft_scale = [[m for _, m in row] for row in drafted]
        return (out if scored else None), seen, per_token

    def _count(self, union: torch.Tensor) -> tuple[int, int]:
        """``(experts routed, experts)`` over the MoE layers of ``union`` ``[layers, experts]``."""
        moe = self._moe_layers
        return int(union[moe].sum()), int(moe.sum()) * self.routing.num_experts

    def _flat(self, mask: torch.Tensor) -> set:
        """``(layer, expert)`` pairs where ``mask`` ``[layers, experts]`` is True, as flat indices."""
        return set(torch.nonzero(mask.flatten()).flatten().tolist())

    def _logprobs(self, tokens: torch.Tensor, *, scored: bool = True):
        """``log p(tokens[:, t] | tokens[:, :t])`` for t >= 1 and the magnitude of its logits
        (:func:`_vocab_parallel_logprobs`), [batch, seq - 1, 2] (float32), on every rank
        (``scored``; else None: the forward alone), this rank's
        :class:`~conversion.forward.PipelinePass` and, under :attr:`score_draft`, the first MTP
        layer's log-probs of the token after the next, [batch, seq - 2, 2] (else None)."""
        from megatron.core import parallel_state as ps

        draft = self.score_draft and scored
        with mtp_logits() if draft else contextlib.nullcontext() as captured:
            run = pipeline_forward(self.model, tokens)
        if not scored:
            return None, run, None
        device = run.next_tokens.device
        result = torch.empty(tokens.shape[0], tokens.shape[1] - 1, 2, dtype=torch.float32, device=device)
        drafted = torch.empty(tokens.shape[0], max(0, tokens.shape[1] - 2), 2, dtype=torch.float32,
                              device=device) if draft else None
        if last_rank_holds_output(self.model):
            with cpu_forward():
                local = _vocab_parallel_logprobs(run.output, run.next_tokens, self.vocab_size)
                if draft:  # MTP layer 1 at position t: the token after the next
                    logits = captured[0].transpose(0, 1)
                    after = torch.nn.functional.pad(tokens[:, 2:], (0, logits.shape[1] - tokens.shape[1] + 2))
                    drafted.copy_(_vocab_parallel_logprobs(logits, after.to(device), self.vocab_size)[
                        :, : drafted.shape[1]])
            result.copy_(gather_sequence(local, run)[:, :-1])  # every CP rank the whole probe
        if ps.get_pipeline_model_parallel_world_size() > 1:  # every stage gets the last stage's answer
            for answer in (result, drafted) if draft else (result,):
                torch.distributed.broadcast(answer, ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
        return result.cpu(), run, None if drafted is None else drafted.cpu()

    @contextlib.contextmanager
    def _untouched(self):
        """Eval mode, the RNG states and DDP's forward pre-hooks, as training left them."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        tracker_states = tracker.get_states()
        modes = [chunk.training for chunk in self.model]
        hooked = [c for c in self.model if getattr(c, "use_forward_hook", False) and c.remove_forward_pre_hook_handles]
        for chunk in hooked:
            chunk.disable_forward_pre_hook(param_sync=False)
        for chunk in self.model:
            chunk.eval()
        try:
            yield
        finally:
            for chunk, mode in zip(self.model, modes, strict=True):
                chunk.train(mode)
            for chunk in hooked:
                chunk.enable_forward_pre_hook()
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            tracker.set_states(tracker_states)


@contextlib.contextmanager
def mtp_logits():
    """While it is open, the last stage's forward also keeps the first MTP layer's logits
    (``[seq, batch, vocab / tp]``, what Megatron's ``process_mtp_loss`` computes its loss from) in
    the list it yields: Megatron's own function is wrapped (and put back after), its output unchanged."""
    from megatron.core.models.gpt import gpt_model

    captured: list = []
    original = gpt_model.process_mtp_loss

    def keeping(hidden_states, *args, output_layer, output_weight, runtime_gather_output, config, **kwargs):
        first = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)[1]
        captured.append(output_layer(first, weight=output_weight, runtime_gather_output=runtime_gather_output)[0])
        return original(hidden_states, *args, output_layer=output_layer, output_weight=output_weight,
                        runtime_gather_output=runtime_gather_output, config=config, **kwargs)

    gpt_model.process_mtp_loss = keeping
    try:
        yield captured
    finally:
        gpt_model.process_mtp_loss = original


@contextlib.contextmanager
def fp8_rounded_weights(model: list):
    """While a module of ``model`` (Megatron chunks) runs, each of its linear weights that
    trainer-side FP8 quantizes holds its blockwise FP8 round trip ``dequantize(quantize(w))``: what
    an FP8 engine computes with. Their 128x128 blocks in Megatron's local layout are the HF
    tensors' blocks when every HF piece edge is on the 128 grid (the plan enforces it) and each
    attention head spans whole blocks (``kv_channels`` a multiple of 128: :meth:`MegatronForward.prepare`
    checks it). One weight at a time is rounded (the extra memory is one weight's copy); each is
    put back after its module ran, and all of them if a forward raises."""
    from megatron_refit.endpoint.fp8 import dequantize_blockwise, quantize_blockwise

    targets: dict[torch.nn.Module, list[str]] = {}
    for chunk in model:
        for module_name, module in chunk.named_modules():
            for name, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}"
                if param.dim() == 2 and QUANTIZED.search(full) and ".router." not in full:
                    targets.setdefault(module, []).append(name)
    saved: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # -> (param, its training value)

    @torch.no_grad()
    def before(module, _args):
        for name in targets[module]:
            param = getattr(module, name)
            saved[id(module), name] = param, param.detach().clone()
            param.copy_(dequantize_blockwise(*quantize_blockwise(param.detach()), dtype=param.dtype))

    @torch.no_grad()
    def restore(keys) -> None:
        for key in keys:
            param, original = saved.pop(key)
            param.copy_(original)

    def after(module, _args, _output):
        restore([(id(module), name) for name in targets[module]])

    handles = [h for m in targets for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        restore(list(saved))  # a forward that raised inside a module: its weights as training left them


def _vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``log_softmax(logits)[label]`` over the first ``vocab_size`` columns of vocab-parallel
    ``logits`` [batch, seq, vocab / TP] (each TP rank holds a contiguous slice) and the magnitude
    its error scales with, ``|logit of the label| + |largest logit|``: float32 [batch, seq, 2].
    One all-gather over TP: each rank's largest logit, its sum of ``exp(logit - that)`` and its
    label logit (a rank whose slice is all padding gives ``-inf``, 0 and 0: no NaN)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    width = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    logits = logits.float().clone()
    valid = max(0, min(width, vocab_size - start))
    logits[..., valid:] = -torch.inf  # Megatron's padding rows: no token of the HF vocabulary
    peak = logits.max(dim=-1).values
    anchor = torch.where(torch.isfinite(peak), peak, 0.0)
    sums = (logits - anchor.unsqueeze(-1)).exp().sum(dim=-1)
    local = labels - start
    mine = (local >= 0) & (local < valid)
    picked = torch.where(mine, logits.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    mine_stats = torch.stack([peak, sums, picked])
    ranks = [torch.empty_like(mine_stats) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(ranks, mine_stats, group=group)
    stats = torch.stack(ranks)  # [tp, 3, batch, seq]
    peak = stats[:, 0].max(dim=0).values
    sums = (stats[:, 1] * (stats[:, 0] - peak).exp()).sum(dim=0)  # exp(-inf - peak) = 0 on an all-padding rank
    picked = stats[:, 2].sum(dim=0)
    return torch.stack([picked - peak - sums.log(), picked.abs() + peak.abs()], dim=-1)


def trainer_forward(model: list, hf_config, *, lora: bool = False) -> MegatronForward:
    """The serving check's reference over Megatron model chunks built through Bridge (every train
    rank builds its own; calling it is collective over the train ranks). ``lora``: the chunks
    carry LoRA adapters (the tolerance allows for the engine's merge)."""
    return MegatronForward(model, hf_config, lora=lora)
