"""Hugging Face transformers receiver (the CPU reference engine, generation TP = 1).

Holds a transformers model built from the same config and writes every received piece in
place into its parameters. Checkpoint names map onto the model's storage: most are the
model's own parameter names; routed experts, which transformers 5 keeps fused per layer
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``), receive the
per-expert checkpoint names ``experts.<e>.{gate,up,down}_proj.weight`` as views into those
tensors (non-gated experts: ``experts.up_proj [E, I, H]``). The family table renames state-dict
names to checkpoint names (Nemotron-H: ``model.*`` -> ``backbone.*``) and lists tensors that
refits move as segments (Mamba ``in_proj#z`` …: row ranges of the parameter). Persistent
buffers that checkpoints carry (DeepSeek's router ``e_score_correction_bias``) are targets
too. A tied ``lm_head`` is not a target (it is the embedding).

With ``fp8=True`` the quantized weights arrive as FP8 data + ``weight_scale_inv`` (trainer-side
quantization) into staging buffers, and ``finalize()`` dequantizes them into the model: the
CPU reference for what an FP8 engine computes with.
"""

from __future__ import annotations

import torch

from megatron_refit import families
from megatron_refit.endpoint.fp8 import FP8_DTYPE, dequantize_blockwise
from megatron_refit.endpoint.storage import WeightsState
from megatron_refit.engines.segments import join_segments
from megatron_refit.plan.fp8_layout import fp8_specs, is_quantized, scale_name, scale_shape
from megatron_refit.plan.probe import by_length
from megatron_refit.plan.spec import ShardSpec, full_box


class HFStorage(WeightsState):
    """Storage over a transformers causal LM (all pieces whole: gen TP 1)."""

    def __init__(self, model: torch.nn.Module, *, fp8: bool = False, draft: torch.nn.Module | None = None):
        self.model = model
        self.draft = draft
        """The engine's speculative draft (:class:`~megatron_refit.engines.hf.draft.MTPDraft`, its
        weights received as the model's under their checkpoint names), or None."""
        # Parameters and persistent buffers (e.g. DeepSeek's router e_score_correction_bias).
        # Buffers transformers keeps in float32 whatever the model dtype (as from_pretrained
        # does; from_config does not) stay float32, as the trainer sends them.
        keep_fp32 = getattr(model, "_keep_in_fp32_modules_strict", None) or []
        for module in (model, draft) if draft is not None else (model,):
            for name, buf in module.named_buffers():
                if any(key in name.split(".") for key in keep_fp32):
                    buf.data = buf.data.float()
        self._views = self._live_views()
        self.live_buffers = not fp8
        """Where a refit writes (:meth:`buffer`) is what the engine serves after :meth:`finalize`
        (not under FP8: the received FP8 data is dequantized into it), so the refit's digests can
        be checked against the live weights (``Receiver.stale_live``)."""
        self.rebinds = 0
        """Targets re-resolved because the model re-allocated their storage (see :meth:`refresh_targets`)."""
        self._staged: dict[str, torch.Tensor] = {}
        """FP8 mode: received FP8 data and scales, by checkpoint name."""
        if fp8:
            for name, view in self._views.items():
                if is_quantized(name, tuple(view.shape)):
                    self._staged[name] = torch.empty(view.shape, dtype=FP8_DTYPE, device=view.device)
                    self._staged[scale_name(name)] = torch.empty(scale_shape(tuple(view.shape)), dtype=torch.float32,
                                                                 device=view.device)

    def _live_views(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the model's storage for it, from the model as it is now (or from
        ``params``, tensors under the model's state-dict names)."""
        views: dict[str, torch.Tensor] = {}
        params = self.tensors_by_name() if params is None else params
        config = self.model.config
        tied = getattr(config, "tie_word_embeddings", False)
        for model_name, param in params.items():
            if tied and model_name == "lm_head.weight":
                continue
            name = families.checkpoint_name(model_name, config)
            if name.endswith(".experts.gate_up_proj"):
                prefix = name.removesuffix(".gate_up_proj")
                half = param.shape[1] // 2
                for e in range(param.shape[0]):
                    views[f"{prefix}.{e}.gate_proj.weight"] = param.data[e, :half]
                    views[f"{prefix}.{e}.up_proj.weight"] = param.data[e, half:]
            elif name.endswith((".experts.down_proj", ".experts.up_proj")):  # up alone: non-gated experts
                prefix, proj = name.rsplit(".", 1)
                for e in range(param.shape[0]):
                    views[f"{prefix}.{e}.{proj}.weight"] = param.data[e]
            elif (segments := families.segment_rows(name, config)) is not None:
                start = 0
                for segment, rows in segments:
                    views[families.segment_name(name, segment)] = param.data.narrow(0, start, rows)
                    start += rows
                if start != param.shape[0]:
                    raise ValueError(f"HF receiver: {name} has {param.shape[0]} rows, its segments "
                                     f"{dict(segments)} add up to {start}")
            else:
                views[name] = param.data
        return views

    def tensors_by_name(self) -> dict[str, torch.Tensor]:
        """The model's parameters and persistent buffers by state-dict name, and the draft's (its
        names are the checkpoint's, ``model.layers.<N>.*``, past the model's layers)."""
        out = self.model.state_dict(keep_vars=True)
        if self.draft is not None:
            out.update(self.draft.state_dict(keep_vars=True))
        return out

    def refresh_targets(self) -> bool:
        """Before every refit (the receiver calls it): follow parameters the model re-allocated
        since ``prepare()`` (``model.to(...)``, offload / reload), so bytes land in the live
        model (True if any moved); a target whose shape or dtype changed is refused by name
        before any byte moves."""
        live = self._live_views()
        for name, old in self._views.items():
            new = live.get(name)
            if new is None or new.shape != old.shape or new.dtype != old.dtype:
                now = "gone" if new is None else f"{tuple(new.shape)} {new.dtype}"
                raise ValueError(f"HF receiver: model parameter {name} changed since prepare() "
                                 f"({tuple(old.shape)} {old.dtype} -> {now}); prepare a new refit plan")
        moved = sum(live[name].data_ptr() != old.data_ptr() for name, old in self._views.items())
        if moved:
            self._views = {name: live[name] for name in self._views}
            self.rebinds += moved
        return bool(moved)

    @classmethod
    def from_config(cls, hf_config, *, dtype: torch.dtype = torch.float32, fp8: bool = False,
                    device: str | torch.device = "cpu", draft: bool = False, **kwargs) -> HFStorage:
        """A receiver over a fresh model of ``hf_config``; ``draft``: with its MTP layers as a
        speculative draft (:class:`~megatron_refit.engines.hf.draft.MTPDraft`); ``kwargs`` go to
        the class (e.g. a staged receiver's ``budget_bytes``)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(device)
        model.eval()
        mtp = None
        if draft:
            from megatron_refit.engines.hf.draft import MTPDraft

            mtp = MTPDraft(model, hf_config).to(device=device, dtype=dtype).eval()
        return cls(model, fp8=fp8, draft=mtp, **kwargs)

    def target_specs(self) -> list[ShardSpec]:
        out = []
        for name, t in self._views.items():
            spec = ShardSpec(name=name, global_shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                             box=full_box(tuple(t.shape)))
            out += fp8_specs(spec) if name in self._staged else [spec]
        return out

    def buffer(self, name: str) -> torch.Tensor:
        return self._staged[name] if name in self._staged else self._views[name]

    def finalize(self) -> None:
        for name, view in self._views.items():
            if name in self._staged:
                view.copy_(dequantize_blockwise(self._staged[name], self._staged[scale_name(name)], dtype=view.dtype))

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Received weights under checkpoint (per-expert) names; FP8 mode: quantized weights
        as received (FP8 data and ``weight_scale_inv``)."""
        with self.serving:  # one version, also while a staged swap may run in another thread
            out = {name: t.detach().clone() for name, t in self._views.items() if name not in self._staged}
            out.update({name: t.clone() for name, t in self._staged.items()})
        return join_segments(out)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits of the received model. Refuses unless the last refit completed:
        the engine never serves half-updated weights."""
        return self.step(tokens)[0]

    @torch.no_grad()
    def score(self, sequences) -> list[list[float]] | dict:
        """The serving probe (``refit.verify_serving``) through this engine's forward: each
        sequence's ``log p(token t | tokens < t)`` for every token after the first (a float32
        log-softmax over the vocabulary). One batch per sequence length, all under one hold of
        :attr:`serving`: the whole probe is scored by one version, also while a staged swap waits.
        With a draft, ``{"logprobs": those, "draft": its}``: what the draft proposes from
        (:meth:`~megatron_refit.engines.hf.draft.MTPDraft.logprobs`, ``log p(token t + 2)``)."""
        out: list = [None] * len(sequences)
        drafted: list = [None] * len(sequences)
        with self.serving:
            for indices in by_length(sequences):
                tokens = torch.tensor([list(sequences[i]) for i in indices], dtype=torch.long)
                logits, hidden = self._forward(tokens, hidden=self.draft is not None)
                logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
                for i, row in zip(indices, logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1).tolist(),
                                  strict=True):
                    out[i] = row
                if self.draft is not None:  # from the same forward's final hidden states
                    for i, row in zip(indices, self.draft.logprobs(self.model, tokens, hidden).tolist(), strict=True):
                        drafted[i] = row
        return out if self.draft is None else {"logprobs": out, "draft": drafted}

    @torch.no_grad()
    def draft_acceptance(self, sequences, start: int) -> dict:
        """How well the draft guesses what this engine's model samples, on ``sequences`` (token
        lists, or a ``[batch, seq]`` tensor), one forward per sequence length: for each token at a
        position ``j >= start`` of a sequence, the draft's proposal for it (from the model's final
        hidden state at ``j - 2`` and the token at ``j - 1``) against the model's distribution for
        it (at ``j - 1``), scored by :func:`~megatron_refit.engines.hf.draft.acceptance` (neither
        needs the token at ``j`` itself). Returns ``{"expected"}``: the mean chance that speculative
        sampling at temperature 1 accepts one drafted token, ``"greedy"``: the share of positions
        where the draft's argmax is the model's, ``"positions"``: how many positions were averaged,
        and ``"version"``: the weights' version. Refuses an engine without a draft."""
        from megatron_refit.engines.hf.draft import acceptance

        if self.draft is None:
            raise RuntimeError("HF receiver: draft_acceptance needs the engine's speculative draft, and this "
                               "engine holds none (HFStorage.from_config(draft=True) for a model with MTP layers)")
        if start < 2 or not len(sequences) or any(len(sequence) <= start for sequence in sequences):
            raise ValueError(f"draft_acceptance: the draft proposes tokens from position 2 on, and start={start} "
                             f"must be a position of every sequence, one at least (lengths "
                             f"{sorted({len(sequence) for sequence in sequences})})")
        expected = greedy = 0.0
        count = 0
        with self.serving:
            self.wait_gate()  # as step(): a version under its serving check takes no traffic before its verdict
            for indices in by_length(sequences):
                tokens = torch.stack([torch.as_tensor(sequences[i], dtype=torch.long) for i in indices])
                logits, hidden = self._forward(tokens, hidden=True)
                drafted = self.draft.logits(self.model, tokens, hidden).cpu()  # [:, t]: the token at t + 2
                length = tokens.shape[1]
                each, agree = acceptance(logits[:, start - 1 : length - 1], drafted[:, start - 2 : length - 2])
                expected += float(each.sum())
                greedy += float(agree.sum())
                count += each.numel()
            version = self.weights_version
        return {"expected": expected / count, "greedy": greedy / count, "positions": count, "version": version}

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One forward pass: the logits and the version of the weights that produced them
        (the pass holds :attr:`serving`, so a swap waits for it and it sees one version; over a
        version under its serving check it waits for the verdict: :meth:`wait_gate`)."""
        with self.serving:
            self.wait_gate()  # a version under its serving check takes no traffic before its verdict
            return self._forward(tokens)[0], self.weights_version

    def _forward(self, tokens: torch.Tensor, *, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 logits of the received model for ``tokens``, on the CPU (the caller holds
        :attr:`serving`), and with ``hidden`` its final hidden states (after the final norm, on
        the model's device: what an MTP draft takes; the logits then are its output head's of them,
        as the causal LM's forward computes them); refuses unless the last refit completed."""
        self.require_ready("HF receiver")
        tokens = tokens.to(next(self.model.parameters()).device)
        if not hidden:
            return self.model(tokens).logits.float().cpu(), None
        states = self.model.model(tokens).last_hidden_state
        return self.model.lm_head(states).float().cpu(), states
