"""Validation shared by every form of the refit plan (pure): dtypes, exact tiling of each
parameter by the train pieces, one index of the pieces by name and box, and gen pieces
against the trainer's tensors."""

from __future__ import annotations

import contextlib
import gc
import math
import re
from collections import defaultdict

from megatron_refit.errors import PlanError
from megatron_refit.plan.spec import box_numel
from megatron_refit.plan.spec import Box, ShardSpec, intersect

ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""Byte alignment of items in a bucket, so any slice can be viewed as any dtype above."""


def check_dtype(name: str, dtype: str) -> None:
    if dtype not in ITEMSIZE:
        raise PlanError(f"{name}: unsupported dtype {dtype!r}; expected one of {sorted(ITEMSIZE)}")


def check_tiling(name: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Distinct train boxes must be pairwise disjoint and cover ``shape`` exactly."""
    covered = sum(box_numel(box) for box in boxes)
    if covered != math.prod(shape):
        raise PlanError(
            f"{name}: train pieces cover {covered} elements, the global shape {shape} has {math.prod(shape)}"
        )
    if not shape or len(boxes) == 1:  # one box inside the shape that covers it: the full box
        return
    # Sweep along the dim with the most distinct starts; only boxes open at a start can overlap.
    dim = max(range(len(shape)), key=lambda d: len({box[d][0] for box in boxes}))
    active: list[Box] = []
    for box in sorted(boxes, key=lambda b: b[dim][0]):
        active = [a for a in active if a[dim][1] > box[dim][0]]
        for other in active:
            if intersect(box, other) is not None:
                raise PlanError(f"{name}: train pieces {other} and {box} overlap")
        active.append(box)


def index_specs(
    side: str, specs: dict[int, list[ShardSpec]]
) -> tuple[dict[str, dict[Box, list[int]]], dict[str, ShardSpec]]:
    """``name -> box -> ranks holding it`` and one spec per name; rejects duplicates and inconsistent metadata."""
    if sorted(specs) != list(range(len(specs))):
        raise PlanError(f"{side} ranks must be 0..{len(specs) - 1}, got {sorted(specs)}")
    index: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    meta: dict[str, ShardSpec] = {}
    for rank in range(len(specs)):
        seen: set[str] = set()
        for spec in specs[rank]:
            if spec.name in seen:
                raise PlanError(f"{spec.name}: listed twice on {side} rank {rank}")
            seen.add(spec.name)
            first = meta.setdefault(spec.name, spec)
            if first is spec:
                check_dtype(spec.name, spec.dtype)
            elif (first.global_shape, first.dtype) != (spec.global_shape, spec.dtype):
                raise PlanError(
                    f"{spec.name}: {side} pieces disagree: global shape {first.global_shape} {first.dtype} "
                    f"vs {spec.global_shape} {spec.dtype} on {side} rank {rank}"
                )
            index[spec.name][spec.box].append(rank)
    return index, meta


def check_target(name: str, gen_shape: tuple[int, ...], gen_dtype: str, shape: tuple[int, ...], dtype: str) -> None:
    """A gen piece must agree with the trainer's tensor in global shape and dtype."""
    if gen_shape != shape:
        raise PlanError(f"{name}: global shape {gen_shape} on gen ranks, {shape} on train ranks")
    if gen_dtype != dtype:
        hint = ""
        if gen_dtype.startswith("float8") and not dtype.startswith("float8"):
            hint = (": the engine loads block-FP8 weights; turn on trainer-side FP8 quantization "
                    "(trainer_quantize_fp8) or serve the engine in the training dtype")
        raise PlanError(f"{name}: dtype {gen_dtype} on gen ranks, {dtype} on train ranks{hint}")


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection meanwhile: building a plan allocates hundreds of
    thousands of long-lived acyclic tuples, and each collection would rescan them all."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_PROJECTION = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")
"""An MTP layer's own projection: the decoder layers that have one are MTP layers."""


def mtp_names(names) -> list[str]:
    """Those of ``names`` in an MTP layer (a decoder layer one of ``names`` gives an ``eh_proj``)."""
    layers = {m.group(1) for m in map(_MTP_PROJECTION.match, names) if m}
    return [n for n in names if (m := _LAYER.match(n)) and m.group(1) in layers]


def unproduced_hint(name: str, train_names) -> str:
    """What to add to "``name`` is not produced by the trainer" where the engine holds a decoder
    layer past the trainer's last one (``train_names``: every name the trainer produces): an MTP
    layer, the speculative draft of an engine whose trainer has none."""
    hit = _LAYER.match(name)
    last = max((int(m.group(1)) for m in map(_LAYER.match, train_names) if m), default=None)
    if hit is None or last is None or int(hit.group(1)) <= last:
        return ""
    return (f": it is in model.layers.{hit.group(1)}, past the trainer's last decoder layer "
            f"(model.layers.{last}), so the engine holds an MTP layer (its speculative draft: vLLM's deepseek_mtp, "
            f"SGLang's NextN) that the trainer does not train, and the draft would stay the first version's: "
            f"build the trainer with its MTP layers (Bridge's mtp_num_layers) or start the engine without the draft")


def draft_hint(refused: list[str]) -> str:
    """What to add where parameters no engine rank holds are the trainer's MTP layers (the layers
    with an ``eh_proj``), which ``refit.gen_draft`` requires an engine's speculative draft to hold."""
    mtp = mtp_names(refused)
    if not mtp:
        return ""
    return (f". {len(mtp)} of them are the trainer's MTP layers (the decoder layers with an eh_proj), "
            f"which refit.gen_draft requires the engine's speculative draft to hold. Start the engine with its draft "
            f"(vLLM --speculative-config deepseek_mtp, SGLang --speculative-algorithm EAGLE with its NextN draft, the "
            f"HF engine's draft), or set gen_draft: false, which skips them by name")
