"""Model families: one table each (:class:`~megatron_refit.families.base.ModelFamily`), and
the questions the rest of the code asks them. Adding a family is one module here (plus, if
Bridge's local layer spec cannot build it on CPU, its build hooks under ``conversion/``)
and one line in :data:`FAMILIES`."""

from __future__ import annotations

import re
from functools import cache

from megatron_refit.families import deepseek_v3, llama, nemotron_h, qwen3
from megatron_refit.families.base import SEGMENT_MARK, ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (qwen3.FAMILY, llama.FAMILY, deepseek_v3.FAMILY, nemotron_h.FAMILY)

PRESETS: dict[str, dict] = {name: fields for f in FAMILIES for name, fields in f.presets.items()}
"""Every family's presets by name."""


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_param(name: str, num_hidden_layers: int) -> bool:
    """Whether HF parameter ``name`` is in a multi-token-prediction layer: DeepSeek-V3's MTP
    layers follow the decoder layers (``model.layers.<N>.`` with ``N >= num_hidden_layers``)."""
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= num_hidden_layers


def by_architecture(arch: str) -> ModelFamily:
    """The family of an HF architecture; ``ValueError`` naming it and the supported ones."""
    for f in FAMILIES:
        if arch in f.architectures:
            return f
    supported = sorted(a for f in FAMILIES for a in f.architectures)
    raise ValueError(f"unsupported architecture {arch!r}; supported: {supported}")


def of_config(hf_config) -> ModelFamily:
    """The family of an HF config: by its first architecture, else by its config class."""
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch is None:
        for f in FAMILIES:
            if type(hf_config).__name__ in f.architectures.values():
                return f
    return by_architecture(arch)


@cache
def role_rules() -> tuple[tuple[ModelFamily, str, re.Pattern[str]], ...]:
    """Every family's ``(family, role, pattern)`` in table order."""
    return tuple((f, role, re.compile(pattern)) for f in FAMILIES for role, pattern in f.roles)


@cache
def expert_re() -> re.Pattern[str]:
    """A routed expert's parameter, any family; group ``expert``: its index."""
    prefixes = "|".join(sorted({f.expert_prefix for f in FAMILIES}))
    return re.compile(rf"(?:^|\.)(?:{prefixes})\.(?P<expert>\d+)\.")


_INDEX = re.compile(r"\.\d+(?=\.)")


def classify(name: str) -> tuple[ModelFamily, str] | None:
    """The family and role of the first rule that names HF parameter ``name``. No rule names a
    layer or an expert by its index, so names that differ only there are classified once."""
    return _classify(_INDEX.sub(".0", name))


@cache
def _classify(name: str) -> tuple[ModelFamily, str] | None:
    for f, role, pattern in role_rules():
        if pattern.search(name):
            return f, role
    return None


@cache
def _segment_rules() -> tuple:
    return tuple((re.compile(pattern), order, rows) for f in FAMILIES for pattern, order, rows in f.segments)


def segment_order(name: str) -> tuple[str, ...] | None:
    """The segments HF tensor ``name`` is a concatenation of (along dim 0, in order), or None
    (see :attr:`ModelFamily.segments`)."""
    for pattern, order, _ in _segment_rules():
        if pattern.fullmatch(name):
            return order
    return None


def segment_rows(name: str, hf_config) -> tuple[tuple[str, int], ...] | None:
    """``((segment, rows), ...)`` in order if HF tensor ``name`` is a concatenation of
    segments, else None."""
    for pattern, order, rows in _segment_rules():
        if pattern.fullmatch(name):
            return tuple(zip(order, rows(hf_config), strict=True))
    return None


def checkpoint_name(model_name: str, hf_config) -> str:
    """A transformers state-dict name as the checkpoint spells it."""
    for pattern, replacement in of_config(hf_config).checkpoint_renames:
        model_name = re.sub(pattern, replacement, model_name)
    return model_name


def segment_name(name: str, segment: str) -> str:
    return f"{name}{SEGMENT_MARK}{segment}"


def split_segment(name: str) -> tuple[str, str | None]:
    """``(HF tensor name, segment)`` of a refit name (segment None for a whole tensor)."""
    base, mark, segment = name.partition(SEGMENT_MARK)
    return (base, segment) if mark else (name, None)


@cache
def _compiled_engine(family_name: str) -> tuple:
    family = next(f for f in FAMILIES if f.name == family_name)
    return (re.compile(family.engine_experts),
            tuple((re.compile(p), template, order) for p, template, order in family.engine_fused))


def engine_group(name: str) -> tuple[str, re.Match[str], tuple[str, ...] | None] | None:
    """How the engine stacks HF piece ``name``, by the rules of the family that names it:
    ``("experts", match, None)`` for a routed expert's weight (FusedMoE; groups p, e, m, t),
    ``(template, match, order)`` for a member of a fused projection (groups p, m, t), or None."""
    found = classify(name.removesuffix("_scale_inv"))  # FP8 scale tiles stack like their weights
    if found is None:
        return None
    experts, fused = _compiled_engine(found[0].name)
    if m := experts.fullmatch(name):
        return "experts", m, None
    for pattern, template, order in fused:
        if m := pattern.fullmatch(name):
            return template, m, order
    return None


@cache
def _engine_rules() -> tuple:
    renames = tuple(dict.fromkeys((re.compile(p), r) for f in FAMILIES for p, r in f.engine_renames))
    transforms = tuple((re.compile(p), r, t) for f in FAMILIES for p, r, t in f.engine_transforms)
    return renames, transforms


def engine_name(name: str) -> tuple[str, str | None]:
    """``(engine name, transform)`` of an HF (or fused) name: the family's renames, then a
    parameter the engine stores transformed (``transform``: see :attr:`ModelFamily.engine_transforms`)."""
    renames, transforms = _engine_rules()
    for pattern, replacement in renames:
        name = pattern.sub(replacement, name)
    for pattern, replacement, transform in transforms:
        if pattern.search(name):
            return pattern.sub(replacement, name), transform
    return name, None


@cache
def vocab_names() -> frozenset[str]:
    return frozenset(name for f in FAMILIES for name in f.vocab)


@cache
def engine_aliases() -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple(dict.fromkeys(alias for f in FAMILIES for alias in f.engine_aliases))


__all__ = ["FAMILIES", "PRESETS", "ModelFamily", "by_architecture", "checkpoint_name", "classify", "engine_aliases",
           "engine_group", "engine_name", "expert_re", "of_config", "role_rules", "segment_name", "segment_order",
           "segment_rows", "split_segment", "vocab_names"]
