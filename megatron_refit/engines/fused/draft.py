"""An engine's speculative draft beside its model, as one refit target (``refit.gen_draft``, #67).

vLLM and SGLang hold the model's MTP layers in a draft model of their own (vLLM's
``DeepSeekMTP``, SGLang's NextN class), built and loaded beside the served model; both share the
target's embedding and LM head into it at load. The trainer sends the MTP layer ``N + i``
(``N = num_hidden_layers``) under its checkpoint names ``model.layers.<N + i>.*``, and the embedding
and the LM head once, to the main model. :class:`ModelWithDraft` is one parameter table over both
models under the checkpoint's names, which
:class:`~megatron_refit.engines.fused.live.LiveModelStorage` resolves like any model's (its fused
spellings included); each engine says how its draft spells a checkpoint name
(``checkpoint_name``). The draft is handed over after the plan is built (the engine's weight-update
path gives it to the refit): until then ``LiveModelStorage`` keeps placeholders for what
:meth:`ModelWithDraft.is_draft` names, and no refit starts without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SHARED = ("model.embed_tokens.weight", "lm_head.weight")
"""The target's parameters a draft shares (a tied model has the first only)."""


class ModelWithDraft:
    """The parameters a refit writes on one engine rank: ``model``'s, and once the engine handed
    its draft over (:meth:`hand_over`), the draft's own under their checkpoint names
    (``checkpoint_name(draft name)``: None for what the draft shares with the target)."""

    def __init__(self, model: torch.nn.Module, first_layer: int, checkpoint_name: Callable[[str], str | None],
                 engine: str):
        self.main = model
        self.first = first_layer
        """The first MTP layer's index (the main model's ``num_hidden_layers``)."""
        self.checkpoint_name = checkpoint_name
        self.engine = engine
        self.draft: torch.nn.Module | None = None

    def is_draft(self, name: str) -> bool:
        """Whether ``name`` (a checkpoint or layout name) is an MTP layer's (the draft's)."""
        match = _LAYER.match(name)
        return match is not None and int(match.group(1)) >= self.first

    def hand_over(self, draft: torch.nn.Module) -> None:
        """The engine's draft; ``ValueError`` naming a weight the draft holds a copy of where the
        checkpoint shares it (the refit sends the embedding and the LM head once, to the main
        model, so a copy would stay the first version's) or a draft with no MTP layer (another
        kind of draft, which the trainer does not train)."""
        params = dict(draft.named_parameters())
        if not any(self.checkpoint_name(name) is not None for name in params):
            raise ValueError(f"refit.gen_draft: {self.engine}'s draft {type(draft).__name__} holds no MTP layer "
                             f"(model.layers.{self.first}.*): a draft the trainer does not train (gen_draft: false "
                             "leaves it untouched)")
        main = dict(self.main.named_parameters())
        shared = {main[n].data_ptr() for n in SHARED if n in main}
        for name, param in params.items():
            if self.checkpoint_name(name) is None and param.data_ptr() not in shared:
                raise ValueError(f"refit.gen_draft: {self.engine}'s draft holds its own {name}, not the main model's; "
                                 "the refit sends the embedding and the LM head once, to the main model (the "
                                 "engine shares them into an MTP draft when it loads it)")
        self.draft = draft

    def named_parameters(self):
        """The main model's parameters, then the draft's own under their checkpoint names."""
        yield from self.main.named_parameters()
        if self.draft is None:
            return
        for name, param in self.draft.named_parameters():
            hf = self.checkpoint_name(name)
            if hf is not None:
                yield hf, param
