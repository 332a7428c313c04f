"""The role of each HF parameter in tensor-parallel sharding (pure): decided by the family
tables' rules (:mod:`megatron_refit.families`) on the last components of its name.

``gen_layout`` shards by role; trainer-side FP8 (:func:`megatron_refit.plan.fp8_layout.is_quantized`)
and the LoRA receiver (:func:`is_adapted`) select parameters by role, through the family whose
rule named the parameter.
"""

from __future__ import annotations

import re

from megatron_refit import families

EXPERT_RE = families.expert_re()
"""A routed expert's parameter; group ``expert``: its index."""
MTP_PROJECTION = re.compile(r"(?:^|\.)eh_proj\.weight$")
"""An MTP layer's projection of [the next token's embedding, the hidden state] back to the hidden
size: a plain ``nn.Linear`` in the engines' drafts (vLLM's ``DeepSeekMTP``, SGLang's NextN), whole
on every engine rank."""


def _classify(name: str, ndim: int) -> tuple[families.ModelFamily | None, str]:
    found = families.classify(name)
    if found is not None:
        return found
    if ndim <= 1 or MTP_PROJECTION.search(name):
        return None, "replicated"
    raise ValueError(f"no vLLM sharding rule for parameter {name!r} ({ndim} dims)")


def param_role(name: str, ndim: int) -> str:
    """Sharding role of HF parameter ``name``; ``ValueError`` for an unknown tensor of 2+ dims."""
    return _classify(name, ndim)[1]


def is_quantized_role(name: str) -> bool:
    """True if trainer-side FP8 quantizes 2-D weight ``name`` in its family (``ValueError``
    for an unknown name)."""
    family, role = _classify(name, 2)
    return family is not None and role in family.quantized_roles


def is_adapted(name: str) -> bool:
    """True if LoRA adapts 2-D weight ``name`` in its family (``ValueError`` for an unknown name)."""
    family, role = _classify(name, 2)
    return family is not None and role in family.adapted_roles
