"""The HF engine's speculative draft: a DeepSeek-V3-style model's multi-token-prediction (MTP)
layers, the weights an engine decoding with ``deepseek_mtp`` (vLLM) or NextN (SGLang) drafts with.

transformers builds the main model only (it drops ``model.layers.<N>.*`` of a checkpoint, ``N =
num_hidden_layers``), so :class:`MTPDraft` holds the MTP layers beside it under their checkpoint
names, as Megatron-Bridge exports them: per MTP layer ``i`` at index ``N + i`` a full decoder layer
of the model's own class (MoE where the model's later layers are), its ``enorm`` (the next token's
embedding) and ``hnorm`` (the main model's hidden state) RMSNorms, ``eh_proj`` (``[hidden, 2 x
hidden]``, their concatenation projected back) and ``shared_head.norm``. The embedding and the
output head are the main model's (the checkpoint's per-layer copies are the same tensors): the
refit sends them once, to the main model.

:func:`acceptance` is the draft's expected acceptance under speculative (rejection) sampling, the
figure a speculating engine reports as accepted / drafted tokens: the HF engine does not speculate,
so it computes it from the same forward's distributions (``HFStorage.draft_acceptance``).
"""

from __future__ import annotations

import torch

MTP_LAYERS_FIELD = "num_nextn_predict_layers"
"""The HF config field that counts a model's MTP layers (DeepSeek-V3, GLM-4.5, MiMo)."""


def mtp_layers(hf_config) -> int:
    """How many MTP layers ``hf_config`` declares (0: none)."""
    return int(getattr(hf_config, MTP_LAYERS_FIELD, 0) or 0)


def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, the chance that one drafted token is accepted: ``target_logits`` and
    ``draft_logits`` (``[..., vocab]``) give the target's distribution ``p`` and the draft's ``q``
    for the same token. Speculative sampling at temperature 1 accepts a draft ``x ~ q`` with
    probability ``min(1, p(x) / q(x))``, in expectation ``sum_x min(p(x), q(x))`` (one minus their
    total variation distance): the first tensor, float32 ``[...]`` in [0, 1]. The second: greedy
    decoding's, 1.0 where ``argmax q == argmax p``, else 0.0."""
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    expected = torch.minimum(logp, logq).exp().sum(-1).clamp(max=1.0)  # min of the logs: log of the min
    greedy = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    return expected, greedy


class MTPDraft(torch.nn.Module):
    """The MTP layers of ``model`` (a transformers causal LM of ``hf_config``), as
    ``self.model.layers[str(N + i)]``: their ``state_dict`` names are the checkpoint's."""

    def __init__(self, model: torch.nn.Module, hf_config):
        super().__init__()
        count = mtp_layers(hf_config)
        if count < 1:
            raise ValueError(f"an MTP draft needs the model's MTP layers: {type(hf_config).__name__}."
                             f"{MTP_LAYERS_FIELD} is {getattr(hf_config, MTP_LAYERS_FIELD, None)!r}")
        decoder = getattr(getattr(model, "model", None), "layers", None)
        if not decoder:
            raise ValueError(f"an MTP draft is built beside a decoder model (model.model.layers); "
                             f"{type(model).__name__} has none")
        layer_class, norm_class = type(decoder[-1]), type(model.model.norm)
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        first = hf_config.num_hidden_layers
        layers = {}
        for index in range(first, first + count):
            layer = layer_class(hf_config, index)
            layer.enorm = norm_class(hidden, eps=eps)
            layer.hnorm = norm_class(hidden, eps=eps)
            layer.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
            layer.shared_head = torch.nn.Module()
            layer.shared_head.norm = norm_class(hidden, eps=eps)
            layers[str(index)] = layer
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleDict(layers)
        self.first = first
        """The first MTP layer's index (the main model's ``num_hidden_layers``)."""

    @torch.no_grad()
    def logits(self, model: torch.nn.Module, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """What the draft proposes, as the trainer's MTP layer computes it: at each position t, the
        first MTP layer takes the main model's final hidden state (after its norm: ``hidden``,
        ``[batch, seq, hidden]``) and the next token's embedding, and predicts the token after it
        (position t + 2): float32 logits ``[batch, seq - 1, vocab]`` on ``hidden``'s device (the last
        position's proposal lies past ``tokens``). ``model``: the main model this draft belongs to
        (its embedding, rotary embedding and output head)."""
        from transformers.masking_utils import create_causal_mask

        inner = model.model
        tokens = tokens.to(hidden.device)
        layer = self.model.layers[str(self.first)]
        x = layer.eh_proj(torch.cat([layer.enorm(inner.embed_tokens(tokens[:, 1:])), layer.hnorm(hidden[:, :-1])], -1))
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        mask = create_causal_mask(config=inner.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)
        x = layer(x, attention_mask=mask, position_embeddings=inner.rotary_emb(x, position_ids=positions),
                  position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        return model.lm_head(layer.shared_head.norm(x)).float()

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's log-prob of each token it proposes inside ``tokens`` (:meth:`logits`):
        ``log p(tokens[:, t + 2])``, float32 ``[batch, seq - 2]`` on the CPU."""
        logits = self.logits(model, tokens, hidden)[:, :-1]
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 2:, None].to(logits.device)).squeeze(-1).cpu()
