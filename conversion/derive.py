"""Every train rank's ShardSpecs from a few representative ranks (pure).

Meta enumeration costs about a second per rank; production MoE layouts have 128–256
distinct ranks. Their structure is regular in Megatron's rank order:

- dense (non-expert) pieces depend only on the (PP stage, TP rank): CP and DP ranks hold
  the same (each rank's model chunks: every virtual stage of its PP stage);
- routed-expert pieces depend on the (PP stage, ETP rank, EP rank), and EP rank ``e``
  holds the same pieces as EP rank 0 with the experts renumbered by
  ``e * num_experts / ep`` (per-expert names ``…experts.<i>.…``, or dim 0 of a grouped
  ``[num_experts, …]`` tensor).

So one rank per (PP stage, inner index < max(tp, etp)) is enough: inner index ``i`` has TP
rank ``i`` for ``i < tp`` and (ETP rank ``i``, EP rank 0) for ``i < etp``. The tests check
the derivation against enumerating every rank on small layouts.
"""

from __future__ import annotations

import gzip
import json
import re

from megatron_refit.plan.layout import TrainLayout
from megatron_refit.plan.spec import ShardSpec

_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")

CACHE_FORMAT = 1
"""Bump when the cache file layout changes."""


def representative_ranks(layout: TrainLayout) -> list[int]:
    """The ranks whose ShardSpecs determine every rank's (see the module docstring)."""
    inner = layout.tp * layout.cp * layout.dp
    return [stage * inner + i for stage in range(layout.pp) for i in range(max(layout.tp, layout.etp))]


def _renumbered(spec: ShardSpec, offset: int, num_experts: int) -> ShardSpec:
    if offset == 0:
        return spec
    match = _EXPERT_ID.search(spec.name)
    if match is not None:
        expert = int(match.group(1))
        name = f"{spec.name[: match.start(1)]}{expert + offset}{spec.name[match.end(1):]}"
        return ShardSpec.trusted(name, spec.global_shape, spec.dtype, spec.box, pp_stage=spec.pp_stage,
                                 is_expert=True)  # the box of a valid spec, unchanged
    if spec.global_shape and spec.global_shape[0] == num_experts:
        (start, stop), *rest = spec.box
        return ShardSpec(name=spec.name, global_shape=spec.global_shape, dtype=spec.dtype,
                         box=((start + offset, stop + offset), *rest), pp_stage=spec.pp_stage, is_expert=True)
    raise ValueError(f"{spec.name}: expert piece with no expert index in its name or its dim 0")


def derive_all_ranks(
    layout: TrainLayout, representative: dict[int, list[ShardSpec]], num_experts: int
) -> dict[int, list[ShardSpec]]:
    """ShardSpecs of every rank of ``layout`` from those of :func:`representative_ranks`.

    Ranks with the same pieces share one list (as :func:`conversion.testing.meta.all_rank_shard_specs`).
    """
    missing = sorted(set(representative_ranks(layout)) - set(representative))
    if missing:
        raise ValueError(f"representative ranks {missing} of layout {layout.describe()} are missing")
    if num_experts % layout.ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={layout.ep}")
    per_ep = num_experts // layout.ep
    inner = layout.tp * layout.cp * layout.dp
    dense: dict[tuple[int, int], list[ShardSpec]] = {}
    experts: dict[tuple[int, int, int], list[ShardSpec]] = {}
    merged: dict[tuple[int, int, int, int], list[ShardSpec]] = {}
    out = {}
    for rank in range(layout.world_size):
        c = layout.coordinates(rank)
        key = (c["pp"], c["tp"], c["etp"], c["ep"])
        if key not in merged:
            base = c["pp"] * inner
            if (c["pp"], c["tp"]) not in dense:
                dense[c["pp"], c["tp"]] = [s for s in representative[base + c["tp"]] if not s.is_expert]
            ekey = (c["pp"], c["etp"], c["ep"])
            if ekey not in experts:
                experts[ekey] = [_renumbered(s, c["ep"] * per_ep, num_experts)
                                 for s in representative[base + c["etp"]] if s.is_expert]
            merged[key] = dense[c["pp"], c["tp"]] + experts[ekey]
        out[rank] = merged[key]
    return out


def save_specs(path: str, key: str, specs: dict[int, list[ShardSpec]]) -> None:
    """Write ``{rank: specs}`` as gzipped JSON tagged with ``key``."""
    rows = {
        str(rank): [[s.name, list(s.global_shape), s.dtype, [list(b) for b in s.box], s.pp_stage, s.is_expert]
                    for s in rank_specs]
        for rank, rank_specs in specs.items()
    }
    text = json.dumps({"format": CACHE_FORMAT, "key": key, "ranks": rows}, separators=(",", ":"))
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as z:  # same specs, same bytes
        z.write(text.encode())


def load_specs(path: str, key: str | None = None) -> dict[int, list[ShardSpec]]:
    """Read :func:`save_specs` output; ``ValueError`` if its key differs from ``key``."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    if data.get("format") != CACHE_FORMAT or (key is not None and data.get("key") != key):
        raise ValueError(f"{path}: cache key {data.get('key')!r} (format {data.get('format')}) does not match {key!r}")
    shared: dict[tuple, tuple] = {}  # one object per distinct shape and box: less memory, faster plans
    out = {}
    for rank, rows in data["ranks"].items():
        specs = []
        for name, shape, dtype, box, pp_stage, is_expert in rows:
            shape = tuple(shape)
            box = tuple(map(tuple, box))
            specs.append(ShardSpec(name=name, global_shape=shared.setdefault(shape, shape), dtype=dtype,
                                   box=shared.setdefault(box, box), pp_stage=pp_stage, is_expert=is_expert))
        out[int(rank)] = specs
    return out
