"""Which decoder and MTP layers each (pipeline rank, virtual stage) of a Megatron trainer builds
(pure: no Megatron, no torch).

Megatron-Core decides this from its ``TransformerConfig``:

- ``pipeline_model_parallel_layout``: an explicit list of stages, each a list of layer types
  (``embedding``, ``decoder``, ``mtp``, ``loss``), or its string form (``"Et*3|(tt|)*29,m|L"``:
  ``E`` embedding, ``t`` decoder, ``m`` MTP, ``L`` loss, ``|`` between stages, ``x*n`` and
  ``(…)*n`` repeat, commas cosmetic). Stage ``s`` of the list runs on pipeline rank
  ``s % pp``, virtual stage ``s // pp``; its layer count also sets the virtual pipeline size.
- otherwise an even split of ``num_layers`` over ``pp × vpp`` chunks, with the uneven first /
  last stage of ``num_layers_in_first/last_pipeline_stage`` or one layer's room kept for the
  embedding / loss (``account_for_embedding/loss_in_pipeline_split``); MTP layers sit on the
  last pipeline rank's last virtual stage.

:func:`parse_layout` and :func:`chunk_layers` follow Megatron-Core 0.19's
``PipelineParallelLayerLayout``, ``get_num_layers_to_build`` and
``get_transformer_layer_offset`` (the tests compare them with Megatron's own code); every
inconsistency Megatron asserts on is a ``ValueError`` here that names the key.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

LAYER_TYPES = ("embedding", "decoder", "mtp", "loss")
"""Layer types of a pipeline layout (Megatron's ``LayerType``, without the unsupported ``encoder``)."""

_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}

LAYOUT_KEY = "pipeline_model_parallel_layout"

Stages = tuple[tuple[str, ...], ...]
"""A layout as Megatron lists it: stage ``s`` on pipeline rank ``s % pp``, virtual stage ``s // pp``."""


def _unroll(text: str) -> str:
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):  # (…)*n first, then x*n, as Megatron
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text


def parse_layout(value: str | Sequence, pp: int) -> Stages:
    """Megatron's ``pipeline_model_parallel_layout`` (string or list of lists of layer-type
    names) as :data:`Stages`; ``ValueError`` naming the key where Megatron would refuse it."""
    if isinstance(value, str):
        stages = []
        for stage in _unroll(value).split("|"):
            bad = sorted({c for c in stage if c not in _CHARS})
            if bad:
                raise ValueError(f"model.{LAYOUT_KEY} {value!r}: unknown layer character(s) {bad} "
                                 f"(known: {sorted(_CHARS)})")
            stages.append(tuple(_CHARS[c] for c in stage))
    elif isinstance(value, Sequence) and all(isinstance(s, Sequence) and not isinstance(s, str) for s in value):
        stages = []
        for stage in value:
            names = []
            for item in stage:
                name = str(item).strip().lower() if isinstance(item, str) else None
                if name not in LAYER_TYPES:
                    raise ValueError(f"model.{LAYOUT_KEY}: {item!r} is not a layer type (known: {list(LAYER_TYPES)})")
                names.append(name)
            stages.append(tuple(names))
    else:
        raise ValueError(f"model.{LAYOUT_KEY}: expected a string or a list of lists of layer types, got {value!r}")
    if not stages or len(stages) % pp:
        raise ValueError(f"model.{LAYOUT_KEY}: {len(stages)} stages do not divide over "
                         f"pipeline_model_parallel_size={pp}")
    return tuple(stages)


def check_layout(stages: Stages, pp: int, *, num_layers: int, mtp_layers: int) -> None:
    """Megatron's ``validate_layer_layout``: one embedding first, one loss last, every decoder
    layer once and before the MTP layers, all MTP layers in one stage, the last virtual stage
    of its pipeline rank."""
    flat = [layer for stage in stages for layer in stage]  # layer-id order: the list's
    where = f"model.{LAYOUT_KEY}"
    if not flat or flat[0] != "embedding" or flat[-1] != "loss":
        raise ValueError(f"{where}: the first layer must be embedding and the last loss")
    if flat.count("embedding") != 1 or flat.count("loss") != 1:
        raise ValueError(f"{where}: embedding and loss must each appear exactly once")
    if flat.count("decoder") != num_layers:
        raise ValueError(f"{where} holds {flat.count('decoder')} decoder layers, the model has num_layers="
                         f"{num_layers}")
    if flat.count("mtp") != mtp_layers:
        raise ValueError(f"{where} holds {flat.count('mtp')} mtp layers, mtp_num_layers is {mtp_layers}")
    if "mtp" in flat and "decoder" in flat[flat.index("mtp"):]:
        raise ValueError(f"{where}: decoder layers must come before the MTP layers")
    vpp = len(stages) // pp
    for s, stage in enumerate(stages):
        rank, vp = s % pp, s // pp
        if "mtp" in stage and vp != vpp - 1:
            raise ValueError(f"{where}: MTP layers must be in the last virtual stage of a pipeline rank "
                             f"(stage {s}: pipeline rank {rank}, virtual stage {vp})")
        if "mtp" in stage and stage.count("mtp") != mtp_layers:
            raise ValueError(f"{where}: all {mtp_layers} MTP layers must be in one stage (stage {s} holds "
                             f"{stage.count('mtp')})")


def layout_text(stages: Stages) -> str:
    """``stages`` in Megatron's string form, runs compressed (``Et*4|t*4|…``)."""
    inverse = {name: char for char, name in _CHARS.items()}
    parts = []
    for stage in stages:
        text, i = "", 0
        while i < len(stage):
            j = i
            while j < len(stage) and stage[j] == stage[i]:
                j += 1
            text += inverse[stage[i]] + (f"*{j - i}" if j - i > 1 else "")
            i = j
        parts.append(text)
    return "|".join(parts)


def chunk_layers(*, num_layers: int, pp: int, vpp: int | None, first: int | None = None, last: int | None = None,
                 account_for_embedding: bool = False, account_for_loss: bool = False,
                 stages: Stages | None = None) -> dict[tuple[int, int], range]:
    """``{(pipeline rank, virtual stage): decoder layer ids}`` as Megatron builds them (see the
    module docstring); ``ValueError`` naming the keys where the layers do not split."""
    num_vp = vpp or 1
    if stages is not None:
        out, offset = {}, 0
        for s, stage in enumerate(stages):  # layer ids run in list order
            count = stage.count("decoder")
            out[s % pp, s // pp] = range(offset, offset + count)
            offset += count
        return out
    if pp == 1:
        return {(0, 0): range(num_layers)}
    if first is not None or last is not None:
        return _uneven(num_layers, pp, vpp, first, last)
    total = num_layers + account_for_embedding + account_for_loss
    if total % pp:
        raise ValueError(f"num_layers={num_layers}{_accounting(account_for_embedding, account_for_loss)} does not "
                         f"split over pipeline_model_parallel_size={pp}")
    per_rank = total // pp
    if per_rank % num_vp:
        raise ValueError(f"{per_rank} layers per pipeline rank{_accounting(account_for_embedding, account_for_loss)} "
                         f"do not split over virtual_pipeline_model_parallel_size={vpp}")
    per_chunk = per_rank // num_vp
    out = {}
    for rank in range(pp):
        for vp in range(num_vp):
            offset = vp * (total // num_vp) + rank * per_chunk
            count = per_chunk
            first_chunk, last_chunk = rank == 0 and vp == 0, rank == pp - 1 and vp == num_vp - 1
            if account_for_embedding and not first_chunk:
                offset -= 1
            if account_for_embedding and first_chunk:
                count -= 1
            if account_for_loss and last_chunk:
                count -= 1
            if count < 0:
                raise ValueError(f"pipeline rank {rank}, virtual stage {vp} has no room for its "
                                 f"{'embedding' if first_chunk else 'loss'} (account_for_*_in_pipeline_split)")
            out[rank, vp] = range(offset, offset + count)
    return out


def _accounting(embedding: bool, loss: bool) -> str:
    extra = [name for name, on in (("embedding", embedding), ("loss", loss)) if on]
    return f" (+1 for the {' and '.join(extra)}: account_for_*_in_pipeline_split)" if extra else ""


def _uneven(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> dict:
    """Megatron's uneven split (``num_layers_in_first/last_pipeline_stage``), with or without a
    virtual pipeline."""
    keys = "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
    num_vp = vpp or 1
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    for name, value in (("first", first), ("last", last)):
        if value is not None and value % num_vp:
            raise ValueError(f"num_layers_in_{name}_pipeline_stage={value} does not split over "
                             f"virtual_pipeline_model_parallel_size={vpp}")
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
            middle_stages and middle_layers % middle_stages):
        raise ValueError(f"num_layers={num_layers} does not split over pipeline_model_parallel_size={pp} with "
                         f"{keys} = {first} / {last}")
    per_middle = middle_layers // middle_stages if middle_stages else 0
    if per_middle % num_vp:
        raise ValueError(f"{per_middle} layers per middle pipeline rank do not split over "
                         f"virtual_pipeline_model_parallel_size={vpp}")
    out = {}
    for rank in range(pp):
        per_rank = per_middle
        if rank == 0 and first is not None:
            per_rank = first
        if rank == pp - 1 and last is not None:
            per_rank = last
        count = per_rank // num_vp
        middle_rank = rank if first is None else rank - 1
        for vp in range(num_vp):
            if vpp is None:
                offset = 0 if rank == 0 else middle_rank * per_middle + (first or 0)
            else:
                first_chunk = (first or 0) // vpp
                middle_chunk = middle_layers // vpp
                chunk_total = first_chunk + middle_chunk + (last or 0) // vpp
                offset = vp * chunk_total if rank == 0 else (
                    vp * chunk_total + first_chunk + middle_rank * (middle_chunk // middle_stages))
            out[rank, vp] = range(offset, offset + count)
    return out


def mtp_stages(*, pp: int, vpp: int | None, mtp_layers: int,
               stages: Stages | None = None) -> dict[tuple[int, int], int]:
    """``{(pipeline rank, virtual stage): MTP layers}`` where MTP layers are built: the layout's
    ``mtp`` entries, else all of them on the last pipeline rank's last virtual stage."""
    if not mtp_layers:
        return {}
    if stages is not None:
        return {(s % pp, s // pp): stage.count("mtp") for s, stage in enumerate(stages) if "mtp" in stage}
    return {(pp - 1, (vpp or 1) - 1): mtp_layers}
